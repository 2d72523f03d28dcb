//! The in-process store.

use std::cmp::{self, Reverse};
use std::collections::BinaryHeap;
use std::fmt;
use std::future::{Ready, ready};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use hashbrown::HashTable;
use smallvec::SmallVec;

use super::{Check, NOTHING_TO_CHECK, Store, StoreError};
use crate::algorithm::{FixedWindow, Gcra, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket};
use crate::clock::{Clock, SystemClock};
use crate::sync::{AtomicU64, Mutex, MutexGuard};
use crate::telemetry::{Counter, Gauge};
use crate::{Algorithm, Decision, Policy};

/// The default cap on tracked (key, policy) pairs.
pub const DEFAULT_MAX_KEYS: usize = 1 << 20;
/// The default number of shards.
pub const DEFAULT_SHARDS: usize = 64;
/// The default longest key, in bytes.
pub const DEFAULT_MAX_KEY_LEN: usize = 512;
/// The default name of a [`MemoryStore`] in metrics.
pub const DEFAULT_MEMORY_STORE_NAME: &str = "memory";

/// Limiter state in this process's memory.
///
/// - **Exact and atomic.** A check runs under one shard's lock; a stacked check
///   ([`MemoryStore::check_all`]) locks the shards it needs in a fixed order, decides every
///   check, and commits only if all admit. There is no global lock: keys are spread over
///   shards (64 by default) by a keyed hash.
/// - **Cheap.** A check on a key already tracked allocates nothing; the future it returns is
///   ready at once, so nothing is boxed. Time comes from a monotonic [`Clock`].
/// - **Bounded.** At most about `max_keys` (key, policy) pairs are tracked (by default
///   2^20). When a shard is full, state that has fully recovered is dropped first, which
///   changes no decision (a recovered key is indistinguishable from a new one): live state is
///   never forgotten while recovered state remains. If the shard is full of live state, it
///   forgets the sixteenth of it whose loss gives away least: the pairs that have consumed
///   the fewest units of their policy as of now, and of those the closest to recovery. A
///   pair's units consumed are what forgetting it would admit at once beyond what it still
///   admits (`limit - remaining`): a bucket's level (token bucket: the tokens missing), GCRA's
///   backlog, in units rounded up; a fixed window's count; a sliding window counter's weighted
///   count, rounded down; a sliding log's live entries. So a flood of new keys cannot grow
///   memory, and what it pushes out first is barely used state. Those keys may then be
///   admitted early, and [`MemoryStore::evicted`] counts them. Size `max_keys` above your live
///   key count.
/// - **What a flood of keys can still buy back.** A pair that has consumed `u` units is
///   forgotten only when its shard is full of live state and at least `cap - cap/16` other
///   pairs of that shard (`cap`: `max_keys` divided by the shard count) have each consumed at
///   least `u` units as of that moment (those as consumed recovering no sooner). Keys are
///   spread over shards by a hash with a per-store random seed, so an attacker cannot aim at
///   one shard: to make the store forget a login key exhausted at 5 per 15 minutes, it must
///   hold about 15/16 of `max_keys` other pairs at 5 units or more each, all at once, that is
///   spend on the order of `5 × max_keys` admitted requests inside 15 minutes to regain 5. A
///   flood of keys that each made one request, whatever its size, never pushes out a pair
///   that has consumed two units or more. What remains:
///   - units are each policy's own, not weighted by its limit or period: a pair that made 6
///     requests under a generous 1000 per second policy outranks a login key exhausted at 5
///     per 15 minutes in the same store. Keep a few-requests policy that guards something
///     (logins, password resets) in a `MemoryStore` of its own, or weigh it with a cost;
///   - the honest pairs least used are forgotten first, with the flood's: each of them gets
///     back the few units it had used;
///   - a pair that has consumed one unit (a limit of 1, or a key used once) is as cheap as a
///     flood's key, and being older it recovers sooner, so it goes first;
///   - consumption is taken as of the moment the shard is full: a pair that has nearly
///     recovered ranks as the little it still holds.
/// - **Amortised O(1) when full.** A full shard in which little has recovered keeps the
///   sixteenth of its pairs due to recover soonest in order, and forgets the first of them
///   once it has recovered without looking at the others: whatever the rate of new keys, it
///   scans all its pairs at most about once per sixty-fourth of its capacity of new keys (or
///   of requests that delay the recovery of a pair in that order). A scan that must forget
///   live state ranks every pair (a division or two each) and frees a sixteenth of the shard,
///   so under a flood that nothing recovers from it runs once per sixteenth of new keys.
/// - **Cost per key.** A tracked pair takes one slot in its policy's hash table (each shard
///   keeps one table per policy with a pair in it, so a slot holds no policy fingerprint),
///   plus a control byte and the table's spare capacity: 32 bytes for GCRA, 40 for the leaky
///   bucket, 48 for the token bucket and the fixed window, 56 for the sliding window counter
///   and 72 for the sliding log, whose entries take 16 bytes each on the heap. A key of up to
///   23 bytes is stored in the slot; a longer one adds a heap copy. A shard that has been full
///   also keeps 24 bytes for each pair in its eviction order (about a sixteenth of them, so
///   1.5 bytes per key), and each shard 64 bytes (and a control byte) for each policy with a
///   pair in it, plus that policy's table: a policy with few pairs in a shard costs at least
///   a table of 4 slots there (one allocation). Measured with 100,000 keys: about 43 bytes per
///   key for GCRA, 75 for the sliding window counter (`cargo bench --bench memory_per_key`;
///   BENCHMARKS.md has every figure).
///
/// Clones share one state: cloning the store (or a layer holding it) never splits a limit.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{MemoryStore, Policy};
/// use tollgate::clock::ManualClock;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let clock = ManualClock::new();
/// let store = MemoryStore::builder().clock(clock.clone()).max_keys(10_000).build();
/// let login = Policy::sliding_log(5, Duration::from_secs(15 * 60))?;
/// for _ in 0..5 {
///     assert!(store.check_now("ip:203.0.113.9", &login, 1)?.allowed());
/// }
/// let d = store.check_now("ip:203.0.113.9", &login, 1)?;
/// assert_eq!(d.retry_after(), Some(Duration::from_secs(15 * 60)));
/// clock.advance(Duration::from_secs(15 * 60));
/// assert!(store.check_now("ip:203.0.113.9", &login, 1)?.allowed());
/// # Ok(())
/// # }
/// ```
pub struct MemoryStore<C = SystemClock> {
    inner: Arc<Inner<C>>,
}

struct Inner<C> {
    clock: C,
    hasher: crate::sync::HashState,
    shards: Box<[Padded]>,
    mask: usize,
    shard_cap: usize,
    max_key_len: usize,
    evicted: AtomicU64,
    /// Its name in metrics.
    name: Box<str>,
    /// `tollgate_memory_store_keys`: set where the store counts its pairs anyway (a sweep), or
    /// when asked ([`MemoryStore::record_metrics`]); never per request.
    keys: Gauge,
    /// `tollgate_memory_store_evictions_total`, counted where evictions are.
    evictions: Counter,
}

/// One shard on its own cache lines, so that two threads on two shards never share one.
#[repr(align(128))]
struct Padded(Mutex<Shard>);

/// A shard keeps one hash table per policy (of one algorithm), so that each slot is only as
/// large as its own algorithm's state needs and holds no policy fingerprint (a GCRA slot is 32
/// bytes: the key and the theoretical arrival time).
#[derive(Default)]
struct Shard {
    /// The pairs of each policy that has some in the shard. A policy's table goes with its last
    /// pair, so there are never more tables than pairs (and usually a handful).
    policies: Vec<ByPolicy>,
    /// The position of each policy in `policies`, by id (already a hash): searched only when
    /// there are more than [`FEW_POLICIES`], a handful being quicker to compare one by one.
    index: HashTable<usize>,
    /// How many pairs the tables hold.
    len: usize,
    order: Soonest,
}

/// Up to how many policies a shard finds a policy's table by comparing ids in turn.
const FEW_POLICIES: usize = 4;

/// The pairs of one policy in a shard.
struct ByPolicy {
    id: u64,
    /// The policy's period, so that a scan can count what each pair has consumed, in units of
    /// its own policy, without the policy at hand.
    period: u64,
    table: Tables,
}

/// A policy's table: slots of its algorithm's state.
enum Tables {
    Gcra(Table<Gcra>),
    TokenBucket(Table<Timed<TokenBucket>>),
    LeakyBucket(Table<LeakyBucket>),
    FixedWindow(Table<Timed<FixedWindow>>),
    SlidingWindow(Table<Timed<SlidingWindow>>),
    SlidingLog(Table<Timed<SlidingLog>>),
}

type Table<S> = HashTable<Slot<S>>;

/// Runs `$body` with `$table` bound to the table inside `$tables`, whatever its algorithm.
macro_rules! on_table {
    ($tables:expr, $table:ident => $body:expr) => {
        match $tables {
            Tables::Gcra($table) => $body,
            Tables::TokenBucket($table) => $body,
            Tables::LeakyBucket($table) => $body,
            Tables::FixedWindow($table) => $body,
            Tables::SlidingWindow($table) => $body,
            Tables::SlidingLog($table) => $body,
        }
    };
}

