//! The Redis store (feature `redis`): one limit shared by every instance of a service, on a
//! single Redis, Sentinel or Cluster, with the same decisions as the in-process store.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Policy, Rate, StoreError};
//! use tollgate::store::redis::RedisStore;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! // Every policy of the in-process store works here, up to the bounds of the Lua arithmetic.
//! assert!(RedisStore::supports(&Policy::gcra(Rate::per_second(100), 50)?).is_ok());
//! assert!(RedisStore::supports(&Policy::fixed_window(10, Duration::from_secs(365 * 86_400))?).is_err());
//!
//! // Nothing listens on port 1: connecting fails promptly, with a store error.
//! let err = RedisStore::builder().url("redis://127.0.0.1:1").connect().await.unwrap_err();
//! assert!(matches!(err, StoreError::Backend(_) | StoreError::Timeout(_)));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! With a server (this is `examples/redis_two_instances.rs` in short):
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use tollgate::{Check, Policy, Rate};
//! use tollgate::store::redis::RedisStore;
//!
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//! let per_user = Policy::token_bucket(Rate::per_second(5), 10)?;
//! let d = store.check("user:42", &per_user, 1).await?;
//! assert!(d.allowed());
//! # Ok(()) }
//! ```
//!
//! # How a check runs
//!
//! A check is one `EVALSHA`, one round trip. Each algorithm is a line-for-line mirror of
//! `src/algorithm/*.rs` in Lua (same names, same order of steps; the files are
//! `src/store/redis/*.lua`), and a call runs the script made of its algorithm (a stack mixing
//! algorithms, the script holding all six). The script decides every check of the call and
//! writes only if all admit, so a stacked check is all or nothing. Scripts are loaded when the
//! store connects; after a Redis restart or `SCRIPT FLUSH` the server answers `NOSCRIPT` and
//! the store sends the script itself (`EVAL`, which also caches it) in the same call. Redis
//! 6.2 or later is needed (scripts replicated by effects, `LPOP` with a count).
//!
//! Concurrent checks are pipelined over a pool of connections (by default 4; Nagle's
//! algorithm stays on so that pipelined commands share packets). No lock is held across an
//! await; the only locks are the optional deny cache's, held for a hash-map lookup.
//!
//! # Time
//!
//! The scripts read the time with Redis `TIME`, so every instance shares the Redis server's
//! clock and a skewed instance clock changes nothing. Fixed and sliding windows are aligned on
//! Unix time: window k is `[kW, (k+1)W)`.
//!
//! # Exact arithmetic in Lua
//!
//! Lua numbers are doubles, exact for integers below 2^53, and nanoseconds since the epoch
//! (~1.8e18) are not. So each Redis key stores a base second `b` and its times as nanosecond
//! offsets from `b`; the script reads `now` as `(sec - b) * 1e9 + nsec` and writes the state
//! back rebased on the current second. A state older than its policy's horizon (the window,
//! twice the window for the sliding window, `limit * interval` for the buckets) has fully
//! recovered and is read as fresh, so offsets never exceed about twice the horizon. Hence the
//! bounds checked by [`RedisStore::supports`]: the horizon at most [`MAX_HORIZON`] (about 39
//! days) and the limit at most [`MAX_LIMIT`] (2^52). The sliding window compares `prev * (W -
//! elapsed)` with multiples of `W`, products up to 2^105: the script computes
//! `floor(prev * (W - elapsed) / W)` exactly with 24-bit limbs, and every comparison of the
//! Rust code reduces to an integer comparison on it. Decisions are therefore identical to
//! [`MemoryStore`](crate::MemoryStore)'s, which the differential tests check on random traces.
//!
//! # Keys
//!
//! A key name is `{prefix}{tag}:{algorithm}:{fingerprint}:{key}`. The prefix is yours
//! (default `tollgate:`). The tag, the only braces in the name, is a digest of the part of the
//! key that picks the Cluster slot ([`KeySlots`]: by default the whole key, so every policy of
//! one key shares a slot). The algorithm part also names the layout of the state: the sliding
//! log's is `sl2` (times with running sums); the `sl` lists of older versions are never read
//! and expire by themselves, so during an upgrade old and new instances keep separate logs.
//! The fingerprint is a stable hash of the policy (algorithm, limit, period, name), so two
//! policies never share state. The user's key follows, with bytes outside printable ASCII and
//! `{ } % #` escaped as `%XX`, so no user text can pick a slot or step into another namespace;
//! when the escaped key is longer than 128 bytes it is replaced by `#` and its SHA-256. Every
//! key is written with its expiry (`PEXPIRE`) in the same script, set to when its state will
//! have fully recovered plus a slack (default 1 s): no key lives forever, and a rejection
//! writes nothing.
//!
//! # Stacked checks across Cluster slots
//!
//! When the keys of one `check_all` share a slot (always on a single node or Sentinel), it is
//! one atomic script. On a Cluster, keys in different slots cannot be in one script, so the
//! store runs the script once per slot, concurrently, each consuming only if all of its own
//! checks admit (consume), and if any slot rejected, runs a refund script on the slots that
//! consumed (refund). Between the two, a concurrent request may see the consumed cost and be
//! rejected: the protocol may briefly reject too much, it never admits too much. Refunds are
//! exact:
//!
//! - fixed window and sliding window: the cost is taken back out of the window it was counted
//!   in (in the sliding window, out of `prev` once that window has become the previous one);
//!   once it has aged out there is nothing to take back. The consuming script records the
//!   call's token and cost in that window's state, and the refund takes back only what it
//!   finds recorded there: a refund that comes twice, or after a failover lost the
//!   consumption, takes nothing back (it used to subtract its cost from whatever was
//!   counted, other requests' counts included);
//! - sliding log: the cost is taken out of the entry logged at that time. The log keeps a
//!   running sum beside each time, so the refund rewrites only the entries from that one to
//!   the newest (nearly always the newest alone), and a check finds the first live entry and
//!   the one that decides `retry_after` by bisection, in O(log n) reads whatever the length of
//!   the log (up to 2^20 entries) or the cost;
//! - token bucket, leaky bucket and GCRA: the consuming script records how much later the
//!   bucket's theoretical arrival time is because of this consumption (a pending refund, in
//!   the key's hash). Every admission on the key updates that amount (idle time can absorb part
//!   of it: it becomes `min(amount, backlog)`), and the refund moves the bucket back by what is
//!   left, as if the consumption had never happened. When several refunds of one key are
//!   pending at once, each refund recomputes the others from the least backlog seen since
//!   them; exact while the bucket stayed busy, and otherwise rounded towards giving back less
//!   (rejecting slightly more), never more. A call admitted on every slot settles its pending
//!   refunds (a fire-and-forget script call); a pending refund is kept at most 2 s, and at most
//!   the newest 256 per key: beyond that the oldest is forgotten, and its consumption, if a
//!   refund was still to come, stays (refunds come within a round trip, while the settles of
//!   admitted calls can lag behind a burst, so the oldest entry is the least likely to be
//!   needed).
//!
//! If a slot fails, the slots that consumed are refunded and the call returns the error; a
//! slot whose call got no answer (a timeout, a connection lost under it) may have run it, or
//! may still run it (a paused server), so the refund of its tokens follows it on the same
//! connection, where it runs after the call if the call ran and takes nothing otherwise. A
//! call across slots runs in a task of its own, and its timeout ends the wait, not the call:
//! its refunds still run, and a call admitted everywhere after its caller stopped waiting is
//! taken back. Only one admitted in the instant between that check and its answer leaves its
//! cost consumed (an over-rejection).
//!
//! # Hot keys: leased quota
//!
//! A key that one instance checks thousands of times per second (a global limit, a big
//! tenant) can be decided in process from a lease of its quota, taken out of Redis in one
//! call and given back unspent through the refund path above: wrap the store in a
//! [`LeasedStore`], whose docs state the lease policy and the exact bounds it keeps. Its lease
//! calls run `take.lua` (check.lua that may consume more than the cost, as much as fits), and
//! a bucket's refund there takes back only the lease's unspent part.
//!
//! # Failures
//!
//! Every call has a timeout (default 250 ms): an unreachable Redis gives
//! [`StoreError::Timeout`] or [`StoreError::Backend`] promptly, never a rejection. The
//! connections reconnect by themselves (backoff from 50 ms to 1 s), so the store recovers
//! within a second or two of Redis coming back, without being rebuilt. On a Cluster each
//! master's pool does, whatever its first contact (a master down when the store connects, or
//! where a `MOVED` points, is reached once it is up); `connect` needs only the masters that
//! answer ([`RedisStoreBuilder::wait_for_redis`]), and a master down fails only its own keys. What to do meanwhile
//! (fail open, closed or to a local store) and the circuit breaker are the business of
//! [`ResilientStore`](crate::store::ResilientStore), which wraps any store.
//!
//! # Memory: which `maxmemory-policy`
//!
//! Every key tollgate writes has a TTL, so its keys free themselves once their state has
//! recovered; what a full Redis does to them depends on its `maxmemory-policy`, which is one
//! setting for the whole server:
//!
//! - **`noeviction` is the one that keeps quotas.** Redis never forgets a counter; once
//!   `used_memory` passes `maxmemory`, Redis refuses a script whose first write is one that
//!   can grow memory (`HSET`, `RPUSH`: the first write of every admission, but for a sliding
//!   log that drops expired entries first) with an `OOM command not allowed` error, and the
//!   check returns [`StoreError::Backend`]: the request goes to your failure policy
//!   ([`ResilientStore`](crate::store::ResilientStore)), not to a decision. An exhausted key
//!   stays refused (a refusal writes nothing, so Redis still answers it). Fail closed (or to a
//!   local store) if a full Redis must not open limits; failing open admits every new key
//!   while Redis is full. Size `maxmemory` for your live keys (a few hundred bytes each) and
//!   watch for the errors. (Until this release the sliding log's first write to a new key was
//!   a `DEL`, after which Redis lets a script write past `maxmemory`: a flood grew a 2 MB
//!   Redis to 10 MB.)
//! - **Every evicting policy can buy a quota back.** `volatile-ttl` evicts the keys that
//!   expire soonest: an exhausted key written before a flood of new keys of the same policy
//!   goes first. `volatile-lru`, `volatile-lfu` and `volatile-random` choose among keys with a
//!   TTL, which is all of tollgate's; `allkeys-lru`, `allkeys-lfu` and `allkeys-random` among
//!   every key. Whichever key is evicted is read as fresh by the next check, which is admitted
//!   with the whole limit: a flood of new keys (one request each) can make Redis forget an
//!   exhausted key, and Redis reports no error. Under these policies give tollgate a Redis of
//!   its own (a cache that needs `allkeys-lru` should not share one with limits), large
//!   enough never to evict (`evicted_keys` in `INFO stats` stays 0).
//!
//! `tests/redis_memory.rs` shows both on servers of 2 MB: under `noeviction` a flood gets OOM
//! errors in every algorithm and the exhausted key stays refused; under `volatile-ttl` and
//! `allkeys-lru` the flood is admitted throughout and the exhausted key comes back with its
//! whole limit. (The in-process [`MemoryStore`](crate::MemoryStore) chooses what to forget by
//! what forgetting gives away; Redis cannot be told to.)
//!
//! # Deny cache
//!
//! Optionally ([`RedisStoreBuilder::deny_cache`]), a rejection is remembered locally: the same
//! key, policy and an equal or larger cost is answered here, without Redis, until the time the
//! rejection said to retry (counted from when the call was sent, so never later than Redis
//! would admit it), and for at most [`RedisStoreBuilder::deny_cache_max_age`] (default 1 s).
//! A flood of rejected requests then costs Redis one call per key and second. The local
//! answer's `remaining` is the one Redis gave and its `retry_after` the true remaining wait; a
//! refund elsewhere can make Redis admit slightly earlier than the cache says (an
//! over-rejection, bounded by the maximum age, never an over-admission). Local answers are
//! marked [`Decision::without_backend`], so a breaker does not take them for a healthy Redis.

