//! The layer's configuration: its layer, builder and errors.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tower_layer::Layer;

pub(crate) use super::admission::{Permit, bounded};
use super::fair::Fair;
#[cfg(feature = "redis")]
use super::leases::Leases;
use super::service::ConcurrencyLimit;
pub use super::shared::MAX_RETRY_AFTER;
pub(crate) use super::shared::Shared;
use super::shared::{KeyedRule, Latency, Queue, RuleLimit, Total, tiered_limits};
use super::table::InFlight;
use super::telemetry::Telemetry;
use crate::answer::{DefaultResponder, Responder};
use crate::clock::{Clock, SystemClock};
use crate::key::Key;
use crate::limiter::{Matcher, Rule, Tiers, valid_name};
#[cfg(feature = "redis")]
use crate::store::FailurePolicy;
use crate::sync::{AtomicU32, AtomicUsize, Mutex};

/// The default name of a [`ConcurrencyLimitLayer`] in metrics and logs.
pub const DEFAULT_CONCURRENCY_LAYER_NAME: &str = "concurrency";

/// At most so many requests in flight per key, and optionally in all: see the
/// [module docs](super).
#[derive(Clone)]
pub struct ConcurrencyLimitLayer {
    pub(crate) shared: Arc<Shared>,
}

impl ConcurrencyLimitLayer {
    /// A builder with no rules yet.
    pub fn builder() -> ConcurrencyLimitLayerBuilder {
        ConcurrencyLimitLayerBuilder {
            rules: Vec::new(),
            total: None,
            queue: None,
            #[cfg(feature = "redis")]
            redis: None,
            #[cfg(feature = "redis")]
            lease_time: super::DEFAULT_LEASE_TIME,
            #[cfg(feature = "redis")]
            on_store_error: FailurePolicy::LocalFallback,
            responder: Box::new(DefaultResponder),
            clock: Arc::new(SystemClock::new()),
            name: DEFAULT_CONCURRENCY_LAYER_NAME.to_owned(),
        }
    }

    /// The layer's name in metrics and logs (see [`ConcurrencyLimitLayerBuilder::name`]).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Requests in flight for `key` under the rule named `rule` (0 for an unknown rule).
    pub fn in_flight(&self, rule: &str, key: &str) -> u32 {
        let mut store_key = Key::from(key);
        store_key.push_raw("@");
        store_key.push_raw(rule);
        self.shared.in_flight.count(bounded(store_key).as_str())
    }

    /// Requests in flight under the total cap (or over all rules' keys when there is none).
    pub fn total_in_flight(&self) -> u64 {
        match &self.shared.total {
            Some(total) => u64::from(total.count.load(Ordering::Acquire)),
            None => self.shared.in_flight.total(),
        }
    }

    /// What the leases on Redis have done (all zero without
    /// [`redis`](ConcurrencyLimitLayerBuilder::redis)).
    #[cfg(feature = "redis")]
    pub fn lease_stats(&self) -> super::LeaseStats {
        self.shared
            .leases
            .as_ref()
            .map(|l| l.stats())
            .unwrap_or_default()
    }

    /// Renews this instance's leases on Redis now, as the renewer does every third of the
    /// lease time (for tests that cannot wait for it).
    #[cfg(feature = "redis")]
    #[doc(hidden)]
    pub async fn renew_leases(&self) {
        if let Some(leases) = &self.shared.leases {
            leases.renew_all().await;
        }
    }

    /// Requests waiting in the queue for a place (see
    /// [`ConcurrencyLimitLayerBuilder::queue`]).
    pub fn queued(&self) -> usize {
        self.shared
            .queue
            .as_ref()
            .map_or(0, |q| q.waiting.load(Ordering::Acquire))
    }

    /// Keys with requests in flight: each key's entry is removed when its count returns to
    /// zero, so this is bounded by the requests in flight.
    pub fn tracked_keys(&self) -> usize {
        self.shared.in_flight.keys()
    }
}

impl<S> Layer<S> for ConcurrencyLimitLayer {
    type Service = ConcurrencyLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ConcurrencyLimit::new(inner, self.shared.clone())
    }
}

impl fmt::Debug for ConcurrencyLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLimitLayer")
            .field("name", &self.shared.name)
            .field(
                "rules",
                &self
                    .shared
                    .rules
                    .iter()
                    .map(|r| (&*r.matcher.name, r.max))
                    .collect::<Vec<_>>(),
            )
            .field("total", &self.shared.total.as_ref().map(|t| t.max))
            .finish_non_exhaustive()
    }
}