impl Tables {
    fn len(&self) -> usize {
        on_table!(self, t => t.len())
    }
}

/// What forgetting a live slot gives away, compared when a full shard must forget some: the
/// units it has consumed as of now, then its expiry (of two slots as consumed, the one closer
/// to recovery goes first).
type Rank = (u64, u64);

/// The rank at `now` of `slot`, of a policy whose period is `period`.
#[inline]
fn rank<S: Kept>(slot: &Slot<S>, period: u64, now: u64) -> Rank {
    (slot.state.consumed(period, now), slot.state.expires())
}

/// `nanos` of a bucket's backlog in units of `period`, rounded up: a bucket `nanos` short of
/// full admits `limit - units` at once.
#[inline]
fn units(nanos: u64, period: u64) -> u64 {
    nanos.div_ceil(period.max(1))
}

/// What a shard knows of which slots recover first, so that a full shard can usually free a
/// recovered slot without scanning the others. It relies on expiries never moving earlier (a
/// commit never brings recovery closer), so a time recorded for a slot stays a lower bound.
///
/// Every slot either has an entry in `due` no later than its expiry, or expires at `later` or
/// after.
#[derive(Default)]
struct Soonest {
    /// The slots that may recover soonest: the sixteenth of the shard closest to recovery at
    /// the last scan, and the slots tracked since that are due before `later`.
    due: BinaryHeap<Reverse<Due>>,
    /// No slot outside `due` recovers before this time (zero, i.e. unknown, until a scan).
    later: u64,
    /// How many times the shard was scanned to make room.
    #[cfg(test)]
    scans: u64,
}

/// A slot in [`Soonest::due`]: its policy's id, its hash, and a time before which it cannot
/// have recovered. Ordered by time first.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Due {
    at: u64,
    hash: u64,
    policy: u64,
}

impl Due {
    fn rank(&self) -> (u64, u64, u64) {
        (self.at, self.hash, self.policy)
    }
}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    fn cmp(&self, other: &Self) -> cmp::Ordering {
        self.rank().cmp(&other.rank())
    }
}

impl Soonest {
    /// Records a slot due at `due.at`, unless `later` already covers it.
    #[inline]
    fn track(&mut self, due: Due) {
        if due.at < self.later {
            self.due.push(Reverse(due));
        }
    }

    /// Forgets the order (after a sweep): the next full shard scans.
    fn reset(&mut self) {
        self.due = BinaryHeap::new();
        self.later = 0;
    }
}

/// What became of a slot found through [`Soonest::due`].
enum Found {
    /// It had recovered, and is forgotten.
    Recovered,
    /// It is live until this time.
    Live(u64),
    /// It is no longer tracked.
    Gone,
}

/// The `n` smallest of some values (expiries, or ranks): those below `at`, and `ties` of those
/// equal to `at`.
struct Cut<T> {
    at: T,
    ties: usize,
}

impl<T: Ord + Copy> Cut<T> {
    /// The `n` smallest of `values` (1 <= n <= len), which it reorders.
    fn smallest(values: &mut [T], n: usize) -> Self {
        let (below, &mut at, _) = values.select_nth_unstable(n - 1);
        let ties = n - below.iter().filter(|&&e| e < at).count();
        Cut { at, ties }
    }

    /// Whether a slot of value `value` is one of the `n`; call once per slot.
    fn takes(&mut self, value: T) -> bool {
        if value < self.at {
            true
        } else if value == self.at && self.ties > 0 {
            self.ties -= 1;
            true
        } else {
            false
        }
    }
}

/// The state of one (key, policy) pair.
struct Slot<S: Kept> {
    key: Key,
    state: S,
}

impl<S: Kept> Slot<S> {
    #[inline]
    fn is(&self, key: &str) -> bool {
        self.key.is(key.as_bytes())
    }
}

/// Runs `$body` with `$kept` naming the type that the table of `$algorithm` keeps.
macro_rules! with_kept {
    ($algorithm:expr, $kept:ident => $body:expr) => {
        match $algorithm {
            Algorithm::Gcra => {
                type $kept = Gcra;
                $body
            }
            Algorithm::TokenBucket => {
                type $kept = Timed<TokenBucket>;
                $body
            }
            Algorithm::LeakyBucket => {
                type $kept = LeakyBucket;
                $body
            }
            Algorithm::FixedWindow => {
                type $kept = Timed<FixedWindow>;
                $body
            }
            Algorithm::SlidingWindow => {
                type $kept = Timed<SlidingWindow>;
                $body
            }
            Algorithm::SlidingLog => {
                type $kept = Timed<SlidingLog>;
                $body
            }
        }
    };
}

/// What a table keeps for one algorithm: its state, and how to decide, commit and expire it.
trait Kept: Sized {
    /// The state of a key never seen under `policy`.
    fn fresh(policy: &Policy) -> Self;

    /// Decides a request without changing anything; [`Kept::apply`] commits what it returns.
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update);

    /// Writes what [`Kept::decide`] returned for an admitted request.
    fn apply(&mut self, policy: &Policy, update: Update);

    /// When the state will be indistinguishable from a fresh one: forgetting it from then on
    /// changes no decision. [`Kept::apply`] never makes it earlier; [`Soonest`] relies on it.
    fn expires(&self) -> u64;

    /// The units of its policy (whose period is `period`) that the state holds consumed at
    /// `now`: what forgetting it would admit at once beyond what it admits, `limit -
    /// remaining` of a check of cost 0 at `now`.
    fn consumed(&self, period: u64, now: u64) -> u64;

    /// An empty table of this state.
    fn empty() -> Tables;

    /// The table in `tables`, if it keeps this state.
    fn table(tables: &Tables) -> Option<&Table<Self>>;

    /// [`Kept::table`], to change.
    fn table_mut(tables: &mut Tables) -> Option<&mut Table<Self>>;
}

/// What to write if a decision is committed.
#[derive(Clone, Copy, Debug)]
enum Update {
    Gcra(Gcra),
    TokenBucket(TokenBucket),
    LeakyBucket(LeakyBucket),
    FixedWindow(FixedWindow),
    SlidingWindow(SlidingWindow),
    SlidingLog { now: u64, cost: u64 },
}

/// The methods of [`Kept`] (or `Algo`) that name the variant of [`Tables`] holding a type's
/// slots, of type `$state`.
macro_rules! kept_tables {
    ($variant:ident) => {
        kept_tables!($variant, Self);
    };
    ($variant:ident, $state:ty) => {
        fn empty() -> Tables {
            Tables::$variant(HashTable::new())
        }

        #[inline]
        fn table(tables: &Tables) -> Option<&Table<$state>> {
            match tables {
                Tables::$variant(table) => Some(table),
                _ => None,
            }
        }

        #[inline]
        fn table_mut(tables: &mut Tables) -> Option<&mut Table<$state>> {
            match tables {
                Tables::$variant(table) => Some(table),
                _ => None,
            }
        }
    };
}

// GCRA's state is its own expiry: the theoretical arrival time.
impl Kept for Gcra {
    fn fresh(_: &Policy) -> Self {
        Gcra::default()
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let (next, d) = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::Gcra(next))
    }

    #[inline]
    fn apply(&mut self, _: &Policy, update: Update) {
        if let Update::Gcra(next) = update {
            *self = next;
        }
    }

    #[inline]
    fn expires(&self) -> u64 {
        self.recovered_at()
    }

    fn consumed(&self, period: u64, now: u64) -> u64 {
        units(self.tat.saturating_sub(now), period)
    }

    kept_tables!(Gcra);
}

// So is the leaky bucket's: the time its level drains to zero.
impl Kept for LeakyBucket {
    fn fresh(_: &Policy) -> Self {
        LeakyBucket::default()
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let (next, d) = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::LeakyBucket(next))
    }

    #[inline]
    fn apply(&mut self, _: &Policy, update: Update) {
        if let Update::LeakyBucket(next) = update {
            *self = next;
        }
    }

    #[inline]
    fn expires(&self) -> u64 {
        self.recovered_at()
    }

    fn consumed(&self, period: u64, now: u64) -> u64 {
        // The level left at `now` (time never runs backwards inside a state).
        units(
            self.recovered_at().saturating_sub(now.max(self.last)),
            period,
        )
    }

    kept_tables!(LeakyBucket);
}

/// A state whose expiry depends on the policy, kept beside it (computed on each commit).
struct Timed<S> {
    expires: u64,
    state: S,
}

/// The pure algorithm behind a [`Timed`] state.
trait Algo: Sized {
    fn fresh(policy: &Policy) -> Self;
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update);
    fn apply(&mut self, policy: &Policy, update: Update);
    fn recovered_at(&self, policy: &Policy) -> u64;
    /// [`Kept::consumed`], given the expiry kept beside the state.
    fn consumed(&self, expires: u64, period: u64, now: u64) -> u64;
    fn empty() -> Tables;
    fn table(tables: &Tables) -> Option<&Table<Timed<Self>>>;
    fn table_mut(tables: &mut Tables) -> Option<&mut Table<Timed<Self>>>;
}

