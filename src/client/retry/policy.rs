//! The retry policy: which answers are retried, how long to wait, and when to give up. The
//! tower layer and the reqwest middleware both decide through it.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::{HeaderMap, HeaderName, Method, StatusCode};

use super::budget::RetryBudget;
use super::random::Rng;
use crate::client::local::{GRPC_RESOURCE_EXHAUSTED, GRPC_UNAVAILABLE, grpc_status};
use crate::client::{RetryHint, ServerHints};
use crate::clock::{Clock, TokioClock};
use crate::telemetry::Counter;

/// `Idempotency-Key`: a request that carries it may be retried whatever its method.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The least spread of the random offset added to a server's hint.
const MIN_HINT_SPREAD: Duration = Duration::from_millis(100);

/// How the wait before a retry is drawn when the server gave no hint. `attempt` counts retries
/// from 0, and `ceiling = min(cap, base * 2^attempt)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Jitter {
    /// Uniform in `[0, ceiling)`: the least contention and the least total work of the four
    /// (the default).
    #[default]
    Full,
    /// Uniform in `[ceiling / 2, ceiling)`: never less than half the exponential wait.
    Equal,
    /// Uniform in `[base, 3 * previous wait)`, at most `cap` (the first previous wait is
    /// `base`): each wait grows from the last one drawn, not from the attempt number.
    Decorrelated,
    /// Exactly `ceiling`: no randomness. For tests and comparisons; clients that share one
    /// failure come back together.
    None,
}

/// Why a retry layer stopped retrying a failed request. A response it gave up on carries a
/// [`GaveUp`] in its extensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GiveUp {
    /// The request was made as many times as allowed.
    Attempts,
    /// The wait before the next attempt would end past the deadline (a server hint longer than
    /// the time left ends the retries at once).
    Deadline,
    /// The retry budget was spent.
    Budget,
    /// The server said not to retry (a negative or malformed `grpc-retry-pushback-ms`).
    Stop,
    /// The request cannot be sent again: its method is not idempotent and it has no
    /// `Idempotency-Key`, or its body cannot be replayed.
    NotReplayable,
    /// A retry layer inside this one already gave up on this answer: only the layer nearest to
    /// the failure retries, so nested layers do not multiply the load.
    Inner,
}

/// Put in the extensions of a response that a retry layer gave up on: why, and after how many
/// attempts. An outer retry layer does not retry such a response (see
/// [`RetryPolicyBuilder::retry_what_inner_layers_gave_up`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GaveUp {
    /// Why the layer stopped.
    pub reason: GiveUp,
    /// How many times the request was sent (1 when it was never retried).
    pub attempts: u32,
}

/// What a retry policy has done, counted since it was built (all its clones together).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryStats {
    /// Requests seen (first attempts).
    pub requests: u64,
    /// Retries made.
    pub retries: u64,
    /// Failures answered as they were because the attempts ran out.
    pub gave_up_attempts: u64,
    /// ... because the next attempt would have started past the deadline.
    pub gave_up_deadline: u64,
    /// ... because the retry budget was spent.
    pub gave_up_budget: u64,
    /// ... because the server said not to retry.
    pub gave_up_stop: u64,
    /// ... because the request could not be sent again.
    pub not_replayable: u64,
    /// ... because an inner retry layer had already given up on them.
    pub inner_gave_up: u64,
}

/// A setting of [`RetryPolicyBuilder`] or [`RetryBudget`] that cannot work.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryConfigError {
    /// `max_attempts` must be 1 (no retries) to 100.
    Attempts(u32),
    /// The deadline must be longer than zero.
    Deadline,
    /// The backoff's base must be longer than zero and its cap at least the base.
    Backoff {
        /// The base given.
        base: Duration,
        /// The cap given.
        cap: Duration,
    },
    /// A budget's percentage must be 0 to 1000.
    BudgetPercent(u32),
    /// A budget's window must be 100 ms to one hour.
    BudgetWindow(Duration),
}

impl fmt::Display for RetryConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Attempts(n) => write!(f, "max_attempts must be 1 to 100, not {n}"),
            Self::Deadline => f.write_str("the retry deadline must be longer than zero"),
            Self::Backoff { base, cap } => write!(
                f,
                "the backoff base must be above zero and the cap at least the base \
                 (base {base:?}, cap {cap:?})"
            ),
            Self::BudgetPercent(p) => {
                write!(f, "a retry budget's percentage must be 0 to 1000, not {p}")
            }
            Self::BudgetWindow(w) => {
                write!(
                    f,
                    "a retry budget's window must be 100 ms to one hour, not {w:?}"
                )
            }
        }
    }
}

impl std::error::Error for RetryConfigError {}

