//! Failure as a policy: a per-call timeout, a circuit breaker and what to answer while the
//! store is down, around any [`Store`].
//!
//! A store error is never a rejection. [`ResilientStore`] turns store failures (errors and
//! timeouts) into the answer chosen up front by its [`FailurePolicy`]:
//!
//! - [`FailurePolicy::Closed`]: the error goes to the caller (the HTTP layer answers 503: it is
//!   our problem, not the client's);
//! - [`FailurePolicy::Open`]: the request is admitted, and counted in
//!   [`ResilientStats::failed_open`] (and passed to the
//!   [`on_failure`](ResilientStoreBuilder::on_failure) hook, to log it);
//! - [`FailurePolicy::LocalFallback`]: an in-process [`MemoryStore`] decides with the same
//!   policies, optionally with each limit divided by the number of instances sharing it.
//!
//! After `failures` consecutive failures the breaker opens: for `open_for`, calls do not reach
//! the store at all and take the failure policy at once. Then one call at a time probes the
//! store: a success closes the breaker, a failure opens it again. So a dead store costs one
//! timeout per probe interval, not one per request, and the breaker closes by itself when the
//! store answers again. Caller errors ([`StoreError::CostExceedsLimit`],
//! [`StoreError::KeyTooLong`], [`StoreError::Unsupported`]) pass through untouched and never
//! count as failures: a misconfigured limit never fails open.
//!
//! Timeouts and the breaker's clock are tokio's (`tokio::time`), so checks run inside a tokio
//! runtime with its timer enabled, and tests can drive them with paused time.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{MemoryStore, Policy};
//! use tollgate::store::{FailurePolicy, ResilientStore};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let store = ResilientStore::builder(MemoryStore::new())
//!     .timeout(Duration::from_millis(200))
//!     .failure_policy(FailurePolicy::LocalFallback)
//!     .breaker(5, Duration::from_secs(1))
//!     .build();
//! let p = Policy::fixed_window(1, Duration::from_secs(60))?;
//! assert!(store.check("k", &p, 1).await?.allowed());
//! assert!(!store.check("k", &p, 1).await?.allowed()); // a rejection is not a failure
//! assert_eq!(store.stats().failures, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::{Check, MemoryStore, NOTHING_TO_CHECK, Store, StoreError};
use crate::{Algorithm, Decision, Policy, Rate};

/// The default per-call timeout of a [`ResilientStore`].
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_millis(250);
/// The default number of consecutive failures that opens the breaker.
pub const DEFAULT_BREAKER_FAILURES: u32 = 5;
/// The default time the breaker stays open before a probe.
pub const DEFAULT_BREAKER_OPEN_FOR: Duration = Duration::from_secs(1);

/// What to answer when the store fails or the breaker is open.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Admit the request (counted in [`ResilientStats::failed_open`]).
    Open,
    /// Return the error (the HTTP layer answers 503).
    #[default]
    Closed,
    /// Decide with an in-process store and the same policies (limits divided by
    /// [`ResilientStoreBuilder::fallback_instances`]).
    LocalFallback,
}

/// Counters of a [`ResilientStore`], since it was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ResilientStats {
    /// Calls that reached the store and failed (errors and timeouts).
    pub failures: u64,
    /// Of those, timeouts.
    pub timeouts: u64,
    /// Calls answered without asking the store because the breaker was open.
    pub short_circuited: u64,
    /// Requests admitted by [`FailurePolicy::Open`].
    pub failed_open: u64,
    /// Decisions taken by the local fallback store.
    pub fallback_decisions: u64,
    /// Times the breaker opened.
    pub breaker_opened: u64,
}

#[derive(Default)]
struct Counters {
    failures: AtomicU64,
    timeouts: AtomicU64,
    short_circuited: AtomicU64,
    failed_open: AtomicU64,
    fallback_decisions: AtomicU64,
    breaker_opened: AtomicU64,
}

