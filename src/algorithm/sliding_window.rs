//! The sliding window counter: the previous and the current fixed window's counts, the
//! previous one weighted by how much of it the sliding window still covers.
//!
//! `estimate = prev * (W - elapsed) / W + cur`, taken before counting. A request of cost `c`
//! is admitted when `estimate + c - 1 < limit` (for `c = 1`, the classic `estimate < limit`).
//! Everything is compared multiplied by `W`, in 128-bit integers, so the comparison is exact.

use crate::Decision;

/// The state of one key: the index of the current window and the two counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SlidingWindow {
    /// The index `k` of the current window `[kW, (k+1)W)`.
    pub window: u64,
    /// Cost admitted in window `k - 1`.
    pub prev: u64,
    /// Cost admitted in window `k`.
    pub cur: u64,
}

impl SlidingWindow {
    /// Checks a request of `cost` at `now` against `limit` per sliding `window` (ns). Only
    /// admitted cost is counted; a rejection returns the state unchanged.
    #[inline]
    pub fn check(self, limit: u64, window: u64, now: u64, cost: u64) -> (Self, Decision) {
        let w = u128::from(window);
        let k = (now / window).max(self.window);
        let start = k.saturating_mul(window);
        let elapsed = now.saturating_sub(start).min(window - 1);
        let (prev, cur) = if k == self.window {
            (self.prev, self.cur)
        } else if k == self.window + 1 {
            (self.cur, 0)
        } else {
            (0, 0)
        };
        // `estimate * W`, and the bound `(limit + 1) * W` that `(estimate + cost) * W` must stay
        // under.
        let scaled = |prev: u64, cur: u64| {
            (u128::from(prev) * (w - u128::from(elapsed))).saturating_add(u128::from(cur) * w)
        };
        let bound = (u128::from(limit) + 1) * w;
        let estimate = scaled(prev, cur);
        let admit = estimate.saturating_add(u128::from(cost) * w) < bound;
        let (prev, cur, estimate) = if admit {
            let cur = cur.saturating_add(cost);
            (prev, cur, scaled(prev, cur))
        } else {
            (prev, cur, estimate)
        };
        // The largest n with estimate + n - 1 < limit.
        let remaining = bound.saturating_sub(estimate).saturating_sub(1) / w;
        let remaining = u64::try_from(remaining).unwrap_or(u64::MAX).min(limit);
        let reset = if cur > 0 {
            start.saturating_add(window.saturating_mul(2))
        } else if prev > 0 {
            start.saturating_add(window)
        } else {
            now
        }
        .saturating_sub(now);
        if admit {
            let decision = Decision::from_nanos(true, limit, remaining, reset, 0);
            (
                SlidingWindow {
                    window: k,
                    prev,
                    cur,
                },
                decision,
            )
        } else {
            let at = Self::admitted_at(limit, window, start, elapsed, prev, cur, cost);
            let decision =
                Decision::from_nanos(false, limit, remaining, reset, at.saturating_sub(now));
            (self, decision)
        }
    }

    /// The first instant at which a request of `cost` would be admitted, given the counts of
    /// the window that started at `start` and `elapsed` into it (which rejects it now).
    #[cold]
    #[inline(never)]
    fn admitted_at(
        limit: u64,
        window: u64,
        start: u64,
        elapsed: u64,
        prev: u64,
        cur: u64,
        cost: u64,
    ) -> u64 {
        if cost > limit {
            return u64::MAX;
        }
        let w = u128::from(window);
        let target = (u128::from(limit) + 1) * w - 1 - u128::from(cost) * w;
        // Still in this window: prev * (W - elapsed - d) + cur * W <= target.
        let now_scaled =
            (u128::from(prev) * (w - u128::from(elapsed))).saturating_add(u128::from(cur) * w);
        if prev > 0 {
            let d = (now_scaled - target).div_ceil(u128::from(prev));
            if u128::from(elapsed) + d < w {
                return start.saturating_add(elapsed).saturating_add(d as u64);
            }
        }
        // In the next window, d into it: cur * (W - d) <= target.
        let next = start.saturating_add(window);
        let next_scaled = u128::from(cur) * w;
        if next_scaled <= target {
            return next;
        }
        if cur > 0 {
            let d = (next_scaled - target).div_ceil(u128::from(cur));
            if d < w {
                return next.saturating_add(d as u64);
            }
        }
        // The window after: both counts have aged out.
        next.saturating_add(window)
    }

    /// When both counts will have aged out.
    pub fn recovered_at(&self, window: u64) -> u64 {
        let start = self.window.saturating_mul(window);
        if self.cur > 0 {
            start.saturating_add(window.saturating_mul(2))
        } else if self.prev > 0 {
            start.saturating_add(window)
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SlidingWindow;

    #[test]
    fn recovered_at_is_when_both_counts_have_aged_out() {
        const W: u64 = 1_000;
        const LIMIT: u64 = 4;
        let fresh = SlidingWindow::default();
        for (state, at) in [
            // Counts in window 5 weigh on window 6, until it ends.
            (
                SlidingWindow {
                    window: 5,
                    prev: 3,
                    cur: 2,
                },
                7_000,
            ),
            // What a zero-cost admission leaves in a new window: only the previous count.
            (
                SlidingWindow {
                    window: 5,
                    prev: 3,
                    cur: 0,
                },
                6_000,
            ),
            (
                SlidingWindow {
                    window: 5,
                    prev: 0,
                    cur: 0,
                },
                0,
            ),
            (fresh, 0),
        ] {
            assert_eq!(state.recovered_at(W), at, "{state:?}");
            // From then on (and never before the state's own window) it decides like a fresh
            // state and moves to the same next state...
            let from = at.max(5_000);
            for now in [from, from + 1, from + W] {
                for cost in 0..=LIMIT {
                    let kept = state.check(LIMIT, W, now, cost);
                    assert_eq!(kept, fresh.check(LIMIT, W, now, cost), "{state:?} at {now}");
                }
            }
            // ...and not one nanosecond earlier.
            if at > 5_000 {
                let kept = state.check(LIMIT, W, at - 1, 0);
                assert_ne!(
                    kept,
                    fresh.check(LIMIT, W, at - 1, 0),
                    "{state:?} at {at} - 1"
                );
            }
        }
    }
}