/// When to retry and how long to wait: the decisions shared by
/// [`RetryLayer`](super::RetryLayer) and, with feature `reqwest`, the reqwest middleware.
///
/// Built by [`RetryPolicy::builder`]; [`RetryPolicy::default`] has the defaults listed there.
/// Clones share one budget, one random sequence and one set of [`RetryStats`].
#[derive(Clone)]
pub struct RetryPolicy {
    shared: Arc<Shared>,
}

/// Whether a request that is neither of an idempotent method nor keyed may be retried.
type IdempotentWhen = Arc<dyn Fn(&Method, &str, &HeaderMap) -> bool + Send + Sync>;

struct Shared {
    config: Config,
    idempotent_when: Option<IdempotentWhen>,
    budget: Option<RetryBudget>,
    rng: Rng,
    clock: TokioClock,
    stats: Counters,
    /// Its name in metrics.
    name: Box<str>,
    /// `tollgate_client_retries_total`.
    retries: Counter,
    /// `tollgate_client_gave_up_total`, in the order of [`GIVE_UP_REASONS`].
    gave_up: [Counter; 6],
}

/// The `reason` labels of `tollgate_client_gave_up_total`.
const GIVE_UP_REASONS: [&str; 6] = [
    "attempts",
    "deadline",
    "budget",
    "stop",
    "not_replayable",
    "inner",
];

/// The default name of a [`RetryPolicy`], a `CircuitBreakerLayer` and an
/// `AdaptiveThrottleLayer` in metrics and logs.
pub const DEFAULT_CLIENT_NAME: &str = "default";

#[derive(Clone, Debug)]
struct Config {
    max_attempts: u32,
    deadline: Duration,
    base: Duration,
    cap: Duration,
    jitter: Jitter,
    hint_spread: Duration,
    server_errors: bool,
    errors: bool,
    inner_gave_up: bool,
    replay_limit: usize,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    retries: AtomicU64,
    attempts: AtomicU64,
    deadline: AtomicU64,
    budget: AtomicU64,
    stop: AtomicU64,
    not_replayable: AtomicU64,
    inner: AtomicU64,
}

/// The budget a builder will give its policy.
#[derive(Clone, Debug)]
enum BudgetChoice {
    /// A new [`RetryBudget::default`], made by `build()`: each policy its own, even those
    /// built from clones of one builder.
    Default,
    /// This one (shared with whoever else holds it).
    Given(RetryBudget),
    /// None.
    None,
}

/// Builds a [`RetryPolicy`]; validated by [`RetryPolicyBuilder::build`].
#[derive(Clone)]
pub struct RetryPolicyBuilder {
    config: Config,
    idempotent_when: Option<IdempotentWhen>,
    budget: BudgetChoice,
    seed: Option<u64>,
    name: String,
}

/// One request's progress through its attempts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Attempts {
    /// When the first attempt started (ns on the policy's clock).
    started: u64,
    /// Retries made so far.
    retries: u32,
    /// The last wait (for decorrelated jitter).
    last_wait: Duration,
}

impl Attempts {
    /// How many times the request has been sent.
    pub(crate) fn made(&self) -> u32 {
        self.retries.saturating_add(1)
    }
}

/// What to do with an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Hand it to the caller: a success, or a failure that is not retried.
    Done,
    /// Wait this long, then send the request again.
    Retry(Duration),
    /// Hand it to the caller, marked with why.
    GiveUp(GiveUp),
}

impl RetryPolicy {
    /// A builder with the defaults: 3 attempts, a 30 s deadline, full jitter over 200 ms
    /// doubling up to 20 s, a random offset of up to a tenth (at least 100 ms, at most 1 s)
    /// added to server hints, the [default budget](RetryBudget::default) (10 %), 429 and 503
    /// and gRPC `RESOURCE_EXHAUSTED` / `UNAVAILABLE` retried, other 5xx and connection errors
    /// not, bodies that cannot be cloned read ahead up to 64 KiB.
    pub fn builder() -> RetryPolicyBuilder {
        RetryPolicyBuilder {
            config: Config {
                max_attempts: 3,
                deadline: Duration::from_secs(30),
                base: Duration::from_millis(200),
                cap: Duration::from_secs(20),
                jitter: Jitter::Full,
                hint_spread: Duration::from_secs(1),
                server_errors: false,
                errors: false,
                inner_gave_up: false,
                replay_limit: 64 * 1024,
            },
            idempotent_when: None,
            budget: BudgetChoice::Default,
            seed: None,
            name: DEFAULT_CLIENT_NAME.to_owned(),
        }
    }

    /// The policy's name in metrics (see [`RetryPolicyBuilder::name`]).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// What the policy has done so far.
    pub fn stats(&self) -> RetryStats {
        let c = &self.shared.stats;
        let read = |n: &AtomicU64| n.load(Ordering::Relaxed);
        RetryStats {
            requests: read(&c.requests),
            retries: read(&c.retries),
            gave_up_attempts: read(&c.attempts),
            gave_up_deadline: read(&c.deadline),
            gave_up_budget: read(&c.budget),
            gave_up_stop: read(&c.stop),
            not_replayable: read(&c.not_replayable),
            inner_gave_up: read(&c.inner),
        }
    }

