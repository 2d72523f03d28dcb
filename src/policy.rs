//! What a limit is: an algorithm, a limit or burst, and a window or a rate.
//!
//! Policies are validated once, when they are built; a check never re-validates them. Every
//! constructor returns a [`PolicyError`] naming the bad value instead of panicking.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Policy, PolicyError, Rate};
//!
//! let per_minute = Policy::sliding_window(100, Duration::from_secs(60))?.named("per-minute")?;
//! assert_eq!(per_minute.limit(), 100);
//! assert_eq!(per_minute.name(), Some("per-minute"));
//!
//! let api = Policy::gcra(Rate::per_second(5), 10)?;
//! assert_eq!(api.interval(), Duration::from_millis(200)); // one request every 200 ms
//! assert_eq!(api.window(), Duration::from_secs(2));      // an empty burst refills in 2 s
//!
//! assert_eq!(Policy::fixed_window(0, Duration::from_secs(1)), Err(PolicyError::ZeroLimit));
//! # Ok::<(), PolicyError>(())
//! ```

use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

/// The largest limit a sliding log accepts: it stores up to one timestamp per admitted unit of
/// cost, so its memory per key grows with the limit (16 bytes an entry).
pub const MAX_SLIDING_LOG_LIMIT: u64 = 1 << 20;

/// The longest name a policy may carry (it goes into response headers).
pub const MAX_NAME_LEN: usize = 64;

/// A number of events per span of time, as in "5 per second".
///
/// Constructing a rate never fails; [`Policy`] constructors reject a zero count or a zero
/// span.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    count: u64,
    per: Duration,
}

impl Rate {
    /// `count` events every `per`.
    pub const fn new(count: u64, per: Duration) -> Self {
        Self { count, per }
    }

    /// `count` events per second.
    pub const fn per_second(count: u64) -> Self {
        Self::new(count, Duration::from_secs(1))
    }

    /// `count` events per minute.
    pub const fn per_minute(count: u64) -> Self {
        Self::new(count, Duration::from_secs(60))
    }

    /// `count` events per hour.
    pub const fn per_hour(count: u64) -> Self {
        Self::new(count, Duration::from_secs(3600))
    }

    /// The number of events per span.
    pub const fn count(&self) -> u64 {
        self.count
    }

    /// The span.
    pub const fn per(&self) -> Duration {
        self.per
    }

    /// The time between two events, in whole nanoseconds, rounded up so that the policy never
    /// admits faster than the rate it was given.
    fn interval_nanos(&self) -> Result<u64, PolicyError> {
        if self.count == 0 {
            return Err(PolicyError::ZeroRate);
        }
        let per = nanos(self.per, "rate period")?;
        if per == 0 {
            return Err(PolicyError::ZeroWindow);
        }
        Ok(per.div_ceil(self.count))
    }
}

/// The algorithm a [`Policy`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// A counter per aligned window `[kW, (k+1)W)`.
    FixedWindow,
    /// A log of admitted requests over the window `(t-W, t]`.
    SlidingLog,
    /// The two-counter estimate of a sliding window.
    SlidingWindow,
    /// A bucket of tokens refilled lazily at a steady rate, capped at the burst.
    TokenBucket,
    /// A bucket that drains at a steady rate and overflows at its capacity (the meter reading).
    LeakyBucket,
    /// The generic cell rate algorithm: one theoretical arrival time per key.
    Gcra,
}

