//! The in-process store.

use std::fmt;
use std::future::{Ready, ready};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashTable;
use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;

use super::{Check, NOTHING_TO_CHECK, Store, StoreError};
use crate::algorithm::{State, Update};
use crate::clock::{Clock, SystemClock};
use crate::{Decision, Policy};

/// The default cap on tracked (key, policy) pairs.
pub const DEFAULT_MAX_KEYS: usize = 1 << 20;
/// The default number of shards.
pub const DEFAULT_SHARDS: usize = 64;
/// The default longest key, in bytes.
pub const DEFAULT_MAX_KEY_LEN: usize = 512;

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
///   changes no decision (a recovered key is indistinguishable from a new one). If the shard is
///   still full of live state, the sixteenth of it closest to recovery is forgotten, so a flood
///   of new keys cannot grow memory; those keys may then be admitted early, and
///   [`MemoryStore::evicted`] counts them. Size `max_keys` above your live key count.
/// - **Cost per key.** A tracked pair takes one 64-byte slot in a hash table (plus a control
///   byte and the table's spare capacity) and a heap copy of the key; a sliding log adds 16
///   bytes per entry. BENCHMARKS.md has the measured figure.
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
    hasher: foldhash::fast::RandomState,
    shards: Box<[Padded]>,
    mask: usize,
    shard_cap: usize,
    max_key_len: usize,
    evicted: AtomicU64,
}

/// One shard on its own cache lines, so that two threads on two shards never share one.
#[repr(align(128))]
struct Padded(Mutex<Shard>);

#[derive(Default)]
struct Shard {
    table: HashTable<Slot>,
}

struct Slot {
    policy: u64,
    /// When `state` will have fully recovered (`State::recovered_at`).
    expires: u64,
    key: Box<str>,
    state: State,
}

impl Slot {
    fn is(&self, policy: u64, key: &str) -> bool {
        self.policy == policy && *self.key == *key
    }

    #[inline]
    fn decide(&self, policy: &Policy, now: u64, cost: u64) -> (Decision, Update) {
        if self.state.fits(policy) {
            self.state.decide(policy, now, cost)
        } else {
            // Only after a 64-bit collision of policy fingerprints: start afresh.
            State::fresh(policy).decide(policy, now, cost)
        }
    }