/// Builds a [`ConcurrencyLimitLayer`]; everything is validated by
/// [`ConcurrencyLimitLayerBuilder::build`].
pub struct ConcurrencyLimitLayerBuilder {
    rules: Vec<(Rule, RuleLimit)>,
    total: Option<u32>,
    queue: Option<(usize, Duration)>,
    #[cfg(feature = "redis")]
    redis: Option<crate::RedisStore>,
    #[cfg(feature = "redis")]
    lease_time: Duration,
    #[cfg(feature = "redis")]
    on_store_error: FailurePolicy,
    responder: Box<dyn Responder>,
    clock: Arc<dyn Clock>,
    name: String,
}

impl ConcurrencyLimitLayerBuilder {
    /// At most `max_in_flight` requests in flight per key of `rule`, for the requests it
    /// matches (its methods, path or route, key, and what to do without a key, as for rate
    /// limits; the rule takes no policies here). Every rule that matches a request applies,
    /// all or nothing.
    pub fn rule(mut self, rule: Rule, max_in_flight: u32) -> Self {
        self.rules.push((rule, RuleLimit::One(max_in_flight)));
        self
    }

    /// A rule whose limit per key depends on the key's tier (its plan: free, pro), as
    /// `tiers` find it: `limits` gives each tier's most requests in flight per key, and the
    /// tier names. `tiers` brings the resolver, its cache and the default tier (the first of
    /// `limits` unless set); its own [`Tiers::tier`] list is for rate limits and must be
    /// empty here. The resolver gets the key the rule's extractor found and is asked at most
    /// once per key per cache time; a request whose key's tier is not known yet waits for the
    /// answer, at most the tiers' [timeout](Tiers::timeout) (1 s unless set), after which it
    /// counts in the default tier (so does a resolver that fails or panics; such a fallback is
    /// not cached). Concurrent requests for one unknown key share one lookup and its answer.
    ///
    /// ```
    /// use tollgate::ConcurrencyLimitLayer;
    /// use tollgate::key::Header;
    /// use tollgate::limiter::{Rule, Tiers};
    ///
    /// let plans = Tiers::new(|key: String| async move {
    ///     key.starts_with("pro-").then(|| "pro".to_owned())
    /// });
    /// let limits = ConcurrencyLimitLayer::builder()
    ///     .tiered(
    ///         Rule::new("per-key").key(Header::from_static("x-api-key")),
    ///         plans,
    ///         [("free", 2), ("pro", 20)],
    ///     )
    ///     .build()?;
    /// # let _ = limits;
    /// # Ok::<(), tollgate::concurrency::ConcurrencyError>(())
    /// ```
    pub fn tiered<N: Into<String>>(
        mut self,
        rule: Rule,
        tiers: Tiers,
        limits: impl IntoIterator<Item = (N, u32)>,
    ) -> Self {
        let limits = limits.into_iter().map(|(n, max)| (n.into(), max)).collect();
        self.rules.push((rule, RuleLimit::Tiered(tiers, limits)));
        self
    }

    /// At most `max_in_flight` requests in flight in all, whatever their keys: past it, `503`.
    pub fn total(mut self, max_in_flight: u32) -> Self {
        self.total = Some(max_in_flight);
        self
    }

    /// Lets up to `max_waiting` requests (over the whole layer) that find their key or the
    /// total cap full wait up to `max_wait` for a place before being refused, instead of being
    /// refused at once. A request that waits longer, finds no room, or is pushed out of a full
    /// queue gets the usual answer (`429`, or `503` for the total cap).
    ///
    /// The queue is fair (see [the module docs](super#fairness)): waiters are kept per flow
    /// (the key of the first rule that applies), a place given back goes to the waiter it
    /// fits, in fair-queuing order (the flow whose key holds the fewest places first, then the
    /// one served least recently; within a flow, the oldest), and a newcomer does not take a
    /// place before a waiter it would fit. A flow waits in at most `max_waiting` divided by
    /// the flows waiting (at least one) of the queue's places, and at most as many requests
    /// wait for a key as the key has places, whatever refused them: one client cannot fill
    /// the queue.
    ///
    /// The wait is timed on the layer's [clock](Self::clock), woken by tokio's timer: under
    /// tokio's paused time give the layer a [`TokioClock`](crate::clock::TokioClock). Both
    /// numbers must be above zero ([`ConcurrencyError::InvalidQueue`]); a `max_wait` too long
    /// to reach (`Duration::MAX`) is no deadline.
    pub fn queue(mut self, max_waiting: usize, max_wait: Duration) -> Self {
        self.queue = Some((max_waiting, max_wait));
        self
    }

