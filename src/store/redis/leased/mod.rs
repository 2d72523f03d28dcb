//! Leased quota for hot keys: [`LeasedStore`] (its docs hold the lease policy and the
//! guarantees).

mod decide;
mod future;
mod give_back;
mod ledger;
mod policy;

pub use future::LeasedFuture;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use hashbrown::HashTable;
use parking_lot::Mutex;
use smallvec::SmallVec;

use self::decide::{Ask, Ended, Plan, Unfinished};
use self::give_back::Back;
use self::ledger::Entry;
use self::policy::{Config, kind, nanos};
use super::{NOTHING_TO_CHECK, RedisStore, TakeFuture};
use crate::Policy;
// Named in the docs of LeasedStore.
#[cfg(doc)]
use crate::Decision;
use crate::clock::Clock;
use crate::store::{Check, Store, StoreError};

/// The default span of demand a lease covers (and over which demand is counted).
pub const DEFAULT_LEASE_SPAN: Duration = Duration::from_millis(10);
/// The default lifetime `L` of a bucket's lease.
pub const DEFAULT_BUCKET_LIFETIME: Duration = Duration::from_millis(5);
/// The default largest lease, in percent of the limit.
pub const DEFAULT_MAX_SHARE_PERCENT: u8 = 10;
/// The default demand, in units per span on one instance, that makes a key hot.
pub const DEFAULT_HOT_THRESHOLD: u64 = 8;
/// The default time without a check after which a key's leases go back.
pub const DEFAULT_IDLE_AFTER: Duration = Duration::from_millis(20);
/// The default number of hot keys tracked per instance.
pub const DEFAULT_MAX_HOT_KEYS: usize = 4096;

/// Keys longer than this never lease (their checks go to Redis as without leases): the hot
/// table keeps each hot key's text, and hot keys are short (a tenant, an API key, `global`).
pub const MAX_LEASED_KEY_LEN: usize = 256;
const SHARDS: usize = 16;
/// Demand counters for keys that are not hot (yet): a count per span, by hash.
const SKETCH_SLOTS: usize = 16_384;
const SKETCH_COUNT_BITS: u32 = 24;
const SKETCH_COUNT_MAX: u64 = (1 << SKETCH_COUNT_BITS) - 1;

#[derive(Default)]
struct Counters {
    leases: AtomicU64,
    units_leased: AtomicU64,
    local_decisions: AtomicU64,
    local_refusals: AtomicU64,
    units_spent: AtomicU64,
    units_returned: AtomicU64,
    units_dropped: AtomicU64,
}

/// Counters of a [`LeasedStore`], since it was built, and what it holds now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseStats {
    /// Leases taken (calls that consumed more than their request's cost).
    pub leases: u64,
    /// Units those leases held beyond their requests' costs.
    pub units_leased: u64,
    /// Checks answered from a lease, without Redis.
    pub local_decisions: u64,
    /// Units those checks spent.
    pub units_spent: u64,
    /// Checks refused without Redis because their key was short (see [`LeasedStore`]).
    pub local_refusals: u64,
    /// Unspent units sent back to Redis.
    pub units_returned: u64,
    /// Unspent units neither spent nor given back (a refund that failed, units put back
    /// after their lease was returned, a lease whose key was no longer tracked when it came).
    pub units_dropped: u64,
    /// Units Redis may hold for lease calls whose leases never reached this instance: a call
    /// that got no answer (a timeout, a connection lost under it) and whose refund, sent
    /// after it on the same connection, got none either; or a lease taken after its caller
    /// stopped waiting, or by a stack that another slot refused, whose give-back failed. At
    /// most this many stay consumed (an under-admission; often none: the call may not have
    /// run, or its refund may have run unanswered). They are outside `units_leased`.
    pub units_in_doubt: u64,
    /// Units held now in live or expired leases, unspent: the most the fleet is
    /// under-admitting because of this instance.
    pub outstanding: u64,
    /// Hot (key, policy) pairs tracked now.
    pub hot_keys: usize,
    /// Of those, the ones with a lease call in flight.
    pub fetching: usize,
}