    #[inline]
    fn apply(&mut self, policy: &Policy, update: Update) {
        if !self.state.fits(policy) {
            self.state = State::fresh(policy);
        }
        self.state.apply(policy, update);
        self.expires = self.state.recovered_at(policy);
    }
}

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
        let now = inner.clock.now();
        let hash = inner.hash(policy.id(), key);
        let mut shard = inner.shard(hash);
        if let Some(slot) = shard.table.find_mut(hash, |s| s.is(policy.id(), key)) {
            let (decision, update) = slot.decide(policy, now, cost);
            if decision.allowed() && cost > 0 {
                slot.apply(policy, update);
            }
            return Ok(decision);
        }
        let mut state = State::fresh(policy);
        let (decision, update) = state.decide(policy, now, cost);
        if decision.allowed() && cost > 0 {
            state.apply(policy, update);
            let slot = Slot {
                policy: policy.id(),
                expires: state.recovered_at(policy),
                key: key.into(),
                state,
            };
            inner.insert(&mut shard, hash, slot, now);
        }
        Ok(decision)
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
                    hash: inner.hash(id, check.key()),
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

        let mut verdict: Option<Decision> = None;
        for item in &mut items {
            let shard = guard_for(&mut guards, inner.shard_index(item.hash));
            let (decision, update) = match shard
                .table
                .find(item.hash, |s| s.is(item.policy.id(), item.key))
            {
                Some(slot) => slot.decide(item.policy, now, item.cost),
                None => State::fresh(item.policy).decide(item.policy, now, item.cost),
            };
            item.update = Some(update);
            let decision = decision.with_index(item.index);
            verdict = Some(verdict.map_or(decision, |v| v.most_restrictive(decision)));
        }
        let verdict = verdict.unwrap_or(NOTHING_TO_CHECK);
        if !verdict.allowed() {
            return Ok(verdict);
        }
        for item in &items {
            let Some(update) = item.update else { continue };
            if item.cost == 0 {
                continue;
            }
            let shard = guard_for(&mut guards, inner.shard_index(item.hash));
            match shard
                .table
                .find_mut(item.hash, |s| s.is(item.policy.id(), item.key))
            {
                Some(slot) => slot.apply(item.policy, update),
                None => {
                    let mut state = State::fresh(item.policy);
                    state.apply(item.policy, update);
                    let slot = Slot {
                        policy: item.policy.id(),
                        expires: state.recovered_at(item.policy),
                        key: item.key.into(),
                        state,
                    };
                    inner.insert(shard, item.hash, slot, now);
                }
            }
        }
        Ok(verdict)
    }

    /// The number of (key, policy) pairs tracked, recovered or not.
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| s.0.lock().table.len())
            .sum()
    }

    /// Whether no pair is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every pair whose state has fully recovered, and returns how many. Never changes
    /// a decision; the store does it by itself when a shard fills, so calling it is optional
    /// (it returns memory to the allocator sooner after a burst of keys).
    pub fn sweep(&self) -> usize {
        let now = self.inner.clock.now();
        self.inner
            .shards
            .iter()
            .map(|s| {
                let mut shard = s.0.lock();
                let before = shard.table.len();
                shard.table.retain(|slot| slot.expires > now);
                shard
                    .table
                    .shrink_to_fit(|slot| self.inner.hash(slot.policy, &slot.key));
                before - shard.table.len()
            })
            .sum()
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

impl<C> Inner<C> {
    #[inline]
    fn hash(&self, policy: u64, key: &str) -> u64 {
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

    fn insert(&self, shard: &mut Shard, hash: u64, slot: Slot, now: u64) {
        if shard.table.len() >= self.shard_cap {
            let evicted = make_room(shard, self.shard_cap, now);
            if evicted > 0 {
                self.evicted.fetch_add(evicted, Ordering::Relaxed);
            }
        }
        shard
            .table
            .insert_unique(hash, slot, |s| self.hash(s.policy, &s.key));
    }
}

/// Drops every recovered slot; if the shard is still full, forgets the sixteenth of it closest
/// to recovery. Returns how many live slots were forgotten.
fn make_room(shard: &mut Shard, cap: usize, now: u64) -> u64 {
    shard.table.retain(|slot| slot.expires > now);
    let len = shard.table.len();
    if len < cap {
        return 0;
    }
    let quota = (cap / 16).clamp(1, len);
    let mut expiries: Vec<u64> = shard.table.iter().map(|s| s.expires).collect();
    let (_, &mut threshold, _) = expiries.select_nth_unstable(quota - 1);
    let below = expiries.iter().filter(|&&e| e < threshold).count();
    let mut ties = quota - below;
    shard.table.retain(|slot| {
        if slot.expires < threshold {
            false
        } else if slot.expires == threshold && ties > 0 {
            ties -= 1;
            false
        } else {
            true
        }
    });
    quota as u64
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
}

/// Configures a [`MemoryStore`]; made by [`MemoryStore::builder`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder<C = SystemClock> {
    clock: C,
    max_keys: usize,
    shards: usize,
    max_key_len: usize,
}

impl<C: Clock> MemoryStoreBuilder<C> {
    /// The clock to read time from.
    pub fn clock<C2: Clock>(self, clock: C2) -> MemoryStoreBuilder<C2> {
        MemoryStoreBuilder {
            clock,
            max_keys: self.max_keys,
            shards: self.shards,
            max_key_len: self.max_key_len,
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

    /// Builds the store.
    pub fn build(self) -> MemoryStore<C> {
        let mut shards = self.shards.next_power_of_two();
        while shards > 1 && shards > self.max_keys {
            shards /= 2;
        }
        let inner = Inner {
            clock: self.clock,
            hasher: foldhash::fast::RandomState::default(),
            shards: (0..shards)
                .map(|_| Padded(Mutex::new(Shard::default())))
                .collect(),
            mask: shards - 1,
            shard_cap: self.max_keys.div_ceil(shards),
            max_key_len: self.max_key_len,
            evicted: AtomicU64::new(0),
        };
        MemoryStore {
            inner: Arc::new(inner),
        }
    }
}
