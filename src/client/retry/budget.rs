//! The retry budget: retries at most a share of the requests over a sliding period.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::policy::RetryConfigError;
use crate::clock::{Clock, TokioClock};

/// The period is kept as this many slots, each a tenth of it.
const SLOTS: usize = 10;

/// What one retry costs, in the budget's units; a request deposits its percentage.
const RETRY_COST: i64 = 100;

/// A retry budget: over any sliding `window`, at most `percent` % of the requests are
/// retried, plus a floor of `min_per_second` retries per second for clients that send little
/// (over a window, `min_per_second` times its seconds, rounded up to whole retries: at least
/// one per window, so a window under a second still has its floor). The rounding gives a
/// short window more than its rate: a 100 ms window with a floor of 1 per second allows one
/// retry per 100 ms, ten a second, to a client that sends little. Keep the window at a second
/// or more where the floor's rate matters.
///
/// Every request deposits into it; every retry withdraws, and a retry the budget cannot pay
/// is not made (the caller gets the last answer). With 10 % a failing backend sees at most
/// about 1.1 times the calls it would see without retries, however many attempts each request
/// was allowed: the budget, not the attempt count, bounds the load when everything fails.
/// The budget counts the requests of every backend the policy serves: when one backend of
/// many fails, the healthy ones' requests pay for its retries, and that one backend may see
/// up to the attempt count times its calls. Give each backend its own policy (or budget)
/// where that matters.
///
/// This is Finagle's budget, as tower's `TpsBudget` also is; tollgate has its own because it
/// counts in integers (a percentage, not an `f32` whose reciprocal is truncated) and validates
/// its settings with an error instead of an assertion. It keeps its own time, on tokio's
/// clock (which follows tokio's paused time), from the moment it was made.
///
/// Clones share one budget: give the same budget to several policies to bound their retries
/// together, whenever each policy was built.
///
/// ```
/// use std::time::Duration;
/// use tollgate::client::RetryBudget;
///
/// // 20 % of requests, and at least 5 retries per second, over 10 seconds.
/// let budget = RetryBudget::new(20, 5, Duration::from_secs(10))?;
/// assert!(RetryBudget::new(20, 5, Duration::ZERO).is_err());
/// # Ok::<(), tollgate::client::RetryConfigError>(())
/// ```
#[derive(Clone)]
pub struct RetryBudget {
    shared: Arc<Shared>,
}

struct Shared {
    /// Units a request deposits (its percentage).
    deposit: i64,
    /// Units always available: `min_per_second` retries per second of the window.
    reserve: i64,
    /// Nanoseconds per slot.
    slot: u64,
    window: Duration,
    min_per_second: u32,
    /// The budget's own time line: policies built at different times share it.
    clock: TokioClock,
    state: Mutex<Slots>,
}

/// The net deposits of each slot of the window, the newest at `current`.
#[derive(Debug)]
struct Slots {
    units: [i64; SLOTS],
    current: usize,
    /// When the current slot began (ns on the budget's clock).
    start: u64,
}

impl RetryBudget {
    /// Retries at most `percent` % of the requests (0 to 1000) over a sliding `window` (100 ms
    /// to one hour), plus `min_per_second` retries per second whatever the traffic.
    pub fn new(
        percent: u32,
        min_per_second: u32,
        window: Duration,
    ) -> Result<Self, RetryConfigError> {
        if percent > 1000 {
            return Err(RetryConfigError::BudgetPercent(percent));
        }
        if window < Duration::from_millis(100) || window > Duration::from_secs(3600) {
            return Err(RetryConfigError::BudgetWindow(window));
        }
        let window_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
        // min_per_second retries per second of the window, rounded up to whole retries: a
        // window under a second still holds one, or its floor would be none at all.
        let floor = i64::from(min_per_second)
            .saturating_mul(window_ms)
            .saturating_add(999)
            / 1000;
        let reserve = floor.saturating_mul(RETRY_COST);
        Ok(Self {
            shared: Arc::new(Shared {
                deposit: i64::from(percent),
                reserve,
                slot: u64::try_from(window.as_nanos()).unwrap_or(u64::MAX) / SLOTS as u64,
                window,
                min_per_second,
                clock: TokioClock::new(),
                state: Mutex::new(Slots {
                    units: [0; SLOTS],
                    current: 0,
                    start: 0,
                }),
            }),
        })
    }

    /// Records a request made now.
    pub(crate) fn deposit(&self) {
        self.deposit_at(self.shared.clock.now());
    }

    /// Pays for one retry now, if the budget allows it.
    pub(crate) fn withdraw(&self) -> bool {
        self.withdraw_at(self.shared.clock.now())
    }

    /// Records a request made at `now` (nanoseconds on the budget's clock).
    fn deposit_at(&self, now: u64) {
        let mut slots = self.shared.state.lock();
        self.shared.roll(&mut slots, now);
        let current = slots.current;
        slots.units[current] = slots.units[current].saturating_add(self.shared.deposit);
    }

    /// Pays for one retry at `now`, if the budget allows it.
    fn withdraw_at(&self, now: u64) -> bool {
        let mut slots = self.shared.state.lock();
        self.shared.roll(&mut slots, now);
        let balance = slots
            .units
            .iter()
            .fold(self.shared.reserve, |sum, u| sum.saturating_add(*u));
        if balance < RETRY_COST {
            return false;
        }
        let current = slots.current;
        slots.units[current] -= RETRY_COST;
        true
    }
}