struct Shared {
    redis: RedisStore,
    /// [`LeaseStats::units_in_doubt`], counted by the lease calls themselves.
    in_doubt: Arc<AtomicU64>,
    clock: Arc<dyn Clock>,
    config: Config,
    hasher: foldhash::fast::RandomState,
    sketch: Box<[AtomicU64]>,
    shards: Box<[Mutex<HashTable<Entry>>]>,
    /// Leases expired or emptied, to give back at the next sweep.
    returns: Mutex<Vec<Back>>,
    /// Held while a sweep or flush gives back: when a flush returns, so has every refund
    /// collected before it.
    sweeping: tokio::sync::Mutex<()>,
    closed: AtomicBool,
    ids: AtomicU64,
    counters: Counters,
    /// How often the background sweep runs (`None`: no sweep), and whether it has started: a
    /// store built outside a runtime starts it when a key first takes a lease in one.
    sweep_every: Option<Duration>,
    sweeper_started: AtomicBool,
}

/// A [`RedisStore`] that takes a share of a hot key's quota out of Redis in one call (a
/// lease) and spends it in process.
///
/// One Redis shard runs about 100 000 scripted checks per second, and a Cluster does not help a
/// single key: every check of a global limit, a big tenant or a shared API key lands on one
/// shard. A `LeasedStore` wraps a [`RedisStore`] and, for a key that is hot *on this
/// instance*, takes a **lease**: one script call that consumes `k` units from the key's real
/// state, exactly as `k` admitted units of cost would be (the same algorithm code, with cost
/// `k`). It then admits requests on that key locally, at in-process speed, until the lease is
/// spent or expires, and gives what it did not spend back through the refund path that
/// cross-slot stacked checks use (`refund.lua`). Keys that are not hot go to Redis as before.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tollgate::{Policy, Rate};
/// use tollgate::store::redis::{LeasedStore, RedisStore};
///
/// let redis = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// let store = LeasedStore::new(redis);
/// let global = Policy::gcra(Rate::per_second(1_000_000), 100_000)?;
/// assert!(store.check("global", &global, 1).await?.allowed());
/// // ... and when the service stops, give back what the leases did not spend:
/// store.shutdown().await?;
/// # Ok(()) }
/// ```
///
/// # When a key is hot, and how much it leases
///
/// Each instance counts the demand (units asked) per key and policy over spans of
/// [`lease_span`](LeasedStoreBuilder::lease_span) (default 10 ms) in a small fixed array of
/// counters, so a key that is not hot costs a lookup and an atomic add, and no memory. A key
/// whose demand
/// in one span reaches [`hot_threshold`](LeasedStoreBuilder::hot_threshold) (default 8 units)
/// becomes hot: it gets an entry (at most
/// [`max_hot_keys`](LeasedStoreBuilder::max_hot_keys), each with a key of at most
/// [`MAX_LEASED_KEY_LEN`] bytes: longer keys never lease) and its next check takes a lease. The
/// size `k` of a lease is
///
/// - the key's local demand over one span (windows) or over half a bucket lease's lifetime
///   (buckets): the larger of the current and the previous span's demand, so a lease lasts
///   about that long;
/// - at most [`max_share_percent`](LeasedStoreBuilder::max_share_percent) of the limit
///   (default 10 %), so that no instance holds much of a key's quota;
/// - at most half of what Redis said was left after this instance's last call on the key (for
///   a bucket, plus what has refilled since): leases shrink as the quota runs out, down to
///   single units (then every check is a Redis call, as without leases);
/// - at least the request's cost. The request that takes the lease is part of it: it asks for
///   `k` and is admitted from it. If `k` does not fit but the request does, the script takes
///   as much as fits (`take.lua`): a lease never turns an admission into a rejection.
///
/// One lease call per key is out at a time on an instance, so an instance admits at most
/// `share · limit` per round trip on one key: a bucket whose burst is small next to its rate
/// times a round trip (a burst of 20 000 at 200 000/s is 100 ms of rate, and a 10 % lease
/// 10 ms) needs a larger share, or it leaves refill unused when Redis is slow.
///
/// When half of what an instance holds for a key is spent, it takes the next lease in the
/// background, so the local path rarely runs dry. One lease call per key is in flight at a
/// time; a check that finds no units while one is in flight waits for it (a round trip, as a
/// Redis check would), then is decided again (going to Redis on its own if it must). If that
/// call fails or times out, its waiters fail alike at once: no check waits for more than one
/// timeout (what such a call took, if Redis ran it, goes back: see the guarantees). A lease
/// call whose future is dropped before it ends (outside a runtime, where nothing finishes it
/// in the background) ends its key's wait too, and puts back what the stack took from leases;
/// what Redis consumed for it, if the script ran, stays consumed.
///
/// **Short keys.** When a lease call gets less than it asked for because the key is nearly out
/// of quota (a bucket nearly empty, a window with nothing left, or the call refused), the key
/// is *short* for a *hold*: the call's own `retry_after` when it was refused; otherwise, for a
/// window, until the window ends; for a bucket, until the missing part has refilled (at most
/// `L`). Holds last at most the longer of the lease span and `L`. During the hold, and while
/// the next lease call is out (for at most another hold), the checks on the key that the
/// leases do not cover are refused here ([`Decision::without_backend`]). Their `retry_after`
/// is the rest of the hold, or, if longer, the wait Redis' last answer implies for that cost
/// (a window: its end, if fewer units were left; a bucket: until all but `limit - cost` units
/// have come back), so that clients come back when Redis would admit them. A hot key above its limit then costs Redis about one call per instance per
/// hold, not one per refused request. These refusals defer admissions, they do not lose them:
/// a bucket keeps refilling meanwhile, from at most a lease's worth (far below its burst, so
/// nothing is capped away), and the next lease takes what refilled; a window refuses what
/// Redis would refuse too (unless another instance gives units back before the window ends).
///
/// # Guarantees
///
/// Leases are taken out of the real distributed state before anything is admitted from them,
/// so the fleet can only admit less than the limit, except for the buckets' lease lifetime:
///
/// - **Fixed window**: a lease is spent only inside the window it was taken from. It expires
///   locally at `sent + reset_after`, where `sent` is when the lease call left this instance
///   (the script ran no earlier) and `reset_after` the time from the script's run to the
///   window's end: never later than the window's end. Every window admits at most its limit,
///   exactly as without leases.
/// - **Token bucket, GCRA, leaky bucket**: units are consumed when leased and spent within the
///   lease lifetime `L` ([`bucket_lifetime`](LeasedStoreBuilder::bucket_lifetime), default
///   5 ms, counted from `sent`). In any span `T` the fleet admits at most `B + r·(T + L)`
///   (`B` the burst, `r` the rate): what it admits in `T` was consumed within `T + L`.
/// - **Under-admission**: while leases are out, Redis refuses what they hold, so the fleet may
///   admit less than without leases, by at most the sum of the outstanding leases' unspent
///   units ([`LeaseStats::outstanding`]), and while a key is short, an instance defers its
///   admissions by at most a hold and a round trip (see above). Unspent units go back when a
///   lease expires, when its
///   key has been idle for [`idle_after`](LeasedStoreBuilder::idle_after) (default 20 ms), on
///   [`flush`](LeasedStore::flush), [`shutdown`](LeasedStore::shutdown) and drop. A bucket's
///   refund moves its state back as if the units had never been consumed (less what idle
///   time has absorbed, as for cross-slot refunds); a window's refund takes them out of the
///   window's count if that window is still the current one (after it, there is nothing to
///   give back).
/// - **Lease calls cut off by a timeout** leave nothing consumed that is not counted. Each
///   lease call (a request's, or a prefetch in the background) runs in a task of its own: if
///   its caller stopped waiting and Redis answers later, what it took goes back; if no answer
///   comes at all (a timeout, a connection lost under it), a refund of its token follows it on
///   the same connection, so that it runs after the call if the call ran, and takes nothing
///   if it did not. What may still stay consumed (that refund unanswered too, or a give-back
///   that failed) is counted in [`LeaseStats::units_in_doubt`], outside `outstanding`: at
///   most that much more under-admission, until the window ends or the bucket refills.
/// - **A crashed instance** strands at most its leases until they expire: a bucket's units
///   simply stay consumed (the bucket refills as usual), a window's stay counted until the
///   window ends. A bucket refund is honoured up to 2 s after the lease was taken (the
///   lifetime of a pending refund); later, the units stay consumed.
/// - **Stacked checks** stay all or nothing: the checks of a `check_all` that a lease covers
///   are taken locally first, the others go to Redis in one call (taking leases there too),
///   and if Redis refuses, the local units are put back into their leases (if a lease expired
///   and went back meanwhile, they are dropped, counted in [`LeaseStats::units_dropped`]: an
///   under-admission). Such a mixed stack
///   is admitted when Redis answers, up to one round trip after its leased part was taken:
///   for buckets the bound above becomes `B + r·(T + L + RTT)` for those stacks, and a
///   window's leased unit can admit a request whose other checks Redis decided just after
///   the window ended (counted in the window it was leased from, so no window counts more
///   than its limit).
/// - **Decisions from a lease** (marked [`Decision::without_backend`], so that a circuit
///   breaker does not take them for Redis' answers; a stack that Redis decided in part is
///   marked as coming from Redis, whichever of its checks is the tighter) report the distributed
///   state as of the newest lease of the key: `remaining` is what Redis said was left after
///   it, plus the units this instance still holds; `reset_after` is Redis' value less the
///   time since the lease was sent. They do not see what other instances consumed since: for
///   a bucket they are at most `L` old; for a window, at most as old as the lease, which its
///   size (about one span of demand) and the idle return keep short, and never from another
///   window.
///
/// The bounds assume that this instance's clock and Redis' run at the same rate over `L` (a
/// drift of parts per million over milliseconds is nanoseconds).
///
/// # The other algorithms
///
/// The sliding log and the sliding window never lease: their checks go to Redis as before.
/// The sliding log admits per request at its own time and forgets each request exactly `W`
/// later; a lease's units would all be logged at the lease's time, so a unit spent `L` later
/// would be forgotten `L` too early. It would need a log that takes entries stamped with the
/// end of their lease (counted from then, so admissions are forgotten late, never early), and
/// a refund that removes stamped entries. The sliding window counts per window like the fixed
/// window and could lease the same way (spent inside the window it came from; its estimate
/// sees the units a little early, which only refuses more), but its `remaining` depends on
/// the time inside the window, so the lease sizing would have to follow the decaying estimate
/// rather than a count; it is left out until someone needs it.
///
/// # When to turn it on
///
/// For keys that one instance checks thousands of times per second or more, shared by the
/// fleet: a global limit, a big tenant, an API key used by many clients. Leases cost a little
/// exactness at the edges (the bounds above) and trade freshness of `remaining` for speed.
/// With low per-key traffic nothing changes: no key becomes hot, and every check is the
/// `RedisStore`'s own.
///
/// # Clones and shutdown
///
/// Cloning is cheap; clones share the leases. When the last clone is dropped inside a tokio
/// runtime, unspent units are given back in the background; [`LeasedStore::shutdown`] does it
/// and waits (for the lease calls in flight too, at most the Redis store's timeout). The
/// background sweep starts with the store inside a runtime, or else when a key first takes
/// a lease inside one.
#[derive(Clone)]
pub struct LeasedStore {
    shared: Arc<Shared>,
}

