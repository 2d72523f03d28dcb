//! Metrics (feature `metrics`): counters, gauges and histograms on the
//! [`metrics`](https://docs.rs/metrics) facade, so any exporter works (Prometheus, StatsD,
//! OpenTelemetry, ...).
//!
//! **Install the recorder (the exporter) before building layers and stores.** Each layer and
//! store registers its handles once, when it is built, and keeps them in the state its clones
//! share: a request then only adds to atomics (one per rule for its decision, one per policy
//! for the cost it consumed), with no label to allocate and no registry to search. A layer built
//! before any recorder is installed keeps handles that record nothing, as with every
//! `metrics` exporter. Call [`describe`] once, after installing the recorder, to give each
//! metric its unit and description.
//!
//! **Cardinality is bounded by construction**: the labels are the names of rules, policies,
//! tiers, layers, stores and classes, all fixed in code or configuration, never a key, a path
//! or a client's address. Envoy's rate limit service labels by the configured domain and the
//! configured descriptor's path; where a request's values are asked for (`detailed_metric:
//! true`) or a request sends its own limit, a service makes at most
//! labels (`RateLimitService::max_metric_descriptors`, default 1,000), then counts under the
//! configured path (or `_other`).
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use metrics_util::debugging::{DebugValue, DebuggingRecorder};
//! use tollgate::{MemoryStore, Policy, Rate};
//! use tollgate::limiter::{Limiter, Rule};
//!
//! let recorder = DebuggingRecorder::new();
//! let snapshotter = recorder.snapshotter();
//! // In a service: `metrics_exporter_prometheus::PrometheusBuilder::new().install()?`, then build.
//! let store = metrics::with_local_recorder(&recorder, || {
//!     tollgate::metrics::describe();
//!     MemoryStore::builder().name("local").build()
//! });
//! let p = Policy::gcra(Rate::per_second(1), 1)?;
//! store.check_now("k", &p, 1)?;
//! store.record_metrics();
//! let keys = snapshotter.snapshot().into_vec().into_iter().find_map(|(key, _, _, value)| {
//!     (key.key().name() == tollgate::metrics::MEMORY_STORE_KEYS).then_some(value)
//! });
//! assert_eq!(keys, Some(DebugValue::Gauge(1.0.into())));
//! # Ok(())
//! # }
//! ```
//!
//! # Every metric
//!
//! | name | type | unit | labels | meaning |
//! | --- | --- | --- | --- | --- |
//! | `tollgate_decisions_total` | counter | decisions | `rule`, `policy`, `outcome` | The rate-limit layer's decisions: one per request and rule that decided it. `outcome`: `admitted` (every policy of the rule admitted the request; `policy` empty; for a shadow rule: would have), `limited` (the policy that refused the request: a 429; the other rules that applied consumed nothing and count nothing), `shadow_limited` (a shadow rule's policy would have refused it), `no_key` (the rule found no key and refuses such requests; `policy` empty), `store_error` (the store could not decide: a 503; each enforced rule that applied, `policy` empty), `failure_policy` (the store could not decide and its failure policy admitted the request, failing open or deciding in process: nothing was consumed from the store; each enforced rule that applied, `policy` empty). So `limited / all` by `rule` is each rule's refusal ratio. |
//! | `tollgate_cost_consumed_total` | counter | units of cost | `rule`, `policy` | The cost consumed from each policy by the requests it admitted (a shadow rule's included): each policy of each rule that applied to an admitted request. |
//! | `tollgate_tier_cache_total` | counter | lookups | `rule`, `result` | Tier lookups of a rule's key in its cache, by `result`: `hit` or `miss` (a miss asks the resolver, or waits for the lookup of its key under way). |
//! | `tollgate_store_duration_seconds` | histogram | seconds | `store` | How long each call of a `ResilientStore` that reached its store took (errors and timeouts included; calls refused by the open breaker not). |
//! | `tollgate_store_errors_total` | counter | calls | `store`, `kind` | Calls of a `ResilientStore` that ended in an error, by `kind`: `timeout`, `backend`, `circuit_open` (refused by the open breaker, the store not asked), `invalid` (the caller's mistake: a cost above the limit, a key too long, an unsupported policy; no failure policy applies). |
//! | `tollgate_store_failure_policy_total` | counter | calls | `store`, `action` | Calls of a `ResilientStore` answered by its failure policy, by `action`: `fail_open` (admitted), `fail_closed` (the error goes on: 503), `fallback` (decided by the in-process fallback). |
//! | `tollgate_breaker_state` | gauge | state | `store` | The `ResilientStore`'s circuit breaker: 0 closed, 1 half open (a probe is out), 2 open. |
//! | `tollgate_breaker_transitions_total` | counter | transitions | `store`, `to` | Changes of the breaker's state, by the state entered (`to`: `closed`, `half_open`, `open`). |
//! | `tollgate_deny_cache_hits_total` | counter | checks | (none) | Checks of a `RedisStore` answered by its local deny cache, without a round trip to Redis. |
//! | `tollgate_memory_store_keys` | gauge | (key, policy) pairs | `store` | The pairs a `MemoryStore` tracks, as of its last `sweep` or `record_metrics` call (counting them takes every shard's lock, so it is not done per request). |
//! | `tollgate_memory_store_evictions_total` | counter | (key, policy) pairs | `store` | Pairs a full `MemoryStore` forgot while their state was still live (non-zero means `max_keys` is too small, or a flood of keys). |
//! | `tollgate_in_flight` | gauge | requests | `layer` | Requests a `ConcurrencyLimitLayer` or `LoadShedLayer` admitted whose response body has not ended. |
//! | `tollgate_concurrency_refused_total` | counter | requests | `layer`, `rule`, `reason` | Requests a `ConcurrencyLimitLayer` refused, by `reason`: `busy` (the rule's key is at its limit: 429), `full` (the total cap: 503; `rule` empty), `no_key` (the rule found no key), `store_down` (Redis failed and the policy is to refuse: 503; `rule` empty). |
//! | `tollgate_shed_total` | counter | requests | `layer`, `class`, `reason` | Requests a `LoadShedLayer` shed (503), by criticality `class` (`critical_plus`, `critical`, `sheddable_plus`, `sheddable`) and `reason`: `capacity` (no room for the class, and no queue), `utilization` (the operator's signal), `unfair` (the tenant has its fair share), `queue_full` (the queue was full, or its waiter gave way to a higher class), `deadline` (the client's declared timeout leaves no time to wait), `timed_out` (waited in the queue and its wait ran out). |
//! | `tollgate_shed_limit` | gauge | requests | `layer` | The `LoadShedLayer`'s limit on requests in flight (it moves with an adaptive limit). |
//! | `tollgate_queue_duration_seconds` | histogram | seconds | `layer` | Time requests waited: in the queue of a `ConcurrencyLimitLayer` or `LoadShedLayer` (each request that waited, admitted or not), or for its departure in a `ShapeLayer` (each request it admitted, zero included). |
//! | `tollgate_shape_refused_total` | counter | requests | `layer`, `rule`, `reason` | Requests a `ShapeLayer` refused, by `reason`: `limited` (its wait would pass the queue: 429), `no_key`, `store_error` (503). |
//! | `tollgate_client_retries_total` | counter | retries | `client` | Retries a client `RetryPolicy` made (feature `client`; its `RetryLayer`s and reqwest middlewares together). |
//! | `tollgate_client_gave_up_total` | counter | requests | `client`, `reason` | Failures a client `RetryPolicy` answered as they were, by `reason`: `attempts`, `deadline`, `budget` (the retry budget was spent), `stop` (the server said not to retry), `not_replayable`, `inner` (an inner retry layer had given up). |
//! | `tollgate_client_breaker_state` | gauge | state | `client` | An outbound `CircuitBreakerLayer`: 0 closed, 1 half open, 2 open. |
//! | `tollgate_client_breaker_transitions_total` | counter | transitions | `client`, `to` | Changes of an outbound breaker's state, by the state entered (`closed`, `half_open`, `open`). |
//! | `tollgate_client_throttled_total` | counter | requests | `client` | Requests an `AdaptiveThrottleLayer` refused itself, without sending them. |
//! | `tollgate_envoy_hits_total` | counter | hits (units of cost) | `domain`, `descriptor`, `outcome` | Envoy's rate limit service (feature `envoy`): the hits (`hits_addend`, 1 by default) of each descriptor of a `ShouldRateLimit` call that matched a counted limit, by `outcome`, one per descriptor and call: `within_limit` (admitted, more than a fifth of the limit left), `near_limit` (admitted, using more than 80 % of the limit; told only for the descriptor whose limit decided the call, the one that runs out first, as the others' remainders are known only as lower bounds: they count `within_limit`), `over_limit` (this limit refused the call), `shadow_mode` (a `shadow_mode` limit would have refused; the call was answered as the other limits decided), `not_counted` (another limit of the call refused it: all or nothing, nothing was counted here). Their sum by `domain` and `descriptor` is envoyproxy/ratelimit's `total_hits`. `descriptor` is the configured descriptor's path (`message_type_marketing.to_number`), with the request's values only under `detailed_metric: true` (at most `max_metric_descriptors` such labels per service, then the configured path); `override:<keys>` for a limit Envoy sent. Unlimited descriptors, descriptors that match no limit, and calls that end in an error are not counted. |
//! | `tollgate_envoy_calls_total` | counter | calls | `domain`, `result` | `ShouldRateLimit` calls by `result`: `ok`, `over_limit`, `store_error` (`UNAVAILABLE`: Envoy applies its `failure_mode_deny`), `invalid` (`INVALID_ARGUMENT`), `unknown_domain` (answered `OK`). `domain` is the configured domain, empty for `invalid` and `unknown_domain` (a request's domain is not a label). |
//! | `tollgate_envoy_store_errors_total` | counter | store calls | `domain`, `pass` | Store calls of Envoy's rate limit service that failed, by `pass`: `enforced` (the call answered `UNAVAILABLE`), `shadow` (the shadow limits went uncounted; the call was answered as the enforced limits decided). |
//! | `tollgate_envoy_config_reloads_total` | counter | reloads | `result` | Configurations put in place by `RateLimitService::set_config` or `reload_from` (`success`), and configurations `reload_from` refused for a problem, the running one kept (`error`). |
//!
//! The layers' names (`layer`) are set with `.name(..)` on their builders (by default
//! `concurrency`, `shed` and `shape`), the client's (`client`) on `RetryPolicyBuilder`,
//! `CircuitBreakerLayerBuilder` and `AdaptiveThrottleLayerBuilder` (`default`), the stores'
//! (`store`) with
//! [`ResilientStoreBuilder::name`](crate::store::resilient::ResilientStoreBuilder::name)
//! (`default`) and [`MemoryStoreBuilder::name`](crate::store::MemoryStoreBuilder::name)
//! (`memory`; a `ResilientStore`'s own fallback store is `<name>-fallback`). Give two
//! layers or stores of one kind different names, or their series add up.