#[derive(Clone, Copy, Debug)]
enum BreakerState {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// One probe is in flight.
    HalfOpen,
}

/// Whether a call may go to the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Permit {
    Call,
    Probe,
    Refuse,
}

/// The breaker's state, as [`ResilientStore::breaker_state`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BreakerStatus {
    /// Calls go to the store.
    Closed,
    /// Calls do not go to the store (until the next probe).
    Open,
    /// One probe call is in flight; the others do not go to the store.
    HalfOpen,
}

/// Called for every call answered by the failure policy (see
/// [`ResilientStoreBuilder::on_failure`]).
type FailureHook = Arc<dyn Fn(&StoreError) + Send + Sync>;

struct Shared<S> {
    store: S,
    hook: Option<FailureHook>,
    timeout: Duration,
    policy: FailurePolicy,
    threshold: u32,
    open_for: Duration,
    state: Mutex<BreakerState>,
    fallback: MemoryStore,
    instances: u64,
    divided: Mutex<HashMap<u64, Policy>>,
    counters: Counters,
}

/// A store wrapped in a timeout, a circuit breaker and a [`FailurePolicy`]. Cloning is cheap;
/// clones share the breaker, the counters and the fallback store.
pub struct ResilientStore<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for ResilientStore<S> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S> fmt::Debug for ResilientStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResilientStore")
            .field("timeout", &self.shared.timeout)
            .field("policy", &self.shared.policy)
            .field("breaker", &*self.shared.state.lock())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl<S: Store> ResilientStore<S> {
    /// `store` with the defaults: 250 ms timeout, [`FailurePolicy::Closed`], breaker open
    /// after 5 consecutive failures for 1 s.
    pub fn new(store: S) -> Self {
        Self::builder(store).build()
    }

    /// A builder around `store`.
    pub fn builder(store: S) -> ResilientStoreBuilder<S> {
        ResilientStoreBuilder {
            store,
            timeout: DEFAULT_CALL_TIMEOUT,
            policy: FailurePolicy::Closed,
            threshold: DEFAULT_BREAKER_FAILURES,
            open_for: DEFAULT_BREAKER_OPEN_FOR,
            fallback: None,
            instances: 1,
            hook: None,
        }
    }

    /// Checks one request (see [`Store::check`]).
    pub fn check(&self, key: &str, policy: &Policy, cost: u64) -> ResilientFuture {
        self.check_all(&[Check::new(key, policy, cost)])
    }
}

impl<S> ResilientStore<S> {
    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.shared.store
    }

    /// The counters so far.
    pub fn stats(&self) -> ResilientStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ResilientStats {
            failures: get(&c.failures),
            timeouts: get(&c.timeouts),
            short_circuited: get(&c.short_circuited),
            failed_open: get(&c.failed_open),
            fallback_decisions: get(&c.fallback_decisions),
            breaker_opened: get(&c.breaker_opened),
        }
    }

    /// The breaker's state now.
    pub fn breaker_state(&self) -> BreakerStatus {
        match *self.shared.state.lock() {
            BreakerState::Closed { .. } => BreakerStatus::Closed,
            BreakerState::Open { .. } => BreakerStatus::Open,
            BreakerState::HalfOpen => BreakerStatus::HalfOpen,
        }
    }
}

