//! The locks and atomics that the in-process store, the concurrency permits and the shedder
//! share between threads, from one place: `parking_lot`'s mutex and the standard atomics in
//! every build, and [shuttle]'s when the crate's own tests are built with
//! `--cfg tollgate_shuttle`, so that shuttle's scheduler can explore the interleavings of
//! their callers (the modules' `model_checks` tests; `bash scripts/model-check` runs them).
//!
//! [shuttle]: https://docs.rs/shuttle

#[cfg(not(all(test, tollgate_shuttle)))]
pub(crate) use parking_lot::{Mutex, MutexGuard};
#[cfg(not(all(test, tollgate_shuttle)))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};
/// The hasher that places keys in shards: seeded at random, so that no client can aim its keys
/// at one shard (fixed under the model checks, whose runs must place keys alike to replay).
#[cfg(not(all(test, tollgate_shuttle)))]
pub(crate) type HashState = foldhash::fast::RandomState;
#[cfg(all(test, tollgate_shuttle))]
pub(crate) type HashState = foldhash::fast::FixedState;

#[cfg(all(test, tollgate_shuttle))]
#[allow(unused_imports)] // The store names the guard, and only it.
pub(crate) use model::{Mutex, MutexGuard};
#[cfg(all(test, tollgate_shuttle))]
pub(crate) use shuttle::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};

/// shuttle's mutex behind `parking_lot`'s interface (no poisoning: a panic fails the model
/// check anyway).
#[cfg(all(test, tollgate_shuttle))]
mod model {
    use std::sync::PoisonError;

    pub(crate) type MutexGuard<'a, T> = shuttle::sync::MutexGuard<'a, T>;

    #[derive(Default)]
    pub(crate) struct Mutex<T>(shuttle::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(shuttle::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(PoisonError::into_inner)
        }
    }
}

/// How many runs each model check makes: shuttle's PCT scheduler (probabilistic concurrency
/// testing) samples the interleavings, weighted towards the orderings that find bugs of
/// depth three or less; `TOLLGATE_MODEL_RUNS` sets how many (10,000 by default).
#[cfg(all(test, tollgate_shuttle))]
pub(crate) fn pct_runs() -> usize {
    std::env::var("TOLLGATE_MODEL_RUNS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10_000)
}