impl Algorithm {
    /// A short lowercase name: `fixed_window`, `sliding_log`, `sliding_window`,
    /// `token_bucket`, `leaky_bucket` or `gcra`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::LeakyBucket => "leaky_bucket",
            Algorithm::Gcra => "gcra",
        }
    }

    /// Whether the policy is a window (limit per window) rather than a bucket (rate and burst).
    pub const fn is_window(self) -> bool {
        matches!(
            self,
            Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingWindow
        )
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A validated limit: what to count and how much of it to allow.
///
/// For the window algorithms `limit` is the most a window admits and `period` is the window.
/// For the bucket algorithms (token bucket, leaky bucket, GCRA) `limit` is the burst (the
/// capacity) and `period` is the emission interval, the time one unit of cost takes to refill.
/// Cloning is cheap.
#[derive(Clone, PartialEq, Eq)]
pub struct Policy {
    algorithm: Algorithm,
    limit: u64,
    period: u64,
    name: Option<Arc<str>>,
    id: u64,
}

impl Policy {
    /// At most `limit` per aligned window of length `window`: window k is `[kW, (k+1)W)` on the
    /// clock's time line. Allows up to twice the limit across a window boundary.
    pub fn fixed_window(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        Self::windowed(Algorithm::FixedWindow, limit, window)
    }

    /// At most `limit` admitted in every window `(t-W, t]`, exactly. Keeps one entry per
    /// admitted request, so memory per key grows with `limit` (at most
    /// [`MAX_SLIDING_LOG_LIMIT`]).
    pub fn sliding_log(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        if limit > MAX_SLIDING_LOG_LIMIT {
            return Err(PolicyError::TooLarge {
                what: "sliding log limit",
                value: u128::from(limit),
                max: u128::from(MAX_SLIDING_LOG_LIMIT),
            });
        }
        Self::windowed(Algorithm::SlidingLog, limit, window)
    }

    /// The sliding window counter: `estimate = prev * (1 - elapsed/W) + cur`, taken before
    /// counting, admits a request of cost `c` when `estimate + c - 1 < limit`. Two counters per
    /// key; close to the sliding log, off only when the previous window's traffic was bunched.
    pub fn sliding_window(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        Self::windowed(Algorithm::SlidingWindow, limit, window)
    }

    /// A token bucket of `burst` tokens refilled at `rate`; a request of cost `c` takes `c`
    /// tokens or nothing. In any span `T` it admits at most `burst + rate * T`.
    pub fn token_bucket(rate: Rate, burst: u64) -> Result<Self, PolicyError> {
        Self::bucket(Algorithm::TokenBucket, rate, burst)
    }

    /// A leaky bucket as a meter: a level that drains at `rate`, admitting a request of cost
    /// `c` when `level + c <= capacity`. Admits exactly what the token bucket with the same
    /// rate and burst admits. (The queue reading, which delays instead of rejecting, is a
    /// shaper, not a store policy.)
    pub fn leaky_bucket(rate: Rate, capacity: u64) -> Result<Self, PolicyError> {
        Self::bucket(Algorithm::LeakyBucket, rate, capacity)
    }

    /// The generic cell rate algorithm with `rate` and `burst`: one timestamp per key, the
    /// same admissions as the token bucket.
    pub fn gcra(rate: Rate, burst: u64) -> Result<Self, PolicyError> {
        Self::bucket(Algorithm::Gcra, rate, burst)
    }

    fn windowed(algorithm: Algorithm, limit: u64, window: Duration) -> Result<Self, PolicyError> {
        if limit == 0 {
            return Err(PolicyError::ZeroLimit);
        }
        let period = nanos(window, "window")?;
        if period == 0 {
            return Err(PolicyError::ZeroWindow);
        }
        Ok(Self::build(algorithm, limit, period, None))
    }

    fn bucket(algorithm: Algorithm, rate: Rate, burst: u64) -> Result<Self, PolicyError> {
        if burst == 0 {
            return Err(PolicyError::ZeroLimit);
        }
        let period = rate.interval_nanos()?;
        if period.checked_mul(burst).is_none() {
            return Err(PolicyError::TooLarge {
                what: "burst times interval (ns)",
                value: u128::from(period) * u128::from(burst),
                max: u128::from(u64::MAX),
            });
        }
        Ok(Self::build(algorithm, burst, period, None))
    }

    fn build(algorithm: Algorithm, limit: u64, period: u64, name: Option<Arc<str>>) -> Self {
        let id = foldhash::fast::FixedState::with_seed(0x746f_6c6c_6761_7465).hash_one((
            algorithm,
            limit,
            period,
            name.as_deref(),
        ));
        Self {
            algorithm,
            limit,
            period,
            id,
            name,
        }
    }

    /// Gives the policy a name, shown to clients in the `RateLimit-Policy` header and in
    /// metrics. Names are 1 to [`MAX_NAME_LEN`] characters of `a-z A-Z 0-9 - _ . :`. Two
    /// policies with the same parameters but different names count separately.
    pub fn named(self, name: impl AsRef<str>) -> Result<Self, PolicyError> {
        let name = name.as_ref();
        let valid = !name.is_empty()
            && name.len() <= MAX_NAME_LEN
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
        if !valid {
            return Err(PolicyError::InvalidName(name.chars().take(80).collect()));
        }
        Ok(Self::build(
            self.algorithm,
            self.limit,
            self.period,
            Some(Arc::from(name)),
        ))
    }

    /// The algorithm this policy runs.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The most a window admits, or the burst (capacity) of a bucket. No single request may
    /// cost more than this.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// For a window, the window; for a bucket, the emission interval (the time one unit of
    /// cost takes to refill), rounded up to whole nanoseconds.
    pub fn interval(&self) -> Duration {
        Duration::from_nanos(self.period)
    }

    /// The span the limit is about: the window, or for a bucket the time an empty burst takes
    /// to refill (`limit * interval`). This is the `w` of the `RateLimit-Policy` header.
    pub fn window(&self) -> Duration {
        if self.algorithm.is_window() {
            Duration::from_nanos(self.period)
        } else {
            Duration::from_nanos(self.period.saturating_mul(self.limit))
        }
    }

    /// The name given with [`Policy::named`], if any.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// A fingerprint of the algorithm, limit, period and name. Stores keep separate state per
    /// key and fingerprint, so one key can carry several policies.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The period in nanoseconds (see [`Policy::interval`]).
    pub(crate) fn period_nanos(&self) -> u64 {
        self.period
    }
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("Policy");
        s.field("algorithm", &self.algorithm)
            .field("limit", &self.limit)
            .field("interval", &self.interval());
        if let Some(name) = &self.name {
            s.field("name", name);
        }
        s.finish()
    }
}