impl<S: Store> ResilientStore<S> {
    /// Checks a stack of limits all or nothing (see [`Store::check_all`]).
    pub fn check_all(&self, checks: &[Check<'_>]) -> ResilientFuture {
        let shared = Arc::clone(&self.shared);
        let permit = shared.permit();
        let owned: Vec<(String, Policy, u64)> = match shared.policy {
            FailurePolicy::LocalFallback => checks
                .iter()
                .map(|c| (c.key().to_owned(), shared.divided(c.policy()), c.cost()))
                .collect(),
            _ => Vec::new(),
        };
        // What an admission by the Open policy reports: the tightest limit of the stack.
        let open_limit = checks.iter().map(|c| c.policy().limit()).min();
        let call = match permit {
            Permit::Refuse => None,
            Permit::Call | Permit::Probe => Some(shared.store.check_all(checks)),
        };
        // Made before the future is first polled, so that dropping it unpolled re-arms too.
        let probe = ProbeGuard {
            shared: Arc::clone(&shared),
            armed: permit == Permit::Probe,
        };
        ResilientFuture {
            inner: Box::pin(async move {
                let mut probe = probe;
                let error = match call {
                    None => {
                        shared
                            .counters
                            .short_circuited
                            .fetch_add(1, Ordering::Relaxed);
                        StoreError::CircuitOpen
                    }
                    Some(call) => match tokio::time::timeout(shared.timeout, call).await {
                        Ok(Ok(decision)) => {
                            probe.armed = false;
                            shared.success();
                            return Ok(decision);
                        }
                        Ok(Err(
                            e @ (StoreError::CostExceedsLimit { .. }
                            | StoreError::KeyTooLong { .. }
                            | StoreError::Unsupported { .. }),
                        )) => {
                            // The caller's mistake, not the store's: no failure, no policy.
                            probe.armed = false;
                            shared.success();
                            return Err(e);
                        }
                        Ok(Err(e)) => {
                            probe.armed = false;
                            shared.failure(matches!(e, StoreError::Timeout(_)));
                            e
                        }
                        Err(_) => {
                            probe.armed = false;
                            shared.failure(true);
                            StoreError::Timeout(shared.timeout)
                        }
                    },
                };
                shared.on_failure(error, &owned, open_limit)
            }),
        }
    }
}

/// Re-opens the breaker if a probe is dropped before it finished, so that the next call can
/// probe again.
struct ProbeGuard<S> {
    shared: Arc<Shared<S>>,
    armed: bool,
}

impl<S> Drop for ProbeGuard<S> {
    fn drop(&mut self) {
        if self.armed {
            *self.shared.state.lock() = BreakerState::Open {
                until: Instant::now(),
            };
        }
    }
}

impl<S> Shared<S> {
    fn permit(&self) -> Permit {
        let mut state = self.state.lock();
        match *state {
            BreakerState::Closed { .. } => Permit::Call,
            BreakerState::Open { until } if Instant::now() >= until => {
                *state = BreakerState::HalfOpen;
                Permit::Probe
            }
            BreakerState::Open { .. } | BreakerState::HalfOpen => Permit::Refuse,
        }
    }

    fn success(&self) {
        let mut state = self.state.lock();
        if !matches!(*state, BreakerState::Closed { failures: 0 }) {
            *state = BreakerState::Closed { failures: 0 };
        }
    }