impl fmt::Debug for LeasedStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeasedStore")
            .field("redis", &self.shared.redis)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Configures a [`LeasedStore`]; made by [`LeasedStore::builder`].
#[derive(Clone, Debug)]
pub struct LeasedStoreBuilder {
    redis: RedisStore,
    span: Duration,
    lifetime: Duration,
    share_percent: u8,
    hot: u64,
    idle: Duration,
    max_hot_keys: usize,
    sweep: Option<Duration>,
}

impl LeasedStoreBuilder {
    /// The span of local demand a lease is sized for, and over which demand is counted
    /// (default 10 ms, at least 1 µs).
    pub fn lease_span(mut self, span: Duration) -> Self {
        self.span = span.max(Duration::from_micros(1));
        self
    }

    /// The lifetime `L` of a bucket's lease, counted from when its call was sent (default
    /// 5 ms, at least 1 µs): in any span `T` the fleet admits at most `B + r·(T + L)`.
    pub fn bucket_lifetime(mut self, lifetime: Duration) -> Self {
        self.lifetime = lifetime.max(Duration::from_micros(1));
        self
    }

    /// The largest lease, in percent of the policy's limit (default 10, from 1 to 100; a
    /// lease is at least one unit).
    pub fn max_share_percent(mut self, percent: u8) -> Self {
        self.share_percent = percent.clamp(1, 100);
        self
    }

