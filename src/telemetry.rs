//! What tollgate tells your logs and metrics: the tracing spans and events (feature
//! `tracing`), the metrics (feature `metrics`, listed in `tollgate::metrics`), and how keys
//! appear in them ([`KeyTrace`]).
//!
//! Both features are on by default; without them (`default-features = false`) nothing of
//! this is compiled in: no handle, no clock read, no span. With them, a request that no
//! subscriber wants DEBUG for makes no span (one relaxed load of `tracing`'s maximum level
//! decides), and a recorded metric is an atomic add on a handle registered when the layer was
//! built; BENCHMARKS.md has what both cost per request.
//!
//! # Tracing
//!
//! Spans and events go to whatever [`tracing`](https://docs.rs/tracing) subscriber the service
//! installs, with targets under `tollgate` (filter with `tollgate=debug`, say). Each has a
//! name of its own, so a subscriber (or a test) can pick it out.
//!
//! | name | kind | level | fields | when |
//! | --- | --- | --- | --- | --- |
//! | `tollgate.decision` | span | DEBUG | `rule`, `policy`, `outcome`, `remaining`, `key` | one per request the rate-limit layer decides; it covers the decision, the store's answer included. `outcome` is `admitted`, `limited`, `no_key`, `store_error` or `unchecked` (no enforced rule applies); `rule` and `policy` the ones that decided (the most restrictive, as the `RateLimit` field reports it); `key` only with [`KeyTrace::Hashed`] or [`KeyTrace::Plain`] |
//! | `tollgate.shadow_limited` | event | DEBUG | `rule`, `policy`, `remaining` | a shadow rule would have refused the request (inside the decision's span) |
//! | `tollgate.store.failed` | event | WARN | `store`, `kind`, `error` | a call of a [`ResilientStore`](crate::store::ResilientStore) reached the store and failed (an error or a timeout); calls refused by the open breaker are not logged one by one |
//! | `tollgate.breaker.opened` | event | WARN | `store`, `open_for` | the breaker of a `ResilientStore` opened (a run of failures, or a failed probe) |
//! | `tollgate.breaker.half_open` | event | DEBUG | `store` | the breaker lets one probe through |
//! | `tollgate.breaker.closed` | event | INFO | `store` | the breaker closed: the store answers again |
//! | `tollgate.tier_fallback` | event | WARN (at most one a second per rule; the others DEBUG) | `rule`, `reason` | a rule's tier resolver gave no answer and the request was counted in the default tier, remembered for nobody: `reason` is `error` (the resolver's answer was an `Err`), `panic` or `timeout` ([`Tiers::timeout`](crate::limiter::Tiers::timeout)). One per request that fell back. Without the resolver's error text, which may hold the key |
//! | `tollgate.tier_fallback.error` | event | DEBUG | `rule`, `error` | the text of that `Err`, as the resolver wrote it (for `reason = "error"`, right after the fallback's event) |
//! | `tollgate.concurrency.refused` | event | DEBUG | `layer`, `rule`, `reason` | the concurrency layer refused a request (`busy`, `full`, `no_key`, `store_down`) |
//! | `tollgate.shed` | event | DEBUG | `layer`, `class`, `reason` | the shedder shed a request (reasons as in the `tollgate_shed_total` metric) |
//! | `tollgate.shed.limit` | event | DEBUG | `layer`, `from`, `to` | the shedder's adaptive limit moved |
//! | `tollgate.shape.refused` | event | DEBUG | `layer`, `rule`, `reason` | the shaper refused a request (`limited`, `no_key`, `store_error`) |
//! | `tollgate.client.breaker.opened` | event | WARN | `client`, `open_for` | an outbound `CircuitBreakerLayer` opened (feature `client`) |
//! | `tollgate.client.breaker.half_open` | event | DEBUG | `client` | it lets a trial call through |
//! | `tollgate.client.breaker.closed` | event | INFO | `client` | it closed: the backend answers again |
//!
//! **Keys are personal data** (an address, a user, an API key). No span or event above DEBUG
//! carries a key, and the DEBUG decision span carries one only if the layer asks for it with
//! [`RateLimitLayerBuilder::trace_keys`](crate::http::RateLimitLayerBuilder::trace_keys):
//! [`KeyTrace::Hashed`] (a short hash that tells keys apart and is the same in every process)
//! or [`KeyTrace::Plain`]. Text that tollgate does not write is kept at DEBUG too: a tier
//! resolver's error (`tollgate.tier_fallback.error`) may name the key it was asked about. A
//! resolver that panics is caught, but the process's panic hook still prints its message
//! first (the standard hook to stderr; some hooks log it at ERROR): a resolver should not put
//! the key in a panic message.
//!
//! The decision span is made only while some subscriber wants DEBUG (`tracing`'s global
//! maximum level, one relaxed load), and then with `debug_span!`, whose callsite's cached
//! interest tells whether DEBUG is on for `tollgate` itself; otherwise there is no span, and
//! recording does nothing. With a `fmt` subscriber, its fields show on the events inside it, or on its close with
//! `FmtSpan::CLOSE`.
//!
//! ```
//! use tollgate::{MemoryStore, Policy, RateLimitLayer, Rate};
//! use tollgate::key::PeerIp;
//! use tollgate::limiter::Rule;
//! use tollgate::telemetry::KeyTrace;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = RateLimitLayer::builder(MemoryStore::new())
//!     .rule(Rule::new("per-ip").key(PeerIp::new()).policy(Policy::gcra(Rate::per_second(10), 20)?))
//!     .trace_keys(KeyTrace::Hashed) // the decision span tells clients apart, by hash
//!     .build()?;
//! assert_eq!(layer.key_trace(), KeyTrace::Hashed);
//! assert_eq!(KeyTrace::Hashed.show("203.0.113.9@per-ip").len(), 12);
//! # Ok(())
//! # }
//! ```

