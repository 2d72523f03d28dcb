//! The configuration's shape: plain data, read from a file or written in code.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::human::{HumanDuration, HumanRate};

/// A whole configuration: the store, named key extractors, the answers, the rate-limit rules
/// and the overload layers (see the [module docs](super) for a complete file).
///
/// Every field has a default, so a file holds only what it changes. Unknown fields are errors.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Config {
    /// Where the rate-limit state lives.
    pub store: StoreConfig,
    /// Key extractors by name, for rules to refer to (`key = "client"`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, KeyConfig>,
    /// How refusals and admitted responses are answered.
    pub answers: AnswersConfig,
    /// What the rate-limit layer's DEBUG decision span shows of keys (feature `tracing`):
    /// `none` (the default), `hashed` (a short stable hash) or `plain`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_keys: Option<KeyTraceConfig>,
    /// The rate-limit rules, in order; every rule that matches a request applies to it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<RuleConfig>,
    /// The per-key concurrency limit, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<ConcurrencyConfig>,
    /// The load shedder, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shed: Option<ShedConfig>,
}

/// [`KeyTrace`](crate::telemetry::KeyTrace), by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum KeyTraceConfig {
    /// Keys are not shown.
    None,
    /// A short stable hash of each key.
    Hashed,
    /// The keys themselves (only ever at DEBUG).
    Plain,
}

/// Which store, and how it fails.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct StoreConfig {
    /// `memory` (the default) or `redis`.
    pub kind: StoreKind,
    /// The `store` label of its metrics (`memory`, or `default` for Redis, unless set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// In process: the most (key, policy) pairs kept.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_keys: Option<usize>,
    /// In process: the number of shards (a power of two).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shards: Option<usize>,
    /// The longest key decided (longer keys are hashed by the limiter).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_key_len: Option<usize>,
    /// Redis: the server's URL (`redis://host:port/db`; `rediss://` for TLS).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Redis Cluster: seed nodes as `host:port` (instead of `url`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cluster: Vec<String>,
    /// Redis: the prefix of every key name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// Redis: connections in the pool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_size: Option<usize>,
    /// Redis: the most a decision may take; slower is a failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout: Option<HumanDuration>,
    /// Redis Cluster: the most calls across slots (stacked limits whose keys live on several
    /// masters) in flight at once; past it such a call fails at once, consuming nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cross_slot_calls: Option<usize>,
    /// Redis: refused keys remembered in process (0 turns the deny cache off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deny_cache: Option<usize>,
    /// Redis: what to answer when it fails: `closed` (503, the default), `open` (admit) or
    /// `local` (decide in process, limits divided by `instances`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_failure: Option<FailureConfig>,
    /// Redis: the instances sharing the limits, for `on_failure = "local"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instances: Option<u64>,
    /// Redis: the circuit breaker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker: Option<BreakerConfig>,
}

/// The kind of store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum StoreKind {
    /// [`MemoryStore`](crate::MemoryStore).
    #[default]
    Memory,
    /// [`RedisStore`](crate::store::redis::RedisStore) behind a
    /// [`ResilientStore`](crate::store::ResilientStore) (feature `redis`).
    Redis,
}

/// What to answer when the store fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FailureConfig {
    /// Admit.
    Open,
    /// Refuse with 503.
    Closed,
    /// Decide in process.
    Local,
}

/// The circuit breaker of a Redis store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct BreakerConfig {
    /// Consecutive failures that open it.
    pub failures: u32,
    /// How long it stays open before a probe.
    pub open_for: HumanDuration,
}

/// A key extractor (see [`crate::key`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct KeyConfig {
    /// What the key is.
    pub kind: KeyKind,
    /// `header`: the header's name (`x-api-key`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// `forwarded`: the networks of the proxies trusted to report the client's address.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub trusted: Vec<String>,
    /// `forwarded`: read the standard `Forwarded` header instead of `X-Forwarded-For`.
    #[serde(skip_serializing_if = "is_false")]
    pub rfc7239: bool,
    /// `peer_ip`, `forwarded`: group IPv4 addresses by this many leading bits (32 unless set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipv4_prefix: Option<u8>,
    /// `peer_ip`, `forwarded`: group IPv6 addresses by this many leading bits (64 unless set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipv6_prefix: Option<u8>,
    /// `any_of`, `all_of`: the keys combined, by name.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub of: Vec<String>,
    /// `custom`: the name an extractor was registered under in code
    /// ([`Bindings::key`](super::Bindings::key)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub binding: Option<String>,
}

