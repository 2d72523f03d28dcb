//! Requests in flight per key: an entry exists only while its count is above zero, so memory
//! follows the requests in flight, not the keys ever seen.

use std::hash::BuildHasher;
use std::sync::atomic::Ordering;

use hashbrown::HashTable;
use tokio::sync::Notify;

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
    /// One per shard: woken when a place of one of its keys is given back, while anyone waits.
    wakers: Box<[Notify]>,
    /// Woken when a place under the total cap is given back ([`InFlight::total_released`]).
    total_waker: Notify,
    /// Requests waiting for a place (see [`InFlight::wait_for`]).
    waiters: AtomicUsize,
}

impl InFlight {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Table::default())).collect(),
            hasher: crate::sync::HashState::default(),
            entries: AtomicUsize::new(0),
            wakers: (0..SHARDS).map(|_| Notify::new()).collect(),
            total_waker: Notify::new(),
            waiters: AtomicUsize::new(0),
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

    /// Takes places with `take`, waiting while it refuses: each refusal is kept in `refusal`,
    /// and the request waits until a place is given back, of the key whose hash `on` gives
    /// for the refusal (`None`: a place under the total cap), then tries again; `None` once
    /// `deadline` has passed (no deadline: it waits as long as it takes).
    ///
    /// Each try comes after the request counted itself among the waiters and registered its
    /// wake-up for the place it lacked, so that a place given back between a failed try and
    /// the wait still wakes it; refused for another place than that one, it registers again
    /// before it waits (the model checks below run this in many interleavings).
    pub(crate) async fn wait_for<S, T, E>(
        &self,
        state: &mut S,
        refusal: &mut E,
        on: impl Fn(&S, &E) -> Option<u64>,
        mut take: impl FnMut(&mut S) -> Result<T, E>,
        deadline: Option<tokio::time::Instant>,
    ) -> Option<T> {
        // Tries in a row that were refused for another place than the one registered for.
        let mut flips = 0u32;
        loop {
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let _waiting = Waiting(&self.waiters);
            let waits_on = on(state, refusal);
            let freed = match waits_on {
                Some(hash) => &self.wakers[self.shard_index(hash)],
                None => &self.total_waker,
            };
            let mut notified = std::pin::pin!(freed.notified());
            notified.as_mut().enable();
            match take(state) {
                Ok(taken) => return Some(taken),
                Err(again) => *refusal = again,
            }
            // Refused for another key (or the total cap) than the one it registered for: the
            // place it lacks now would not wake it; register for that one and try again (while
            // time is left: others taking and giving back places could keep it turning).
            if on(state, refusal) != waits_on {
                if deadline.is_some_and(|deadline| tokio::time::Instant::now() >= deadline) {
                    return None;
                }
                // A refusal that keeps flipping between keys under churn would otherwise turn
                // here without ever giving the thread back: from the second flip in a row, let
                // the other tasks run first.
                flips += 1;
                if flips > 1 {
                    YieldNow(false).await;
                }
                continue;
            }
            flips = 0;
            match deadline {
                Some(deadline) => {
                    if tokio::time::timeout_at(deadline, notified).await.is_err() {
                        return None;
                    }
                }
                None => notified.await,
            }
        }
    }

    /// A place under the total cap was given back: wakes those waiting for one.
    pub(crate) fn total_released(&self) {
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.total_waker.notify_waiters();
        }
    }

    /// Takes a place for `key` if it has fewer than `max` in flight; whether it did. A key
    /// already in flight takes its place without allocating.
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
    pub(crate) fn release(&self, hash: u64, key: &Key) {
        self.give_back_where(hash, |e| e.key == *key);
    }

    /// Gives back the place of `slot` (see [`InFlight::release`]).
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
        drop(table);
        // After the place is back, so a waiter that registered before its failed try is woken.
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.wakers[self.shard_index(hash)].notify_waiters();
        }
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

/// A request counted among the waiters of an [`InFlight`]; dropping it stops counting it.
struct Waiting<'a>(&'a AtomicUsize);

/// Returns `Pending` once (asking to be polled again at once), then `Ready`: lets the other
/// tasks on the thread run.
struct YieldNow(bool);