use std::fmt::Write as _;

/// How the DEBUG decision span shows the key a request was counted against (see the
/// [module docs](self)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyTrace {
    /// Not at all (the default).
    #[default]
    None,
    /// A short hash of the key: 12 hex digits of its SHA-256, the same in every process and
    /// build, so the requests of one client can be followed across instances without the key.
    /// It hides the key, but a key from a small space (an IPv4 address) can be found again by
    /// hashing every candidate: treat it as a pseudonym, not as anonymous.
    Hashed,
    /// The key itself, as the store sees it (`key@rule`). Only ever in the DEBUG span.
    Plain,
}

impl KeyTrace {
    /// What the decision span shows for `key` (empty for [`KeyTrace::None`]).
    pub fn show(self, key: &str) -> String {
        match self {
            KeyTrace::None => String::new(),
            KeyTrace::Plain => key.to_owned(),
            KeyTrace::Hashed => {
                use sha2::{Digest, Sha256};
                let digest = Sha256::digest(key.as_bytes());
                let mut out = String::with_capacity(12);
                for b in &digest[..6] {
                    let _ = write!(out, "{b:02x}");
                }
                out
            }
        }
    }
}

/// Whether the crate records metrics (feature `metrics`): code that only computes what a
/// metric records is skipped when it is off.
pub(crate) const METRICS: bool = cfg!(feature = "metrics");

/// The labels of a metric, as `(name, value)` pairs.
pub(crate) type Labels<'a> = &'a [(&'static str, &'a str)];

#[cfg(feature = "metrics")]
fn labels(labels: Labels<'_>) -> Vec<::metrics::Label> {
    labels
        .iter()
        .map(|(k, v)| ::metrics::Label::new(*k, (*v).to_owned()))
        .collect()
}

/// A counter registered once, when its layer or store is built; without the `metrics` feature
/// it is nothing, and counting does nothing.
#[derive(Clone, Debug)]
pub(crate) struct Counter {
    #[cfg(feature = "metrics")]
    inner: ::metrics::Counter,
}

impl Counter {
    /// Registers the counter `name` with `labels` in the recorder installed now.
    pub(crate) fn new(name: &'static str, labels: Labels<'_>) -> Self {
        #[cfg(feature = "metrics")]
        {
            Self {
                inner: ::metrics::counter!(name, self::labels(labels)),
            }
        }
        #[cfg(not(feature = "metrics"))]
        {
            let _ = (name, labels);
            Self {}
        }
    }

