//! The algorithms through `MemoryStore` on a manual clock: random traces of time and cost
//! never panic or overflow, every decision agrees with an exact reference model (u128
//! arithmetic, one per algorithm; the three buckets share one), `remaining`, `retry_after` and
//! `reset_after` are exact by that model, and the bounds each algorithm promises hold.

use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::{Algorithm, MemoryStore, Policy, Rate, StoreError};

use crate::input::Input;

pub(crate) fn check(data: &[u8]) {
    let mut input = Input::new(data);
    let algorithm = *input.pick(&[
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::Gcra,
    ]);
    let limit = 1 + input.edgy_u64() % 1_000_000;
    let period = Duration::from_nanos(input.edgy_u64().max(1));
    let per = input.edgy_u64() % 1000 + 1;
    let policy = match algorithm {
        Algorithm::FixedWindow => Policy::fixed_window(limit, period),
        Algorithm::SlidingLog => Policy::sliding_log(limit, period),
        Algorithm::SlidingWindow => Policy::sliding_window(limit, period),
        Algorithm::TokenBucket => Policy::token_bucket(Rate::new(per, period), limit),
        Algorithm::LeakyBucket => Policy::leaky_bucket(Rate::new(per, period), limit),
        _ => Policy::gcra(Rate::new(per, period), limit),
    };
    let Ok(policy) = policy else { return };
    let interval = u64::try_from(policy.interval().as_nanos()).expect("validated");
    let backwards = input.u8() % 16 == 0;
    let clock = ManualClock::new();
    clock.set(Duration::from_nanos(match input.u8() % 4 {
        0 => 0,
        1 => 1_767_225_600_000_000_000,
        _ => input.edgy_u64(),
    }));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let mut model = Model::new(algorithm, limit, interval);
    let mut admitted: Vec<(u64, u64)> = Vec::new();
    let mut now = clock_now(&clock);
    for _ in 0..64 {
        if input.is_empty() {
            break;
        }
        let step = match input.u8() % 4 {
            0 => 0,
            1 => u64::from(input.u8()),
            2 => interval.saturating_mul(u64::from(input.u8() % 4)),
            _ => input.edgy_u64(),
        };
        if backwards && input.u8() % 4 == 0 {
            clock.set(Duration::from_nanos(now.saturating_sub(step)));
        } else {
            clock.advance(Duration::from_nanos(step));
        }
        now = clock_now(&clock);
        // Within two periods of the end of the u64 time line (its last quarter: past 2440 in Unix
        // nanoseconds) the algorithms' times saturate and they are not exact: not compared
        // (see the regressions named `*-at-the-end-of-time`, which must still not panic).
        let end_of_time = now.saturating_add(interval.saturating_mul(2)) > u64::MAX / 4 * 3;
        let cost = match input.u8() % 4 {
            0 => 0,
            1 => 1,
            2 => input.edgy_u64() % (limit + 1),
            _ => input.edgy_u64(),
        };
        let decision = match store.check_now("k", &policy, cost) {
            Err(StoreError::CostExceedsLimit { .. }) => {
                assert!(cost > limit, "cost {cost} within the limit {limit} refused");
                continue;
            }
            Err(e) => panic!("{e}"),
            Ok(d) => d,
        };
        assert!(cost <= limit, "cost {cost} above the limit {limit} decided");
        assert!(
            store.len() <= 1,
            "one key, one policy: {} entries",
            store.len()
        );
        assert_eq!(decision.limit(), limit);
        if backwards || end_of_time {
            // A clock that jumps back is tolerated: nothing to compare with but the bounds
            // of the decision itself.
            assert!(decision.remaining() <= limit);
            continue;
        }
        let want = model.admits(now, cost);
        assert_eq!(
            decision.allowed(),
            want,
            "{algorithm:?} at {now} cost {cost}: {decision:?}"
        );
        if want && cost > 0 {
            model.commit(now, cost);
            admitted.push((now, cost));
        }
        let remaining = model.remaining(now);
        assert_eq!(
            decision.remaining(),
            remaining,
            "{algorithm:?} at {now}: {decision:?}"
        );
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).expect("fits");
        let reset = nanos(decision.reset_after());
        if let Some(at) = now.checked_add(reset) {
            assert_eq!(
                model.remaining(at),
                limit,
                "{algorithm:?} not reset at {at}: {decision:?}"
            );
            if reset > 0 && algorithm != Algorithm::SlidingWindow {
                assert!(
                    model.remaining(at - 1) < limit,
                    "reset after {reset} ns is late"
                );
            }
        }
        match decision.retry_after() {
            None => assert!(decision.allowed()),
            Some(retry) => {
                assert!(!decision.allowed());
                let retry = nanos(retry);
                assert!(retry > 0);
                if let Some(at) = now.checked_add(retry) {
                    assert!(
                        model.admits(at, cost),
                        "{algorithm:?}: not admitted after {retry} ns"
                    );
                    assert!(
                        !model.admits(at - 1, cost),
                        "{algorithm:?}: {retry} ns is too long"
                    );
                }
            }
        }
    }
    bounds(algorithm, limit, interval, &admitted);
}

fn clock_now(clock: &ManualClock) -> u64 {
    u64::try_from(clock.elapsed().as_nanos()).expect("a u64 clock")
}

