//! The tenants of fair shedding: who asked recently, the places each holds and its waiters,
//! and when each was last given a place.
//!
//! One table under one lock, its entries keyed by the hash of the tenant's key (64 bits of a
//! seeded hash: two tenants meet on one entry with a chance of about one in 2^64 per pair). An
//! entry lives while its tenant holds a place or waits, and for [`RECENT`] after it last asked;
//! so the tenants counted for a fair share are those in flight, waiting, or that asked (and
//! were admitted or refused) within the last second. At most [`MAX_TENANTS`] entries are kept:
//! past that, the tenants that find no entry share one (the overflow entry), as if they were
//! one tenant, until entries expire. The table is allocated whole when the layer is built, so
//! a request never allocates in it.

use crate::sync::Mutex;
use std::collections::HashMap;

/// How long a tenant that asked is counted for the fair share after it last asked, on the
/// layer's clock, in nanoseconds: one second (ten CoDel intervals at their default).
pub(super) const RECENT: u64 = 1_000_000_000;
/// The most tenants the table tells apart.
pub(super) const MAX_TENANTS: usize = 4_096;
/// Entries that expired are cleared at most this often (so a tenant is counted for
/// [`RECENT`] and up to an eighth more).
const SWEEP: u64 = RECENT / 8;
/// The entry of the tenants that found the table full. A real tenant whose hash is this one
/// is moved to `OVERFLOW + 1`.
const OVERFLOW: u64 = 0;

/// A tenant's entry.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Tenant {
    /// When it last asked.
    pub(super) seen: u64,
    /// Its places in flight.
    pub(super) held: u32,
    /// Its requests in the queue.
    pub(super) waiting: u32,
    /// When it was last given a place (0: never).
    pub(super) served: u64,
}

pub(super) struct Tenants {
    table: Mutex<Table>,
}

pub(super) struct Table {
    entries: HashMap<u64, Tenant, foldhash::fast::RandomState>,
    /// Entries whose tenant holds no place.
    empty: usize,
    /// When expired entries were last cleared.
    swept: u64,
}

impl Table {
    /// The tenants counted for a fair share: in flight, waiting, or seen recently.
    pub(super) fn recent(&self) -> u32 {
        u32::try_from(self.entries.len()).unwrap_or(u32::MAX).max(1)
    }

    /// The recent tenants that hold no place (those waiting included).
    pub(super) fn empty(&self) -> u32 {
        u32::try_from(self.empty).unwrap_or(u32::MAX)
    }

    /// Places held and requests waiting, over every tenant, and the entries holding none
    /// (counted, and as kept).
    #[cfg(test)]
    pub(super) fn totals(&self) -> (u32, u32, usize, usize) {
        let held = self.entries.values().map(|t| t.held).sum();
        let waiting = self.entries.values().map(|t| t.waiting).sum();
        let empty = self.entries.values().filter(|t| t.held == 0).count();
        (held, waiting, empty, self.empty)
    }

    /// The entry of `hash` (a tenant with no entry holds nothing).
    pub(super) fn get(&self, hash: u64) -> Tenant {
        self.entries.get(&hash).copied().unwrap_or_default()
    }

    fn entry(&mut self, hash: u64) -> &mut Tenant {
        let empty = &mut self.empty;
        self.entries.entry(hash).or_insert_with(|| {
            *empty += 1;
            Tenant::default()
        })
    }

    /// Drops the entry of `hash` if it holds nothing, waits for nothing and was not seen
    /// within [`RECENT`] of `now`.
    fn expire(&mut self, hash: u64, now: u64) {
        if let Some(t) = self.entries.get(&hash) {
            if t.held == 0 && t.waiting == 0 && t.seen.saturating_add(RECENT) <= now {
                self.entries.remove(&hash);
                self.empty -= 1;
            }
        }
    }

    fn sweep(&mut self, now: u64) {
        if now < self.swept.saturating_add(SWEEP) {
            return;
        }
        self.swept = now;
        let before = self.entries.len();
        self.entries
            .retain(|_, t| t.held > 0 || t.waiting > 0 || t.seen.saturating_add(RECENT) > now);
        // Only entries holding nothing expire.
        self.empty -= before - self.entries.len();
    }
}

impl Tenants {
    pub(super) fn new() -> Self {
        Tenants {
            table: Mutex::new(Table {
                // One more for the overflow entry: no request allocates.
                entries: HashMap::with_capacity_and_hasher(
                    MAX_TENANTS + 1,
                    foldhash::fast::RandomState::default(),
                ),
                empty: 0,
                swept: 0,
            }),
        }
    }

