//! The fixed window: one counter per aligned window `[kW, (k+1)W)`.

use crate::Decision;

/// The state of one key: the window it last counted in and the cost admitted there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FixedWindow {
    /// The index `k` of the window `[kW, (k+1)W)`.
    pub window: u64,
    /// Cost admitted in that window.
    pub count: u64,
}

impl FixedWindow {
    /// Checks a request of `cost` at `now` against `limit` per window of `window` ns. Admit
    /// when `count + cost <= limit`; only admitted cost is counted, and a rejection returns the
    /// state unchanged.
    #[inline]
    pub fn check(self, limit: u64, window: u64, now: u64, cost: u64) -> (Self, Decision) {
        let k = (now / window).max(self.window);
        let count = if k == self.window { self.count } else { 0 };
        let window_end = k.saturating_add(1).saturating_mul(window);
        let until_end = window_end.saturating_sub(now);
        match count.checked_add(cost).filter(|&c| c <= limit) {
            Some(count) => {
                let reset = if count > 0 { until_end } else { 0 };
                let decision = Decision::from_nanos(true, limit, limit - count, reset, 0);
                (FixedWindow { window: k, count }, decision)
            }
            None => {
                let reset = if count > 0 { until_end } else { 0 };
                let decision = Decision::from_nanos(
                    false,
                    limit,
                    limit.saturating_sub(count),
                    reset,
                    until_end,
                );
                (self, decision)
            }
        }
    }

    /// When the counter will be back to zero.
    pub fn recovered_at(&self, window: u64) -> u64 {
        if self.count == 0 {
            0
        } else {
            self.window.saturating_add(1).saturating_mul(window)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::FixedWindow;

    #[test]
    fn an_empty_window_has_nothing_to_reset() {
        const W: u64 = 1_000;
        // A fresh key, and one whose count belongs to an earlier window.
        for state in [
            FixedWindow::default(),
            FixedWindow {
                window: 0,
                count: 3,
            },
        ] {
            for now in [1_000, 1_001, 1_999] {
                let (_, d) = state.check(3, W, now, 0);
                assert!(d.allowed());
                assert_eq!(d.reset_after(), Duration::ZERO, "{state:?} at {now}");
                // A cost above the limit is refused, and there is still nothing to reset.
                let (_, d) = state.check(3, W, now, 4);
                assert!(!d.allowed());
                assert_eq!(d.reset_after(), Duration::ZERO, "{state:?} at {now}");
            }
        }
        // Once something is counted, the window's end is the reset.
        let (_, d) = FixedWindow::default().check(3, W, 1_250, 1);
        assert_eq!(d.reset_after(), Duration::from_nanos(750));
    }
}