mod builder;
mod check;
mod cluster;
mod cross_slot;
mod deny;
mod future;
pub(crate) mod keys;
mod lease;
mod leased;
mod partition;
mod refund;
mod scripts;
mod take;

pub use builder::RedisStoreBuilder;
pub use future::ResponseFuture;
pub use keys::KeySlots;
pub(crate) use lease::LeaseOp;
pub use leased::{
    DEFAULT_BUCKET_LIFETIME, DEFAULT_HOT_THRESHOLD, DEFAULT_IDLE_AFTER, DEFAULT_LEASE_SPAN,
    DEFAULT_MAX_HOT_KEYS, DEFAULT_MAX_SHARE_PERCENT, LeaseStats, LeasedFuture, LeasedStore,
    LeasedStoreBuilder, MAX_LEASED_KEY_LEN,
};
pub(crate) use take::{TakeFuture, Taken, TakenItem, Wanted};

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use fred::bytes_utils::Str;
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::ClientLike;
use fred::types::Key;
use smallvec::SmallVec;

use self::deny::DenyCache;
use self::keys::KeyNames;
use self::scripts::{Backend, Scripts, algorithm_slot};
use super::{Check, NOTHING_TO_CHECK, Store, StoreError};
use crate::clock::Clock;
use crate::{Algorithm, Decision, Policy};

