//! How much the service can have in flight: a fixed number, or one that follows latency.
//!
//! The adaptive controllers are pure: each completed request is a sample (when it completed,
//! its time in flight, the requests in flight when it started, whether it failed), and they
//! never read a clock. Samples are gathered in windows of at least ten samples and two round
//! trips, and the limit moves once per window, by the window's median: a change of the limit shows in the latency
//! only a round trip later, and a controller that moved on every sample would overshoot,
//! swinging between far too many and far too few.

use std::fmt;
use std::time::Duration;

use arrayvec::ArrayVec;

/// The capacity a [`LoadShedLayer`](super::LoadShedLayer) sheds against: the requests in
/// flight the service can take.
#[derive(Clone, Debug)]
pub struct Limit {
    pub(crate) kind: LimitKind,
    pub(crate) min: u32,
    pub(crate) max: u32,
    /// Whether a window with failures backs off whatever its latency and use.
    pub(crate) any_failure: bool,
}

#[derive(Clone, Debug)]
pub(crate) enum LimitKind {
    Fixed,
    Vegas {
        initial: u32,
    },
    Aimd {
        initial: u32,
        latency: Duration,
        backoff: f64,
    },
}

impl Limit {
    /// Always `n` in flight.
    pub fn fixed(n: u32) -> Self {
        Limit {
            kind: LimitKind::Fixed,
            min: n,
            max: n,
            any_failure: false,
        }
    }

    /// The default adaptive limit, TCP Vegas as Netflix's concurrency-limits uses it: the
    /// time in flight without queueing is the least window median, and `limit × (1 − least /
    /// now)` estimates how many requests wait in a queue; the limit grows while that estimate
    /// is below `3·log10(limit)` and shrinks when it passes `6·log10(limit)`, so it settles
    /// where a few requests queue, close to what the service can serve at once. It starts at
    /// `initial` and stays within 1 to 1,000 unless bounded otherwise ([`Limit::bounds`]).
    ///
    /// The time without queueing is guarded against answers faster than the service's own: a
    /// shorter one is learnt only once three windows in a row with the limit in use read
    /// shorter (their median is taken), so a burst of 404s from a scanner or of instant errors
    /// cannot lower it on its own; a request whose client gave up counts only as a lower bound
    /// of its time (given up sooner than the time without queueing, it teaches nothing); and a
    /// time so short that the whole limit reads as queued, three windows in a row, is
    /// forgotten. A longer one is learnt at a probe, every `300 × limit` samples.
    ///
    /// Why the default: it needs no latency target from you, it follows a service that gets
    /// faster or slower, and under load it converges near the true capacity rather than
    /// oscillating around a threshold as AIMD does.
    pub fn vegas(initial: u32) -> Self {
        Limit {
            kind: LimitKind::Vegas { initial },
            min: 1,
            max: 1_000,
            any_failure: false,
        }
    }

    /// Additive increase, multiplicative decrease against a latency target: a window of
    /// requests (ten or more, over twice `latency`) whose median is slower than `latency`, or
    /// in which one in twenty failed with 70 % of the limit in flight (see
    /// [`back_off_on_any_failure`](Limit::back_off_on_any_failure)), multiplies the limit by
    /// 0.9; a faster one in which the limit was in
    /// use adds one. Simple and predictable when you know the latency your service should
    /// keep. Starts at `initial`, within 1 to 1,000 unless bounded otherwise.
    pub fn aimd(initial: u32, latency: Duration) -> Self {
        Limit {
            kind: LimitKind::Aimd {
                initial,
                latency,
                backoff: 0.9,
            },
            min: 1,
            max: 1_000,
            any_failure: false,
        }
    }

    /// Keeps an adaptive limit within `min..=max` (`min` at least 1), so that it can neither
    /// collapse to zero nor grow without limit.
    pub fn bounds(mut self, min: u32, max: u32) -> Self {
        if !matches!(self.kind, LimitKind::Fixed) {
            self.min = min.max(1);
            self.max = max.max(self.min);
        }
        self
    }

