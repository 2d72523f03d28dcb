//! Leased quota for hot keys: [`LeasedStore`] (its docs hold the lease policy and the
//! guarantees).

use std::fmt;
use std::future::Future;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use hashbrown::HashTable;
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::{RedisStore, ResponseFuture, Taken, TakenItem, Ticket, Wanted, supports};
use crate::clock::Clock;
use crate::store::{Check, Store, StoreError};
use crate::{Algorithm, Decision, Policy};

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

/// How an algorithm leases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Spent inside the window it came from.
    Window,
    /// Spent within the lease lifetime L.
    Bucket,
}

fn kind(algorithm: Algorithm) -> Option<Kind> {
    match algorithm {
        Algorithm::FixedWindow => Some(Kind::Window),
        Algorithm::TokenBucket | Algorithm::LeakyBucket | Algorithm::Gcra => Some(Kind::Bucket),
        _ => None,
    }
}

/// Adds `cost` to a demand counter for `span` (a counter of an older span starts over): the
/// count in this span. The span's low 40 bits tag the count.
fn sketch_add(slot: &AtomicU64, span: u64, cost: u64) -> u64 {
    let tag = span & ((1 << (64 - SKETCH_COUNT_BITS)) - 1);
    let mut count = 0;
    let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        let before = if v >> SKETCH_COUNT_BITS == tag {
            v & SKETCH_COUNT_MAX
        } else {
            0
        };
        count = before.saturating_add(cost).min(SKETCH_COUNT_MAX);
        Some((tag << SKETCH_COUNT_BITS) | count)
    });
    count
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The configuration, in nanoseconds.
#[derive(Clone, Copy, Debug)]
struct Config {
    span: u64,
    lifetime: u64,
    share_percent: u64,
    hot: u64,
    idle: u64,
    per_shard: usize,
}

/// Redis' view of the key as of this instance's newest call on it.
#[derive(Clone, Copy, Debug)]
struct AsOf {
    /// What was left after that call.
    remaining: u64,
    /// When the call was sent (local ns).
    sent: u64,
    /// Time from the script's run until the key's state fully recovers (ns); a window's end.
    reset_after: u64,
}

/// How a key's lease call ended, for the checks that waited for it.
#[derive(Clone, Debug, Default)]
enum Ended {
    /// In flight (the channel's first value), answered, or never made: decide again.
    #[default]
    Answered,
    /// Redis did not answer in time: the waiters fail alike, rather than each waiting for a
    /// timeout of its own.
    TimedOut(Duration),
    /// Redis failed (the error's text).
    Failed(String),
}

impl Ended {
    /// How a lease call that failed with `e` ended, for its key's waiters: `alone`, whether
    /// the call was about the leased keys alone. A failure of another check of its stack (its
    /// slot down, its key invalid) says nothing about this key: its waiters decide again.
    fn of(e: &StoreError, alone: bool) -> Self {
        match e {
            StoreError::Timeout(after) if alone => Ended::TimedOut(*after),
            StoreError::Backend(_) | StoreError::CircuitOpen if alone => {
                Ended::Failed(e.to_string())
            }
            _ => Ended::Answered,
        }
    }
}

/// A lease (or what is left of it) on its way back to Redis.
struct Back {
    /// The lease's id: units put back after it left its entry still find it here.
    id: u64,
    ticket: Ticket,
    units: u64,
}

impl From<Lease> for Back {
    fn from(l: Lease) -> Self {
        Back {
            id: l.id,
            ticket: l.ticket,
            units: l.units,
        }
    }
}

struct Lease {
    id: u64,
    /// Units left to spend.
    units: u64,
    /// Units it came with.
    granted: u64,
    /// Local time (ns) from which it may no longer be spent.
    expires: u64,
    ticket: Ticket,
}

/// A hot (key, policy) of this instance.
struct Entry {
    hash: u64,
    id: u64,
    key: Box<str>,
    placement_len: usize,
    policy: Policy,
    kind: Kind,
    /// Oldest first (the first to expire).
    leases: SmallVec<[Lease; 2]>,
    /// A lease call is in flight, sent at `fetch_sent` (local ns); `done` is told when it ends.
    fetching: bool,
    fetch_sent: u64,
    done: tokio::sync::watch::Sender<Ended>,
    /// The span being counted, its demand so far, and the previous span's.
    span: u64,
    demand: u64,
    last_demand: u64,
    /// When a check last asked for this key.
    used_at: u64,
    as_of: Option<AsOf>,
    /// The key is short (its last lease call got less than it asked for): until this local
    /// time, checks the leases cannot cover are refused here (0: not short).
    short_until: u64,
    /// How long that refusal was (the wait a refusal reports while the next call is out).
    hold: u64,
}

