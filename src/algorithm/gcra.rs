//! GCRA, the generic cell rate algorithm: one theoretical arrival time (TAT) per key.

use crate::Decision;

/// The state of one key: the theoretical arrival time, the instant at which the key would be
/// back to an empty bucket. A fresh key has `tat = 0`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Gcra {
    /// Theoretical arrival time, in the clock's nanoseconds.
    pub tat: u64,
}

impl Gcra {
    /// Checks a request of `cost` at `now` against `limit` (the burst) and `interval` (the
    /// emission interval, ns). Returns the state to keep and the decision; a rejection returns
    /// the state unchanged.
    ///
    /// Admit when `max(tat, now) + cost * interval - now <= limit * interval`.
    #[inline]
    pub fn check(self, limit: u64, interval: u64, now: u64, cost: u64) -> (Self, Decision) {
        let capacity = limit.saturating_mul(interval);
        let tat = self.tat.max(now);
        let new_tat = tat.saturating_add(cost.saturating_mul(interval));
        let backlog = new_tat - now;
        if backlog <= capacity {
            let remaining = (capacity - backlog) / interval;
            let decision = Decision::from_nanos(true, limit, remaining, backlog, 0);
            (Gcra { tat: new_tat }, decision)
        } else {
            let held = tat - now;
            let remaining = capacity.saturating_sub(held) / interval;
            let decision = Decision::from_nanos(false, limit, remaining, held, backlog - capacity);
            (self, decision)
        }
    }

    /// When the key will be indistinguishable from a fresh one.
    pub fn recovered_at(&self) -> u64 {
        self.tat
    }
}