    /// Counts each rule's places on `store`, shared by every instance connected to it (feature
    /// `redis`): two instances never have more than a rule's limit in flight for one key
    /// between them. Each request holds a lease per key, renewed every third of the
    /// [lease time](Self::lease_time) while it runs and given back when its response ends; the
    /// leases of an instance that crashes free their places after one lease time. The
    /// in-process count still applies first (so a key over its limit on this instance alone
    /// costs no call to Redis), and the total cap stays in process: it protects this
    /// instance. A request refused by Redis does not wait in the [queue](Self::queue).
    #[cfg(feature = "redis")]
    pub fn redis(mut self, store: crate::RedisStore) -> Self {
        self.redis = Some(store);
        self
    }

    /// How long a lease on Redis lasts without renewal: what a crashed instance can leak
    /// ([`DEFAULT_LEASE_TIME`](super::DEFAULT_LEASE_TIME) unless set; between
    /// [`MIN_LEASE_TIME`](super::MIN_LEASE_TIME) and [`MAX_LEASE_TIME`](super::MAX_LEASE_TIME),
    /// and at least three times the store's [timeout](crate::store::redis::RedisStoreBuilder::timeout)).
    #[cfg(feature = "redis")]
    pub fn lease_time(mut self, lease: Duration) -> Self {
        self.lease_time = lease;
        self
    }

    /// What to do when Redis fails (an error, a timeout): [`FailurePolicy::LocalFallback`]
    /// (the default) and [`FailurePolicy::Open`] both admit on the in-process count alone, so
    /// each instance keeps its own limit; [`FailurePolicy::Closed`] refuses with `503`.
    #[cfg(feature = "redis")]
    pub fn on_store_error(mut self, policy: FailurePolicy) -> Self {
        self.on_store_error = policy;
        self
    }

    /// How refusals are answered ([`DefaultResponder`] unless set).
    pub fn responder(mut self, responder: impl Responder) -> Self {
        self.responder = Box::new(responder);
        self
    }

    /// The layer's name in metrics (the `layer` label) and logs
    /// ([`DEFAULT_CONCURRENCY_LAYER_NAME`] unless set): give each concurrency layer of a
    /// process its own.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The clock that times requests for `Retry-After` and the wait in the queue (the
    /// system's monotonic clock unless set; [`TokioClock`](crate::clock::TokioClock) under
    /// tokio's paused time, a [`ManualClock`](crate::clock::ManualClock) in tests).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Validates the rules and builds the layer, and registers its metrics (feature
    /// `metrics`: install the recorder first).
    pub fn build(self) -> Result<ConcurrencyLimitLayer, ConcurrencyError> {
        if self.rules.is_empty() && self.total.is_none() {
            return Err(ConcurrencyError::NothingToLimit);
        }
        if self.total == Some(0) {
            return Err(ConcurrencyError::ZeroLimit("total".into()));
        }
        if self.rules.len() > usize::from(u16::MAX) {
            return Err(ConcurrencyError::TooManyRules(self.rules.len()));
        }
        if let Some((max_waiting, max_wait)) = self.queue {
            if max_waiting == 0 || max_wait.is_zero() {
                return Err(ConcurrencyError::InvalidQueue {
                    max_waiting,
                    max_wait,
                });
            }
        }
        #[cfg(feature = "redis")]
        if !(super::MIN_LEASE_TIME..=super::MAX_LEASE_TIME).contains(&self.lease_time)
            || self
                .redis
                .as_ref()
                .is_some_and(|store| self.lease_time < store.timeout().saturating_mul(3))
        {
            return Err(ConcurrencyError::LeaseTime(self.lease_time));
        }
        let mut rules: Vec<KeyedRule> = Vec::with_capacity(self.rules.len());
        for (rule, max) in self.rules {
            let name = rule.name.clone();
            if !valid_name(&name) {
                return Err(ConcurrencyError::InvalidRuleName(
                    name.chars().take(80).collect(),
                ));
            }
            if rules.iter().any(|r| *r.matcher.name == *name) {
                return Err(ConcurrencyError::DuplicateRule(name));
            }
            if !rule.policies.is_empty() || rule.tiers.is_some() || rule.shadow {
                return Err(ConcurrencyError::NotAConcurrencyRule(name));
            }
            let (max, tiers) = match max {
                RuleLimit::One(max) => (max, None),
                RuleLimit::Tiered(tiers, limits) => {
                    let tiers = tiered_limits(&name, tiers, limits)?;
                    (tiers.limits.iter().copied().max().unwrap_or(0), Some(tiers))
                }
            };
            if max == 0 {
                return Err(ConcurrencyError::ZeroLimit(name));
            }
            rules.push(KeyedRule {
                matcher: Matcher::new(rule),
                max,
                tiers,
                latency: Latency::default(),
            });
        }
        let telemetry = Telemetry::new(&self.name, &rules, self.total.is_some(), {
            #[cfg(feature = "redis")]
            {
                self.redis.is_some() && self.on_store_error == FailurePolicy::Closed
            }
            #[cfg(not(feature = "redis"))]
            false
        });
        Ok(ConcurrencyLimitLayer {
            shared: Arc::new(Shared {
                name: self.name.into(),
                telemetry,
                rules: rules.into(),
                in_flight: InFlight::new(),
                total: self.total.map(|max| Total {
                    max,
                    count: AtomicU32::new(0),
                }),
                queue: self.queue.map(|(max, max_wait)| Queue {
                    max,
                    max_wait,
                    waiting: AtomicUsize::new(0),
                    fair: Mutex::new(Fair::default()),
                }),
                latency: Latency::default(),
                #[cfg(feature = "redis")]
                leases: self.redis.map(|store| {
                    Arc::new(Leases::new(store, self.lease_time, self.on_store_error))
                }),
                responder: self.responder,
                clock: self.clock,
            }),
        })
    }
}