/// `tollgate_decisions_total`, see the [table](self#every-metric).
pub const DECISIONS_TOTAL: &str = "tollgate_decisions_total";
/// `tollgate_cost_consumed_total`, see the [table](self#every-metric).
pub const COST_CONSUMED_TOTAL: &str = "tollgate_cost_consumed_total";
/// `tollgate_tier_cache_total`, see the [table](self#every-metric).
pub const TIER_CACHE_TOTAL: &str = "tollgate_tier_cache_total";
/// `tollgate_store_duration_seconds`, see the [table](self#every-metric).
pub const STORE_DURATION_SECONDS: &str = "tollgate_store_duration_seconds";
/// `tollgate_store_errors_total`, see the [table](self#every-metric).
pub const STORE_ERRORS_TOTAL: &str = "tollgate_store_errors_total";
/// `tollgate_store_failure_policy_total`, see the [table](self#every-metric).
pub const STORE_FAILURE_POLICY_TOTAL: &str = "tollgate_store_failure_policy_total";
/// `tollgate_breaker_state`, see the [table](self#every-metric).
pub const BREAKER_STATE: &str = "tollgate_breaker_state";
/// `tollgate_breaker_transitions_total`, see the [table](self#every-metric).
pub const BREAKER_TRANSITIONS_TOTAL: &str = "tollgate_breaker_transitions_total";
/// `tollgate_deny_cache_hits_total`, see the [table](self#every-metric).
pub const DENY_CACHE_HITS_TOTAL: &str = "tollgate_deny_cache_hits_total";
/// `tollgate_memory_store_keys`, see the [table](self#every-metric).
pub const MEMORY_STORE_KEYS: &str = "tollgate_memory_store_keys";
/// `tollgate_memory_store_evictions_total`, see the [table](self#every-metric).
pub const MEMORY_STORE_EVICTIONS_TOTAL: &str = "tollgate_memory_store_evictions_total";
/// `tollgate_in_flight`, see the [table](self#every-metric).
pub const IN_FLIGHT: &str = "tollgate_in_flight";
/// `tollgate_concurrency_refused_total`, see the [table](self#every-metric).
pub const CONCURRENCY_REFUSED_TOTAL: &str = "tollgate_concurrency_refused_total";
/// `tollgate_shed_total`, see the [table](self#every-metric).
pub const SHED_TOTAL: &str = "tollgate_shed_total";
/// `tollgate_shed_limit`, see the [table](self#every-metric).
pub const SHED_LIMIT: &str = "tollgate_shed_limit";
/// `tollgate_queue_duration_seconds`, see the [table](self#every-metric).
pub const QUEUE_DURATION_SECONDS: &str = "tollgate_queue_duration_seconds";
/// `tollgate_shape_refused_total`, see the [table](self#every-metric).
pub const SHAPE_REFUSED_TOTAL: &str = "tollgate_shape_refused_total";

