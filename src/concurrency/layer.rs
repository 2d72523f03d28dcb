//! The layer's configuration, and the state every clone of it shares.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Response, StatusCode};
use smallvec::SmallVec;
use tower_layer::Layer;

#[cfg(feature = "redis")]
use super::leases::{Denied, Lease, Leases};
use super::service::ConcurrencyLimit;
use super::table::InFlight;
use crate::answer::{DefaultResponder, Rejection, RejectionKind, Responder};
use crate::clock::{Clock, SystemClock};
use crate::inflight::{Admitted, Held, Refuse};
use crate::key::{Key, MAX_KEY_LEN};
use crate::limiter::{Matcher, Rule, TierLookup, Tiers, valid_name};
#[cfg(feature = "redis")]
use crate::store::FailurePolicy;
use crate::sync::{AtomicU32, AtomicU64, AtomicUsize};
use crate::telemetry::{Counter, Gauge, Histogram};

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
    /// answer.
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
    /// refused at once. A request that waits longer, or finds `max_waiting` others already
    /// waiting, gets the usual answer (`429`, or `503` for the total cap). Waiters are woken
    /// when a place of their key is given back; they are not served in order of arrival (a
    /// newcomer may take a place first), so keep `max_wait` short: it bounds the latency
    /// the queue adds. The wait runs on tokio's timer.
    ///
    /// At most as many requests wait for a key as the key has places, whatever refused them
    /// (their key, or the total cap): one client cannot fill the queue. Both numbers must be
    /// above zero ([`ConcurrencyError::InvalidQueue`]); a `max_wait` too long to reach
    /// (`Duration::MAX`) is no deadline.
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
    /// system's monotonic clock unless set; a [`ManualClock`](crate::clock::ManualClock) in
    /// tests).
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

/// The layer's metrics, registered when it is built.
struct Telemetry {
    in_flight: Gauge,
    queue: Histogram,
    /// Per rule: its keys busy, and requests without a key refused.
    rules: Box<[[Counter; 2]]>,
    full: Counter,
    #[cfg(feature = "redis")]
    store_down: Counter,
}

impl Telemetry {
    fn new(layer: &str, rules: &[KeyedRule], total: bool, store_down: bool) -> Self {
        #[cfg(not(feature = "redis"))]
        let _ = store_down;
        use crate::metrics::{CONCURRENCY_REFUSED_TOTAL, IN_FLIGHT, QUEUE_DURATION_SECONDS};
        let refused = |rule: &str, reason| {
            Counter::new(
                CONCURRENCY_REFUSED_TOTAL,
                &[("layer", layer), ("rule", rule), ("reason", reason)],
            )
        };
        let optional = |on: bool, reason| {
            if on {
                refused("", reason)
            } else {
                Counter::noop()
            }
        };
        Telemetry {
            in_flight: Gauge::new(IN_FLIGHT, &[("layer", layer)]),
            queue: Histogram::new(QUEUE_DURATION_SECONDS, &[("layer", layer)]),
            rules: rules
                .iter()
                .map(|r| {
                    let name = &*r.matcher.name;
                    let no_key = if r.matcher.refuses_without_key() {
                        refused(name, "no_key")
                    } else {
                        Counter::noop()
                    };
                    [refused(name, "busy"), no_key]
                })
                .collect(),
            full: optional(total, "full"),
            #[cfg(feature = "redis")]
            store_down: optional(store_down, "store_down"),
        }
    }

    /// Counts a refusal, and logs it at DEBUG.
    fn refused(&self, layer: &str, rules: &[KeyedRule], refusal: &Refusal) {
        let rule = |index: u16| rules.get(usize::from(index)).map(|r| &*r.matcher.name);
        let (counter, rule, reason) = match refusal {
            Refusal::Busy { rule: index } => (
                self.rules.get(usize::from(*index)).map(|c| &c[0]),
                rule(*index),
                "busy",
            ),
            Refusal::NoKey { rule: index, .. } => (
                self.rules.get(usize::from(*index)).map(|c| &c[1]),
                rule(*index),
                "no_key",
            ),
            Refusal::Full => (Some(&self.full), None, "full"),
            #[cfg(feature = "redis")]
            Refusal::StoreDown => (Some(&self.store_down), None, "store_down"),
        };
        if let Some(counter) = counter {
            counter.increment(1);
        }
        let _ = (layer, rule, reason);
        crate::telemetry::event!(
            debug,
            name: "tollgate.concurrency.refused",
            layer,
            rule = rule.unwrap_or(""),
            reason,
            "the concurrency limit refused a request"
        );
    }
}

