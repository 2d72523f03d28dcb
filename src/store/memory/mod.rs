//! The in-process store.

mod evict;
mod kept;
mod key;
mod shard;

use std::cmp::Reverse;
use std::fmt;
use std::future::{Ready, ready};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use self::evict::Due;
use self::kept::{Kept, Timed, Update, with_kept};
use self::key::Key;
use self::shard::{ByPolicy, Padded, Shard, Slot};
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
///   shards (64 by default) by a keyed hash. A check reads the clock before it takes the
///   lock, and again under it only if its shard has decided later than that reading (it was
///   held up on the way): never in the past of a decision it finds committed, however long it
///   waited.
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
        // The time is read before the locks, and again under them only if a shard locked has
        // a later decision (`Shard::decide_at`); every shard locked keeps it as its latest.
        let read = inner.clock.now();
        let mut guards: SmallVec<[(usize, MutexGuard<'_, Shard>); 8]> = order
            .iter()
            .map(|&i| (i, inner.shards[i].0.lock()))
            .collect();
        let latest = guards.iter().fold(0, |t, (_, g)| t.max(g.now));
        let now = if read < latest {
            shard::reread(&inner.clock)
        } else {
            read
        };
        for (_, guard) in &mut guards {
            guard.now = now;
        }

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
        // Read before the lock (a reading under it made every check's critical section
        // longer), and again under it only if the shard has a later decision: see
        // `Shard::decide_at`.
        let read = self.clock.now();
        let id = policy.id();
        let hash = self.hash(id, key.as_bytes());
        let mut shard = self.shard(hash);
        let now = shard.decide_at(read, &self.clock);
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

    use super::evict::{Rank, rank};
    use super::key::INLINE_KEY;
    use super::shard::{Tables, on_table};
    use super::*;
    use crate::Rate;
    use crate::clock::ManualClock;

    /// A decision is never taken in the past of what it finds committed. A thread reads the
    /// time, is held up (preempted, or waiting for the shard's lock), and meanwhile another
    /// checks one of its keys later: the first must then decide at a time no earlier than that
    /// check's, as if it had come after it, never at the time it read. Decided at the time it
    /// read, it saw the other's commit as its future: a GCRA far below its limit refused a
    /// request (the Envoy bench's unreachable limit), and GCRA, the fixed window and the
    /// sliding window counter answered for a moment already past (24 of the 48 cases below
    /// fail so; the token bucket, the leaky bucket and the sliding log keep the time they last
    /// moved to, and decide at no earlier time by themselves).
    ///
    /// The clock below, once armed, lets another check of the key (`step` later) come in
    /// between whenever the store reads the time while its shards are free, as another thread
    /// could; read under the lock, nothing can come in between, and the check decides at the
    /// time it read. Either way its decision must be the one of a store that saw the same
    /// checks in that order at those times (a manual clock, no race). Every algorithm, a single
    /// check and a stacked one. (This replaces `a_decision_reads_its_time_under_the_lock`, which
    /// asserted the mechanism of the first fix: that nothing comes in between.)
    #[cfg(not(tollgate_shuttle))]
    #[test]
    fn a_decision_is_never_in_the_past_of_what_it_finds_committed() {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::{Arc, Mutex as StdMutex, OnceLock};

        /// A check that another thread makes while the store reads the time.
        type Intruder = (String, Policy, u64);

        #[derive(Clone)]
        struct Racing {
            store: Arc<OnceLock<MemoryStore<Racing>>>,
            time: Arc<AtomicU64>,
            armed: Arc<StdMutex<Option<Intruder>>>,
            came_in: Arc<AtomicBool>,
        }
        impl Clock for Racing {
            fn now(&self) -> u64 {
                let at = self.time.load(Ordering::SeqCst);
                let armed = self.armed.lock().unwrap().take();
                if let Some((key, policy, step)) = armed {
                    let store = self.store.get().unwrap();
                    let free = store.inner.shards.iter().all(|s| s.0.try_lock().is_some());
                    if free {
                        self.time.store(at + step, Ordering::SeqCst);
                        store.check_now(&key, &policy, 1).unwrap();
                        self.came_in.store(true, Ordering::SeqCst);
                    }
                }
                at
            }
        }

        let s = Duration::from_secs;
        let rate = Rate::per_second(2);
        let policies = [
            Policy::gcra(rate, 2).unwrap(),
            Policy::token_bucket(rate, 2).unwrap(),
            Policy::leaky_bucket(rate, 2).unwrap(),
            Policy::fixed_window(2, s(1)).unwrap(),
            Policy::sliding_window(2, s(1)).unwrap(),
            Policy::sliding_log(2, s(1)).unwrap(),
        ];
        let other = Policy::fixed_window(100, s(60)).unwrap();
        let start = 10_000_000_000;
        let mut wrong = Vec::new();
        for policy in &policies {
            for step in [1, 400_000_000, 700_000_000, 1_000_000_000] {
                for stacked in [false, true] {
                    let clock = Racing {
                        store: Arc::new(OnceLock::new()),
                        time: Arc::new(AtomicU64::new(start)),
                        armed: Arc::new(StdMutex::new(None)),
                        came_in: Arc::new(AtomicBool::new(false)),
                    };
                    let shards = if stacked { 8 } else { 1 };
                    let store = MemoryStore::builder()
                        .clock(clock.clone())
                        .shards(shards)
                        .build();
                    assert!(clock.store.set(store.clone()).is_ok());
                    let reference = MemoryStore::with_clock(ManualClock::new());
                    reference.clock().set(Duration::from_nanos(start));
                    // One request first, then the held-up one and the one that comes in.
                    let checks = [Check::new("k", policy, 1), Check::new("j", &other, 1)];
                    let checks = if stacked { &checks[..] } else { &checks[..1] };
                    for store in [
                        &store.check_now("k", policy, 1),
                        &reference.check_now("k", policy, 1),
                    ] {
                        assert!(store.as_ref().unwrap().allowed());
                    }
                    *clock.armed.lock().unwrap() = Some(("k".to_owned(), policy.clone(), step));
                    let held_up = store.check_all_now(checks).unwrap();
                    if clock.came_in.load(Ordering::SeqCst) {
                        reference.clock().advance(Duration::from_nanos(step));
                        reference.check_now("k", policy, 1).unwrap();
                    }
                    let expected = reference.check_all_now(checks).unwrap();
                    // And the store goes on from there as the reference does.
                    let (after, expected_after) =
                        (store.check_all_now(checks), reference.check_all_now(checks));
                    let got = format!("{held_up:?}, then {after:?}");
                    let want = format!("{expected:?}, then {expected_after:?}");
                    if got != want {
                        let case = format!("{:?}, {step} ns later", policy.algorithm());
                        let case = format!("{case}, {} checks", checks.len());
                        wrong.push(format!("{case}:\n  got  {got}\n  want {want}"));
                    }
                }
            }
        }
        assert!(
            wrong.is_empty(),
            "{} of 48 cases:\n{}",
            wrong.len(),
            wrong.join("\n")
        );
    }

    /// A clock that goes back (a manual one set back, as the differential test with Redis does
    /// to mirror a stepped wall clock) is taken by each state as it takes any earlier time, as
    /// Redis's scripts take it: the decision is the algorithm's at the time read, not at the
    /// time of a later decision of its shard (another key's, or its own refused). Only a
    /// reading earlier than its shard's latest decision is read again, under the lock: a
    /// thread held up then gets the clock's time, a clock gone back its own.
    #[test]
    fn a_clock_gone_back_is_taken_as_each_state_takes_it() {
        let ms = |n| Duration::from_millis(n).as_nanos() as u64;
        let policy = Policy::gcra(Rate::per_second(1), 1).unwrap();
        let store = one_shard(16);
        let mut state = crate::algorithm::Gcra::default();
        let times = [
            10_000, 10_900, 10_500, 10_700, 10_200, 11_000, 10_950, 12_000,
        ];
        for t in times.map(ms) {
            store.clock().set(Duration::from_nanos(t));
            // Another key of the same shard, decided at each time first.
            store.check_now("other", &policy, 1).unwrap();
            let got = store.check_now("k", &policy, 1).unwrap();
            let (next, want) = state.check(policy.limit(), policy.period_nanos(), t, 1);
            if want.allowed() {
                state = next;
            }
            assert_eq!(format!("{got:?}"), format!("{want:?}"), "at {t} ns");
        }
    }

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
