//! The circuit breaker that [`ResilientStore`](crate::store::ResilientStore) (around a store) and
//! `client::CircuitBreakerLayer` (around an outbound service) share.
//!
//! Closed: calls go through and consecutive failures are counted; `threshold` of them in a row
//! open it. Open: no call goes through until `open_for` has passed. Then one call at a time
//! probes: a success closes the breaker, a failure opens it again for `open_for`.
//!
//! The owner decides what a success and a failure are; the breaker only counts. Answers that say
//! nothing about the backend are neither: they leave the count as it is, and a probe answered
//! that way hands the probe to the next call ([`ProbeGuard::release`]).
//!
//! Time is read through a [`Clock`], in nanoseconds; an `open_for` that the clock cannot add
//! (beyond `u64::MAX` nanoseconds from now, about 584 years) never probes again.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::clock::Clock;

/// The breaker's state, as it is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BreakerStatus {
    /// Calls go through.
    Closed,
    /// Calls do not go through (until the next probe).
    Open,
    /// One probe call is in flight; the others do not go through.
    HalfOpen,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BreakerState {
    Closed {
        failures: u32,
    },
    /// No call goes through before `until` (the clock's nanoseconds); with `None`, never (an
    /// `open_for` beyond what the clock can represent).
    Open {
        until: Option<u64>,
    },
    /// The probe numbered `probe` is in flight.
    HalfOpen {
        probe: u64,
    },
}

#[derive(Clone, Copy, Debug)]
struct Machine {
    state: BreakerState,
    /// Probes started so far: numbers each half-open state, so that a probe that ends without
    /// an answer re-arms only its own half-open state, never a later one.
    probes: u64,
    /// Changes of state so far. A call remembers the epoch it was sent in, and its answer
    /// moves the breaker only if no change happened since: a call sent before the breaker
    /// opened cannot close it afterwards, nor one sent before a probe closed it open it
    /// again (a backend slower than `open_for` would otherwise flap the breaker).
    epoch: u64,
    /// When another probe may go while one is still out without an answer (with a probe
    /// timeout: a backend that never answers must not hold the breaker half-open for ever).
    next_probe: Option<u64>,
}

impl Machine {
    /// Moves to `state`; the change of status, if there is one, for the observer.
    fn set(&mut self, state: BreakerState) -> Option<Change> {
        let from = self.state;
        self.state = state;
        if std::mem::discriminant(&state) == std::mem::discriminant(&from) {
            return None;
        }
        self.epoch = self.epoch.wrapping_add(1);
        Some(Change {
            from: status(from),
            to: status(state),
            epoch: self.epoch,
        })
    }
}

fn status(state: BreakerState) -> BreakerStatus {
    match state {
        BreakerState::Closed { .. } => BreakerStatus::Closed,
        BreakerState::Open { .. } => BreakerStatus::Open,
        BreakerState::HalfOpen { .. } => BreakerStatus::HalfOpen,
    }
}

/// A change of the breaker's status, as its observer is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Change {
    pub(crate) from: BreakerStatus,
    pub(crate) to: BreakerStatus,
    /// The epoch the change started: observers told out of order (each is told after the
    /// lock is released) keep the latest by it.
    pub(crate) epoch: u64,
}

/// Told of every change of status, after the breaker's lock is released (for metrics and
/// logs).
pub(crate) type Observer = Box<dyn Fn(Change) + Send + Sync>;

/// Whether a call may go through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Permit {
    /// A call, in this epoch.
    Call(u64),
    /// The probe with this number.
    Probe(u64),
    Refuse,
}

/// Whose breaker it is, for its metrics and events.
#[cfg(any(feature = "metrics", feature = "tracing"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// A [`ResilientStore`](crate::store::ResilientStore)'s: labelled `store`.
    Store,
    /// An outbound `client::CircuitBreakerLayer`'s: labelled `client`.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    Client,
}