impl<S: Algo> Kept for Timed<S> {
    fn fresh(policy: &Policy) -> Self {
        Timed {
            expires: 0,
            state: S::fresh(policy),
        }
    }

    // Always inlined: returned through the stack, a `(Decision, Update)` costs a
    // store-forwarding stall (the sliding window counter's check was not inlined once each
    // policy had its own table).
    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        self.state.decide(policy, now, cost)
    }

    #[inline]
    fn apply(&mut self, policy: &Policy, update: Update) {
        self.state.apply(policy, update);
        self.expires = self.state.recovered_at(policy);
    }

    #[inline]
    fn expires(&self) -> u64 {
        self.expires
    }

    fn consumed(&self, period: u64, now: u64) -> u64 {
        self.state.consumed(self.expires, period, now)
    }

    fn empty() -> Tables {
        S::empty()
    }

    #[inline]
    fn table(tables: &Tables) -> Option<&Table<Self>> {
        S::table(tables)
    }

    #[inline]
    fn table_mut(tables: &mut Tables) -> Option<&mut Table<Self>> {
        S::table_mut(tables)
    }
}

impl Algo for TokenBucket {
    fn fresh(policy: &Policy) -> Self {
        TokenBucket::full(policy.limit(), policy.period_nanos())
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let (next, d) = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::TokenBucket(next))
    }

    #[inline]
    fn apply(&mut self, _: &Policy, update: Update) {
        if let Update::TokenBucket(next) = update {
            *self = next;
        }
    }

    #[inline]
    fn recovered_at(&self, policy: &Policy) -> u64 {
        TokenBucket::recovered_at(self, policy.limit(), policy.period_nanos())
    }

    fn consumed(&self, expires: u64, period: u64, now: u64) -> u64 {
        // The bucket is full again at `expires`: until then it lacks `expires - now` of credit.
        units(expires.saturating_sub(now.max(self.last)), period)
    }

    kept_tables!(TokenBucket, Timed<Self>);
}

impl Algo for FixedWindow {
    fn fresh(_: &Policy) -> Self {
        FixedWindow::default()
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let (next, d) = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::FixedWindow(next))
    }

    #[inline]
    fn apply(&mut self, _: &Policy, update: Update) {
        if let Update::FixedWindow(next) = update {
            *self = next;
        }
    }

    #[inline]
    fn recovered_at(&self, policy: &Policy) -> u64 {
        FixedWindow::recovered_at(self, policy.period_nanos())
    }

    fn consumed(&self, _: u64, period: u64, now: u64) -> u64 {
        if (now / period.max(1)).max(self.window) == self.window {
            self.count
        } else {
            0
        }
    }

    kept_tables!(FixedWindow, Timed<Self>);
}

impl Algo for SlidingWindow {
    fn fresh(_: &Policy) -> Self {
        SlidingWindow::default()
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let (next, d) = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::SlidingWindow(next))
    }

    #[inline]
    fn apply(&mut self, _: &Policy, update: Update) {
        if let Update::SlidingWindow(next) = update {
            *self = next;
        }
    }

    #[inline]
    fn recovered_at(&self, policy: &Policy) -> u64 {
        SlidingWindow::recovered_at(self, policy.period_nanos())
    }

    fn consumed(&self, _: u64, period: u64, now: u64) -> u64 {
        // The weighted count as `check` takes it, rounded down (what it weighs on admission).
        let w = period.max(1);
        let k = (now / w).max(self.window);
        let (prev, cur) = if k == self.window {
            (self.prev, self.cur)
        } else if Some(k) == self.window.checked_add(1) {
            (self.cur, 0)
        } else {
            (0, 0)
        };
        let elapsed = now.saturating_sub(k.saturating_mul(w)).min(w - 1);
        let scaled = u128::from(prev) * u128::from(w - elapsed) + u128::from(cur) * u128::from(w);
        u64::try_from(scaled / u128::from(w)).unwrap_or(u64::MAX)
    }

    kept_tables!(SlidingWindow, Timed<Self>);
}

impl Algo for SlidingLog {
    fn fresh(_: &Policy) -> Self {
        SlidingLog::default()
    }

    #[inline(always)]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        let d = self.check(policy.limit(), policy.period_nanos(), now, cost);
        (d, Update::SlidingLog { now, cost })
    }

    #[inline]
    fn apply(&mut self, policy: &Policy, update: Update) {
        if let Update::SlidingLog { now, cost } = update {
            self.record(policy.period_nanos(), now, cost);
        }
    }

    #[inline]
    fn recovered_at(&self, policy: &Policy) -> u64 {
        SlidingLog::recovered_at(self, policy.period_nanos())
    }

    fn consumed(&self, expires: u64, period: u64, now: u64) -> u64 {
        // The cost of the entries still in the window; the newest entry is `expires - period`.
        let now = now.max(expires.saturating_sub(period));
        self.entries()
            .skip_while(|&(t, _)| t.saturating_add(period) <= now)
            .map(|(_, cost)| cost)
            .sum()
    }

    kept_tables!(SlidingLog, Timed<Self>);
}

impl Shard {
    fn len(&self) -> usize {
        self.len
    }

    /// Where policy `id` is in `policies`, if it has pairs in the shard.
    #[inline]
    fn position(&self, id: u64) -> Option<usize> {
        if self.policies.len() <= FEW_POLICIES {
            self.policies.iter().position(|p| p.id == id)
        } else {
            let at = |&pos: &usize| self.policies.get(pos).is_some_and(|p| p.id == id);
            self.index.find(id, at).copied()
        }
    }

    /// The table of policy `id`, if it has pairs in the shard and keeps `K`.
    #[inline]
    fn table<K: Kept>(&self, id: u64) -> Option<&Table<K>> {
        K::table(&self.policies.get(self.position(id)?)?.table)
    }

    /// [`Shard::table`], to change.
    #[inline]
    fn table_mut<K: Kept>(&mut self, id: u64) -> Option<&mut Table<K>> {
        let pos = self.position(id)?;
        K::table_mut(&mut self.policies.get_mut(pos)?.table)
    }

    /// Tracks a new pair of `policy`, in its table (made if it is the first).
    fn insert_slot<K: Kept>(
        &mut self,
        policy: &Policy,
        hash: u64,
        slot: Slot<K>,
        rehash: impl Fn(u64, &[u8]) -> u64,
    ) {
        let id = policy.id();
        let pos = match self.position(id) {
            Some(pos) => pos,
            None => {
                let pos = self.policies.len();
                self.policies.push(ByPolicy {
                    id,
                    period: policy.period_nanos(),
                    table: K::empty(),
                });
                let policies = &self.policies;
                let rehash_pos = |&p: &usize| policies.get(p).map_or(0, |p| p.id);
                self.index.insert_unique(id, pos, rehash_pos);
                pos
            }
        };
        // A policy's id hashes its algorithm with the rest: a table of another algorithm under
        // the same id would take two policies whose 64-bit hashes agree. Such a pair is not
        // tracked, and every check of it answers as for a new key.
        let by_policy = self.policies.get_mut(pos);
        if let Some(table) = by_policy.and_then(|p| K::table_mut(&mut p.table)) {
            table.insert_unique(hash, slot, |s| rehash(id, s.key.as_bytes()));
            self.len += 1;
        }
    }

    /// Forgets the (empty) table at `pos`: the last table takes its place.
    fn remove_policy(&mut self, pos: usize) {
        let removed = self.policies.swap_remove(pos);
        if let Ok(entry) = self.index.find_entry(removed.id, |&p| p == pos) {
            entry.remove();
        }
        let last = self.policies.len();
        if let Some(moved) = self.policies.get(pos) {
            if let Some(p) = self.index.find_mut(moved.id, |&p| p == last) {
                *p = pos;
            }
        }
    }

    /// Forgets the empty tables, after a scan or a sweep, and counts the pairs left.
    fn drop_empty_tables(&mut self) {
        self.policies.retain(|p| p.table.len() > 0);
        self.index.clear();
        for (pos, p) in self.policies.iter().enumerate() {
            let policies = &self.policies;
            let rehash_pos = |&p: &usize| policies.get(p).map_or(0, |p| p.id);
            self.index.insert_unique(p.id, pos, rehash_pos);
        }
        self.len = self.policies.iter().map(|p| p.table.len()).sum();
    }

    /// Keeps the slots for which `keep(expiry)` is true.
    fn retain(&mut self, mut keep: impl FnMut(u64) -> bool) {
        for p in &mut self.policies {
            on_table!(&mut p.table, t => t.retain(|slot| keep(slot.state.expires())));
        }
        self.drop_empty_tables();
    }

    /// Keeps the slots for which `keep(rank at now)` is true.
    fn retain_ranked(&mut self, now: u64, mut keep: impl FnMut(Rank) -> bool) {
        for p in &mut self.policies {
            let period = p.period;
            on_table!(&mut p.table, t => t.retain(|slot| keep(rank(slot, period, now))));
        }
        self.drop_empty_tables();
    }

