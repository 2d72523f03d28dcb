//! Time for the limiters: a monotonic clock measured in nanoseconds.
//!
//! Every limiter in tollgate reads time through the [`Clock`] trait and nothing else. The
//! default, [`SystemClock`], is monotonic: a jump of the wall clock (NTP, a changed time zone,
//! a suspended VM resynchronising) changes nothing. [`ManualClock`] is for tests: it starts at
//! zero and moves only when told, and its clones share one time line.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::clock::{Clock, ManualClock};
//!
//! let clock = ManualClock::new();
//! let seen_by_store = clock.clone();
//! clock.advance(Duration::from_millis(1500));
//! assert_eq!(seen_by_store.now(), 1_500_000_000);
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A source of monotonic time, in nanoseconds since an arbitrary origin.
///
/// Implementations must never go backwards. The origin is private to each clock: only
/// differences between two readings of the same clock mean anything.
pub trait Clock: Send + Sync + 'static {
    /// Nanoseconds since this clock's origin.
    fn now(&self) -> u64;

    /// A wait until this clock reads `at` or later, for the waits timed on it (the shedder's
    /// queue). `None`, the default, says that the clock keeps pace with tokio's timer, which
    /// then times the wait (the waiter reads the clock again when it wakes, and waits again if
    /// it is early). A clock that moves otherwise returns its own wait, as [`ManualClock`]
    /// does (it ends when the clock is advanced past `at`).
    fn sleep_until(&self, at: u64) -> Option<Pin<Box<dyn Future<Output = ()> + Send + '_>>> {
        let _ = at;
        None
    }
}

impl<C: Clock> Clock for Arc<C> {
    fn now(&self) -> u64 {
        (**self).now()
    }

    fn sleep_until(&self, at: u64) -> Option<Pin<Box<dyn Future<Output = ()> + Send + '_>>> {
        (**self).sleep_until(at)
    }
}

/// The monotonic clock of the machine.
///
/// It reads the CPU's time-stamp counter where that is reliable and the operating system's
/// monotonic clock otherwise (through `quanta`), so a reading costs a few nanoseconds. Its
/// origin is the moment it was created.
#[derive(Clone)]
pub struct SystemClock {
    clock: quanta::Clock,
    origin: u64,
}

impl SystemClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Self { clock, origin }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for SystemClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SystemClock")
            .field("now_ns", &self.now())
            .finish()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> u64 {
        self.clock.delta_as_nanos(self.origin, self.clock.raw())
    }
}

/// tokio's clock (`tokio::time::Instant`): it follows tokio's paused and advanced time, so
/// that a test or simulation under `#[tokio::test(start_paused = true)]` times requests as
/// tokio's timers see them. Outside paused time it is tokio's monotonic clock. Its origin is
/// the moment it was created.
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::{Clock, TokioClock};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let clock = TokioClock::new();
/// tokio::time::sleep(Duration::from_secs(5)).await; // no real wait under paused time
/// assert_eq!(clock.now(), 5_000_000_000);
/// # }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// A clock whose origin is now, on tokio's time line.
    pub fn new() -> Self {
        Self {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    #[inline]
    fn now(&self) -> u64 {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.origin);
        u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX)
    }
}

/// A clock that moves only when told to, for tests and simulations.
///
/// It starts at zero. Clones share one time line: advancing any of them advances all. Waits
/// timed on it (a shedder's queue) end when it is advanced or set past their end, whatever
/// tokio's timer says.
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
    /// Woken whenever the clock is moved.
    moved: Arc<tokio::sync::Notify>,
}

impl ManualClock {
    /// A clock at time zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `by` (saturating at `u64::MAX` nanoseconds).
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .nanos
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_add(by))
            });
        self.moved.notify_waiters();
    }

    /// Sets the clock to `at` since its origin. Setting it earlier than it is models a clock
    /// that went backwards; the algorithms tolerate that (time never runs backwards inside a
    /// limiter's state), but the system clock never does it.
    pub fn set(&self, at: Duration) {
        let at = u64::try_from(at.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.store(at, Ordering::Release);
        self.moved.notify_waiters();
    }

    /// The current reading as a `Duration` since the origin.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.now())
    }
}

impl Clock for ManualClock {
    #[inline]
    fn now(&self) -> u64 {
        self.nanos.load(Ordering::Acquire)
    }

    fn sleep_until(&self, at: u64) -> Option<Pin<Box<dyn Future<Output = ()> + Send + '_>>> {
        Some(Box::pin(async move {
            loop {
                // Registered before the clock is read, so a move in between still wakes it.
                let mut moved = std::pin::pin!(self.moved.notified());
                moved.as_mut().enable();
                if self.now() >= at {
                    return;
                }
                moved.await;
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_clock_is_monotonic() {
        let clock = SystemClock::new();
        let mut last = clock.now();
        for _ in 0..10_000 {
            let now = clock.now();
            assert!(now >= last);
            last = now;
        }
    }

    /// A wait on a manual clock ends when the clock is moved past its end, not before, and
    /// not by tokio's timer.
    #[tokio::test(start_paused = true)]
    async fn a_wait_on_a_manual_clock_follows_it() {
        let clock = ManualClock::new();
        let other = clock.clone();
        let wait = tokio::spawn(async move {
            if let Some(wait) = other.sleep_until(5_000) {
                wait.await;
            }
            other.now()
        });
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!wait.is_finished(), "tokio's timer does not end it");
        clock.advance(Duration::from_nanos(4_999));
        tokio::task::yield_now().await;
        assert!(!wait.is_finished());
        clock.set(Duration::from_nanos(6_000));
        assert_eq!(wait.await.unwrap(), 6_000);
        assert!(TokioClock::new().sleep_until(1).is_none());
    }

    #[test]
    fn manual_clock_clones_share_time() {
        let a = ManualClock::new();
        let b = a.clone();
        a.advance(Duration::from_secs(2));
        b.advance(Duration::from_nanos(5));
        assert_eq!(a.now(), 2_000_000_005);
        a.set(Duration::from_secs(1));
        assert_eq!(b.elapsed(), Duration::from_secs(1));
        a.advance(Duration::MAX);
        assert_eq!(b.now(), u64::MAX);
    }
}
