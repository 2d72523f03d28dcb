//! Places shared by every instance of a service: each admitted request holds a lease per key
//! on Redis (a sorted set of lease deadlines per key, see `store/redis/lease.lua`), renewed
//! while it runs and given back when its response ends. An instance that crashes stops
//! renewing, so its leases free their places after one lease time.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use fred::bytes_utils::Str;
use fred::clients::Client;
use fred::types::Key as RedisKey;
use parking_lot::Mutex;

use crate::store::FailurePolicy;
use crate::store::redis::{LeaseOp, RedisStore};

/// The default time a lease on Redis lasts without renewal (what a crashed instance can leak).
pub const DEFAULT_LEASE_TIME: Duration = Duration::from_secs(10);
/// The shortest lease time accepted (renewals go every third of it).
pub const MIN_LEASE_TIME: Duration = Duration::from_millis(300);
/// The longest lease time accepted.
pub const MAX_LEASE_TIME: Duration = Duration::from_secs(3600);

/// The leases of one layer, on one Redis.
pub(crate) struct Leases {
    store: RedisStore,
    lease: Duration,
    pub(crate) on_error: FailurePolicy,
    live: Mutex<Live>,
    counters: Counters,
}

/// This instance's live leases, which the renewer renews.
#[derive(Default)]
struct Live {
    leases: HashMap<u64, (RedisKey, Str)>,
    next: u64,
    /// The number of the renewer running (0: none): a renewer that ends clears it only if it
    /// is still its own.
    renewer: u64,
    renewers: u64,
}

#[derive(Default)]
struct Counters {
    granted: AtomicU64,
    refused: AtomicU64,
    renewed: AtomicU64,
    lost: AtomicU64,
    errors: AtomicU64,
    without_redis: AtomicU64,
}

/// A lease a request holds: given back when dropped (see [`Leases::release`]).
pub(crate) struct Lease {
    slot: u64,
    key: RedisKey,
    id: Str,
}

/// What a concurrency limit's leases on Redis have done since the layer was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseStats {
    /// Leases this instance holds now.
    pub live: usize,
    /// Leases taken.
    pub granted: u64,
    /// Requests refused because the key's leases, over every instance, were at the limit.
    pub refused: u64,
    /// Renewals that found their lease live and moved its deadline.
    pub renewed: u64,
    /// Renewals that found their lease gone: its deadline passed first (renewals failed for
    /// a whole lease time, or Redis lost the data). The request goes on uncounted on Redis.
    pub lost: u64,
    /// Calls to Redis that failed (errors and timeouts).
    pub errors: u64,
    /// Requests admitted on the in-process count alone because Redis failed
    /// ([`FailurePolicy::Open`] or [`FailurePolicy::LocalFallback`]).
    pub without_redis: u64,
}

/// Why a lease was not granted.
pub(crate) enum Denied {
    /// The key's leases are at the limit.
    Busy,
    /// Redis failed and the policy is to refuse.
    Unavailable,
}

impl Leases {
    pub(crate) fn new(store: RedisStore, lease: Duration, on_error: FailurePolicy) -> Self {
        Self {
            store,
            lease,
            on_error,
            live: Mutex::new(Live::default()),
            counters: Counters::default(),
        }
    }