/// `tollgate_client_retries_total`, see the [table](self#every-metric).
pub const CLIENT_RETRIES_TOTAL: &str = "tollgate_client_retries_total";
/// `tollgate_client_gave_up_total`, see the [table](self#every-metric).
pub const CLIENT_GAVE_UP_TOTAL: &str = "tollgate_client_gave_up_total";
/// `tollgate_client_breaker_state`, see the [table](self#every-metric).
pub const CLIENT_BREAKER_STATE: &str = "tollgate_client_breaker_state";
/// `tollgate_client_breaker_transitions_total`, see the [table](self#every-metric).
pub const CLIENT_BREAKER_TRANSITIONS_TOTAL: &str = "tollgate_client_breaker_transitions_total";
/// `tollgate_client_throttled_total`, see the [table](self#every-metric).
pub const CLIENT_THROTTLED_TOTAL: &str = "tollgate_client_throttled_total";

/// `tollgate_envoy_hits_total`, see the [table](self#every-metric).
pub const ENVOY_HITS_TOTAL: &str = "tollgate_envoy_hits_total";
/// `tollgate_envoy_calls_total`, see the [table](self#every-metric).
pub const ENVOY_CALLS_TOTAL: &str = "tollgate_envoy_calls_total";
/// `tollgate_envoy_store_errors_total`, see the [table](self#every-metric).
pub const ENVOY_STORE_ERRORS_TOTAL: &str = "tollgate_envoy_store_errors_total";
/// `tollgate_envoy_config_reloads_total`, see the [table](self#every-metric).
pub const ENVOY_CONFIG_RELOADS_TOTAL: &str = "tollgate_envoy_config_reloads_total";

