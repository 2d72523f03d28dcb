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