    /// A counter that counts nothing.
    pub(crate) fn noop() -> Self {
        Self {
            #[cfg(feature = "metrics")]
            inner: ::metrics::Counter::noop(),
        }
    }

    #[inline(always)]
    pub(crate) fn increment(&self, by: u64) {
        #[cfg(feature = "metrics")]
        self.inner.increment(by);
        #[cfg(not(feature = "metrics"))]
        let _ = by;
    }
}

/// A gauge registered once (see [`Counter`]).
#[derive(Clone, Debug)]
pub(crate) struct Gauge {
    #[cfg(feature = "metrics")]
    inner: ::metrics::Gauge,
}

impl Gauge {
    /// Registers the gauge `name` with `labels` in the recorder installed now.
    pub(crate) fn new(name: &'static str, labels: Labels<'_>) -> Self {
        #[cfg(feature = "metrics")]
        {
            Self {
                inner: ::metrics::gauge!(name, self::labels(labels)),
            }
        }
        #[cfg(not(feature = "metrics"))]
        {
            let _ = (name, labels);
            Self {}
        }
    }

    #[inline(always)]
    pub(crate) fn set(&self, value: f64) {
        #[cfg(feature = "metrics")]
        self.inner.set(value);
        #[cfg(not(feature = "metrics"))]
        let _ = value;
    }

    #[inline(always)]
    pub(crate) fn increment(&self) {
        #[cfg(feature = "metrics")]
        self.inner.increment(1.0);
    }

    #[inline(always)]
    pub(crate) fn decrement(&self) {
        #[cfg(feature = "metrics")]
        self.inner.decrement(1.0);
    }
}

/// A histogram registered once (see [`Counter`]).
#[derive(Clone, Debug)]
pub(crate) struct Histogram {
    #[cfg(feature = "metrics")]
    inner: ::metrics::Histogram,
}

impl Histogram {
    /// Registers the histogram `name` with `labels` in the recorder installed now.
    pub(crate) fn new(name: &'static str, labels: Labels<'_>) -> Self {
        #[cfg(feature = "metrics")]
        {
            Self {
                inner: ::metrics::histogram!(name, self::labels(labels)),
            }
        }
        #[cfg(not(feature = "metrics"))]
        {
            let _ = (name, labels);
            Self {}
        }
    }

    /// Records a duration of `nanos` nanoseconds, in seconds.
    #[inline(always)]
    pub(crate) fn record_nanos(&self, nanos: u64) {
        #[cfg(feature = "metrics")]
        self.inner.record(nanos as f64 / 1e9);
        #[cfg(not(feature = "metrics"))]
        let _ = nanos;
    }
}

/// A tracing event at `$level` (`debug`, `info`, `warn`), only with the `tracing` feature: the
/// arguments are those of `tracing`'s macros. An expression of type `()`.
macro_rules! event {
    ($level:ident, $($arg:tt)*) => {{
        #[cfg(feature = "tracing")]
        {
            ::tracing::$level!($($arg)*);
        }
    }};
}
pub(crate) use event;

/// At most one WARN a second of one kind, the others at DEBUG: a store that dies fails every
/// call in flight at once, a resolver that is down fails every request, and an outage must not
/// flood the log.
#[derive(Debug, Default)]
pub(crate) struct WarnEvery {
    /// When the last WARN was logged, in the caller's clock's nanoseconds plus one (zero:
    /// never).
    last: std::sync::atomic::AtomicU64,
}

impl WarnEvery {
    /// The least time between two WARNs, in nanoseconds.
    const EVERY: u64 = 1_000_000_000;

    /// Whether the event of `now` (the caller's clock) may be a WARN: the first in a second.
    pub(crate) fn now(&self, now: u64) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let now = now.saturating_add(1);
        let last = self.last.load(Relaxed);
        (last == 0 || now.saturating_sub(last) >= Self::EVERY)
            && self
                .last
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
    }
}

/// The span of one rate-limit decision, `tollgate.decision` at DEBUG (nothing without the
/// `tracing` feature).
///
/// No span is made at all unless a subscriber may want DEBUG from this crate: while the
/// highest level any subscriber asks for is above DEBUG (or none is installed), a request
/// pays one relaxed load of `tracing`'s global maximum level, and everything else here is a
/// check of `None`. In particular `tracing`'s `log` fallback (on in every axum build with its
/// default `tower-log` feature) never runs per request.
#[derive(Debug)]
pub(crate) struct DecisionSpan {
    #[cfg(feature = "tracing")]
    span: Option<::tracing::Span>,
}