impl Entry {
    fn matches(&self, check: &Check<'_>) -> bool {
        self.policy.id() == check.policy().id()
            && self.placement_len == check.placement().len()
            && *self.key == *check.key()
    }

    /// Counts `cost` units of demand at `now`.
    fn note(&mut self, now: u64, cost: u64, span_ns: u64) {
        let span = now / span_ns;
        if span != self.span {
            self.last_demand = if span == self.span.wrapping_add(1) {
                self.demand
            } else {
                0
            };
            self.span = span;
            self.demand = 0;
        }
        self.demand = self.demand.saturating_add(cost);
        self.used_at = now;
    }

    /// Units held, unspent.
    fn held(&self) -> u64 {
        self.leases.iter().map(|l| l.units).sum()
    }

    /// Moves the leases expired at `now` to `out`.
    fn expire(&mut self, now: u64, out: &mut Vec<Back>) {
        let mut i = 0;
        while i < self.leases.len() {
            if now >= self.leases[i].expires {
                let l = self.leases.remove(i);
                out.push(Back::from(l));
            } else {
                i += 1;
            }
        }
    }

    /// Spends `cost` from the live leases, oldest first, if they hold it: the units taken
    /// from each (lease id, units). A lease emptied goes to `out` (a bucket still has to
    /// forget its pending refund).
    fn spend(&mut self, cost: u64, out: &mut Vec<Back>) -> Option<Parts> {
        if self.held() < cost {
            return None;
        }
        let mut parts = Parts::new();
        let mut left = cost;
        for lease in &mut self.leases {
            let take = lease.units.min(left);
            if take > 0 {
                lease.units -= take;
                left -= take;
                parts.push((lease.id, take));
            }
            if left == 0 {
                break;
            }
        }
        let mut i = 0;
        while i < self.leases.len() {
            if self.leases[i].units == 0 {
                out.push(Back::from(self.leases.remove(i)));
            } else {
                i += 1;
            }
        }
        Some(parts)
    }

    /// A decision from the leases, for the check at `index`: admitted, or refused with
    /// `retry` (ns).
    fn decision(&self, now: u64, index: usize, retry: Option<u64>) -> Decision {
        let limit = self.policy.limit();
        let (remaining, reset) = match self.as_of {
            Some(a) => (
                a.remaining.saturating_add(self.held()).min(limit),
                a.reset_after.saturating_sub(now.saturating_sub(a.sent)),
            ),
            None => (self.held().min(limit), 0),
        };
        Decision::from_nanos(retry.is_none(), limit, remaining, reset, retry.unwrap_or(0))
            .with_index(index)
            .without_backend()
    }

    /// The wait a local refusal of `cost` at `now` reports: at least `hold`, and at least
    /// until `cost` fits by what Redis said last, so that a client comes back when Redis
    /// would admit it (not merely when the next lease call may go out).
    fn retry(&self, now: u64, cost: u64, hold: u64) -> u64 {
        hold.max(self.fits_at(cost).saturating_sub(now))
    }

    /// When a check of `cost` fits by Redis' answer to the last lease call (local ns; 0: it
    /// fitted then). A window: when it ends, if fewer than `cost` units were left. A bucket:
    /// its `reset_after` is the time until it is full, so `cost` fits once all but
    /// `limit - cost` units have come back (the same wait the Redis store reports).
    fn fits_at(&self, cost: u64) -> u64 {
        let Some(a) = self.as_of else {
            return 0;
        };
        if a.remaining >= cost {
            return 0;
        }
        let full = a.sent.saturating_add(a.reset_after);
        match self.kind {
            Kind::Window => full,
            Kind::Bucket => {
                let spare = u128::from(self.policy.limit().saturating_sub(cost))
                    * u128::from(self.policy.period_nanos());
                full.saturating_sub(u64::try_from(spare).unwrap_or(u64::MAX))
            }
        }
    }