    /// The demand, in units per span on this instance, that makes a key hot (default 8, at
    /// least 1).
    pub fn hot_threshold(mut self, units: u64) -> Self {
        self.hot = units.max(1);
        self
    }

    /// How long a key goes without a check before its leases are given back and it stops
    /// being tracked (default 20 ms).
    pub fn idle_after(mut self, idle: Duration) -> Self {
        self.idle = idle;
        self
    }

    /// The most hot (key, policy) pairs tracked at once (default 4096); beyond, keys go to
    /// Redis on every check.
    pub fn max_hot_keys(mut self, max: usize) -> Self {
        self.max_hot_keys = max;
        self
    }

    /// How often a background task gives back expired and idle leases (default: every
    /// bucket lifetime). `None`: no task; call [`LeasedStore::sweep`] yourself (tests do,
    /// with an injected clock).
    pub fn sweep_every(mut self, every: Option<Duration>) -> Self {
        self.sweep = every.map(|d| d.max(Duration::from_micros(100)));
        self
    }

    /// The store. The background sweep starts now if this runs inside a tokio runtime, or
    /// else when a key first takes a lease inside one.
    pub fn build(self) -> LeasedStore {
        // Zero: every bucket lifetime.
        let sweep = match self.sweep {
            Some(Duration::ZERO) | None => self.lifetime,
            Some(every) => every,
        };
        let shared = Arc::new(Shared {
            clock: Arc::clone(self.redis.local_clock()),
            redis: self.redis,
            in_doubt: Arc::new(AtomicU64::new(0)),
            config: Config {
                span: nanos(self.span),
                lifetime: nanos(self.lifetime),
                share_percent: u64::from(self.share_percent),
                hot: self.hot,
                idle: nanos(self.idle),
                per_shard: self.max_hot_keys.div_ceil(SHARDS),
            },
            hasher: foldhash::fast::RandomState::default(),
            sketch: (0..SKETCH_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            shards: (0..SHARDS).map(|_| Mutex::new(HashTable::new())).collect(),
            returns: Mutex::new(Vec::new()),
            sweeping: tokio::sync::Mutex::new(()),
            closed: AtomicBool::new(false),
            ids: AtomicU64::new(1),
            counters: Counters::default(),
            sweep_every: self.sweep.map(|_| sweep),
            sweeper_started: AtomicBool::new(false),
        });
        shared.start_sweeper();
        LeasedStore { shared }
    }
}

impl LeasedStore {
    /// `redis` with the default lease policy (see [`LeasedStore`]).
    pub fn new(redis: RedisStore) -> Self {
        Self::builder(redis).build()
    }