    /// The tenant of `hash` asks at `now`: it is counted as recent from now on. The hash its
    /// places and waiters are counted under (the overflow entry's when the table is full).
    pub(super) fn see(&self, hash: u64, now: u64) -> u64 {
        let hash = if hash == OVERFLOW { OVERFLOW + 1 } else { hash };
        let mut table = self.table.lock();
        table.sweep(now);
        let hash = if table.entries.contains_key(&hash) || table.entries.len() < MAX_TENANTS {
            hash
        } else {
            OVERFLOW
        };
        let tenant = table.entry(hash);
        tenant.seen = tenant.seen.max(now);
        hash
    }

    /// Runs `f` on the table, under its lock.
    pub(super) fn with<T>(&self, f: impl FnOnce(&Table) -> T) -> T {
        f(&self.table.lock())
    }

    /// Takes a place for the tenant of `hash` at `now` if `allows` (given its entry and the
    /// table) says so; whether it did.
    pub(super) fn acquire(
        &self,
        hash: u64,
        now: u64,
        allows: impl FnOnce(&Tenant, &Table) -> bool,
    ) -> bool {
        let mut table = self.table.lock();
        let tenant = table.get(hash);
        if !allows(&tenant, &table) {
            return false;
        }
        if tenant.held == 0 && table.entries.contains_key(&hash) {
            table.empty -= 1;
        }
        let fresh = !table.entries.contains_key(&hash);
        let tenant = table.entry(hash);
        tenant.held += 1;
        tenant.served = now;
        if fresh {
            // Inserted holding one: not empty.
            table.empty -= 1;
        }
        true
    }

    /// Gives a place of `hash` back at `now`.
    pub(super) fn release(&self, hash: u64, now: u64) {
        let mut table = self.table.lock();
        if let Some(t) = table.entries.get_mut(&hash) {
            t.held = t.held.saturating_sub(1);
            if t.held == 0 {
                table.empty += 1;
            }
            table.expire(hash, now);
        }
    }

    /// A request of `hash` joins the queue if `allows` (given its entry and the table) says
    /// so; whether it did.
    pub(super) fn enter_queue(
        &self,
        hash: u64,
        allows: impl FnOnce(&Tenant, &Table) -> bool,
    ) -> bool {
        let mut table = self.table.lock();
        let tenant = table.get(hash);
        if !allows(&tenant, &table) {
            return false;
        }
        table.entry(hash).waiting += 1;
        true
    }

    /// A request of `hash` left the queue at `now`.
    pub(super) fn leave_queue(&self, hash: u64, now: u64) {
        let mut table = self.table.lock();
        if let Some(t) = table.entries.get_mut(&hash) {
            t.waiting = t.waiting.saturating_sub(1);
            table.expire(hash, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    /// A tenant is counted while it holds a place, and for a second after it last asked; the
    /// count of tenants holding nothing follows.
    #[test]
    fn tenants_are_counted_while_recent() {
        let t = Tenants::new();
        let a = t.see(7, S);
        assert!(t.acquire(a, S, |_, _| true));
        let b = t.see(9, S);
        assert_eq!(t.with(|t| (t.recent(), t.empty())), (2, 1));
        t.release(a, S + 1);
        assert_eq!(
            t.with(|t| (t.recent(), t.empty(), t.get(a).served)),
            (2, 2, S)
        );
        // Both asked at 1 s: counted until 2 s and a sweep after.
        t.see(11, 2 * S + SWEEP);
        assert_eq!(
            t.with(|t| (t.get(a).seen, t.get(b).seen)),
            (0, 0),
            "expired"
        );
        assert_eq!(t.with(|t| (t.recent(), t.empty())), (1, 1));
        assert_eq!(t.with(|t| t.totals()), (0, 0, 1, 1));
    }

    /// Past the bound, new tenants share the overflow entry; a hash of 0 is not it.
    #[test]
    fn tenants_past_the_bound_share_one_entry() {
        let t = Tenants::new();
        assert_eq!(t.see(OVERFLOW, 0), OVERFLOW + 1);
        for hash in 2..=MAX_TENANTS as u64 {
            assert_eq!(t.see(hash, 0), hash);
        }
        assert_eq!(t.see(u64::MAX, 0), OVERFLOW);
        assert_eq!(t.see(u64::MAX - 1, 0), OVERFLOW);
        assert_eq!(t.with(|t| t.recent()), MAX_TENANTS as u32 + 1);
        // Expired entries make room again.
        assert_eq!(t.see(u64::MAX, 2 * S), u64::MAX);
    }

    /// A waiter keeps its tenant counted; an entry holding nothing expires when its last
    /// waiter leaves after the second.
    #[test]
    fn waiters_keep_their_tenant() {
        let t = Tenants::new();
        let a = t.see(5, 0);
        assert!(t.enter_queue(a, |e, _| e.waiting == 0));
        assert!(!t.enter_queue(a, |e, _| e.waiting == 0));
        t.see(6, 3 * S);
        assert_eq!(t.with(|t| t.get(a).waiting), 1);
        t.leave_queue(a, 3 * S);
        assert_eq!(t.with(|t| t.recent()), 1);
    }
}