    /// Backs off on every window in which one request in twenty failed (an error, a 503 or a
    /// 504, gRPC `UNAVAILABLE` or `DEADLINE_EXCEEDED`), whatever its latency and however much
    /// of the limit is in use. By default failures count as overload only in a window that is
    /// also slow (Vegas: a long queue; AIMD: slower than its target) or in which the requests
    /// in flight reached 70 % of the limit: a route whose dependency is down answers 503 at
    /// once while the service has room, and would otherwise pull the limit to its floor. Ask
    /// for this when your service sheds its own load with fast 503s.
    pub fn back_off_on_any_failure(mut self) -> Self {
        self.any_failure = true;
        self
    }

    pub(crate) fn controller(&self) -> Controller {
        let clamp = |n: u32| f64::from(n.clamp(self.min, self.max));
        match &self.kind {
            LimitKind::Fixed => Controller::Fixed(self.max),
            LimitKind::Vegas { initial } => Controller::Vegas(
                Vegas {
                    limit: clamp(*initial),
                    min: f64::from(self.min),
                    max: f64::from(self.max),
                    least: 0,
                    faster: [0; VEGAS_CONFIRM],
                    confirmed: 0,
                    implausible: 0,
                    samples_since_probe: 0,
                    any_failure: self.any_failure,
                },
                Window::default(),
            ),
            LimitKind::Aimd {
                initial,
                latency,
                backoff,
            } => Controller::Aimd(
                Aimd {
                    limit: clamp(*initial),
                    min: f64::from(self.min),
                    max: f64::from(self.max),
                    target: u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX),
                    backoff: *backoff,
                    any_failure: self.any_failure,
                },
                Window::default(),
            ),
        }
    }
}

/// One completed request, as the controllers see it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sample {
    /// When it completed, on the layer's clock, in nanoseconds.
    pub(crate) at: u64,
    /// Its time in flight, in nanoseconds (at least 1).
    pub(crate) nanos: u64,
    /// Requests in flight when it was admitted (itself included).
    pub(crate) in_flight: u32,
    /// Whether it failed as an overloaded service fails: an error, a 503 or a 504.
    pub(crate) failed: bool,
    /// Whether its client gave up before the answer: its time is only a lower bound of the
    /// time the service would have taken.
    pub(crate) abandoned: bool,
}

/// A limit and its state.
pub(crate) enum Controller {
    Fixed(u32),
    Vegas(Vegas, Window),
    Aimd(Aimd, Window),
}

/// The samples of one window, summed up.
#[derive(Clone, Debug, Default)]
pub(crate) struct Window {
    start: u64,
    count: u32,
    /// The first times in flight of the window, for its median.
    times: ArrayVec<u64, WINDOW_KEPT>,
    in_flight: u32,
    failures: u32,
}

/// How many times in flight a window keeps for its median.
const WINDOW_KEPT: usize = 64;

/// The fewest samples a window holds.
const WINDOW_SAMPLES: u32 = 10;

impl Window {
    /// Adds a sample; the window's summary once it has enough (then it starts anew). A request
    /// abandoned sooner than `floor` (the time without a queue; 0 if none is known) is left
    /// out: its time says only that the service takes at least that long, which is known.
    fn add(&mut self, s: Sample, round_trip: u64, floor: u64) -> Option<Summary> {
        if s.abandoned && (floor == 0 || s.nanos < floor) {
            return None;
        }
        if self.count == 0 {
            self.start = s.at.saturating_sub(s.nanos);
        }
        self.count += 1;
        let _ = self.times.try_push(s.nanos);
        self.in_flight = self.in_flight.max(s.in_flight);
        self.failures += u32::from(s.failed);
        let long_enough = s.at.saturating_sub(self.start) >= round_trip.saturating_mul(2);
        if self.count < WINDOW_SAMPLES || !long_enough {
            return None;
        }
        let middle = self.times.len() / 2;
        let median = *self.times.select_nth_unstable(middle).1;
        let summary = Summary {
            count: self.count,
            typical: median.max(1),
            in_flight: self.in_flight,
            // A window fails when one in twenty of its requests did: a stray error is not
            // overload.
            failed: self.failures.saturating_mul(20) >= self.count,
        };
        *self = Window::default();
        Some(summary)
    }
}

