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
//! store: an answer from the backend closes the breaker, a failure opens it again. So a dead
//! store costs one timeout per probe interval, not one per request, and the breaker closes by
//! itself when the store answers again.
//!
//! A store whose parts fail apart says which part decides each check
//! ([`Store::partition`]: a Redis Cluster's master), and then each part has a breaker of its
//! own: one master down opens the breaker of the keys it holds, and the other masters' keys
//! are decided as usual. A call whose checks span several parts goes to the store whole when
//! every one of their breakers lets it; its success counts for each, and its failure for
//! each part that has not answered another call since it was sent (so a stack across a
//! healthy master and a hung one does not open the healthy one's breaker while that one
//! answers its own keys).
//!
//! # One part down
//!
//! When some of a call's parts have their breakers open and others not, one part down fails
//! only its own checks: the checks of the parts that are up are still decided where they
//! live, and charged there, and only those of the parts that are down take the failure
//! policy. A stack stays all or nothing across a down part, in this sense: it is admitted
//! only if the parts that are up admit it where they live *and* the failure policy admits
//! the down parts' checks; and then it consumed where each part was decided. In detail:
//!
//! - [`FailurePolicy::Closed`]: the call fails with [`StoreError::CircuitOpen`], whole;
//!   nothing is asked of the store and nothing is charged anywhere.
//! - [`FailurePolicy::Open`]: the store decides the up parts' checks (its own all or nothing
//!   across them); if it admits them, the down parts' checks are admitted by the policy,
//!   consuming nothing (counted in [`ResilientStats::failed_open`]).
//! - [`FailurePolicy::LocalFallback`]: the fallback decides the down parts' checks first: if
//!   it refuses, so is the call, and the store is not asked. If it admits, the store decides
//!   the others; if the store refuses, what the fallback took stays taken (an
//!   over-rejection on this instance's fallback, never an over-admission).
//!
//! An admission decided in part by the policy is marked
//! [`Decision::is_failure_policy`]; a refusal where a part lives is that part's own answer.
//! If the store fails on the up parts too, their checks take the failure policy as well.
//! Until a part's breaker opens (its first `failures` failures, and each probe while it is
//! still down), a call that includes it fails as a whole, and the failure policy decides all
//! of its checks: with the local fallback, a healthy part's check may then be admitted by
//! the fallback beyond what its own part would admit, within the bound stated at
//! [`FailurePolicy::LocalFallback`]. At most [`MAX_PARTITION_BREAKERS`] parts have their own at once; the rest share the
//! store's. A part no call has gone to for a while (ten times `open_for`, at least a minute:
//! a master replaced in a failover) loses its breaker, closed first so that its last state is
//! not reported for ever; so does the store's own once parts have taken over.
//!
//! Only answers that reached the backend say anything about its health. Caller errors
//! ([`StoreError::CostExceedsLimit`], [`StoreError::KeyTooLong`], [`StoreError::Unsupported`])
//! pass through untouched and are neither failures nor successes: a misconfigured limit never
//! fails open. Decisions marked [`Decision::without_backend`] (the Redis store's deny cache)
//! are passed on and count for nothing either: they neither reset the count of failures nor
//! close the breaker, and a probe answered that way hands the probe to the next call.
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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use smallvec::SmallVec;
// The tests time the breaker on tokio's clock.
#[cfg(test)]
use tokio::time::Instant;

use super::{Check, MemoryStore, NOTHING_TO_CHECK, Store, StoreError};
use crate::breaker::{Breaker, Permit, ProbeGuard};
use crate::clock::TokioClock;
use crate::telemetry::{Counter, Histogram, METRICS};
use crate::{Algorithm, Decision, Policy, Rate};

pub use crate::breaker::BreakerStatus;

/// The default per-call timeout of a [`ResilientStore`].
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_millis(250);
/// The default number of consecutive failures that opens the breaker.
pub const DEFAULT_BREAKER_FAILURES: u32 = 5;
/// The default time the breaker stays open before a probe.
pub const DEFAULT_BREAKER_OPEN_FOR: Duration = Duration::from_secs(1);
/// The default name of a [`ResilientStore`] in metrics and logs.
pub const DEFAULT_STORE_NAME: &str = "default";
/// The most parts of a store ([`Store::partition`]) that get a breaker of their own; beyond,
/// they share the store's.
pub const MAX_PARTITION_BREAKERS: usize = 256;

/// The least time a part's breaker is kept without a call going to it.
const PART_IDLE: Duration = Duration::from_secs(60);

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
    ///
    /// **The bound.** The fallback does not know what the store admitted before it took
    /// over, and the store does not learn what the fallback admitted: nothing is carried
    /// across. So in a window that spans a switch to the fallback and back (for a bucket, in
    /// any span `T`), the fleet admits up to the policy's bound twice: once counted by the
    /// store, and once by the fallbacks together (each instance's at most the divided limit,
    /// so with `fallback_instances` equal to the number of instances, the limit in all). A
    /// limit of 5 on one instance admits 10 around such a switch; never more. With fewer
    /// instances configured than run, each runs its own share: up to `instances /
    /// fallback_instances` limits from the fallbacks. A store that forgets its state while
    /// down (a Redis restarted without persistence) can admit its limit once more in that
    /// window, after it is back.
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

/// The metrics of a store, registered when it is built.
struct Telemetry {
    duration: Histogram,
    /// By [`error_kind`].
    errors: [Counter; 4],
    /// The action of the store's failure policy.
    action: Counter,
}

/// The `kind` labels of `tollgate_store_errors_total`, in the order of [`error_kind`].
const ERROR_KINDS: [&str; 4] = ["timeout", "backend", "circuit_open", "invalid"];

/// Which of [`ERROR_KINDS`] an error is.
fn error_kind(error: &StoreError) -> usize {
    match error {
        StoreError::Timeout(_) => 0,
        StoreError::Backend(_) => 1,
        StoreError::CircuitOpen => 2,
        _ => 3,
    }
}

impl Telemetry {
    fn new(store: &str, policy: FailurePolicy) -> Self {
        use crate::metrics::{
            STORE_DURATION_SECONDS, STORE_ERRORS_TOTAL, STORE_FAILURE_POLICY_TOTAL,
        };
        let action = match policy {
            FailurePolicy::Open => "fail_open",
            FailurePolicy::Closed => "fail_closed",
            FailurePolicy::LocalFallback => "fallback",
        };
        Telemetry {
            duration: Histogram::new(STORE_DURATION_SECONDS, &[("store", store)]),
            errors: ERROR_KINDS
                .map(|kind| Counter::new(STORE_ERRORS_TOTAL, &[("store", store), ("kind", kind)])),
            action: Counter::new(
                STORE_FAILURE_POLICY_TOTAL,
                &[("store", store), ("action", action)],
            ),
        }
    }

    fn error(&self, error: &StoreError) {
        self.errors[error_kind(error)].increment(1);
    }
}

/// Called for every call answered by the failure policy (see
/// [`ResilientStoreBuilder::on_failure`]).
type FailureHook = Arc<dyn Fn(&StoreError) + Send + Sync>;

struct Shared<S> {
    store: S,
    /// Its name in metrics and logs.
    name: Arc<str>,
    telemetry: Telemetry,
    hook: Option<FailureHook>,
    timeout: Duration,
    policy: FailurePolicy,
    breaker: Arc<Breaker<TokioClock>>,
    /// The store's breaker as a gate, for calls no part is named for.
    whole: Arc<Gate>,
    /// The breakers of the store's parts, made on first use (see [`Store::partition`]).
    parts: RwLock<HashMap<u32, Arc<Gate>>>,
    /// Whether a part has ever been named (then gates keep when they were last used).
    partitioned: AtomicBool,
    /// When idle gates were last looked for (breaker clock, ns).
    pruned_at: AtomicU64,
    /// How long a part's gate may go unused before it is dropped (ns).
    idle: u64,
    threshold: u32,
    open_for: Duration,
    fallback: MemoryStore,
    instances: u64,
    divided: Mutex<HashMap<u64, Policy>>,
    counters: Counters,
    /// Failed calls: at most one WARN a second (on the breaker's clock), the others at DEBUG.
    warned: crate::telemetry::WarnEvery,
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
            .field("name", &self.shared.name)
            .field("timeout", &self.shared.timeout)
            .field("policy", &self.shared.policy)
            .field("breaker", &self.shared.breaker.state())
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
            name: DEFAULT_STORE_NAME.to_owned(),
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

