//! The service's metrics (feature `metrics`): what each descriptor's hits came to, what each
//! call answered, the store's failures and the reloads. Handles are registered once per label
//! set and kept where the labels come from: a configured limit keeps its own, a domain its
//! own, the service the rest; only `detailed_metric` and limit overrides look theirs up, in a
//! map of bounded size.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::metrics as m;
use crate::telemetry::Counter;

/// The label a descriptor counts under once the service's map of labels that requests made
/// (`detailed_metric`, overrides) is full.
pub(super) const OTHER: &str = "_other";

/// What became of one descriptor's hits (its cost) in one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Admitted, with more than a fifth of the limit left.
    Within,
    /// Admitted, leaving a fifth of the limit or less.
    Near,
    /// This descriptor's limit refused the call.
    Over,
    /// A shadow limit would have refused the call; it answered OK.
    Shadow,
    /// Another descriptor's limit refused the call: nothing was counted here.
    NotCounted,
}

impl Outcome {
    /// Within or near, from what is left after the call out of `limit`: near when more than
    /// 80 % of the limit is used (envoyproxy/ratelimit's default near-limit ratio).
    pub(super) fn admitted(remaining: u64, limit: u64) -> Outcome {
        if remaining.saturating_mul(5) < limit {
            Outcome::Near
        } else {
            Outcome::Within
        }
    }
}

/// The hits of one (domain, descriptor) label pair, by outcome.
#[derive(Clone, Debug)]
pub(crate) struct Hits {
    within: Counter,
    near: Counter,
    over: Counter,
    shadow: Counter,
    not_counted: Counter,
}

impl Hits {
    pub(super) fn new(domain: &str, descriptor: &str) -> Hits {
        let c = |outcome| {
            Counter::new(
                m::ENVOY_HITS_TOTAL,
                &[
                    ("domain", domain),
                    ("descriptor", descriptor),
                    ("outcome", outcome),
                ],
            )
        };
        Hits {
            within: c("within_limit"),
            near: c("near_limit"),
            over: c("over_limit"),
            shadow: c("shadow_mode"),
            not_counted: c("not_counted"),
        }
    }

    /// Counts `hits` (at most `u32::MAX` a call: a client's cost of `u64::MAX` would wrap the
    /// counter, which Prometheus would read as a reset).
    pub(super) fn record(&self, outcome: Outcome, hits: u64) {
        let hits = hits.min(u64::from(u32::MAX));
        match outcome {
            Outcome::Within => &self.within,
            Outcome::Near => &self.near,
            Outcome::Over => &self.over,
            Outcome::Shadow => &self.shadow,
            Outcome::NotCounted => &self.not_counted,
        }
        .increment(hits);
    }
}

/// The calls of one domain (the empty domain: calls refused before one was known), by
/// result, and its store's failures by pass.
#[derive(Clone, Debug)]
pub(crate) struct Calls {
    pub(super) ok: Counter,
    pub(super) over_limit: Counter,
    pub(super) store_error: Counter,
    pub(super) invalid: Counter,
    pub(super) unknown_domain: Counter,
    pub(super) store_failed_enforced: Counter,
    pub(super) store_failed_shadow: Counter,
}

impl Calls {
    pub(super) fn new(domain: &str) -> Calls {
        let call = |result| {
            Counter::new(
                m::ENVOY_CALLS_TOTAL,
                &[("domain", domain), ("result", result)],
            )
        };
        let failed = |pass| {
            Counter::new(
                m::ENVOY_STORE_ERRORS_TOTAL,
                &[("domain", domain), ("pass", pass)],
            )
        };
        Calls {
            ok: call("ok"),
            over_limit: call("over_limit"),
            store_error: call("store_error"),
            invalid: call("invalid"),
            unknown_domain: call("unknown_domain"),
            store_failed_enforced: failed("enforced"),
            store_failed_shadow: failed("shadow"),
        }
    }
}

/// What the service keeps: the calls without a domain, the reloads, and the hits of the
/// labels that requests made, at most `max` of them.
#[derive(Debug)]
pub(super) struct ServiceMetrics {
    pub(super) no_domain: Calls,
    pub(super) reloaded: Counter,
    pub(super) reload_refused: Counter,
    made: Mutex<Made>,
}

impl ServiceMetrics {
    pub(super) fn new() -> ServiceMetrics {
        let reloads = |result| Counter::new(m::ENVOY_CONFIG_RELOADS_TOTAL, &[("result", result)]);
        ServiceMetrics {
            no_domain: Calls::new(""),
            reloaded: reloads("success"),
            reload_refused: reloads("error"),
            made: Mutex::default(),
        }
    }

    /// The hits of `descriptor` in `domain`, a label a request made: registered on first use
    /// while fewer than `max` such labels exist; `None` for a new label past that.
    pub(super) fn made(&self, domain: &str, descriptor: &str, max: usize) -> Option<Arc<Hits>> {
        let mut key = String::with_capacity(domain.len() + descriptor.len() + 1);
        key.push_str(domain);
        key.push('\0');
        key.push_str(descriptor);
        let mut made = self.made.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(hits) = made.labels.get(&key) {
            return Some(Arc::clone(hits));
        }
        if made.labels.len() >= max {
            return None;
        }
        let hits = Arc::new(Hits::new(domain, descriptor));
        made.labels.insert(key, Arc::clone(&hits));
        Some(hits)
    }

    /// The hits of [`OTHER`] in `domain` (one per domain, and domains are configured).
    pub(super) fn other(&self, domain: &str) -> Arc<Hits> {
        let mut made = self.made.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(hits) = made.other.get(domain) {
            return Arc::clone(hits);
        }
        let hits = Arc::new(Hits::new(domain, OTHER));
        made.other.insert(domain.to_owned(), Arc::clone(&hits));
        hits
    }

    /// How many labels requests made (the overflow labels not counted).
    #[cfg(test)]
    pub(super) fn made_count(&self) -> usize {
        let made = self.made.lock().unwrap_or_else(PoisonError::into_inner);
        made.labels.len()
    }
}

/// The labels requests made, and each domain's overflow label.
#[derive(Debug, Default)]
struct Made {
    labels: HashMap<String, Arc<Hits>>,
    other: HashMap<String, Arc<Hits>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_means_more_than_four_fifths_used_as_envoyproxy_counts_it() {
        // envoyproxy/ratelimit: near when used > floor(0.8 * limit).
        for limit in 1..=200u64 {
            let threshold = limit * 8 / 10;
            for used in 0..=limit {
                let near = used > threshold;
                assert_eq!(
                    Outcome::admitted(limit - used, limit) == Outcome::Near,
                    near,
                    "limit {limit}, used {used}"
                );
            }
        }
    }

    #[test]
    fn labels_made_by_requests_are_bounded() {
        let metrics = ServiceMetrics::new();
        let made: Vec<bool> = (0..10)
            .map(|i| metrics.made("edge", &format!("user_{i}"), 3).is_some())
            .collect();
        assert_eq!(made.iter().filter(|m| **m).count(), 3);
        assert_eq!(metrics.made_count(), 3);
        // Those known still count under their own label.
        assert!(metrics.made("edge", "user_1", 3).is_some());
        assert!(metrics.made("other", "user_1", 3).is_none());
        assert_eq!(metrics.made_count(), 3);
        metrics.other("edge");
        metrics.other("edge");
        assert_eq!(metrics.made.lock().unwrap().other.len(), 1);
    }
}