/// The observer of the breaker named `name`: its state as a gauge (0 closed, 1 half open, 2
/// open), its transitions counted, and each logged (opened: WARN, half open: DEBUG, closed:
/// INFO).
#[cfg(any(feature = "metrics", feature = "tracing"))]
pub(crate) fn observer(role: Role, name: &Arc<str>, open_for: Duration) -> Observer {
    use crate::metrics::{
        BREAKER_STATE, BREAKER_TRANSITIONS_TOTAL, CLIENT_BREAKER_STATE,
        CLIENT_BREAKER_TRANSITIONS_TOTAL,
    };
    use crate::telemetry::{Counter, Gauge, event};
    let (state, transitions, label) = match role {
        Role::Store => (BREAKER_STATE, BREAKER_TRANSITIONS_TOTAL, "store"),
        Role::Client => (
            CLIENT_BREAKER_STATE,
            CLIENT_BREAKER_TRANSITIONS_TOTAL,
            "client",
        ),
    };
    let gauge = Gauge::new(state, &[(label, name)]);
    gauge.set(0.0);
    let to = ["closed", "half_open", "open"]
        .map(|to| Counter::new(transitions, &[(label, name), ("to", to)]));
    let name = Arc::clone(name);
    // The epoch of the change the gauge shows: a change told late (its thread was preempted
    // between releasing the lock and telling) must not overwrite a later one.
    let shown = std::sync::atomic::AtomicU64::new(0);
    Box::new(move |change: Change| {
        let index = match change.to {
            BreakerStatus::Closed => 0,
            BreakerStatus::HalfOpen => 1,
            BreakerStatus::Open => 2,
        };
        if shown.fetch_max(change.epoch, std::sync::atomic::Ordering::AcqRel) < change.epoch {
            gauge.set(index as f64);
        }
        to[index].increment(1);
        let _ = (&name, open_for);
        match (role, change.to) {
            (Role::Store, BreakerStatus::Open) => event!(
                warn,
                name: "tollgate.breaker.opened",
                parent: None,
                store = &*name,
                open_for = ?open_for,
                "the store's circuit breaker opened: calls take the failure policy without asking it"
            ),
            (Role::Store, BreakerStatus::HalfOpen) => event!(
                debug,
                name: "tollgate.breaker.half_open",
                store = &*name,
                "the store's circuit breaker lets a probe through"
            ),
            (Role::Store, BreakerStatus::Closed) => event!(
                info,
                name: "tollgate.breaker.closed",
                parent: None,
                store = &*name,
                "the store's circuit breaker closed: the store answers again"
            ),
            (Role::Client, BreakerStatus::Open) => event!(
                warn,
                name: "tollgate.client.breaker.opened",
                parent: None,
                client = &*name,
                open_for = ?open_for,
                "the outbound circuit breaker opened: calls are refused without reaching the backend"
            ),
            (Role::Client, BreakerStatus::HalfOpen) => event!(
                debug,
                name: "tollgate.client.breaker.half_open",
                client = &*name,
                "the outbound circuit breaker lets a trial call through"
            ),
            (Role::Client, BreakerStatus::Closed) => event!(
                info,
                name: "tollgate.client.breaker.closed",
                parent: None,
                client = &*name,
                "the outbound circuit breaker closed: the backend answers again"
            ),
        }
    })
}

/// A circuit breaker on a clock.
pub(crate) struct Breaker<C> {
    clock: C,
    threshold: u32,
    open_for: Duration,
    /// How long a probe may stay unanswered before another goes (`None`: for ever, for callers
    /// whose calls time out by themselves).
    probe_timeout: Option<Duration>,
    machine: Mutex<Machine>,
    observer: Option<Observer>,
}

impl<C: std::fmt::Debug> std::fmt::Debug for Breaker<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Breaker")
            .field("clock", &self.clock)
            .field("threshold", &self.threshold)
            .field("open_for", &self.open_for)
            .field("probe_timeout", &self.probe_timeout)
            .field("machine", &self.machine)
            .finish_non_exhaustive()
    }
}

fn nanos(d: Duration) -> Option<u64> {
    u64::try_from(d.as_nanos()).ok()
}

impl<C: Clock> Breaker<C> {
    /// Closed; opens after `threshold` (at least 1) consecutive failures, for `open_for`.
    pub(crate) fn new(clock: C, threshold: u32, open_for: Duration) -> Self {
        Self {
            clock,
            threshold: threshold.max(1),
            open_for,
            probe_timeout: None,
            machine: Mutex::new(Machine {
                state: BreakerState::Closed { failures: 0 },
                probes: 0,
                epoch: 0,
                next_probe: None,
            }),
            observer: None,
        }
    }