/// Whether a subscriber may want DEBUG spans now (the level this crate's spans are at).
#[cfg(feature = "tracing")]
#[inline(always)]
fn debug_wanted() -> bool {
    use ::tracing::level_filters::{LevelFilter, STATIC_MAX_LEVEL};
    STATIC_MAX_LEVEL >= LevelFilter::DEBUG && LevelFilter::current() >= LevelFilter::DEBUG
}

impl DecisionSpan {
    /// A new span: none while no subscriber wants DEBUG for this crate.
    #[inline(always)]
    pub(crate) fn new() -> Self {
        Self {
            #[cfg(feature = "tracing")]
            span: if debug_wanted() { Self::make() } else { None },
        }
    }

    /// The span itself, if its callsite is enabled.
    #[cfg(feature = "tracing")]
    #[cold]
    #[inline(never)]
    fn make() -> Option<::tracing::Span> {
        let span = ::tracing::debug_span!(
            "tollgate.decision",
            rule = ::tracing::field::Empty,
            policy = ::tracing::field::Empty,
            outcome = ::tracing::field::Empty,
            remaining = ::tracing::field::Empty,
            key = ::tracing::field::Empty,
        );
        (!span.is_disabled()).then_some(span)
    }

    /// Whether anything listens to this span.
    #[inline(always)]
    pub(crate) fn enabled(&self) -> bool {
        #[cfg(feature = "tracing")]
        {
            self.span.is_some()
        }
        #[cfg(not(feature = "tracing"))]
        {
            false
        }
    }

    /// Runs `f` inside the span.
    #[inline(always)]
    pub(crate) fn in_scope<T>(&self, f: impl FnOnce() -> T) -> T {
        #[cfg(feature = "tracing")]
        {
            match &self.span {
                Some(span) => span.in_scope(f),
                None => f(),
            }
        }
        #[cfg(not(feature = "tracing"))]
        {
            f()
        }
    }

    /// Records the keys of the rules that apply, as `trace` shows them (joined by `, `).
    pub(crate) fn record_keys<'a>(&self, trace: KeyTrace, keys: impl Iterator<Item = &'a str>) {
        if trace == KeyTrace::None || !self.enabled() {
            return;
        }
        let mut shown = String::new();
        for key in keys {
            if !shown.is_empty() {
                shown.push_str(", ");
            }
            shown.push_str(&trace.show(key));
        }
        #[cfg(feature = "tracing")]
        if let Some(span) = &self.span {
            span.record("key", shown.as_str());
        }
    }

    /// Records what was decided, by which rule and policy, and what is left.
    #[inline]
    pub(crate) fn record(
        &self,
        outcome: &'static str,
        rule: Option<&str>,
        policy: Option<&str>,
        remaining: Option<u64>,
    ) {
        if !self.enabled() {
            return;
        }
        #[cfg(feature = "tracing")]
        if let Some(span) = &self.span {
            span.record("outcome", outcome);
            if let Some(rule) = rule {
                span.record("rule", rule);
            }
            if let Some(policy) = policy {
                span.record("policy", policy);
            }
            if let Some(remaining) = remaining {
                span.record("remaining", remaining);
            }
        }
        #[cfg(not(feature = "tracing"))]
        let _ = (outcome, rule, policy, remaining);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashed_keys_are_short_stable_and_distinct() {
        let a = KeyTrace::Hashed.show("203.0.113.9@per-ip");
        assert_eq!(a.len(), 12);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(a, KeyTrace::Hashed.show("203.0.113.9@per-ip"));
        assert_ne!(a, KeyTrace::Hashed.show("203.0.113.8@per-ip"));
        // SHA-256: the same in every process and build.
        assert_eq!(KeyTrace::Hashed.show("abc"), "ba7816bf8f01");
        assert_eq!(KeyTrace::Plain.show("k@r"), "k@r");
        assert_eq!(KeyTrace::None.show("k@r"), "");
    }
}