    fn failure(&self, timeout: bool) {
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
        if timeout {
            self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
        }
        let mut state = self.state.lock();
        let open = match *state {
            BreakerState::Closed { failures } => {
                let failures = failures.saturating_add(1);
                *state = BreakerState::Closed { failures };
                failures >= self.threshold
            }
            // A failed probe, or a call that started before the breaker opened.
            BreakerState::HalfOpen => true,
            BreakerState::Open { .. } => false,
        };
        if open {
            *state = BreakerState::Open {
                until: Instant::now() + self.open_for,
            };
            self.counters.breaker_opened.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn on_failure(
        &self,
        error: StoreError,
        owned: &[(String, Policy, u64)],
        open_limit: Option<u64>,
    ) -> Result<Decision, StoreError> {
        if let Some(hook) = &self.hook {
            hook(&error);
        }
        match self.policy {
            FailurePolicy::Closed => Err(error),
            FailurePolicy::Open => {
                self.counters.failed_open.fetch_add(1, Ordering::Relaxed);
                Ok(match open_limit {
                    Some(limit) => Decision::admitted(limit, limit, Duration::ZERO),
                    None => NOTHING_TO_CHECK,
                })
            }
            FailurePolicy::LocalFallback => {
                self.counters
                    .fallback_decisions
                    .fetch_add(1, Ordering::Relaxed);
                let checks: Vec<Check<'_>> = owned
                    .iter()
                    .map(|(k, p, c)| Check::new(k, p, (*c).min(p.limit())))
                    .collect();
                self.fallback.check_all_now(&checks)
            }
        }
    }

    /// `policy` with its limit divided by the number of instances (cached per policy).
    fn divided(&self, policy: &Policy) -> Policy {
        if self.instances <= 1 {
            return policy.clone();
        }
        let mut cache = self.divided.lock();
        if let Some(p) = cache.get(&policy.id()) {
            return p.clone();
        }
        let p = divide(policy, self.instances).unwrap_or_else(|| policy.clone());
        if cache.len() < 4096 {
            cache.insert(policy.id(), p.clone());
        }
        p
    }
}

/// A policy allowing a `n`-th of `policy`: the limit (or burst) divided, at least 1, and for a
/// bucket the rate divided too.
fn divide(policy: &Policy, n: u64) -> Option<Policy> {
    let limit = (policy.limit() / n).max(1);
    let period = policy.interval();
    let p = match policy.algorithm() {
        Algorithm::FixedWindow => Policy::fixed_window(limit, period),
        Algorithm::SlidingLog => Policy::sliding_log(limit, period),
        Algorithm::SlidingWindow => Policy::sliding_window(limit, period),
        Algorithm::TokenBucket => {
            Policy::token_bucket(Rate::new(1, period.checked_mul(n as u32)?), limit)
        }
        Algorithm::LeakyBucket => {
            Policy::leaky_bucket(Rate::new(1, period.checked_mul(n as u32)?), limit)
        }
        Algorithm::Gcra => Policy::gcra(Rate::new(1, period.checked_mul(n as u32)?), limit),
    }
    .ok()?;
    match policy.name() {
        Some(name) => p.named(name).ok(),
        None => Some(p),
    }
}

impl<S: Store> Store for ResilientStore<S> {
    type Future = ResilientFuture;

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        ResilientStore::check_all(self, checks)
    }

    fn check(&self, key: &str, policy: &Policy, cost: u64) -> Self::Future {
        ResilientStore::check(self, key, policy, cost)
    }
}

/// The future of a [`ResilientStore`] check.
#[must_use = "futures do nothing unless polled"]
pub struct ResilientFuture {
    inner: Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send + 'static>>,
}

impl Future for ResilientFuture {
    type Output = Result<Decision, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl fmt::Debug for ResilientFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResilientFuture").finish_non_exhaustive()
    }
}

/// Configures a [`ResilientStore`]; made by [`ResilientStore::builder`].
pub struct ResilientStoreBuilder<S> {
    store: S,
    timeout: Duration,
    policy: FailurePolicy,
    threshold: u32,
    open_for: Duration,
    fallback: Option<MemoryStore>,
    instances: u64,
    hook: Option<FailureHook>,
}

impl<S> fmt::Debug for ResilientStoreBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResilientStoreBuilder")
            .field("timeout", &self.timeout)
            .field("policy", &self.policy)
            .field("threshold", &self.threshold)
            .field("open_for", &self.open_for)
            .field("instances", &self.instances)
            .field("on_failure", &self.hook.is_some())
            .finish_non_exhaustive()
    }
}