    /// Tells `observer` of every change of status.
    #[cfg_attr(not(any(feature = "metrics", feature = "tracing")), allow(dead_code))]
    pub(crate) fn observe(mut self, observer: Observer) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Tells the observer of `change`, if any (call it with the lock released).
    fn notify(&self, change: Option<Change>) {
        if let (Some(observer), Some(change)) = (&self.observer, change) {
            observer(change);
        }
    }

    /// The clock's time now, in nanoseconds.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn now(&self) -> u64 {
        self.clock.now()
    }

    /// Lets another probe go when one has stayed unanswered for `timeout` (its answer, should
    /// it still come, then moves nothing): a backend that never answers cannot hold the
    /// breaker half-open for ever.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    pub(crate) fn probe_timeout(mut self, timeout: Duration) -> Self {
        self.probe_timeout = Some(timeout);
        self
    }

    /// The state now.
    pub(crate) fn state(&self) -> BreakerState {
        self.machine.lock().state
    }

    /// The state now, as reported.
    pub(crate) fn status(&self) -> BreakerStatus {
        status(self.state())
    }

    /// How long until the next probe may go: zero when closed or due, `open_for` while a probe
    /// is in flight (its failure would open the breaker for that long), `None` if never.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    pub(crate) fn next_probe_in(&self) -> Option<Duration> {
        match self.state() {
            BreakerState::Closed { .. } => Some(Duration::ZERO),
            BreakerState::Open { until: None } => None,
            BreakerState::Open { until: Some(until) } => {
                Some(Duration::from_nanos(until.saturating_sub(self.clock.now())))
            }
            BreakerState::HalfOpen { .. } => Some(self.open_for),
        }
    }

    /// Whether a call may go through now; the first call after `open_for` is the probe, and
    /// so is, with a [probe timeout](Self::probe_timeout), the first call that long after a
    /// probe that has not been answered.
    pub(crate) fn permit(&self) -> Permit {
        let mut machine = self.machine.lock();
        let now = self.clock.now();
        let (permit, change) = match machine.state {
            BreakerState::Closed { .. } => return Permit::Call(machine.epoch),
            BreakerState::Open { until: Some(until) } if now >= until => self.probe(&mut machine),
            BreakerState::HalfOpen { .. } if machine.next_probe.is_some_and(|at| now >= at) => {
                self.probe(&mut machine)
            }
            BreakerState::Open { .. } | BreakerState::HalfOpen { .. } => return Permit::Refuse,
        };
        drop(machine);
        self.notify(change);
        permit
    }

    fn probe(&self, machine: &mut Machine) -> (Permit, Option<Change>) {
        machine.probes = machine.probes.wrapping_add(1);
        let probe = machine.probes;
        let change = machine.set(BreakerState::HalfOpen { probe });
        machine.next_probe = self.probe_timeout.and_then(|t| self.after(t));
        (Permit::Probe(probe), change)
    }

    /// Now plus `wait`, or `None` beyond the clock's range.
    fn after(&self, wait: Duration) -> Option<u64> {
        nanos(wait).and_then(|wait| self.clock.now().checked_add(wait))
    }

    /// Re-arms the breaker, the next probe due after `wait`, if it is still in the half-open
    /// state of `probe` (a compare and swap: a breaker that another call has closed or opened
    /// since is left alone).
    ///
    /// With no wait (a probe answered without the backend: the deny cache, a caller's
    /// mistake) it stays half-open with the next probe due at once: no change of status to
    /// tell, so a stream of such answers is not logged as the breaker opening each time.
    pub(crate) fn release(&self, probe: u64, wait: Duration) {
        let mut machine = self.machine.lock();
        if machine.state == (BreakerState::HalfOpen { probe }) {
            if wait.is_zero() {
                machine.next_probe = Some(self.clock.now());
                return;
            }
            let until = self.after(wait);
            let change = machine.set(BreakerState::Open { until });
            drop(machine);
            self.notify(change);
        }
    }

    /// Whether the answer to a call sent with `permit` may move the breaker: a probe's while
    /// its half-open state lasts, a call's while the epoch it was sent in lasts.
    fn current(machine: &Machine, permit: Permit) -> bool {
        match permit {
            Permit::Call(epoch) => epoch == machine.epoch,
            Permit::Probe(probe) => machine.state == (BreakerState::HalfOpen { probe }),
            Permit::Refuse => false,
        }
    }

    /// An answer from the backend: it works.
    pub(crate) fn success(&self, permit: Permit) {
        let mut machine = self.machine.lock();
        if Self::current(&machine, permit)
            && machine.state != (BreakerState::Closed { failures: 0 })
        {
            let change = machine.set(BreakerState::Closed { failures: 0 });
            drop(machine);
            self.notify(change);
        }
    }

    /// Closes the breaker whatever its state, telling the observer: for a breaker no call
    /// goes through any more (a part of a store that has left it), whose last state would
    /// otherwise be reported for ever.
    pub(crate) fn reset(&self) {
        let mut machine = self.machine.lock();
        let change = machine.set(BreakerState::Closed { failures: 0 });
        drop(machine);
        self.notify(change);
    }

    /// A failure of the backend; true if it opened the breaker.
    pub(crate) fn failure(&self, permit: Permit) -> bool {
        let mut machine = self.machine.lock();
        if !Self::current(&machine, permit) {
            return false;
        }
        let open = match machine.state {
            BreakerState::Closed { failures } => {
                let failures = failures.saturating_add(1);
                machine.state = BreakerState::Closed { failures };
                failures >= self.threshold
            }
            // A failed probe.
            BreakerState::HalfOpen { .. } => true,
            BreakerState::Open { .. } => false,
        };
        if open {
            // Saturated: an `open_for` beyond the clock's range never probes.
            let until = self.after(self.open_for);
            let change = machine.set(BreakerState::Open { until });
            drop(machine);
            self.notify(change);
        }
        open
    }
}