impl fmt::Debug for ConcurrencyLimitLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLimitLayerBuilder")
            .field("rules", &self.rules)
            .field("total", &self.total)
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

/// Why a [`ConcurrencyLimitLayer`] could not be built.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConcurrencyError {
    /// Neither a rule nor a total cap.
    NothingToLimit,
    /// A limit of zero would refuse every request (the rule's name, or `total`).
    ZeroLimit(String),
    /// A rule name that is empty, too long, or has characters outside `a-z A-Z 0-9 - _ . :`.
    InvalidRuleName(String),
    /// Two rules with one name.
    DuplicateRule(String),
    /// A rule with policies, tiers or shadow mode, which limit rates, not requests in flight.
    NotAConcurrencyRule(String),
    /// More rules than 65 535.
    TooManyRules(usize),
    /// The tiers of a [`tiered`](ConcurrencyLimitLayerBuilder::tiered) rule: none declared,
    /// a name used twice or not valid, a default that is not declared, or [`Tiers`] that
    /// declare policies.
    InvalidTiers {
        /// The rule.
        rule: String,
        /// What is wrong.
        reason: String,
    },
    /// A lease time outside [`MIN_LEASE_TIME`](super::MIN_LEASE_TIME) to
    /// [`MAX_LEASE_TIME`](super::MAX_LEASE_TIME), or shorter than three times the store's
    /// timeout (a renewal goes every third of it, and may take a timeout).
    #[cfg(feature = "redis")]
    LeaseTime(Duration),
    /// A [queue](ConcurrencyLimitLayerBuilder::queue) of no places, or with no time to wait
    /// (as [`ShedError::InvalidQueue`](crate::shed::ShedError::InvalidQueue)).
    InvalidQueue {
        /// The most requests waiting given.
        max_waiting: usize,
        /// The longest wait given.
        max_wait: Duration,
    },
}

impl fmt::Display for ConcurrencyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConcurrencyError::NothingToLimit => {
                f.write_str("no rule and no total cap: add .rule(..) or .total(..)")
            }
            ConcurrencyError::ZeroLimit(name) => {
                write!(f, "{name:?}: a limit of 0 in flight refuses every request")
            }
            ConcurrencyError::InvalidRuleName(name) => write!(
                f,
                "invalid rule name {name:?}: use 1 to {} of a-z A-Z 0-9 - _ . :",
                crate::MAX_NAME_LEN
            ),
            ConcurrencyError::DuplicateRule(name) => write!(f, "two rules are named {name:?}"),
            ConcurrencyError::NotAConcurrencyRule(name) => write!(
                f,
                "rule {name:?} has policies, tiers or shadow mode: a concurrency rule takes \
                 only its matching and key, and its limit from .rule(rule, max_in_flight)"
            ),
            ConcurrencyError::TooManyRules(n) => write!(f, "{n} rules: at most 65535"),
            ConcurrencyError::InvalidTiers { rule, reason } => {
                write!(f, "the tiers of rule {rule:?}: {reason}")
            }
            #[cfg(feature = "redis")]
            ConcurrencyError::LeaseTime(t) => write!(
                f,
                "a lease time of {t:?}: use {:?} to {:?}, and at least three times the \
                 store's timeout",
                super::MIN_LEASE_TIME,
                super::MAX_LEASE_TIME
            ),
            ConcurrencyError::InvalidQueue {
                max_waiting,
                max_wait,
            } => write!(
                f,
                "a queue of {max_waiting} places with a longest wait of {max_wait:?}: both \
                 must be above zero"
            ),
        }
    }
}

impl std::error::Error for ConcurrencyError {}
