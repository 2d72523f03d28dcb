//! The sliding log: the time and cost of every admitted request still inside the window
//! `(t-W, t]`. Exact, and its memory grows with the limit (at most `limit` entries, since each
//! entry costs at least 1 and their sum never exceeds the limit).

use std::collections::VecDeque;

use crate::Decision;

/// The state of one key: admitted requests, oldest first, with equal times merged.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct SlidingLog {
    entries: VecDeque<(u64, u64)>,
    total: u64,
}

impl SlidingLog {
    /// The logged `(time, cost)` entries, oldest first (expired ones may linger until the next
    /// admission prunes them).
    pub fn entries(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.entries.iter().copied()
    }

    /// The number of entries held, expired or not.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the log holds no entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn newest(&self) -> u64 {
        self.entries.back().map_or(0, |e| e.0)
    }

    /// Checks a request of `cost` at `now` against `limit` per `window` (ns) without changing
    /// anything; call [`SlidingLog::record`] to admit it. Admit when the cost in `(now - W,
    /// now]` plus `cost` is at most `limit`.
    pub fn check(&self, limit: u64, window: u64, now: u64, cost: u64) -> Decision {
        let now = now.max(self.newest());
        let live = |t: u64| t.saturating_add(window) > now;
        let expired: u64 = self
            .entries
            .iter()
            .take_while(|e| !live(e.0))
            .map(|e| e.1)
            .sum();
        let used = self.total - expired;
        let newest_expiry = self.newest().saturating_add(window);
        if let Some(used) = used.checked_add(cost).filter(|&u| u <= limit) {
            let reset = if cost > 0 {
                window
            } else if used > 0 {
                newest_expiry - now
            } else {
                0
            };
            return Decision::from_nanos(true, limit, limit - used, reset, 0);
        }
        // Rejected: wait until enough of the oldest live entries have expired.
        let mut need = used.saturating_add(cost) - limit;
        let mut at = newest_expiry;
        for &(t, c) in self.entries.iter().skip_while(|e| !live(e.0)) {
            if c >= need {
                at = t.saturating_add(window);
                break;
            }
            need -= c;
        }
        let reset = if used > 0 { newest_expiry - now } else { 0 };
        Decision::from_nanos(
            false,
            limit,
            limit.saturating_sub(used),
            reset,
            at.saturating_sub(now),
        )
    }

    /// Logs an admitted request of `cost` at `now`, first forgetting the entries that have
    /// left the window. A zero cost records nothing.
    pub fn record(&mut self, window: u64, now: u64, cost: u64) {
        if cost == 0 {
            return;
        }
        let now = now.max(self.newest());
        while let Some(&(t, c)) = self.entries.front() {
            if t.saturating_add(window) > now {
                break;
            }
            self.total -= c;
            self.entries.pop_front();
        }
        self.total += cost;
        match self.entries.back_mut() {
            Some(last) if last.0 == now => last.1 += cost,
            _ => self.entries.push_back((now, cost)),
        }
    }

    /// When every entry will have left the window.
    pub fn recovered_at(&self, window: u64) -> u64 {
        if self.entries.is_empty() {
            0
        } else {
            self.newest().saturating_add(window)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SlidingLog;

    #[test]
    fn the_log_merges_equal_times_and_prunes_on_the_next_admission() {
        const W: u64 = 1_000;
        let mut log = SlidingLog::default();
        assert!(log.is_empty());
        assert_eq!((log.len(), log.entries().count()), (0, 0));
        log.record(W, 100, 0);
        assert!(log.is_empty(), "a zero cost records nothing");
        log.record(W, 100, 2);
        log.record(W, 100, 1);
        log.record(W, 600, 3);
        assert!(!log.is_empty());
        assert_eq!(log.len(), 2);
        assert_eq!(log.entries().collect::<Vec<_>>(), [(100, 3), (600, 3)]);
        // The entry of 100 expires at 1100, but lingers until an admission prunes it.
        assert_eq!(log.check(10, W, 1_100, 0).remaining(), 7);
        assert_eq!(log.len(), 2);
        log.record(W, 1_100, 1);
        assert_eq!(log.entries().collect::<Vec<_>>(), [(600, 3), (1_100, 1)]);
    }
}