    /// The rank of every slot at `now`.
    fn ranks(&self, now: u64) -> Vec<Rank> {
        let mut ranks = Vec::with_capacity(self.len);
        for p in &self.policies {
            let period = p.period;
            on_table!(&p.table, t => ranks.extend(t.iter().map(|slot| rank(slot, period, now))));
        }
        ranks
    }

    /// The expiry of every slot.
    fn expiries(&self) -> Vec<u64> {
        let mut expiries = Vec::with_capacity(self.len);
        for p in &self.policies {
            on_table!(&p.table, t => expiries.extend(t.iter().map(|slot| slot.state.expires())));
        }
        expiries
    }

    /// Gives the tables' spare capacity back to the allocator.
    fn shrink_to_fit(&mut self, hash: impl Fn(u64, &[u8]) -> u64) {
        for p in self.policies.iter_mut() {
            let id = p.id;
            on_table!(&mut p.table, t => t.shrink_to_fit(|slot| hash(id, slot.key.as_bytes())));
        }
        self.policies.shrink_to_fit();
        let policies = &self.policies;
        self.index
            .shrink_to_fit(|&p| policies.get(p).map_or(0, |p| p.id));
    }

    /// Frees at least one slot of a full shard, and returns how many live slots it forgot.
    ///
    /// Recovered state goes first, and costs no scan while the slot due soonest has recovered:
    /// that one is forgotten. Otherwise one scan forgets every recovered slot, and, if the
    /// shard is still full of live state, the sixteenth of it whose loss gives away least: the
    /// least consumed as of now (ties: the closest to recovery). A scan that frees less than a
    /// sixty-fourth orders the sixteenth due next. So at any steady flow of new keys, a full
    /// shard is scanned at most about once per sixty-fourth of its capacity of new keys.
    fn make_room(&mut self, cap: usize, now: u64, hash: impl Fn(u64, &[u8]) -> u64) -> u64 {
        while let Some(&Reverse(due)) = self.order.due.peek() {
            if due.at > now {
                break;
            }
            self.order.due.pop();
            match self.forget_if_recovered(due, now, &hash) {
                Found::Recovered => return 0,
                Found::Live(at) => self.order.track(Due { at, ..due }),
                Found::Gone => {}
            }
        }
        self.scan(cap, now, &hash)
    }

    /// Forgets the slot of `due` if it has recovered by `now`, and its policy's table with it
    /// if that was the last.
    fn forget_if_recovered(
        &mut self,
        due: Due,
        now: u64,
        hash: &impl Fn(u64, &[u8]) -> u64,
    ) -> Found {
        let id = due.policy;
        let Some(pos) = self.position(id) else {
            return Found::Gone;
        };
        let Some(by_policy) = self.policies.get_mut(pos) else {
            return Found::Gone;
        };
        // A slot is known by its hash: two slots of one table whose 64-bit keyed hashes agree
        // may be mistaken for each other, which at worst forgets the other one if it, too, has
        // recovered.
        let found = on_table!(&mut by_policy.table, t => {
            match t.find_entry(due.hash, |slot| hash(id, slot.key.as_bytes()) == due.hash) {
                Ok(slot) if slot.get().state.expires() <= now => {
                    slot.remove();
                    Found::Recovered
                }
                Ok(slot) => Found::Live(slot.get().state.expires()),
                Err(_) => Found::Gone,
            }
        });
        if let Found::Recovered = found {
            self.len -= 1;
            if by_policy.table.len() == 0 {
                self.remove_policy(pos);
            }
        }
        found
    }

    /// Forgets every recovered slot; if that frees less than a sixty-fourth of the shard,
    /// orders the sixteenth due next, after forgetting the sixteenth least consumed if the
    /// shard is still full. Returns how many live slots were forgotten.
    fn scan(&mut self, cap: usize, now: u64, hash: &impl Fn(u64, &[u8]) -> u64) -> u64 {
        #[cfg(test)]
        {
            self.order.scans += 1;
        }
        let before = self.len();
        self.retain(|expires| expires > now);
        if before - self.len() >= (cap / 64).max(1) {
            // That much room pays for this scan: until the shard is full again, an order
            // would cost more than it saves.
            self.order.due.clear();
            self.order.later = 0;
            return 0;
        }
        let quota = (cap / 16).max(1);
        let mut evicted = 0;
        let mut expiries = if self.len() >= cap {
            // Forget what gives away least: the pairs least consumed as of now.
            let mut ranks = self.ranks(now);
            evicted = quota.min(ranks.len());
            let mut cut = Cut::smallest(&mut ranks, evicted);
            self.retain_ranked(now, |rank| !cut.takes(rank));
            // The slots forgotten are `ranks[..evicted]`; the rest are still tracked.
            let left = ranks.get(evicted..).unwrap_or_default();
            left.iter().map(|&(_, expires)| expires).collect()
        } else {
            self.expiries()
        };
        self.order_soonest(&mut expiries, quota, hash);
        evicted as u64
    }

    /// Puts the `n` slots closest to recovery in order; `expiries` are those of every slot.
    fn order_soonest(&mut self, expiries: &mut [u64], n: usize, hash: &impl Fn(u64, &[u8]) -> u64) {
        let mut due = std::mem::take(&mut self.order.due).into_vec();
        due.clear();
        let n = n.min(expiries.len());
        self.order.later = u64::MAX;
        if n > 0 {
            let mut cut = Cut::smallest(expiries, n);
            self.order.later = cut.at;
            for p in &self.policies {
                let id = p.id;
                on_table!(&p.table, t => {
                    for slot in t {
                        let at = slot.state.expires();
                        if cut.takes(at) {
                            let hash = hash(id, slot.key.as_bytes());
                            due.push(Reverse(Due { at, hash, policy: id }));
                        }
                    }
                });
            }
        }
        self.order.due = BinaryHeap::from(due);
    }
}

/// The longest key kept inside its slot; a longer one goes to the heap.
const INLINE_KEY: usize = 23;

/// A key as a slot keeps it: up to 23 bytes in the slot itself (no allocation and no pointer to
/// follow when comparing), a longer one in a heap copy. 24 bytes either way: the length of an
/// inline key is a [`KeyLen`], whose unused values tell the heap case apart.
enum Key {
    Inline {
        len: KeyLen,
        bytes: [u8; INLINE_KEY],
    },
    Heap(Box<str>),
}

impl Key {
    fn new(key: &str) -> Self {
        let mut bytes = [0; INLINE_KEY];
        match (KeyLen::of(key.len()), bytes.get_mut(..key.len())) {
            (Some(len), Some(prefix)) => {
                prefix.copy_from_slice(key.as_bytes());
                Key::Inline { len, bytes }
            }
            _ => Key::Heap(key.into()),
        }
    }

    /// Whether this is `key`; an inline key is compared in place, without a call to `memcmp`.
    #[inline]
    fn is(&self, key: &[u8]) -> bool {
        match self {
            Key::Inline { len, bytes } => {
                *len as usize == key.len() && bytes.iter().zip(key).all(|(a, b)| a == b)
            }
            Key::Heap(own) => own.as_bytes() == key,
        }
    }

    #[inline]
    fn as_bytes(&self) -> &[u8] {
        match self {
            Key::Inline { len, bytes } => bytes.get(..*len as usize).unwrap_or_default(),
            Key::Heap(key) => key.as_bytes(),
        }
    }
}

/// The length of an inline key, 0 to 23.
#[derive(Clone, Copy)]
#[repr(u8)]
#[rustfmt::skip]
enum KeyLen {
    L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11,
    L12, L13, L14, L15, L16, L17, L18, L19, L20, L21, L22, L23,
}

impl KeyLen {
    #[rustfmt::skip]
    const ALL: [KeyLen; INLINE_KEY + 1] = {
        use KeyLen::*;
        [
            L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11,
            L12, L13, L14, L15, L16, L17, L18, L19, L20, L21, L22, L23,
        ]
    };

    fn of(len: usize) -> Option<Self> {
        Self::ALL.get(len).copied()
    }
}

// The sizes the documentation promises.
const _: () = {
    assert!(size_of::<Key>() == 24);
    assert!(size_of::<Slot<Gcra>>() == 32);
    assert!(size_of::<Slot<LeakyBucket>>() == 40);
    assert!(size_of::<Slot<Timed<TokenBucket>>>() == 48);
    assert!(size_of::<Slot<Timed<FixedWindow>>>() == 48);
    assert!(size_of::<Slot<Timed<SlidingWindow>>>() == 56);
    assert!(size_of::<Slot<Timed<SlidingLog>>>() == 72);
    assert!(size_of::<Reverse<Due>>() == 24);
    // A policy with pairs in a shard: its entry, and its position in the index.
    assert!(size_of::<ByPolicy>() + size_of::<usize>() == 64);
};

impl MemoryStore<SystemClock> {
    /// A store on the monotonic system clock, with the default limits.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder to set the clock, the key cap, the shard count and the longest key.
    pub fn builder() -> MemoryStoreBuilder<SystemClock> {
        MemoryStoreBuilder {
            clock: SystemClock::new(),
            max_keys: DEFAULT_MAX_KEYS,
            shards: DEFAULT_SHARDS,
            max_key_len: DEFAULT_MAX_KEY_LEN,
            name: DEFAULT_MEMORY_STORE_NAME.to_owned(),
        }
    }
}