    /// The store's name in metrics and logs (see [`ResilientStoreBuilder::name`]).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The breaker's state now: with a breaker per part ([`Store::partition`]), the most open
    /// of them (see [`breaker_states`](Self::breaker_states) for each).
    pub fn breaker_state(&self) -> BreakerStatus {
        let rank = |s: BreakerStatus| match s {
            BreakerStatus::Closed => 0,
            BreakerStatus::HalfOpen => 1,
            BreakerStatus::Open => 2,
        };
        self.breaker_states()
            .into_iter()
            .map(|(_, s)| s)
            .max_by_key(|s| rank(*s))
            .unwrap_or(BreakerStatus::Closed)
    }

    /// The state of each breaker now: the store's (`None`), then each part's by its number
    /// ([`Store::partition`]), in order.
    pub fn breaker_states(&self) -> Vec<(Option<u32>, BreakerStatus)> {
        self.shared.prune(self.shared.breaker.now());
        let mut parts: Vec<(Option<u32>, BreakerStatus)> = self
            .shared
            .parts
            .read()
            .iter()
            .map(|(part, gate)| (Some(*part), gate.breaker.status()))
            .collect();
        parts.sort_by_key(|(part, _)| *part);
        parts.insert(0, (None, self.shared.breaker.status()));
        parts
    }
}

