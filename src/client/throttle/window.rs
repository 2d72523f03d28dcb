//! The sliding window of the adaptive throttle: requests and accepts over the last `slots`
//! buckets of time, and the rejection draw. Pure: the time is passed in.

/// Requests and accepts in a window of `slots` buckets of `width` nanoseconds each. Buckets
/// leave the window whole: the window holds the current bucket and the `slots - 1` before it.
#[derive(Clone, Debug)]
pub(crate) struct Window {
    width: u64,
    /// `(requests, accepts)` per bucket, bucket `n` at `n % slots`.
    slots: Box<[(u64, u64)]>,
    /// The latest bucket counted in.
    head: u64,
    requests: u64,
    accepts: u64,
}

/// The counts of a window at one time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct WindowCounts {
    /// Requests the layer was asked to send in the window (those it refused itself included).
    pub requests: u64,
    /// Of those, the ones the backend accepted (never more than `requests`).
    pub accepts: u64,
}

impl WindowCounts {
    /// The probability that the next request is refused locally, with `k` the multiplier:
    /// `max(0, (requests - k * accepts) / (requests + 1))`.
    pub fn rejection_probability(&self, k: f64) -> f64 {
        // Counts stay far below 2^53 in any real window: exact as floats.
        #[allow(clippy::cast_precision_loss)]
        let (requests, accepts) = (self.requests as f64, self.accepts as f64);
        ((requests - k * accepts) / (requests + 1.0)).max(0.0)
    }
}

impl Window {
    /// An empty window; `slots` and `width` at least 1.
    pub(crate) fn new(slots: usize, width: u64) -> Self {
        Self {
            width: width.max(1),
            slots: vec![(0, 0); slots.max(1)].into_boxed_slice(),
            head: 0,
            requests: 0,
            accepts: 0,
        }
    }

    fn len(&self) -> u64 {
        self.slots.len() as u64
    }

    fn index(&self, bucket: u64) -> usize {
        // Less than `slots.len()`, a usize.
        (bucket % self.len()) as usize
    }

    /// Moves the window to `now`: the buckets that left it are forgotten. A time before the
    /// latest bucket counts in the latest bucket (a clock never goes back; a manual one may).
    fn advance(&mut self, now: u64) -> usize {
        let bucket = now / self.width;
        if bucket > self.head {
            if bucket - self.head >= self.len() {
                self.slots.fill((0, 0));
                self.requests = 0;
                self.accepts = 0;
            } else {
                for b in self.head + 1..=bucket {
                    let i = self.index(b);
                    let (requests, accepts) = std::mem::take(&mut self.slots[i]);
                    self.requests -= requests;
                    self.accepts -= accepts;
                }
            }
            self.head = bucket;
        }
        self.index(self.head)
    }

    /// The counts at `now`.
    pub(crate) fn counts(&mut self, now: u64) -> WindowCounts {
        self.advance(now);
        WindowCounts {
            requests: self.requests,
            // An accept counts in the bucket of its answer, its request in an earlier one
            // that may have left the window (or been taken back): never more than requests.
            accepts: self.accepts.min(self.requests),
        }
    }

    /// Whether a request at `now` is refused locally, for a `draw` uniform over all `u64`s and
    /// the multiplier `k_milli / 1000`; the request is counted either way. Integer arithmetic:
    /// refused when `draw * (requests + 1) / 2^64 < requests - k * accepts`, the probability
    /// `(requests - k * accepts) / (requests + 1)` to within 2^-64.
    pub(crate) fn request(&mut self, now: u64, draw: u64, k_milli: u64) -> bool {
        let i = self.advance(now);
        let requests = u128::from(self.requests);
        let excess =
            (requests * 1000).saturating_sub(u128::from(k_milli) * u128::from(self.accepts));
        let scaled = (u128::from(draw) * ((requests + 1) * 1000)) >> 64;
        self.slots[i].0 += 1;
        self.requests += 1;
        scaled < excess
    }

    /// The bucket the latest request was counted in (requests count in the latest bucket).
    pub(crate) fn bucket(&self) -> u64 {
        self.head
    }

    /// A request counted in `bucket` never reached the backend (a layer inside refused it):
    /// it is taken back, if its bucket is still in the window at `now`.
    pub(crate) fn unsent(&mut self, now: u64, bucket: u64) {
        self.advance(now);
        if bucket <= self.head && self.head - bucket < self.len() {
            let i = self.index(bucket);
            if self.slots[i].0 > 0 {
                self.slots[i].0 -= 1;
                self.requests -= 1;
            }
        }
    }

    /// A request the backend accepted, answered at `now`.
    pub(crate) fn accept(&mut self, now: u64) {
        let i = self.advance(now);
        // An accept answered in a later bucket than its request: the request may have left
        // the window already. Accepts are counted only while below requests (they can still
        // pass them as buckets leave: `counts` and the draw bound them).
        if self.accepts < self.requests {
            self.slots[i].1 += 1;
            self.accepts += 1;
        }
    }

