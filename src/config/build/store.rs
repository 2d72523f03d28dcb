//! The `[store]` section: its problems that need no connection, the failure policy and Cluster
//! nodes.

use super::Builder;
use super::label_ok;
use crate::config::Problems;
use crate::config::schema::*;

impl<'a> Builder<'a> {
    /// The store section's problems that need no connection.
    pub(crate) fn store(&mut self) {
        let s = &self.config.store;
        let p = &mut self.problems;
        let memory = s.kind == StoreKind::Memory;
        let only = |p: &mut Problems, field: &str, set: bool, kind: &str| {
            if set {
                p.add(
                    format!("store.{field}"),
                    format!("only for kind = \"{kind}\""),
                );
            }
        };
        only(p, "max_keys", s.max_keys.is_some() && !memory, "memory");
        only(p, "shards", s.shards.is_some() && !memory, "memory");
        for (field, set) in [
            ("url", s.url.is_some()),
            ("cluster", !s.cluster.is_empty()),
            ("prefix", s.prefix.is_some()),
            ("pool_size", s.pool_size.is_some()),
            ("timeout", s.timeout.is_some()),
            ("deny_cache", s.deny_cache.is_some()),
            ("max_cross_slot_calls", s.max_cross_slot_calls.is_some()),
            ("on_failure", s.on_failure.is_some()),
            ("instances", s.instances.is_some()),
            ("breaker", s.breaker.is_some()),
        ] {
            only(p, field, set && memory, "redis");
        }
        if let Some(name) = &s.name {
            label_ok(name, "store.name", p);
        }
        if s.max_keys == Some(0) {
            p.add("store.max_keys", "must be at least 1");
        }
        if let Some(shards) = s.shards {
            if shards == 0 || !shards.is_power_of_two() || shards > 1 << 16 {
                p.add(
                    "store.shards",
                    format!("{shards}: give a power of two up to 65536"),
                );
            }
        }
        if s.max_key_len == Some(0) {
            p.add("store.max_key_len", "must be at least 1");
        }
        if !memory {
            #[cfg(not(feature = "redis"))]
            p.add(
                "store.kind",
                "the Redis store needs tollgate's feature `redis`",
            );
            match (&s.url, s.cluster.is_empty()) {
                (None, true) => p.add("store.url", "missing: the Redis URL (or cluster)"),
                (Some(_), false) => p.add("store.cluster", "give url or cluster, not both"),
                _ => {}
            }
            for (i, node) in s.cluster.iter().enumerate() {
                if node_of(node).is_none() {
                    p.add(
                        format!("store.cluster[{i}]"),
                        format!("{node:?}: give host:port"),
                    );
                }
            }
            if let Some(t) = s.timeout {
                if t.get().is_zero() {
                    p.add("store.timeout", "must be above zero");
                }
            }
            if let Some(n) = s.pool_size.filter(|n| !(1..=256).contains(n)) {
                p.add("store.pool_size", format!("{n}: give 1 to 256"));
            }
            if s.max_cross_slot_calls == Some(0) {
                p.add("store.max_cross_slot_calls", "must be at least 1");
            }
            if s.instances == Some(0) {
                p.add("store.instances", "must be at least 1");
            }
            if s.instances.is_some() && s.on_failure != Some(FailureConfig::Local) {
                p.add("store.instances", "only with on_failure = \"local\"");
            }
            if let Some(b) = &s.breaker {
                if b.failures == 0 {
                    p.add("store.breaker.failures", "must be at least 1");
                }
                if b.open_for.get().is_zero() {
                    p.add("store.breaker.open_for", "must be above zero");
                }
            }
        }
    }
}

/// The store's failure policy.
#[cfg(feature = "redis")]
pub(crate) fn failure_policy(policy: FailureConfig) -> crate::store::FailurePolicy {
    use crate::store::FailurePolicy;
    match policy {
        FailureConfig::Open => FailurePolicy::Open,
        FailureConfig::Closed => FailurePolicy::Closed,
        FailureConfig::Local => FailurePolicy::LocalFallback,
    }
}

/// `host:port`, split.
pub(crate) fn node_of(node: &str) -> Option<(String, u16)> {
    let (host, port) = node.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty())
        .then(|| Some((host.to_owned(), port.parse().ok()?)))
        .flatten()
}
