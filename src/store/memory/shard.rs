//! A shard: one hash table of slots per policy, each slot only as large as its algorithm's
//! state.

use hashbrown::HashTable;

use super::evict::Soonest;
use super::kept::{Kept, Timed};
use super::key::Key;
use crate::Policy;
use crate::algorithm::{FixedWindow, Gcra, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket};
use crate::clock::Clock;
use crate::sync::Mutex;

/// One shard on its own cache lines, so that two threads on two shards never share one.
#[repr(align(128))]
pub(super) struct Padded(pub(super) Mutex<Shard>);

/// A shard keeps one hash table per policy (of one algorithm), so that each slot is only as
/// large as its own algorithm's state needs and holds no policy fingerprint (a GCRA slot is 32
/// bytes: the key and the theoretical arrival time).
#[derive(Default)]
pub(super) struct Shard {
    /// The pairs of each policy that has some in the shard. A policy's table goes with its last
    /// pair, so there are never more tables than pairs (and usually a handful).
    pub(super) policies: Vec<ByPolicy>,
    /// The position of each policy in `policies`, by id (already a hash): searched only when
    /// there are more than [`FEW_POLICIES`], a handful being quicker to compare one by one.
    pub(super) index: HashTable<usize>,
    /// How many pairs the tables hold.
    pub(super) len: usize,
    pub(super) order: Soonest,
    /// The latest time a decision in this shard was taken at ([`Shard::decide_at`]).
    pub(super) now: u64,
}

/// The clock read again, under a shard's lock: [`Shard::decide_at`] for a reading earlier than
/// the shard's latest decision (a thread held up, or a clock gone back), and a stacked check
/// likewise.
#[cold]
#[inline(never)]
pub(super) fn reread(clock: &impl Clock) -> u64 {
    clock.now()
}

/// Up to how many policies a shard finds a policy's table by comparing ids in turn.
const FEW_POLICIES: usize = 4;

/// The pairs of one policy in a shard.
pub(super) struct ByPolicy {
    pub(super) id: u64,
    /// The policy's period, so that a scan can count what each pair has consumed, in units of
    /// its own policy, without the policy at hand.
    pub(super) period: u64,
    pub(super) table: Tables,
}

/// A policy's table: slots of its algorithm's state.
pub(super) enum Tables {
    Gcra(Table<Gcra>),
    TokenBucket(Table<Timed<TokenBucket>>),
    LeakyBucket(Table<LeakyBucket>),
    FixedWindow(Table<Timed<FixedWindow>>),
    SlidingWindow(Table<Timed<SlidingWindow>>),
    SlidingLog(Table<Timed<SlidingLog>>),
}

pub(super) type Table<S> = HashTable<Slot<S>>;

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
    pub(super) fn len(&self) -> usize {
        on_table!(self, t => t.len())
    }
}

/// The state of one (key, policy) pair.
pub(super) struct Slot<S: Kept> {
    pub(super) key: Key,
    pub(super) state: S,
}

impl<S: Kept> Slot<S> {
    #[inline]
    pub(super) fn is(&self, key: &str) -> bool {
        self.key.is(key.as_bytes())
    }
}

impl Shard {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The time to decide at, for a check that read `read` from `clock` just before it took
    /// this shard's lock, which becomes the time of the shard's latest decision.
    ///
    /// Nearly always the reading itself: no decision of the shard is later, so the check is
    /// decided as if it had read the clock under the lock, without the reading inside the
    /// critical section (it made every check's longer). A reading earlier than the shard's
    /// latest decision is read again, now under the lock ([`reread`]): a thread held up between
    /// its reading and the lock (preempted, or waiting for the lock) then gets a time no earlier
    /// than any decision it finds committed (decided at its first reading, it saw them as its
    /// future: a GCRA far below its limit refused, as GCRA, the fixed window and the sliding
    /// window counter cannot tell from their state when they last moved); a clock gone back
    /// (only a manual one, in tests, or a custom clock against the [`Clock`] contract) gets its
    /// own time again, which each state takes as it takes any earlier time, as Redis's scripts
    /// do. Either way, the times of a shard's decisions follow the order in which they are
    /// taken, as when the clock was read under the lock (with a clock that does not go back).
    ///
    /// A branch, not a `max`: the reading is nearly always the later, and the decision's
    /// arithmetic can then start from it before the mark is loaded (behind the lock).
    #[inline]
    pub(super) fn decide_at(&mut self, read: u64, clock: &impl Clock) -> u64 {
        let now = if read < self.now { reread(clock) } else { read };
        self.now = now;
        now
    }

    /// Where policy `id` is in `policies`, if it has pairs in the shard.
    #[inline]
    pub(super) fn position(&self, id: u64) -> Option<usize> {
        if self.policies.len() <= FEW_POLICIES {
            self.policies.iter().position(|p| p.id == id)
        } else {
            let at = |&pos: &usize| self.policies.get(pos).is_some_and(|p| p.id == id);
            self.index.find(id, at).copied()
        }
    }

    /// The table of policy `id`, if it has pairs in the shard and keeps `K`.
    #[inline]
    pub(super) fn table<K: Kept>(&self, id: u64) -> Option<&Table<K>> {
        K::table(&self.policies.get(self.position(id)?)?.table)
    }

    /// [`Shard::table`], to change.
    #[inline]
    pub(super) fn table_mut<K: Kept>(&mut self, id: u64) -> Option<&mut Table<K>> {
        let pos = self.position(id)?;
        K::table_mut(&mut self.policies.get_mut(pos)?.table)
    }

    /// Tracks a new pair of `policy`, in its table (made if it is the first).
    pub(super) fn insert_slot<K: Kept>(
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
    pub(super) fn remove_policy(&mut self, pos: usize) {
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
    pub(super) fn drop_empty_tables(&mut self) {
        self.policies.retain(|p| p.table.len() > 0);
        self.index.clear();
        for (pos, p) in self.policies.iter().enumerate() {
            let policies = &self.policies;
            let rehash_pos = |&p: &usize| policies.get(p).map_or(0, |p| p.id);
            self.index.insert_unique(p.id, pos, rehash_pos);
        }
        self.len = self.policies.iter().map(|p| p.table.len()).sum();
    }
}

pub(super) use on_table;