    /// The longest request body read ahead to be replayed (for bodies that cannot be cloned).
    pub(crate) fn replay_limit(&self) -> usize {
        self.shared.config.replay_limit
    }

    /// A request is about to be sent for the first time: counts it and pays the budget its
    /// share. `Some` when it may be sent again (an idempotent method, an `Idempotency-Key`, or
    /// the policy's own rule).
    pub(crate) fn begin(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Option<Attempts> {
        let now = self.shared.clock.now();
        self.shared.stats.requests.fetch_add(1, Ordering::Relaxed);
        if let Some(budget) = &self.shared.budget {
            budget.deposit();
        }
        let replayable = idempotent(method)
            || headers.contains_key(IDEMPOTENCY_KEY)
            || self
                .shared
                .idempotent_when
                .as_ref()
                .is_some_and(|rule| rule(method, path, headers));
        replayable.then_some(Attempts {
            started: now,
            retries: 0,
            last_wait: self.shared.config.base,
        })
    }

    /// Whether an answer is a failure worth retrying.
    pub(crate) fn retryable(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        match status.as_u16() {
            429 | 503 => true,
            501 | 505 => false,
            500..=599 => self.shared.config.server_errors,
            _ => matches!(
                grpc_status(headers),
                Some(GRPC_RESOURCE_EXHAUSTED | GRPC_UNAVAILABLE)
            ),
        }
    }

    /// What to do with an answer. `attempts` is `None` for a request that cannot be sent
    /// again; `inner_gave_up` says whether the response carries an inner layer's [`GaveUp`].
    pub(crate) fn after_response(
        &self,
        attempts: Option<&mut Attempts>,
        status: StatusCode,
        headers: &HeaderMap,
        inner_gave_up: bool,
    ) -> Next {
        if !self.retryable(status, headers) {
            return Next::Done;
        }
        if inner_gave_up && !self.shared.config.inner_gave_up {
            return self.give_up(GiveUp::Inner);
        }
        let Some(attempts) = attempts else {
            return self.give_up(GiveUp::NotReplayable);
        };
        match ServerHints::read(headers).retry() {
            RetryHint::Stop => self.give_up(GiveUp::Stop),
            RetryHint::After(hint) => self.next(attempts, Some(hint)),
            RetryHint::None => self.next(attempts, None),
        }
    }

    /// What to do when the inner service failed (a connection error): retried only when the
    /// policy retries errors.
    pub(crate) fn after_error(&self, attempts: Option<&mut Attempts>) -> Next {
        if !self.shared.config.errors {
            return Next::Done;
        }
        match attempts {
            Some(attempts) => self.next(attempts, None),
            None => self.give_up(GiveUp::NotReplayable),
        }
    }

    /// Retry after `hint` (plus a random offset) or after a backoff, unless the attempts, the
    /// deadline or the budget say no.
    fn next(&self, attempts: &mut Attempts, hint: Option<Duration>) -> Next {
        let config = &self.shared.config;
        if attempts.retries.saturating_add(1) >= config.max_attempts {
            return self.give_up(GiveUp::Attempts);
        }
        let wait = match hint {
            Some(hint) => hint.saturating_add(self.hint_offset(hint)),
            None => self.backoff(attempts.retries, attempts.last_wait),
        };
        let now = self.shared.clock.now();
        let elapsed = Duration::from_nanos(now.saturating_sub(attempts.started));
        if elapsed.saturating_add(wait) > config.deadline {
            return self.give_up(GiveUp::Deadline);
        }
        if let Some(budget) = &self.shared.budget {
            if !budget.withdraw() {
                return self.give_up(GiveUp::Budget);
            }
        }
        attempts.retries += 1;
        attempts.last_wait = wait;
        self.shared.stats.retries.fetch_add(1, Ordering::Relaxed);
        self.shared.retries.increment(1);
        Next::Retry(wait)
    }

    fn give_up(&self, reason: GiveUp) -> Next {
        let c = &self.shared.stats;
        let (counter, index) = match reason {
            GiveUp::Attempts => (&c.attempts, 0),
            GiveUp::Deadline => (&c.deadline, 1),
            GiveUp::Budget => (&c.budget, 2),
            GiveUp::Stop => (&c.stop, 3),
            GiveUp::NotReplayable => (&c.not_replayable, 4),
            GiveUp::Inner => (&c.inner, 5),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.shared.gave_up[index].increment(1);
        Next::GiveUp(reason)
    }

    /// The wait without a server hint, before retry number `attempt` (from 0).
    pub(crate) fn backoff(&self, attempt: u32, last_wait: Duration) -> Duration {
        let config = &self.shared.config;
        let cap = nanos(config.cap);
        let base = nanos(config.base);
        let ceiling = base
            .saturating_mul(1u64.checked_shl(attempt).unwrap_or(u64::MAX))
            .min(cap);
        let rng = &self.shared.rng;
        Duration::from_nanos(match config.jitter {
            Jitter::Full => rng.below(ceiling),
            Jitter::Equal => ceiling / 2 + rng.below(ceiling - ceiling / 2),
            Jitter::Decorrelated => {
                let top = nanos(last_wait).saturating_mul(3).max(base);
                (base + rng.below(top - base)).min(cap)
            }
            Jitter::None => ceiling,
        })
    }

    /// The random offset added to a server's hint: uniform in `[0, spread)`, where the spread
    /// is a tenth of the hint, at least 100 ms and at most the configured spread (1 s).
    pub(crate) fn hint_offset(&self, hint: Duration) -> Duration {
        let spread = (hint / 10)
            .max(MIN_HINT_SPREAD)
            .min(self.shared.config.hint_spread);
        Duration::from_nanos(self.shared.rng.below(nanos(spread)))
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// GET, HEAD, OPTIONS, PUT, DELETE and TRACE (RFC 9110, 9.2.2).
fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

impl Default for RetryPolicy {
    /// The policy of [`RetryPolicy::builder`]'s defaults.
    fn default() -> Self {
        Self::builder().build_unchecked()
    }
}

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("name", &self.shared.name)
            .field("config", &self.shared.config)
            .field("budget", &self.shared.budget)
            .field("stats", &self.stats())
            .finish()
    }
}

impl fmt::Debug for RetryPolicyBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicyBuilder")
            .field("name", &self.name)
            .field("config", &self.config)
            .field("idempotent_when", &self.idempotent_when.is_some())
            .field("budget", &self.budget)
            .field("seed", &self.seed)
            .finish()
    }
}