impl<S: Store> ResilientStoreBuilder<S> {
    /// Calls `hook` with the error of every call that the failure policy answers (a store
    /// error, a timeout, or [`StoreError::CircuitOpen`] while the breaker is open): the place
    /// to log it, with whatever logger the service uses (rate-limit the log: during an outage
    /// this is every request).
    pub fn on_failure(mut self, hook: impl Fn(&StoreError) + Send + Sync + 'static) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// The most a call may take (default 250 ms); a slower one is a failure.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// What to answer on failure (default [`FailurePolicy::Closed`]).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Open the breaker after `failures` consecutive failures (at least 1), for `open_for`
    /// before each probe (defaults 5 and 1 s).
    pub fn breaker(mut self, failures: u32, open_for: Duration) -> Self {
        self.threshold = failures.max(1);
        self.open_for = open_for;
        self
    }

    /// The in-process store of [`FailurePolicy::LocalFallback`] (default: a new
    /// `MemoryStore`).
    pub fn fallback_store(mut self, store: MemoryStore) -> Self {
        self.fallback = Some(store);
        self
    }

    /// How many instances share the limit: the fallback divides each limit (and rate) by it,
    /// at least 1, so that together they stay near the shared limit (default 1). A request
    /// costing more than the divided limit is charged the divided limit.
    pub fn fallback_instances(mut self, instances: u64) -> Self {
        self.instances = instances.max(1);
        self
    }

    /// Builds the store.
    pub fn build(self) -> ResilientStore<S> {
        ResilientStore {
            shared: Arc::new(Shared {
                store: self.store,
                timeout: self.timeout,
                policy: self.policy,
                threshold: self.threshold,
                open_for: self.open_for,
                state: Mutex::new(BreakerState::Closed { failures: 0 }),
                fallback: self.fallback.unwrap_or_default(),
                instances: self.instances,
                hook: self.hook,
                divided: Mutex::new(HashMap::new()),
                counters: Counters::default(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU8;

    const OK: u8 = 0;
    const FAIL: u8 = 1;
    const HANG: u8 = 2;

    /// A store that admits, fails or never answers, as told, and counts its calls.
    #[derive(Clone, Default)]
    struct Fake {
        mode: Arc<AtomicU8>,
        calls: Arc<AtomicU64>,
    }

    impl Fake {
        fn set(&self, mode: u8) {
            self.mode.store(mode, Ordering::SeqCst);
        }
        fn calls(&self) -> u64 {
            self.calls.load(Ordering::SeqCst)
        }
    }

    impl Store for Fake {
        type Future = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>;

        fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let limit = checks[0].policy().limit();
            match self.mode.load(Ordering::SeqCst) {
                OK => Box::pin(std::future::ready(Ok(Decision::admitted(
                    limit,
                    0,
                    Duration::ZERO,
                )))),
                FAIL => Box::pin(std::future::ready(Err(StoreError::Backend("down".into())))),
                _ => Box::pin(std::future::pending()),
            }
        }
    }

    fn policy() -> Policy {
        Policy::fixed_window(4, Duration::from_secs(60)).unwrap()
    }

    fn store(fake: &Fake, policy: FailurePolicy) -> ResilientStore<Fake> {
        ResilientStore::builder(fake.clone())
            .timeout(Duration::from_millis(100))
            .breaker(3, Duration::from_secs(1))
            .failure_policy(policy)
            .fallback_instances(2)
            .build()
    }

    #[tokio::test(start_paused = true)]
    async fn the_breaker_opens_after_consecutive_failures_and_probes_one_at_a_time() {
        let fake = Fake::default();
        let s = store(&fake, FailurePolicy::Closed);
        let p = policy();
        fake.set(HANG);
        let started = Instant::now();
        for _ in 0..3 {
            assert!(matches!(
                s.check("k", &p, 1).await,
                Err(StoreError::Timeout(_))
            ));
        }
        // Three timeouts paid, then none: the breaker is open.
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        assert_eq!(s.breaker_state(), BreakerStatus::Open);
        for _ in 0..100 {
            assert!(matches!(
                s.check("k", &p, 1).await,
                Err(StoreError::CircuitOpen)
            ));
        }
        assert_eq!(fake.calls(), 3);
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        // After the open interval, one probe at a time reaches the store.
        tokio::time::advance(Duration::from_secs(1)).await;
        let probe = s.check("k", &p, 1);
        assert_eq!(s.breaker_state(), BreakerStatus::HalfOpen);
        assert!(matches!(
            s.check("k", &p, 1).await,
            Err(StoreError::CircuitOpen)
        ));
        assert!(matches!(probe.await, Err(StoreError::Timeout(_))));
        assert_eq!(fake.calls(), 4);
        assert_eq!(s.breaker_state(), BreakerStatus::Open);
        // The store comes back: the next probe closes the breaker.
        fake.set(OK);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(s.check("k", &p, 1).await.unwrap().allowed());
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
        assert!(s.check("k", &p, 1).await.unwrap().allowed());
        assert_eq!(fake.calls(), 6);
        let stats = s.stats();
        assert_eq!(stats.failures, 4);
        assert_eq!(stats.timeouts, 4);
        assert_eq!(stats.breaker_opened, 2);
        assert_eq!(stats.short_circuited, 101);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_probe_lets_the_next_call_probe() {
        let fake = Fake::default();
        let s = store(&fake, FailurePolicy::Closed);
        let p = policy();
        fake.set(FAIL);
        for _ in 0..3 {
            assert!(s.check("k", &p, 1).await.is_err());
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        drop(s.check("k", &p, 1));
        fake.set(OK);
        assert!(s.check("k", &p, 1).await.unwrap().allowed());
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn failing_open_admits_and_counts() {
        let fake = Fake::default();
        let s = store(&fake, FailurePolicy::Open);
        let p = policy();
        fake.set(FAIL);
        for _ in 0..10 {
            let d = s.check("k", &p, 1).await.unwrap();
            assert!(d.allowed());
            assert_eq!(d.limit(), 4);
        }
        assert_eq!(s.stats().failed_open, 10);
        assert_eq!(fake.calls(), 3);
        // The hook sees every failure the policy answered: 3 errors, then the open breaker.
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let s = ResilientStore::builder(fake.clone())
            .breaker(3, Duration::from_secs(1))
            .failure_policy(FailurePolicy::Open)
            .on_failure(move |e| log.lock().push(matches!(e, StoreError::CircuitOpen)))
            .build();
        for _ in 0..5 {
            assert!(s.check("k", &p, 1).await.unwrap().allowed());
        }
        assert_eq!(*seen.lock(), [false, false, false, true, true]);
    }

    #[tokio::test(start_paused = true)]
    async fn the_local_fallback_applies_the_divided_limits() {
        let fake = Fake::default();
        let s = store(&fake, FailurePolicy::LocalFallback);
        let p = policy().named("per-minute").unwrap();
        fake.set(HANG);
        // Limit 4 shared by 2 instances: the fallback admits 2 here.
        let mut admitted = 0;
        for _ in 0..6 {
            let d = s.check("k", &p, 1).await.unwrap();
            admitted += u64::from(d.allowed());
            assert_eq!(d.limit(), 2);
        }
        assert_eq!(admitted, 2);
        assert_eq!(s.stats().fallback_decisions, 6);
        let bucket = Policy::gcra(Rate::per_second(10), 6).unwrap();
        let half = divide(&bucket, 2).unwrap();
        assert_eq!(half.limit(), 3);
        assert_eq!(half.interval(), Duration::from_millis(200));
    }

    #[tokio::test(start_paused = true)]
    async fn caller_errors_pass_through_and_are_no_failures() {
        let fake = Fake::default();
        let s = store(&fake, FailurePolicy::Open);
        let mem = ResilientStore::new(MemoryStore::new());
        let p = policy();
        for _ in 0..10 {
            assert!(matches!(
                mem.check("k", &p, 5).await,
                Err(StoreError::CostExceedsLimit { .. })
            ));
        }
        assert_eq!(mem.stats().failures, 0);
        assert_eq!(mem.breaker_state(), BreakerStatus::Closed);
        assert!(s.check("k", &p, 1).await.unwrap().allowed());
    }
}
