//! Requests in flight per key: an entry exists only while its count is above zero, so memory
//! follows the requests in flight, not the keys ever seen.

use std::hash::BuildHasher;
use std::sync::atomic::Ordering;

use hashbrown::HashTable;

use crate::key::Key;
use crate::sync::{AtomicUsize, Mutex};

/// Shards of the table: enough that cores rarely meet on one lock.
const SHARDS: usize = 32;

/// One shard: each key with requests in flight or waiting for a place.
type Shard = Mutex<Table>;

/// The entries of a shard, and the id its next entry gets.
#[derive(Default)]
struct Table {
    entries: HashTable<Entry>,
    next_id: u64,
}

// The shard's entries are what its lock is taken for.
impl std::ops::Deref for Table {
    type Target = HashTable<Entry>;

    fn deref(&self) -> &Self::Target {
        &self.entries
    }
}

impl std::ops::DerefMut for Table {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.entries
    }
}

/// A key's requests in flight, and those waiting for a place of it (the entry lives while
/// either is above zero).
struct Entry {
    key: Key,
    /// Unique in its shard for as long as the table lives: a place taken names its entry by
    /// it ([`Slot`]), without a copy of the key.
    id: u64,
    count: u32,
    waiting: u32,
}

/// A place taken of a key: its entry, by the key's hash and the entry's id. The entry lives
/// at least as long as the place (its count is above zero until the place is given back), so
/// a slot names one entry and no other, and gives the place back without the key.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot {
    hash: u64,
    id: u64,
}

pub(crate) struct InFlight {
    shards: Box<[Shard]>,
    hasher: crate::sync::HashState,
    /// Keys with requests in flight, over all shards.
    entries: AtomicUsize,
}

