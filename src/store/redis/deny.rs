//! The local deny cache: a key known to be rejected until T is answered here until T.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::Decision;
use crate::telemetry::Counter;

const SHARDS: usize = 16;

#[derive(Clone, Copy)]
struct Entry {
    /// Local time (ns) until which a request of at least `cost` is rejected.
    until: u64,
    /// Local time (ns) after which Redis is asked again (at most `until`).
    expires: u64,
    /// When the decision was received (local ns), to age its `reset_after`.
    at: u64,
    cost: u64,
    decision: Decision,
}

/// Bounded: at most `capacity` entries; when full, expired entries are dropped and, if none
/// were, the new entry is not kept (a cache miss only costs a round trip). An entry answers for
/// at most `max_age`, so that a rejection caused by a passing state (a cross-slot consumption
/// about to be refunded) does not stick.
pub(crate) struct DenyCache {
    shards: Box<[Mutex<HashMap<u64, Entry>>]>,
    per_shard: usize,
    max_age: u64,
    /// `tollgate_deny_cache_hits_total`.
    hits: Counter,
}

impl DenyCache {
    pub(crate) fn new(capacity: usize, max_age: u64) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            max_age,
            hits: Counter::new(crate::metrics::DENY_CACHE_HITS_TOTAL, &[]),
        }
    }

    fn shard(&self, hash: u64) -> &Mutex<HashMap<u64, Entry>> {
        &self.shards[(hash >> 40) as usize % SHARDS]
    }

    /// The rejection to answer locally for a request of `cost` on the key with `hash`, if the
    /// key is known to reject it at `now` (marked [`Decision::without_backend`]).
    pub(crate) fn get(&self, hash: u64, cost: u64, now: u64) -> Option<Decision> {
        let mut shard = self.shard(hash).lock();
        let e = *shard.get(&hash)?;
        if now >= e.expires {
            shard.remove(&hash);
            return None;
        }
        if cost < e.cost {
            return None;
        }
        let d = e.decision;
        drop(shard);
        self.hits.increment(1);
        let waited = now.saturating_sub(e.at);
        Some(
            Decision::from_nanos(
                false,
                d.limit(),
                d.remaining(),
                (d.reset_after().as_nanos() as u64).saturating_sub(waited),
                e.until - now,
            )
            .without_backend(),
        )
    }

    /// Remembers a rejection of `cost` received for a call sent at `sent` (local ns): nothing
    /// of that cost can be admitted before `sent + retry_after`.
    pub(crate) fn insert(&self, hash: u64, cost: u64, sent: u64, now: u64, decision: Decision) {
        let Some(retry) = decision.retry_after() else {
            return;
        };
        let until = sent.saturating_add(u64::try_from(retry.as_nanos()).unwrap_or(u64::MAX));
        let expires = until.min(sent.saturating_add(self.max_age));
        if expires <= now {
            return;
        }
        let mut shard = self.shard(hash).lock();
        if shard.len() >= self.per_shard && !shard.contains_key(&hash) {
            shard.retain(|_, e| e.expires > now);
            if shard.len() >= self.per_shard {
                return;
            }
        }
        shard.insert(
            hash,
            Entry {
                until,
                expires,
                at: now,
                cost,
                decision,
            },
        );
    }

    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn answers_until_the_retry_time_and_stays_bounded() {
        let c = DenyCache::new(16, u64::MAX);
        let d = Decision::rejected(5, 0, Duration::from_secs(2), Duration::from_secs(1));
        c.insert(7, 1, 100, 150, d);
        let local = c.get(7, 1, 1_000_000_100 - 1).unwrap();
        // Not a sign of Redis' health: a breaker must not close on it.
        assert!(!local.reached_backend());
        assert_eq!(local.retry_after(), Some(Duration::from_nanos(1)));
        assert!(c.get(7, 1, 1_000_000_100).is_none());
        // Capped: after max_age, Redis is asked again, and the wait stays the true one.
        let c = DenyCache::new(16, 1000);
        c.insert(7, 1, 0, 0, d);
        assert_eq!(
            c.get(7, 1, 999).unwrap().retry_after(),
            Some(Duration::from_nanos(999_999_001))
        );
        assert!(c.get(7, 1, 1000).is_none());
        let c = DenyCache::new(16, u64::MAX);
        // A cheaper request than the one rejected still goes to Redis.
        c.insert(8, 3, 0, 0, d);
        assert!(c.get(8, 2, 10).is_none());
        assert!(c.get(8, 3, 10).is_some());
        for h in 0..10_000u64 {
            c.insert(h << 40, 1, 0, 0, d);
        }
        assert!(c.len() <= 16 + SHARDS);
    }
}