impl Shared {
    /// Moves the window on to `now`: every slot entered is emptied (it held the oldest tenth).
    fn roll(&self, slots: &mut Slots, now: u64) {
        let passed = now.saturating_sub(slots.start) / self.slot;
        if passed == 0 {
            return;
        }
        for _ in 0..passed.min(SLOTS as u64) {
            slots.current = (slots.current + 1) % SLOTS;
            slots.units[slots.current] = 0;
        }
        slots.start = slots.start.saturating_add(passed.saturating_mul(self.slot));
    }
}

impl Default for RetryBudget {
    /// 10 % of the requests, and at least one retry per second, over 10 seconds.
    fn default() -> Self {
        match Self::new(10, 1, Duration::from_secs(10)) {
            Ok(budget) => budget,
            Err(_) => unreachable!("the default budget is valid"),
        }
    }
}

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudget")
            .field("percent", &self.shared.deposit)
            .field("min_per_second", &self.shared.min_per_second)
            .field("window", &self.shared.window)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn retries(budget: &RetryBudget, now: u64) -> usize {
        // Bounded, so that a budget that never refuses fails the test instead of hanging it.
        std::iter::from_fn(|| budget.withdraw_at(now).then_some(()))
            .take(10_000)
            .count()
    }

    #[test]
    fn a_tenth_of_the_requests() {
        let budget = RetryBudget::new(10, 0, Duration::from_secs(10)).unwrap();
        assert!(!budget.withdraw_at(0), "nothing deposited, no floor");
        for _ in 0..95 {
            budget.deposit_at(0);
        }
        assert_eq!(retries(&budget, 0), 9);
        budget.deposit_at(0);
        budget.deposit_at(0);
        budget.deposit_at(0);
        budget.deposit_at(0);
        budget.deposit_at(0);
        assert_eq!(retries(&budget, 5 * MS), 1);
    }

    #[test]
    fn deposits_expire_after_the_window() {
        let budget = RetryBudget::new(100, 0, Duration::from_secs(1)).unwrap();
        budget.deposit_at(0);
        budget.deposit_at(950 * MS);
        // At 1 s the first deposit's slot is reused: only the second one is left.
        assert_eq!(retries(&budget, 1000 * MS), 1);
        budget.deposit_at(1000 * MS);
        // Long after, everything has expired (and so has the withdrawal).
        assert_eq!(retries(&budget, 60_000 * MS), 0);
        budget.deposit_at(60_000 * MS);
        budget.deposit_at(60_099 * MS);
        assert_eq!(retries(&budget, 60_099 * MS), 2);
        // A slot later: those deposits are spent, and nothing new came in.
        assert_eq!(retries(&budget, 60_100 * MS), 0);
    }

    #[test]
    fn the_floor_refills_as_retries_leave_the_window() {
        let budget = RetryBudget::new(10, 2, Duration::from_secs(5)).unwrap();
        assert_eq!(retries(&budget, 0), 10, "2 per second over 5 seconds");
        assert_eq!(retries(&budget, 4_999 * MS), 0);
        assert_eq!(retries(&budget, 5_000 * MS), 10);
        // A withdrawal in a later slot leaves the window later.
        assert_eq!(retries(&budget, 7_000 * MS), 0);
    }

    #[test]
    fn more_than_one_retry_per_request() {
        let budget = RetryBudget::new(250, 0, Duration::from_secs(1)).unwrap();
        budget.deposit_at(0);
        budget.deposit_at(0);
        assert_eq!(retries(&budget, 0), 5);
    }

    /// Issue 24, 6: `min_per_second` times a window under a second rounded below one
    /// retry's cost, so such a window had no floor at all.
    #[test]
    fn a_window_under_a_second_keeps_its_floor() {
        let budget = RetryBudget::new(0, 1, Duration::from_millis(500)).unwrap();
        assert_eq!(retries(&budget, 0), 1);
        assert_eq!(retries(&budget, 499 * MS), 0);
        assert_eq!(
            retries(&budget, 500 * MS),
            1,
            "one per 500 ms: at least 1 a second"
        );
        let budget = RetryBudget::new(0, 3, Duration::from_millis(100)).unwrap();
        assert_eq!(retries(&budget, 0), 1);
        // Whole retries, rounded up: 1 a second over 1.5 s is 2, not 1.5.
        let budget = RetryBudget::new(0, 1, Duration::from_millis(1500)).unwrap();
        assert_eq!(retries(&budget, 0), 2);
        let budget = RetryBudget::new(0, 0, Duration::from_millis(500)).unwrap();
        assert_eq!(retries(&budget, 0), 0, "no floor asked, none given");
    }

    /// Issue 24, 2: the budget keeps its own time. Policies built an hour apart share it: each
    /// read its own clock (zero when it was built), so the later one saw no slot expire.
    #[tokio::test(start_paused = true)]
    async fn the_budget_keeps_its_own_time() {
        let budget = RetryBudget::new(0, 1, Duration::from_secs(1)).unwrap();
        let clone = budget.clone();
        assert!(budget.withdraw());
        assert!(!clone.withdraw());
        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(!clone.withdraw());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(clone.withdraw());
        budget.deposit();
    }

    #[test]
    fn bad_settings_are_errors() {
        assert_eq!(
            RetryBudget::new(1001, 0, Duration::from_secs(1)).unwrap_err(),
            RetryConfigError::BudgetPercent(1001)
        );
        for window in [Duration::from_millis(99), Duration::from_secs(3601)] {
            assert_eq!(
                RetryBudget::new(10, 0, window).unwrap_err(),
                RetryConfigError::BudgetWindow(window)
            );
        }
        assert!(RetryBudget::new(1000, u32::MAX, Duration::from_secs(3600)).is_ok());
        assert!(RetryBudget::new(0, 0, Duration::from_millis(100)).is_ok());
        let shown = format!("{:?}", RetryBudget::default());
        assert!(shown.contains("percent: 10") && shown.contains("min_per_second: 1"));
    }
}