    /// The latest bucket counted in, as a time: for forgetting idle windows.
    pub(crate) fn last_seen(&self) -> u64 {
        self.head.saturating_mul(self.width)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    /// A request whose bucket left the window while its accept stays (answered a bucket
    /// later): the counts show no more accepts than requests (they showed 1 of 0).
    #[test]
    fn accepts_never_show_above_requests() {
        let mut w = Window::new(3, S);
        w.request(0, u64::MAX, 2000);
        w.accept(2 * S);
        assert_eq!(
            w.counts(2 * S),
            WindowCounts {
                requests: 1,
                accepts: 1
            }
        );
        assert_eq!(
            w.counts(3 * S),
            WindowCounts {
                requests: 0,
                accepts: 0
            }
        );
        // A request taken back after the one accepted left: 1 accept, 0 requests underneath.
        let mut w = Window::new(3, S);
        w.request(0, u64::MAX, 2000);
        w.request(2 * S, u64::MAX, 2000);
        w.accept(2 * S);
        w.unsent(3 * S, 2);
        assert_eq!(
            w.counts(3 * S),
            WindowCounts {
                requests: 0,
                accepts: 0
            }
        );
    }

    #[test]
    fn buckets_leave_the_window_whole() {
        let mut w = Window::new(3, S);
        assert!(!w.request(0, u64::MAX, 2000));
        w.accept(S / 2);
        w.request(S, 0, 2000);
        w.request(2 * S + 5, 0, 2000);
        let c = w.counts(2 * S + 999_999_999);
        assert_eq!((c.requests, c.accepts), (3, 1));
        // Bucket 0 leaves at 3 s, bucket 1 at 4 s.
        assert_eq!(w.counts(3 * S).requests, 2);
        assert_eq!(w.counts(3 * S).accepts, 0);
        assert_eq!(w.counts(4 * S).requests, 1);
        // A time gone back counts in the latest bucket.
        w.request(0, 0, 2000);
        assert_eq!(w.counts(4 * S).requests, 2);
        assert_eq!(w.last_seen(), 4 * S);
        // A jump of a whole window forgets everything.
        assert_eq!(
            w.counts(100 * S),
            WindowCounts {
                requests: 0,
                accepts: 0
            }
        );
        assert_eq!(w.counts(5 * S).requests, 0);
    }

    #[test]
    fn a_request_not_sent_is_taken_back_while_its_bucket_is_in_the_window() {
        let mut w = Window::new(3, S);
        w.request(0, u64::MAX, 2000);
        let first = w.bucket();
        assert_eq!(first, 0);
        w.request(S, u64::MAX, 2000);
        assert_eq!(w.bucket(), 1);
        w.unsent(2 * S, first);
        assert_eq!(w.counts(2 * S).requests, 1);
        // Never below zero in its bucket.
        w.unsent(2 * S, first);
        assert_eq!(w.counts(2 * S).requests, 1);
        // A bucket that left the window is not touched, though its slot now holds another
        // bucket's count: bucket 1 left at 4 s, its slot is bucket 4's.
        w.request(4 * S, u64::MAX, 2000);
        assert_eq!(w.bucket(), 4);
        w.unsent(4 * S, 1);
        assert_eq!(w.counts(4 * S).requests, 1);
        // A request taken back from the latest bucket, the one it was counted in.
        w.request(5 * S, u64::MAX, 2000);
        w.unsent(5 * S, w.bucket());
        assert_eq!(w.counts(5 * S).requests, 1);
        // A time gone back counts in the latest bucket, and is taken back from it.
        w.request(0, u64::MAX, 2000);
        assert_eq!(w.bucket(), 5);
        w.unsent(0, 5);
        assert_eq!(w.counts(5 * S).requests, 1);
    }

    #[test]
    fn the_draw_meets_the_formula() {
        // 9 requests, 2 accepts, k = 2: p = (9 - 4) / 10 = 0.5.
        let fill = || {
            let mut w = Window::new(120, S);
            for _ in 0..9 {
                w.request(0, u64::MAX, 2000);
            }
            w.accept(0);
            w.accept(0);
            w
        };
        let half = 1u64 << 63;
        assert!(fill().request(0, half - 1, 2000));
        assert!(!fill().request(0, half, 2000));
        // k = 4.5 leaves nothing to refuse.
        assert!(!fill().request(0, 0, 4500));
        // The probability reported is the same formula.
        let c = fill().counts(0);
        assert!((c.rejection_probability(2.0) - 0.5).abs() < 1e-12);
        assert_eq!(c.rejection_probability(4.5), 0.0);
        // An empty window refuses nothing; accepts never exceed requests.
        let mut w = Window::new(2, S);
        assert!(!w.request(0, 0, 1000));
        w.accept(0);
        w.accept(0);
        assert_eq!(
            w.counts(0),
            WindowCounts {
                requests: 1,
                accepts: 1
            }
        );
    }
}
