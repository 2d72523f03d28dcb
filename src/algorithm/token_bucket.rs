//! The token bucket: a balance refilled lazily at a steady rate and capped at the burst.
//!
//! The balance is kept in nanoseconds of refill ("credit"): one token is worth one emission
//! interval, so refill is one unit per nanosecond and the arithmetic is exact integers.

use crate::Decision;

/// The state of one key: the credit (tokens times the interval, in ns) at time `last`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TokenBucket {
    /// Credit at `last`, in nanoseconds of refill; `limit * interval` is a full bucket.
    pub credit: u64,
    /// When the credit was last brought up to date.
    pub last: u64,
}

impl TokenBucket {
    /// A full bucket.
    pub fn full(limit: u64, interval: u64) -> Self {
        TokenBucket {
            credit: limit.saturating_mul(interval),
            last: 0,
        }
    }

    /// Checks a request of `cost` at `now` against a bucket of `limit` tokens refilled one
    /// token per `interval` ns. Admit when the refilled balance covers the whole cost; a
    /// rejection returns the state unchanged.
    #[inline]
    pub fn check(self, limit: u64, interval: u64, now: u64, cost: u64) -> (Self, Decision) {
        let capacity = limit.saturating_mul(interval);
        let now = now.max(self.last);
        let credit = self.credit.saturating_add(now - self.last).min(capacity);
        let need = cost.saturating_mul(interval);
        if credit >= need {
            let left = credit - need;
            let decision = Decision::from_nanos(true, limit, left / interval, capacity - left, 0);
            (
                TokenBucket {
                    credit: left,
                    last: now,
                },
                decision,
            )
        } else {
            let decision = Decision::from_nanos(
                false,
                limit,
                credit / interval,
                capacity - credit,
                need - credit,
            );
            (self, decision)
        }
    }

    /// When the bucket will be full again.
    pub fn recovered_at(&self, limit: u64, interval: u64) -> u64 {
        let capacity = limit.saturating_mul(interval);
        self.last
            .saturating_add(capacity.saturating_sub(self.credit))
    }
}
