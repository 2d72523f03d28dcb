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
//! If a slot fails, the slots that consumed are refunded and the call returns the error. A call
//! across slots runs in a task of its own, and its timeout ends the wait, not the call: its
//! refunds still run, and a call admitted everywhere after its caller stopped waiting is
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
//! within a second or two of Redis coming back, without being rebuilt. What to do meanwhile
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

mod cluster;
mod deny;
pub(crate) mod keys;
mod leased;
mod partition;

pub use keys::KeySlots;
pub use leased::{
    DEFAULT_BUCKET_LIFETIME, DEFAULT_HOT_THRESHOLD, DEFAULT_IDLE_AFTER, DEFAULT_LEASE_SPAN,
    DEFAULT_MAX_HOT_KEYS, DEFAULT_MAX_SHARE_PERCENT, LeaseStats, LeasedFuture, LeasedStore,
    LeasedStoreBuilder, MAX_LEASED_KEY_LEN,
};

use std::fmt;
use std::fmt::Write as _;
use std::future::Future;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use fred::bytes::Bytes;
use fred::bytes_utils::Str;
use fred::clients::{Client, Pool};
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::{ClientLike, LuaInterface};
use fred::types::config::{Config, ReconnectPolicy, ServerConfig};
use fred::types::scripts::Script;
use fred::types::{Builder, Key, MultipleKeys, Value};
use smallvec::SmallVec;

use self::deny::DenyCache;
use self::keys::KeyNames;
use super::{Check, NOTHING_TO_CHECK, Store, StoreError};
use crate::clock::{Clock, SystemClock};
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

/// The check script for calls whose checks all run one algorithm: only that algorithm's code,
/// so that each call defines as few Lua functions as it can.
macro_rules! check_script {
    ($($file:literal),*) => {
        concat!(include_str!("common.lua"), $(include_str!($file),)* include_str!("check.lua"))
    };
}

const GCRA_LUA: &str = check_script!("gcra.lua");
const TOKEN_BUCKET_LUA: &str = check_script!("token_bucket.lua");
const LEAKY_BUCKET_LUA: &str = check_script!("leaky_bucket.lua");
const FIXED_WINDOW_LUA: &str = check_script!("arith.lua", "fixed_window.lua");
const SLIDING_WINDOW_LUA: &str = check_script!("arith.lua", "sliding_window.lua");
const SLIDING_LOG_LUA: &str = check_script!("sliding_log.lua");
/// Every algorithm, for stacked checks that mix them.
const MIXED_LUA: &str = check_script!(
    "arith.lua",
    "gcra.lua",
    "token_bucket.lua",
    "leaky_bucket.lua",
    "fixed_window.lua",
    "sliding_window.lua",
    "sliding_log.lua"
);

const REFUND_LUA: &str = concat!(
    include_str!("common.lua"),
    include_str!("gcra.lua"),
    include_str!("token_bucket.lua"),
    include_str!("leaky_bucket.lua"),
    include_str!("fixed_window.lua"),
    include_str!("sliding_window.lua"),
    include_str!("sliding_log.lua"),
    include_str!("refund.lua"),
);

const LEASE_LUA: &str = concat!(include_str!("common.lua"), include_str!("lease.lua"));

/// check.lua's sibling for calls that take quota leases (see [`LeasedStore`]).
const TAKE_LUA: &str = concat!(
    include_str!("common.lua"),
    include_str!("arith.lua"),
    include_str!("gcra.lua"),
    include_str!("token_bucket.lua"),
    include_str!("leaky_bucket.lua"),
    include_str!("fixed_window.lua"),
    include_str!("sliding_window.lua"),
    include_str!("sliding_log.lua"),
    include_str!("take.lua"),
);

/// A script and its SHA-1.
#[derive(Clone, Debug)]
struct Lua {
    text: &'static str,
    sha: String,
}

impl Lua {
    fn new(text: &'static str) -> Self {
        Self {
            text,
            sha: Script::from_lua(text).sha1().to_string(),
        }
    }
}

/// Every script the store runs.
#[derive(Debug)]
struct Scripts {
    /// Indexed by [`algorithm_slot`].
    single: [Lua; 6],
    mixed: Lua,
    refund: Lua,
    lease: Lua,
    take: Lua,
}

impl Scripts {
    fn new() -> Self {
        Self {
            single: [
                Lua::new(FIXED_WINDOW_LUA),
                Lua::new(SLIDING_LOG_LUA),
                Lua::new(SLIDING_WINDOW_LUA),
                Lua::new(TOKEN_BUCKET_LUA),
                Lua::new(LEAKY_BUCKET_LUA),
                Lua::new(GCRA_LUA),
            ],
            mixed: Lua::new(MIXED_LUA),
            refund: Lua::new(REFUND_LUA),
            lease: Lua::new(LEASE_LUA),
            take: Lua::new(TAKE_LUA),
        }
    }

    fn all(&self) -> impl Iterator<Item = &Lua> {
        self.single
            .iter()
            .chain([&self.mixed, &self.refund, &self.lease, &self.take])
    }

    /// The script for a call on these items.
    fn check(&self, items: &[&Item]) -> &Lua {
        match items.split_first() {
            Some((first, rest)) if rest.iter().all(|it| it.algorithm == first.algorithm) => {
                &self.single[algorithm_slot(first.algorithm)]
            }
            _ => &self.mixed,
        }
    }
}

fn algorithm_slot(name: &str) -> usize {
    match name {
        "fixed_window" => 0,
        "sliding_log" => 1,
        "sliding_window" => 2,
        "token_bucket" => 3,
        "leaky_bucket" => 4,
        _ => 5,
    }
}

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