impl InFlight {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Table::default())).collect(),
            hasher: crate::sync::HashState::default(),
            entries: AtomicUsize::new(0),
        }
    }

    fn shard_index(&self, hash: u64) -> usize {
        // The table itself uses the low and the top bits; the shard takes others.
        usize::try_from(hash >> 40).unwrap_or(0) % self.shards.len()
    }

    pub(crate) fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    fn shard(&self, hash: u64) -> &Shard {
        &self.shards[self.shard_index(hash)]
    }

    /// Takes a place for `key` if it has fewer than `max` in flight; whether it did. A key
    /// already in flight takes its place without allocating. (The layer holds slots; tests
    /// count by key.)
    #[cfg(test)]
    pub(crate) fn acquire(&self, hash: u64, key: &Key, max: u32) -> bool {
        self.take(hash, key, max).is_some()
    }

    /// Takes a place for `key` if it has fewer than `max` in flight: its slot, to give it back
    /// with [`InFlight::give_back`]. A key already in flight takes its place without
    /// allocating.
    pub(crate) fn take(&self, hash: u64, key: &Key, max: u32) -> Option<Slot> {
        let mut table = self.shard(hash).lock();
        if let Some(entry) = table.find_mut(hash, |e| e.key == *key) {
            if entry.count >= max {
                return None;
            }
            entry.count += 1;
            return Some(Slot { hash, id: entry.id });
        }
        if max == 0 {
            return None;
        }
        let id = self.insert(&mut table, hash, key, 1, 0);
        Some(Slot { hash, id })
    }

    /// Inserts the entry of `key`: its id.
    fn insert(&self, table: &mut Table, hash: u64, key: &Key, count: u32, waiting: u32) -> u64 {
        let id = table.next_id;
        table.next_id += 1;
        let entry = Entry {
            key: key.clone(),
            id,
            count,
            waiting,
        };
        table
            .entries
            .insert_unique(hash, entry, |e| self.hasher.hash_one(e.key.as_str()));
        self.entries.fetch_add(1, Ordering::Relaxed);
        id
    }

    /// Counts a request waiting for a place of `key`, if fewer than `max` already wait for
    /// one; whether it did. Give it back with [`InFlight::leave_queue`].
    pub(crate) fn enter_queue(&self, hash: u64, key: &Key, max: u32) -> bool {
        let mut table = self.shard(hash).lock();
        if let Some(entry) = table.find_mut(hash, |e| e.key == *key) {
            if entry.waiting >= max {
                return false;
            }
            entry.waiting += 1;
            return true;
        }
        if max == 0 {
            return false;
        }
        self.insert(&mut table, hash, key, 0, 1);
        true
    }

    /// A request stopped waiting for a place of `key`.
    pub(crate) fn leave_queue(&self, hash: u64, key: &Key) {
        let mut table = self.shard(hash).lock();
        if let Ok(mut entry) = table.find_entry(hash, |e| e.key == *key) {
            let e = entry.get_mut();
            e.waiting = e.waiting.saturating_sub(1);
            if e.count == 0 && e.waiting == 0 {
                entry.remove();
                self.entries.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Gives a place of `key` back; the entry goes when its count reaches zero.
    #[cfg(test)]
    pub(crate) fn release(&self, hash: u64, key: &Key) {
        self.give_back_where(hash, |e| e.key == *key);
    }

    /// Gives back the place of `slot`; the entry goes when its count reaches zero (and nobody
    /// waits for it).
    pub(crate) fn give_back(&self, slot: Slot) {
        self.give_back_where(slot.hash, |e| e.id == slot.id);
    }

    fn give_back_where(&self, hash: u64, is: impl Fn(&Entry) -> bool) {
        let mut table = self.shard(hash).lock();
        if let Ok(mut entry) = table.find_entry(hash, is) {
            let e = entry.get_mut();
            e.count = e.count.saturating_sub(1);
            if e.count == 0 && e.waiting == 0 {
                entry.remove();
                self.entries.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// The requests in flight for `key`, whose hash is `hash`.
    pub(crate) fn count_of(&self, hash: u64, key: &Key) -> u32 {
        self.shard(hash)
            .lock()
            .find(hash, |e| e.key == *key)
            .map_or(0, |e| e.count)
    }

    /// The requests in flight for `key`.
    pub(crate) fn count(&self, key: &str) -> u32 {
        let hash = self.hash(key);
        self.shard(hash)
            .lock()
            .find(hash, |e| e.key.as_str() == key)
            .map_or(0, |e| e.count)
    }

    /// The keys with requests in flight or waiting.
    pub(crate) fn keys(&self) -> usize {
        self.entries.load(Ordering::Relaxed)
    }

    /// All requests in flight, over every key.
    pub(crate) fn total(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.lock().iter().map(|e| u64::from(e.count)).sum::<u64>())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_live_while_counts_are_above_zero() {
        let t = InFlight::new();
        let key = Key::from("k");
        let h = t.hash(key.as_str());
        assert!(t.acquire(h, &key, 2));
        assert!(t.acquire(h, &key, 2));
        assert!(!t.acquire(h, &key, 2));
        assert_eq!((t.count("k"), t.keys(), t.total()), (2, 1, 2));
        t.release(h, &key);
        assert!(t.acquire(h, &key, 2));
        t.release(h, &key);
        t.release(h, &key);
        assert_eq!((t.count("k"), t.keys(), t.total()), (0, 0, 0));
        // A release with nothing in flight changes nothing; a limit of zero admits nothing.
        t.release(h, &key);
        assert_eq!(t.keys(), 0);
        assert!(!t.acquire(h, &key, 0));
        assert_eq!(t.keys(), 0);
    }

    /// A slot names its entry and no other: given back, it frees the place it took; kept
    /// past its entry's end (a bug), it cannot free a place of the key's next entry.
    #[test]
    fn a_slot_gives_back_the_place_of_its_own_entry() {
        let t = InFlight::new();
        let (a, b) = (Key::from("a"), Key::from("b"));
        let (ha, hb) = (t.hash(a.as_str()), t.hash(b.as_str()));
        let first = t.take(ha, &a, 2).unwrap();
        let second = t.take(ha, &a, 2).unwrap();
        assert!(t.take(ha, &a, 2).is_none());
        let other = t.take(hb, &b, 1).unwrap();
        t.give_back(first);
        assert_eq!((t.count("a"), t.count("b"), t.keys()), (1, 1, 2));
        t.give_back(second);
        t.give_back(other);
        assert_eq!(
            (t.count("a"), t.count("b"), t.keys(), t.total()),
            (0, 0, 0, 0)
        );
        // The key's next entry has a new id: the old slot frees nothing of it.
        let _next = t.take(ha, &a, 2).unwrap();
        t.give_back(first);
        assert_eq!((t.count("a"), t.keys()), (1, 1));
    }

    #[test]
    fn waiters_keep_the_entry_and_are_bounded_per_key() {
        let t = InFlight::new();
        let key = Key::from("k");
        let h = t.hash(key.as_str());
        assert!(t.acquire(h, &key, 1));
        assert!(t.enter_queue(h, &key, 2));
        assert!(t.enter_queue(h, &key, 2));
        assert!(!t.enter_queue(h, &key, 2), "two wait already");
        t.release(h, &key);
        assert_eq!((t.count("k"), t.keys()), (0, 1), "kept for its waiters");
        t.leave_queue(h, &key);
        assert!(
            t.acquire(h, &key, 1),
            "the waiting do not count as in flight"
        );
        t.leave_queue(h, &key);
        t.release(h, &key);
        assert_eq!((t.count("k"), t.keys(), t.total()), (0, 0, 0));
        // A key with no entry: the waiter makes one, and it goes with the waiter.
        assert!(t.enter_queue(h, &key, 1));
        assert_eq!(t.keys(), 1);
        t.leave_queue(h, &key);
        assert_eq!(t.keys(), 0);
        assert!(!t.enter_queue(h, &key, 0));
        assert_eq!(t.keys(), 0);
    }
}

/// Model checks (`bash scripts/model-check`, under `--cfg tollgate_shuttle`): shuttle runs the
/// threads below in many interleavings of the table's locks and atomics (its PCT scheduler).
/// The hand-over of places to waiters is checked with the queue ([`fair`](super::fair)).
#[cfg(all(test, tollgate_shuttle))]
mod model_checks {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn counts_return_to_zero_and_never_pass_the_limit() {
        shuttle::check_pct(
            || {
                let t = Arc::new(InFlight::new());
                let peak = Arc::new(crate::sync::AtomicU32::new(0));
                let threads: Vec<_> = (0..3)
                    .map(|_| {
                        let (t, peak) = (Arc::clone(&t), Arc::clone(&peak));
                        shuttle::thread::spawn(move || {
                            let key = Key::from("k");
                            let hash = t.hash(key.as_str());
                            if t.acquire(hash, &key, 2) {
                                peak.fetch_max(t.count("k"), Ordering::SeqCst);
                                t.release(hash, &key);
                            }
                        })
                    })
                    .collect();
                for thread in threads {
                    thread.join().unwrap();
                }
                assert!(peak.load(Ordering::SeqCst) <= 2);
                assert_eq!((t.count("k"), t.keys(), t.total()), (0, 0, 0));
            },
            crate::sync::pct_runs(),
            3,
        );
    }
}