/// Holds a probe's number while it is in flight, and releases it when the probe ends. A probe
/// answered by the backend has moved the breaker by then (`success` or `failure`), so the
/// release finds nothing to do. One answered without the backend (locally, or with a caller
/// error) leaves its half-open state with the probe due at once, so that the next call probes.
/// One dropped or panicked before its answer reopens the breaker for `open_for`: the backend
/// may well be hanging, and a caller that gives up early must not make every call a probe.
#[derive(Debug)]
pub(crate) struct ProbeGuard<C: Clock> {
    breaker: Arc<Breaker<C>>,
    probe: Option<u64>,
}

impl<C: Clock> ProbeGuard<C> {
    /// Guards the probe of `permit`, if it is one. Make it before anything can panic or return,
    /// the call itself included.
    pub(crate) fn new(breaker: Arc<Breaker<C>>, permit: Permit) -> Self {
        let probe = match permit {
            Permit::Probe(n) => Some(n),
            Permit::Call(_) | Permit::Refuse => None,
        };
        Self { breaker, probe }
    }

    /// The probe got an answer that says nothing of the backend: the next call probes.
    pub(crate) fn release(&mut self) {
        if let Some(probe) = self.probe.take() {
            self.breaker.release(probe, Duration::ZERO);
        }
    }
}