    /// A builder around `redis`.
    pub fn builder(redis: RedisStore) -> LeasedStoreBuilder {
        LeasedStoreBuilder {
            redis,
            span: DEFAULT_LEASE_SPAN,
            lifetime: DEFAULT_BUCKET_LIFETIME,
            share_percent: DEFAULT_MAX_SHARE_PERCENT,
            hot: DEFAULT_HOT_THRESHOLD,
            idle: DEFAULT_IDLE_AFTER,
            max_hot_keys: DEFAULT_MAX_HOT_KEYS,
            sweep: Some(Duration::ZERO),
        }
    }

    /// The Redis store underneath.
    pub fn redis(&self) -> &RedisStore {
        &self.shared.redis
    }

    /// The counters so far, and the units held now.
    pub fn stats(&self) -> LeaseStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut outstanding = self
            .shared
            .returns
            .lock()
            .iter()
            .map(|b| b.units)
            .sum::<u64>();
        let (mut hot_keys, mut fetching) = (0, 0);
        for shard in self.shared.shards.iter() {
            let table = shard.lock();
            hot_keys += table.len();
            fetching += table.iter().filter(|e| e.fetching).count();
            outstanding += table.iter().map(Entry::held).sum::<u64>();
        }
        LeaseStats {
            leases: get(&c.leases),
            units_leased: get(&c.units_leased),
            local_decisions: get(&c.local_decisions),
            units_spent: get(&c.units_spent),
            local_refusals: get(&c.local_refusals),
            units_returned: get(&c.units_returned),
            units_dropped: get(&c.units_dropped),
            units_in_doubt: get(&self.shared.in_doubt),
            outstanding,
            hot_keys,
            fetching,
        }
    }

    /// Checks one request of `cost` against `policy` for `key`.
    pub fn check(&self, key: &str, policy: &Policy, cost: u64) -> LeasedFuture {
        self.check_all(&[Check::new(key, policy, cost)])
    }

