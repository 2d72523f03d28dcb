//! The algorithms, each a pure state machine: `(state, now, cost) -> (state', Decision)`.
//!
//! No I/O and no clock reads: time comes in as nanoseconds on the caller's time line, so the
//! same functions serve the in-process store, the tests (with a manual clock) and, mirrored
//! step for step, the Redis scripts. A rejection never changes the state, so a check can be
//! computed, thrown away and computed again (after a lost race, or when a stacked check
//! rejects on another key).
//!
//! Conventions shared by all of them:
//! - a request of cost `c` is admitted only when the whole cost fits (no partial payment);
//! - `remaining` is the largest cost that would be admitted right after the decision;
//! - `retry_after` is the exact time until the same request would be admitted;
//! - `reset_after` is the time until the state is indistinguishable from a fresh one;
//! - a time earlier than one the state has already seen is treated as that time (time never
//!   runs backwards inside a state);
//! - a cost above the limit is always rejected, and its `retry_after` means nothing: the stores
//!   refuse such a check with [`StoreError::CostExceedsLimit`](crate::StoreError) before
//!   asking an algorithm.
//!
//! ```
//! use tollgate::algorithm::Gcra;
//!
//! // 2 per second (one every 500 ms), burst 2; times in nanoseconds.
//! let ms = 1_000_000;
//! let (s, d) = Gcra::default().check(2, 500 * ms, 0, 1);
//! assert!(d.allowed());
//! let (s, d) = s.check(2, 500 * ms, 0, 1);
//! assert!(d.allowed() && d.remaining() == 0);
//! let (_, d) = s.check(2, 500 * ms, 100 * ms, 1);
//! assert_eq!(d.retry_after().map(|t| t.as_millis()), Some(400));
//! ```

mod fixed_window;
mod gcra;
mod leaky_bucket;
mod sliding_log;
mod sliding_window;
mod token_bucket;

pub use fixed_window::FixedWindow;
pub use gcra::Gcra;
pub use leaky_bucket::LeakyBucket;
pub use sliding_log::SlidingLog;
pub use sliding_window::SlidingWindow;
pub use token_bucket::TokenBucket;

use crate::{Algorithm, Decision, Policy};

/// The state of one key under one policy, whatever the algorithm.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum State {
    FixedWindow(FixedWindow),
    SlidingLog(Box<SlidingLog>),
    SlidingWindow(SlidingWindow),
    TokenBucket(TokenBucket),
    LeakyBucket(LeakyBucket),
    Gcra(Gcra),
}

/// What to write if a decision is committed.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Update {
    FixedWindow(FixedWindow),
    SlidingLog { now: u64, cost: u64 },
    SlidingWindow(SlidingWindow),
    TokenBucket(TokenBucket),
    LeakyBucket(LeakyBucket),
    Gcra(Gcra),
}

impl State {
    /// The state of a key never seen under `policy`.
    pub(crate) fn fresh(policy: &Policy) -> Self {
        match policy.algorithm() {
            Algorithm::FixedWindow => State::FixedWindow(FixedWindow::default()),
            Algorithm::SlidingLog => State::SlidingLog(Box::default()),
            Algorithm::SlidingWindow => State::SlidingWindow(SlidingWindow::default()),
            Algorithm::TokenBucket => {
                State::TokenBucket(TokenBucket::full(policy.limit(), policy.period_nanos()))
            }
            Algorithm::LeakyBucket => State::LeakyBucket(LeakyBucket::default()),
            Algorithm::Gcra => State::Gcra(Gcra::default()),
        }
    }

    /// Whether this state belongs to `policy`'s algorithm.
    pub(crate) fn fits(&self, policy: &Policy) -> bool {
        matches!(
            (self, policy.algorithm()),
            (State::FixedWindow(_), Algorithm::FixedWindow)
                | (State::SlidingLog(_), Algorithm::SlidingLog)
                | (State::SlidingWindow(_), Algorithm::SlidingWindow)
                | (State::TokenBucket(_), Algorithm::TokenBucket)
                | (State::LeakyBucket(_), Algorithm::LeakyBucket)
                | (State::Gcra(_), Algorithm::Gcra)
        )
    }

    /// Decides a request without changing anything. The caller commits with
    /// [`State::apply`] when the request is admitted (for a stacked check, when all are).
    /// The state must [`fit`](State::fits) the policy.
    #[inline]
    pub(crate) fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let (limit, period) = (policy.limit(), policy.period_nanos());
        match self {
            State::Gcra(s) => {
                let (s, d) = s.check(limit, period, now, cost);
                (d, Update::Gcra(s))
            }
            State::TokenBucket(s) => {
                let (s, d) = s.check(limit, period, now, cost);
                (d, Update::TokenBucket(s))
            }
            State::LeakyBucket(s) => {
                let (s, d) = s.check(limit, period, now, cost);
                (d, Update::LeakyBucket(s))
            }
            State::FixedWindow(s) => {
                let (s, d) = s.check(limit, period, now, cost);
                (d, Update::FixedWindow(s))
            }
            State::SlidingWindow(s) => {
                let (s, d) = s.check(limit, period, now, cost);
                (d, Update::SlidingWindow(s))
            }
            State::SlidingLog(log) => {
                let d = log.check(limit, period, now, cost);
                (d, Update::SlidingLog { now, cost })
            }
        }
    }

    /// Writes what [`State::decide`] returned for an admitted request.
    #[inline]
    pub(crate) fn apply(&mut self, policy: &Policy, update: Update) {
        match (self, update) {
            (State::Gcra(s), Update::Gcra(n)) => *s = n,
            (State::TokenBucket(s), Update::TokenBucket(n)) => *s = n,
            (State::LeakyBucket(s), Update::LeakyBucket(n)) => *s = n,
            (State::FixedWindow(s), Update::FixedWindow(n)) => *s = n,
            (State::SlidingWindow(s), Update::SlidingWindow(n)) => *s = n,
            (State::SlidingLog(log), Update::SlidingLog { now, cost }) => {
                log.record(policy.period_nanos(), now, cost)
            }
            // `decide` always returns the update of the state's own variant.
            _ => {}
        }
    }

    /// When this state will be indistinguishable from a fresh one: forgetting it from then on
    /// changes no decision.
    pub(crate) fn recovered_at(&self, policy: &Policy) -> u64 {
        let (limit, period) = (policy.limit(), policy.period_nanos());
        match self {
            State::Gcra(s) => s.recovered_at(),
            State::TokenBucket(s) => s.recovered_at(limit, period),
            State::LeakyBucket(s) => s.recovered_at(),
            State::FixedWindow(s) => s.recovered_at(period),
            State::SlidingWindow(s) => s.recovered_at(period),
            State::SlidingLog(log) => log.recovered_at(period),
        }
    }
}