/// The longest horizon a policy may have on Redis: `3 * 2^50` ns, about 39 days. The horizon
/// is the window (fixed window, sliding log), twice the window (sliding window) or `limit *
/// interval` (token bucket, leaky bucket, GCRA). Below it every number in the scripts stays an
/// exact integer.
pub const MAX_HORIZON: Duration = Duration::from_nanos(3 << 50);

/// The largest limit (or burst) a policy may have on Redis: 2^52.
pub const MAX_LIMIT: u64 = 1 << 52;

/// The default per-call timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

/// The default number of pooled connections.
pub const DEFAULT_POOL_SIZE: usize = 4;

/// The default bound on calls across slots in flight at once (see
/// [`RedisStoreBuilder::max_cross_slot_calls`]).
pub const DEFAULT_MAX_CROSS_SLOT_CALLS: usize = 4096;

/// The default longest key, in bytes (longer escaped keys are hashed; this bounds the work).
pub const DEFAULT_MAX_KEY_LEN: usize = 64 * 1024;

/// Limiter state on Redis, shared by every instance that connects to the same server.
///
/// Cloning is cheap and clones share the connections. See the [module docs](self) for how
/// checks run, the key layout, the precision of the arithmetic and the cross-slot protocol.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Backend,
    clustered: bool,
    names: KeyNames,
    max_key_len: usize,
    timeout: Duration,
    slack_arg: Str,
    injected: Option<Arc<dyn Clock>>,
    local: Arc<dyn Clock>,
    deny: Option<DenyCache>,
    deny_hasher: foldhash::fast::RandomState,
    scripts: Scripts,
    instance: u64,
    tokens: AtomicU64,
    /// One permit per call across slots in flight (each runs in a task of its own).
    cross_slot: Arc<tokio::sync::Semaphore>,
    max_cross_slot: usize,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last clone is gone: close the connections (and stop reconnecting) in the
        // background, if there is still a runtime to do it on.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let pools = self.backend.pools();
            runtime.spawn(async move {
                for pool in pools {
                    let _ = pool.quit().await;
                }
            });
        }
    }
}

