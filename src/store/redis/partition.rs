//! Which Cluster master decides a check: [`ResilientStore`](crate::store::ResilientStore)
//! keeps a circuit breaker per master ([`Store::partition`](crate::Store::partition)), so that
//! one master down fails only the keys it holds.
//!
//! The master of a key's hash slot comes from the client's own map of the Cluster (the one it
//! routes commands by), read again at most once a second: after a failover or a resharding,
//! the keys of the slots that moved follow their new master within a second. A master is named
//! by a hash of its address, so each keeps its breaker across re-reads of the map.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use fred::interfaces::ClusterInterface;
use fred::types::cluster::ClusterRouting;

use super::RedisStore;
use crate::store::Check;

/// How long a copy of the client's map of the Cluster is used before it is read again (ns).
const ROUTING_MAX_AGE: u64 = 1_000_000_000;

/// The last copy of the client's map of the Cluster, and when it was taken (local clock, ns).
#[derive(Default)]
pub(super) struct Routing {
    copy: ArcSwapOption<(u64, ClusterRouting)>,
}

impl std::fmt::Debug for Routing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routing").finish_non_exhaustive()
    }
}

impl RedisStore {
    /// The master that decides `check` (a hash of its address), or `None` outside a Cluster,
    /// for a key the store refuses anyway, or before the client knows the Cluster's slots.
    pub(super) fn master_of(&self, check: &Check<'_>) -> Option<u32> {
        let inner = &self.inner;
        if !inner.clustered || check.key().len() > inner.max_key_len {
            return None;
        }
        let name = inner
            .names
            .placed_name(check.key(), check.placement(), check.policy());
        let slot = fred::util::redis_keyslot(name.as_bytes());
        let now = inner.local.now();
        let copy = match inner.routing.copy.load_full() {
            Some(copy) if now.saturating_sub(copy.0) < ROUTING_MAX_AGE => copy,
            _ => {
                let fresh = Arc::new((now, inner.pool.next().cached_cluster_state()?));
                inner.routing.copy.store(Some(Arc::clone(&fresh)));
                fresh
            }
        };
        let server = copy.1.get_server(slot)?;
        let mut hasher = DefaultHasher::new();
        server.host.hash(&mut hasher);
        server.port.hash(&mut hasher);
        // The low half of a 64-bit hash: a clash of two masters' halves among a handful of
        // masters is about as likely as 1 in 10^8.
        Some(hasher.finish() as u32)
    }
}