    /// After a lease call that asked for `want` and consumed `granted` (its decision `d`):
    /// whether the key is short, and for how long to refuse locally what leases do not cover.
    fn shortage(&self, d: &Decision, want: u64, granted: u64, config: &Config) -> u64 {
        let ns = |t: Duration| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX);
        let hold = match (self.kind, d.retry_after()) {
            // Refused: nothing of this cost fits before its retry time.
            (_, Some(retry)) => ns(retry),
            // A window with nothing left: until it ends.
            (Kind::Window, None) if d.remaining() == 0 => ns(d.reset_after()),
            (Kind::Window, None) => 0,
            // A bucket that had less than asked for: until the missing part has refilled, at
            // most a lease lifetime.
            (Kind::Bucket, None) => want
                .saturating_sub(granted)
                .saturating_mul(self.policy.period_nanos())
                .min(config.lifetime),
        };
        hold.min(config.span.max(config.lifetime))
    }

    /// The size of the next lease for a request of `cost` at `now` (`cost` itself: no lease).
    fn want(&self, now: u64, cost: u64, config: &Config) -> u64 {
        let limit = self.policy.limit();
        let demand = u128::from(self.demand.max(self.last_demand).max(cost));
        let horizon = match self.kind {
            Kind::Window => config.span,
            Kind::Bucket => config.lifetime / 2,
        };
        let by_demand = (demand * u128::from(horizon)).div_ceil(u128::from(config.span.max(1)));
        let by_share = (u128::from(limit) * u128::from(config.share_percent) / 100).max(1);
        let left = match self.as_of {
            None => u128::from(limit),
            Some(a) => match self.kind {
                Kind::Window if now >= a.sent.saturating_add(a.reset_after) => u128::from(limit),
                Kind::Window => u128::from(a.remaining),
                Kind::Bucket => {
                    let refilled = now.saturating_sub(a.sent) / self.policy.period_nanos().max(1);
                    u128::from(a.remaining.saturating_add(refilled).min(limit))
                }
            },
        };
        let by_left = (left / 2).max(1);
        let k = by_demand.min(by_share).min(by_left);
        u64::try_from(k).unwrap_or(u64::MAX).max(cost)
    }

    /// Whether to take the next lease now: half of what is held is spent.
    fn low(&self, granted: u64) -> bool {
        self.held() <= granted / 2
    }
}

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
/// timeout. A lease call whose future is dropped before it ends (outside a runtime, where
/// nothing finishes it in the background) ends its key's wait too, and puts back what the
/// stack took from leases; what Redis consumed for it, if the script ran, stays consumed.
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
/// - **Decisions from a lease** (marked [`Decision::without_backend`]) report the distributed
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