/// A policy the Redis store cannot run exactly (see [`RedisStore::supports`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnsupportedPolicy {
    /// Which check of the call (0 from [`RedisStore::supports`]).
    pub index: usize,
    /// What is too large.
    pub what: &'static str,
    /// Its value (nanoseconds for a horizon).
    pub value: u128,
    /// The most the Redis store accepts.
    pub max: u128,
}

impl fmt::Display for UnsupportedPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the Redis store runs a {} of at most {}, and this one is {}",
            self.what, self.max, self.value
        )
    }
}

impl std::error::Error for UnsupportedPolicy {}

/// An error reported by Redis or by the connection to it (inside [`StoreError::Backend`]).
#[derive(Clone, Debug)]
pub struct RedisError {
    message: String,
}

impl RedisError {
    /// What went wrong, as the client reported it.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for RedisError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "redis: {}", self.message)
    }
}

impl std::error::Error for RedisError {}

fn backend_error(e: &FredError, timeout: Duration) -> StoreError {
    if *e.kind() == ErrorKind::Timeout {
        StoreError::Timeout(timeout)
    } else {
        StoreError::Backend(Box::new(RedisError {
            message: format!("{:?}: {}", e.kind(), e.details()),
        }))
    }
}

fn horizon(policy: &Policy) -> u128 {
    let (limit, period) = (
        u128::from(policy.limit()),
        u128::from(policy.period_nanos()),
    );
    match policy.algorithm() {
        Algorithm::FixedWindow | Algorithm::SlidingLog => period,
        Algorithm::SlidingWindow => 2 * period,
        _ => limit * period,
    }
}

