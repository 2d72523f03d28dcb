//! The state every clone of the layer shares: its rules, total cap, queue and latencies.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::fair::Fair;
use super::layer::ConcurrencyError;
#[cfg(feature = "redis")]
use super::leases::Leases;
use super::table::InFlight;
use super::telemetry::Telemetry;
use crate::answer::Responder;
use crate::clock::Clock;
use crate::limiter::{Matcher, TierLookup, Tiers, valid_name};
use crate::sync::{AtomicU32, AtomicU64, AtomicUsize, Mutex};

/// What every clone of the layer and its services shares.
pub(crate) struct Shared {
    /// The layer's name in metrics and logs.
    pub(super) name: Arc<str>,
    pub(super) telemetry: Telemetry,
    pub(super) rules: Box<[KeyedRule]>,
    pub(crate) in_flight: InFlight,
    pub(super) total: Option<Total>,
    pub(super) queue: Option<Queue>,
    /// How long requests stayed in flight, over all rules.
    pub(super) latency: Latency,
    #[cfg(feature = "redis")]
    pub(super) leases: Option<Arc<Leases>>,
    pub(super) responder: Box<dyn Responder>,
    pub(super) clock: Arc<dyn Clock>,
}

/// A rule: which requests, which key, how many in flight per key.
pub(super) struct KeyedRule {
    pub(super) matcher: Matcher,
    /// The limit per key (with tiers, the largest of theirs).
    pub(super) max: u32,
    pub(super) tiers: Option<TieredLimits>,
    /// How long this rule's requests stayed in flight.
    pub(super) latency: Latency,
}

/// A rule's limit as the builder got it.
#[derive(Debug)]
pub(super) enum RuleLimit {
    One(u32),
    Tiered(Tiers, Vec<(String, u32)>),
}

/// The limits of a tiered rule: the lookup of a key's tier, and each tier's limit.
pub(super) struct TieredLimits {
    pub(super) lookup: TierLookup,
    pub(super) limits: Box<[u32]>,
}

/// Checks the tiers of rule `rule` and makes their lookup.
pub(super) fn tiered_limits(
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
    pub(super) fn limit(&self, tier: u16) -> u32 {
        self.limits.get(usize::from(tier)).copied().unwrap_or(0)
    }
}

pub(super) struct Total {
    pub(super) max: u32,
    pub(super) count: AtomicU32,
}

/// Requests waiting for a place: at most `max`, each at most `max_wait`, served fairly
/// ([`fair`](super::fair)).
pub(super) struct Queue {
    pub(super) max: usize,
    pub(super) max_wait: Duration,
    /// The requests waiting (read without the lock: a place given back, or a newcomer, sees
    /// whether anyone waits).
    pub(super) waiting: AtomicUsize,
    pub(super) fair: Mutex<Fair>,
}

/// A moving average of the time requests stay in flight, in nanoseconds (each new sample
/// weighs one eighth); 0 before the first.
#[derive(Default)]
pub(super) struct Latency(AtomicU64);

impl Latency {
    pub(super) fn record(&self, nanos: u64) {
        // A load and a store, not a compare-and-swap: two requests ending at once may lose one
        // of their samples, which an average of the last few dozen does not miss, and the
        // request path takes no locked instruction for it.
        let avg = self.0.load(Ordering::Relaxed);
        let next = if avg == 0 {
            nanos.max(1)
        } else {
            avg - avg / 8 + nanos / 8
        };
        self.0.store(next, Ordering::Relaxed);
    }

    /// The average, as a `Retry-After`: at least 1 s, at most [`MAX_RETRY_AFTER`] (a rule over
    /// long downloads or streams would otherwise send clients away for hours).
    pub(super) fn retry_after(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
            .clamp(Duration::from_secs(1), MAX_RETRY_AFTER)
    }
}

/// The longest `Retry-After` a concurrency refusal sends.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