impl RetryPolicyBuilder {
    /// How many times a request may be sent in all, the first time included (1 to 100; 1
    /// never retries). Default 3.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.config.max_attempts = attempts;
        self
    }

    /// The longest time from the first attempt to the start of the last one. A retry whose
    /// wait would end past it is not made, so a server hint longer than the time left ends
    /// the retries at once with the last answer. Default 30 s. It does not cut an attempt
    /// short: for a hard bound on the whole call, put a timeout outside the retry layer.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.config.deadline = deadline;
        self
    }

    /// The exponential backoff used when the server gives no hint: retry `n` (from 0) waits
    /// up to `min(cap, base * 2^n)`, drawn by the [`Jitter`]. Default 200 ms and 20 s.
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.config.base = base;
        self.config.cap = cap;
        self
    }

    /// How the backoff is drawn. Default [`Jitter::Full`].
    pub fn jitter(mut self, jitter: Jitter) -> Self {
        self.config.jitter = jitter;
        self
    }

    /// The largest random offset added to a server's hint (`Retry-After`,
    /// `grpc-retry-pushback-ms`, the `RateLimit` field's reset). The offset is uniform below
    /// a tenth of the hint, at least 100 ms and at most this, so that the many clients one
    /// reset instant refused do not all return at that instant. Default 1 s; zero waits
    /// exactly what the server said.
    pub fn hint_spread(mut self, max: Duration) -> Self {
        self.config.hint_spread = max;
        self
    }

    /// The retry budget. Default: a [`RetryBudget::default`] (10 % of requests, at least one
    /// retry per second, over 10 seconds) of its own, made when the policy is built, so that
    /// policies built from clones of one builder do not share a budget. A budget given here is
    /// shared by every policy it is given to.
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = BudgetChoice::Given(budget);
        self
    }

    /// No retry budget: only the attempts and the deadline bound the retries. Nested layers
    /// without budgets multiply the calls on a failing service (three layers of three
    /// attempts make 27 calls of one).
    pub fn no_budget(mut self) -> Self {
        self.budget = BudgetChoice::None;
        self
    }

    /// Also retry the other 5xx answers (not 501 and 505, which another attempt cannot
    /// change). Default no.
    pub fn retry_server_errors(mut self, yes: bool) -> Self {
        self.config.server_errors = yes;
        self
    }

    /// Also retry when the inner service fails with an error (a refused or broken
    /// connection). Default no. An error carries no mark, so nested layers that all retry
    /// errors are bounded by their budgets only.
    pub fn retry_errors(mut self, yes: bool) -> Self {
        self.config.errors = yes;
        self
    }

    /// Also treat as idempotent the requests for which `rule(method, path, headers)` is true.
    /// gRPC calls are all POSTs: name the methods that are safe to call twice, for instance
    /// `|_, path, _| path.starts_with("/inventory.Catalog/Get")`. (A request with an
    /// `Idempotency-Key` header, or gRPC metadata of that name, is retried without a rule.)
    pub fn idempotent_when<F>(mut self, rule: F) -> Self
    where
        F: Fn(&Method, &str, &HeaderMap) -> bool + Send + Sync + 'static,
    {
        self.idempotent_when = Some(Arc::new(rule));
        self
    }

    /// Retry answers that an inner retry layer already gave up on (they carry a [`GaveUp`]).
    /// Default no: only the layer nearest the failing service retries, so that three nested
    /// layers put about 1.1 times the calls on it instead of 1.1³.
    pub fn retry_what_inner_layers_gave_up(mut self, yes: bool) -> Self {
        self.config.inner_gave_up = yes;
        self
    }

    /// The longest request body read ahead to be replayed, for body types that cannot be
    /// cloned (see [`ReplayBody`](super::ReplayBody)). Default 64 KiB.
    pub fn replay_limit(mut self, bytes: usize) -> Self {
        self.config.replay_limit = bytes;
        self
    }

    /// The policy's name in metrics (the `client` label; [`DEFAULT_CLIENT_NAME`] unless set):
    /// give each policy of a process its own.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Seeds the random waits, for repeatable tests. Default: a random seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// The policy, if the settings can work.
    pub fn build(self) -> Result<RetryPolicy, RetryConfigError> {
        let c = &self.config;
        if !(1..=100).contains(&c.max_attempts) {
            return Err(RetryConfigError::Attempts(c.max_attempts));
        }
        if c.deadline.is_zero() {
            return Err(RetryConfigError::Deadline);
        }
        if c.base.is_zero() || c.cap < c.base {
            return Err(RetryConfigError::Backoff {
                base: c.base,
                cap: c.cap,
            });
        }
        Ok(self.build_unchecked())
    }

    fn build_unchecked(self) -> RetryPolicy {
        use crate::metrics::{CLIENT_GAVE_UP_TOTAL, CLIENT_RETRIES_TOTAL};
        let name = self.name.as_str();
        RetryPolicy {
            shared: Arc::new(Shared {
                retries: Counter::new(CLIENT_RETRIES_TOTAL, &[("client", name)]),
                gave_up: GIVE_UP_REASONS.map(|reason| {
                    Counter::new(
                        CLIENT_GAVE_UP_TOTAL,
                        &[("client", name), ("reason", reason)],
                    )
                }),
                name: self.name.into(),
                config: self.config,
                idempotent_when: self.idempotent_when,
                budget: match self.budget {
                    BudgetChoice::Default => Some(RetryBudget::default()),
                    BudgetChoice::Given(budget) => Some(budget),
                    BudgetChoice::None => None,
                },
                rng: Rng::new(self.seed.unwrap_or_else(Rng::entropy)),
                clock: TokioClock::new(),
                stats: Counters::default(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    const MS: Duration = Duration::from_millis(1);

    fn policy(b: RetryPolicyBuilder) -> RetryPolicy {
        b.seed(1).build().unwrap()
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn what_is_retried() {
        let p = RetryPolicy::default();
        let none = HeaderMap::new();
        let retried =
            |p: &RetryPolicy, s: u16| p.retryable(StatusCode::from_u16(s).unwrap(), &none);
        for s in [429, 503] {
            assert!(retried(&p, s), "{s}");
        }
        for s in [200, 204, 400, 404, 500, 501, 502, 504, 505] {
            assert!(!retried(&p, s), "{s}");
        }
        let p5 = policy(RetryPolicy::builder().retry_server_errors(true));
        for s in [500, 502, 504, 599] {
            assert!(retried(&p5, s), "{s}");
        }
        for s in [499, 501, 505] {
            assert!(!retried(&p5, s), "{s}");
        }
        // Read as the other client layers read it: trimmed (it was compared byte for byte).
        for (code, yes) in [
            ("8", true),
            ("14", true),
            (" 14 ", true),
            ("8 ", true),
            ("0", false),
            ("13", false),
            ("80", false),
            ("x", false),
        ] {
            let h = headers(&[("grpc-status", code)]);
            assert_eq!(p.retryable(StatusCode::OK, &h), yes, "{code}");
        }
    }

    #[test]
    fn idempotent_methods_or_an_idempotency_key() {
        let p = RetryPolicy::default();
        let none = HeaderMap::new();
        for m in ["GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"] {
            assert!(p.begin(&m.parse().unwrap(), "/", &none).is_some(), "{m}");
        }
        for m in ["POST", "PATCH", "CONNECT", "PURGE"] {
            assert!(p.begin(&m.parse().unwrap(), "/", &none).is_none(), "{m}");
        }
        let keyed = headers(&[("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")]);
        assert!(p.begin(&Method::POST, "/", &keyed).is_some());
        assert_eq!(p.stats().requests, 11);
        let grpc = policy(RetryPolicy::builder().idempotent_when(|m, path, _| {
            m == Method::POST && path.starts_with("/catalog.Catalog/Get")
        }));
        assert!(
            grpc.begin(&Method::POST, "/catalog.Catalog/GetItem", &none)
                .is_some()
        );
        assert!(
            grpc.begin(&Method::POST, "/catalog.Catalog/PutItem", &none)
                .is_none()
        );
        assert!(grpc.begin(&Method::GET, "/anything", &none).is_some());
        assert!(format!("{:?}", RetryPolicy::builder()).contains("idempotent_when: false"));
    }

    #[test]
    fn full_jitter_bounds() {
        let p = policy(RetryPolicy::builder());
        for attempt in 0..12 {
            let ceiling = (200 * MS * 2u32.pow(attempt)).min(Duration::from_secs(20));
            let waits: Vec<_> = (0..2000).map(|_| p.backoff(attempt, MS)).collect();
            assert!(waits.iter().all(|w| *w < ceiling), "attempt {attempt}");
            // Both ends of the range are reached.
            assert!(waits.iter().any(|w| *w < ceiling / 50), "attempt {attempt}");
            assert!(
                waits.iter().any(|w| *w > ceiling * 49 / 50),
                "attempt {attempt}"
            );
        }
        // Far past the cap, and past 2^64.
        assert!(p.backoff(200, MS) < Duration::from_secs(20));
        assert!(p.backoff(40, MS) > Duration::ZERO);
    }

    /// Chi-square of `n` draws in `[0, ceiling)` over 20 equal bins.
    fn chi_square(draw: impl Fn() -> Duration, ceiling: Duration, n: usize) -> f64 {
        let mut bins = [0usize; 20];
        for _ in 0..n {
            let w = draw();
            assert!(w < ceiling);
            bins[(w.as_nanos() * 20 / ceiling.as_nanos()) as usize] += 1;
        }
        let expected = n as f64 / 20.0;
        bins.iter()
            .map(|&o| (o as f64 - expected).powi(2) / expected)
            .sum()
    }

    #[test]
    fn full_jitter_is_uniform() {
        // 19 degrees of freedom: 43.82 is the 0.1 % critical value. A fixed seed makes it
        // deterministic; the statistic is printed so a drift shows.
        let p = policy(RetryPolicy::builder());
        for attempt in [0, 3, 9] {
            let ceiling = (200 * MS * 2u32.pow(attempt)).min(Duration::from_secs(20));
            let chi2 = chi_square(|| p.backoff(attempt, MS), ceiling, 20_000);
            println!("full jitter, attempt {attempt}: chi-square {chi2:.1} (19 df)");
            assert!(chi2 < 43.82, "attempt {attempt}: chi-square {chi2}");
        }
        // And a wait that is not uniform fails the same test.
        let skewed = chi_square(|| p.backoff(2, MS).min(p.backoff(2, MS)), 800 * MS, 20_000);
        assert!(skewed > 1000.0, "{skewed}");
    }

    #[test]
    fn the_other_jitters() {
        let p = |j| policy(RetryPolicy::builder().jitter(j));
        let none = p(Jitter::None);
        assert_eq!(none.backoff(0, MS), 200 * MS);
        assert_eq!(none.backoff(3, MS), 1600 * MS);
        assert_eq!(none.backoff(7, MS), Duration::from_secs(20));
        let equal = p(Jitter::Equal);
        let waits: Vec<_> = (0..2000).map(|_| equal.backoff(2, MS)).collect();
        assert!(waits.iter().all(|w| *w >= 400 * MS && *w < 800 * MS));
        assert!(waits.iter().any(|w| *w < 410 * MS) && waits.iter().any(|w| *w > 790 * MS));
        let chi2 = chi_square(|| equal.backoff(2, MS) - 400 * MS, 400 * MS, 20_000);
        assert!(chi2 < 43.82, "{chi2}");
        let dec = p(Jitter::Decorrelated);
        // From the previous wait: [base, 3 * previous), at most the cap.
        let waits: Vec<_> = (0..2000).map(|_| dec.backoff(0, 1000 * MS)).collect();
        assert!(waits.iter().all(|w| *w >= 200 * MS && *w < 3000 * MS));
        assert!(waits.iter().any(|w| *w < 220 * MS) && waits.iter().any(|w| *w > 2900 * MS));
        assert!(
            (0..200).all(|_| dec.backoff(0, Duration::from_secs(60)) <= Duration::from_secs(20))
        );
        // A previous wait below the base draws from the base.
        assert!((0..200).all(|_| dec.backoff(0, Duration::ZERO) == 200 * MS));
    }

    #[test]
    fn the_offset_added_to_a_hint() {
        let p = policy(RetryPolicy::builder());
        for (hint, spread) in [
            (0, 100),
            (500, 100),
            (3000, 300),
            (9000, 900),
            (60_000, 1000),
        ] {
            let offsets: Vec<_> = (0..2000).map(|_| p.hint_offset(hint * MS)).collect();
            assert!(offsets.iter().all(|o| *o < spread * MS), "{hint}");
            assert!(offsets.iter().any(|o| *o > spread * MS * 9 / 10), "{hint}");
        }
        let exact = policy(RetryPolicy::builder().hint_spread(Duration::ZERO));
        assert_eq!(exact.hint_offset(Duration::from_secs(5)), Duration::ZERO);
        let small = policy(RetryPolicy::builder().hint_spread(50 * MS));
        assert!((0..200).all(|_| small.hint_offset(Duration::from_secs(5)) < 50 * MS));
    }

    #[tokio::test(start_paused = true)]
    async fn the_decision_in_order() {
        let p = policy(
            RetryPolicy::builder()
                .no_budget()
                .jitter(Jitter::None)
                .hint_spread(Duration::ZERO),
        );
        let none = HeaderMap::new();
        let r = |a: &mut Attempts, s: u16, h: &HeaderMap| {
            p.after_response(Some(a), StatusCode::from_u16(s).unwrap(), h, false)
        };
        let mut a = p.begin(&Method::GET, "/", &none).unwrap();
        assert_eq!(r(&mut a, 200, &none), Next::Done);
        assert_eq!(a.made(), 1);
        assert_eq!(r(&mut a, 503, &none), Next::Retry(200 * MS));
        assert_eq!(r(&mut a, 503, &none), Next::Retry(400 * MS));
        assert_eq!(a.made(), 3);
        assert_eq!(r(&mut a, 503, &none), Next::GiveUp(GiveUp::Attempts));
        // The server's word: stop, or a wait.
        let mut a = p.begin(&Method::GET, "/", &none).unwrap();
        let stop = headers(&[("grpc-retry-pushback-ms", "-1")]);
        assert_eq!(r(&mut a, 429, &stop), Next::GiveUp(GiveUp::Stop));
        let after = |s: &str| headers(&[("retry-after", s)]);
        assert_eq!(r(&mut a, 429, &after("2")), Next::Retry(2000 * MS));
        // The deadline (30 s from the first attempt) is inclusive.
        tokio::time::advance(Duration::from_secs(27)).await;
        assert_eq!(r(&mut a, 429, &after("3")), Next::Retry(3000 * MS));
        let mut a = p.begin(&Method::GET, "/", &none).unwrap();
        assert_eq!(r(&mut a, 429, &after("31")), Next::GiveUp(GiveUp::Deadline));
        // Not replayable, or already given up on inside.
        assert_eq!(
            p.after_response(None, StatusCode::TOO_MANY_REQUESTS, &none, false),
            Next::GiveUp(GiveUp::NotReplayable)
        );
        assert_eq!(
            p.after_response(None, StatusCode::OK, &none, true),
            Next::Done
        );
        assert_eq!(
            p.after_response(Some(&mut a), StatusCode::SERVICE_UNAVAILABLE, &none, true),
            Next::GiveUp(GiveUp::Inner)
        );
        // Errors are not retried unless asked.
        assert_eq!(p.after_error(Some(&mut a)), Next::Done);
        let stats = p.stats();
        assert_eq!(
            stats,
            RetryStats {
                requests: 3,
                retries: 4,
                gave_up_attempts: 1,
                gave_up_deadline: 1,
                gave_up_budget: 0,
                gave_up_stop: 1,
                not_replayable: 1,
                inner_gave_up: 1,
            }
        );
        let again = policy(
            RetryPolicy::builder()
                .retry_what_inner_layers_gave_up(true)
                .retry_errors(true),
        );
        let mut a = again.begin(&Method::GET, "/", &none).unwrap();
        assert!(matches!(
            again.after_response(Some(&mut a), StatusCode::SERVICE_UNAVAILABLE, &none, true),
            Next::Retry(_)
        ));
        assert!(matches!(again.after_error(Some(&mut a)), Next::Retry(_)));
        assert_eq!(
            again.after_error(Some(&mut a)),
            Next::GiveUp(GiveUp::Attempts)
        );
        assert_eq!(again.after_error(None), Next::GiveUp(GiveUp::NotReplayable));
    }

    #[tokio::test(start_paused = true)]
    async fn the_budget_is_asked_last() {
        let budget = RetryBudget::new(0, 1, Duration::from_secs(1)).unwrap();
        let p = policy(RetryPolicy::builder().budget(budget).max_attempts(10));
        let none = HeaderMap::new();
        let mut a = p.begin(&Method::GET, "/", &none).unwrap();
        // A hint past the deadline costs nothing from the budget.
        let far = headers(&[("retry-after", "60")]);
        let r = |a: &mut Attempts, h: &HeaderMap| {
            p.after_response(Some(a), StatusCode::TOO_MANY_REQUESTS, h, false)
        };
        assert_eq!(r(&mut a, &far), Next::GiveUp(GiveUp::Deadline));
        assert!(matches!(r(&mut a, &none), Next::Retry(_)));
        assert_eq!(r(&mut a, &none), Next::GiveUp(GiveUp::Budget));
        assert_eq!(p.stats().gave_up_budget, 1);
    }

    /// Issue 24, 8: `builder()` made the default budget, so policies built from clones of one
    /// builder shared it (against the advice to give each backend its own).
    #[tokio::test(start_paused = true)]
    async fn clones_of_a_builder_build_policies_with_budgets_of_their_own() {
        let base = RetryPolicy::builder().max_attempts(2);
        let a = policy(base.clone());
        let b = policy(base.clone());
        let none = HeaderMap::new();
        let retry = |p: &RetryPolicy| {
            let mut attempts = p.begin(&Method::GET, "/", &none).unwrap();
            p.after_response(
                Some(&mut attempts),
                StatusCode::SERVICE_UNAVAILABLE,
                &none,
                false,
            )
        };
        // The default floor: one a second over 10 s, and a tenth of the requests.
        let spent = (0..100)
            .take_while(|_| matches!(retry(&a), Next::Retry(_)))
            .count();
        assert_eq!(spent, 11);
        assert_eq!(retry(&a), Next::GiveUp(GiveUp::Budget));
        assert!(matches!(retry(&b), Next::Retry(_)));
        // A budget given is shared.
        let shared = RetryBudget::new(0, 1, Duration::from_secs(1)).unwrap();
        let base = RetryPolicy::builder().budget(shared);
        let (c, d) = (policy(base.clone()), policy(base));
        assert!(matches!(retry(&c), Next::Retry(_)));
        assert_eq!(retry(&d), Next::GiveUp(GiveUp::Budget));
    }

    /// Issue 24, 2: a budget shared by policies built an hour apart refills for both (each read
    /// its own clock, zero when it was built, and the later one saw no slot expire): 0 % and
    /// one a second over 1 s, one failing request every 2 s, each gets its retry.
    #[tokio::test(start_paused = true)]
    async fn a_budget_shared_by_policies_built_apart_refills() {
        let budget = RetryBudget::new(0, 1, Duration::from_secs(1)).unwrap();
        let early = policy(RetryPolicy::builder().budget(budget.clone()));
        tokio::time::advance(Duration::from_secs(3600)).await;
        let late = policy(RetryPolicy::builder().budget(budget));
        let none = HeaderMap::new();
        let retry = |p: &RetryPolicy| {
            let mut attempts = p.begin(&Method::GET, "/", &none).unwrap();
            p.after_response(
                Some(&mut attempts),
                StatusCode::SERVICE_UNAVAILABLE,
                &none,
                false,
            )
        };
        for round in 0..10 {
            let p = if round % 2 == 0 { &early } else { &late };
            assert!(matches!(retry(p), Next::Retry(_)), "round {round}");
            tokio::time::advance(Duration::from_secs(2)).await;
        }
    }

    #[test]
    fn a_policy_is_named() {
        assert_eq!(RetryPolicy::default().name(), DEFAULT_CLIENT_NAME);
        let named = policy(RetryPolicy::builder().name("payments"));
        assert_eq!(named.name(), "payments");
        assert!(format!("{named:?}").contains("name: \"payments\""));
    }

    #[test]
    fn bad_settings_are_errors() {
        let b = RetryPolicy::builder;
        assert_eq!(
            b().max_attempts(0).build().unwrap_err(),
            RetryConfigError::Attempts(0)
        );
        assert_eq!(
            b().max_attempts(101).build().unwrap_err(),
            RetryConfigError::Attempts(101)
        );
        assert!(b().max_attempts(1).build().is_ok() && b().max_attempts(100).build().is_ok());
        assert_eq!(
            b().deadline(Duration::ZERO).build().unwrap_err(),
            RetryConfigError::Deadline
        );
        let bad = RetryConfigError::Backoff {
            base: 2 * MS,
            cap: MS,
        };
        assert_eq!(b().backoff(2 * MS, MS).build().unwrap_err(), bad);
        assert!(bad.to_string().contains("base 2ms, cap 1ms"));
        assert!(b().backoff(Duration::ZERO, MS).build().is_err());
        assert!(b().backoff(MS, MS).build().is_ok());
        assert!(RetryConfigError::Attempts(0).to_string().contains("not 0"));
        assert!(format!("{:?}", RetryPolicy::default()).contains("max_attempts: 3"));
        assert_eq!(RetryPolicy::default().replay_limit(), 64 * 1024);
        assert_eq!(policy(b().replay_limit(10)).replay_limit(), 10);
    }
}
