//! What a table keeps for each algorithm ([`Kept`]): its state, and how to decide, commit and
//! expire it.

use hashbrown::HashTable;

use super::evict::units;
use super::shard::{Table, Tables};
use crate::algorithm::{FixedWindow, Gcra, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket};
use crate::{Decision, Policy};

/// Runs `$body` with `$kept` naming the type that the table of `$algorithm` keeps.
macro_rules! with_kept {
    ($algorithm:expr, $kept:ident => $body:expr) => {
        match $algorithm {
            Algorithm::Gcra => {
                type $kept = Gcra;
                $body
            }
            Algorithm::TokenBucket => {
                type $kept = Timed<TokenBucket>;
                $body
            }
            Algorithm::LeakyBucket => {
                type $kept = LeakyBucket;
                $body
            }
            Algorithm::FixedWindow => {
                type $kept = Timed<FixedWindow>;
                $body
            }
            Algorithm::SlidingWindow => {
                type $kept = Timed<SlidingWindow>;
                $body
            }
            Algorithm::SlidingLog => {
                type $kept = Timed<SlidingLog>;
                $body
            }
        }
    };
}

/// What a table keeps for one algorithm: its state, and how to decide, commit and expire it.
pub(super) trait Kept: Sized {
    /// The state of a key never seen under `policy`.
    fn fresh(policy: &Policy) -> Self;

    /// Decides a request without changing anything; [`Kept::apply`] commits what it returns.
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update);

    /// Writes what [`Kept::decide`] returned for an admitted request.
    fn apply(&mut self, policy: &Policy, update: Update);

    /// When the state will be indistinguishable from a fresh one: forgetting it from then on
    /// changes no decision. [`Kept::apply`] never makes it earlier; [`Soonest`] relies on it.
    fn expires(&self) -> u64;

    /// The units of its policy (whose period is `period`) that the state holds consumed at
    /// `now`: what forgetting it would admit at once beyond what it admits, `limit -
    /// remaining` of a check of cost 0 at `now`.
    fn consumed(&self, period: u64, now: u64) -> u64;

    /// An empty table of this state.
    fn empty() -> Tables;

    /// The table in `tables`, if it keeps this state.
    fn table(tables: &Tables) -> Option<&Table<Self>>;

    /// [`Kept::table`], to change.
    fn table_mut(tables: &mut Tables) -> Option<&mut Table<Self>>;
}

/// What to write if a decision is committed.
#[derive(Clone, Copy, Debug)]
pub(super) enum Update {
    Gcra(Gcra),
    TokenBucket(TokenBucket),
    LeakyBucket(LeakyBucket),
    FixedWindow(FixedWindow),
    SlidingWindow(SlidingWindow),
    SlidingLog { now: u64, cost: u64 },
}

/// The methods of [`Kept`] (or `Algo`) that name the variant of [`Tables`] holding a type's
/// slots, of type `$state`.
macro_rules! kept_tables {
    ($variant:ident) => {
        kept_tables!($variant, Self);
    };
    ($variant:ident, $state:ty) => {
        fn empty() -> Tables {
            Tables::$variant(HashTable::new())
        }

        #[inline]
        fn table(tables: &Tables) -> Option<&Table<$state>> {
            match tables {
                Tables::$variant(table) => Some(table),
                _ => None,
            }
        }

        #[inline]
        fn table_mut(tables: &mut Tables) -> Option<&mut Table<$state>> {
            match tables {
                Tables::$variant(table) => Some(table),
                _ => None,
            }
        }
    };
}

// GCRA's state is its own expiry: the theoretical arrival time.
impl Kept for Gcra {
    fn fresh(_: &Policy) -> Self {
        Gcra::default()
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let (next, d) = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::Gcra(next))
    }

    #[inline]
    fn apply(&mut self, _: &Policy, update: Update) {
        if let Update::Gcra(next) = update {
            *self = next;
        }
    }

    #[inline]
    fn expires(&self) -> u64 {
        self.recovered_at()
    }

    fn consumed(&self, period: u64, now: u64) -> u64 {
        units(self.tat.saturating_sub(now), period)
    }

    kept_tables!(Gcra);
}

// So is the leaky bucket's: the time its level drains to zero.
impl Kept for LeakyBucket {
    fn fresh(_: &Policy) -> Self {
        LeakyBucket::default()
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let (next, d) = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::LeakyBucket(next))
    }

    #[inline]
    fn apply(&mut self, _: &Policy, update: Update) {
        if let Update::LeakyBucket(next) = update {
            *self = next;
        }
    }

    #[inline]
    fn expires(&self) -> u64 {
        self.recovered_at()
    }

    fn consumed(&self, period: u64, now: u64) -> u64 {
        // The level left at `now` (time never runs backwards inside a state).
        units(
            self.recovered_at().saturating_sub(now.max(self.last)),
            period,
        )
    }

    kept_tables!(LeakyBucket);
}

/// A state whose expiry depends on the policy, kept beside it (computed on each commit).
pub(super) struct Timed<S> {
    expires: u64,
    state: S,
}