/// The type of a metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
    /// A distribution of values.
    Histogram,
}

/// One row of the [table](self#every-metric): what [`describe`] tells the recorder.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Metric {
    /// The metric's name.
    pub name: &'static str,
    /// Its type.
    pub kind: Kind,
    /// Its labels.
    pub labels: &'static [&'static str],
    /// What it counts or measures, in one line.
    pub description: &'static str,
}

const fn metric(
    name: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    description: &'static str,
) -> Metric {
    Metric {
        name,
        kind,
        labels,
        description,
    }
}

/// Every metric tollgate records, in the order of the [table](self#every-metric).
pub const ALL: &[Metric] = &[
    metric(
        DECISIONS_TOTAL,
        Kind::Counter,
        &["rule", "policy", "outcome"],
        "Rate-limit decisions, one per request and rule, by outcome (and the refusing policy).",
    ),
    metric(
        COST_CONSUMED_TOTAL,
        Kind::Counter,
        &["rule", "policy"],
        "Units of cost consumed from each policy by the requests it admitted.",
    ),
    metric(
        TIER_CACHE_TOTAL,
        Kind::Counter,
        &["rule", "result"],
        "Tier lookups in a rule's cache, by result (hit, miss).",
    ),
    metric(
        STORE_DURATION_SECONDS,
        Kind::Histogram,
        &["store"],
        "Time taken by the calls of a resilient store that reached the store.",
    ),
    metric(
        STORE_ERRORS_TOTAL,
        Kind::Counter,
        &["store", "kind"],
        "Calls of a resilient store that ended in an error, by kind.",
    ),
    metric(
        STORE_FAILURE_POLICY_TOTAL,
        Kind::Counter,
        &["store", "action"],
        "Calls answered by a resilient store's failure policy, by action.",
    ),
    metric(
        BREAKER_STATE,
        Kind::Gauge,
        &["store"],
        "A resilient store's circuit breaker: 0 closed, 1 half open, 2 open.",
    ),
    metric(
        BREAKER_TRANSITIONS_TOTAL,
        Kind::Counter,
        &["store", "to"],
        "Changes of a circuit breaker's state, by the state entered.",
    ),
    metric(
        DENY_CACHE_HITS_TOTAL,
        Kind::Counter,
        &[],
        "Redis checks answered by the local deny cache.",
    ),
    metric(
        MEMORY_STORE_KEYS,
        Kind::Gauge,
        &["store"],
        "(key, policy) pairs tracked by an in-process store, as of its last sweep or record.",
    ),
    metric(
        MEMORY_STORE_EVICTIONS_TOTAL,
        Kind::Counter,
        &["store"],
        "Pairs a full in-process store forgot while their state was live.",
    ),
    metric(
        IN_FLIGHT,
        Kind::Gauge,
        &["layer"],
        "Requests admitted by a concurrency or shedding layer whose body has not ended.",
    ),
    metric(
        CONCURRENCY_REFUSED_TOTAL,
        Kind::Counter,
        &["layer", "rule", "reason"],
        "Requests a concurrency layer refused, by rule and reason.",
    ),
    metric(
        SHED_TOTAL,
        Kind::Counter,
        &["layer", "class", "reason"],
        "Requests a shedding layer shed, by criticality class and reason.",
    ),
    metric(
        SHED_LIMIT,
        Kind::Gauge,
        &["layer"],
        "A shedding layer's limit on requests in flight.",
    ),
    metric(
        QUEUE_DURATION_SECONDS,
        Kind::Histogram,
        &["layer"],
        "Time requests waited in a layer's queue, or for their departure in a shaper.",
    ),
    metric(
        SHAPE_REFUSED_TOTAL,
        Kind::Counter,
        &["layer", "rule", "reason"],
        "Requests a shaping layer refused, by rule and reason.",
    ),
    metric(
        CLIENT_RETRIES_TOTAL,
        Kind::Counter,
        &["client"],
        "Retries a client retry policy made.",
    ),
    metric(
        CLIENT_GAVE_UP_TOTAL,
        Kind::Counter,
        &["client", "reason"],
        "Failures a client retry policy gave up on, by reason.",
    ),
    metric(
        CLIENT_BREAKER_STATE,
        Kind::Gauge,
        &["client"],
        "An outbound circuit breaker: 0 closed, 1 half open, 2 open.",
    ),
    metric(
        CLIENT_BREAKER_TRANSITIONS_TOTAL,
        Kind::Counter,
        &["client", "to"],
        "Changes of an outbound circuit breaker's state, by the state entered.",
    ),
    metric(
        CLIENT_THROTTLED_TOTAL,
        Kind::Counter,
        &["client"],
        "Requests a client's adaptive throttle refused itself.",
    ),
    metric(
        ENVOY_HITS_TOTAL,
        Kind::Counter,
        &["domain", "descriptor", "outcome"],
        "Hits of each descriptor of Envoy's ShouldRateLimit calls that matched a limit, by outcome.",
    ),
    metric(
        ENVOY_CALLS_TOTAL,
        Kind::Counter,
        &["domain", "result"],
        "Envoy's ShouldRateLimit calls, by result.",
    ),
    metric(
        ENVOY_STORE_ERRORS_TOTAL,
        Kind::Counter,
        &["domain", "pass"],
        "Failed store calls of Envoy's rate limit service, by pass (enforced, shadow).",
    ),
    metric(
        ENVOY_CONFIG_RELOADS_TOTAL,
        Kind::Counter,
        &["result"],
        "Envoy rate limit configurations put in place (success) or refused (error).",
    ),
];

/// Describes every metric (unit and description) to the recorder installed now: call it once,
/// after installing the recorder.
pub fn describe() {
    #[cfg(feature = "metrics")]
    for m in ALL {
        let unit = if m.name.ends_with("_seconds") {
            Some(::metrics::Unit::Seconds)
        } else if m.kind == Kind::Counter {
            Some(::metrics::Unit::Count)
        } else {
            None
        };
        match (m.kind, unit) {
            (Kind::Counter, Some(unit)) => {
                ::metrics::describe_counter!(m.name, unit, m.description)
            }
            (Kind::Counter, None) => ::metrics::describe_counter!(m.name, m.description),
            (Kind::Gauge, Some(unit)) => ::metrics::describe_gauge!(m.name, unit, m.description),
            (Kind::Gauge, None) => ::metrics::describe_gauge!(m.name, m.description),
            (Kind::Histogram, Some(unit)) => {
                ::metrics::describe_histogram!(m.name, unit, m.description)
            }
            (Kind::Histogram, None) => ::metrics::describe_histogram!(m.name, m.description),
        }
    }
}