impl Default for MemoryStore<SystemClock> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> MemoryStore<C> {
    /// A store on `clock` (a [`ManualClock`](crate::clock::ManualClock) in tests), with the
    /// default limits.
    pub fn with_clock(clock: C) -> Self {
        MemoryStore::builder().clock(clock).build()
    }

    /// Checks one request of `cost` against `policy` for `key`. The future is ready at once.
    pub fn check(
        &self,
        key: &str,
        policy: &Policy,
        cost: u64,
    ) -> Ready<Result<Decision, StoreError>> {
        ready(self.check_now(key, policy, cost))
    }

    /// Checks a stack of limits all or nothing. The future is ready at once.
    pub fn check_all(&self, checks: &[Check<'_>]) -> Ready<Result<Decision, StoreError>> {
        ready(self.check_all_now(checks))
    }

    /// [`MemoryStore::check`], without the future.
    #[inline]
    pub fn check_now(&self, key: &str, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        let inner = &*self.inner;
        Check::new(key, policy, cost).validate(0, inner.max_key_len)?;
        Ok(with_kept!(policy.algorithm(), K => inner.check_one::<K>(key, policy, cost)))
    }

    /// [`MemoryStore::check_all`], without the future.
    pub fn check_all_now(&self, checks: &[Check<'_>]) -> Result<Decision, StoreError> {
        match checks {
            [] => return Ok(NOTHING_TO_CHECK),
            [one] => return self.check_now(one.key(), one.policy(), one.cost()),
            _ => {}
        }
        let inner = &*self.inner;
        // The same (key, policy) twice in one stack is one check of the summed cost.
        let mut items: SmallVec<[Item<'_>; 8]> = SmallVec::new();
        for (index, check) in checks.iter().enumerate() {
            check.validate(index, inner.max_key_len)?;
            let id = check.policy().id();
            match items
                .iter_mut()
                .find(|it| it.policy.id() == id && it.key == check.key())
            {
                Some(it) => {
                    it.cost = it
                        .cost
                        .checked_add(check.cost())
                        .filter(|&c| c <= it.policy.limit())
                        .ok_or(StoreError::CostExceedsLimit {
                            index,
                            cost: it.cost.saturating_add(check.cost()),
                            limit: it.policy.limit(),
                        })?;
                }
                None => items.push(Item {
                    hash: inner.hash(id, check.key().as_bytes()),
                    key: check.key(),
                    policy: check.policy(),
                    cost: check.cost(),
                    index,
                    update: None,
                }),
            }
        }
        // Lock every shard involved, in ascending order, so that two stacked checks can never
        // wait on each other.
        let mut order: SmallVec<[usize; 8]> =
            items.iter().map(|it| inner.shard_index(it.hash)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: SmallVec<[(usize, MutexGuard<'_, Shard>); 8]> = order
            .iter()
            .map(|&i| (i, inner.shards[i].0.lock()))
            .collect();
        let now = inner.clock.now();

        let mut verdict: Option<(Decision, u64)> = None;
        for item in &mut items {
            let shard = guard_for(&mut guards, inner.shard_index(item.hash));
            let (decision, update) =
                with_kept!(item.policy.algorithm(), K => decide_in::<K>(shard, item, now));
            item.update = Some(update);
            let decision = (decision.with_index(item.index), item.cost);
            verdict = Some(verdict.map_or(decision, |v| crate::decision::tighter(v, decision)));
        }
        let verdict = verdict.map_or(NOTHING_TO_CHECK, |(d, _)| d);
        if !verdict.allowed() {
            return Ok(verdict);
        }
        for item in &items {
            let Some(update) = item.update else { continue };
            if item.cost == 0 {
                continue;
            }
            let shard = guard_for(&mut guards, inner.shard_index(item.hash));
            with_kept!(item.policy.algorithm(), K => inner.commit::<K>(shard, item, update, now));
        }
        Ok(verdict)
    }

    /// The number of (key, policy) pairs tracked, recovered or not.
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| s.0.lock().len()).sum()
    }

    /// Whether no pair is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every pair whose state has fully recovered, and returns how many. Never changes
    /// a decision; the store does it by itself when a shard fills, so calling it is optional
    /// (it returns memory to the allocator sooner after a burst of keys).
    ///
    /// With feature `metrics`, it also sets the `tollgate_memory_store_keys` gauge to the pairs
    /// left (as [`MemoryStore::record_metrics`] does).
    pub fn sweep(&self) -> usize {
        let now = self.inner.clock.now();
        let (mut forgotten, mut left) = (0, 0);
        for s in self.inner.shards.iter() {
            let mut shard = s.0.lock();
            let before = shard.len();
            shard.retain(|expires| expires > now);
            shard.order.reset();
            shard.shrink_to_fit(|policy, key| self.inner.hash(policy, key));
            forgotten += before - shard.len();
            left += shard.len();
        }
        self.inner.keys.set(left as f64);
        forgotten
    }

    /// Sets the `tollgate_memory_store_keys` gauge to the pairs tracked now (feature
    /// `metrics`).
    ///
    /// The store does not keep that gauge up to date by itself: a count shared by every shard
    /// would be one more write to a contended cache line on every new key, which is the one
    /// thing its sharding avoids. Counting takes each shard's lock in turn, briefly, as
    /// [`MemoryStore::len`] does; call it from the task that scrapes or sweeps, every few
    /// seconds. Evictions are counted as they happen.
    #[cfg(feature = "metrics")]
    #[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
    pub fn record_metrics(&self) {
        self.inner.keys.set(self.len() as f64);
    }

    /// The store's name in metrics (see [`MemoryStoreBuilder::name`]).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// How many pairs were forgotten while their state was still live, because the store was
    /// full. Non-zero means `max_keys` is too small for the traffic (or a flood of keys).
    pub fn evicted(&self) -> u64 {
        self.inner.evicted.load(Ordering::Relaxed)
    }

    /// The store's clock.
    pub fn clock(&self) -> &C {
        &self.inner.clock
    }
}

struct Item<'a> {
    hash: u64,
    key: &'a str,
    policy: &'a Policy,
    cost: u64,
    index: usize,
    update: Option<Update>,
}

fn guard_for<'g, 's>(
    guards: &'g mut [(usize, MutexGuard<'s, Shard>)],
    index: usize,
) -> &'g mut Shard {
    // Every item's shard was locked above; the search cannot fail.
    let pos = guards.iter().position(|(i, _)| *i == index).unwrap_or(0);
    &mut guards[pos].1
}

/// Decides one item of a stacked check, changing nothing.
fn decide_in<K: Kept>(shard: &Shard, item: &Item<'_>, now: u64) -> (Decision, Update) {
    let (policy, cost) = (item.policy, item.cost);
    let table = shard.table::<K>(policy.id());
    match table.and_then(|t| t.find(item.hash, |s| s.is(item.key))) {
        Some(slot) => slot.state.decide(policy, now, cost),
        None => K::fresh(policy).decide(policy, now, cost),
    }
}

impl<C: Clock> Inner<C> {
    /// One check: find the slot, decide, commit if admitted (a zero cost writes nothing).
    #[inline]
    fn check_one<K: Kept>(&self, key: &str, policy: &Policy, cost: u64) -> Decision {
        let now = self.clock.now();
        let id = policy.id();
        let hash = self.hash(id, key.as_bytes());
        let mut shard = self.shard(hash);
        let table = shard.table_mut::<K>(id);
        if let Some(slot) = table.and_then(|t| t.find_mut(hash, |s| s.is(key))) {
            let (decision, update) = slot.state.decide(policy, now, cost);
            if decision.allowed() && cost > 0 {
                slot.state.apply(policy, update);
            }
            return decision;
        }
        let mut state = K::fresh(policy);
        let (decision, update) = state.decide(policy, now, cost);
        if decision.allowed() && cost > 0 {
            state.apply(policy, update);
            self.insert(&mut shard, hash, policy, key, state, now);
        }
        decision
    }
}

impl<C> Inner<C> {
    #[inline]
    fn hash(&self, policy: u64, key: &[u8]) -> u64 {
        self.hasher.hash_one((policy, key))
    }

    #[inline]
    fn shard_index(&self, hash: u64) -> usize {
        // hashbrown uses the low bits for buckets and the top seven for tags: take others.
        (hash >> 32) as usize & self.mask
    }