    /// Takes a lease of `key` (a store key, placed by its part before the last `@`) if fewer
    /// than `max` are live over every instance. `Ok(None)`: Redis failed and the policy
    /// admits on the in-process count alone.
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        key: &str,
        max: u32,
    ) -> Result<Option<Lease>, Denied> {
        let placed_by = key.rfind('@').unwrap_or(key.len());
        let redis_key = self.store.lease_key(key, placed_by);
        let id = self.store.new_lease_id();
        // Should this future be dropped while the script is on its way, or the answer be lost
        // (a timeout), the lease may be taken all the same: `unsure` gives it back, on the
        // same connection, so after the acquire.
        let connection = self.store.connection(&redis_key);
        let mut unsure = Unsure {
            leases: self,
            connection: &connection,
            lease: Some((redis_key.clone(), id.clone())),
        };
        let answer = self
            .store
            .lease(
                Some(&connection),
                &redis_key,
                &id,
                LeaseOp::Acquire { max },
                self.lease,
            )
            .await;
        match answer {
            Ok((true, _)) => {
                unsure.lease = None;
                self.counters.granted.fetch_add(1, Ordering::Relaxed);
                Ok(Some(self.register(redis_key, id)))
            }
            Ok((false, _)) => {
                unsure.lease = None;
                self.counters.refused.fetch_add(1, Ordering::Relaxed);
                Err(Denied::Busy)
            }
            Err(_) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                match self.on_error {
                    FailurePolicy::Closed => Err(Denied::Unavailable),
                    _ => {
                        self.counters.without_redis.fetch_add(1, Ordering::Relaxed);
                        Ok(None)
                    }
                }
            }
        }
    }

    /// Counts the lease among the live ones, and starts the renewer if it is not running.
    fn register(self: &Arc<Self>, key: RedisKey, id: Str) -> Lease {
        let mut live = self.live.lock();
        let slot = live.next;
        live.next += 1;
        live.leases.insert(slot, (key.clone(), id.clone()));
        if live.renewer == 0 {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                live.renewers += 1;
                live.renewer = live.renewers;
                let stop = RenewerStop {
                    leases: Arc::downgrade(self),
                    number: live.renewer,
                };
                runtime.spawn(renewer(stop, self.lease / 3));
            }
        }
        Lease { slot, key, id }
    }

    /// Gives leases back, off the request's path (or, outside a runtime, lets them expire).
    pub(crate) fn release(&self, leases: impl IntoIterator<Item = Lease>) {
        let mut gone = Vec::new();
        {
            let mut live = self.live.lock();
            for lease in leases {
                live.leases.remove(&lease.slot);
                gone.push((lease.key, lease.id));
            }
        }
        self.spawn_release(None, gone);
    }

    fn spawn_release(&self, connection: Option<Client>, gone: Vec<(RedisKey, Str)>) {
        if gone.is_empty() {
            return;
        }
        let (store, lease) = (self.store.clone(), self.lease);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for (key, id) in gone {
                    let on = connection.as_ref();
                    let _ = store.lease(on, &key, &id, LeaseOp::Release, lease).await;
                }
            });
        }
    }

    /// Renews every live lease of this instance once, and puts back those that were lost
    /// while their requests still run; `false` when there was none.
    pub(crate) async fn renew_all(&self) -> bool {
        let snapshot: Vec<(u64, RedisKey, Str)> = {
            let live = self.live.lock();
            live.leases
                .iter()
                .map(|(slot, (key, id))| (*slot, key.clone(), id.clone()))
                .collect()
        };
        if snapshot.is_empty() {
            return false;
        }
        let renewals = snapshot.iter().map(|(slot, key, id)| async move {
            let renewed = self
                .store
                .lease(None, key, id, LeaseOp::Renew, self.lease)
                .await;
            match renewed {
                Ok((true, _)) => {
                    self.counters.renewed.fetch_add(1, Ordering::Relaxed);
                }
                // Gone while its request still runs: counted again, lest more than the limit
                // run uncounted (at worst a lease for one lease time too many, which refuses
                // too much rather than admitting too much).
                Ok((false, _)) if self.live.lock().leases.contains_key(slot) => {
                    self.counters.lost.fetch_add(1, Ordering::Relaxed);
                    let restored = self
                        .store
                        .lease(None, key, id, LeaseOp::Restore, self.lease)
                        .await;
                    if restored.is_err() {
                        self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                // Gone because its request ended meanwhile.
                Ok(_) => {}
                Err(_) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        futures_util::future::join_all(renewals).await;
        true
    }

    /// Whether renewer `number` should stop: no lease left (then it is no longer running).
    fn renewer_done(&self, number: u64) -> bool {
        let mut live = self.live.lock();
        if live.renewer != number {
            return true;
        }
        if live.leases.is_empty() {
            live.renewer = 0;
            return true;
        }
        false
    }

    pub(crate) fn stats(&self) -> LeaseStats {
        let c = &self.counters;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        LeaseStats {
            live: self.live.lock().leases.len(),
            granted: n(&c.granted),
            refused: n(&c.refused),
            renewed: n(&c.renewed),
            lost: n(&c.lost),
            errors: n(&c.errors),
            without_redis: n(&c.without_redis),
        }
    }
}

/// Renews the live leases every `period` while there are any and the layer exists.
async fn renewer(stop: RenewerStop, period: Duration) {
    loop {
        tokio::time::sleep(period).await;
        let Some(leases) = stop.leases.upgrade() else {
            return;
        };
        leases.renew_all().await;
        if leases.renewer_done(stop.number) {
            return;
        }
    }
}

/// Marks renewer `number` as stopped however it ends (its runtime may shut down), so that the
/// next lease starts another.
struct RenewerStop {
    leases: Weak<Leases>,
    number: u64,
}

impl Drop for RenewerStop {
    fn drop(&mut self) {
        if let Some(leases) = self.leases.upgrade() {
            let mut live = leases.live.lock();
            if live.renewer == self.number {
                live.renewer = 0;
            }
        }
    }
}

/// A lease whose acquire may or may not have taken effect: given back when dropped, unless
/// the answer settled it (`lease` taken out).
struct Unsure<'a> {
    leases: &'a Leases,
    connection: &'a Client,
    lease: Option<(RedisKey, Str)>,
}

impl Drop for Unsure<'_> {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.leases
                .spawn_release(Some(self.connection.clone()), vec![lease]);
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}
