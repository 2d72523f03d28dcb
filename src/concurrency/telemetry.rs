//! The concurrency limit's metrics, and how a refusal is counted and logged.

use super::admission::Refusal;
use super::shared::KeyedRule;
use crate::telemetry::{Counter, Gauge, Histogram};

/// The layer's metrics, registered when it is built.
pub(super) struct Telemetry {
    pub(super) in_flight: Gauge,
    pub(super) queue: Histogram,
    /// Per rule: its keys busy, and requests without a key refused.
    rules: Box<[[Counter; 2]]>,
    full: Counter,
    #[cfg(feature = "redis")]
    store_down: Counter,
}

impl Telemetry {
    pub(super) fn new(layer: &str, rules: &[KeyedRule], total: bool, store_down: bool) -> Self {
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
    pub(super) fn refused(&self, layer: &str, rules: &[KeyedRule], refusal: &Refusal) {
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
