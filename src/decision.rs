//! The answer to a check: admitted or not, and everything a response needs to say so.

use std::time::Duration;

/// The outcome of checking a request against one policy, or the most restrictive outcome of a
/// stacked check.
///
/// ```
/// use std::time::Duration;
/// use tollgate::Decision;
///
/// let d = Decision::rejected(10, 0, Duration::from_secs(2), Duration::from_millis(200));
/// assert!(!d.allowed());
/// assert_eq!(d.retry_after(), Some(Duration::from_millis(200)));
/// assert_eq!(d.retry_after_secs(), Some(1)); // header values round up
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Decision {
    allowed: bool,
    limit: u64,
    remaining: u64,
    reset_after: u64,
    retry_after: u64,
    index: usize,
    /// Answered without reaching the store's backend (a local cache, say).
    without_backend: bool,
    /// Admitted by a failure policy (failing open, or the local fallback): the store could not
    /// decide.
    failure_policy: bool,
}

/// Two decisions are equal when they decide alike: where the answer came from (see
/// [`Decision::without_backend`]) does not count.
impl PartialEq for Decision {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Decision {}

impl std::hash::Hash for Decision {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

impl Decision {
    /// What equality and hashing compare.
    const fn key(&self) -> (bool, u64, u64, u64, u64, usize) {
        (
            self.allowed,
            self.limit,
            self.remaining,
            self.reset_after,
            self.retry_after,
            self.index,
        )
    }

    /// An admission: `remaining` is what is left after it, `reset_after` the time until the
    /// state has fully recovered.
    pub const fn admitted(limit: u64, remaining: u64, reset_after: Duration) -> Self {
        Self {
            allowed: true,
            limit,
            remaining,
            reset_after: saturating_nanos(reset_after),
            retry_after: 0,
            index: 0,
            without_backend: false,
            failure_policy: false,
        }
    }

    /// A rejection: `remaining` is what is left (unchanged by the rejection), `retry_after`
    /// the exact wait until the same request would be admitted.
    pub const fn rejected(
        limit: u64,
        remaining: u64,
        reset_after: Duration,
        retry_after: Duration,
    ) -> Self {
        Self {
            allowed: false,
            limit,
            remaining,
            reset_after: saturating_nanos(reset_after),
            // A rejection always has a positive wait: 1 ns at the least.
            retry_after: if saturating_nanos(retry_after) == 0 {
                1
            } else {
                saturating_nanos(retry_after)
            },
            index: 0,
            without_backend: false,
            failure_policy: false,
        }
    }

    pub(crate) const fn from_nanos(
        allowed: bool,
        limit: u64,
        remaining: u64,
        reset_after: u64,
        retry_after: u64,
    ) -> Self {
        Self {
            allowed,
            limit,
            remaining,
            reset_after,
            retry_after: if allowed {
                0
            } else if retry_after == 0 {
                1
            } else {
                retry_after
            },
            index: 0,
            without_backend: false,
            failure_policy: false,
        }
    }

    /// The same decision, marked as coming from the check at `index` of a stacked check.
    pub const fn with_index(mut self, index: usize) -> Self {
        self.index = index;
        self
    }

    /// The same decision, marked as answered without reaching the store's backend: from a
    /// local cache (the Redis store's deny cache), or by a failure policy while the backend is
    /// down. A [`ResilientStore`](crate::store::ResilientStore) takes only answers that reached
    /// the backend as signs of its health. Decisions are made as coming from the backend, so a
    /// custom store that answers some calls without I/O marks those with this.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::Decision;
    ///
    /// let d = Decision::admitted(10, 9, Duration::ZERO);
    /// assert!(d.reached_backend());
    /// assert!(!d.without_backend().reached_backend());
    /// ```
    pub const fn without_backend(mut self) -> Self {
        self.without_backend = true;
        self
    }

    /// Marks an admission by a failure policy (see [`ResilientStore`](crate::store::ResilientStore)).
    pub(crate) const fn by_failure_policy(mut self) -> Self {
        self.failure_policy = true;
        self.without_backend = true;
        self
    }

    /// Whether a failure policy admitted the request: the store could not decide.
    pub const fn is_failure_policy(&self) -> bool {
        self.failure_policy
    }

    /// Whether the answer came from the store's backend (see [`Decision::without_backend`]).
    pub const fn reached_backend(&self) -> bool {
        !self.without_backend
    }

    /// Whether the request was admitted.
    pub const fn allowed(&self) -> bool {
        self.allowed
    }

    /// The policy's limit (the burst, for a bucket).
    pub const fn limit(&self) -> u64 {
        self.limit
    }

    /// What is left after this decision: the largest cost that would be admitted right now. A
    /// rejection leaves it unchanged.
    pub const fn remaining(&self) -> u64 {
        self.remaining
    }

    /// The time until the state has fully recovered (as if the key had never been seen).
    pub const fn reset_after(&self) -> Duration {
        Duration::from_nanos(self.reset_after)
    }

    /// `None` when admitted; otherwise the exact time until this request, with this cost, would
    /// be admitted.
    pub const fn retry_after(&self) -> Option<Duration> {
        if self.allowed {
            None
        } else {
            Some(Duration::from_nanos(self.retry_after))
        }
    }

    /// [`Decision::retry_after`] in whole seconds, rounded up, as `Retry-After` wants it.
    pub const fn retry_after_secs(&self) -> Option<u64> {
        if self.allowed {
            None
        } else {
            Some(self.retry_after.div_ceil(1_000_000_000))
        }
    }

    /// [`Decision::reset_after`] in whole seconds, rounded up.
    pub const fn reset_after_secs(&self) -> u64 {
        self.reset_after.div_ceil(1_000_000_000)
    }