impl<C: Clock> Drop for ProbeGuard<C> {
    fn drop(&mut self) {
        if let Some(probe) = self.probe.take() {
            self.breaker.release(probe, self.breaker.open_for);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn breaker() -> (Arc<Breaker<ManualClock>>, ManualClock) {
        let clock = ManualClock::new();
        let b = Breaker::new(clock.clone(), 2, Duration::from_secs(3));
        (Arc::new(b), clock)
    }

    #[test]
    fn opens_after_the_run_probes_once_and_closes() {
        let (b, clock) = breaker();
        assert_eq!(b.next_probe_in(), Some(Duration::ZERO));
        let p = b.permit();
        assert!(!b.failure(p));
        assert!(b.failure(b.permit()));
        assert_eq!(b.status(), BreakerStatus::Open);
        assert_eq!(b.permit(), Permit::Refuse);
        clock.advance(Duration::from_secs(1));
        assert_eq!(b.next_probe_in(), Some(Duration::from_secs(2)));
        clock.advance(Duration::from_secs(2));
        let probe = b.permit();
        assert!(matches!(probe, Permit::Probe(1)));
        assert_eq!(b.status(), BreakerStatus::HalfOpen);
        assert_eq!(b.next_probe_in(), Some(Duration::from_secs(3)));
        assert_eq!(b.permit(), Permit::Refuse);
        // A failed probe opens it again for the whole of open_for.
        assert!(b.failure(probe));
        assert_eq!(b.next_probe_in(), Some(Duration::from_secs(3)));
        clock.advance(Duration::from_secs(3));
        let probe = b.permit();
        b.success(probe);
        assert_eq!(b.state(), BreakerState::Closed { failures: 0 });
        // The threshold is at least one.
        let one = Breaker::new(ManualClock::new(), 0, Duration::MAX);
        assert!(one.failure(one.permit()));
        assert_eq!(one.next_probe_in(), None);
    }

    /// The observer hears each change of status once: open, half open, closed, and a probe
    /// dropped back to open; a failure that does not open it, a success while closed, or a
    /// probe released without an answer (the next probe due at once) is no change.
    #[test]
    fn the_observer_hears_every_change_of_status() {
        use std::sync::Mutex as StdMutex;
        let heard = Arc::new(StdMutex::new(Vec::new()));
        let clock = ManualClock::new();
        let b = {
            let heard = Arc::clone(&heard);
            Breaker::new(clock.clone(), 2, Duration::from_secs(3)).observe(Box::new(move |c| {
                heard.lock().unwrap().push((c.from, c.to))
            }))
        };
        let b = Arc::new(b);
        b.success(b.permit());
        b.failure(b.permit());
        assert!(heard.lock().unwrap().is_empty());
        b.failure(b.permit());
        clock.advance(Duration::from_secs(3));
        let probe = b.permit();
        b.success(probe);
        b.failure(b.permit());
        b.failure(b.permit());
        clock.advance(Duration::from_secs(3));
        // Released without an answer from the backend: still half open, nothing to tell.
        ProbeGuard::new(Arc::clone(&b), b.permit()).release();
        drop(ProbeGuard::new(Arc::clone(&b), b.permit()));
        use BreakerStatus::*;
        assert_eq!(
            *heard.lock().unwrap(),
            [
                (Closed, Open),
                (Open, HalfOpen),
                (HalfOpen, Closed),
                (Closed, Open),
                (Open, HalfOpen),
                (HalfOpen, Open),
            ]
        );
    }

    /// Changes told out of order (each after the lock is released, by racing threads) leave
    /// the gauge at the latest.
    #[cfg(feature = "metrics")]
    #[test]
    fn the_gauge_keeps_the_latest_change() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let gauge = || {
            snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .find_map(|(key, _, _, value)| {
                    (key.key().name() == crate::metrics::BREAKER_STATE).then_some(value)
                })
        };
        metrics::with_local_recorder(&recorder, || {
            let name: Arc<str> = Arc::from("s");
            let observe = observer(Role::Store, &name, Duration::from_secs(1));
            let change = |to, epoch| Change {
                from: BreakerStatus::HalfOpen,
                to,
                epoch,
            };
            observe(change(BreakerStatus::Closed, 5));
            // The opening of epoch 4, told late.
            observe(change(BreakerStatus::Open, 4));
            assert_eq!(gauge(), Some(DebugValue::Gauge(0.0.into())));
            observe(change(BreakerStatus::Open, 6));
            assert_eq!(gauge(), Some(DebugValue::Gauge(2.0.into())));
        });
    }

    #[test]
    fn a_released_probe_is_due_at_once_and_a_dropped_one_waits() {
        let (b, clock) = breaker();
        b.failure(b.permit());
        b.failure(b.permit());
        clock.advance(Duration::from_secs(3));
        let mut guard = ProbeGuard::new(Arc::clone(&b), b.permit());
        guard.release();
        drop(guard);
        assert_eq!(b.status(), BreakerStatus::HalfOpen);
        assert!(matches!(b.permit(), Permit::Probe(2)));
        assert_eq!(b.permit(), Permit::Refuse, "one probe at a time");
        let guard = ProbeGuard::new(Arc::clone(&b), Permit::Probe(2));
        drop(guard);
        assert_eq!(b.next_probe_in(), Some(Duration::from_secs(3)));
        // A call's guard does nothing.
        drop(ProbeGuard::new(Arc::clone(&b), Permit::Call(0)));
        assert_eq!(b.status(), BreakerStatus::Open);
    }

    #[test]
    fn a_probe_never_answered_does_not_hold_the_breaker_half_open() {
        let clock = ManualClock::new();
        let b = Breaker::new(clock.clone(), 2, Duration::from_secs(3))
            .probe_timeout(Duration::from_secs(3));
        b.failure(b.permit());
        b.failure(b.permit());
        clock.advance(Duration::from_secs(3));
        let stuck = b.permit();
        assert!(matches!(stuck, Permit::Probe(1)));
        clock.advance(Duration::from_secs(2));
        assert_eq!(b.permit(), Permit::Refuse, "one probe at a time");
        clock.advance(Duration::from_secs(1));
        let next = b.permit();
        assert!(matches!(next, Permit::Probe(2)), "{next:?}");
        assert_eq!(b.permit(), Permit::Refuse);
        // The first probe's late answer moves nothing; the second's closes it.
        b.success(stuck);
        assert_eq!(b.status(), BreakerStatus::HalfOpen);
        b.success(next);
        assert_eq!(b.state(), BreakerState::Closed { failures: 0 });
    }

    /// Every interleaving of a few callers' steps, each step one critical section of the
    /// breaker (so every concurrent run is one of these orders), with every answer a call can
    /// get (success, failure, a probe released without the backend, a probe dropped), the
    /// clock moving past `open_for` at any point, with and without a probe timeout: a model
    /// check, exhaustive over small runs (725,760 of them). After every step the breaker agrees
    /// with a model written from its documentation: a call's answer counts only while no
    /// change of status happened since it was sent, a probe's only while it is the current
    /// probe; two current failures open it, a current failed or dropped probe reopens it, a
    /// current success closes it; an open breaker refuses until its time, then lets exactly
    /// one probe go (another only after a release or the probe timeout).
    #[test]
    fn every_interleaving_of_callers_keeps_the_breaker_consistent() {
        #[derive(Clone, Copy, Debug)]
        enum Answer {
            Success,
            Failure,
            /// A probe answered without the backend (the next call probes).
            Release,
            /// A probe dropped before its answer (open again for `open_for`).
            Drop,
        }
        #[derive(Clone, Copy, Debug)]
        enum Step {
            Permit(usize),
            Answer(usize, Answer),
            Tick,
        }
        const OPEN_FOR: Duration = Duration::from_secs(3);

        /// The breaker as its documentation describes it, written again: what each step must do.
        #[derive(Clone, Copy, Debug, PartialEq)]
        enum Model {
            Closed(u32),
            Open(u64),
            /// The probe in flight, and when another may go (a probe answered without the
            /// backend: at once).
            Half(u64, Option<u64>),
        }

        /// Moves the model to `to`, counting a change of status.
        fn moved(model: &mut Model, to: Model, changes: &mut u64) {
            if std::mem::discriminant(model) != std::mem::discriminant(&to) {
                *changes += 1;
            }
            *model = to;
        }

        /// `steps` on a breaker of threshold 2, with a probe timeout of `open_for` or none.
        fn run(steps: &[Step], probe_timeout: bool) {
            let clock = ManualClock::new();
            let mut b = Breaker::new(clock.clone(), 2, OPEN_FOR);
            if probe_timeout {
                b = b.probe_timeout(OPEN_FOR);
            }
            let open_for = u64::try_from(OPEN_FOR.as_nanos()).unwrap();
            // When a probe's half-open state lets another probe go.
            let due = |now: u64| probe_timeout.then_some(now + open_for);
            let mut model = Model::Closed(0);
            // Changes of status so far, and probes started: what makes an answer stale.
            let (mut changes, mut probes) = (0u64, 0u64);
            let mut permits: Vec<Option<(Permit, u64)>> = vec![None; 4];
            for (n, step) in steps.iter().enumerate() {
                let now = clock.now();
                let context = || format!("step {n} of {steps:?}");
                match *step {
                    Step::Tick => clock.advance(OPEN_FOR),
                    Step::Permit(c) => {
                        let expected = match model {
                            Model::Closed(_) => Permit::Call(0),
                            Model::Open(until) if now >= until => {
                                probes += 1;
                                moved(&mut model, Model::Half(probes, due(now)), &mut changes);
                                Permit::Probe(probes)
                            }
                            Model::Half(_, Some(at)) if now >= at => {
                                probes += 1;
                                model = Model::Half(probes, due(now));
                                Permit::Probe(probes)
                            }
                            _ => Permit::Refuse,
                        };
                        let p = b.permit();
                        match (p, expected) {
                            (Permit::Call(_), Permit::Call(_)) => {}
                            _ => assert_eq!(p, expected, "{}", context()),
                        }
                        permits[c] = Some((p, changes));
                    }
                    Step::Answer(c, answer) => {
                        let Some((p, changes_then)) = permits[c].take() else {
                            continue;
                        };
                        let current = match p {
                            Permit::Call(_) => changes == changes_then,
                            Permit::Probe(probe) => {
                                matches!(model, Model::Half(q, _) if q == probe)
                            }
                            Permit::Refuse => false,
                        };
                        match (answer, p) {
                            (Answer::Success, _) => {
                                b.success(p);
                                if current {
                                    moved(&mut model, Model::Closed(0), &mut changes);
                                }
                            }
                            (Answer::Failure, _) => {
                                b.failure(p);
                                if current {
                                    let to = match model {
                                        Model::Closed(f) if f + 1 < 2 => Model::Closed(f + 1),
                                        _ => Model::Open(now + open_for),
                                    };
                                    moved(&mut model, to, &mut changes);
                                }
                            }
                            (Answer::Release, Permit::Probe(probe)) => {
                                b.release(probe, Duration::ZERO);
                                if current {
                                    model = Model::Half(probe, Some(now));
                                }
                            }
                            (Answer::Drop, Permit::Probe(probe)) => {
                                b.release(probe, OPEN_FOR);
                                if current {
                                    moved(&mut model, Model::Open(now + open_for), &mut changes);
                                }
                            }
                            _ => {}
                        }
                    }
                }
                let state = b.state();
                let agrees = match (model, state) {
                    (Model::Closed(f), BreakerState::Closed { failures }) => f == failures,
                    (Model::Open(u), BreakerState::Open { until }) => until == Some(u),
                    (Model::Half(p, _), BreakerState::HalfOpen { probe }) => p == probe,
                    _ => false,
                };
                assert!(agrees, "{model:?} but {state:?}: {}", context());
            }
        }

        /// Every interleaving of `programs` (each run in order) and `ticks` clock moves.
        fn interleave(
            programs: &mut Vec<Vec<Step>>,
            ticks: usize,
            done: &mut Vec<Step>,
            runs: &mut u64,
        ) {
            if programs.iter().all(Vec::is_empty) && ticks == 0 {
                run(done, false);
                run(done, true);
                *runs += 2;
                return;
            }
            for i in 0..programs.len() {
                if programs[i].is_empty() {
                    continue;
                }
                let step = programs[i].remove(0);
                done.push(step);
                interleave(programs, ticks, done, runs);
                done.pop();
                programs[i].insert(0, step);
            }
            if ticks > 0 {
                done.push(Step::Tick);
                interleave(programs, ticks - 1, done, runs);
                done.pop();
            }
        }

        let answers = [
            Answer::Success,
            Answer::Failure,
            Answer::Release,
            Answer::Drop,
        ];
        let mut runs = 0;
        // Three callers, one call each, two clock moves.
        for a in answers {
            for b in answers {
                for c in answers {
                    let mut programs = vec![
                        vec![Step::Permit(0), Step::Answer(0, a)],
                        vec![Step::Permit(1), Step::Answer(1, b)],
                        vec![Step::Permit(2), Step::Answer(2, c)],
                    ];
                    interleave(&mut programs, 2, &mut Vec::new(), &mut runs);
                }
            }
        }
        // Two callers, two calls each, two clock moves.
        for a in answers {
            for b in answers {
                for c in answers {
                    let mut programs = vec![
                        vec![
                            Step::Permit(0),
                            Step::Answer(0, a),
                            Step::Permit(0),
                            Step::Answer(0, c),
                        ],
                        vec![
                            Step::Permit(1),
                            Step::Answer(1, b),
                            Step::Permit(1),
                            Step::Answer(1, Answer::Failure),
                        ],
                    ];
                    interleave(&mut programs, 2, &mut Vec::new(), &mut runs);
                }
            }
        }
        assert_eq!(runs, 725_760);
    }
}