/// Whether the requests in flight reached 70 % of `limit` in the window (where the least
/// important class is shed by default): only then do its failures say the limit is too high
/// (below, a route that fails fast fails alike at any limit).
fn full(w: &Summary, limit: f64) -> bool {
    f64::from(w.in_flight) >= (0.7 * limit).floor().max(1.0)
}

/// What a window saw.
#[derive(Clone, Copy, Debug)]
struct Summary {
    count: u32,
    /// The median time in flight: a few requests delayed by something else than a queue (a
    /// busy CPU, a pause) move it little, where they would move an average.
    typical: u64,
    in_flight: u32,
    failed: bool,
}

impl Controller {
    /// The limit now.
    pub(crate) fn limit(&self) -> u32 {
        match self {
            Controller::Fixed(n) => *n,
            Controller::Vegas(v, _) => v.limit as u32,
            Controller::Aimd(a, _) => a.limit as u32,
        }
    }

    /// Learns from one completed request.
    pub(crate) fn sample(&mut self, sample: Sample) {
        match self {
            Controller::Fixed(_) => {}
            Controller::Vegas(v, window) => {
                let round_trip = if v.least == 0 { sample.nanos } else { v.least };
                if let Some(summary) = window.add(sample, round_trip, v.least) {
                    v.update(summary);
                }
            }
            Controller::Aimd(a, window) => {
                if let Some(summary) = window.add(sample, a.target, a.target) {
                    a.update(summary);
                }
            }
        }
    }
}

impl fmt::Debug for Controller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Controller({})", self.limit())
    }
}

/// After `limit` times this many samples, Vegas takes the median of the last window as its
/// time without a queue if it is slower, so that a service that lastingly got slower is not
/// read as one with a queue for ever (about a minute at 100 in flight and 500 requests per
/// second). Netflix's concurrency-limits probes ten times as often; measured here, that let a
/// standing queue in which every request waits alike become the new "no queue" and ratchet
/// the limit up (a simulated service settled at 138 % of its capacity instead of 113 %).
const VEGAS_PROBE_EVERY: f64 = 300.0;

/// How many windows in a row, each with the limit in use, must read faster than the time
/// without a queue before Vegas takes their median as the new one. A burst of fast answers (a
/// scanner's 404s, a cache warming up) fills a window or two, and mostly while the limit is
/// not in use; a service that got faster reads faster window after window, under load.
const VEGAS_CONFIRM: usize = 3;

/// How many windows in a row, each with the limit in use, may estimate the whole limit queued
/// (not one request being served: the time without a queue is too short to be true) before
/// Vegas forgets that time and takes the window's median instead.
const VEGAS_IMPLAUSIBLE: u32 = 3;

pub(crate) struct Vegas {
    limit: f64,
    min: f64,
    max: f64,
    /// The time in flight without a queue (0: none yet): the least window median that held.
    least: u64,
    /// The medians of the windows in a row that read faster than `least` with the limit in
    /// use (the first `confirmed`).
    faster: [u64; VEGAS_CONFIRM],
    confirmed: usize,
    /// How many windows in a row estimated the whole limit queued.
    implausible: u32,
    samples_since_probe: u64,
    any_failure: bool,
}