/// What every clone of the layer and its services shares.
pub(crate) struct Shared {
    /// The layer's name in metrics and logs.
    name: Arc<str>,
    telemetry: Telemetry,
    rules: Box<[KeyedRule]>,
    pub(crate) in_flight: InFlight,
    total: Option<Total>,
    queue: Option<Queue>,
    /// How long requests stayed in flight, over all rules.
    latency: Latency,
    #[cfg(feature = "redis")]
    leases: Option<Arc<Leases>>,
    responder: Box<dyn Responder>,
    clock: Arc<dyn Clock>,
}

/// A rule: which requests, which key, how many in flight per key.
struct KeyedRule {
    matcher: Matcher,
    /// The limit per key (with tiers, the largest of theirs).
    max: u32,
    tiers: Option<TieredLimits>,
    /// How long this rule's requests stayed in flight.
    latency: Latency,
}

/// A rule's limit as the builder got it.
#[derive(Debug)]
enum RuleLimit {
    One(u32),
    Tiered(Tiers, Vec<(String, u32)>),
}

/// The limits of a tiered rule: the lookup of a key's tier, and each tier's limit.
struct TieredLimits {
    lookup: TierLookup,
    limits: Box<[u32]>,
}

/// Checks the tiers of rule `rule` and makes their lookup.
fn tiered_limits(
    rule: &str,
    mut tiers: Tiers,
    limits: Vec<(String, u32)>,
) -> Result<TieredLimits, ConcurrencyError> {
    let invalid = |reason: String| ConcurrencyError::InvalidTiers {
        rule: rule.to_owned(),
        reason,
    };
    if !tiers.tiers.is_empty() {
        return Err(invalid(
            "its Tiers declare policies (.tier): give the tiers' limits to .tiered instead".into(),
        ));
    }
    if limits.is_empty() {
        return Err(invalid("no tier declared".into()));
    }
    if limits.len() > usize::from(u16::MAX) {
        return Err(invalid("more than 65535 tiers".into()));
    }
    for (i, (tier, max)) in limits.iter().enumerate() {
        if !valid_name(tier) {
            return Err(invalid(format!(
                "tier name {:?}: use 1 to {} of a-z A-Z 0-9 - _ . :",
                tier.chars().take(80).collect::<String>(),
                crate::MAX_NAME_LEN
            )));
        }
        if limits[..i].iter().any(|(t, _)| t == tier) {
            return Err(invalid(format!("tier {tier:?} is declared twice")));
        }
        if *max == 0 {
            return Err(ConcurrencyError::ZeroLimit(format!("{rule}/{tier}")));
        }
    }
    let default = match &tiers.default {
        None => 0,
        Some(d) => limits
            .iter()
            .position(|(t, _)| t == d)
            .ok_or_else(|| invalid(format!("the default tier {d:?} is not declared")))?,
    };
    tiers.tiers = limits
        .iter()
        .map(|(t, _)| (t.clone(), Vec::new()))
        .collect();
    Ok(TieredLimits {
        lookup: tiers.into_resolved(rule, u16::try_from(default).unwrap_or(0)),
        limits: limits.into_iter().map(|(_, max)| max).collect(),
    })
}

impl TieredLimits {
    /// The limit of a tier (the lookup answers only tiers it was given).
    fn limit(&self, tier: u16) -> u32 {
        self.limits.get(usize::from(tier)).copied().unwrap_or(0)
    }
}

struct Total {
    max: u32,
    count: AtomicU32,
}

/// Requests waiting for a place: at most `max`, each at most `max_wait`.
struct Queue {
    max: usize,
    max_wait: Duration,
    waiting: AtomicUsize,
}

/// A request counted among those waiting for a place of `key`; dropping it stops counting.
struct KeyQueue<'a> {
    in_flight: &'a InFlight,
    hash: u64,
    key: Key,
}

impl Drop for KeyQueue<'_> {
    fn drop(&mut self) {
        self.in_flight.leave_queue(self.hash, &self.key);
    }
}