impl RedisStore {
    /// Connects to the Redis at `url` with the default configuration: `redis://host:port/db`,
    /// `redis-cluster://host:port?node=host2:port2` or
    /// `redis-sentinel://host:port?sentinelServiceName=name`, with `user:password@` as usual.
    pub async fn connect(url: &str) -> Result<RedisStore, StoreError> {
        Self::builder().url(url).connect().await
    }

    /// A builder for the key prefix, pool size, timeouts, deny cache and Cluster or Sentinel
    /// configuration.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder::default()
    }

    /// Whether the Redis store runs `policy` exactly: its limit at most [`MAX_LIMIT`] and its
    /// horizon at most [`MAX_HORIZON`]. A check with an unsupported policy fails with
    /// [`StoreError::Unsupported`]; call this when you build your policies to find out at
    /// start-up.
    pub fn supports(policy: &Policy) -> Result<(), UnsupportedPolicy> {
        supports(policy, 0)
    }

    /// Checks one request of `cost` against `policy` for `key`.
    pub fn check(&self, key: &str, policy: &Policy, cost: u64) -> ResponseFuture {
        self.check_all(&[Check::new(key, policy, cost)])
    }

    /// Checks a stack of limits all or nothing, and returns the most restrictive decision.
    pub fn check_all(&self, checks: &[Check<'_>]) -> ResponseFuture {
        match self.inner.prepare(checks) {
            Err(e) => ResponseFuture::ready(Err(e)),
            Ok(Prepared::Done(d)) => ResponseFuture::ready(Ok(d)),
            Ok(Prepared::Ask(call)) => {
                let inner = Arc::clone(&self.inner);
                ResponseFuture::boxed(async move { inner.run(call).await })
            }
        }
    }

    /// The Redis key name under which `key`'s state for `policy` is kept, for a check made
    /// with [`Check::new`] (placed by the whole key). A [`Limiter`](crate::limiter::Limiter)'s
    /// checks are placed by the key before `@rule` (see [`Check::placed_by`]): under
    /// [`KeySlots::UntilDelimiter`] their names come from [`RedisStore::placed_key_name`].
    pub fn key_name(&self, key: &str, policy: &Policy) -> String {
        self.inner.names.name(key, policy)
    }

    /// The Redis key name of a check whose first `placed_by` bytes place it
    /// ([`Check::placed_by`]).
    pub fn placed_key_name(&self, key: &str, placed_by: usize, policy: &Policy) -> String {
        let check = Check::new(key, policy, 0).placed_by(placed_by);
        self.inner.names.placed_name(key, check.placement(), policy)
    }

    /// How many calls across slots are in flight now (see
    /// [`RedisStoreBuilder::max_cross_slot_calls`]).
    pub fn cross_slot_calls(&self) -> usize {
        self.inner.max_cross_slot - self.inner.cross_slot.available_permits()
    }

    /// How many rejections the deny cache holds (0 without a deny cache).
    pub fn deny_cache_len(&self) -> usize {
        self.inner.deny.as_ref().map_or(0, DenyCache::len)
    }

    /// The SHA-1 of the script that a check of `algorithm` runs, as `EVALSHA` takes it (to
    /// benchmark the script alone with `redis-benchmark`, say). Its arguments are described at
    /// the top of `src/store/redis/check.lua`.
    pub fn check_script_sha(&self, algorithm: Algorithm) -> &str {
        &self.inner.scripts.single[algorithm_slot(algorithm.as_str())].sha
    }

    /// Whether the store talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner.clustered
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.names.prefix)
            .field("slots", &self.inner.names.slots)
            .field("cluster", &self.inner.clustered)
            .field("pool_size", &self.inner.backend.pool_size())
            .field("timeout", &self.inner.timeout)
            .field("deny_cache", &self.inner.deny.is_some())
            .finish_non_exhaustive()
    }
}

