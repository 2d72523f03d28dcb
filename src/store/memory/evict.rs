//! Forgetting pairs: what a full shard gives away (ranks), the order in which slots recover,
//! and the sweeps and scans that free them.

use std::cmp::{self, Reverse};
use std::collections::BinaryHeap;

use super::kept::Kept;
use super::shard::{Shard, Slot, Tables, on_table};

/// What forgetting a live slot gives away, compared when a full shard must forget some: the
/// units it has consumed as of now, then its expiry (of two slots as consumed, the one closer
/// to recovery goes first).
pub(super) type Rank = (u64, u64);

/// The rank at `now` of `slot`, of a policy whose period is `period`.
#[inline]
pub(super) fn rank<S: Kept>(slot: &Slot<S>, period: u64, now: u64) -> Rank {
    (slot.state.consumed(period, now), slot.state.expires())
}

/// `nanos` of a bucket's backlog in units of `period`, rounded up: a bucket `nanos` short of
/// full admits `limit - units` at once.
#[inline]
pub(super) fn units(nanos: u64, period: u64) -> u64 {
    nanos.div_ceil(period.max(1))
}

/// What a shard knows of which slots recover first, so that a full shard can usually free a
/// recovered slot without scanning the others. It relies on expiries never moving earlier (a
/// commit never brings recovery closer), so a time recorded for a slot stays a lower bound.
///
/// Every slot either has an entry in `due` no later than its expiry, or expires at `later` or
/// after.
#[derive(Default)]
pub(super) struct Soonest {
    /// The slots that may recover soonest: the sixteenth of the shard closest to recovery at
    /// the last scan, and the slots tracked since that are due before `later`.
    pub(super) due: BinaryHeap<Reverse<Due>>,
    /// No slot outside `due` recovers before this time (zero, i.e. unknown, until a scan).
    pub(super) later: u64,
    /// How many times the shard was scanned to make room.
    #[cfg(test)]
    pub(super) scans: u64,
}

/// A slot in [`Soonest::due`]: its policy's id, its hash, and a time before which it cannot
/// have recovered. Ordered by time first.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Due {
    pub(super) at: u64,
    pub(super) hash: u64,
    pub(super) policy: u64,
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
    pub(super) fn track(&mut self, due: Due) {
        if due.at < self.later {
            self.due.push(Reverse(due));
        }
    }

    /// Forgets the order (after a sweep): the next full shard scans.
    pub(super) fn reset(&mut self) {
        self.due = BinaryHeap::new();
        self.later = 0;
    }
}

/// What became of a slot found through [`Soonest::due`].
pub(super) enum Found {
    /// It had recovered, and is forgotten.
    Recovered,
    /// It is live until this time.
    Live(u64),
    /// It is no longer tracked.
    Gone,
}

/// The `n` smallest of some values (expiries, or ranks): those below `at`, and `ties` of those
/// equal to `at`.
pub(super) struct Cut<T> {
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

impl Shard {
    /// Keeps the slots for which `keep(expiry)` is true.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(u64) -> bool) {
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
    pub(super) fn shrink_to_fit(&mut self, hash: impl Fn(u64, &[u8]) -> u64) {
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
    pub(super) fn make_room(
        &mut self,
        cap: usize,
        now: u64,
        hash: impl Fn(u64, &[u8]) -> u64,
    ) -> u64 {
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
