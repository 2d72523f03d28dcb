//! The `[concurrency]` section: the concurrency layer.

use std::collections::BTreeSet;

use super::Builder;
#[cfg(feature = "redis")]
use super::store::failure_policy;
use super::{label_ok, queue_ok};
use crate::ConcurrencyLimitLayer;
use crate::config::schema::*;

impl<'a> Builder<'a> {
    /// The concurrency layer, if the file has one.
    pub(crate) fn concurrency(&mut self) -> Option<ConcurrencyLimitLayer> {
        let spec = self.config.concurrency.as_ref()?;
        let mut builder = ConcurrencyLimitLayer::builder();
        if let Some(name) = &spec.name {
            label_ok(name, "concurrency.name", &mut self.problems);
            builder = builder.name(name.as_str());
        }
        let mut names = BTreeSet::new();
        for (i, r) in spec.rules.iter().enumerate() {
            let path = format!("concurrency.rules[{i}]");
            if !r.name.is_empty() && !names.insert(r.name.as_str()) {
                self.problems.add(
                    format!("{path}.name"),
                    format!("two rules are named {:?}", r.name),
                );
            }
            if r.max_in_flight == 0 {
                self.problems.add(
                    format!("{path}.max_in_flight"),
                    "must be at least 1 (0 refuses every request)",
                );
            }
            let rule = self.matching(
                &path,
                &r.name,
                &r.methods,
                false,
                [
                    ("path", r.path.as_ref()),
                    ("path_prefix", r.path_prefix.as_ref()),
                    ("route", r.route.as_ref()),
                ],
                r.key.as_ref(),
                r.on_missing_key,
            );
            if let Some(rule) = rule {
                builder = builder.rule(rule, r.max_in_flight);
            }
        }
        if let Some(total) = spec.total {
            if total == 0 {
                self.problems.add(
                    "concurrency.total",
                    "must be at least 1 (0 refuses every request)",
                );
            }
            builder = builder.total(total);
        }
        if spec.rules.is_empty() && spec.total.is_none() {
            self.problems.add(
                "concurrency",
                "give rules or a total (or leave the section out)",
            );
        }
        if let Some(queue) = &spec.queue {
            queue_ok(queue, "concurrency.queue", &mut self.problems);
            builder = builder.queue(queue.max_waiting, queue.max_wait.get());
        }
        #[cfg(feature = "redis")]
        if let (true, Some(lease)) = (spec.distributed, spec.lease_time) {
            let timeout = self
                .config
                .store
                .timeout
                .map_or(crate::store::redis::DEFAULT_TIMEOUT, |t| t.get());
            let (min, max) = (
                crate::concurrency::MIN_LEASE_TIME,
                crate::concurrency::MAX_LEASE_TIME,
            );
            if !(min..=max).contains(&lease.get()) || lease.get() < timeout.saturating_mul(3) {
                self.problems.add(
                    "concurrency.lease_time",
                    format!(
                        "{lease}: give {} to {}, and at least three times store.timeout ({})",
                        super::HumanDuration::from(min),
                        super::HumanDuration::from(max),
                        super::HumanDuration::from(timeout)
                    ),
                );
            }
        }
        #[cfg(feature = "redis")]
        if let (true, Some(redis)) = (spec.distributed, self.redis.clone()) {
            builder = builder.redis(redis);
            if let Some(lease) = spec.lease_time {
                builder = builder.lease_time(lease.get());
            }
            if let Some(policy) = spec.on_store_error {
                builder = builder.on_store_error(failure_policy(policy));
            }
        }
        if !spec.distributed {
            if spec.lease_time.is_some() {
                self.problems
                    .add("concurrency.lease_time", "only with distributed = true");
            }
            if spec.on_store_error.is_some() {
                self.problems
                    .add("concurrency.on_store_error", "only with distributed = true");
            }
        } else if self.config.store.kind != StoreKind::Redis {
            self.problems
                .add("concurrency.distributed", "needs store.kind = \"redis\"");
        }
        if !self.problems.is_empty() {
            return None;
        }
        match builder.build() {
            Ok(layer) => Some(layer),
            Err(e) => {
                self.problems.add("concurrency", e);
                None
            }
        }
    }
}