/// A request's place in the [`Queue`]; dropping it leaves the queue.
struct InQueue<'a>(&'a AtomicUsize);

impl Drop for InQueue<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Queue {
    /// A place in the queue, if it is not full.
    fn enter(&self) -> Option<InQueue<'_>> {
        self.waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| InQueue(&self.waiting))
    }
}

/// A moving average of the time requests stay in flight, in nanoseconds (each new sample
/// weighs one eighth); 0 before the first.
#[derive(Default)]
struct Latency(AtomicU64);

impl Latency {
    fn record(&self, nanos: u64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |avg| {
                Some(if avg == 0 {
                    nanos.max(1)
                } else {
                    avg - avg / 8 + nanos / 8
                })
            });
    }

    /// The average, as a `Retry-After`: at least 1 s, at most [`MAX_RETRY_AFTER`] (a rule over
    /// long downloads or streams would otherwise send clients away for hours).
    fn retry_after(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
            .clamp(Duration::from_secs(1), MAX_RETRY_AFTER)
    }
}

/// The longest `Retry-After` a concurrency refusal sends.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// The places one request holds; dropping it gives them back and times the request.
pub(crate) struct Permit {
    shared: Arc<Shared>,
    held: Places,
    started: u64,
    /// Whether the request got every place: a permit dropped while being refused gives back
    /// what it took but teaches nothing about how long requests stay.
    granted: bool,
    #[cfg(feature = "redis")]
    leases: SmallVec<[Lease; 1]>,
}

/// The limit of a place whose key's tier is not known yet.
const UNRESOLVED: u32 = 0;

/// The keys a request takes a place of, one per rule that applies.
type Places = SmallVec<[Place; 2]>;