/// The kinds of key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum KeyKind {
    /// One key for all requests.
    #[default]
    Global,
    /// The connection's address.
    PeerIp,
    /// The client's address as trusted proxies report it.
    Forwarded,
    /// A header's value.
    Header,
    /// The first of `of` that finds a key.
    AnyOf,
    /// All of `of`, joined.
    AllOf,
    /// An extractor registered in code.
    Custom,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The answers' options.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct AnswersConfig {
    /// Which rate-limit fields responses carry: `ietf` (the default), `legacy`, `both`, `off`.
    pub headers: HeadersConfig,
    /// `X-RateLimit-Reset` as `delta_seconds` (the default) or `unix_seconds`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub legacy_reset: Option<ResetConfig>,
    /// The `Retry-After` of a 503 sent because the store failed (1 s unless set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable_retry_after: Option<HumanDuration>,
    /// Whether an admitted request's decision goes into its extensions for the handler (no
    /// unless set, as for the layer built in code).
    #[serde(skip_serializing_if = "is_false")]
    pub decision_extension: bool,
}

/// [`HeaderProfile`](crate::answer::HeaderProfile), by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum HeadersConfig {
    /// The IETF draft's `RateLimit-Policy` and `RateLimit`.
    #[default]
    Ietf,
    /// `X-RateLimit-*`.
    Legacy,
    /// Both.
    Both,
    /// None.
    Off,
}

/// [`ResetFormat`](crate::answer::ResetFormat), by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ResetConfig {
    /// Seconds from now.
    DeltaSeconds,
    /// A Unix time.
    UnixSeconds,
}

/// One rate-limit rule (see [`Rule`](crate::limiter::Rule)).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RuleConfig {
    /// Its name (1 to 64 of `a-z A-Z 0-9 - _ . :`), unique among the rules.
    pub name: String,
    /// Only these methods (`GET` also covers `HEAD` unless `exact_methods`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    /// The methods exactly as listed.
    #[serde(skip_serializing_if = "is_false")]
    pub exact_methods: bool,
    /// Only this exact path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Only paths under this prefix, by whole segments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// Only this axum route template (`/users/{id}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    /// The key: a name from `[keys]`, or `global` / `peer_ip` (global unless set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// What a request costs (1 unless set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
    /// The policies, all of which must admit a request (or `tiers`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<PolicyConfig>,
    /// Policies by the key's tier, instead of `policies`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiers: Option<TiersConfig>,
    /// A request without a key: `"skip"` the rule, or refuse it with this status (500 unless
    /// set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_missing_key: Option<MissingKeyConfig>,
    /// Decide and report, never refuse.
    #[serde(skip_serializing_if = "is_false")]
    pub shadow: bool,
}

/// What a rule does without a key: `"skip"`, or a status such as `401`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
#[non_exhaustive]
pub enum MissingKeyConfig {
    /// `"skip"`.
    Skip(Skip),
    /// Refuse with this status.
    Reject(u16),
}

/// The word `skip`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Skip {
    /// `"skip"`.
    Skip,
}

/// One policy (see [`Policy`](crate::Policy)).
///
/// Windows (`fixed_window`, `sliding_log`, `sliding_window`) take `limit` and `window`, or a
/// `rate` (`"100/minute"` is a limit of 100 per window of a minute). Buckets (`token_bucket`,
/// `leaky_bucket`, `gcra`) take a `rate` and a `burst` (the rate's count unless set).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PolicyConfig {
    /// The algorithm.
    pub algorithm: AlgorithmConfig,
    /// Windows: the most admitted per window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// Windows: the window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<HumanDuration>,
    /// Buckets: the rate; windows: the limit and window in one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<HumanRate>,
    /// Buckets: the burst (the leaky bucket's capacity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    /// The name clients see in the fields (the rule's unless set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl PolicyConfig {
    /// A policy of `algorithm` with nothing else set yet.
    pub fn new(algorithm: AlgorithmConfig) -> Self {
        PolicyConfig {
            algorithm,
            limit: None,
            window: None,
            rate: None,
            burst: None,
            name: None,
        }
    }
}

/// [`Algorithm`](crate::Algorithm), by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum AlgorithmConfig {
    /// Fixed window.
    FixedWindow,
    /// Sliding log.
    SlidingLog,
    /// Sliding window counter.
    SlidingWindow,
    /// Token bucket.
    TokenBucket,
    /// Leaky bucket (meter).
    LeakyBucket,
    /// GCRA.
    Gcra,
}