/// Gives back expired and idle leases every `every` (twenty times less often while no key
/// is hot), until the store is dropped.
async fn sweeper(store: Weak<Shared>, every: Duration) {
    let mut pause = every;
    loop {
        tokio::time::sleep(pause).await;
        let Some(shared) = store.upgrade() else {
            return;
        };
        // One lock at a time: elsewhere a shard is locked before the returns (put_back).
        let nothing_back = shared.returns.lock().is_empty();
        let idle = nothing_back && shared.shards.iter().all(|s| s.lock().is_empty());
        pause = if idle {
            every.saturating_mul(20)
        } else {
            every
        };
        let _ = LeasedStore { shared }.sweep().await;
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

/// What a check_all does.
enum Plan {
    /// A check waits for its key's lease call in flight; then the stack is decided again.
    Wait(tokio::sync::watch::Receiver<Ended>),
    /// Nothing leased is involved: the Redis store's own path.
    Direct,
    /// Every check answered from leases.
    Local(Decision),
    /// Redis decides the rest.
    Ask(Box<Ask>),
}

struct Ask {
    future: super::TakeFuture,
    /// Redis is asked about the fetches' keys alone.
    alone: bool,
    /// Checks answered from leases, pending Redis' verdict on the others.
    locals: SmallVec<[Local; 2]>,
    /// Checks whose call takes a lease.
    fetches: SmallVec<[Fetch; 2]>,
}

/// A call with leased parts until [`Shared::finish`] runs. If its future is dropped first
/// (the caller went away without a runtime to finish it, or the runtime shut down), the
/// units taken from leases go back and its lease calls end, so that no check waits for them
/// forever. (What Redis consumed for such a call, if it ran, stays consumed.)
struct Unfinished {
    shared: Arc<Shared>,
    locals: SmallVec<[Local; 2]>,
    fetches: SmallVec<[Fetch; 2]>,
    /// The call asks Redis about its lease calls' keys alone.
    alone: bool,
}

impl Unfinished {
    fn finish(mut self, taken: Result<Taken, StoreError>) -> Result<Decision, StoreError> {
        let locals = std::mem::take(&mut self.locals);
        let fetches = std::mem::take(&mut self.fetches);
        self.shared.finish(taken, locals, fetches, self.alone)
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        self.shared.put_back(&self.locals);
        for f in &self.fetches {
            self.shared.install(f, None, 0, Ended::Answered);
        }
    }
}

/// Units taken from leases: (lease id, units).
type Parts = SmallVec<[(u64, u64); 2]>;

/// A check answered from its key's leases.
#[derive(Clone)]
struct Local {
    hash: u64,
    parts: Parts,
    units: u64,
    decision: Decision,
}

/// A lease call: its key's entry (hash, id), the check's index and cost.
#[derive(Clone, Copy)]
struct Fetch {
    hash: u64,
    entry: u64,
    index: usize,
    cost: u64,
    /// What the lease call asks for (at least the cost).
    want: u64,
}

/// What deciding a stack leaves to do once the locks are released.
struct Effects<'c> {
    /// Leases expired or emptied, to give back.
    returns: Vec<Back>,
    /// Lease calls to make in the background: (the check, its fetch, what to ask for).
    prefetch: SmallVec<[(Check<'c>, Fetch, u64); 1]>,
}

/// What one check of a stack does.
enum Step {
    /// Waits for the lease call in flight.
    Wait(tokio::sync::watch::Receiver<Ended>),
    /// Spent from leases.
    Local(Local),
    /// Refused here: the key is short.
    Refuse(Decision),
    /// Asks Redis, taking a lease.
    Fetch(Fetch),
    /// Asks Redis, as without leases.
    Direct,
}

impl Shared {
    /// Starts the background sweep, if there is one, it has not started yet, and this runs
    /// inside a tokio runtime.
    fn start_sweeper(self: &Arc<Self>) {
        let Some(every) = self.sweep_every else {
            return;
        };
        if self.sweeper_started.load(Ordering::Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !self.sweeper_started.swap(true, Ordering::AcqRel) {
            runtime.spawn(sweeper(Arc::downgrade(self), every));
        }
    }

    fn hash(&self, check: &Check<'_>) -> u64 {
        self.hasher
            .hash_one((check.key(), check.placement().len(), check.policy().id()))
    }

    fn shard(&self, hash: u64) -> &Mutex<HashTable<Entry>> {
        &self.shards[(hash >> 40) as usize % SHARDS]
    }

    /// Counts demand for a key that is not hot: its slot's units in the current span.
    fn bump(&self, hash: u64, span: u64, cost: u64) -> u64 {
        sketch_add(
            &self.sketch[(hash >> 20) as usize % SKETCH_SLOTS],
            span,
            cost,
        )
    }

    /// What to do with a stack. Checks are validated where a key becomes hot (so a hot key's
    /// checks are valid but for their cost, which a lease never covers beyond the limit);
    /// others are the Redis store's to refuse.
    fn plan(self: &Arc<Self>, checks: &[Check<'_>], may_wait: bool) -> Result<Plan, StoreError> {
        // The same (key, policy) twice in one stack is one check of the summed cost, as the
        // Redis store merges it.
        let mut merged: SmallVec<[(Check<'_>, usize); 4]> = SmallVec::new();
        for (index, check) in checks.iter().enumerate() {
            match merged
                .iter_mut()
                .find(|(c, _)| c.policy().id() == check.policy().id() && c.key() == check.key())
            {
                Some((c, _)) => {
                    let cost = c
                        .cost()
                        .checked_add(check.cost())
                        .filter(|&s| s <= c.policy().limit())
                        .ok_or(StoreError::CostExceedsLimit {
                            index,
                            cost: c.cost().saturating_add(check.cost()),
                            limit: c.policy().limit(),
                        })?;
                    *c = c.with_cost(cost);
                }
                None => merged.push((*check, index)),
            }
        }
        let mut steps: SmallVec<[Step; 4]> = SmallVec::new();
        let mut effects = Effects {
            returns: Vec::new(),
            prefetch: SmallVec::new(),
        };
        for &(check, index) in &merged {
            let step = match kind(check.policy().algorithm()) {
                // (A cost above the limit is the Redis store's error to report, short or not.)
                Some(kind) if check.cost() > 0 && check.cost() <= check.policy().limit() => {
                    self.step(check, index, kind, may_wait, &mut effects)
                }
                _ => Step::Direct,
            };
            steps.push(step);
        }
        if !effects.prefetch.is_empty() {
            self.start_sweeper();
        }
        for (check, fetch, want) in effects.prefetch {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                // Nowhere to take it in the background: the next check that runs dry will.
                self.install(&fetch, None, 0, Ended::Answered);
                continue;
            };
            let future = self.redis.take(&[Wanted {
                check: check.with_cost(0),
                index: 0,
                want,
            }]);
            let unfinished = Unfinished {
                shared: Arc::clone(self),
                locals: SmallVec::new(),
                fetches: [fetch].into_iter().collect(),
                alone: true,
            };
            runtime.spawn(async move {
                let taken = future.await;
                unfinished.finish(taken)
            });
        }
        let refused = steps.iter().filter_map(|s| match s {
            Step::Refuse(d) => Some(*d),
            _ => None,
        });
        let refusal = refused.reduce(Decision::most_restrictive);
        let wait = steps.iter().find_map(|s| match s {
            Step::Wait(done) => Some(done.clone()),
            _ => None,
        });
        let early = match (refusal, wait) {
            (Some(refusal), _) => {
                self.counters.local_refusals.fetch_add(1, Ordering::Relaxed);
                Some(Plan::Local(refusal))
            }
            (None, Some(done)) => Some(Plan::Wait(done)),
            (None, None) => None,
        };
        if let Some(plan) = early {
            // Nothing is consumed anywhere: units taken from leases go back, calls are not made.
            let mut locals: SmallVec<[Local; 2]> = SmallVec::new();
            for s in steps {
                match s {
                    Step::Local(l) => locals.push(l),
                    Step::Fetch(f) => self.install(&f, None, 0, Ended::Answered),
                    _ => {}
                }
            }
            // Before the leases emptied here are published for a sweep to give back: their
            // units go back with them.
            self.put_back_with(&locals, &mut effects.returns);
            self.publish(&mut effects.returns);
            return Ok(plan);
        }
        self.publish(&mut effects.returns);
        if steps.iter().all(|s| matches!(s, Step::Local(_))) {
            let mut decision: Option<(Decision, u64)> = None;
            for s in &steps {
                if let Step::Local(l) = s {
                    self.counted_local(l);
                    let this = (l.decision, l.units);
                    decision = Some(decision.map_or(this, |d| crate::decision::tighter(d, this)));
                }
            }
            return Ok(Plan::Local(
                decision.map_or(super::NOTHING_TO_CHECK, |(d, _)| d),
            ));
        }
        if steps.iter().all(|s| matches!(s, Step::Direct)) {
            return Ok(Plan::Direct);
        }
        // A lease is being taken: someone must give it back.
        self.start_sweeper();
        let mut wanted: SmallVec<[Wanted<'_>; 4]> = SmallVec::new();
        let mut locals = SmallVec::new();
        let mut fetches = SmallVec::new();
        for ((check, index), step) in merged.iter().zip(steps) {
            match step {
                Step::Local(l) => locals.push(l),
                Step::Fetch(f) => {
                    fetches.push(f);
                    wanted.push(Wanted {
                        check: *check,
                        index: *index,
                        want: f.want,
                    });
                }
                Step::Refuse(_) | Step::Wait(_) => {}
                Step::Direct => wanted.push(Wanted {
                    check: *check,
                    index: *index,
                    want: check.cost(),
                }),
            }
        }
        Ok(Plan::Ask(Box::new(Ask {
            alone: wanted.len() == fetches.len(),
            future: self.redis.take(&wanted),
            locals,
            fetches,
        })))
    }

    /// What one leasable check does: spend from a lease, take one, or go to Redis alone.
    fn step<'c>(
        &self,
        check: Check<'c>,
        index: usize,
        kind: Kind,
        may_wait: bool,
        effects: &mut Effects<'c>,
    ) -> Step {
        let (returns, prefetch) = (&mut effects.returns, &mut effects.prefetch);
        let config = &self.config;
        let hash = self.hash(&check);
        let cost = check.cost();
        let mut table = self.shard(hash).lock();
        // Closing: no lease call starts after shutdown has looked at this shard.
        if self.closed.load(Ordering::Acquire) {
            return Step::Direct;
        }
        // Read once the shard is ours, so that no wait for the lock makes it stale: a lease
        // is never spent after it expired.
        let now = self.clock.now();
        if let Some(e) = table.find_mut(hash, |e| e.hash == hash && e.matches(&check)) {
            e.note(now, cost, config.span);
            e.expire(now, returns);
            let granted = e.leases.last().map_or(0, |l| l.granted);
            if let Some(parts) = e.spend(cost, returns) {
                let decision = e.decision(now, index, None);
                if !e.fetching && e.low(granted.max(cost)) {
                    let want = e.want(now, 0, config);
                    if want > 0 {
                        e.fetching = true;
                        e.fetch_sent = now;
                        let fetch = Fetch {
                            hash,
                            entry: e.id,
                            index: 0,
                            cost: 0,
                            want,
                        };
                        prefetch.push((check, fetch, want));
                    }
                }
                return Step::Local(Local {
                    hash,
                    parts,
                    units: cost,
                    decision,
                });
            }
            if now < e.short_until {
                let retry = e.retry(now, cost, e.short_until - now);
                return Step::Refuse(e.decision(now, index, Some(retry)));
            }
            if e.fetching {
                if e.short_until > 0 && now < e.fetch_sent.saturating_add(e.hold) {
                    // Short, and the next lease call is out (for less than a hold): refused
                    // here too.
                    let retry = e.retry(now, cost, e.hold.max(1));
                    return Step::Refuse(e.decision(now, index, Some(retry)));
                }
                if may_wait {
                    return Step::Wait(e.done.subscribe());
                }
                return Step::Direct;
            }
            e.fetching = true;
            e.fetch_sent = now;
            let want = e.want(now, cost, config);
            return Step::Fetch(Fetch {
                hash,
                entry: e.id,
                index,
                cost,
                want,
            });
        }
        let span = now / config.span.max(1);
        let demand = self.bump(hash, span, cost);
        if demand < config.hot || table.len() >= config.per_shard {
            return Step::Direct;
        }
        // A check Redis would refuse (a key too long, a policy out of its bounds) stays cold.
        let valid = check.key().len() <= MAX_LEASED_KEY_LEN
            && check.validate(index, self.redis.inner.max_key_len).is_ok()
            && supports(check.policy(), index).is_ok();
        if !valid {
            return Step::Direct;
        }
        let entry = Entry {
            hash,
            id: self.ids.fetch_add(1, Ordering::Relaxed),
            key: check.key().into(),
            placement_len: check.placement().len(),
            policy: check.policy().clone(),
            kind,
            leases: SmallVec::new(),
            fetching: true,
            fetch_sent: now,
            done: tokio::sync::watch::Sender::new(Ended::Answered),
            span,
            demand,
            last_demand: 0,
            used_at: now,
            as_of: None,
            short_until: 0,
            hold: 0,
        };
        let want = entry.want(now, cost, config);
        let fetch = Fetch {
            hash,
            entry: entry.id,
            index,
            cost,
            want,
        };
        table.insert_unique(hash, entry, |e| e.hash);
        Step::Fetch(fetch)
    }

    fn counted_local(&self, l: &Local) {
        let c = &self.counters;
        c.local_decisions.fetch_add(1, Ordering::Relaxed);
        c.units_spent.fetch_add(l.units, Ordering::Relaxed);
    }

    /// After Redis answered a call with leased parts: installs the leases taken, puts local
    /// units back if the call was refused or failed, and folds the decisions.
    fn finish(
        &self,
        taken: Result<Taken, StoreError>,
        locals: SmallVec<[Local; 2]>,
        fetches: SmallVec<[Fetch; 2]>,
        alone: bool,
    ) -> Result<Decision, StoreError> {
        let taken = match taken {
            Ok(t) => t,
            Err(e) => {
                self.put_back(&locals);
                let ended = Ended::of(&e, alone);
                for f in &fetches {
                    self.install(f, None, 0, ended.clone());
                }
                return Err(e);
            }
        };
        let admitted = taken.decision.allowed();
        if !admitted {
            self.put_back(&locals);
        }
        let mut decisions: SmallVec<[(Decision, u64); 4]> = SmallVec::new();
        for l in &locals {
            if admitted {
                self.counted_local(l);
            }
            decisions.push((l.decision, l.units));
        }
        let mut answered: SmallVec<[usize; 2]> = SmallVec::new();
        for item in taken.items {
            let mut d = item.decision;
            if let Some(f) = fetches.iter().find(|f| f.index == item.index) {
                answered.push(f.index);
                let extra = item.granted.saturating_sub(f.cost);
                if admitted && extra > 0 {
                    // The request's own view: what is left besides its cost.
                    d = Decision::from_nanos(
                        true,
                        d.limit(),
                        d.remaining().saturating_add(extra).min(d.limit()),
                        u64::try_from(d.reset_after().as_nanos()).unwrap_or(u64::MAX),
                        0,
                    )
                    .with_index(d.index());
                }
                self.install(
                    f,
                    Some((&item, taken.sent, admitted)),
                    extra,
                    Ended::Answered,
                );
            }
            decisions.push((d, item.cost));
        }
        // A fetch without an answer (the deny cache answered) takes nothing.
        for f in fetches.iter().filter(|f| !answered.contains(&f.index)) {
            self.install(f, None, 0, Ended::Answered);
        }
        if !admitted {
            return Ok(taken.decision);
        }
        // In the order of the checks, folded as the other stores fold them.
        decisions.sort_by_key(|(d, _)| d.index());
        Ok(decisions
            .into_iter()
            .reduce(crate::decision::tighter)
            .map_or(taken.decision, |(d, _)| d))
    }

    /// Ends a fetch: installs `extra` units of `answer`'s lease (its item, when its call was
    /// sent, whether the call was admitted), or only clears the fetch when there is no answer.
    fn install(
        &self,
        f: &Fetch,
        answer: Option<(&TakenItem, u64, bool)>,
        extra: u64,
        ended: Ended,
    ) {
        if answer.is_some() && extra > 0 {
            // Taken out of Redis: spent, given back or dropped from here on.
            self.counters.leases.fetch_add(1, Ordering::Relaxed);
            self.counters
                .units_leased
                .fetch_add(extra, Ordering::Relaxed);
        }
        let mut table = self.shard(f.hash).lock();
        let entry = table.find_mut(f.hash, |e| e.id == f.entry);
        let Some(e) = entry else {
            drop(table);
            if let Some((item, _, _)) = answer {
                if let Some(ticket) = &item.ticket {
                    // The key is no longer tracked: give it all back.
                    self.returns.lock().push(Back {
                        id: 0,
                        ticket: ticket.clone(),
                        units: extra,
                    });
                }
            }
            return;
        };
        e.fetching = false;
        e.done.send_replace(ended);
        let Some((item, sent, admitted)) = answer else {
            return;
        };
        let d = item.decision;
        // A key admitted while another check of its stack was refused is not short, and its
        // answer counted a consumption that was refunded: it says nothing new.
        if admitted || !d.allowed() {
            e.as_of = Some(AsOf {
                remaining: d.remaining(),
                sent,
                reset_after: u64::try_from(d.reset_after().as_nanos()).unwrap_or(u64::MAX),
            });
            e.hold = e.shortage(&d, f.want, item.granted, &self.config);
            e.short_until = if e.hold > 0 {
                sent.saturating_add(e.hold)
            } else {
                0
            };
        }
        let Some(ticket) = item.ticket.clone() else {
            return;
        };
        // A window's count lands in a later window than the script's time only when the time
        // went backwards (an injected clock, a stepped Redis clock): then its reset is longer
        // than a window, and spending it now would admit in one window what another counted.
        let later_window = e.kind == Kind::Window && d.reset_after() > e.policy.window();
        if extra == 0 || later_window || self.closed.load(Ordering::Acquire) {
            // Under the shard's lock (shard, then returns, as everywhere): a flush that
            // locks this shard after the call ended finds the units in the returns.
            self.returns.lock().push(Back {
                id: 0,
                ticket,
                units: extra,
            });
            return;
        }
        let expires = match e.kind {
            Kind::Window => sent.saturating_add(e.as_of.map_or(0, |a| a.reset_after)),
            Kind::Bucket => sent.saturating_add(self.config.lifetime),
        };
        e.leases.push(Lease {
            id: self.ids.fetch_add(1, Ordering::Relaxed),
            units: extra,
            granted: extra,
            expires,
            ticket,
        });
    }

    /// Leases expired or emptied, for the next sweep to give back.
    fn publish(&self, returns: &mut Vec<Back>) {
        if !returns.is_empty() {
            self.returns.lock().append(returns);
        }
    }

    /// Puts units taken from leases back (their call was refused or failed).
    fn put_back(&self, locals: &[Local]) {
        self.put_back_with(locals, &mut Vec::new());
    }

    /// [`Shared::put_back`], looking for leases that left their entry in `unpublished` (not
    /// yet among the returns) first.
    fn put_back_with(&self, locals: &[Local], unpublished: &mut [Back]) {
        for l in locals {
            let mut table = self.shard(l.hash).lock();
            for &(id, units) in &l.parts {
                let lease = table
                    .find_mut(l.hash, |e| e.leases.iter().any(|x| x.id == id))
                    .and_then(|e| e.leases.iter_mut().find(|x| x.id == id));
                match lease {
                    Some(lease) => lease.units = lease.units.saturating_add(units),
                    None => {
                        // Its lease left the entry (spent to the last unit, or expired): if it
                        // has not gone back yet, the units go back with it.
                        if let Some(b) = unpublished.iter_mut().find(|b| b.id == id) {
                            b.units = b.units.saturating_add(units);
                            continue;
                        }
                        let mut returns = self.returns.lock();
                        match returns.iter_mut().find(|b| b.id == id) {
                            Some(b) => b.units = b.units.saturating_add(units),
                            None => {
                                self.counters
                                    .units_dropped
                                    .fetch_add(units, Ordering::Relaxed);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The leases to give back: expired ones and those of idle keys, or all with `all`.
    fn collect(&self, all: bool) -> Vec<Back> {
        let now = self.clock.now();
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let mut table = shard.lock();
            table.retain(|e| {
                let idle = now.saturating_sub(e.used_at) >= self.config.idle;
                if all || idle {
                    out.extend(e.leases.drain(..).map(Back::from));
                } else {
                    e.expire(now, &mut out);
                }
                // An entry with a call in flight stays, so that its lease finds it.
                e.fetching || !(all || idle)
            });
        }
        // Last: what a lease call that ended while the shards were read left here.
        out.append(&mut self.returns.lock());
        out
    }

    async fn give_back(&self, returns: Vec<Back>) -> Result<(), StoreError> {
        if returns.is_empty() {
            return Ok(());
        }
        let units: u64 = returns.iter().map(|b| b.units).sum();
        let r = self
            .redis
            .give_back(returns.into_iter().map(|b| (b.ticket, b.units)).collect())
            .await;
        let (failed, r) = match r {
            Ok(()) => (0, Ok(())),
            Err((failed, e)) => (failed.min(units), Err(e)),
        };
        let c = &self.counters;
        c.units_returned
            .fetch_add(units - failed, Ordering::Relaxed);
        c.units_dropped.fetch_add(failed, Ordering::Relaxed);
        r
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The last clone is gone: give back what the leases hold, in the background, if there
        // is still a runtime to do it on.
        let mut out = std::mem::take(&mut *self.returns.lock());
        for shard in self.shards.iter() {
            for e in shard.lock().iter_mut() {
                out.extend(e.leases.drain(..).map(Back::from));
            }
        }
        if out.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let redis = self.redis.clone();
            let out = out.into_iter().map(|b| (b.ticket, b.units)).collect();
            runtime.spawn(async move {
                let _ = redis.give_back(out).await;
            });
        }
    }
}

/// The future of a [`LeasedStore`] check: ready at once when leases answer it, the
/// [`RedisStore`]'s own future when no lease is involved, and otherwise a task that finishes
/// the leases' bookkeeping even if this future is dropped.
#[must_use = "futures do nothing unless polled"]
pub struct LeasedFuture {
    state: FutureState,
}

enum FutureState {
    Ready(Option<Result<Decision, StoreError>>),
    Redis(ResponseFuture),
    Spawned(tokio::task::JoinHandle<Result<Decision, StoreError>>),
    Boxed(Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send + 'static>>),
}

impl LeasedFuture {
    fn ready(r: Result<Decision, StoreError>) -> Self {
        Self {
            state: FutureState::Ready(Some(r)),
        }
    }

    fn redis(f: ResponseFuture) -> Self {
        Self {
            state: FutureState::Redis(f),
        }
    }

    fn spawned(h: tokio::task::JoinHandle<Result<Decision, StoreError>>) -> Self {
        Self {
            state: FutureState::Spawned(h),
        }
    }

    fn boxed(f: impl Future<Output = Result<Decision, StoreError>> + Send + 'static) -> Self {
        Self {
            state: FutureState::Boxed(Box::pin(f)),
        }
    }
}

impl Future for LeasedFuture {
    type Output = Result<Decision, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            FutureState::Ready(r) => match r.take() {
                Some(r) => Poll::Ready(r),
                None => Poll::Pending,
            },
            FutureState::Redis(f) => Pin::new(f).poll(cx),
            FutureState::Spawned(h) => Pin::new(h).poll(cx).map(|r| match r {
                Ok(r) => r,
                Err(e) => Err(StoreError::Backend(Box::new(e))),
            }),
            FutureState::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for LeasedFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            FutureState::Ready(_) => "ready",
            FutureState::Redis(_) => "redis",
            FutureState::Spawned(_) => "spawned",
            FutureState::Boxed(_) => "waiting",
        };
        f.debug_struct("LeasedFuture")
            .field("state", &state)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Rate;

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
    fn the_demand_sketch_counts_per_span_and_saturates() {
        let slot = AtomicU64::new(0);
        assert_eq!(sketch_add(&slot, 7, 3), 3);
        assert_eq!(sketch_add(&slot, 7, 4), 7);
        assert_eq!(sketch_add(&slot, 8, 1), 1, "a new span starts over");
        assert_eq!(sketch_add(&slot, 8, u64::MAX), SKETCH_COUNT_MAX);
    }
}