/// Quota leases (see [`LeasedStore`]): calls that consume more than their cost, and the refund
/// of what a lease did not spend.
impl RedisStore {
    /// The clock this store times its calls with (the injected one in tests).
    pub(crate) fn local_clock(&self) -> &Arc<dyn Clock> {
        &self.inner.local
    }

    /// Decides `wanted` all or nothing, as [`RedisStore::check_all`] decides their checks,
    /// consuming for each up to its `want` where there is room for more than its cost (see
    /// take.lua). The future owns what it needs.
    pub(crate) fn take(&self, wanted: &[Wanted<'_>]) -> TakeFuture {
        match self.inner.prepare_wanted(wanted.iter().copied(), true) {
            Err(e) => Box::pin(std::future::ready(Err(e))),
            Ok(Prepared::Done(decision)) => {
                let sent = self.inner.local.now();
                Box::pin(std::future::ready(Ok(Taken {
                    decision,
                    sent,
                    items: SmallVec::new(),
                })))
            }
            Ok(Prepared::Ask(call)) => {
                let inner = Arc::clone(&self.inner);
                let first_slot = call.items[0].slot;
                if call.items.iter().all(|it| it.slot == first_slot) {
                    return Box::pin(async move { inner.take(&call, &|| false).await });
                }
                // Across slots: the call runs in a task of its own, so that a timeout stops
                // the wait, not the call. Its refunds still run when a slot fails, and what
                // it took after its caller stopped waiting goes back (a lease's `want` can be
                // a tenth of the limit: cut off between consuming and refunding, it would
                // stay consumed).
                Box::pin(async move {
                    let permit = inner.cross_slot_permit()?;
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    let worker = RedisStore {
                        inner: Arc::clone(&inner),
                    };
                    tokio::spawn(async move {
                        let _permit = permit;
                        let r = worker.inner.take(&call, &|| tx.is_closed()).await;
                        if let Err(Ok(taken)) = tx.send(r) {
                            // The caller stopped waiting in the last instant: its leases'
                            // units go back (the other checks' stay consumed).
                            let back: Vec<(Ticket, u64)> = taken
                                .items
                                .into_iter()
                                .filter_map(|it| Some((it.ticket?, it.granted)))
                                .collect();
                            let _ = worker.give_back(back).await;
                        }
                    });
                    answer_within(inner.timeout, rx).await
                })
            }
        }
    }

    /// Gives back `unspent` units of each lease (0: a bucket only forgets its pending refund),
    /// one refund.lua call per key, all at once. On failure: the units of the keys whose call
    /// failed, and the first error.
    pub(crate) async fn give_back(
        &self,
        leases: Vec<(Ticket, u64)>,
    ) -> Result<(), (u64, StoreError)> {
        let inner = &self.inner;
        // Grouped by key in a map: a sweep can return thousands of leases at once.
        let mut by_key: std::collections::HashMap<Key, Vec<(Ticket, u64)>> =
            std::collections::HashMap::new();
        for (ticket, unspent) in leases {
            if unspent == 0 && !ticket.needs_settling() {
                continue;
            }
            by_key
                .entry(ticket.key.clone())
                .or_default()
                .push((ticket, unspent));
        }
        let calls = by_key.into_values().map(|group| async move {
            let build = || inner.refund_args(inner.now_args(), group.iter().cloned(), "refund");
            let units: u64 = group.iter().map(|(_, u)| *u).sum();
            eval::<Value>(&inner.backend, &inner.scripts.refund, build)
                .await
                .map_err(|e| (units, backend_error(&e, inner.timeout)))
        });
        let mut failed: Option<(u64, StoreError)> = None;
        for r in futures_util::future::join_all(calls).await {
            if let Err((units, e)) = r {
                failed = Some(match failed {
                    None => (units, e),
                    Some((n, first)) => (n.saturating_add(units), first),
                });
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

/// The answer of a call that runs in a task of its own, if it comes within `timeout`. Past
/// it, the channel is closed first: an answer sent in the same instant is taken rather than
/// dropped unseen, and any later one fails to send, so the task knows nobody took it (and
/// gives back what it consumed).
async fn answer_within<T>(
    timeout: Duration,
    mut rx: tokio::sync::oneshot::Receiver<Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(timeout, &mut rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(StoreError::Backend(
            "the call's task ended without an answer".into(),
        )),
        Err(_) => {
            rx.close();
            rx.try_recv().unwrap_or(Err(StoreError::Timeout(timeout)))
        }
    }
}

/// The future of [`RedisStore::take`].
pub(crate) type TakeFuture =
    Pin<Box<dyn Future<Output = Result<Taken, StoreError>> + Send + 'static>>;

/// What to do with a lease of a concurrency limit (see `lease.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LeaseOp {
    /// Take a lease if fewer than `max` are live.
    Acquire { max: u32 },
    /// Move a live lease's deadline.
    Renew,
    /// Put a lost lease back (its request still runs).
    Restore,
    /// Give the lease back.
    Release,
}

/// The leases of concurrency limits: places in flight that several instances share, each
/// with a deadline so that an instance that crashes leaks nothing beyond one lease time.
impl RedisStore {
    /// The Redis key of the leases of `key`, whose first `placed_by` bytes place it.
    pub(crate) fn lease_key(&self, key: &str, placed_by: usize) -> Key {
        let placement = key.get(..placed_by).unwrap_or(key);
        Key::from(self.inner.names.lease_name(key, placement))
    }

    /// A lease id no other lease of any instance has.
    pub(crate) fn new_lease_id(&self) -> Str {
        Str::from(format!(
            "{:x}.{:x}",
            self.inner.instance,
            self.inner.tokens.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// One of the pooled connections to the node that holds `key`: calls made on it run in
    /// the order they were made (an acquire, then the release that undoes it).
    pub(crate) fn connection(&self, key: &Key) -> Client {
        self.inner.backend.pool_for(key).next().clone()
    }

    /// The per-call timeout.
    pub(crate) fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Runs `op` on lease `id` of the leases at `key`, each lasting `lease` from now, on
    /// `connection` (or any): whether it did (took, renewed, released), and how many leases
    /// are live.
    pub(crate) async fn lease(
        &self,
        connection: Option<&Client>,
        key: &Key,
        id: &Str,
        op: LeaseOp,
        lease: Duration,
    ) -> Result<(bool, u64), StoreError> {
        let inner = &self.inner;
        let (name, max) = match op {
            LeaseOp::Acquire { max } => ("acquire", max),
            LeaseOp::Renew => ("renew", 0),
            LeaseOp::Restore => ("restore", 0),
            LeaseOp::Release => ("release", 0),
        };
        let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1);
        let build = || {
            let mut args: Vec<Value> = Vec::with_capacity(7);
            args.extend(inner.now_args());
            args.push(static_str(name));
            args.push(Value::String(id.clone()));
            args.push(Value::from(max.to_string()));
            args.push(Value::from(lease_ms.to_string()));
            (vec![key.clone()], args)
        };
        let out = match connection {
            Some(client) => eval_on::<Vec<i64>, _>(client, &inner.scripts.lease, build).await,
            None => eval::<Vec<i64>>(&inner.backend, &inner.scripts.lease, build).await,
        }
        .map_err(|e| backend_error(&e, inner.timeout))?;
        match out[..] {
            [ok, live] => Ok((ok == 1, u64::try_from(live).unwrap_or(0))),
            _ => Err(StoreError::Backend(Box::new(RedisError {
                message: format!("unexpected lease answer of {} values", out.len()),
            }))),
        }
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

/// The future of a Redis check: ready at once for an invalid call or a deny-cache hit, boxed
/// otherwise.
#[must_use = "futures do nothing unless polled"]
pub struct ResponseFuture {
    state: FutureState,
}

type BoxFuture = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send + 'static>>;

enum FutureState {
    Ready(Option<Result<Decision, StoreError>>),
    Boxed(BoxFuture),
}

impl ResponseFuture {
    fn ready(r: Result<Decision, StoreError>) -> Self {
        Self {
            state: FutureState::Ready(Some(r)),
        }
    }

    fn boxed(f: impl Future<Output = Result<Decision, StoreError>> + Send + 'static) -> Self {
        Self {
            state: FutureState::Boxed(Box::pin(f)),
        }
    }
}

impl Future for ResponseFuture {
    type Output = Result<Decision, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            FutureState::Ready(r) => match r.take() {
                Some(r) => Poll::Ready(r),
                None => Poll::Pending,
            },
            FutureState::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            FutureState::Ready(_) => "ready",
            FutureState::Boxed(_) => "pending",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
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

/// One check of a call that may take a quota lease: the check, its index in the caller's
/// stack, and how much to consume if there is room (at least its cost; more to take a lease).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Wanted<'a> {
    pub(crate) check: Check<'a>,
    pub(crate) index: usize,
    pub(crate) want: u64,
}

/// What a lease-taking call answered.
#[derive(Debug)]
pub(crate) struct Taken {
    /// The verdict, as [`RedisStore::check_all`] would have answered it.
    pub(crate) decision: Decision,
    /// The local time at which the call was sent: the script ran no earlier.
    pub(crate) sent: u64,
    /// Each check's own answer, in the order asked (none when the deny cache answered).
    pub(crate) items: SmallVec<[TakenItem; 4]>,
}

/// One check's answer in a [`Taken`].
#[derive(Debug)]
pub(crate) struct TakenItem {
    pub(crate) index: usize,
    /// The check's cost.
    pub(crate) cost: u64,
    /// Its decision, for what it consumed (`granted` when admitted).
    pub(crate) decision: Decision,
    /// What it consumed: 0 unless the whole call was admitted.
    pub(crate) granted: u64,
    /// How to give back what a lease does not spend (a lease item that consumed something).
    pub(crate) ticket: Option<Ticket>,
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

impl Inner {
    fn prepare(&self, checks: &[Check<'_>]) -> Result<Prepared, StoreError> {
        self.prepare_wanted(
            checks.iter().enumerate().map(|(index, check)| Wanted {
                check: *check,
                index,
                want: check.cost(),
            }),
            false,
        )
    }

    fn prepare_wanted<'c>(
        &self,
        checks: impl ExactSizeIterator<Item = Wanted<'c>>,
        take: bool,
    ) -> Result<Prepared, StoreError> {
        if checks.len() == 0 {
            return Ok(Prepared::Done(NOTHING_TO_CHECK.without_backend()));
        }
        let mut merged: SmallVec<[(Check<'_>, usize, u64); 4]> = SmallVec::new();
        for Wanted { check, index, want } in checks {
            check.validate(index, self.max_key_len)?;
            supports(check.policy(), index).map_err(|e| StoreError::Unsupported {
                index,
                reason: e.to_string(),
            })?;
            // The same (key, policy) twice in one stack is one check of the summed cost.
            match merged
                .iter_mut()
                .find(|(c, _, _)| c.policy().id() == check.policy().id() && c.key() == check.key())
            {
                Some((c, _, w)) => {
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
                    *w = w.saturating_add(want);
                }
                None => merged.push((check, index, want)),
            }
        }
        let local_now = self.local.now();
        let mut items = SmallVec::new();
        for (check, index, want) in merged {
            let key = self
                .names
                .placed_name(check.key(), check.placement(), check.policy());
            let deny_hash = match &self.deny {
                Some(_) => self.deny_hasher.hash_one(&key),
                None => 0,
            };
            if let Some(deny) = &self.deny {
                if let Some(d) = deny.get(deny_hash, check.cost(), local_now) {
                    return Ok(Prepared::Done(d.with_index(index)));
                }
            }
            let policy = check.policy();
            items.push(Item {
                slot: if self.clustered {
                    fred::util::redis_keyslot(key.as_bytes())
                } else {
                    0
                },
                key: Key::from(key),
                algorithm: policy.algorithm().as_str(),
                limit: policy.limit(),
                period: policy.period_nanos(),
                cost: check.cost(),
                want: want.clamp(check.cost(), policy.limit()),
                // Bounded by MAX_HORIZON, checked above.
                horizon: u64::try_from(horizon(policy)).unwrap_or(u64::MAX),
                index,
                deny_hash,
            });
        }
        let time = self.injected.as_ref().map(|c| {
            let now = c.now();
            (now / 1_000_000_000, now % 1_000_000_000)
        });
        Ok(Prepared::Ask(Box::new(Call {
            items,
            time,
            sent: local_now,
            take,
        })))
    }

    async fn run(self: Arc<Self>, call: Box<Call>) -> Result<Decision, StoreError> {
        let first_slot = call.items[0].slot;
        if call.items.iter().all(|it| it.slot == first_slot) {
            // One command: the client's own command timeout (set to ours) bounds it, and
            // drops the command if it is still queued (while reconnecting, say).
            return self.decide(&call).await;
        }
        // Across slots: the call runs in a task of its own, so that a timeout stops the wait,
        // not the call: its refunds still run when a slot fails, and if it was admitted after
        // its caller stopped waiting, what it consumed goes back.
        let permit = self.cross_slot_permit()?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let inner = Arc::clone(&self);
        tokio::spawn(async move {
            let _permit = permit;
            let r = async {
                let answers = inner.answers(&call, &|| tx.is_closed()).await?;
                Ok(inner.verdict(&call, answers.iter().map(|(g, a)| (a, g.items.clone()))))
            }
            .await;
            let _ = tx.send(r);
        });
        answer_within(self.timeout, rx).await
    }

    /// A place for one more call across slots, or the error of a call past the bound.
    fn cross_slot_permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, StoreError> {
        Arc::clone(&self.cross_slot)
            .try_acquire_owned()
            .map_err(|_| {
                StoreError::Busy(format!(
                    "too many calls across slots in flight (at most {})",
                    self.max_cross_slot
                ))
            })
    }

    /// The first three script arguments of a call made now.
    fn now_args(&self) -> [Value; 3] {
        let time = self.injected.as_ref().map(|c| {
            let now = c.now();
            (now / 1_000_000_000, now % 1_000_000_000)
        });
        self.time_args_at(time)
    }

    /// The first three script arguments: the time (injected, or empty for Redis `TIME`) and
    /// the TTL slack.
    fn time_args(&self, call: &Call) -> [Value; 3] {
        self.time_args_at(call.time)
    }

    fn time_args_at(&self, time: Option<(u64, u64)>) -> [Value; 3] {
        let slack = Value::String(self.slack_arg.clone());
        match time {
            Some((s, n)) => [
                Value::from(s.to_string()),
                Value::from(n.to_string()),
                slack,
            ],
            None => [static_str(""), static_str("0"), slack],
        }
    }

    async fn decide(&self, call: &Call) -> Result<Decision, StoreError> {
        let answers = self.answers(call, &|| false).await?;
        Ok(self.verdict(call, answers.iter().map(|(g, a)| (a, g.items.clone()))))
    }

    /// Runs the call's scripts: one per slot, and the cross-slot protocol when there are
    /// several. The groups come in the order of [`Inner::slot_groups`].
    /// `gone`: whether the caller stopped waiting (across slots, a call admitted everywhere
    /// is then taken back).
    async fn answers<'c>(
        &self,
        call: &'c Call,
        gone: &(dyn Fn() -> bool + Sync),
    ) -> Result<Vec<(Group<'c>, Answer)>, StoreError> {
        let first_slot = call.items[0].slot;
        if call.items.iter().all(|it| it.slot == first_slot) {
            let items: SmallVec<[&Item; 4]> = call.items.iter().collect();
            let group = Group {
                tokens: self.tokens(&items, false),
                items,
            };
            let answer = self.consume(call, &group).await?;
            return Ok(vec![(group, answer)]);
        }
        self.consume_across_slots(call, gone).await
    }

    /// The refund tokens of a group's items, for calls across slots or taking leases: every
    /// algorithm but the sliding log needs one to be refunded (a lease's unspent part, or a
    /// slot's consumption when another slot rejects), and the refund takes back only what the
    /// token's own consumption recorded. An admitted call then settles its tokens, one
    /// fire-and-forget script call (for a fixed window too, which used to need none).
    fn tokens(&self, items: &[&Item], across_slots: bool) -> SmallVec<[String; 4]> {
        items
            .iter()
            .map(|it| match it.algorithm {
                "token_bucket" | "leaky_bucket" | "gcra" | "fixed_window" | "sliding_window"
                    if across_slots || it.leasing() =>
                {
                    format!(
                        "{:x}.{:x}",
                        self.instance,
                        self.tokens.fetch_add(1, Ordering::Relaxed)
                    )
                }
                _ => String::new(),
            })
            .collect()
    }

    /// A lease-taking call: the verdict, and each check's own answer with what it consumed
    /// and how to give a lease's unspent part back.
    async fn take(
        &self,
        call: &Call,
        gone: &(dyn Fn() -> bool + Sync),
    ) -> Result<Taken, StoreError> {
        let answers = self.answers(call, gone).await?;
        let decision = self.verdict(call, answers.iter().map(|(g, a)| (a, g.items.clone())));
        let mut items: SmallVec<[TakenItem; 4]> = SmallVec::new();
        for (group, answer) in &answers {
            for ((it, token), a) in group.items.iter().zip(&group.tokens).zip(&answer.decisions) {
                let consumed = answer.admitted && a.granted > 0;
                let ticket = (it.leasing() && consumed).then(|| Ticket {
                    key: it.key.clone(),
                    algorithm: it.algorithm,
                    limit: it.limit,
                    period: it.period,
                    horizon: it.horizon,
                    token: token.clone(),
                    ref_b: a.ref_b,
                    ref_t: a.ref_t,
                });
                items.push(TakenItem {
                    index: it.index,
                    cost: it.cost,
                    decision: a.decision,
                    granted: if answer.admitted { a.granted } else { 0 },
                    ticket,
                });
            }
        }
        // Cross-slot: one slot may have admitted while another rejected; what it consumed
        // was refunded, so nothing was granted anywhere.
        if !decision.allowed() {
            for item in &mut items {
                item.granted = 0;
                item.ticket = None;
            }
        }
        Ok(Taken {
            decision,
            sent: call.sent,
            items,
        })
    }

    /// The most restrictive decision of all the answers; rejections go to the deny cache.
    fn verdict<'a, 'b>(
        &self,
        call: &Call,
        answers: impl IntoIterator<Item = (&'b Answer, SmallVec<[&'a Item; 4]>)>,
    ) -> Decision {
        let now = self.local.now();
        let mut decisions: SmallVec<[(Decision, u64); 4]> = SmallVec::new();
        for (answer, items) in answers {
            for (a, item) in answer.decisions.iter().zip(items) {
                let d = a.decision;
                if !d.allowed() {
                    if let Some(deny) = &self.deny {
                        deny.insert(item.deny_hash, item.cost, call.sent, now, d);
                    }
                }
                decisions.push((d, item.cost));
            }
        }
        // In the order of the checks, as the in-process store folds them (ties keep the first).
        decisions.sort_by_key(|(d, _)| d.index());
        decisions
            .into_iter()
            .reduce(crate::decision::tighter)
            .map_or(NOTHING_TO_CHECK, |(d, _)| d)
    }

    /// The items grouped by slot, in the order `consume_across_slots` answers them (one group
    /// when all share a slot).
    fn slot_groups(call: &Call) -> Vec<SmallVec<[&Item; 4]>> {
        let mut slots: SmallVec<[u16; 4]> = call.items.iter().map(|it| it.slot).collect();
        slots.sort_unstable();
        slots.dedup();
        slots
            .iter()
            .map(|&s| call.items.iter().filter(|it| it.slot == s).collect())
            .collect()
    }

    async fn consume_across_slots<'c>(
        &self,
        call: &'c Call,
        gone: &(dyn Fn() -> bool + Sync),
    ) -> Result<Vec<(Group<'c>, Answer)>, StoreError> {
        let groups: Vec<Group<'_>> = Self::slot_groups(call)
            .into_iter()
            .map(|items| Group {
                tokens: self.tokens(&items, true),
                items,
            })
            .collect();
        let results =
            futures_util::future::join_all(groups.iter().map(|g| self.consume(call, g))).await;
        let all_admitted = results.iter().all(|r| matches!(r, Ok(a) if a.admitted));
        let gone = all_admitted && gone();
        if all_admitted && !gone {
            // Nothing to take back: let the buckets forget the pending refunds, off the
            // caller's path (but not those of leases: their unspent part comes back later).
            for (g, r) in groups.iter().zip(&results) {
                if let Ok(a) = r {
                    let settled = g
                        .items
                        .iter()
                        .zip(&g.tokens)
                        .zip(&a.decisions)
                        .filter(|((it, t), _)| !t.is_empty() && !it.leasing());
                    let (keys, args) = self.refund_args(
                        self.time_args(call),
                        settled.map(|((it, t), a)| (refund_of(it, t, a), a.granted)),
                        "settle",
                    );
                    if !keys.is_empty() {
                        let (backend, lua) = (self.backend.clone(), self.scripts.refund.clone());
                        tokio::spawn(async move {
                            let build = || (keys.clone(), args.clone());
                            let _ = eval::<Value>(&backend, &lua, build).await;
                        });
                    }
                }
            }
        } else {
            // Take back what the slots that admitted consumed.
            let refunds = groups.iter().zip(&results).filter_map(|(g, r)| match r {
                Ok(a) if a.admitted => {
                    Some(eval::<Value>(&self.backend, &self.scripts.refund, || {
                        let consumed = g.items.iter().zip(&g.tokens).zip(&a.decisions);
                        self.refund_args(
                            self.time_args(call),
                            consumed.map(|((it, t), a)| (refund_of(it, t, a), a.granted)),
                            "refund",
                        )
                    }))
                }
                _ => None,
            });
            let _ = futures_util::future::join_all(refunds).await;
            if gone {
                // Admitted everywhere, but nobody waits for it any more: all went back.
                return Err(StoreError::Timeout(self.timeout));
            }
        }
        groups
            .into_iter()
            .zip(results)
            .map(|(g, r)| r.map(|a| (g, a)))
            .collect()
    }

    async fn consume(&self, call: &Call, group: &Group<'_>) -> Result<Answer, StoreError> {
        // take.lua has one more argument per check (want), and one more value per answer.
        let (stride, lua) = if call.take {
            (7, &self.scripts.take)
        } else {
            (6, self.scripts.check(&group.items))
        };
        // The numbers of every check in one buffer, handed out as slices of it.
        let mut digits = String::with_capacity(64 * group.items.len());
        let mut ends: SmallVec<[usize; 20]> = SmallVec::new();
        let per_item = if call.take { 5 } else { 4 };
        for it in &group.items {
            for n in [it.limit, it.period, it.cost, it.horizon, it.want]
                .into_iter()
                .take(per_item)
            {
                let _ = write!(digits, "{n}");
                ends.push(digits.len());
            }
        }
        let digits = Bytes::from(digits);
        let build = || {
            let keys: Vec<Key> = group.items.iter().map(|it| it.key.clone()).collect();
            let mut args: Vec<Value> = Vec::with_capacity(3 + stride * group.items.len());
            args.extend(self.time_args(call));
            for (i, (it, token)) in group.items.iter().zip(&group.tokens).enumerate() {
                let number = |k: usize| {
                    let at = per_item * i + k;
                    let start = if at == 0 { 0 } else { ends[at - 1] };
                    Value::Bytes(digits.slice(start..ends[at]))
                };
                args.push(static_str(it.algorithm));
                for k in 0..4 {
                    args.push(number(k));
                }
                args.push(if token.is_empty() {
                    static_str("")
                } else {
                    Value::from(token.as_str())
                });
                if call.take {
                    args.push(number(4));
                }
            }
            (keys, args)
        };
        let out = eval::<Vec<i64>>(&self.backend, lua, build)
            .await
            .map_err(|e| backend_error(&e, self.timeout))?;
        if out.len() != 1 + stride * group.items.len() {
            return Err(StoreError::Backend(Box::new(RedisError {
                message: format!("unexpected script answer of {} values", out.len()),
            })));
        }
        let decisions = group
            .items
            .iter()
            .zip(out[1..].chunks_exact(stride))
            .map(|(it, v)| {
                let n = |x: i64| u64::try_from(x).unwrap_or(0);
                let decision = Decision::from_nanos(v[0] == 1, it.limit, n(v[1]), n(v[2]), n(v[3]))
                    .with_index(it.index);
                Answered {
                    decision,
                    ref_b: v[4],
                    ref_t: v[5],
                    granted: if call.take { n(v[6]) } else { it.cost },
                }
            })
            .collect();
        Ok(Answer {
            admitted: out[0] == 1,
            decisions,
        })
    }

    /// The keys and arguments of refund.lua: `mode` is `refund` (take back `cost` of what each
    /// consumed) or `settle` (the call was admitted: forget how to refund it).
    fn refund_args(
        &self,
        time: [Value; 3],
        consumed: impl Iterator<Item = (Ticket, u64)>,
        mode: &'static str,
    ) -> (Vec<Key>, Vec<Value>) {
        let mut keys: Vec<Key> = Vec::new();
        let [sec, nsec, _] = time;
        let mut args: Vec<Value> = vec![sec, nsec, static_str(mode)];
        for (t, cost) in consumed {
            keys.push(t.key);
            args.push(static_str(t.algorithm));
            args.push(Value::from(t.limit.to_string()));
            args.push(Value::from(t.period.to_string()));
            args.push(Value::from(cost.to_string()));
            args.push(Value::from(t.horizon.to_string()));
            args.push(Value::from(t.token));
            args.push(Value::from(t.ref_b.to_string()));
            args.push(Value::from(t.ref_t.to_string()));
        }
        (keys, args)
    }
}

/// What refund.lua needs to take back an item's consumption.
fn refund_of(it: &Item, token: &str, a: &Answered) -> Ticket {
    Ticket {
        key: it.key.clone(),
        algorithm: it.algorithm,
        limit: it.limit,
        period: it.period,
        horizon: it.horizon,
        token: token.to_owned(),
        ref_b: a.ref_b,
        ref_t: a.ref_t,
    }
}

/// A constant argument, without copying it.
fn static_str(s: &'static str) -> Value {
    Value::String(Str::from_static(s))
}

/// EVALSHA, and EVAL of the whole script if the server has lost it (restart, SCRIPT FLUSH, a
/// new Cluster node): EVAL caches it again.
/// `build` makes the keys and arguments (twice after a NOSCRIPT).
/// Where the store's commands go: one pool (a single node, or the primary Sentinel names), or
/// on a Cluster a pool per master, chosen by the slot of a call's keys.
#[derive(Clone)]
enum Backend {
    One(Pool),
    Cluster(Arc<cluster::Masters>),
}

impl Backend {
    /// The pool for a call on `key` (on a Cluster before its map is known: any master's, whose
    /// `MOVED` then points the way).
    fn pool_for(&self, key: &Key) -> Pool {
        match self {
            Backend::One(pool) => pool.clone(),
            Backend::Cluster(masters) => masters
                .pool_for(key.cluster_hash())
                .map_or_else(|| masters.seed(), |(_, pool)| pool),
        }
    }

    /// Every pool.
    fn pools(&self) -> Vec<Pool> {
        match self {
            Backend::One(pool) => vec![pool.clone()],
            Backend::Cluster(masters) => masters.pools(),
        }
    }

    /// The connections of each pool.
    fn pool_size(&self) -> usize {
        self.pools().first().map_or(0, Pool::size)
    }
}

/// Runs `lua` with the keys and arguments `build` makes, where its keys are: on a Cluster, on
/// their master, following a `MOVED` once (the script did not run) and reading the map again
/// in the background after a redirection or a failure.
async fn eval<R: fred::types::FromValue>(
    backend: &Backend,
    lua: &Lua,
    build: impl Fn() -> (Vec<Key>, Vec<Value>),
) -> Result<R, FredError> {
    let masters = match backend {
        Backend::One(pool) => return eval_on(pool, lua, build).await,
        Backend::Cluster(masters) => masters,
    };
    let slot = build().0.first().map_or(0, Key::cluster_hash);
    let pool = masters
        .pool_for(slot)
        .map_or_else(|| masters.seed(), |(_, pool)| pool);
    match eval_on::<R, _>(&pool, lua, &build).await {
        Err(e) if e.is_cluster() => {
            masters.refresh_soon();
            match cluster::moved_to(&e) {
                Some((host, port)) => {
                    let pool = masters.pool_at(&host, port)?;
                    eval_on(&pool, lua, build).await
                }
                None => Err(e),
            }
        }
        Err(e) => {
            if *e.kind() != ErrorKind::Timeout || !pool.is_connected() {
                masters.refresh_soon();
            }
            Err(e)
        }
        ok => ok,
    }
}

async fn eval_on<R: fred::types::FromValue, C: LuaInterface + Sync>(
    pool: &C,
    lua: &Lua,
    build: impl Fn() -> (Vec<Key>, Vec<Value>),
) -> Result<R, FredError> {
    let (keys, args) = build();
    match pool
        .evalsha::<R, _, _, _>(
            lua.sha.as_str(),
            MultipleKeys::from(keys),
            Value::Array(args),
        )
        .await
    {
        Err(e) if e.details().starts_with("NOSCRIPT") => {
            let (keys, args) = build();
            pool.eval::<R, _, _, _>(lua.text, MultipleKeys::from(keys), Value::Array(args))
                .await
        }
        r => r,
    }
}

#[derive(Clone, Debug)]
enum Server {
    Url(String),
    Cluster(Vec<(String, u16)>),
    Sentinel {
        hosts: Vec<(String, u16)>,
        service: String,
    },
}

/// Configures a [`RedisStore`]; made by [`RedisStore::builder`].
#[derive(Clone)]
pub struct RedisStoreBuilder {
    server: Server,
    prefix: String,
    slots: KeySlots,
    pool_size: usize,
    timeout: Duration,
    connect_timeout: Duration,
    deny_cache: usize,
    deny_max_age: Duration,
    max_key_len: usize,
    ttl_slack: Duration,
    wait: bool,
    injected: Option<Arc<dyn Clock>>,
    max_cross_slot: usize,
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        Self {
            server: Server::Url("redis://127.0.0.1:6379".into()),
            prefix: "tollgate:".into(),
            slots: KeySlots::PerKey,
            pool_size: DEFAULT_POOL_SIZE,
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: Duration::from_secs(1),
            deny_cache: 0,
            deny_max_age: Duration::from_secs(1),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            ttl_slack: Duration::from_secs(1),
            wait: true,
            injected: None,
            max_cross_slot: DEFAULT_MAX_CROSS_SLOT_CALLS,
        }
    }
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let server = match &self.server {
            // The URL may hold a password.
            Server::Url(_) => "url".to_owned(),
            Server::Cluster(nodes) => format!("cluster {nodes:?}"),
            Server::Sentinel { hosts, service } => format!("sentinel {service} {hosts:?}"),
        };
        f.debug_struct("RedisStoreBuilder")
            .field("server", &server)
            .field("prefix", &self.prefix)
            .field("slots", &self.slots)
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("deny_cache", &self.deny_cache)
            .field("deny_max_age", &self.deny_max_age)
            .field("max_key_len", &self.max_key_len)
            .field("ttl_slack", &self.ttl_slack)
            .field("wait_for_redis", &self.wait)
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    /// The server, as a URL (see [`RedisStore::connect`]). Default `redis://127.0.0.1:6379`.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.server = Server::Url(url.into());
        self
    }

    /// A Redis Cluster, found from any of these `(host, port)` nodes. The store reads the
    /// Cluster's map itself and keeps a connection pool per master, so that one master down
    /// (hung or killed) fails only the keys it holds, each master with its own circuit breaker
    /// under a [`ResilientStore`](crate::store::ResilientStore); a `MOVED` answer is followed
    /// at once and the map read again, and an `ASK` (a slot in mid-migration) fails that call.
    pub fn cluster<H: Into<String>>(mut self, nodes: impl IntoIterator<Item = (H, u16)>) -> Self {
        self.server = Server::Cluster(nodes.into_iter().map(|(h, p)| (h.into(), p)).collect());
        self
    }

    /// A primary found through Sentinel: the sentinels' `(host, port)` and the service name.
    pub fn sentinel<H: Into<String>>(
        mut self,
        sentinels: impl IntoIterator<Item = (H, u16)>,
        service_name: impl Into<String>,
    ) -> Self {
        self.server = Server::Sentinel {
            hosts: sentinels.into_iter().map(|(h, p)| (h.into(), p)).collect(),
            service: service_name.into(),
        };
        self
    }

    /// The prefix of every key name (default `tollgate:`). It may not contain `{` or `}`
    /// (the store chooses the hash tag).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How keys are placed on Cluster slots (default [`KeySlots::PerKey`]).
    pub fn key_slots(mut self, slots: KeySlots) -> Self {
        self.slots = slots;
        self
    }

    /// How many connections to pipeline over (default 4, at least 1).
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.clamp(1, 256);
        self
    }

    /// The most a call may take before it fails with [`StoreError::Timeout`] (default
    /// 250 ms).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The most connecting (and each reconnection attempt) may take (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The most calls across slots in flight at once (default
    /// [`DEFAULT_MAX_CROSS_SLOT_CALLS`], at least 1). Each runs in a task of its own, which
    /// lasts until its refunds are done even after its caller stopped waiting: while a master
    /// hangs, a flood of stacks across slots would otherwise hold about rate x 3 timeouts of
    /// tasks. Past the bound a call across slots fails at once with [`StoreError::Busy`],
    /// consuming nothing; a [`ResilientStore`](crate::store::ResilientStore) answers it with
    /// its failure policy, and no breaker counts it (it says nothing of Redis's health).
    pub fn max_cross_slot_calls(mut self, max: usize) -> Self {
        self.max_cross_slot = max.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        self
    }

    /// Remember up to `capacity` rejections locally and answer them without Redis until their
    /// retry time (default 0: off). See the module docs.
    pub fn deny_cache(mut self, capacity: usize) -> Self {
        self.deny_cache = capacity;
        self
    }

    /// The longest a remembered rejection is answered locally before Redis is asked again,
    /// even if its retry time is later (default 1 s).
    pub fn deny_cache_max_age(mut self, max_age: Duration) -> Self {
        self.deny_max_age = max_age;
        self
    }

    /// The longest key accepted, in bytes (default 64 KiB); a longer one is a
    /// [`StoreError::KeyTooLong`]. Keys longer than 128 bytes once escaped are stored under
    /// their SHA-256.
    pub fn max_key_len(mut self, max_key_len: usize) -> Self {
        self.max_key_len = max_key_len;
        self
    }

    /// Added to every key's expiry beyond the moment its state has fully recovered (default
    /// 1 s).
    pub fn ttl_slack(mut self, slack: Duration) -> Self {
        self.ttl_slack = slack;
        self
    }

    /// Whether [`connect`](Self::connect) waits for Redis (default `true`: it fails if Redis
    /// cannot be reached within the connect timeout). With `false` it returns at once and
    /// connects in the background, retrying with backoff: a service can start while Redis is
    /// down (its checks fail, promptly, until Redis answers; wrap the store in a
    /// [`ResilientStore`](crate::store::ResilientStore) to decide what that means).
    pub fn wait_for_redis(mut self, wait: bool) -> Self {
        self.wait = wait;
        self
    }

    /// Testing only: the scripts take the time from `clock` (nanoseconds since the Unix
    /// epoch, or any origin) instead of Redis `TIME`, and keys expire an hour after they
    /// recover, so that a test can drive this store and a `MemoryStore` with one
    /// `ManualClock`. Never use it in production: instances would not share a clock.
    #[doc(hidden)]
    pub fn injected_clock(mut self, clock: impl Clock) -> Self {
        self.injected = Some(Arc::new(clock));
        self.ttl_slack = Duration::from_secs(3600);
        self
    }

    /// Connects and loads the scripts.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        let config_error = |message: String| StoreError::Backend(Box::new(RedisError { message }));
        if self.prefix.contains(['{', '}']) {
            return Err(config_error(format!(
                "the key prefix {:?} may not contain braces",
                self.prefix
            )));
        }
        let mut config = match &self.server {
            Server::Url(url) => {
                Config::from_url(url).map_err(|e| config_error(e.details().into()))?
            }
            Server::Cluster(nodes) => Config {
                server: ServerConfig::new_clustered(nodes.clone()),
                ..Config::default()
            },
            Server::Sentinel { hosts, service } => Config {
                server: ServerConfig::new_sentinel(hosts.clone(), service.clone()),
                ..Config::default()
            },
        };
        config.fail_fast = self.wait;
        let clustered = config.server.is_clustered();
        let mut builder = Builder::from_config(config);
        let (timeout, connect_timeout) = (self.timeout, self.connect_timeout);
        builder
            .with_connection_config(|c| {
                c.connection_timeout = connect_timeout;
                c.internal_command_timeout = connect_timeout;
                // A script is not idempotent: never send it twice on our behalf.
                c.max_command_attempts = 1;
            })
            .with_performance_config(|p| {
                p.default_command_timeout = timeout;
            })
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 1000, 2));
        let local: Arc<dyn Clock> = match &self.injected {
            Some(c) => Arc::clone(c),
            None => Arc::new(SystemClock::new()),
        };
        let scripts = Scripts::new();
        let backend = if clustered {
            // A pool per master, routed by the store (see cluster.rs).
            let masters = cluster::Masters::connect(
                builder,
                self.pool_size,
                self.wait,
                connect_timeout + timeout,
                Arc::clone(&local),
            )
            .await
            .map_err(|e| backend_error(&e, connect_timeout))?;
            Backend::Cluster(masters)
        } else {
            let pool = builder
                .build_pool(self.pool_size)
                .map_err(|e| config_error(e.details().into()))?;
            if !self.wait {
                // Connect in the background; until then calls fail fast, and the first one
                // after sends its script with EVAL.
                let _handles = pool.connect_pool();
            } else {
                match tokio::time::timeout(connect_timeout + timeout, pool.init()).await {
                    Ok(Ok(_handle)) => {}
                    Ok(Err(e)) => return Err(backend_error(&e, connect_timeout)),
                    Err(_) => {
                        let _ = pool.quit().await;
                        return Err(StoreError::Timeout(connect_timeout));
                    }
                }
            }
            Backend::One(pool)
        };
        if self.wait {
            // On a Cluster, every master; a master met later runs its first script with EVAL.
            for pool in backend.pools() {
                for lua in scripts.all() {
                    pool.next()
                        .script_load::<Value, _>(lua.text)
                        .await
                        .map_err(|e| backend_error(&e, timeout))?;
                }
            }
        }
        let hasher = foldhash::fast::RandomState::default();
        let instance = hasher.hash_one((std::process::id(), local.now()));
        Ok(RedisStore {
            inner: Arc::new(Inner {
                backend,
                clustered,
                names: KeyNames {
                    prefix: self.prefix,
                    slots: self.slots,
                },
                max_key_len: self.max_key_len,
                timeout,
                slack_arg: Str::from(
                    self.ttl_slack
                        .as_millis()
                        .min(u128::from(u64::MAX))
                        .to_string(),
                ),
                injected: self.injected,
                local,
                deny: (self.deny_cache > 0).then(|| {
                    let max_age = u64::try_from(self.deny_max_age.as_nanos()).unwrap_or(u64::MAX);
                    DenyCache::new(self.deny_cache, max_age)
                }),
                deny_hasher: hasher,
                scripts,
                instance,
                tokens: AtomicU64::new(0),
                cross_slot: Arc::new(tokio::sync::Semaphore::new(self.max_cross_slot)),
                max_cross_slot: self.max_cross_slot,
            }),
        })
    }
}