    #[inline]
    fn shard(&self, hash: u64) -> MutexGuard<'_, Shard> {
        self.shards[self.shard_index(hash)].0.lock()
    }

    /// Commits an admitted item of a stacked check.
    fn commit<K: Kept>(&self, shard: &mut Shard, item: &Item<'_>, update: Update, now: u64) {
        let (policy, key) = (item.policy, item.key);
        let table = shard.table_mut::<K>(policy.id());
        match table.and_then(|t| t.find_mut(item.hash, |s| s.is(key))) {
            Some(slot) => slot.state.apply(policy, update),
            None => {
                let mut state = K::fresh(policy);
                state.apply(policy, update);
                self.insert(shard, item.hash, policy, key, state, now);
            }
        }
    }

    /// Tracks a new (key, policy) pair, making room first if the shard is full.
    fn insert<K: Kept>(
        &self,
        shard: &mut Shard,
        hash: u64,
        policy: &Policy,
        key: &str,
        state: K,
        now: u64,
    ) {
        if shard.len() >= self.shard_cap {
            let evicted = shard.make_room(self.shard_cap, now, |p, k| self.hash(p, k));
            if evicted > 0 {
                self.evicted.fetch_add(evicted, Ordering::Relaxed);
                self.evictions.increment(evicted);
            }
        }
        shard.order.track(Due {
            at: state.expires(),
            hash,
            policy: policy.id(),
        });
        let slot = Slot {
            key: Key::new(key),
            state,
        };
        shard.insert_slot(policy, hash, slot, |p, k| self.hash(p, k));
    }
}

impl<C> Clone for MemoryStore<C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<C> fmt::Debug for MemoryStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("name", &self.inner.name)
            .field("shards", &self.inner.shards.len())
            .field(
                "max_keys",
                &(self.inner.shard_cap * self.inner.shards.len()),
            )
            .field("max_key_len", &self.inner.max_key_len)
            .finish_non_exhaustive()
    }
}

impl<C: Clock> Store for MemoryStore<C> {
    type Future = Ready<Result<Decision, StoreError>>;

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        MemoryStore::check_all(self, checks)
    }

    fn check(&self, key: &str, policy: &Policy, cost: u64) -> Self::Future {
        MemoryStore::check(self, key, policy, cost)
    }
    fn max_key_len(&self) -> Option<usize> {
        Some(self.inner.max_key_len)
    }
}

/// Configures a [`MemoryStore`]; made by [`MemoryStore::builder`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder<C = SystemClock> {
    clock: C,
    max_keys: usize,
    shards: usize,
    max_key_len: usize,
    name: String,
}

impl<C: Clock> MemoryStoreBuilder<C> {
    /// The clock to read time from.
    pub fn clock<C2: Clock>(self, clock: C2) -> MemoryStoreBuilder<C2> {
        MemoryStoreBuilder {
            clock,
            max_keys: self.max_keys,
            shards: self.shards,
            max_key_len: self.max_key_len,
            name: self.name,
        }
    }