impl Store for RedisStore {
    type Future = ResponseFuture;

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        RedisStore::check_all(self, checks)
    }

    fn check(&self, key: &str, policy: &Policy, cost: u64) -> Self::Future {
        RedisStore::check(self, key, policy, cost)
    }
    fn max_key_len(&self) -> Option<usize> {
        Some(self.inner.max_key_len)
    }

    /// On a Cluster, the master that holds the check's key (see [`Store::partition`]).
    fn partition(&self, check: &Check<'_>) -> Option<u32> {
        self.master_of(check)
    }
}

pub(crate) fn supports(policy: &Policy, index: usize) -> Result<(), UnsupportedPolicy> {
    if policy.limit() > MAX_LIMIT {
        return Err(UnsupportedPolicy {
            index,
            what: "limit",
            value: u128::from(policy.limit()),
            max: u128::from(MAX_LIMIT),
        });
    }
    let h = horizon(policy);
    if h > MAX_HORIZON.as_nanos() {
        return Err(UnsupportedPolicy {
            index,
            what: "horizon (ns)",
            value: h,
            max: MAX_HORIZON.as_nanos(),
        });
    }
    Ok(())
}

/// One check, owned, ready for the script.
struct Item {
    key: Key,
    slot: u16,
    algorithm: &'static str,
    limit: u64,
    period: u64,
    cost: u64,
    /// What to consume if there is room for it (a quota lease, see `leased.rs`); the cost
    /// otherwise.
    want: u64,
    horizon: u64,
    index: usize,
    deny_hash: u64,
}

impl Item {
    /// Whether the item asks for more than its cost (a quota lease).
    fn leasing(&self) -> bool {
        self.want > self.cost
    }
}

struct Call {
    items: SmallVec<[Item; 4]>,
    /// Injected time as (seconds, nanoseconds), or None for Redis TIME.
    time: Option<(u64, u64)>,
    sent: u64,
    /// Whether the call runs take.lua (some item may lease) rather than check.lua.
    take: bool,
    /// A lease-taking call's count of units Redis may hold for it without its caller
    /// knowing (see [`LeaseStats::units_in_doubt`]).
    in_doubt: Option<Arc<AtomicU64>>,
}

enum Prepared {
    Done(Decision),
    Ask(Box<Call>),
}

/// One script call's worth of items (one hash slot).
struct Group<'a> {
    items: SmallVec<[&'a Item; 4]>,
    tokens: SmallVec<[String; 4]>,
}

/// What one check's script answered: its decision, where its admitted cost went (`ref_b`,
/// `ref_t`) and how much it consumed (the cost, or a lease's size).
#[derive(Clone, Copy)]
struct Answered {
    decision: Decision,
    ref_b: i64,
    ref_t: i64,
    granted: u64,
}

/// What a slot's script answered: whether all its checks were admitted, and each one's answer.
struct Answer {
    admitted: bool,
    decisions: SmallVec<[Answered; 4]>,
}

/// How to give back the unspent part of a quota lease through refund.lua.
#[derive(Clone, Debug)]
pub(crate) struct Ticket {
    key: Key,
    algorithm: &'static str,
    limit: u64,
    period: u64,
    horizon: u64,
    token: String,
    ref_b: i64,
    ref_t: i64,
}

impl Ticket {
    /// Whether giving back nothing still needs a call (a bucket forgets its pending refund).
    pub(crate) fn needs_settling(&self) -> bool {
        !self.token.is_empty()
    }
}
