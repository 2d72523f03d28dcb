//! The leaky bucket as a meter: a level that drains at a steady rate; a request is admitted
//! when it fits under the rim. The mirror image of the token bucket (`credit = capacity -
//! level`), so both admit exactly the same requests.

use crate::Decision;

/// The state of one key: the level (in nanoseconds of draining) at time `last`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LeakyBucket {
    /// Level at `last`, in nanoseconds of draining; `limit * interval` is the rim.
    pub level: u64,
    /// When the level was last brought up to date.
    pub last: u64,
}

impl LeakyBucket {
    /// Checks a request of `cost` at `now` against a bucket of capacity `limit` draining one
    /// unit per `interval` ns. Admit when `level + cost <= capacity`; a rejection returns the
    /// state unchanged.
    #[inline]
    pub fn check(self, limit: u64, interval: u64, now: u64, cost: u64) -> (Self, Decision) {
        let capacity = limit.saturating_mul(interval);
        let now = now.max(self.last);
        let level = self.level.saturating_sub(now - self.last);
        // In u128: with a capacity above half of u64, `level + cost` would saturate, and the
        // retry computed from it would be too short (found by fuzzing).
        let wanted = u128::from(level) + u128::from(cost) * u128::from(interval);
        if wanted <= u128::from(capacity) {
            let level_after = u64::try_from(wanted).unwrap_or(capacity);
            let remaining = (capacity - level_after) / interval;
            let decision = Decision::from_nanos(true, limit, remaining, level_after, 0);
            (
                LeakyBucket {
                    level: level_after,
                    last: now,
                },
                decision,
            )
        } else {
            let remaining = capacity.saturating_sub(level) / interval;
            let retry = u64::try_from(wanted - u128::from(capacity)).unwrap_or(u64::MAX);
            let decision = Decision::from_nanos(false, limit, remaining, level, retry);
            (self, decision)
        }
    }

    /// When the bucket will be empty.
    pub fn recovered_at(&self) -> u64 {
        self.last.saturating_add(self.level)
    }
}