impl std::future::Future for YieldNow {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if std::mem::replace(&mut self.0, true) {
            return std::task::Poll::Ready(());
        }
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal that flips between two keys on every try (others taking and giving back
    /// places) does not keep the thread: the wait yields after the second flip in a row.
    /// Before, it turned without yielding for as long as the flips went on.
    #[test]
    fn a_refusal_that_keeps_flipping_yields_the_thread() {
        let t = InFlight::new();
        let tries = std::cell::Cell::new(0u32);
        let mut flip = 0u64;
        let (mut state, mut refusal) = ((), 0u64);
        let wait = t.wait_for(
            &mut state,
            &mut refusal,
            |_, refusal| Some(*refusal),
            |_| {
                tries.set(tries.get() + 1);
                assert!(tries.get() < 1_000, "turns without yielding");
                flip ^= 1;
                Err::<(), u64>(flip)
            },
            None,
        );
        let mut wait = std::pin::pin!(wait);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        assert!(tries.get() <= 3, "{} tries", tries.get());
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        assert!(tries.get() <= 6, "{} tries", tries.get());
    }

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
/// threads below in many interleavings of the table's locks and atomics (its PCT scheduler); a
/// wake-up lost in one of them leaves a waiter blocked for ever, which shuttle reports as a
/// deadlock.
#[cfg(all(test, tollgate_shuttle))]
mod model_checks {
    use std::sync::Arc;

    use super::*;

    /// Waits for a place of `key` (at most `max` in flight), as the concurrency layer's queue
    /// does, and gives it back.
    fn wait_take_release(t: &InFlight, key: &Key, max: u32) {
        let hash = t.hash(key.as_str());
        let taken = shuttle::future::block_on(t.wait_for(
            &mut (),
            &mut (),
            |_, _| Some(hash),
            |_| t.acquire(hash, key, max).then_some(()).ok_or(()),
            None,
        ));
        assert!(
            taken.is_some(),
            "no deadline: it waits until it has a place"
        );
        t.release(hash, key);
    }

    /// The holder of the only place gives it back while `waiters` others try, register or
    /// wait for it; each gets it in turn.
    fn hand_over(waiters: usize) {
        let t = Arc::new(InFlight::new());
        let key = Key::from("k");
        let hash = t.hash(key.as_str());
        assert!(t.acquire(hash, &key, 1));
        let threads: Vec<_> = (0..waiters)
            .map(|_| {
                let (t, key) = (Arc::clone(&t), key.clone());
                shuttle::thread::spawn(move || wait_take_release(&t, &key, 1))
            })
            .collect();
        t.release(hash, &key);
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!((t.count("k"), t.keys(), t.total()), (0, 0, 0));
    }

    #[test]
    fn a_waiter_is_woken_by_the_place_given_back() {
        shuttle::check_pct(|| hand_over(1), crate::sync::pct_runs(), 3);
    }

    #[test]
    fn waiters_are_woken_by_every_place_given_back() {
        shuttle::check_pct(|| hand_over(3), crate::sync::pct_runs(), 3);
    }

    #[test]
    fn a_waiter_refused_for_another_key_waits_for_that_one() {
        shuttle::check_pct(
            || {
                // Keys `a` and `b` (in different shards), one place each. The main thread holds
                // `b`; the waiter needs both, `a` first, and was refused for `b`. Another
                // request takes `a` and gives it back while `b` comes back: the waiter may be
                // refused next for `a`, and must then be woken by `a`.
                let t = Arc::new(InFlight::new());
                let shard = |key: &str| t.shard_index(t.hash(key));
                let a = Key::from("a");
                let b = (0..)
                    .map(|i| Key::from(format!("b{i}").as_str()))
                    .find(|b| shard(b.as_str()) != shard("a"))
                    .unwrap();
                let (ha, hb) = (t.hash(a.as_str()), t.hash(b.as_str()));
                assert!(t.acquire(hb, &b, 1));
                let waiter = {
                    let (t, a, b) = (Arc::clone(&t), a.clone(), b.clone());
                    shuttle::thread::spawn(move || {
                        let mut refusal = hb;
                        let taken = shuttle::future::block_on(t.wait_for(
                            &mut (),
                            &mut refusal,
                            |_, &lacked| Some(lacked),
                            |_| {
                                if !t.acquire(ha, &a, 1) {
                                    return Err(ha);
                                }
                                if !t.acquire(hb, &b, 1) {
                                    t.release(ha, &a);
                                    return Err(hb);
                                }
                                Ok(())
                            },
                            None,
                        ));
                        assert!(taken.is_some());
                        t.release(ha, &a);
                        t.release(hb, &b);
                    })
                };
                let other = {
                    let (t, a) = (Arc::clone(&t), a.clone());
                    shuttle::thread::spawn(move || {
                        if t.acquire(ha, &a, 1) {
                            t.release(ha, &a);
                        }
                    })
                };
                t.release(hb, &b);
                waiter.join().unwrap();
                other.join().unwrap();
                assert_eq!((t.keys(), t.total()), (0, 0));
            },
            crate::sync::pct_runs(),
            3,
        );
    }

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