struct Place {
    rule: u16,
    max: u32,
    /// The key as the extractor found it, while its tier is being resolved.
    raw: Option<Box<str>>,
    hash: u64,
    key: Key,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let shared = &self.shared;
        #[cfg(feature = "redis")]
        if let Some(leases) = &shared.leases {
            leases.release(self.leases.drain(..));
        }
        shared.release(&self.held);
        if self.granted {
            shared.telemetry.in_flight.decrement();
            let elapsed = shared.clock.now().saturating_sub(self.started);
            for place in &self.held {
                if let Some(rule) = shared.rules.get(usize::from(place.rule)) {
                    rule.latency.record(elapsed);
                }
            }
            shared.latency.record(elapsed);
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field(
                "keys",
                &self.held.iter().map(|h| &h.key).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Permit {
    /// The request got every place: it is timed from now on.
    fn grant(mut self) -> Held {
        self.granted = true;
        self.shared.telemetry.in_flight.increment();
        self.started = self.shared.clock.now();
        Held::Concurrency(self)
    }
}

/// Why a request gets no permit.
pub(crate) enum Refusal {
    /// The store that counts the places failed and the policy is to refuse.
    #[cfg(feature = "redis")]
    StoreDown,
    /// Rule `rule`'s key is at its limit.
    Busy { rule: u16 },
    /// The total cap is reached.
    Full,
    /// Rule `rule` found no key and refuses such requests with `status`.
    NoKey { rule: u16, status: StatusCode },
}

impl Shared {
    /// Takes the places of every rule that applies and of the total cap, all or none; or,
    /// with a queue that has room, waits for them.
    pub(crate) fn admit(self: &Arc<Self>, parts: &Parts) -> Result<Admitted, Refusal> {
        let places = self.places(parts)?;
        if places.iter().any(|p| p.max == UNRESOLVED) {
            return Ok(Admitted::Later(Box::pin(Arc::clone(self).resolve(places))));
        }
        self.admit_places(places)
    }

    /// Takes the places (and leases), or waits for them in the queue.
    fn admit_places(self: &Arc<Self>, mut places: Places) -> Result<Admitted, Refusal> {
        match self.take(&mut places) {
            #[cfg(feature = "redis")]
            Ok(permit) if self.leases.is_some() && !permit.held.is_empty() => {
                Ok(Admitted::Later(Box::pin(Arc::clone(self).lease(permit))))
            }
            Ok(permit) => Ok(Admitted::Now(permit.grant())),
            Err(refusal) => match &self.queue {
                Some(queue) if queue.waiting.load(Ordering::Acquire) < queue.max => Ok(
                    Admitted::Later(Box::pin(Arc::clone(self).wait(places, refusal))),
                ),
                _ => Err(refusal),
            },
        }
    }

    /// Asks the resolver the tiers not remembered yet, then admits.
    async fn resolve(self: Arc<Self>, mut places: Places) -> Result<Held, Refuse> {
        for place in places.iter_mut().filter(|p| p.max == UNRESOLVED) {
            if let Some(tiers) = self
                .rules
                .get(usize::from(place.rule))
                .and_then(|r| r.tiers.as_ref())
            {
                let raw = place.raw.take();
                let answer = tiers
                    .lookup
                    .resolve(raw.as_deref().unwrap_or(place.key.as_str()))
                    .await;
                let tier = tiers.lookup.settle(place.key.as_str(), &answer);
                place.max = tiers.limit(tier);
            }
        }
        match self.admit_places(places) {
            Ok(Admitted::Now(held)) => Ok(held),
            Ok(Admitted::Later(pending)) => pending.await,
            Err(refusal) => Err(Box::new(move |parts: &Parts| self.answer(parts, refusal))),
        }
    }

    /// The keys of the rules that apply to a request.
    fn places(&self, parts: &Parts) -> Result<Places, Refusal> {
        let mut places = Places::new();
        for (index, rule) in self.rules.iter().enumerate() {
            if !rule.matcher.matches(parts) {
                continue;
            }
            let index = u16::try_from(index).unwrap_or(u16::MAX);
            let key = match rule.matcher.key(parts) {
                Ok(Some(key)) => key,
                Ok(None) => continue,
                Err(status) => {
                    return Err(Refusal::NoKey {
                        rule: index,
                        status,
                    });
                }
            };
            let (max, raw) = match &rule.tiers {
                None => (rule.max, None),
                Some(tiers) => match tiers.lookup.cached(key.as_str()) {
                    Some(tier) => (tiers.limit(tier), None),
                    None => (UNRESOLVED, rule.matcher.raw_key(parts)),
                },
            };
            places.push(Place {
                rule: index,
                max,
                raw,
                hash: self.in_flight.hash(key.as_str()),
                key,
            });
        }
        Ok(places)
    }

    /// Takes every place of `places` and one under the total cap (moving them into the
    /// permit), or none, and says why.
    fn take(self: &Arc<Self>, places: &mut Places) -> Result<Permit, Refusal> {
        for (taken, place) in places.iter().enumerate() {
            if !self.in_flight.acquire(place.hash, &place.key, place.max) {
                let refusal = Refusal::Busy { rule: place.rule };
                self.release_keys(&places[..taken]);
                return Err(refusal);
            }
        }
        if let Some(total) = &self.total {
            let taken = total
                .count
                // SeqCst, as the waiters count: a release must see a waiter that found no place,
                // or the waiter the place given back.
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < total.max).then_some(n + 1)
                });
            if taken.is_err() {
                self.release_keys(places);
                return Err(Refusal::Full);
            }
        }
        Ok(Permit {
            shared: Arc::clone(self),
            held: std::mem::take(places),
            started: self.clock.now(),
            granted: false,
            #[cfg(feature = "redis")]
            leases: SmallVec::new(),
        })
    }

    fn release_keys(&self, places: &[Place]) {
        for place in places {
            self.in_flight.release(place.hash, &place.key);
        }
    }

    /// Gives back the places of a permit: its keys' and one under the total cap.
    fn release(&self, places: &[Place]) {
        self.release_keys(places);
        if let Some(total) = &self.total {
            total.count.fetch_sub(1, Ordering::SeqCst);
            self.in_flight.total_released();
        }
    }

    /// Takes a lease on Redis for each key of `permit` (without Redis, nothing to take).
    async fn lease(self: Arc<Self>, permit: Permit) -> Result<Held, Refuse> {
        #[cfg(feature = "redis")]
        let permit = {
            let mut permit = permit;
            if let Some(leases) = self.leases.clone() {
                for i in 0..permit.held.len() {
                    let place = &permit.held[i];
                    let rule = place.rule;
                    match leases.acquire(place.key.as_str(), place.max).await {
                        Ok(Some(lease)) => permit.leases.push(lease),
                        Ok(None) => {}
                        Err(denied) => {
                            drop(permit);
                            let refusal = match denied {
                                Denied::Busy => Refusal::Busy { rule },
                                Denied::Unavailable => Refusal::StoreDown,
                            };
                            return Err(Box::new(move |parts: &Parts| self.answer(parts, refusal)));
                        }
                    }
                }
            }
            permit
        };
        Ok(permit.grant())
    }