    /// Checks a stack of limits all or nothing, from leases where they cover a check, and
    /// returns the most restrictive decision.
    pub fn check_all(&self, checks: &[Check<'_>]) -> LeasedFuture {
        let shared = &self.shared;
        let leasable = |c: &Check<'_>| c.cost() > 0 && kind(c.policy().algorithm()).is_some();
        if !checks.iter().any(leasable) || shared.closed.load(Ordering::Acquire) {
            return LeasedFuture::redis(shared.redis.check_all(checks));
        }
        self.decide(checks, true)
    }

    /// [`LeasedStore::check_all`] once the stack is known to involve leases: a check that
    /// finds its key's leases empty while a lease call is out waits for that call (once, with
    /// `may_wait`), then decides again.
    fn decide(&self, checks: &[Check<'_>], may_wait: bool) -> LeasedFuture {
        let shared = &self.shared;
        match shared.plan(checks, may_wait) {
            Err(e) => LeasedFuture::ready(Err(e)),
            Ok(Plan::Direct) => LeasedFuture::redis(shared.redis.check_all(checks)),
            Ok(Plan::Local(d)) => LeasedFuture::ready(Ok(d)),
            Ok(Plan::Ask(ask)) => {
                let Ask {
                    future,
                    alone,
                    locals,
                    fetches,
                } = *ask;
                let unfinished = Unfinished {
                    shared: Arc::clone(shared),
                    locals,
                    fetches,
                    alone,
                };
                let call = async move {
                    let taken = future.await;
                    unfinished.finish(taken)
                };
                // In a task of its own, so that the leases' bookkeeping ends even if the
                // caller drops this future.
                match tokio::runtime::Handle::try_current() {
                    Ok(runtime) => LeasedFuture::spawned(runtime.spawn(call)),
                    Err(_) => LeasedFuture::boxed(call),
                }
            }
            Ok(Plan::Wait(mut done)) => {
                let deadline = shared.redis.inner.timeout;
                let owned: Vec<(Box<str>, usize, Policy, u64)> = checks
                    .iter()
                    .map(|c| {
                        let placement = c.placement().len();
                        (c.key().into(), placement, c.policy().clone(), c.cost())
                    })
                    .collect();
                let store = self.clone();
                LeasedFuture::boxed(async move {
                    // Woken when the call is back (or the key is no longer tracked); a call
                    // that failed fails its waiters too. The wait and what follows it take
                    // one timeout in all.
                    let now = tokio::time::Instant::now();
                    let deadline = now
                        .checked_add(deadline)
                        .unwrap_or(now + Duration::from_secs(86_400 * 365));
                    let timeout = store.shared.redis.inner.timeout;
                    match tokio::time::timeout_at(deadline, done.changed()).await {
                        Err(_) => return Err(StoreError::Timeout(timeout)),
                        Ok(Err(_)) => {}
                        Ok(Ok(())) => {
                            let ended = done.borrow().clone();
                            match ended {
                                Ended::Answered => {}
                                Ended::TimedOut(after) => return Err(StoreError::Timeout(after)),
                                Ended::Failed(why) => return Err(StoreError::Backend(why.into())),
                            }
                        }
                    }
                    let checks: SmallVec<[Check<'_>; 4]> = owned
                        .iter()
                        .map(|(k, p, policy, cost)| Check::new(k, policy, *cost).placed_by(*p))
                        .collect();
                    // No time left: no call (it would only outlive its caller's answer).
                    if tokio::time::Instant::now() >= deadline {
                        return Err(StoreError::Timeout(timeout));
                    }
                    tokio::time::timeout_at(deadline, store.decide(&checks, false))
                        .await
                        .unwrap_or(Err(StoreError::Timeout(timeout)))
                })
            }
        }
    }

    /// Gives back the leases that have expired and those of keys idle for
    /// [`idle_after`](LeasedStoreBuilder::idle_after), now (the background sweep calls this).
    pub async fn sweep(&self) -> Result<(), StoreError> {
        let _one_at_a_time = self.shared.sweeping.lock().await;
        let returns = self.shared.collect(false);
        self.shared.give_back(returns).await
    }

    /// Gives back every lease now, and waits for a sweep in progress to end. Keys lease again
    /// when they are next hot.
    pub async fn flush(&self) -> Result<(), StoreError> {
        let _one_at_a_time = self.shared.sweeping.lock().await;
        let returns = self.shared.collect(true);
        self.shared.give_back(returns).await
    }

    /// Stops taking leases (every check goes to Redis from now on), waits for the lease
    /// calls in flight (at most the Redis store's timeout: what they take comes back too),
    /// and gives back every lease. Call it before the process exits.
    pub async fn shutdown(&self) -> Result<(), StoreError> {
        self.shared.closed.store(true, Ordering::Release);
        let in_flight: Vec<_> = self
            .shared
            .shards
            .iter()
            .flat_map(|s| {
                let table = s.lock();
                table
                    .iter()
                    .filter(|e| e.fetching)
                    .map(|e| e.done.subscribe())
                    .collect::<Vec<_>>()
            })
            .collect();
        let deadline = self.shared.redis.inner.timeout;
        let _ = tokio::time::timeout(
            deadline,
            futures_util::future::join_all(in_flight.into_iter().map(|mut done| async move {
                let _ = done.changed().await;
            })),
        )
        .await;
        self.flush().await
    }

    /// Testing only: forgets every lease without giving anything back, as a crashed instance
    /// would, and stops taking leases.
    #[doc(hidden)]
    pub fn crash(&self) {
        self.shared.closed.store(true, Ordering::Release);
        for shard in self.shared.shards.iter() {
            shard.lock().clear();
        }
        self.shared.returns.lock().clear();
    }
}

impl Store for LeasedStore {
    type Future = LeasedFuture;

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        LeasedStore::check_all(self, checks)
    }

    fn check(&self, key: &str, policy: &Policy, cost: u64) -> Self::Future {
        LeasedStore::check(self, key, policy, cost)
    }

    fn max_key_len(&self) -> Option<usize> {
        Store::max_key_len(&self.shared.redis)
    }

    fn partition(&self, check: &Check<'_>) -> Option<u32> {
        Store::partition(&self.shared.redis, check)
    }
}

#[cfg(test)]
mod tests {
    use super::ledger::{AsOf, Lease};
    use super::policy::sketch_add;
    use super::*;
    use crate::Decision;
    use crate::Rate;
    use crate::store::redis::Ticket;

    const MS: u64 = 1_000_000;

    fn config() -> Config {
        Config {
            span: 10 * MS,
            lifetime: 5 * MS,
            share_percent: 10,
            hot: 8,
            idle: 20 * MS,
            per_shard: 16,
        }
    }

    fn ticket() -> Ticket {
        Ticket {
            key: fred::types::Key::from("k"),
            algorithm: "gcra",
            limit: 1,
            period: 1,
            horizon: 1,
            token: String::new(),
            ref_b: 0,
            ref_t: 0,
        }
    }

    fn entry(policy: Policy) -> Entry {
        Entry {
            hash: 1,
            id: 1,
            key: "k".into(),
            placement_len: 1,
            kind: kind(policy.algorithm()).unwrap(),
            policy,
            leases: SmallVec::new(),
            fetching: false,
            fetch_sent: 0,
            done: tokio::sync::watch::Sender::new(Ended::Answered),
            span: 0,
            demand: 0,
            last_demand: 0,
            used_at: 0,
            as_of: None,
            short_until: 0,
            hold: 0,
        }
    }

    fn lease(id: u64, units: u64, expires: u64) -> Lease {
        Lease {
            id,
            units,
            granted: units,
            expires,
            ticket: ticket(),
        }
    }

    #[test]
    fn demand_is_counted_per_span_and_the_previous_span_is_kept() {
        let mut e = entry(Policy::fixed_window(1_000, Duration::from_secs(1)).unwrap());
        e.note(0, 3, 10 * MS);
        e.note(9 * MS, 2, 10 * MS);
        assert_eq!((e.demand, e.last_demand), (5, 0));
        e.note(10 * MS, 1, 10 * MS);
        assert_eq!((e.demand, e.last_demand), (1, 5));
        // A span skipped: nothing was asked in the previous one.
        e.note(30 * MS, 1, 10 * MS);
        assert_eq!((e.demand, e.last_demand, e.used_at), (1, 0, 30 * MS));
    }

    #[test]
    fn leases_follow_demand_the_share_and_what_is_left() {
        let c = config();
        let mut w = entry(Policy::fixed_window(10_000, Duration::from_secs(1)).unwrap());
        w.demand = 300;
        // A span of demand.
        assert_eq!(w.want(0, 1, &c), 300);
        // At most 10 % of the limit.
        w.demand = 5_000;
        assert_eq!(w.want(0, 1, &c), 1_000);
        // At most half of what is left, and at least the cost.
        w.as_of = Some(AsOf {
            remaining: 100,
            sent: 0,
            reset_after: 500 * MS,
        });
        assert_eq!(w.want(MS, 1, &c), 50);
        w.as_of = Some(AsOf {
            remaining: 1,
            sent: 0,
            reset_after: 500 * MS,
        });
        assert_eq!(w.want(MS, 3, &c), 3);
        // After the window's end, the whole limit is there again.
        assert_eq!(w.want(500 * MS, 1, &c), 1_000);

        // A bucket: half a lifetime of demand, plus what refilled since the last call.
        let mut b = entry(Policy::gcra(Rate::per_second(1_000), 10_000).unwrap());
        b.demand = 400;
        assert_eq!(b.want(0, 1, &c), 100);
        b.as_of = Some(AsOf {
            remaining: 10,
            sent: 0,
            reset_after: 0,
        });
        assert_eq!(b.want(0, 1, &c), 5);
        assert_eq!(b.want(100 * MS, 1, &c), 55);
    }

    #[test]
    fn a_key_is_short_when_a_lease_call_gets_less_than_it_asked_for() {
        let c = config();
        let ms = Duration::from_millis;
        let b = entry(Policy::gcra(Rate::per_second(1_000), 10_000).unwrap());
        // All of it: not short.
        let all = Decision::admitted(10_000, 50, ms(0));
        assert_eq!(b.shortage(&all, 100, 100, &c), 0);
        // 2 of 4 asked: until 2 units have refilled (1 ms each)...
        assert_eq!(b.shortage(&all, 4, 2, &c), 2 * MS);
        // ... at most L.
        assert_eq!(b.shortage(&all, 100, 2, &c), 5 * MS);
        // Refused: its retry time, at most the longer of the span and L.
        let no = Decision::rejected(10_000, 0, ms(10_000), ms(3));
        assert_eq!(b.shortage(&no, 100, 0, &c), 3 * MS);
        let no = Decision::rejected(10_000, 0, ms(10_000), ms(300));
        assert_eq!(b.shortage(&no, 100, 0, &c), 10 * MS);
        // A window: short only with nothing left, until it ends.
        let w = entry(Policy::fixed_window(1_000, Duration::from_secs(1)).unwrap());
        assert_eq!(
            w.shortage(&Decision::admitted(1_000, 3, ms(4)), 10, 5, &c),
            0
        );
        assert_eq!(
            w.shortage(&Decision::admitted(1_000, 0, ms(4)), 10, 5, &c),
            4 * MS
        );
    }

    #[test]
    fn spending_takes_from_the_oldest_leases_and_empties_them() {
        let mut e = entry(Policy::gcra(Rate::per_second(1_000), 10_000).unwrap());
        e.leases.push(lease(1, 1, 100));
        e.leases.push(lease(2, 5, 200));
        let mut out = Vec::new();
        assert!(e.spend(7, &mut out).is_none(), "only 6 held");
        let parts = e.spend(2, &mut out).unwrap();
        assert_eq!(parts.as_slice(), &[(1, 1), (2, 1)]);
        assert_eq!(out.len(), 1, "the emptied lease goes back (to settle)");
        assert_eq!((out[0].id, out[0].units), (1, 0));
        assert_eq!(e.held(), 4);
        e.expire(200, &mut out);
        assert_eq!(e.held(), 0);
        assert_eq!((out[1].id, out[1].units), (2, 4));
        let d = e.decision(0, 3, None);
        assert!(!d.reached_backend() && d.allowed() && d.index() == 3);
        let d = e.decision(0, 3, Some(7));
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(7)));
    }

    #[test]
    fn a_decision_marked_as_reaching_redis_keeps_every_value() {
        let ms = Duration::from_millis;
        for d in [
            Decision::admitted(10, 3, ms(40)).with_index(2),
            Decision::rejected(10, 0, ms(40), ms(7)).with_index(1),
        ] {
            let local = d.without_backend();
            let marked = super::decide::reached_backend(local);
            assert!(marked.reached_backend());
            assert_eq!(marked, d);
            assert_eq!(
                (marked.retry_after(), marked.reset_after(), marked.index()),
                (d.retry_after(), d.reset_after(), d.index())
            );
        }
    }

    #[test]
    fn the_demand_sketch_counts_per_span_and_saturates() {
        let slot = AtomicU64::new(0);
        assert_eq!(sketch_add(&slot, 7, 3), 3);
        assert_eq!(sketch_add(&slot, 7, 4), 7);
        assert_eq!(sketch_add(&slot, 8, 1), 1, "a new span starts over");
        assert_eq!(sketch_add(&slot, 8, u64::MAX), SKETCH_COUNT_MAX);
    }
}