    /// About how many (key, policy) pairs to track at most (default 2^20); spread evenly over
    /// the shards, so the real cap is this rounded up to a multiple of the shard count. At
    /// least 1.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self
    }

    /// How many shards (default 64): rounded up to a power of two, and reduced so that each
    /// holds at least one key.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.clamp(1, 1 << 16);
        self
    }

    /// The longest key accepted, in bytes (default 512); a longer one is a
    /// [`StoreError::KeyTooLong`].
    pub fn max_key_len(mut self, max_key_len: usize) -> Self {
        self.max_key_len = max_key_len;
        self
    }

    /// The store's name in metrics (the `store` label; [`DEFAULT_MEMORY_STORE_NAME`] unless
    /// set): give each `MemoryStore` of a process whose metrics you read its own.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Builds the store, and registers its metrics (feature `metrics`: install the recorder
    /// first).
    pub fn build(self) -> MemoryStore<C> {
        let mut shards = self.shards.next_power_of_two();
        while shards > 1 && shards > self.max_keys {
            shards /= 2;
        }
        let inner = Inner {
            clock: self.clock,
            hasher: crate::sync::HashState::default(),
            shards: (0..shards)
                .map(|_| Padded(Mutex::new(Shard::default())))
                .collect(),
            mask: shards - 1,
            shard_cap: self.max_keys.div_ceil(shards),
            max_key_len: self.max_key_len,
            evicted: AtomicU64::new(0),
            keys: Gauge::new(crate::metrics::MEMORY_STORE_KEYS, &[("store", &self.name)]),
            evictions: Counter::new(
                crate::metrics::MEMORY_STORE_EVICTIONS_TOTAL,
                &[("store", &self.name)],
            ),
            name: self.name.into(),
        };
        MemoryStore {
            inner: Arc::new(inner),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::Rate;
    use crate::clock::ManualClock;

    /// A store of one shard that tracks at most `cap` pairs.
    fn one_shard(cap: usize) -> MemoryStore<ManualClock> {
        MemoryStore::builder()
            .clock(ManualClock::new())
            .max_keys(cap)
            .shards(1)
            .build()
    }

    /// How many times the store's only shard was scanned to make room.
    fn scans(store: &MemoryStore<ManualClock>) -> u64 {
        store.inner.shards[0].0.lock().order.scans
    }

    /// A tracked pair: its algorithm, policy and key.
    type Pair = (String, u64, Vec<u8>);

    /// Every tracked pair of the store's only shard, and its expiry.
    fn slots(store: &MemoryStore<ManualClock>) -> Vec<(Pair, u64)> {
        let shard = store.inner.shards[0].0.lock();
        let mut out = Vec::new();
        for p in &shard.policies {
            on_table!(&p.table, t => {
                for slot in t {
                    let algorithm = std::any::type_name_of_val(&slot.state).to_owned();
                    let id = (algorithm, p.id, slot.key.as_bytes().to_vec());
                    out.push((id, slot.state.expires()));
                }
            });
        }
        assert_eq!(shard.len(), out.len(), "the shard counts its pairs");
        out
    }

    /// Every tracked pair of the store's only shard, and its rank now.
    fn ranked(store: &MemoryStore<ManualClock>) -> Vec<(Pair, Rank)> {
        let now = store.clock().now();
        let shard = store.inner.shards[0].0.lock();
        let mut out = Vec::new();
        for p in &shard.policies {
            on_table!(&p.table, t => {
                for slot in t {
                    let algorithm = std::any::type_name_of_val(&slot.state).to_owned();
                    let id = (algorithm, p.id, slot.key.as_bytes().to_vec());
                    out.push((id, rank(slot, p.period, now)));
                }
            });
        }
        out
    }

    /// The policies the only shard keeps a table for, and the pairs in each.
    fn policies(store: &MemoryStore<ManualClock>) -> Vec<(u64, usize)> {
        let shard = store.inner.shards[0].0.lock();
        for (pos, p) in shard.policies.iter().enumerate() {
            let indexed = shard.index.find(p.id, |&at| at == pos);
            assert_eq!(indexed, Some(&pos), "the index finds every table");
        }
        assert_eq!(shard.index.len(), shard.policies.len());
        let mut out: Vec<_> = shard
            .policies
            .iter()
            .map(|p| (p.id, p.table.len()))
            .collect();
        out.sort_unstable();
        out
    }

    /// The policies of the pairs the only shard tracks, and how many pairs each.
    fn policies_of_pairs(store: &MemoryStore<ManualClock>) -> Vec<(u64, usize)> {
        let mut out: Vec<(u64, usize)> = Vec::new();
        for ((_, policy, _), _) in slots(store) {
            match out.iter_mut().find(|(id, _)| *id == policy) {
                Some((_, n)) => *n += 1,
                None => out.push((policy, 1)),
            }
        }
        out.sort_unstable();
        out
    }

    /// What the only shard's pair of (`key`, `policy`) has consumed now, by [`Kept::consumed`].
    fn consumed(store: &MemoryStore<ManualClock>, key: &str, policy: &Policy) -> Option<u64> {
        fn of<S: Kept>(shard: &Shard, hash: u64, key: &str, p: &Policy, now: u64) -> Option<u64> {
            let slot = shard.table::<S>(p.id())?.find(hash, |s| s.is(key))?;
            Some(slot.state.consumed(p.period_nanos(), now))
        }
        let now = store.clock().now();
        let hash = store.inner.hash(policy.id(), key.as_bytes());
        let shard = store.inner.shards[0].0.lock();
        with_kept!(policy.algorithm(), K => of::<K>(&shard, hash, key, policy, now))
    }

    #[test]
    fn what_a_pair_has_consumed_is_what_forgetting_it_would_admit_at_once() {
        let ms = Duration::from_millis;
        let rate = Rate::new(1, ms(7));
        let policies = [
            Policy::gcra(rate, 5).unwrap(),
            Policy::token_bucket(rate, 5).unwrap(),
            Policy::leaky_bucket(rate, 5).unwrap(),
            Policy::fixed_window(5, ms(30)).unwrap(),
            Policy::sliding_window(5, ms(30)).unwrap(),
            Policy::sliding_log(5, ms(30)).unwrap(),
        ];
        for policy in &policies {
            let store = one_shard(16);
            let mut rng = 0x2545_F491_4F6C_DD1Du64;
            let mut next = |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let mut live = 0;
            for _ in 0..3000 {
                // Steps of 0 to 4 ms, now and then one far ahead (and one nanosecond, which
                // lands between units).
                let step = match next(20) {
                    0 => Duration::from_nanos(1),
                    1 => ms(45),
                    _ => Duration::from_micros(next(4000)),
                };
                store.clock().advance(step);
                let cost = next(policy.limit()) + 1;
                store.check_now("k", policy, cost).unwrap();
                let Some(consumed) = consumed(&store, "k", policy) else {
                    continue;
                };
                let remaining = store.check_now("k", policy, 0).unwrap().remaining();
                assert_eq!(consumed, policy.limit() - remaining, "{policy:?}");
                live += u64::from(consumed > 0);
            }
            assert!(live > 500, "{policy:?}: {live}");
        }
    }

    #[test]
    fn the_shard_keeps_a_table_for_the_policies_of_its_pairs_and_no_others() {
        // Pairs of many policies come and go: by recovery (from the order and by a scan), by
        // eviction, and by a sweep.
        let ms = Duration::from_millis;
        let store = one_shard(64);
        for i in 0..2000u64 {
            let p = match i % 3 {
                0 => Policy::gcra(Rate::new(1, ms(1 + i % 50)), 1),
                1 => Policy::sliding_log(2, ms(1 + i % 70)),
                _ => Policy::fixed_window(3, Duration::from_secs(3600)),
            };
            let p = p.unwrap().named(format!("p{}", i % 97)).unwrap();
            store.check_now(&format!("k{i}"), &p, 1).unwrap();
            store.clock().advance(ms(i % 3));
            assert_eq!(policies(&store), policies_of_pairs(&store), "after {i}");
        }
        assert!(store.evicted() > 0 && scans(&store) > 1);
        store.clock().advance(Duration::from_secs(4000));
        store.sweep();
        assert!(policies(&store).is_empty());
        let shard = store.inner.shards[0].0.lock();
        assert_eq!(shard.policies.capacity() + shard.index.capacity(), 0);
    }

    #[test]
    fn a_full_shard_under_a_steady_flow_of_new_keys_is_scanned_once_per_sixteenth() {
        // Each key recovers `cap` ms after its request, and a new key comes every ms: once
        // full, the shard has exactly one recovered slot at each new key.
        let cap = 1024;
        let store = one_shard(cap);
        let p = Policy::gcra(Rate::new(1, Duration::from_millis(cap as u64)), 1).unwrap();
        let n = 20 * cap;
        for i in 0..cap + n {
            assert!(store.check_now(&format!("k{i}"), &p, 1).unwrap().allowed());
            store.clock().advance(Duration::from_millis(1));
        }
        assert_eq!(store.len(), cap);
        assert_eq!(store.evicted(), 0, "only recovered state was forgotten");
        let bound = n as u64 / (cap as u64 / 16) + 1;
        assert!(
            scans(&store) <= bound,
            "{} scans for {n} keys",
            scans(&store)
        );
    }

    #[test]
    fn short_lived_keys_in_a_shard_full_of_long_lived_ones_cost_no_scan_each() {
        let cap = 512;
        let store = one_shard(cap);
        let long = Policy::fixed_window(1, Duration::from_secs(3600)).unwrap();
        let short = Policy::gcra(Rate::new(1, Duration::from_millis(1)), 1).unwrap();
        for i in 0..cap {
            store.check_now(&format!("long{i}"), &long, 1).unwrap();
        }
        // The first new key finds nothing recovered: a sixteenth of the live keys goes, once.
        for i in 0..10 * cap {
            assert!(
                store
                    .check_now(&format!("short{i}"), &short, 1)
                    .unwrap()
                    .allowed()
            );
            store.clock().advance(Duration::from_millis(2));
        }
        assert_eq!(store.len(), cap);
        assert_eq!(store.evicted(), cap as u64 / 16);
        assert_eq!(scans(&store), 1);
        // The long-lived keys that were not evicted are still limited.
        let limited = (0..cap)
            .filter(|i| {
                !store
                    .check_now(&format!("long{i}"), &long, 1)
                    .unwrap()
                    .allowed()
            })
            .count();
        assert_eq!(limited, cap - cap / 16);
    }

    #[test]
    fn a_full_shard_forgets_live_state_only_when_none_has_recovered() {
        let w = Duration::from_millis;
        let policies = [
            Policy::gcra(Rate::new(1, w(30)), 2).unwrap(),
            Policy::token_bucket(Rate::new(1, w(50)), 2).unwrap(),
            Policy::leaky_bucket(Rate::new(1, w(20)), 3).unwrap(),
            Policy::fixed_window(2, w(40)).unwrap(),
            Policy::sliding_window(2, w(60)).unwrap(),
            Policy::sliding_log(2, w(25)).unwrap(),
            Policy::gcra(Rate::new(1, w(400)), 1).unwrap(),
        ];
        for seed in 1..=8u64 {
            let cap = 128;
            let store = one_shard(cap);
            let quota = cap / 16;
            let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut next = |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let (mut fresh, mut without_scan) = (0, 0);
            for i in 0..3000 {
                // Phases of new keys all at one time (the shard fills with live state, many
                // expiring together) and of new keys spread out.
                let pause = if i / 250 % 2 == 0 { 1 } else { 10 };
                store.clock().advance(w(next(pause)));
                let p = &policies[next(policies.len() as u64) as usize];
                // Mostly new keys; some old ones again, which moves their expiry later.
                let key = match next(3) {
                    0 => format!("k{}", next(fresh + 1)),
                    _ => {
                        fresh += 1;
                        format!("k{fresh}")
                    }
                };
                let now = store.clock().now();
                let before = ranked(&store);
                let (evicted, scanned) = (store.evicted(), scans(&store));
                store.check_now(&key, p, 1).unwrap();
                let after = slots(&store);
                assert!(after.len() <= cap);
                let kept = |id: &Pair| after.iter().any(|(a, _)| a == id);
                let forgotten: Vec<Rank> = before
                    .iter()
                    .filter(|(id, _)| !kept(id))
                    .map(|&(_, r)| r)
                    .collect();
                let live: Vec<Rank> = forgotten.iter().copied().filter(|r| r.1 > now).collect();
                assert_eq!(store.evicted() - evicted, live.len() as u64, "seed {seed}");
                if !forgotten.is_empty() && scans(&store) == scanned {
                    // Room made from the order: one recovered slot.
                    assert!(forgotten.len() == 1 && live.is_empty(), "seed {seed}");
                    without_scan += 1;
                }
                if live.is_empty() {
                    continue;
                }
                // Live state went only because the shard was full of it: nothing recovered is
                // left, and what went was the sixteenth least consumed (of equals, the closest
                // to recovery).
                assert_eq!(before.len(), cap, "seed {seed}");
                assert!(forgotten.len() == live.len(), "seed {seed}: {forgotten:?}");
                assert_eq!(live.len(), quota, "seed {seed}");
                let highest = live.iter().max().copied().unwrap_or_default();
                let survivors = before.iter().filter(|(id, _)| kept(id));
                assert!(survivors.clone().all(|&(_, r)| r.1 > now), "seed {seed}");
                assert!(survivors.clone().all(|&(_, r)| r >= highest), "seed {seed}");
            }
            // The test reaches a shard full of live state, and one that frees recovered state
            // without a scan.
            assert!(store.evicted() > 0, "seed {seed}");
            assert!(without_scan > 0, "seed {seed}");
        }
    }

    #[test]
    fn a_pair_delayed_after_it_was_ordered_is_kept_until_it_recovers() {
        let ms = Duration::from_millis;
        let store = one_shard(128);
        let due_in = |n| Policy::gcra(Rate::new(1, ms(n)), 5).unwrap();
        let long = Policy::fixed_window(1, Duration::from_secs(3600)).unwrap();
        let tracked = |key: &str| {
            slots(&store)
                .iter()
                .any(|((_, _, k), _)| k == key.as_bytes())
        };
        store.check_now("r", &due_in(5), 1).unwrap();
        store.check_now("s", &due_in(10), 1).unwrap();
        store.check_now("q", &due_in(12), 1).unwrap();
        for i in 0..125 {
            store.check_now(&format!("long{i}"), &long, 1).unwrap();
        }
        // Full, and only r has recovered: one scan frees it and orders s, q and six others.
        store.clock().set(ms(5));
        store.check_now("x", &long, 1).unwrap();
        assert!(!tracked("r"));
        assert_eq!(scans(&store), 1);
        // s is used again: it now recovers at 20 ms.
        store.clock().set(ms(6));
        assert!(store.check_now("s", &due_in(10), 1).unwrap().allowed());
        // At 15 ms s is still live, q has recovered: q goes, s stays, and no scan.
        store.clock().set(ms(15));
        store.check_now("y", &long, 1).unwrap();
        assert!(tracked("s") && !tracked("q"));
        // At 20 ms s has recovered: it goes, still without a scan.
        store.clock().set(ms(20));
        store.check_now("z", &long, 1).unwrap();
        assert!(!tracked("s"));
        assert_eq!(scans(&store), 1);
        assert_eq!(store.evicted(), 0);
        assert_eq!(store.len(), 128);
    }

    #[test]
    fn a_scan_that_frees_a_sixty_fourth_of_the_shard_keeps_no_order() {
        let ms = Duration::from_millis;
        let store = one_shard(128);
        let p = Policy::gcra(Rate::new(1, ms(128)), 1).unwrap();
        for i in 0..128 {
            store.check_now(&format!("k{i}"), &p, 1).unwrap();
            store.clock().advance(ms(1));
        }
        // k0 and k1 have recovered at 129 ms: two slots, a sixty-fourth.
        store.clock().set(ms(129));
        store.check_now("new", &p, 1).unwrap();
        assert_eq!(store.len(), 127);
        let shard = store.inner.shards[0].0.lock();
        assert_eq!(shard.order.scans, 1);
        assert!(shard.order.due.is_empty());
        assert_eq!(shard.order.later, 0);
    }

    #[test]
    fn the_smallest_stores_keep_their_bound_and_order() {
        for cap in 1..=3 {
            let store = one_shard(cap);
            let live = Policy::fixed_window(1, Duration::from_secs(3600)).unwrap();
            let short = Policy::gcra(Rate::new(1, Duration::from_millis(1)), 1).unwrap();
            for i in 0..50 {
                store.check_now(&format!("live{i}"), &live, 1).unwrap();
                assert_eq!(store.len(), cap.min(i + 1), "cap {cap}");
            }
            assert_eq!(store.evicted(), (50 - cap) as u64, "cap {cap}");
            for i in 0..50 {
                store.check_now(&format!("short{i}"), &short, 1).unwrap();
                store.clock().advance(Duration::from_millis(1));
                assert!(store.len() <= cap, "cap {cap}");
            }
        }
    }

    #[test]
    fn a_sweep_forgets_only_recovered_state_and_returns_its_memory() {
        let store = one_shard(4096);
        let p = Policy::gcra(Rate::new(1, Duration::from_millis(10)), 1).unwrap();
        for i in 0..1000 {
            store.check_now(&format!("old{i}"), &p, 1).unwrap();
        }
        store.clock().advance(Duration::from_millis(5));
        for i in 0..10 {
            store.check_now(&format!("live{i}"), &p, 1).unwrap();
        }
        // The old keys recover exactly now.
        store.clock().advance(Duration::from_millis(5));
        let buckets = |store: &MemoryStore<ManualClock>| {
            let shard = store.inner.shards[0].0.lock();
            shard.table::<Gcra>(p.id()).map_or(0, |t| t.num_buckets())
        };
        let before = buckets(&store);
        assert_eq!(store.sweep(), 1000);
        assert_eq!(store.len(), 10);
        assert!(buckets(&store) < before);
        for i in 0..10 {
            let d = store.check_now(&format!("live{i}"), &p, 1).unwrap();
            assert!(!d.allowed(), "live{i} is still limited");
        }
    }

    #[test]
    fn a_sweep_forgets_the_order_with_the_recovered_state() {
        // One key recovers per new key: each scan frees one slot, and orders the next ones.
        let store = one_shard(128);
        let p = Policy::gcra(Rate::new(1, Duration::from_millis(128)), 1).unwrap();
        for i in 0..400 {
            store.check_now(&format!("k{i}"), &p, 1).unwrap();
            store.clock().advance(Duration::from_millis(1));
        }
        {
            let shard = store.inner.shards[0].0.lock();
            assert!(shard.order.due.capacity() > 0 && shard.order.later > 0);
        }
        store.clock().advance(Duration::from_millis(128));
        let tracked = store.len();
        assert_eq!(store.sweep(), tracked);
        let shard = store.inner.shards[0].0.lock();
        assert_eq!(shard.order.due.capacity(), 0);
        assert_eq!(shard.order.later, 0);
    }

    #[test]
    fn keys_short_and_long_keep_their_bytes() {
        for len in [0, 1, 22, 23, 24, 25, 512] {
            let text: String = "é0123456789".chars().cycle().take(len).collect();
            let key = Key::new(&text);
            assert_eq!(key.as_bytes(), text.as_bytes(), "length {len}");
            assert_eq!(matches!(key, Key::Inline { .. }), text.len() <= INLINE_KEY);
        }
    }

    #[test]
    fn keys_that_differ_only_past_the_inline_part_count_separately() {
        let store = MemoryStore::with_clock(ManualClock::new());
        let policy = Policy::fixed_window(1, std::time::Duration::from_secs(1)).unwrap();
        let base = "k".repeat(INLINE_KEY);
        let keys = [
            base[..INLINE_KEY - 1].to_owned(),
            base.clone(),
            format!("{base}a"),
            format!("{base}b"),
        ];
        for key in &keys {
            assert!(store.check_now(key, &policy, 1).unwrap().allowed(), "{key}");
        }
        for key in &keys {
            assert!(
                !store.check_now(key, &policy, 1).unwrap().allowed(),
                "{key}"
            );
        }
        assert_eq!(store.len(), keys.len());
    }

    #[test]
    fn every_algorithm_keeps_its_own_table() {
        let store = MemoryStore::with_clock(ManualClock::new());
        let w = std::time::Duration::from_secs(1);
        let rate = crate::Rate::per_second(1);
        let policies = [
            Policy::gcra(rate, 1).unwrap(),
            Policy::token_bucket(rate, 1).unwrap(),
            Policy::leaky_bucket(rate, 1).unwrap(),
            Policy::fixed_window(1, w).unwrap(),
            Policy::sliding_window(1, w).unwrap(),
            Policy::sliding_log(1, w).unwrap(),
        ];
        for p in &policies {
            assert!(store.check_now("k", p, 1).unwrap().allowed(), "{p:?}");
            assert!(!store.check_now("k", p, 1).unwrap().allowed(), "{p:?}");
        }
        assert_eq!(store.len(), policies.len());
        store.clock().advance(std::time::Duration::from_secs(3));
        assert_eq!(store.sweep(), policies.len());
        assert!(store.is_empty());
    }
}

/// Model checks (`bash scripts/model-check`, under `--cfg tollgate_shuttle`): shuttle runs the
/// threads below in many interleavings of their locks and atomics (its PCT scheduler), and
/// each must end deadlock-free with exact totals.
#[cfg(all(test, tollgate_shuttle))]
mod model_checks {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::*;
    use crate::clock::ManualClock;
    use crate::sync::pct_runs;

    /// Checks each stack of keys (cost 1 each, all or nothing) on its own thread, all at once,
    /// and then that the store counted exactly what the admitted stacks took, and no key more
    /// than its limit.
    fn run_stacks(stacks: &[&[usize]], keys: usize, limit: u64) {
        let store = Arc::new(
            MemoryStore::builder()
                .shards(8)
                .clock(ManualClock::new())
                .build(),
        );
        let policy = Arc::new(Policy::fixed_window(limit, Duration::from_secs(60)).unwrap());
        // Keys in distinct shards, so that a stack locks several.
        let shard = |key: &str| {
            let inner = &store.inner;
            inner.shard_index(inner.hash(policy.id(), key.as_bytes()))
        };
        let mut names: Vec<String> = Vec::new();
        for i in 0.. {
            let name = format!("k{i}");
            if names.iter().all(|n| shard(n) != shard(&name)) {
                names.push(name);
            }
            if names.len() == keys {
                break;
            }
        }
        let names = Arc::new(names);
        let threads: Vec<_> = stacks
            .iter()
            .map(|stack| {
                let stack = stack.to_vec();
                let (store, policy, names) = (store.clone(), policy.clone(), names.clone());
                shuttle::thread::spawn(move || {
                    let checks: Vec<Check<'_>> = stack
                        .iter()
                        .map(|&k| Check::new(&names[k], &policy, 1))
                        .collect();
                    let admitted = store.check_all_now(&checks).unwrap().allowed();
                    (stack, admitted)
                })
            })
            .collect();
        let mut taken: HashMap<usize, u64> = HashMap::new();
        for thread in threads {
            let (stack, admitted) = thread.join().unwrap();
            if admitted {
                for k in stack {
                    *taken.entry(k).or_default() += 1;
                }
            }
        }
        for (k, name) in names.iter().enumerate() {
            let took = taken.get(&k).copied().unwrap_or(0);
            let left = store.check_now(name, &policy, 0).unwrap().remaining();
            assert!(
                took <= limit,
                "{name}: {took} admitted over a limit of {limit}"
            );
            assert_eq!(
                limit - left,
                took,
                "{name}: the store counted what was admitted"
            );
        }
    }

    #[test]
    fn stacks_in_opposite_orders_take_all_or_nothing() {
        // Two stacks name two keys in opposite orders (a deadlock if each locked its shards in
        // its own order), and the limit admits one of them.
        shuttle::check_pct(|| run_stacks(&[&[0, 1], &[1, 0]], 2, 1), pct_runs(), 3);
    }

    #[test]
    fn stacks_in_a_cycle_take_all_or_nothing() {
        // Three stacks over three keys in a cycle (the classic three-way deadlock), a fourth
        // takes one key alone, and a limit of one per key admits at most one stack of any two
        // that share a key. Too many interleavings to try them all: shuttle's PCT scheduler
        // samples them, weighted towards the orderings that find bugs of depth three.
        shuttle::check_pct(
            || run_stacks(&[&[0, 1], &[1, 2], &[2, 0], &[1]], 3, 1),
            pct_runs(),
            3,
        );
    }
}