impl<S: Store> ResilientStore<S> {
    /// Checks a stack of limits all or nothing (see [`Store::check_all`]).
    pub fn check_all(&self, checks: &[Check<'_>]) -> ResilientFuture {
        let shared = Arc::clone(&self.shared);
        // The caller's own mistakes are answered as such even while the breaker is open (the
        // failure policy would otherwise admit a misconfigured check).
        let max_key_len = shared.store.max_key_len().unwrap_or(usize::MAX);
        for (index, check) in checks.iter().enumerate() {
            if let Err(e) = check.validate(index, max_key_len) {
                shared.telemetry.error(&e);
                return ResilientFuture {
                    inner: Box::pin(std::future::ready(Err(e))),
                };
            }
        }
        // Each guard is made before anything can panic or return, the inner store's
        // `check_all` included, so that a probe that ends without an answer (a panic, a future
        // dropped unpolled or mid-flight) hands the probe to the next call instead of holding
        // the breaker half-open.
        let (permits, sent) = match shared.permits(checks) {
            Gated::All(permits, sent) => (Some(permits), sent),
            Gated::Refused => (None, 0),
            Gated::Split {
                permits,
                sent,
                down,
            } => return shared.split(checks, permits, sent, &down),
        };
        let owned: Vec<(String, Policy, u64)> = match shared.policy {
            FailurePolicy::LocalFallback => checks
                .iter()
                .map(|c| (c.key().to_owned(), shared.divided(c.policy()), c.cost()))
                .collect(),
            _ => Vec::new(),
        };
        // What an admission by the Open policy reports: the tightest limit of the stack.
        let open_limit = checks.iter().map(|c| c.policy().limit()).min();
        // Timed for the latency histogram only (the clock is read only with metrics).
        let started = if METRICS { shared.breaker.now() } else { 0 };
        let call = permits.as_ref().map(|_| shared.store.check_all(checks));
        ResilientFuture {
            inner: Box::pin(async move {
                let mut permits = permits.unwrap_or_default();
                let error = match call {
                    None => {
                        shared
                            .counters
                            .short_circuited
                            .fetch_add(1, Ordering::Relaxed);
                        let e = StoreError::CircuitOpen;
                        shared.telemetry.error(&e);
                        e
                    }
                    Some(call) => {
                        let answer = tokio::time::timeout(shared.timeout, call).await;
                        if METRICS {
                            let took = shared.breaker.now().saturating_sub(started);
                            shared.telemetry.duration.record_nanos(took);
                        }
                        match answer {
                            Ok(Ok(decision)) if decision.reached_backend() => {
                                shared.success(&permits);
                                return Ok(decision);
                            }
                            Ok(Ok(decision)) => {
                                // Answered without the backend: says nothing of its health.
                                release(&mut permits);
                                return Ok(decision);
                            }
                            Ok(Err(
                                e @ (StoreError::CostExceedsLimit { .. }
                                | StoreError::KeyTooLong { .. }
                                | StoreError::Unsupported { .. }),
                            )) => {
                                // The caller's mistake, not the store's: neither a failure nor
                                // a success, and no failure policy.
                                release(&mut permits);
                                shared.telemetry.error(&e);
                                return Err(e);
                            }
                            Ok(Err(e @ StoreError::Busy(_))) => {
                                // Refused by the store itself before reaching its backend:
                                // local saturation, not a sign of the backend's health. The
                                // failure policy answers; no breaker moves.
                                release(&mut permits);
                                shared.telemetry.error(&e);
                                e
                            }
                            Ok(Err(e)) => {
                                shared.failure(&mut permits, sent, &e);
                                e
                            }
                            Err(_) => {
                                let e = StoreError::Timeout(shared.timeout);
                                shared.failure(&mut permits, sent, &e);
                                e
                            }
                        }
                    }
                };
                shared.on_failure(error, &owned, open_limit)
            }),
        }
    }
}

/// Which gates let a call through (see [`Shared::permits`]).
enum Gated {
    /// All of them: the call goes as it is.
    All(Permits, u64),
    /// None: the failure policy answers the whole call.
    Refused,
    /// Some: the permits of those that do, when the call was sent, and the checks (by index)
    /// whose gates refuse.
    Split {
        permits: Permits,
        sent: u64,
        down: SmallVec<[usize; 4]>,
    },
}

impl<S> Shared<S> {
    /// Drops the gates of parts no call has gone to for `idle` (closing their breakers first,
    /// so that their last state is not reported for ever), and closes the store's own when
    /// parts have taken over from it; at most once every `idle / 4`.
    fn prune(&self, now: u64) {
        let last = self.pruned_at.load(Ordering::Relaxed);
        if now.saturating_sub(last) < self.idle / 4
            || self
                .pruned_at
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let stale = |gate: &Gate| now.saturating_sub(gate.used.load(Ordering::Relaxed)) > self.idle;
        let mut parts = self.parts.write();
        parts.retain(|_, gate| {
            if stale(gate) {
                gate.breaker.reset();
                return false;
            }
            true
        });
        if self.partitioned.load(Ordering::Relaxed) && stale(&self.whole) {
            self.whole.breaker.reset();
        }
    }
}

impl<S: Store> Shared<S> {
    /// The gates `checks` go through (the store's, or each part's) with their permits, and
    /// when the call is sent (breaker clock, ns; 0 without parts): all of them, none (every
    /// gate refuses the call: no probe is held), or the checks of the gates that let it
    /// through while the others refuse (see [`Shared::split`]).
    fn permits(&self, checks: &[Check<'_>]) -> Gated {
        let mut parts: SmallVec<[u32; 4]> = SmallVec::new();
        // Each check's part (none: it goes with the others).
        let mut part_of: SmallVec<[Option<u32>; 4]> = SmallVec::new();
        for check in checks {
            let part = self.store.partition(check);
            if let Some(part) = part {
                if !parts.contains(&part) {
                    parts.push(part);
                }
            }
            part_of.push(part);
        }
        let mut permits = Permits::new();
        let mut sent = 0;
        // Each part's gate, as an index into `permits`.
        let mut gate_of: SmallVec<[(u32, usize); 4]> = SmallVec::new();
        if parts.is_empty() {
            if self.partitioned.load(Ordering::Relaxed) {
                sent = self.breaker.now();
                self.whole.used.store(sent, Ordering::Relaxed);
            }
            push_permit(&mut permits, &self.whole);
        } else {
            sent = self.breaker.now();
            for part in parts {
                let gate = self.part(part, sent);
                // Parts beyond the bound share the store's gate: one permit for it.
                let at = match permits.iter().position(|(g, _, _)| Arc::ptr_eq(g, &gate)) {
                    Some(at) => at,
                    None => {
                        push_permit(&mut permits, &gate);
                        permits.len() - 1
                    }
                };
                gate_of.push((part, at));
            }
        }
        let refused = |(_, permit, _): &(Arc<Gate>, Permit, ProbeGuard<TokioClock>)| {
            *permit == Permit::Refuse
        };
        if !permits.iter().any(refused) {
            return Gated::All(permits, sent);
        }
        if permits.iter().all(refused) {
            // A probe this call will not make goes to the next call.
            release(&mut permits);
            return Gated::Refused;
        }
        // Some parts refuse, others let the call through: the checks of the refusing ones.
        let down = part_of
            .iter()
            .enumerate()
            .filter(|(_, part)| {
                part.and_then(|p| gate_of.iter().find(|(q, _)| *q == p))
                    .is_some_and(|(_, at)| refused(&permits[*at]))
            })
            .map(|(i, _)| i)
            .collect();
        permits.retain(|p| !refused(p));
        Gated::Split {
            permits,
            sent,
            down,
        }
    }

    /// A call whose checks span parts of which some are down (their breakers refuse it) and
    /// some are not: one part down fails only its own checks. The checks of the parts that
    /// are up are decided where they live (and charged there); those of the parts that are
    /// down take the failure policy; and the call stays all or nothing (see the module docs,
    /// "One part down"):
    ///
    /// - `Closed`: the call fails with [`StoreError::CircuitOpen`], as a whole; nothing is
    ///   asked of the store or charged anywhere.
    /// - `Open`: the store decides the checks of the parts that are up; if it admits them,
    ///   the others are admitted by the policy (and the decision is marked so).
    /// - `LocalFallback`: the fallback decides the down parts' checks first; if it refuses,
    ///   that is the answer and the store is not asked; if it admits, the store decides the
    ///   others, and if the store refuses, what the fallback took stays taken (an
    ///   over-rejection on this instance's fallback, never an over-admission).
    ///
    /// If the store fails on the parts that are up too, their checks take the failure
    /// policy as well.
    fn split(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        mut permits: Permits,
        sent: u64,
        down: &[usize],
    ) -> ResilientFuture {
        self.counters
            .short_circuited
            .fetch_add(1, Ordering::Relaxed);
        self.telemetry.error(&StoreError::CircuitOpen);
        let ready = |r: Result<Decision, StoreError>| ResilientFuture {
            inner: Box::pin(std::future::ready(r)),
        };
        let up: SmallVec<[usize; 4]> = (0..checks.len()).filter(|i| !down.contains(i)).collect();
        let owned = |of: &[usize]| -> Vec<(String, Policy, u64)> {
            of.iter()
                .map(|&i| {
                    let c = &checks[i];
                    (c.key().to_owned(), self.divided(c.policy()), c.cost())
                })
                .collect()
        };
        let lowest = |of: &[usize]| of.iter().map(|&i| checks[i].policy().limit()).min();
        let costs: SmallVec<[u64; 4]> = checks.iter().map(Check::cost).collect();
        // The down parts' answer, when it comes first (the fallback's).
        let fallback = match self.policy {
            FailurePolicy::Closed => {
                release(&mut permits);
                return ready(self.on_failure(StoreError::CircuitOpen, &[], None));
            }
            FailurePolicy::Open => None,
            FailurePolicy::LocalFallback => {
                let decided = self
                    .on_failure(StoreError::CircuitOpen, &owned(down), None)
                    .map(|d| renumber(d, down));
                match decided {
                    Ok(d) if d.allowed() => Some(d),
                    refused => {
                        release(&mut permits);
                        return ready(refused);
                    }
                }
            }
        };
        let healthy: SmallVec<[Check<'_>; 4]> = up.iter().map(|&i| checks[i]).collect();
        let (owned_up, up_limit) = match self.policy {
            FailurePolicy::LocalFallback => (owned(&up), None),
            _ => (Vec::new(), lowest(&up)),
        };
        let down_limit = lowest(down).unwrap_or(0);
        let first_down = down.first().copied().unwrap_or(0);
        let started = if METRICS { self.breaker.now() } else { 0 };
        let call = self.store.check_all(&healthy);
        let shared = Arc::clone(self);
        ResilientFuture {
            inner: Box::pin(async move {
                let mut permits = permits;
                let answer = tokio::time::timeout(shared.timeout, call).await;
                if METRICS {
                    let took = shared.breaker.now().saturating_sub(started);
                    shared.telemetry.duration.record_nanos(took);
                }
                let error = match answer {
                    Ok(Ok(d)) => {
                        if d.reached_backend() {
                            shared.success(&permits);
                        } else {
                            release(&mut permits);
                        }
                        let d = renumber(d, &up);
                        if !d.allowed() {
                            // Refused where it lives: nothing consumed by the store. (The
                            // fallback's part, if any, stays taken: an over-rejection.)
                            return Ok(d);
                        }
                        let other = match fallback {
                            Some(f) => f,
                            None => {
                                // Open: the down parts are admitted by the policy.
                                shared.policy_admitted_open();
                                Decision::admitted(down_limit, down_limit, Duration::ZERO)
                                    .with_index(first_down)
                            }
                        };
                        let cost = |d: &Decision| costs.get(d.index()).copied().unwrap_or(0);
                        let tightest =
                            crate::decision::tighter((d, cost(&d)), (other, cost(&other))).0;
                        return Ok(tightest.by_failure_policy());
                    }
                    Ok(Err(
                        e @ (StoreError::CostExceedsLimit { .. }
                        | StoreError::KeyTooLong { .. }
                        | StoreError::Unsupported { .. }),
                    )) => {
                        release(&mut permits);
                        shared.telemetry.error(&e);
                        return Err(e);
                    }
                    Ok(Err(e @ StoreError::Busy(_))) => {
                        release(&mut permits);
                        shared.telemetry.error(&e);
                        e
                    }
                    Ok(Err(e)) => {
                        shared.failure(&mut permits, sent, &e);
                        e
                    }
                    Err(_) => {
                        let e = StoreError::Timeout(shared.timeout);
                        shared.failure(&mut permits, sent, &e);
                        e
                    }
                };
                // The parts that are up failed too: their checks take the policy as well.
                let d = shared.on_failure(error, &owned_up, up_limit)?;
                let d = renumber(d, &up);
                match fallback {
                    Some(f) if d.allowed() => {
                        let cost = |d: &Decision| costs.get(d.index()).copied().unwrap_or(0);
                        Ok(crate::decision::tighter((d, cost(&d)), (f, cost(&f)))
                            .0
                            .by_failure_policy())
                    }
                    _ => Ok(d),
                }
            }),
        }
    }

    /// A request admitted in part by [`FailurePolicy::Open`].
    fn policy_admitted_open(&self) {
        if let Some(hook) = &self.hook {
            hook(&StoreError::CircuitOpen);
        }
        self.telemetry.action.increment(1);
        self.counters.failed_open.fetch_add(1, Ordering::Relaxed);
    }

    /// The gate of part `part`, made on first use (the store's own while
    /// [`MAX_PARTITION_BREAKERS`] parts have one), marked used at `now`.
    fn part(&self, part: u32, now: u64) -> Arc<Gate> {
        self.prune(now);
        if let Some(gate) = self.parts.read().get(&part) {
            gate.used.store(now, Ordering::Relaxed);
            return Arc::clone(gate);
        }
        let mut parts = self.parts.write();
        if let Some(gate) = parts.get(&part) {
            gate.used.store(now, Ordering::Relaxed);
            return Arc::clone(gate);
        }
        if parts.len() >= MAX_PARTITION_BREAKERS {
            self.whole.used.store(now, Ordering::Relaxed);
            return Arc::clone(&self.whole);
        }
        self.partitioned.store(true, Ordering::Relaxed);
        let breaker = Breaker::new(TokioClock::new(), self.threshold, self.open_for);
        // Each part's breaker is reported as `<store>:<part>`.
        #[cfg(any(feature = "metrics", feature = "tracing"))]
        let breaker = breaker.observe(crate::breaker::observer(
            crate::breaker::Role::Store,
            &Arc::from(format!("{}:{part}", self.name)),
            self.open_for,
        ));
        let gate = Arc::new(Gate::new(Arc::new(breaker), now));
        parts.insert(part, Arc::clone(&gate));
        gate
    }

    /// A call that reached the store succeeded: each of its gates closes (or stays closed).
    fn success(&self, permits: &Permits) {
        let now = if permits.len() > 1 || self.partitioned.load(Ordering::Relaxed) {
            self.breaker.now()
        } else {
            0
        };
        for (gate, permit, _) in permits {
            gate.breaker.success(*permit);
            gate.succeeded.fetch_max(now, Ordering::Relaxed);
        }
    }

    /// A call that reached the store, sent at `sent`, failed with `error`. A call across
    /// parts counts against each part that has not answered another call since it was sent
    /// (the others answer: the failure was not theirs), handing their probes on.
    fn failure(&self, permits: &mut Permits, sent: u64, error: &StoreError) {
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
        if matches!(error, StoreError::Timeout(_)) {
            self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
        }
        self.telemetry.error(error);
        // Without the `tracing` feature both events are nothing.
        #[cfg_attr(not(feature = "tracing"), allow(clippy::if_same_then_else))]
        if self.warned.now(self.breaker.now()) {
            crate::telemetry::event!(
                warn,
                name: "tollgate.store.failed",
                parent: None,
                store = &*self.name,
                kind = ERROR_KINDS[error_kind(error)],
                error = %error,
                "the rate-limit store failed (at most one such WARN a second; the others at DEBUG)"
            );
        } else {
            crate::telemetry::event!(
                debug,
                name: "tollgate.store.failed",
                parent: None,
                store = &*self.name,
                kind = ERROR_KINDS[error_kind(error)],
                error = %error,
                "the rate-limit store failed"
            );
        }
        let across = permits.len() > 1;
        for (gate, permit, guard) in permits {
            if across && gate.succeeded.load(Ordering::Relaxed) > sent {
                guard.release();
                continue;
            }
            if gate.breaker.failure(*permit) {
                self.counters.breaker_opened.fetch_add(1, Ordering::Relaxed);
            }
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
        self.telemetry.action.increment(1);
        match self.policy {
            FailurePolicy::Closed => Err(error),
            FailurePolicy::Open => {
                self.counters.failed_open.fetch_add(1, Ordering::Relaxed);
                let admitted = match open_limit {
                    Some(limit) => Decision::admitted(limit, limit, Duration::ZERO),
                    None => NOTHING_TO_CHECK,
                };
                Ok(admitted.by_failure_policy())
            }
            FailurePolicy::LocalFallback => {
                self.counters
                    .fallback_decisions
                    .fetch_add(1, Ordering::Relaxed);
                let checks: Vec<Check<'_>> = owned
                    .iter()
                    .map(|(k, p, c)| Check::new(k, p, (*c).min(p.limit())))
                    .collect();
                self.fallback
                    .check_all_now(&checks)
                    .map(Decision::by_failure_policy)
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

/// A breaker of the store or of one of its parts, with when a call last went through it and
/// when one last succeeded (breaker clock, ns; kept only once a part has been named).
struct Gate {
    breaker: Arc<Breaker<TokioClock>>,
    used: AtomicU64,
    succeeded: AtomicU64,
}

impl Gate {
    fn new(breaker: Arc<Breaker<TokioClock>>, now: u64) -> Self {
        Self {
            breaker,
            used: AtomicU64::new(now),
            succeeded: AtomicU64::new(0),
        }
    }
}

/// The gates a call goes through, each with its permit and the guard of its probe.
type Permits = SmallVec<[(Arc<Gate>, Permit, ProbeGuard<TokioClock>); 1]>;

/// Asks `gate` for a permit, guarding its probe (if it is one) from the start.
fn push_permit(permits: &mut Permits, gate: &Arc<Gate>) {
    let permit = gate.breaker.permit();
    let guard = ProbeGuard::new(Arc::clone(&gate.breaker), permit);
    permits.push((Arc::clone(gate), permit, guard));
}

/// The call got an answer that says nothing of the backend (or will not be made): any probe
/// it held goes to the next call.
fn release(permits: &mut Permits) {
    for (_, _, guard) in permits {
        guard.release();
    }
}

/// `d`, a decision on the checks `of` (by index) of a stack, numbered as in the whole stack.
fn renumber(d: Decision, of: &[usize]) -> Decision {
    match of.get(d.index()) {
        Some(&i) => d.with_index(i),
        None => d,
    }
}

/// A policy allowing a `n`-th of `policy`: the limit (or burst) divided, at least 1, and for a
/// bucket the rate divided too, saturated at the slowest rate a bucket of that burst can have
/// (burst times interval at most `u64::MAX` ns, about 584 years).
fn divide(policy: &Policy, n: u64) -> Option<Policy> {
    let limit = (policy.limit() / n).max(1);
    let period = policy.interval();
    let share = || {
        let interval = policy
            .period_nanos()
            .saturating_mul(n)
            .min(u64::MAX / limit);
        Rate::new(1, Duration::from_nanos(interval))
    };
    let p = match policy.algorithm() {
        Algorithm::FixedWindow => Policy::fixed_window(limit, period),
        Algorithm::SlidingLog => Policy::sliding_log(limit, period),
        Algorithm::SlidingWindow => Policy::sliding_window(limit, period),
        Algorithm::TokenBucket => Policy::token_bucket(share(), limit),
        Algorithm::LeakyBucket => Policy::leaky_bucket(share(), limit),
        Algorithm::Gcra => Policy::gcra(share(), limit),
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

    fn partition(&self, check: &Check<'_>) -> Option<u32> {
        self.shared.store.partition(check)
    }

    /// The inner store's bound, or the fallback store's where that is shorter (the fallback
    /// decides the same keys).
    fn max_key_len(&self) -> Option<usize> {
        let inner = self.shared.store.max_key_len();
        let fallback = self.shared.fallback.max_key_len();
        match (inner, fallback) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
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
    name: String,
}

impl<S> fmt::Debug for ResilientStoreBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResilientStoreBuilder")
            .field("name", &self.name)
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

    /// The store's name in metrics (the `store` label) and logs ([`DEFAULT_STORE_NAME`]
    /// unless set): give each `ResilientStore` of a process its own.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
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
    /// before each probe (defaults 5 and 1 s). An `open_for` too long for the clock to add
    /// (`Duration::MAX`, say) saturates: once open, the breaker never probes again.
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
    /// costing more than the divided limit is charged the divided limit. Any `u64` is taken
    /// as it is; a bucket's divided rate saturates at the slowest one its divided burst can
    /// have (burst times interval at most `u64::MAX` ns, about 584 years).
    pub fn fallback_instances(mut self, instances: u64) -> Self {
        self.instances = instances.max(1);
        self
    }

    /// Builds the store, and registers its metrics (feature `metrics`: install the recorder
    /// first).
    pub fn build(self) -> ResilientStore<S> {
        let name: Arc<str> = self.name.as_str().into();
        let breaker = Breaker::new(TokioClock::new(), self.threshold, self.open_for);
        #[cfg(any(feature = "metrics", feature = "tracing"))]
        let breaker = breaker.observe(crate::breaker::observer(
            crate::breaker::Role::Store,
            &name,
            self.open_for,
        ));
        let breaker = Arc::new(breaker);
        let fallback = self.fallback.unwrap_or_else(|| {
            MemoryStore::builder()
                .name(format!("{name}-fallback"))
                .build()
        });
        ResilientStore {
            shared: Arc::new(Shared {
                telemetry: Telemetry::new(&name, self.policy),
                name,
                store: self.store,
                timeout: self.timeout,
                policy: self.policy,
                whole: Arc::new(Gate::new(Arc::clone(&breaker), 0)),
                breaker,
                parts: RwLock::new(HashMap::new()),
                partitioned: AtomicBool::new(false),
                pruned_at: AtomicU64::new(0),
                idle: u64::try_from(self.open_for.saturating_mul(10).max(PART_IDLE).as_nanos())
                    .unwrap_or(u64::MAX),
                threshold: self.threshold,
                open_for: self.open_for,
                fallback,
                instances: self.instances,
                hook: self.hook,
                divided: Mutex::new(HashMap::new()),
                counters: Counters::default(),
                warned: Default::default(),
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
    /// Rejects without reaching the backend, as the Redis store's deny cache does.
    const LOCAL: u8 = 3;
    /// A caller error, found without reaching the backend.
    const CALLER: u8 = 4;
    /// Panics in `check_all` itself.
    const PANIC: u8 = 5;
    /// Panics when its future is polled.
    const PANIC_POLL: u8 = 6;
    /// Waits for [`Fake::open_gate`], then answers as [`Fake::then`] says.
    const GATED: u8 = 7;

    /// A store that answers as told, and counts its calls.
    #[derive(Clone)]
    struct Fake {
        mode: Arc<AtomicU8>,
        then: Arc<AtomicU8>,
        gate: Arc<tokio::sync::Semaphore>,
        calls: Arc<AtomicU64>,
    }

    impl Default for Fake {
        fn default() -> Self {
            Self {
                mode: Arc::default(),
                then: Arc::default(),
                gate: Arc::new(tokio::sync::Semaphore::new(0)),
                calls: Arc::default(),
            }
        }
    }

    impl Fake {
        fn set(&self, mode: u8) {
            self.mode.store(mode, Ordering::SeqCst);
        }
        /// What gated calls answer once the gate opens.
        fn then(&self, mode: u8) {
            self.then.store(mode, Ordering::SeqCst);
        }
        /// Lets one gated call answer.
        fn open_gate(&self) {
            self.gate.add_permits(1);
        }
        fn calls(&self) -> u64 {
            self.calls.load(Ordering::SeqCst)
        }
    }

    fn answer(mode: u8, limit: u64) -> Result<Decision, StoreError> {
        match mode {
            OK => Ok(Decision::admitted(limit, 0, Duration::ZERO)),
            FAIL => Err(StoreError::Backend("down".into())),
            LOCAL => {
                Ok(
                    Decision::rejected(limit, 0, Duration::from_secs(1), Duration::from_secs(1))
                        .without_backend(),
                )
            }
            CALLER => Err(StoreError::CostExceedsLimit {
                index: 0,
                cost: limit + 1,
                limit,
            }),
            other => unreachable!("no immediate answer for mode {other}"),
        }
    }

    impl Store for Fake {
        type Future = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>;

        fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let limit = checks[0].policy().limit();
            match self.mode.load(Ordering::SeqCst) {
                HANG => Box::pin(std::future::pending()),
                PANIC => panic!("the store panicked"),
                PANIC_POLL => Box::pin(async { panic!("the store's future panicked") }),
                GATED => {
                    let (gate, then) = (Arc::clone(&self.gate), Arc::clone(&self.then));
                    Box::pin(async move {
                        gate.acquire().await.unwrap().forget();
                        answer(then.load(Ordering::SeqCst), limit)
                    })
                }
                mode => Box::pin(std::future::ready(answer(mode, limit))),
            }
        }
    }

    fn policy() -> Policy {
        Policy::fixed_window(4, Duration::from_secs(60)).unwrap()
    }

    /// A store of two parts, as a Cluster of two masters: keys `a:*` are part 1, which hangs
    /// while `down` is set; every other key is part 2, which always answers.
    #[derive(Clone, Default)]
    struct Parted {
        down: Arc<std::sync::atomic::AtomicBool>,
        calls: Arc<AtomicU64>,
    }

    impl Store for Parted {
        type Future = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>;

        fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let touches_a = checks.iter().any(|c| self.partition(c) == Some(1));
            if touches_a && self.down.load(Ordering::SeqCst) {
                return Box::pin(std::future::pending());
            }
            Box::pin(std::future::ready(answer(OK, 4)))
        }

        fn partition(&self, check: &Check<'_>) -> Option<u32> {
            Some(if check.key().starts_with("a:") { 1 } else { 2 })
        }
    }

    /// A store whose parts are named by a key's prefix before `:` (`p7:x` is part 7; a key
    /// without a number, no part), with a set of parts that hang, and one that answers
    /// `Busy` for every call while `busy` is set.
    #[derive(Clone, Default)]
    struct Routed {
        down: Arc<Mutex<Vec<u32>>>,
        busy: Arc<std::sync::atomic::AtomicBool>,
        calls: Arc<AtomicU64>,
    }

    impl Store for Routed {
        type Future = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>;

        fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.busy.load(Ordering::SeqCst) {
                return Box::pin(std::future::ready(Err(StoreError::Busy("full".into()))));
            }
            let down = self.down.lock();
            if checks
                .iter()
                .any(|c| self.partition(c).is_some_and(|p| down.contains(&p)))
            {
                return Box::pin(std::future::pending());
            }
            Box::pin(std::future::ready(answer(OK, 4)))
        }

        fn partition(&self, check: &Check<'_>) -> Option<u32> {
            check
                .key()
                .strip_prefix('p')?
                .split(':')
                .next()?
                .parse()
                .ok()
        }
    }

    fn routed(store: &Routed) -> ResilientStore<Routed> {
        ResilientStore::builder(store.clone())
            .timeout(Duration::from_millis(100))
            .breaker(3, Duration::from_secs(1))
            .build()
    }

    /// A stack across a hung part and a healthy one that answers its own keys counts against
    /// the hung part only: the healthy part's breaker stays closed.
    #[tokio::test(start_paused = true)]
    async fn a_stack_across_parts_fails_only_the_part_that_fails() {
        let store = Routed::default();
        let s = routed(&store);
        let p = policy();
        store.down.lock().push(1);
        let both = [Check::new("p1:a", &p, 1), Check::new("p2:a", &p, 1)];
        // Three stacks out at once, failing together after part 2 answered its own key.
        let (a, b, c, own) = tokio::join!(
            s.check_all(&both),
            s.check_all(&both),
            s.check_all(&both),
            async {
                tokio::time::sleep(Duration::from_millis(10)).await;
                s.check("p2:b", &p, 1).await
            }
        );
        assert!(a.is_err() && b.is_err() && c.is_err());
        assert!(own.unwrap().allowed());
        let states = s.breaker_states();
        assert!(
            states.contains(&(Some(1), BreakerStatus::Open)),
            "{states:?}"
        );
        assert!(
            states.contains(&(Some(2), BreakerStatus::Closed)),
            "{states:?}"
        );
        assert!(s.check("p2:c", &p, 1).await.unwrap().allowed());
    }

    /// A part no call goes to any more (its master replaced in a failover) loses its breaker
    /// after a while, closed first: its last state is not reported for ever.
    #[tokio::test(start_paused = true)]
    async fn a_part_that_left_does_not_stay_open() {
        let store = Routed::default();
        let s = routed(&store);
        let p = policy();
        store.down.lock().push(1);
        for _ in 0..3 {
            assert!(s.check("p1:a", &p, 1).await.is_err());
        }
        assert_eq!(s.breaker_state(), BreakerStatus::Open);
        // The keys now go to part 3; part 1 is never asked again.
        for _ in 0..70 {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert!(s.check("p3:a", &p, 1).await.unwrap().allowed());
        }
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
        assert_eq!(
            s.breaker_states(),
            vec![
                (None, BreakerStatus::Closed),
                (Some(3), BreakerStatus::Closed)
            ]
        );
    }

    /// Parts beyond the bound share the store's breaker, and a call across two of them takes
    /// its permit once: one failure is one failure.
    #[tokio::test(start_paused = true)]
    async fn parts_beyond_the_bound_share_the_stores_breaker_once() {
        let store = Routed::default();
        let s = routed(&store);
        let p = policy();
        for part in 0..MAX_PARTITION_BREAKERS as u32 {
            assert!(s.check(&format!("p{part}:a"), &p, 1).await.is_ok());
        }
        store.down.lock().extend([1000, 1001]);
        let both = [Check::new("p1000:a", &p, 1), Check::new("p1001:a", &p, 1)];
        assert!(matches!(
            s.check_all(&both).await,
            Err(StoreError::Timeout(_))
        ));
        assert!(matches!(
            s.check_all(&both).await,
            Err(StoreError::Timeout(_))
        ));
        // Two failures of a threshold of three: still closed.
        assert_eq!(s.breaker_states()[0], (None, BreakerStatus::Closed));
        assert!(matches!(
            s.check_all(&both).await,
            Err(StoreError::Timeout(_))
        ));
        assert_eq!(s.breaker_states()[0], (None, BreakerStatus::Open));
    }

    /// A store too busy to take the call (its own bound, not its backend) takes the failure
    /// policy, and no breaker counts it.
    #[tokio::test(start_paused = true)]
    async fn a_busy_store_moves_no_breaker() {
        let store = Routed::default();
        let s = ResilientStore::builder(store.clone())
            .breaker(1, Duration::from_secs(1))
            .failure_policy(FailurePolicy::Open)
            .build();
        let p = policy();
        store.busy.store(true, Ordering::SeqCst);
        for key in ["p1:a", "k"] {
            for _ in 0..5 {
                let d = s.check(key, &p, 1).await.unwrap();
                assert!(d.allowed());
            }
        }
        assert_eq!(s.stats().failed_open, 10);
        assert_eq!(s.stats().failures, 0);
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
        store.busy.store(false, Ordering::SeqCst);
        assert_eq!(store.calls.load(Ordering::SeqCst), 10);
    }

    /// One part down opens only its own breaker: the other part's keys are decided by the
    /// store throughout, a stack that spans both takes the failure policy, and the part's
    /// probe closes its breaker when it answers again.
    #[tokio::test(start_paused = true)]
    async fn one_part_down_opens_only_its_own_breaker() {
        let parted = Parted::default();
        let s = ResilientStore::builder(parted.clone())
            .timeout(Duration::from_millis(100))
            .breaker(3, Duration::from_secs(1))
            .build();
        let p = policy();
        parted.down.store(true, Ordering::SeqCst);
        for _ in 0..3 {
            assert!(matches!(
                s.check("a:1", &p, 1).await,
                Err(StoreError::Timeout(_))
            ));
        }
        let calls = parted.calls.load(Ordering::SeqCst);
        for i in 0..50 {
            // Part 1 is not asked; part 2 is, and answers, every time.
            assert!(matches!(
                s.check(&format!("a:{i}"), &p, 1).await,
                Err(StoreError::CircuitOpen)
            ));
            assert!(s.check(&format!("b:{i}"), &p, 1).await.unwrap().allowed());
            let both = [Check::new("a:1", &p, 1), Check::new("b:1", &p, 1)];
            assert!(matches!(
                s.check_all(&both).await,
                Err(StoreError::CircuitOpen)
            ));
        }
        assert_eq!(parted.calls.load(Ordering::SeqCst), calls + 50);
        assert_eq!(
            s.breaker_states(),
            vec![
                (None, BreakerStatus::Closed),
                (Some(1), BreakerStatus::Open),
                (Some(2), BreakerStatus::Closed)
            ]
        );
        assert_eq!(s.breaker_state(), BreakerStatus::Open);
        assert_eq!(s.stats().breaker_opened, 1);
        // Part 1 answers again: its probe closes its breaker, and stacks go through.
        tokio::time::advance(Duration::from_secs(1)).await;
        parted.down.store(false, Ordering::SeqCst);
        assert!(s.check("a:1", &p, 1).await.unwrap().allowed());
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
        let both = [Check::new("a:1", &p, 1), Check::new("b:1", &p, 1)];
        assert!(s.check_all(&both).await.unwrap().allowed());
    }

    /// A store of two parts over one in-process store: keys `a:*` are part 1, which hangs
    /// while `down` is set; every other key is part 2, which the in-process store decides
    /// (and charges).
    #[derive(Clone, Default)]
    struct Halves {
        memory: MemoryStore,
        down: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Store for Halves {
        type Future = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>;

        fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
            let touches_a = checks.iter().any(|c| self.partition(c) == Some(1));
            if touches_a && self.down.load(Ordering::SeqCst) {
                return Box::pin(std::future::pending());
            }
            Box::pin(std::future::ready(self.memory.check_all_now(checks)))
        }

        fn partition(&self, check: &Check<'_>) -> Option<u32> {
            Some(if check.key().starts_with("a:") { 1 } else { 2 })
        }
    }

    /// A stack across a healthy part and one whose breaker is open: the healthy part's check
    /// is decided (and charged) where it lives, only the down part's takes the failure
    /// policy, and the stack stays all or nothing. Under every policy, a tenant limit of 5 on
    /// the healthy part, spent before the other part went down, admits nothing more. (The
    /// whole stack used to go to the failure policy: the fallback admitted 5 more, failing
    /// open 10 of 10.)
    #[tokio::test(start_paused = true)]
    async fn a_stack_across_a_down_part_is_decided_where_its_parts_live() {
        for policy in [
            FailurePolicy::LocalFallback,
            FailurePolicy::Open,
            FailurePolicy::Closed,
        ] {
            let halves = Halves::default();
            let s = ResilientStore::builder(halves.clone())
                .timeout(Duration::from_millis(100))
                .breaker(2, Duration::from_secs(60))
                .failure_policy(policy)
                .build();
            let tenant = Policy::fixed_window(5, Duration::from_secs(3600)).unwrap();
            let user = Policy::fixed_window(100, Duration::from_secs(3600)).unwrap();
            for _ in 0..5 {
                assert!(s.check("b:tenant", &tenant, 1).await.unwrap().allowed());
            }
            halves.down.store(true, Ordering::SeqCst);
            for _ in 0..2 {
                assert!(
                    s.check("a:user", &user, 1).await.is_err() || policy != FailurePolicy::Closed
                );
            }
            assert!(
                s.breaker_states().contains(&(Some(1), BreakerStatus::Open)),
                "{policy:?}"
            );
            let stack = [
                Check::new("a:user", &user, 1),
                Check::new("b:tenant", &tenant, 1),
            ];
            let mut admitted = 0;
            for _ in 0..10 {
                match s.check_all(&stack).await {
                    Ok(d) if d.allowed() => admitted += 1,
                    Ok(d) => {
                        assert_eq!(d.index(), 1, "{policy:?}: the tenant's limit refused");
                        assert!(d.reached_backend(), "{policy:?}: refused where it lives");
                    }
                    Err(e) => {
                        assert_eq!(policy, FailurePolicy::Closed, "{e:?}");
                        assert!(matches!(e, StoreError::CircuitOpen));
                    }
                }
            }
            assert_eq!(admitted, 0, "{policy:?}: the spent tenant admitted more");

            // A tenant with room: admitted where it lives, and charged there; the down part
            // by the policy (a refusal under Closed, charging nothing).
            let roomy = Policy::fixed_window(5, Duration::from_secs(60)).unwrap();
            let stack = [
                Check::new("a:user", &user, 1),
                Check::new("b:other", &roomy, 1),
            ];
            let d = s.check_all(&stack).await;
            let left = halves
                .memory
                .check_now("b:other", &roomy, 0)
                .unwrap()
                .remaining();
            match policy {
                FailurePolicy::Closed => {
                    assert!(matches!(d, Err(StoreError::CircuitOpen)));
                    assert_eq!(left, 5, "nothing charged");
                }
                _ => {
                    let d = d.unwrap();
                    assert!(d.allowed() && d.is_failure_policy(), "{policy:?}: {d:?}");
                    assert_eq!(left, 4, "{policy:?}: charged where it lives");
                }
            }
            // The healthy part's breaker stays closed throughout.
            assert!(
                s.breaker_states()
                    .contains(&(Some(2), BreakerStatus::Closed)),
                "{policy:?}"
            );
        }
    }

    /// Under the local fallback, a down part's check that the fallback refuses refuses the
    /// stack without asking the store (nothing charged where the other parts live); and
    /// when the healthy part fails too, its checks go to the fallback as well.
    #[tokio::test(start_paused = true)]
    async fn a_split_stack_under_the_fallback_stays_all_or_nothing() {
        let halves = Halves::default();
        let s = ResilientStore::builder(halves.clone())
            .timeout(Duration::from_millis(100))
            .breaker(1, Duration::from_secs(60))
            .failure_policy(FailurePolicy::LocalFallback)
            .build();
        let one = Policy::fixed_window(1, Duration::from_secs(3600)).unwrap();
        let roomy = Policy::fixed_window(100, Duration::from_secs(3600)).unwrap();
        halves.down.store(true, Ordering::SeqCst);
        // The failure opens part 1's breaker; the fallback decided it (and took its unit).
        assert!(s.check("a:user", &one, 1).await.unwrap().allowed());
        let stack = [
            Check::new("a:user", &one, 1),
            Check::new("b:tenant", &roomy, 1),
        ];
        let d = s.check_all(&stack).await.unwrap();
        assert!(
            !d.allowed() && d.index() == 0 && d.is_failure_policy(),
            "{d:?}"
        );
        let left = halves
            .memory
            .check_now("b:tenant", &roomy, 0)
            .unwrap()
            .remaining();
        assert_eq!(left, 100, "the store was not asked");
        assert_eq!(s.stats().fallback_decisions, 2);
    }

    /// The bound stated at [`FailurePolicy::LocalFallback`]: a switch to the fallback and
    /// back within one window admits the limit twice (once counted by the store, once by
    /// the fallback), never more; with two instances each falling back to half the limit,
    /// at most twice the limit in all.
    #[tokio::test(start_paused = true)]
    async fn the_fallback_and_the_store_admit_at_most_twice_the_limit_in_a_window() {
        for instances in [1, 2] {
            let halves = Halves::default();
            let fleet: Vec<ResilientStore<Halves>> = (0..instances)
                .map(|_| {
                    ResilientStore::builder(halves.clone())
                        .timeout(Duration::from_millis(100))
                        .breaker(1, Duration::from_secs(1))
                        .failure_policy(FailurePolicy::LocalFallback)
                        .fallback_instances(instances)
                        .build()
                })
                .collect();
            let p = Policy::fixed_window(6, Duration::from_secs(3600)).unwrap();
            let mut admitted = 0;
            let round = async |admitted: &mut u64| {
                for s in &fleet {
                    for _ in 0..20 {
                        if s.check("a:k", &p, 1).await.unwrap().allowed() {
                            *admitted += 1;
                        }
                    }
                }
            };
            // Up, down (the fallback decides), up again (the probe, then the store).
            round(&mut admitted).await;
            halves.down.store(true, Ordering::SeqCst);
            round(&mut admitted).await;
            tokio::time::advance(Duration::from_secs(1)).await;
            halves.down.store(false, Ordering::SeqCst);
            round(&mut admitted).await;
            assert!(fleet.iter().all(|s| s.stats().fallback_decisions > 0));
            assert_eq!(admitted, 12, "{instances} instances: the limit of 6 twice");
        }
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
    async fn a_dropped_probe_reopens_the_breaker_for_open_for() {
        let fake = Fake::default();
        let s = store(&fake, FailurePolicy::Closed);
        let p = policy();
        fake.set(FAIL);
        for _ in 0..3 {
            assert!(s.check("k", &p, 1).await.is_err());
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        // The probe's caller goes away before the answer: the store may be hanging, so the
        // next call does not probe at once.
        drop(s.check("k", &p, 1));
        assert_eq!(s.breaker_state(), BreakerStatus::Open);
        fake.set(OK);
        assert!(matches!(
            s.check("k", &p, 1).await,
            Err(StoreError::CircuitOpen)
        ));
        tokio::time::advance(Duration::from_secs(1)).await;
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

    /// Opens the breaker of `s` (threshold 3) with three backend errors.
    async fn open(s: &ResilientStore<Fake>, fake: &Fake, p: &Policy) {
        fake.set(FAIL);
        let failures = s.stats().failures;
        for _ in 0..3 {
            let _ = s.check("k", p, 1).await;
        }
        assert_eq!(s.stats().failures, failures + 3);
        assert_eq!(s.breaker_state(), BreakerStatus::Open);
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_answered_without_the_backend_leaves_the_next_probe_due() {
        let fake = Fake::default();
        let s = store(&fake, FailurePolicy::Closed);
        let p = policy();
        open(&s, &fake, &p).await;
        tokio::time::advance(Duration::from_secs(1)).await;
        // The probe is answered by a local cache: passed on, but the store may still be down.
        fake.set(LOCAL);
        let d = s.check("k", &p, 1).await.unwrap();
        assert!(!d.allowed() && !d.reached_backend());
        // Not closed: still half open (no change to log), the next probe due at once.
        assert_eq!(s.breaker_state(), BreakerStatus::HalfOpen);
        // The next call probes at once, alone, and pays one timeout, not one per call.
        fake.set(HANG);
        let started = Instant::now();
        let probe = s.check("k", &p, 1);
        assert_eq!(s.breaker_state(), BreakerStatus::HalfOpen);
        assert!(matches!(
            s.check("k", &p, 1).await,
            Err(StoreError::CircuitOpen)
        ));
        assert!(matches!(probe.await, Err(StoreError::Timeout(_))));
        assert_eq!(s.breaker_state(), BreakerStatus::Open);
        assert!(matches!(
            s.check("k", &p, 1).await,
            Err(StoreError::CircuitOpen)
        ));
        assert_eq!(started.elapsed(), Duration::from_millis(100));
        assert_eq!(fake.calls(), 5);
        // A caller error as the probe closes nothing either.
        tokio::time::advance(Duration::from_secs(1)).await;
        fake.set(CALLER);
        assert!(matches!(
            s.check("k", &p, 1).await,
            Err(StoreError::CostExceedsLimit { .. })
        ));
        assert_eq!(s.breaker_state(), BreakerStatus::HalfOpen);
        fake.set(OK);
        assert!(s.check("k", &p, 1).await.unwrap().allowed());
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
        assert_eq!(s.stats().failures, 4);
    }

    #[tokio::test(start_paused = true)]
    async fn answers_without_the_backend_do_not_reset_the_failure_count() {
        for between in [LOCAL, CALLER] {
            let fake = Fake::default();
            let s = store(&fake, FailurePolicy::Closed);
            let p = policy();
            for _ in 0..2 {
                fake.set(FAIL);
                assert!(s.check("k", &p, 1).await.is_err());
                fake.set(between);
                let _ = s.check("k", &p, 1).await;
                assert_eq!(s.breaker_state(), BreakerStatus::Closed);
            }
            fake.set(FAIL);
            assert!(s.check("k", &p, 1).await.is_err());
            assert_eq!(s.breaker_state(), BreakerStatus::Open, "mode {between}");
            assert!(matches!(
                s.check("k", &p, 1).await,
                Err(StoreError::CircuitOpen)
            ));
            // An answer from the backend does reset it.
            let s = store(&fake, FailurePolicy::Closed);
            for _ in 0..2 {
                fake.set(FAIL);
                assert!(s.check("k", &p, 1).await.is_err());
                fake.set(OK);
                assert!(s.check("k", &p, 1).await.is_ok());
            }
            fake.set(FAIL);
            assert!(s.check("k", &p, 1).await.is_err());
            assert_eq!(s.breaker_state(), BreakerStatus::Closed);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_probe_reopens_the_breaker() {
        let fake = Fake::default();
        let s = store(&fake, FailurePolicy::Closed);
        let p = policy();
        open(&s, &fake, &p).await;
        tokio::time::advance(Duration::from_secs(1)).await;
        // In the store's check_all itself, before any future exists.
        fake.set(PANIC);
        let panicked =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.check("k", &p, 1)));
        assert!(panicked.is_err());
        assert_eq!(s.breaker_state(), BreakerStatus::Open);
        tokio::time::advance(Duration::from_secs(1)).await;
        // In the store's future.
        fake.set(PANIC_POLL);
        let task = tokio::spawn(s.check("k", &p, 1));
        assert!(task.await.unwrap_err().is_panic());
        assert_eq!(s.breaker_state(), BreakerStatus::Open);
        tokio::time::advance(Duration::from_secs(1)).await;
        fake.set(OK);
        assert!(s.check("k", &p, 1).await.unwrap().allowed());
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
        assert_eq!(fake.calls(), 6);
    }

    /// A call sent before the breaker opened cannot close it with its late answer: only the
    /// probe speaks for the store once it is open.
    #[tokio::test(start_paused = true)]
    async fn a_late_success_does_not_close_an_open_breaker() {
        let fake = Fake::default();
        let s = store(&fake, FailurePolicy::Open);
        let p = policy();
        fake.set(GATED);
        fake.then(OK);
        let slow = s.check("k", &p, 1);
        open(&s, &fake, &p).await;
        tokio::time::advance(Duration::from_secs(1)).await;
        fake.set(HANG);
        let probe = s.check("k", &p, 1);
        assert_eq!(s.breaker_state(), BreakerStatus::HalfOpen);
        fake.open_gate();
        assert!(slow.await.unwrap().reached_backend());
        assert_eq!(s.breaker_state(), BreakerStatus::HalfOpen);
        // The probe's caller goes away: open again, for the whole of open_for.
        drop(probe);
        assert_eq!(s.breaker_state(), BreakerStatus::Open);
        tokio::time::advance(Duration::from_secs(1)).await;
        fake.set(OK);
        let d = s.check("k", &p, 1).await.unwrap();
        assert!(d.reached_backend());
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
    }

    /// A call sent before the breaker opened cannot open it again with its late failure once
    /// a probe has closed it (a store slower than open_for would otherwise flap the breaker).
    #[tokio::test(start_paused = true)]
    async fn a_late_failure_does_not_reopen_a_closed_breaker() {
        let fake = Fake::default();
        let s = store(&fake, FailurePolicy::Closed);
        let p = policy();
        let mut slow = Vec::new();
        fake.set(GATED);
        fake.then(FAIL);
        for _ in 0..3 {
            slow.push(s.check("k", &p, 1));
        }
        open(&s, &fake, &p).await;
        tokio::time::advance(Duration::from_secs(1)).await;
        fake.set(OK);
        assert!(s.check("k", &p, 1).await.unwrap().allowed());
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
        fake.open_gate();
        for call in slow {
            // Timed out while the breaker was open, or failed: late either way.
            assert!(call.await.is_err());
        }
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
        // And they do not count toward the next opening either.
        fake.set(FAIL);
        for _ in 0..2 {
            let _ = s.check("k", &p, 1).await;
        }
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
    }

    /// The caller's mistakes are its own even while the breaker is open: not admitted by the
    /// failure policy.
    #[tokio::test(start_paused = true)]
    async fn caller_errors_are_answered_while_the_breaker_is_open() {
        let fake = Fake::default();
        let s = store(&fake, FailurePolicy::Open);
        let p = policy();
        open(&s, &fake, &p).await;
        let calls = fake.calls();
        assert!(matches!(
            s.check("k", &p, p.limit() + 1).await,
            Err(StoreError::CostExceedsLimit { .. })
        ));
        assert_eq!(fake.calls(), calls);
    }

    #[tokio::test(start_paused = true)]
    async fn an_endless_open_for_saturates_and_never_probes() {
        let fake = Fake::default();
        let s = ResilientStore::builder(fake.clone())
            .breaker(1, Duration::MAX)
            .build();
        let p = policy();
        fake.set(FAIL);
        assert!(matches!(
            s.check("k", &p, 1).await,
            Err(StoreError::Backend(_))
        ));
        assert_eq!(s.breaker_state(), BreakerStatus::Open);
        tokio::time::advance(Duration::from_secs(100 * 365 * 86_400)).await;
        fake.set(OK);
        assert!(matches!(
            s.check("k", &p, 1).await,
            Err(StoreError::CircuitOpen)
        ));
        assert_eq!(fake.calls(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn fallback_instances_beyond_u32_are_not_truncated() {
        let bucket = Policy::gcra(Rate::per_second(10), 6).unwrap();
        // 2^32 + 1 and 2^32 were once taken as 1 (no division) and 0 (no policy).
        for n in [(1 << 32) + 1, 1 << 32] {
            let share = divide(&bucket, n).unwrap();
            assert_eq!(share.limit(), 1);
            assert_eq!(share.interval(), Duration::from_nanos(100_000_000 * n));
        }
        // Beyond what a policy can hold, the slowest rate it can.
        let share = divide(&bucket, u64::MAX).unwrap();
        assert_eq!(share.interval(), Duration::from_nanos(u64::MAX));
        let fake = Fake::default();
        fake.set(HANG);
        let s = ResilientStore::builder(fake)
            .failure_policy(FailurePolicy::LocalFallback)
            .fallback_instances(1 << 32)
            .build();
        let d = s.check("k", &bucket, 1).await.unwrap();
        assert!(d.allowed() && !d.reached_backend());
        assert_eq!(d.limit(), 1);
        assert!(!s.check("k", &bucket, 1).await.unwrap().allowed());
    }

    #[test]
    fn the_divided_policies_are_cached_and_the_cache_is_bounded() {
        let s = ResilientStore::builder(Fake::default())
            .fallback_instances(2)
            .build();
        let shared = &s.shared;
        let p = policy();
        assert_eq!(shared.divided(&p).limit(), 2);
        assert_eq!(shared.divided(&p).limit(), 2);
        assert_eq!(shared.divided.lock().len(), 1);
        for limit in 1..5000 {
            let p = Policy::fixed_window(limit, Duration::from_secs(1)).unwrap();
            assert_eq!(shared.divided(&p).limit(), (limit / 2).max(1));
        }
        assert_eq!(shared.divided.lock().len(), 4096);
        // One instance: nothing to divide, nothing cached.
        let s = ResilientStore::new(Fake::default());
        assert_eq!(s.shared.divided(&p), p);
        assert!(s.shared.divided.lock().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn debug_shows_the_configuration_and_the_breaker() {
        let fake = Fake::default();
        let builder = ResilientStore::builder(fake.clone()).breaker(3, Duration::from_secs(1));
        assert!(format!("{builder:?}").contains("threshold: 3"));
        let s = builder.build();
        let p = policy();
        assert!(format!("{s:?}").contains("Closed { failures: 0 }"));
        open(&s, &fake, &p).await;
        assert!(format!("{s:?}").contains("Open { until: Some("));
        assert!(format!("{:?}", s.check("k", &p, 1)).starts_with("ResilientFuture"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_calls_send_one_probe_and_an_aborted_probe_hands_it_on() {
        let fake = Fake::default();
        let s = ResilientStore::builder(fake.clone())
            .timeout(Duration::from_secs(3600))
            .breaker(3, Duration::ZERO)
            .build();
        let p = policy();
        open(&s, &fake, &p).await;
        fake.set(HANG);
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..64 {
            let (s, p) = (s.clone(), p.clone());
            calls.spawn(async move { s.check("k", &p, 1).await });
        }
        // All but the probe answer at once (the bound only keeps a failure from hanging).
        let refused = tokio::time::timeout(Duration::from_secs(60), async {
            for _ in 0..63 {
                let r = calls.join_next().await.unwrap().unwrap();
                assert!(matches!(r, Err(StoreError::CircuitOpen)), "{r:?}");
            }
        });
        refused.await.expect("two calls reached the store");
        assert_eq!(fake.calls(), 4);
        assert_eq!(s.breaker_state(), BreakerStatus::HalfOpen);
        calls.abort_all();
        assert!(calls.join_next().await.unwrap().unwrap_err().is_cancelled());
        // Open for `open_for`, here zero: the next probe is due at once.
        assert_eq!(s.breaker_state(), BreakerStatus::HalfOpen);
        fake.set(OK);
        assert!(s.check("k", &p, 1).await.unwrap().allowed());
        assert_eq!(s.breaker_state(), BreakerStatus::Closed);
    }
}