    /// Which check of a stacked check this decision came from (0 for a single check).
    pub const fn index(&self) -> usize {
        self.index
    }

    /// Of two decisions on one request, the one a client must obey: a rejection over an
    /// admission; between rejections the longer wait; between admissions the smaller
    /// remainder, then the later reset. Stores pick with the checks' costs instead (see
    /// [`Store::check_all`](crate::Store::check_all)): between admissions, the fewer further
    /// requests of the same cost.
    pub fn most_restrictive(self, other: Decision) -> Decision {
        let self_first = match (self.allowed, other.allowed) {
            (false, true) => true,
            (true, false) => false,
            (false, false) => self.retry_after >= other.retry_after,
            (true, true) => {
                (self.remaining, std::cmp::Reverse(self.reset_after))
                    <= (other.remaining, std::cmp::Reverse(other.reset_after))
            }
        };
        if self_first { self } else { other }
    }
}

/// Of two decisions on one request and the costs of their checks, the one a client must obey:
/// a rejection over an admission; between rejections the longer wait; between admissions the
/// policy that runs out first for requests like this one (the fewer further requests of this
/// cost; a check that costs nothing never runs out), then the smaller remainder, then the
/// later reset. A per-address bucket with 19 left and a search quota with 25 units left, at 5
/// a search, name the search quota: 5 more searches fit.
pub(crate) fn tighter(a: (Decision, u64), b: (Decision, u64)) -> (Decision, u64) {
    let requests = |(d, cost): (Decision, u64)| d.remaining.checked_div(cost).unwrap_or(u64::MAX);
    let a_first = match (a.0.allowed, b.0.allowed) {
        (false, true) => true,
        (true, false) => false,
        (false, false) => a.0.retry_after >= b.0.retry_after,
        (true, true) => {
            (
                requests(a),
                a.0.remaining,
                std::cmp::Reverse(a.0.reset_after),
            ) <= (
                requests(b),
                b.0.remaining,
                std::cmp::Reverse(b.0.reset_after),
            )
        }
    };
    if a_first { a } else { b }
}

const fn saturating_nanos(d: Duration) -> u64 {
    let n = d.as_nanos();
    if n > u64::MAX as u128 {
        u64::MAX
    } else {
        n as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn most_restrictive_prefers_rejections_then_longer_waits() {
        let ok = Decision::admitted(10, 3, Duration::from_secs(1));
        let tight = Decision::admitted(100, 1, Duration::from_secs(9)).with_index(1);
        let no =
            Decision::rejected(5, 0, Duration::from_secs(5), Duration::from_secs(2)).with_index(2);
        let longer =
            Decision::rejected(5, 0, Duration::from_secs(5), Duration::from_secs(3)).with_index(3);
        assert_eq!(ok.most_restrictive(tight).index(), 1);
        assert_eq!(tight.most_restrictive(no).index(), 2);
        assert_eq!(no.most_restrictive(longer).index(), 3);
        assert_eq!(longer.most_restrictive(ok).index(), 3);
    }

    /// With costs, admissions are compared by the requests of that cost that still fit.
    #[test]
    fn tighter_counts_requests_of_the_cost() {
        let per_ip = Decision::admitted(20, 19, Duration::from_secs(1));
        let search = Decision::admitted(30, 25, Duration::from_secs(60)).with_index(1);
        assert_eq!(tighter((per_ip, 1), (search, 5)).0.index(), 1);
        assert_eq!(tighter((search, 5), (per_ip, 1)).0.index(), 1);
        // Without costs (or equal ones) the smaller remainder, as before.
        assert_eq!(tighter((per_ip, 1), (search, 1)).0.index(), 0);
        // A check that costs nothing never runs out.
        assert_eq!(tighter((search, 0), (per_ip, 1)).0.index(), 0);
        // Equal requests left: the smaller remainder, then the later reset.
        let a = Decision::admitted(30, 10, Duration::from_secs(5)).with_index(2);
        let b = Decision::admitted(30, 11, Duration::from_secs(9)).with_index(3);
        assert_eq!(tighter((a, 5), (b, 5)).0.index(), 2);
        let c = Decision::admitted(30, 10, Duration::from_secs(9)).with_index(4);
        assert_eq!(tighter((a, 5), (c, 5)).0.index(), 4);
        // Rejections still come first, the longer wait first among them.
        let no =
            Decision::rejected(5, 0, Duration::from_secs(5), Duration::from_secs(2)).with_index(5);
        assert_eq!(tighter((per_ip, 1), (no, 1)).0.index(), 5);
        assert_eq!(tighter((no, 1), (per_ip, 1)).0.index(), 5);
    }

    #[test]
    fn durations_beyond_u64_nanoseconds_saturate() {
        let max = Duration::from_nanos(u64::MAX);
        for beyond in [max + Duration::from_nanos(1), Duration::MAX] {
            let d = Decision::admitted(1, 0, beyond);
            assert_eq!(d.reset_after(), max);
            let d = Decision::rejected(1, 0, beyond, beyond);
            assert_eq!((d.reset_after(), d.retry_after()), (max, Some(max)));
        }
        assert_eq!(Decision::admitted(1, 0, max).reset_after(), max);
    }

    #[test]
    fn header_seconds_round_up_and_rejections_always_wait() {
        let d = Decision::rejected(1, 0, Duration::ZERO, Duration::ZERO);
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(1)));
        assert_eq!(d.retry_after_secs(), Some(1));
        let d = Decision::admitted(1, 0, Duration::from_millis(1001));
        assert_eq!(d.reset_after_secs(), 2);
        assert_eq!(d.retry_after_secs(), None);
    }
}