    /// Waits in the queue for the places, then takes the leases; refused for the last reason
    /// met when the queue is full or the wait runs out.
    async fn wait(
        self: Arc<Self>,
        mut places: Places,
        mut refusal: Refusal,
    ) -> Result<Held, Refuse> {
        match self.queued(&mut places, &mut refusal).await {
            Some(permit) => self.lease(permit).await,
            None => Err(Box::new(move |parts: &Parts| self.answer(parts, refusal))),
        }
    }

    /// Waits (if the queue, and the queue of the key that refused, still have room) until
    /// the places are free, or the queue's longest wait has passed.
    async fn queued(
        self: &Arc<Self>,
        places: &mut Places,
        refusal: &mut Refusal,
    ) -> Option<Permit> {
        let queue = self.queue.as_ref()?;
        let _in_queue = queue.enter()?;
        // At most as many wait for a key as it has places, whatever refused the request (its
        // key, another rule's, or the total cap): one client cannot fill the queue.
        let mut _key_queues: SmallVec<[KeyQueue<'_>; 2]> = SmallVec::new();
        for place in places.iter() {
            if !self
                .in_flight
                .enter_queue(place.hash, &place.key, place.max)
            {
                return None;
            }
            _key_queues.push(KeyQueue {
                in_flight: &self.in_flight,
                hash: place.hash,
                key: place.key.clone(),
            });
        }
        let since = self.clock.now();
        let permit = self.wait_for_places(queue, places, refusal).await;
        self.telemetry
            .queue
            .record_nanos(self.clock.now().saturating_sub(since));
        permit
    }

    /// Takes the places once they are free, or gives up after the queue's longest wait.
    async fn wait_for_places(
        self: &Arc<Self>,
        queue: &Queue,
        places: &mut Places,
        refusal: &mut Refusal,
    ) -> Option<Permit> {
        // A wait too long to reach (`Duration::MAX`) is no deadline.
        let deadline = tokio::time::Instant::now().checked_add(queue.max_wait);
        let on = |places: &Places, refusal: &Refusal| match *refusal {
            Refusal::Busy { rule } => places.iter().find(|p| p.rule == rule).map(|p| p.hash),
            _ => None,
        };
        self.in_flight
            .wait_for(places, refusal, on, |places| self.take(places), deadline)
            .await
    }

    /// The answer to a refused request.
    pub(crate) fn answer(&self, parts: &Parts, refusal: Refusal) -> Response<Bytes> {
        self.telemetry.refused(&self.name, &self.rules, &refusal);
        let rule = |index: u16| self.rules.get(usize::from(index));
        let (kind, status, rule, retry_after) = match refusal {
            Refusal::Busy { rule: index } => (
                RejectionKind::TooManyInFlight,
                StatusCode::TOO_MANY_REQUESTS,
                rule(index),
                rule(index).map(|r| r.latency.retry_after()),
            ),
            #[cfg(feature = "redis")]
            Refusal::StoreDown => (
                RejectionKind::Unavailable,
                StatusCode::SERVICE_UNAVAILABLE,
                None,
                Some(Duration::from_secs(1)),
            ),
            Refusal::Full => (
                RejectionKind::Overloaded,
                StatusCode::SERVICE_UNAVAILABLE,
                None,
                Some(self.latency.retry_after()),
            ),
            Refusal::NoKey {
                rule: index,
                status,
            } => (RejectionKind::NoKey, status, rule(index), None),
        };
        crate::answer::refuse(
            &*self.responder,
            &Rejection {
                kind,
                parts,
                status,
                decision: None,
                rule: rule.map(|r| &*r.matcher.name),
                policy: None,
                window: None,
                retry_after,
                error: None,
            },
        )
    }
}

/// A key as the table holds it: hashed past [`MAX_KEY_LEN`], as the limiter's are.
pub(crate) fn bounded(key: Key) -> Key {
    if key.len() <= MAX_KEY_LEN {
        return key;
    }
    let text = key.as_str();
    let at = text.rfind('@').unwrap_or(text.len());
    crate::limiter::hashed_key(&text[..at], &text[at..])
}