impl Vegas {
    fn update(&mut self, w: Summary) {
        self.samples_since_probe += u64::from(w.count);
        let in_use = f64::from(w.in_flight) * 2.0 >= self.limit;
        if self.least == 0 {
            self.least = w.typical;
            return;
        }
        // The time without a queue is a window median, never a single sample, and it gets
        // shorter only once several windows in a row under load read shorter: a burst of fast
        // answers (404s from a scanner) or of requests abandoned early cannot lower it on its
        // own, and one that did would read every ordinary window as a full queue and pull the
        // limit down window after window.
        let log = self.limit.log10().max(1.0);
        if w.failed && (self.any_failure || full(&w, self.limit)) {
            // Failures under load (or any, if asked) back off whatever the window's time: fast
            // failures (a service shedding its own load with quick 503s) must not read as a
            // faster service first.
            self.confirmed = 0;
            self.limit = (self.limit - log).clamp(self.min, self.max);
            return;
        }
        if w.typical < self.least {
            if in_use && !w.failed {
                self.faster[self.confirmed] = w.typical;
                self.confirmed += 1;
                if self.confirmed == VEGAS_CONFIRM {
                    self.faster.sort_unstable();
                    self.least = self.faster[VEGAS_CONFIRM / 2];
                    self.confirmed = 0;
                }
            } else {
                // Not in a row: a streak of faster windows under load starts again.
                self.confirmed = 0;
            }
            self.implausible = 0;
            return;
        }
        self.confirmed = 0;
        if self.samples_since_probe as f64 >= VEGAS_PROBE_EVERY * self.limit {
            // The probe only ever learns a slower service: a faster one is learnt above.
            self.samples_since_probe = 0;
            self.least = w.typical;
            self.implausible = 0;
            return;
        }
        let nanos = w.typical;
        let queue = (self.limit * (1.0 - self.least as f64 / nanos as f64)).ceil();
        if in_use && queue >= self.limit.floor() {
            // The whole limit queued, not one request served: the time without a queue is too
            // short to be true (learnt from answers much faster than the service's own). Forget
            // it once the estimate stays so.
            self.implausible += 1;
            if self.implausible >= VEGAS_IMPLAUSIBLE {
                self.implausible = 0;
                self.least = w.typical;
                return;
            }
        } else {
            self.implausible = 0;
        }
        // Failures are overload when the window is also slow or the limit full (or always, if
        // asked): a route whose dependency is down fails fast while the service has room.
        let overloaded =
            w.failed && (self.any_failure || full(&w, self.limit) || queue > 6.0 * log);
        let next = if overloaded {
            self.limit - log
        } else if !in_use {
            // The limit is not in use: nothing to learn about it.
            return;
        } else if queue <= log {
            self.limit + 6.0 * log
        } else if queue < 3.0 * log {
            self.limit + log
        } else if queue > 6.0 * log {
            self.limit - log
        } else {
            return;
        };
        self.limit = next.clamp(self.min, self.max);
    }
}

pub(crate) struct Aimd {
    limit: f64,
    min: f64,
    max: f64,
    target: u64,
    backoff: f64,
    any_failure: bool,
}