fn nanos(d: Duration, what: &'static str) -> Result<u64, PolicyError> {
    u64::try_from(d.as_nanos()).map_err(|_| PolicyError::TooLarge {
        what,
        value: d.as_nanos(),
        max: u128::from(u64::MAX),
    })
}

/// Why a policy could not be built.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PolicyError {
    /// The limit, burst or capacity was zero: nothing could ever be admitted.
    ZeroLimit,
    /// The window or the rate's period was zero.
    ZeroWindow,
    /// The rate's count was zero: nothing would ever refill.
    ZeroRate,
    /// A value does not fit the arithmetic (nanoseconds in 64 bits) or a documented bound.
    TooLarge {
        /// Which value.
        what: &'static str,
        /// The value given (nanoseconds for durations).
        value: u128,
        /// The largest accepted.
        max: u128,
    },
    /// A policy name with characters outside `a-z A-Z 0-9 - _ . :`, empty or too long.
    InvalidName(String),
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::ZeroLimit => f.write_str("the limit (or burst) must be at least 1"),
            PolicyError::ZeroWindow => {
                f.write_str("the window (or rate period) must be longer than zero")
            }
            PolicyError::ZeroRate => f.write_str("the rate must allow at least 1 event per period"),
            PolicyError::TooLarge { what, value, max } => {
                write!(f, "the {what} is too large: {value} (at most {max})")
            }
            PolicyError::InvalidName(name) => write!(
                f,
                "invalid policy name {name:?}: use 1 to {MAX_NAME_LEN} of a-z A-Z 0-9 - _ . :"
            ),
        }
    }
}