/// Tiers of a rule (see [`Tiers`](crate::limiter::Tiers)): each tier's policies, and how a
/// key's tier is found: listed here by key, or asked of a resolver registered in code
/// ([`Bindings::resolver`](super::Bindings::resolver)), the list first.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct TiersConfig {
    /// The name of a resolver registered in code.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resolver: Option<String>,
    /// Keys whose tier is known up front (key -> tier), written as requests carry them
    /// (`"k%1"` is the header value `k%1`): for an `all_of` key, the values joined by `/`
    /// (`"acme/42"`; the last value takes the rest); for an `any_of` key, the first key's
    /// value, or another's as `name=value` (`"client=203.0.113.9"`), so that a value listed
    /// for one key is never matched by another's (a client sending a listed address as its
    /// API key). Listed keys are looked at before the resolver.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, String>,
    /// The tier of keys placed nowhere (the first plan unless set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// How long a resolver's answer is remembered (60 s unless set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_for: Option<HumanDuration>,
    /// How many keys' answers are remembered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_capacity: Option<usize>,
    /// The longest a request waits for the resolver (1 s unless set); past it, or when the
    /// resolver fails or panics, the request is counted in the default tier and nothing is
    /// remembered (see [`Tiers::timeout`](crate::limiter::Tiers::timeout)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout: Option<HumanDuration>,
    /// The tiers and their policies.
    pub plans: Vec<PlanConfig>,
}

/// One tier and its policies.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct PlanConfig {
    /// The tier's name.
    pub name: String,
    /// Its policies.
    pub policies: Vec<PolicyConfig>,
}

/// The concurrency limit (see [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer)).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ConcurrencyConfig {
    /// The `layer` label of its metrics (`concurrency` unless set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Limits per key.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<ConcurrencyRuleConfig>,
    /// The most in flight in all (503 past it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total: Option<u32>,
    /// A bounded wait for a place.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueConfig>,
    /// Count places on the Redis store, across instances (needs `store.kind = "redis"`).
    #[serde(skip_serializing_if = "is_false")]
    pub distributed: bool,
    /// Distributed: how long a lease lasts without renewal.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_time: Option<HumanDuration>,
    /// Distributed: `local` (the default) or `open` count in process when Redis fails; `closed`
    /// refuses with 503.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_store_error: Option<FailureConfig>,
}

/// One concurrency rule: which requests, by which key, how many in flight per key.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ConcurrencyRuleConfig {
    /// Its name.
    pub name: String,
    /// Only these methods.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    /// Only this exact path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Only paths under this prefix.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// Only this axum route template.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    /// The key, as for rate-limit rules.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// A request without a key, as for rate-limit rules.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_missing_key: Option<MissingKeyConfig>,
    /// The most in flight per key.
    pub max_in_flight: u32,
}

/// A bounded queue.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct QueueConfig {
    /// The most requests waiting.
    pub max_waiting: usize,
    /// The longest wait.
    pub max_wait: HumanDuration,
}

/// The load shedder (see [`LoadShedLayer`](crate::LoadShedLayer)).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ShedConfig {
    /// The `layer` label of its metrics (`shed` unless set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The limit's kind: `fixed`, `vegas` (adaptive, the usual choice) or `aimd`.
    pub limit: ShedLimitKind,
    /// Fixed: the limit; adaptive: where it starts.
    pub initial: u32,
    /// Adaptive: the bounds of the limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<u32>,
    /// Adaptive: the bounds of the limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<u32>,
    /// AIMD: the latency above which the limit shrinks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<HumanDuration>,
    /// The header that carries a request's class (`critical_plus`, `critical`,
    /// `sheddable_plus`, `sheddable`); all critical unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_header: Option<String>,
    /// The share of capacity from which each class is shed (class name -> 0.001..=1).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub shares: BTreeMap<String, f64>,
    /// Fair shedding among tenants keyed by this key (a name from `[keys]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fair_by: Option<String>,
    /// The share of capacity from which fairness applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fair_from: Option<f64>,
    /// The most of the limit one tenant may hold at once, whatever the load (0.001..=1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fair_cap: Option<f64>,
    /// A bounded queue in front of the limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueConfig>,
    /// The header in which clients declare their timeout (`grpc-timeout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_header: Option<String>,
}

/// The kinds of shedding limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ShedLimitKind {
    /// A fixed limit.
    Fixed,
    /// TCP Vegas' estimate of the queue.
    Vegas,
    /// Additive increase, multiplicative decrease on a latency target.
    Aimd,
}