impl Aimd {
    fn update(&mut self, w: Summary) {
        let in_use = f64::from(w.in_flight) * 2.0 >= self.limit;
        let failed = w.failed && (self.any_failure || full(&w, self.limit));
        let next = if failed || w.typical > self.target {
            self.limit * self.backoff
        } else if in_use {
            self.limit + 1.0
        } else {
            return;
        };
        self.limit = next.clamp(self.min, self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `n` samples of `ms` each, completing one millisecond apart from `*at` on.
    fn feed(c: &mut Controller, at: &mut u64, n: u32, ms: u64, in_flight: u32, failed: bool) {
        for _ in 0..n {
            *at += 1_000_000;
            c.sample(Sample {
                at: *at,
                nanos: ms * 1_000_000,
                in_flight,
                failed,
                abandoned: false,
            });
        }
    }

    /// Fast failures, most of each window, back off when asked to (they used to read as a
    /// faster window first, and the limit never moved).
    #[test]
    fn any_failure_backs_off_even_when_failures_are_fast() {
        let mut c = Limit::vegas(100).back_off_on_any_failure().controller();
        let mut at = 0;
        feed(&mut c, &mut at, 205, 100, 60, false);
        for _ in 0..2_000 {
            feed(&mut c, &mut at, 1, 100, 20, false);
            feed(&mut c, &mut at, 2, 1, 20, true);
        }
        assert!(c.limit() < 100, "{}", c.limit());
    }

    #[test]
    fn bounds_hold_whatever_the_samples() {
        for limit in [
            Limit::vegas(10).bounds(5, 50),
            Limit::aimd(10, Duration::from_millis(100)).bounds(5, 50),
        ] {
            let mut c = limit.controller();
            let mut at = 0;
            for i in 0..10_000u64 {
                feed(&mut c, &mut at, 1, 1 + (i % 7) * 50, 1_000, i % 11 == 0);
                assert!((5..=50).contains(&c.limit()), "{limit:?}: {}", c.limit());
            }
            // Failures only, with the limit in use: down to the floor, never zero.
            feed(&mut c, &mut at, 10_000, 1, 1_000, true);
            assert_eq!(c.limit(), 5, "{limit:?}");
        }
        assert_eq!(Limit::vegas(10).bounds(0, 0).controller().limit(), 1);
        assert_eq!(Limit::fixed(7).bounds(1, 100).controller().limit(), 7);
    }

    /// A window closes at its tenth sample once it spans two round trips, and speaks for its
    /// median, not its fastest or slowest sample.
    #[test]
    fn a_window_holds_ten_samples_and_reads_its_median() {
        let mut w = Window::default();
        let ms = 1_000_000;
        // Ten distinct times, shuffled, completing long after they started.
        let times = [7, 3, 10, 1, 6, 9, 2, 8, 5, 4];
        for (i, &t) in times.iter().enumerate() {
            let sample = Sample {
                at: 10_000 * ms + i as u64,
                nanos: t * ms,
                in_flight: 1,
                failed: false,
                abandoned: false,
            };
            let summary = w.add(sample, ms, 0);
            if i < 9 {
                assert!(summary.is_none(), "closed after {} samples", i + 1);
            } else {
                let summary = summary.expect("the tenth sample closes the window");
                assert_eq!(summary.count, 10);
                assert_eq!(summary.typical, 6 * ms);
            }
        }
        // Not long enough: ten samples within one round trip keep the window open.
        let mut w = Window::default();
        for i in 0..10 {
            let sample = Sample {
                at: 100 * ms + i,
                nanos: 100 * ms,
                in_flight: 1,
                failed: false,
                abandoned: false,
            };
            assert!(w.add(sample, 100 * ms, 0).is_none());
        }
    }

    /// A stray failure is not overload; one request in twenty failing is.
    #[test]
    fn a_window_fails_from_one_in_twenty() {
        let mut c = Limit::aimd(100, Duration::from_millis(100)).controller();
        let mut at = 0;
        for _ in 0..10 {
            feed(&mut c, &mut at, 99, 50, 10, false);
            feed(&mut c, &mut at, 1, 50, 10, true);
        }
        assert_eq!(c.limit(), 100, "one in a hundred");
        for _ in 0..50 {
            feed(&mut c, &mut at, 19, 50, 10, false);
            feed(&mut c, &mut at, 1, 50, 10, true);
        }
        assert_eq!(c.limit(), 100, "one in twenty, the limit not full nor slow");
        for _ in 0..50 {
            feed(&mut c, &mut at, 19, 50, 95, false);
            feed(&mut c, &mut at, 1, 50, 95, true);
        }
        assert!(c.limit() < 100, "one in twenty: {}", c.limit());
    }

    #[test]
    fn aimd_backs_off_when_slow_and_grows_when_used() {
        let mut c = Limit::aimd(100, Duration::from_millis(100)).controller();
        let mut at = 0;
        // One window (ten samples or more, over 200 ms) of slow requests: one decrease per
        // window, not one per sample.
        feed(&mut c, &mut at, 200, 150, 100, false);
        assert_eq!(c.limit(), 90);
        // Fast and in use: one more per window.
        feed(&mut c, &mut at, 1_000, 50, 90, false);
        let grown = c.limit();
        assert!((93..=96).contains(&grown), "{grown}");
        // Unused: no growth (past the window still open from before).
        feed(&mut c, &mut at, 300, 50, 10, false);
        let grown = c.limit();
        feed(&mut c, &mut at, 2_000, 50, 10, false);
        assert_eq!(c.limit(), grown);
        // A window with a failure backs off.
        feed(&mut c, &mut at, 300, 50, 91, true);
        assert!(c.limit() < grown);
    }

    /// A service that lastingly got slower is learnt anew: its limit comes back.
    #[test]
    fn vegas_learns_a_lasting_slowdown() {
        let mut c = Limit::vegas(50).controller();
        let mut at = 0;
        feed(&mut c, &mut at, 2_000, 100, 50, false);
        let before = c.limit();
        // Twice as slow for good, with the limit in use: at first it reads as a queue.
        feed(&mut c, &mut at, 500, 200, before, false);
        let shrunk = c.limit();
        assert!(shrunk < before / 2, "{before} -> {shrunk}");
        // After the probe, 200 ms is the time without a queue.
        feed(&mut c, &mut at, 300 * 1_000, 200, 1_000, false);
        assert!(c.limit() >= before, "{shrunk} -> {}", c.limit());
    }

    #[test]
    fn vegas_grows_without_queueing_and_shrinks_with_it() {
        let mut c = Limit::vegas(20).controller();
        let mut at = 0;
        // The first window only sets the time without a queue; the next ones grow.
        feed(&mut c, &mut at, 1_000, 100, 20, false);
        assert!(c.limit() > 20, "no queue: grows, {}", c.limit());
        let grown = c.limit();
        // Two thirds of the time is queueing.
        feed(&mut c, &mut at, 1_000, 300, grown, false);
        assert!(c.limit() < grown, "a long queue: shrinks, {}", c.limit());
        // Half the limit in flight is the limit in use (and less is not).
        let mut c = Limit::vegas(20).controller();
        let mut at = 0;
        feed(&mut c, &mut at, 1_000, 100, 10, false);
        assert!(c.limit() > 20, "half in use: grows, {}", c.limit());
        let mut c = Limit::vegas(20).controller();
        feed(&mut c, &mut at, 1_000, 100, 9, false);
        assert_eq!(c.limit(), 20, "under half: unchanged");
    }

    /// Feeds one sample as [`feed`] does, given up by its client.
    fn abandon(c: &mut Controller, at: &mut u64, n: u32, ms: u64, in_flight: u32) {
        for _ in 0..n {
            *at += 1_000_000;
            c.sample(Sample {
                at: *at,
                nanos: ms * 1_000_000,
                in_flight,
                failed: false,
                abandoned: true,
            });
        }
    }

    fn least(c: &Controller) -> u64 {
        match c {
            Controller::Vegas(v, _) => v.least / 1_000_000,
            _ => unreachable!(),
        }
    }

    /// Feeds samples of `ms` until a window closes.
    fn window(c: &mut Controller, at: &mut u64, ms: u64, in_flight: u32) {
        let seen = |c: &Controller| match c {
            Controller::Vegas(v, _) => v.samples_since_probe,
            _ => unreachable!(),
        };
        let before = seen(c);
        while seen(c) == before {
            feed(c, at, 1, ms, in_flight, false);
        }
    }

    /// A faster time without a queue is learnt only from windows in a row, under load, that
    /// read faster; a window or two of fast answers, with or without load, is not enough.
    #[test]
    fn vegas_learns_a_faster_service_only_under_load_and_in_a_row() {
        let mut c = Limit::vegas(100).controller();
        let mut at = 0;
        window(&mut c, &mut at, 100, 60);
        assert_eq!(least(&c), 100);
        // Fast windows with the limit not in use (a scanner's 404s): nothing learnt.
        for _ in 0..10 {
            window(&mut c, &mut at, 1, 10);
        }
        assert_eq!(least(&c), 100);
        // Two fast windows under load, then an ordinary one: the candidate goes.
        window(&mut c, &mut at, 1, 100);
        window(&mut c, &mut at, 1, 100);
        window(&mut c, &mut at, 100, 100);
        assert_eq!(least(&c), 100);
        // Lastingly faster under load: learnt, as the slowest of the fast windows.
        window(&mut c, &mut at, 50, 100);
        window(&mut c, &mut at, 40, 100);
        assert_eq!(least(&c), 100);
        window(&mut c, &mut at, 50, 100);
        assert_eq!(least(&c), 50);
        // The probe never lowers it.
        let mut c = Limit::vegas(1).bounds(1, 1).controller();
        window(&mut c, &mut at, 100, 1);
        feed(&mut c, &mut at, 1_000, 100, 1, false);
        feed(&mut c, &mut at, 1_000, 10, 0, false);
        assert_eq!(least(&c), 100);
    }

    /// A request given up sooner than the time without a queue teaches nothing; one given up
    /// later is at least that slow, and counts.
    #[test]
    fn vegas_reads_an_abandoned_time_as_a_lower_bound() {
        let mut c = Limit::vegas(100).controller();
        let mut at = 0;
        feed(&mut c, &mut at, 205, 100, 60, false);
        let before = c.limit();
        abandon(&mut c, &mut at, 5_000, 1, 100);
        assert_eq!((least(&c), c.limit()), (100, before));
        // Given up after 400 ms with the limit in use: a queue; the limit shrinks.
        abandon(&mut c, &mut at, 1_000, 400, 100);
        assert!(c.limit() < before, "{}", c.limit());
        assert_eq!(least(&c), 100);
    }

    /// A time without a queue that was learnt wrong (far too short: every window then reads the
    /// whole limit as queued, not one request being served) is forgotten after a few windows.
    #[test]
    fn vegas_forgets_an_impossible_time_without_a_queue() {
        let mut c = Limit::vegas(100).controller();
        let mut at = 0;
        // The very first window is a scanner's: 1 ms.
        feed(&mut c, &mut at, 30, 1, 60, false);
        assert_eq!(least(&c), 1);
        // Then 500 ms with the limit (now 124) in use: "124 queued" of 124. (While the limit is
        // not in use, the wrong time does no harm: the limit does not move.)
        for _ in 0..3 {
            window(&mut c, &mut at, 500, 100);
        }
        assert_eq!(least(&c), 500);
        assert!(c.limit() >= 115, "{}", c.limit());
    }

    /// Failures back off only with the limit in use or a slow window, unless asked always.
    #[test]
    fn failures_are_overload_only_under_load_unless_asked() {
        for limit in [
            Limit::vegas(100),
            Limit::aimd(100, Duration::from_millis(100)),
        ] {
            let mut c = limit.clone().controller();
            let mut at = 0;
            // A route that fails at once, one request in ten, at 20 in flight of 100.
            for _ in 0..500 {
                feed(&mut c, &mut at, 9, 50, 20, false);
                feed(&mut c, &mut at, 1, 1, 20, true);
            }
            assert!(c.limit() >= 100, "{limit:?}: {}", c.limit());
            let mut c = limit.back_off_on_any_failure().controller();
            let mut at = 0;
            for _ in 0..500 {
                feed(&mut c, &mut at, 9, 50, 20, false);
                feed(&mut c, &mut at, 1, 1, 20, true);
            }
            assert!(c.limit() < 50, "{}", c.limit());
        }
    }
}