/// The bounds each algorithm promises, from the admissions alone.
fn bounds(algorithm: Algorithm, limit: u64, period: u64, admitted: &[(u64, u64)]) {
    let sum = |it: &mut dyn Iterator<Item = &(u64, u64)>| -> u128 {
        it.map(|&(_, c)| u128::from(c)).sum()
    };
    match algorithm {
        Algorithm::FixedWindow | Algorithm::SlidingWindow => {
            for &(t, _) in admitted {
                let k = t / period;
                let total = sum(&mut admitted.iter().filter(|(u, _)| u / period == k));
                assert!(total <= u128::from(limit), "{total} in window {k}");
            }
        }
        Algorithm::SlidingLog => {
            for &(t, _) in admitted {
                let total = sum(&mut admitted.iter().filter(|(u, _)| {
                    *u <= t && u128::from(*u) + u128::from(period) > u128::from(t)
                }));
                assert!(
                    total <= u128::from(limit),
                    "{total} in the window ending {t}"
                );
            }
        }
        _ => {
            // In any span [t_i, t_j]: cost * interval <= burst * interval + span.
            for i in 0..admitted.len() {
                let mut total = 0u128;
                for j in i..admitted.len() {
                    total += u128::from(admitted[j].1);
                    let span = u128::from(admitted[j].0 - admitted[i].0);
                    assert!(
                        total * u128::from(period) <= u128::from(limit) * u128::from(period) + span,
                        "{total} admitted in {span} ns"
                    );
                }
            }
        }
    }
}

/// The reference: each algorithm's rule, stated directly in u128.
enum Model {
    Fixed {
        limit: u128,
        window: u128,
        k: u128,
        count: u128,
    },
    Log {
        limit: u128,
        window: u128,
        entries: Vec<(u128, u128)>,
    },
    Sliding {
        limit: u128,
        window: u128,
        k: u128,
        prev: u128,
        cur: u128,
    },
    /// Token bucket, leaky bucket and GCRA: credit in ns, full at `limit * interval`.
    Bucket {
        limit: u128,
        interval: u128,
        credit: u128,
        last: u128,
    },
}

impl Model {
    fn new(algorithm: Algorithm, limit: u64, period: u64) -> Self {
        let (limit, period) = (u128::from(limit), u128::from(period));
        match algorithm {
            Algorithm::FixedWindow => Model::Fixed {
                limit,
                window: period,
                k: 0,
                count: 0,
            },
            Algorithm::SlidingLog => Model::Log {
                limit,
                window: period,
                entries: Vec::new(),
            },
            Algorithm::SlidingWindow => Model::Sliding {
                limit,
                window: period,
                k: 0,
                prev: 0,
                cur: 0,
            },
            _ => Model::Bucket {
                limit,
                interval: period,
                credit: limit * period,
                last: 0,
            },
        }
    }

    /// The largest cost admitted at `now`.
    fn remaining(&self, now: u64) -> u64 {
        let (mut lo, mut hi) = (0u64, self.limit());
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.admits(now, mid) {
                lo = mid
            } else {
                hi = mid - 1
            }
        }
        lo
    }

    fn limit(&self) -> u64 {
        let (Model::Fixed { limit, .. }
        | Model::Log { limit, .. }
        | Model::Sliding { limit, .. }
        | Model::Bucket { limit, .. }) = self;
        u64::try_from(*limit).unwrap()
    }

    fn admits(&self, now: u64, cost: u64) -> bool {
        let (now, cost) = (u128::from(now), u128::from(cost));
        match *self {
            Model::Fixed {
                limit,
                window,
                k,
                count,
            } => {
                let used = if now / window == k { count } else { 0 };
                used + cost <= limit
            }
            Model::Log {
                limit,
                window,
                ref entries,
            } => {
                let used: u128 = entries
                    .iter()
                    .filter(|(t, _)| t + window > now)
                    .map(|e| e.1)
                    .sum();
                used + cost <= limit
            }
            Model::Sliding {
                limit,
                window,
                k,
                prev,
                cur,
            } => {
                let here = now / window;
                let (prev, cur) = match here {
                    _ if here == k => (prev, cur),
                    _ if here == k + 1 => (cur, 0),
                    _ => (0, 0),
                };
                let elapsed = now - here * window;
                prev * (window - elapsed) + cur * window + cost * window < (limit + 1) * window
            }
            Model::Bucket {
                limit,
                interval,
                credit,
                last,
            } => {
                let credit = (credit + (now - last)).min(limit * interval);
                credit >= cost * interval
            }
        }
    }

    fn commit(&mut self, now: u64, cost: u64) {
        let (now, cost) = (u128::from(now), u128::from(cost));
        match self {
            Model::Fixed {
                window, k, count, ..
            } => {
                if now / *window != *k {
                    *k = now / *window;
                    *count = 0;
                }
                *count += cost;
            }
            Model::Log { entries, .. } => entries.push((now, cost)),
            Model::Sliding {
                window,
                k,
                prev,
                cur,
                ..
            } => {
                let here = now / *window;
                if here == *k + 1 {
                    *prev = *cur;
                    *cur = 0;
                } else if here != *k {
                    *prev = 0;
                    *cur = 0;
                }
                *k = here;
                *cur += cost;
            }
            Model::Bucket {
                limit,
                interval,
                credit,
                last,
            } => {
                *credit = (*credit + (now - *last)).min(*limit * *interval) - cost * *interval;
                *last = now;
            }
        }
    }
}