impl std::error::Error for PolicyError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_absurd_values() {
        let s = Duration::from_secs(1);
        assert_eq!(Policy::sliding_window(0, s), Err(PolicyError::ZeroLimit));
        assert_eq!(
            Policy::fixed_window(1, Duration::ZERO),
            Err(PolicyError::ZeroWindow)
        );
        assert_eq!(
            Policy::token_bucket(Rate::per_second(0), 1),
            Err(PolicyError::ZeroRate)
        );
        assert_eq!(
            Policy::gcra(Rate::new(1, Duration::ZERO), 1),
            Err(PolicyError::ZeroWindow)
        );
        assert!(matches!(
            Policy::gcra(Rate::new(1, Duration::MAX), 1),
            Err(PolicyError::TooLarge { .. })
        ));
        assert!(matches!(
            Policy::leaky_bucket(Rate::per_hour(1), u64::MAX),
            Err(PolicyError::TooLarge { .. })
        ));
        assert!(matches!(
            Policy::sliding_log(u64::MAX, s),
            Err(PolicyError::TooLarge { .. })
        ));
        let err = Policy::fixed_window(1, Duration::MAX).unwrap_err();
        assert!(err.to_string().contains("window is too large"), "{err}");
    }

    #[test]
    fn too_large_errors_name_the_value_and_the_bound() {
        let s = Duration::from_secs(1);
        let max = MAX_SLIDING_LOG_LIMIT;
        assert_eq!(Policy::sliding_log(max, s).unwrap().limit(), max);
        assert_eq!(
            Policy::sliding_log(max + 1, s),
            Err(PolicyError::TooLarge {
                what: "sliding log limit",
                value: u128::from(max) + 1,
                max: u128::from(max),
            })
        );
        // An hour in nanoseconds, times the burst: the product, not a wrapped or clamped one.
        assert_eq!(
            Policy::gcra(Rate::per_hour(1), u64::MAX / 1_000),
            Err(PolicyError::TooLarge {
                what: "burst times interval (ns)",
                value: 3_600_000_000_000 * u128::from(u64::MAX / 1_000),
                max: u128::from(u64::MAX),
            })
        );
    }

    #[test]
    fn rates_algorithms_and_policies_describe_themselves() {
        let rate = Rate::new(7, Duration::from_secs(3));
        assert_eq!((rate.count(), rate.per()), (7, Duration::from_secs(3)));
        assert_eq!(Rate::per_minute(2).count(), 2);
        let names = [
            (Algorithm::FixedWindow, "fixed_window"),
            (Algorithm::SlidingLog, "sliding_log"),
            (Algorithm::SlidingWindow, "sliding_window"),
            (Algorithm::TokenBucket, "token_bucket"),
            (Algorithm::LeakyBucket, "leaky_bucket"),
            (Algorithm::Gcra, "gcra"),
        ];
        for (algorithm, name) in names {
            assert_eq!(algorithm.as_str(), name);
            assert_eq!(algorithm.to_string(), name);
        }
        let p = Policy::gcra(Rate::per_second(5), 10).unwrap();
        assert_eq!(
            format!("{p:?}"),
            "Policy { algorithm: Gcra, limit: 10, interval: 200ms }"
        );
        assert_eq!(
            format!("{:?}", p.named("api").unwrap()),
            r#"Policy { algorithm: Gcra, limit: 10, interval: 200ms, name: "api" }"#
        );
    }

    #[test]
    fn interval_rounds_up() {
        let p = Policy::token_bucket(Rate::per_second(3), 1).unwrap();
        assert_eq!(p.interval(), Duration::from_nanos(333_333_334));
        let p = Policy::token_bucket(Rate::new(u64::MAX, Duration::from_secs(1)), 1).unwrap();
        assert_eq!(p.interval(), Duration::from_nanos(1));
    }

    #[test]
    fn names_are_validated_and_part_of_the_identity() {
        let p = Policy::fixed_window(10, Duration::from_secs(1)).unwrap();
        let named = p.clone().named("per-second").unwrap();
        assert_ne!(p.id(), named.id());
        assert_eq!(named.clone().named("per-second").unwrap().id(), named.id());
        assert!(matches!(
            p.clone().named(""),
            Err(PolicyError::InvalidName(_))
        ));
        assert!(matches!(
            p.clone().named("a\"b"),
            Err(PolicyError::InvalidName(_))
        ));
        assert!(matches!(
            p.named("x".repeat(65)),
            Err(PolicyError::InvalidName(_))
        ));
    }
}
