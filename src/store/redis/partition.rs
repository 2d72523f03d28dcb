//! Which Cluster master decides a check: [`ResilientStore`](crate::store::ResilientStore)
//! keeps a circuit breaker per master ([`Store::partition`](crate::Store::partition)), so that
//! one master down fails only the keys it holds. The master is the one the store's own map of
//! the Cluster routes the key's slot to (see cluster.rs), named by a hash of its address.

use super::RedisStore;
use super::scripts::Backend;
use crate::store::Check;

impl RedisStore {
    /// The master that decides `check`, or `None` outside a Cluster, for a key the store
    /// refuses anyway, or before the store knows the Cluster's map.
    pub(super) fn master_of(&self, check: &Check<'_>) -> Option<u32> {
        let inner = &self.inner;
        let Backend::Cluster(masters) = &inner.backend else {
            return None;
        };
        if check.key().len() > inner.max_key_len {
            return None;
        }
        let name = inner
            .names
            .placed_name(check.key(), check.placement(), check.policy());
        masters.master_of(fred::util::redis_keyslot(name.as_bytes()))
    }
}