/// The pure algorithm behind a [`Timed`] state.
pub(super) trait Algo: Sized {
    fn fresh(policy: &Policy) -> Self;
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update);
    fn apply(&mut self, policy: &Policy, update: Update);
    fn recovered_at(&self, policy: &Policy) -> u64;
    /// [`Kept::consumed`], given the expiry kept beside the state.
    fn consumed(&self, expires: u64, period: u64, now: u64) -> u64;
    fn empty() -> Tables;
    fn table(tables: &Tables) -> Option<&Table<Timed<Self>>>;
    fn table_mut(tables: &mut Tables) -> Option<&mut Table<Timed<Self>>>;
}

impl<S: Algo> Kept for Timed<S> {
    fn fresh(policy: &Policy) -> Self {
        Timed {
            expires: 0,
            state: S::fresh(policy),
        }
    }

    // Always inlined: returned through the stack, a `(Decision, Update)` costs a
    // store-forwarding stall (the sliding window counter's check was not inlined once each
    // policy had its own table).
    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        self.state.decide(policy, now, cost)
    }

    #[inline]
    fn apply(&mut self, policy: &Policy, update: Update) {
        self.state.apply(policy, update);
        self.expires = self.state.recovered_at(policy);
    }

    #[inline]
    fn expires(&self) -> u64 {
        self.expires
    }

    fn consumed(&self, period: u64, now: u64) -> u64 {
        self.state.consumed(self.expires, period, now)
    }

    fn empty() -> Tables {
        S::empty()
    }

    #[inline]
    fn table(tables: &Tables) -> Option<&Table<Self>> {
        S::table(tables)
    }

    #[inline]
    fn table_mut(tables: &mut Tables) -> Option<&mut Table<Self>> {
        S::table_mut(tables)
    }
}

impl Algo for TokenBucket {
    fn fresh(policy: &Policy) -> Self {
        TokenBucket::full(policy.limit(), policy.period_nanos())
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let (next, d) = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::TokenBucket(next))
    }

    #[inline]
    fn apply(&mut self, _: &Policy, update: Update) {
        if let Update::TokenBucket(next) = update {
            *self = next;
        }
    }

    #[inline]
    fn recovered_at(&self, policy: &Policy) -> u64 {
        TokenBucket::recovered_at(self, policy.limit(), policy.period_nanos())
    }

    fn consumed(&self, expires: u64, period: u64, now: u64) -> u64 {
        // The bucket is full again at `expires`: until then it lacks `expires - now` of credit.
        units(expires.saturating_sub(now.max(self.last)), period)
    }

    kept_tables!(TokenBucket, Timed<Self>);
}

impl Algo for FixedWindow {
    fn fresh(_: &Policy) -> Self {
        FixedWindow::default()
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let (next, d) = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::FixedWindow(next))
    }

    #[inline]
    fn apply(&mut self, _: &Policy, update: Update) {
        if let Update::FixedWindow(next) = update {
            *self = next;
        }
    }

    #[inline]
    fn recovered_at(&self, policy: &Policy) -> u64 {
        FixedWindow::recovered_at(self, policy.period_nanos())
    }

    fn consumed(&self, _: u64, period: u64, now: u64) -> u64 {
        if (now / period.max(1)).max(self.window) == self.window {
            self.count
        } else {
            0
        }
    }

    kept_tables!(FixedWindow, Timed<Self>);
}

impl Algo for SlidingWindow {
    fn fresh(_: &Policy) -> Self {
        SlidingWindow::default()
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let (next, d) = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::SlidingWindow(next))
    }

    #[inline]
    fn apply(&mut self, _: &Policy, update: Update) {
        if let Update::SlidingWindow(next) = update {
            *self = next;
        }
    }

    #[inline]
    fn recovered_at(&self, policy: &Policy) -> u64 {
        SlidingWindow::recovered_at(self, policy.period_nanos())
    }

    fn consumed(&self, _: u64, period: u64, now: u64) -> u64 {
        // The weighted count as `check` takes it, rounded down (what it weighs on admission).
        let w = period.max(1);
        let k = (now / w).max(self.window);
        let (prev, cur) = if k == self.window {
            (self.prev, self.cur)
        } else if Some(k) == self.window.checked_add(1) {
            (self.cur, 0)
        } else {
            (0, 0)
        };
        let elapsed = now.saturating_sub(k.saturating_mul(w)).min(w - 1);
        let scaled = u128::from(prev) * u128::from(w - elapsed) + u128::from(cur) * u128::from(w);
        u64::try_from(scaled / u128::from(w)).unwrap_or(u64::MAX)
    }

    kept_tables!(SlidingWindow, Timed<Self>);
}

impl Algo for SlidingLog {
    fn fresh(_: &Policy) -> Self {
        SlidingLog::default()
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let d = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::SlidingLog { now, cost })
    }

    #[inline]
    fn apply(&mut self, policy: &Policy, update: Update) {
        if let Update::SlidingLog { now, cost } = update {
            self.record(policy.period_nanos(), now, cost);
        }
    }

    #[inline]
    fn recovered_at(&self, policy: &Policy) -> u64 {
        SlidingLog::recovered_at(self, policy.period_nanos())
    }

    fn consumed(&self, expires: u64, period: u64, now: u64) -> u64 {
        // The cost of the entries still in the window; the newest entry is `expires - period`.
        let now = now.max(expires.saturating_sub(period));
        self.entries()
            .skip_while(|&(t, _)| t.saturating_add(period) <= now)
            .map(|(_, cost)| cost)
            .sum()
    }

    kept_tables!(SlidingLog, Timed<Self>);
}

pub(super) use with_kept;
