//! The shedder's configuration, and the state every clone of it shares.

use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, Response, StatusCode};
use tower_layer::Layer;

use super::classify::{Classifier, Criticality};
use super::limit::{Controller, Limit, LimitKind, Sample};
use super::queue::{DEFAULT_CODEL_INTERVAL, DEFAULT_CODEL_TARGET, Discipline, Queue};
use super::service::LoadShed;
use crate::answer::{DefaultResponder, Rejection, RejectionKind, Responder};
use crate::clock::{Clock, SystemClock};
use crate::concurrency::table::InFlight;
use crate::inflight::{Admitted, Answer, Held};
use crate::key::{Key, KeyExtractor};
use crate::sync::{AtomicU32, AtomicU64, Mutex};
use crate::telemetry::{Counter, Gauge, Histogram};

/// The default least `Retry-After` of a shed request.
pub const DEFAULT_SHED_RETRY_AFTER: Duration = Duration::from_secs(1);
/// The default spread added to it, so that shed clients do not all come back at once.
pub const DEFAULT_SHED_JITTER: Duration = Duration::from_secs(2);
/// The default share of capacity past which tenants above their fair share are shed first.
pub const DEFAULT_FAIR_FROM: f64 = 0.8;
/// The default name of a [`LoadShedLayer`] in metrics and logs.
pub const DEFAULT_SHED_LAYER_NAME: &str = "shed";

/// Refuses requests early when the service has no capacity left, least important first: see
/// the [module docs](super).
#[derive(Clone)]
pub struct LoadShedLayer {
    pub(crate) shared: Arc<Shared>,
}

impl LoadShedLayer {
    /// A shedder against `limit`: [`Limit::fixed`], or an adaptive [`Limit::vegas`] (the
    /// usual choice) or [`Limit::aimd`].
    pub fn builder(limit: Limit) -> LoadShedLayerBuilder {
        LoadShedLayerBuilder {
            limit,
            classifier: Box::new(|_: &Parts| Criticality::Critical),
            shares: Criticality::ALL.map(Criticality::default_share),
            share_error: None,
            utilization: None,
            fair: None,
            fair_from: DEFAULT_FAIR_FROM,
            retry_after: DEFAULT_SHED_RETRY_AFTER,
            jitter: DEFAULT_SHED_JITTER,
            responder: Box::new(DefaultResponder),
            clock: Arc::new(SystemClock::new()),
            queue: None,
            discipline: Discipline::default(),
            codel: (DEFAULT_CODEL_TARGET, DEFAULT_CODEL_INTERVAL),
            deadline: None,
            name: DEFAULT_SHED_LAYER_NAME.to_owned(),
        }
    }

    /// The layer's name in metrics and logs (see [`LoadShedLayerBuilder::name`]).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The limit now (it moves with an adaptive [`Limit`]).
    pub fn limit(&self) -> u32 {
        self.shared.limit.load(Ordering::Relaxed)
    }

    /// Requests admitted and not yet done (their bodies not ended).
    pub fn in_flight(&self) -> u32 {
        self.shared.in_flight.load(Ordering::Acquire)
    }

    /// Requests waiting in the queue now (see [`LoadShedLayerBuilder::queue`]; 0 without one).
    pub fn queued(&self) -> usize {
        self.shared.queue.as_ref().map_or(0, Queue::len)
    }

    /// Whether the queue stands, by CoDel (see [`LoadShedLayerBuilder::codel`]), as of the
    /// last time it changed or a waiter looked at it; `false` without a queue.
    pub fn standing(&self) -> bool {
        self.shared.queue.as_ref().is_some_and(Queue::standing)
    }

    /// Requests admitted and shed so far, per class.
    pub fn stats(&self) -> ShedStats {
        let load = |a: &[AtomicU64; 4]| a.each_ref().map(|n| n.load(Ordering::Relaxed));
        ShedStats {
            admitted: load(&self.shared.admitted),
            shed: load(&self.shared.shed),
            timed_out: self
                .shared
                .queue
                .as_ref()
                .map_or([0; 4], |q| load(&q.timed_out)),
        }
    }
}

impl<S> Layer<S> for LoadShedLayer {
    type Service = LoadShed<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LoadShed::new(inner, self.shared.clone())
    }
}

impl fmt::Debug for LoadShedLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadShedLayer")
            .field("name", &self.shared.name)
            .field("limit", &self.limit())
            .field("in_flight", &self.in_flight())
            .field("queued", &self.queued())
            .finish_non_exhaustive()
    }
}

/// Requests admitted and shed, per [`Criticality`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShedStats {
    admitted: [u64; 4],
    shed: [u64; 4],
    timed_out: [u64; 4],
}

impl ShedStats {
    /// Requests of `class` admitted.
    pub fn admitted(&self, class: Criticality) -> u64 {
        self.admitted[class.index()]
    }

    /// Requests of `class` shed: at once, or after waiting in the queue.
    pub fn shed(&self, class: Criticality) -> u64 {
        self.shed[class.index()]
    }

    /// Requests of `class` shed from the queue because their wait ran out: the longest wait,
    /// their client's deadline, or CoDel's target while the queue stood. They are among
    /// [`shed`](ShedStats::shed) too.
    pub fn timed_out(&self, class: Criticality) -> u64 {
        self.timed_out[class.index()]
    }
}

/// Builds a [`LoadShedLayer`]; validated by [`LoadShedLayerBuilder::build`].
pub struct LoadShedLayerBuilder {
    limit: Limit,
    classifier: Box<dyn Classifier>,
    shares: [u16; 4],
    share_error: Option<ShedError>,
    utilization: Option<Box<dyn Fn() -> f64 + Send + Sync>>,
    fair: Option<Box<dyn KeyExtractor>>,
    fair_from: f64,
    retry_after: Duration,
    jitter: Duration,
    responder: Box<dyn Responder>,
    clock: Arc<dyn Clock>,
    queue: Option<(usize, Duration)>,
    discipline: Discipline,
    codel: (Duration, Duration),
    deadline: Option<HeaderName>,
    name: String,
}

impl LoadShedLayerBuilder {
    /// The layer's name in metrics (the `layer` label) and logs ([`DEFAULT_SHED_LAYER_NAME`]
    /// unless set): give each shedder of a process its own.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Puts each request in a class ([`Criticality::Critical`] for all unless set): a
    /// closure over the request head, or [`ByHeader`](super::ByHeader).
    pub fn classify(mut self, classifier: impl Classifier) -> Self {
        self.classifier = Box::new(classifier);
        self
    }

    /// The share of capacity (0.001 to 1) from which requests of `class` are shed. Defaults:
    /// `sheddable` 0.7, `sheddable_plus` 0.8, `critical` 0.9, `critical_plus` 1.0; what lies
    /// above a class's share is kept for the classes above it.
    pub fn share(mut self, class: Criticality, share: f64) -> Self {
        if share.is_finite() && (0.001..=1.0).contains(&share) {
            self.shares[class.index()] = (share * 1000.0).round() as u16;
        } else {
            self.share_error = Some(ShedError::InvalidShare { class, share });
        }
        self
    }

    /// An operator's signal of how busy the service is, from 0 (idle) to 1 (saturated): a
    /// worker pool's utilization, tokio's runtime metrics, a CPU gauge. A request is shed when
    /// the signal reaches its class's share, whatever the limit says. It is called once per
    /// request: keep it to a few atomic loads. A value that is not a number is ignored.
    pub fn utilization(mut self, signal: impl Fn() -> f64 + Send + Sync + 'static) -> Self {
        self.utilization = Some(Box::new(signal));
        self
    }

    /// Fair shedding among tenants keyed by `tenant`: once more than a share of capacity is in
    /// use ([`LoadShedLayerBuilder::fair_from`], 0.8 by default), a tenant with at least its
    /// fair share in flight (the limit divided among the tenants in flight) is shed before
    /// anyone else, so one noisy tenant cannot crowd out the others. Requests without a key
    /// are shed by class only. Key tenants by something your authentication vouches for: a
    /// client that can name a fresh tenant per request dilutes everyone's fair share.
    pub fn fair_by(mut self, tenant: impl KeyExtractor) -> Self {
        self.fair = Some(Box::new(tenant));
        self
    }

    /// The share of capacity (0 to 1) from which tenants above their fair share are shed first.
    pub fn fair_from(mut self, share: f64) -> Self {
        self.fair_from = share;
        self
    }

    /// A shed request's `Retry-After`: `least` plus a random whole number of seconds up to
    /// `jitter` (both rounded up to whole seconds, `least` at least 1 s; 1 s and up to 2 s
    /// more by default), so that shed clients return spread out, not in one wave.
    pub fn retry_after(mut self, least: Duration, jitter: Duration) -> Self {
        self.retry_after = least;
        self.jitter = jitter;
        self
    }

    /// How shed requests are answered ([`DefaultResponder`] unless set: 503 with
    /// `Retry-After`, `no-store` and a problem body; gRPC `UNAVAILABLE` with pushback).
    pub fn responder(mut self, responder: impl Responder) -> Self {
        self.responder = Box::new(responder);
        self
    }

    /// The clock that times requests for an adaptive limit and waits in the queue (the
    /// system's monotonic clock unless set; [`TokioClock`](crate::clock::TokioClock) for
    /// simulations under tokio's paused time).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// A bounded queue in front of the limit: a request that the limit would shed (its class
    /// has no room now) waits instead, up to `max_wait`, for a place to be given back. A
    /// place given back is handed to a waiter there and then, the first in the
    /// [`discipline`](LoadShedLayerBuilder::discipline)'s order whose class may use it, so a
    /// newcomer cannot take it first. At most `max_queued` requests wait (over all classes):
    /// with the queue full, a request is shed at once.
    ///
    /// A waiter is shed (`503`, counted in [`ShedStats::timed_out`]) when it has waited
    /// `max_wait`, less if its client declared a shorter timeout
    /// ([`deadline_header`](LoadShedLayerBuilder::deadline_header)), or CoDel's target while
    /// the queue stands ([`codel`](LoadShedLayerBuilder::codel), on by default with 5 ms).
    /// A waiter whose client goes away leaves the queue and takes nothing. Requests shed by
    /// the [`utilization`](LoadShedLayerBuilder::utilization) signal or for fairness do not
    /// wait: nothing tells when they would have room.
    ///
    /// `max_wait` bounds the latency the queue adds: keep it well under your clients'
    /// timeouts. The wait runs on tokio's timer. No queue unless set; both numbers must be
    /// above zero.
    pub fn queue(mut self, max_queued: usize, max_wait: Duration) -> Self {
        self.queue = Some((max_queued, max_wait));
        self
    }

    /// The order in which waiters get the places given back: [`Discipline::AdaptiveLifo`] (the
    /// default: oldest first while the queue is healthy, newest first while it stands or is
    /// more than half full), [`Discipline::Fifo`] or [`Discipline::Lifo`]. Only with a
    /// [`queue`](LoadShedLayerBuilder::queue).
    pub fn discipline(mut self, discipline: Discipline) -> Self {
        self.discipline = discipline;
        self
    }

    /// CoDel's judgement of the queue (controlled delay, as Facebook applies it to request
    /// queues; defaults [`DEFAULT_CODEL_TARGET`] 5 ms and [`DEFAULT_CODEL_INTERVAL`] 100 ms).
    /// The queue's delay is how long its oldest waiter has waited. When that delay stays at
    /// `target` or more through an `interval`, the queue *stands*: it no longer absorbs a
    /// burst, it only adds latency. Then waiters wait at most `target` (not `max_wait`) before
    /// being shed, and adaptive LIFO serves the newest first. After an interval in which the
    /// delay fell below half the target (the queue drained, or emptied), it is healthy again.
    ///
    /// With a queue and a fixed limit at about what the service serves at once, this is a
    /// capacity signal of its own: a service that falls behind builds a standing queue, which
    /// is shed down to `target`. To wait `max_wait` whatever the queue's state, give a
    /// `target` of `max_wait` or more. Only with a [`queue`](LoadShedLayerBuilder::queue);
    /// both must be above zero.
    pub fn codel(mut self, target: Duration, interval: Duration) -> Self {
        self.codel = (target, interval);
        self
    }

    /// Honours a timeout the client declares in header `name`: such a request waits in the
    /// queue at most that timeout less the time the service typically takes to answer (a
    /// moving average of its recent answers), so that it is not served after its client gave
    /// up; one whose timeout leaves no time to wait is shed at once when it finds no room.
    /// The timeout bounds the wait only: a request that finds room is admitted whatever it
    /// declares.
    ///
    /// Two forms are read: gRPC's `grpc-timeout` (1 to 8 digits and a unit: `H`, `M`, `S`,
    /// `m` for milliseconds, `u`, `n`; `250m`), and plain milliseconds (1 to 8 digits: `250`,
    /// as in Envoy's `x-envoy-expected-rq-timeout-ms` or an `x-request-timeout`). A value in
    /// neither form (a sign, a fraction, `ms` or `s`, more than 8 digits, bytes that are not
    /// ASCII) is ignored: the request waits as if it declared nothing. Only the header's
    /// first value is read. Only with a [`queue`](LoadShedLayerBuilder::queue).
    pub fn deadline_header(mut self, name: HeaderName) -> Self {
        self.deadline = Some(name);
        self
    }

    /// Validates the settings and builds the layer, and registers its metrics (feature
    /// `metrics`: install the recorder first).
    pub fn build(self) -> Result<LoadShedLayer, ShedError> {
        if let Some(err) = self.share_error {
            return Err(err);
        }
        if matches!(self.limit.kind, LimitKind::Fixed) && self.limit.max == 0 {
            return Err(ShedError::ZeroLimit);
        }
        if let LimitKind::Aimd { latency, .. } = &self.limit.kind {
            if latency.is_zero() {
                return Err(ShedError::ZeroLatency);
            }
        }
        if !(self.fair_from.is_finite() && self.fair_from > 0.0 && self.fair_from <= 1.0) {
            return Err(ShedError::InvalidFairFrom(self.fair_from));
        }
        let (target, interval) = self.codel;
        if target.is_zero() || interval.is_zero() {
            return Err(ShedError::InvalidCodel { target, interval });
        }
        let queue = match self.queue {
            Some((max_queued, max_wait)) if max_queued == 0 || max_wait.is_zero() => {
                return Err(ShedError::InvalidQueue {
                    max_queued,
                    max_wait,
                });
            }
            Some((max, max_wait)) => Some(Queue::new(
                max,
                max_wait,
                self.discipline,
                self.codel,
                self.deadline,
            )),
            None => None,
        };
        let controller = self.limit.controller();
        let limit = controller.limit();
        let telemetry = Telemetry::new(
            &self.name,
            self.utilization.is_some(),
            self.fair.is_some(),
            queue.as_ref().map(|q| q.has_deadlines()),
        );
        telemetry.limit.set(f64::from(limit));
        Ok(LoadShedLayer {
            shared: Arc::new(Shared {
                name: self.name.into(),
                telemetry,
                limit: AtomicU32::new(limit),
                controller: Mutex::new(controller),
                in_flight: AtomicU32::new(0),
                shares: self.shares,
                widest: Criticality::ALL
                    .into_iter()
                    .max_by_key(|c| self.shares[c.index()])
                    .unwrap_or(Criticality::CriticalPlus),
                classifier: self.classifier,
                utilization: self.utilization,
                fair: self.fair.map(|key| Fair {
                    key,
                    tenants: InFlight::new(),
                    from: (self.fair_from * 1000.0).round() as u64,
                }),
                retry_after: whole_secs(self.retry_after).max(1),
                jitter: whole_secs(self.jitter),
                draws: AtomicU64::new(0),
                hasher: foldhash::fast::RandomState::default(),
                admitted: Default::default(),
                shed: Default::default(),
                responder: self.responder,
                clock: self.clock,
                queue,
                typical: AtomicU64::new(0),
            }),
        })
    }
}

impl fmt::Debug for LoadShedLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadShedLayerBuilder")
            .field("limit", &self.limit)
            .field("shares", &self.shares)
            .field("fair_from", &self.fair_from)
            .field("queue", &self.queue)
            .field("discipline", &self.discipline)
            .field("codel", &self.codel)
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}

/// Why a [`LoadShedLayer`] could not be built.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum ShedError {
    /// A share that is not within (0, 1].
    InvalidShare {
        /// The class.
        class: Criticality,
        /// The share given.
        share: f64,
    },
    /// A fairness threshold that is not within (0, 1].
    InvalidFairFrom(f64),
    /// `Limit::fixed(0)` would shed every request.
    ZeroLimit,
    /// `Limit::aimd` with a latency target of zero would back off on every window.
    ZeroLatency,
    /// A queue of no places, or with no time to wait.
    InvalidQueue {
        /// The most requests waiting given.
        max_queued: usize,
        /// The longest wait given.
        max_wait: Duration,
    },
    /// A CoDel target or interval of zero.
    InvalidCodel {
        /// The target given.
        target: Duration,
        /// The interval given.
        interval: Duration,
    },
}

impl fmt::Display for ShedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShedError::InvalidShare { class, share } => {
                write!(
                    f,
                    "the share of {class} is {share}: give a number in [0.001, 1]"
                )
            }
            ShedError::InvalidFairFrom(share) => {
                write!(f, "fair_from is {share}: give a number in (0, 1]")
            }
            ShedError::ZeroLimit => f.write_str("a fixed limit of 0 sheds every request"),
            ShedError::ZeroLatency => {
                f.write_str("an AIMD latency target of 0 backs off on every window")
            }
            ShedError::InvalidQueue {
                max_queued,
                max_wait,
            } => write!(
                f,
                "a queue of {max_queued} places with a longest wait of {max_wait:?}: both must \
                 be above zero"
            ),
            ShedError::InvalidCodel { target, interval } => write!(
                f,
                "a CoDel target of {target:?} over an interval of {interval:?}: both must be \
                 above zero"
            ),
        }
    }
}

impl std::error::Error for ShedError {}

/// A duration in whole seconds, rounded up (and bounded, so that adding a few never
/// overflows).
fn whole_secs(d: Duration) -> u64 {
    d.as_secs()
        .saturating_add(u64::from(d.subsec_nanos() > 0))
        .min(u64::from(u32::MAX))
}

/// Why a request was shed: the `reason` label of `tollgate_shed_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// No room for its class (and no queue to wait in).
    Capacity,
    /// The operator's signal said the service is busy.
    Utilization,
    /// Its tenant has its fair share.
    Unfair,
    /// The queue is full.
    QueueFull,
    /// Its client's deadline leaves no time to wait.
    Deadline,
    /// It waited in the queue, and its wait ran out.
    TimedOut,
}

impl Reason {
    const ALL: [Reason; 6] = [
        Reason::Capacity,
        Reason::Utilization,
        Reason::Unfair,
        Reason::QueueFull,
        Reason::Deadline,
        Reason::TimedOut,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Reason::Capacity => "capacity",
            Reason::Utilization => "utilization",
            Reason::Unfair => "unfair",
            Reason::QueueFull => "queue_full",
            Reason::Deadline => "deadline",
            Reason::TimedOut => "timed_out",
        }
    }
}

/// A request shed: its class, and why.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shed {
    pub(crate) class: Criticality,
    pub(crate) reason: Reason,
}

/// The shedder's metrics, registered when it is built.
pub(super) struct Telemetry {
    in_flight: Gauge,
    limit: Gauge,
    pub(super) queue: Histogram,
    /// By class, then by [`Reason`] (those the layer's settings cannot give count nothing).
    shed: [[Counter; 6]; 4],
}

impl Telemetry {
    /// The metrics of a layer named `layer`, with an operator's signal or not, fairness or
    /// not, and a queue (with deadlines or not) or not.
    fn new(layer: &str, utilization: bool, fair: bool, queue: Option<bool>) -> Self {
        use crate::metrics::{IN_FLIGHT, QUEUE_DURATION_SECONDS, SHED_LIMIT, SHED_TOTAL};
        let possible = |reason| match reason {
            Reason::Capacity => true,
            Reason::Utilization => utilization,
            Reason::Unfair => fair,
            Reason::QueueFull | Reason::TimedOut => queue.is_some(),
            Reason::Deadline => queue == Some(true),
        };
        Telemetry {
            in_flight: Gauge::new(IN_FLIGHT, &[("layer", layer)]),
            limit: Gauge::new(SHED_LIMIT, &[("layer", layer)]),
            queue: Histogram::new(QUEUE_DURATION_SECONDS, &[("layer", layer)]),
            shed: Criticality::ALL.map(|class| {
                Reason::ALL.map(|reason| {
                    if possible(reason) {
                        Counter::new(
                            SHED_TOTAL,
                            &[
                                ("layer", layer),
                                ("class", class.as_str()),
                                ("reason", reason.as_str()),
                            ],
                        )
                    } else {
                        Counter::noop()
                    }
                })
            }),
        }
    }
}

/// What every clone of the layer shares.
pub(crate) struct Shared {
    /// The layer's name in metrics and logs.
    name: Arc<str>,
    pub(super) telemetry: Telemetry,
    /// The controller's limit, read on every request without its lock.
    pub(super) limit: AtomicU32,
    controller: Mutex<Controller>,
    pub(super) in_flight: AtomicU32,
    /// Each class's share of capacity, in thousandths.
    shares: [u16; 4],
    /// The class with the largest share.
    pub(super) widest: Criticality,
    classifier: Box<dyn Classifier>,
    utilization: Option<Box<dyn Fn() -> f64 + Send + Sync>>,
    pub(super) fair: Option<Fair>,
    /// The least `Retry-After` and its spread, in whole seconds.
    retry_after: u64,
    jitter: u64,
    draws: AtomicU64,
    hasher: foldhash::fast::RandomState,
    admitted: [AtomicU64; 4],
    shed: [AtomicU64; 4],
    responder: Box<dyn Responder>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) queue: Option<Queue>,
    /// A moving average of the time the service takes to answer, in nanoseconds (each answer
    /// weighs an eighth; 0 before the first): what a client's deadline must leave for it.
    pub(super) typical: AtomicU64,
}

pub(super) struct Fair {
    key: Box<dyn KeyExtractor>,
    pub(super) tenants: InFlight,
    /// The share of capacity past which fairness applies, in thousandths.
    from: u64,
}

/// A place in flight, and its tenant's place with fairness; dropping it gives both back, the
/// place to a waiter first.
pub(crate) struct Place {
    shared: Arc<Shared>,
    tenant: Option<(u64, Key)>,
    /// False once given back by hand.
    armed: bool,
}

impl Place {
    pub(super) fn new(shared: &Arc<Shared>, tenant: Option<(u64, Key)>) -> Self {
        shared.telemetry.in_flight.increment();
        Place {
            shared: Arc::clone(shared),
            tenant,
            armed: true,
        }
    }

    /// Gives the place back under the queue's lock: its count and its tenant's, and nothing
    /// to the waiters (the caller is serving them).
    pub(super) fn give_back_locked(mut self) {
        self.armed = false;
        self.shared.release_tenant(self.tenant.as_ref());
        self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.shared.telemetry.in_flight.decrement();
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.armed {
            self.shared.release_tenant(self.tenant.as_ref());
            self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            self.shared.telemetry.in_flight.decrement();
            self.shared.serve_waiters();
        }
    }
}

/// The place of a request admitted by the shedder; dropping it gives the place back.
pub(crate) struct Guard {
    place: Place,
    started: u64,
    /// Requests in flight when it was admitted, itself included.
    in_flight: u32,
    answered: bool,
}

impl Guard {
    /// The inner service answered: the adaptive limit learns how long it took, unless a
    /// tollgate layer inside refused the request.
    pub(crate) fn answered(&mut self, answer: Answer) {
        if std::mem::replace(&mut self.answered, true) {
            return;
        }
        if let Answer::Served { failed } = answer {
            let nanos = self.sample(failed, false);
            let shared = &self.place.shared;
            if shared.queue.as_ref().is_some_and(Queue::has_deadlines) {
                let _ = shared
                    .typical
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |avg| {
                        Some(if avg == 0 {
                            nanos
                        } else {
                            avg - avg / 8 + nanos / 8
                        })
                    });
            }
        }
    }

    /// Teaches the controller the request's time in flight so far (returned, in nanoseconds);
    /// if the limit grows, the waiters get the new room there and then.
    fn sample(&self, failed: bool, abandoned: bool) -> u64 {
        let shared = &self.place.shared;
        let now = shared.clock.now();
        let nanos = now.saturating_sub(self.started).max(1);
        let mut controller = shared.controller.lock();
        let before = controller.limit();
        controller.sample(Sample {
            at: now,
            nanos,
            in_flight: self.in_flight,
            failed,
            abandoned,
        });
        let after = controller.limit();
        shared.limit.store(after, Ordering::Relaxed);
        drop(controller);
        if after != before {
            shared.telemetry.limit.set(f64::from(after));
            crate::telemetry::event!(
                debug,
                name: "tollgate.shed.limit",
                layer = &*shared.name,
                from = before,
                to = after,
                "the shedder's limit moved"
            );
        }
        if after > before {
            shared.serve_waiters();
        }
        nanos
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        // Dropped before the service answered (the client went away, a timeout fired): its
        // time so far is a sample too, or a service that hangs would teach nothing. The place
        // is given back after this, as the field is dropped.
        if !self.answered {
            self.sample(false, true);
        }
    }
}

/// Why [`Shared::take`] took no place.
pub(super) enum NoPlace {
    /// The class has no room.
    Full,
    /// The tenant has its fair share in flight.
    Unfair,
    /// The count in flight is no longer the one expected (a place came back meanwhile).
    Moved,
}

impl Shared {
    /// Admits a request (at once, or after a wait in the queue), or sheds it (the class it was
    /// shed as).
    pub(crate) fn admit(self: &Arc<Self>, parts: &Parts) -> Result<Admitted, Shed> {
        let class = self.classifier.classify(parts);
        let share = u64::from(self.shares[class.index()]);
        if let Some(signal) = &self.utilization {
            let busy = signal();
            if busy * 1000.0 >= share as f64 {
                return Err(Shed {
                    class,
                    reason: Reason::Utilization,
                });
            }
        }
        let tenant = self.tenant(parts);
        let queue = self.queue.as_ref();
        if let Some(queue) = queue.filter(|q| q.len() > 0) {
            // Requests wait: the queue decides, so that this one cannot overtake them.
            return self.enqueue(queue, parts, class, tenant);
        }
        match self.take(class, tenant.as_ref(), None) {
            Ok(in_flight) => {
                let guard = self.guard(class, Place::new(self, tenant), in_flight);
                Ok(Admitted::Now(Held::Shed(guard)))
            }
            Err(NoPlace::Full | NoPlace::Moved) => match queue {
                Some(queue) => self.enqueue(queue, parts, class, tenant),
                None => Err(Shed {
                    class,
                    reason: Reason::Capacity,
                }),
            },
            Err(NoPlace::Unfair) => {
                // Its place went back: a request that joined the queue meanwhile may use it.
                self.serve_waiters();
                Err(Shed {
                    class,
                    reason: Reason::Unfair,
                })
            }
        }
    }

    /// The tenant of a request, with fairness: its key's hash and its key.
    fn tenant(&self, parts: &Parts) -> Option<(u64, Key)> {
        let fair = self.fair.as_ref()?;
        let mut key = Key::new();
        if !fair.key.extract_into(parts, &mut key) {
            return None;
        }
        key.push_raw("@tenant");
        let key = crate::concurrency::bounded(key);
        Some((fair.tenants.hash(key.as_str()), key))
    }

    /// Takes a place in flight for a request of `class` if its class has room, and its
    /// tenant's if the tenant is within its fair share (or neither): the requests in flight
    /// with it. With `at`, only if the count in flight is still `at`. Nothing is handed to
    /// waiters here.
    pub(super) fn take(
        &self,
        class: Criticality,
        tenant: Option<&(u64, Key)>,
        at: Option<u32>,
    ) -> Result<u32, NoPlace> {
        let limit = u64::from(self.limit.load(Ordering::Relaxed));
        let threshold = self.threshold(class, limit);
        let before = match at {
            None => self
                .in_flight
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < threshold).then_some(n + 1)
                })
                .map_err(|_| NoPlace::Full)?,
            Some(at) if at >= threshold => return Err(NoPlace::Full),
            Some(at) => self
                .in_flight
                .compare_exchange(at, at + 1, Ordering::SeqCst, Ordering::SeqCst)
                .map_err(|_| NoPlace::Moved)?,
        };
        if let (Some(fair), Some((hash, key))) = (&self.fair, tenant) {
            if !fair
                .tenants
                .acquire(*hash, key, self.fair_share(fair, before, limit, key))
            {
                self.in_flight.fetch_sub(1, Ordering::SeqCst);
                return Err(NoPlace::Unfair);
            }
        }
        Ok(before + 1)
    }

    /// The requests in flight from which `class` is shed, under `limit`.
    pub(super) fn threshold(&self, class: Criticality, limit: u64) -> u32 {
        let share = u64::from(self.shares[class.index()]);
        u32::try_from((limit * share / 1000).max(1)).unwrap_or(u32::MAX)
    }

    /// The most requests in flight the tenant of `key` may have when `before` are in flight:
    /// its fair share near capacity (the limit divided among the tenants in flight, this one
    /// counted once), no bound below.
    pub(super) fn fair_share(&self, fair: &Fair, before: u32, limit: u64, key: &Key) -> u32 {
        if u64::from(before) * 1000 < limit * fair.from {
            return u32::MAX;
        }
        let mut tenants = u64::try_from(fair.tenants.keys()).unwrap_or(u64::MAX);
        if fair.tenants.count(key.as_str()) == 0 {
            tenants = tenants.saturating_add(1);
        }
        u32::try_from((limit / tenants.max(1)).max(1)).unwrap_or(u32::MAX)
    }

    fn release_tenant(&self, tenant: Option<&(u64, Key)>) {
        if let (Some((hash, key)), Some(fair)) = (tenant, &self.fair) {
            fair.tenants.release(*hash, key);
        }
    }

    /// The guard of a request of `class` admitted with `place`, `in_flight` with it.
    pub(super) fn guard(&self, class: Criticality, place: Place, in_flight: u32) -> Guard {
        self.admitted[class.index()].fetch_add(1, Ordering::Relaxed);
        Guard {
            place,
            started: self.clock.now(),
            in_flight,
            answered: false,
        }
    }

    /// The answer to a request shed.
    pub(crate) fn refuse(&self, parts: &Parts, shed: Shed) -> Response<Bytes> {
        let Shed { class, reason } = shed;
        self.shed[class.index()].fetch_add(1, Ordering::Relaxed);
        self.telemetry.shed[class.index()][reason as usize].increment(1);
        crate::telemetry::event!(
            debug,
            name: "tollgate.shed",
            layer = &*self.name,
            class = class.as_str(),
            reason = reason.as_str(),
            "the shedder shed a request"
        );
        // A draw spread evenly over 0..=jitter.
        let draw = self
            .hasher
            .hash_one(self.draws.fetch_add(1, Ordering::Relaxed));
        let secs = self.retry_after + draw % self.jitter.saturating_add(1);
        crate::answer::refuse(
            &*self.responder,
            &Rejection {
                kind: RejectionKind::Overloaded,
                parts,
                status: StatusCode::SERVICE_UNAVAILABLE,
                decision: None,
                rule: None,
                policy: None,
                window: None,
                retry_after: Some(Duration::from_secs(secs)),
                error: None,
            },
        )
    }
}

/// Model checks (`bash scripts/model-check`, under `--cfg tollgate_shuttle`): shuttle runs the
/// threads below in many interleavings of the shedder's locks and atomics (its PCT scheduler). A
/// request left waiting in the queue while a place is free (a place handed to nobody) fails
/// them, as does any place not given back in the end.
#[cfg(all(test, tollgate_shuttle))]
mod model_checks {
    use std::time::Duration;

    use super::*;
    use crate::clock::ManualClock;
    use crate::inflight::Pending;

    fn layer(limit: Limit) -> Arc<Shared> {
        let clock = ManualClock::new();
        clock.advance(Duration::from_secs(1));
        // Every request is `critical`; at a share of 1 its class may use the whole limit.
        let layer = LoadShedLayer::builder(limit)
            .share(Criticality::Critical, 1.0)
            .queue(4, Duration::from_secs(60))
            .clock(clock)
            .build()
            .unwrap();
        layer.shared
    }

    /// Admits a request: served at once (and answered, and gone), or its wait in the queue.
    /// With room in the queue for every arrival, none is shed.
    fn arrive(shared: &Arc<Shared>) -> Option<Pending> {
        let parts = http::Request::new(()).into_parts().0;
        match shared.admit(&parts) {
            Ok(Admitted::Now(mut held)) => {
                held.answered(Answer::Served { failed: false });
                None
            }
            Ok(Admitted::Later(wait)) => Some(wait),
            Err(shed) => panic!("shed ({}) with room in the queue", shed.reason.as_str()),
        }
    }

    /// Nobody waits while a place is free: the places in flight are those of the waiters
    /// served (their places wait in their channels), and the rest wait only if it is full.
    fn settled(shared: &Shared, waits: &[Pending]) {
        let queue = shared.queue.as_ref().unwrap();
        let in_flight = shared.in_flight.load(Ordering::SeqCst);
        let limit = u64::from(shared.limit.load(Ordering::SeqCst));
        let limit = shared.threshold(Criticality::Critical, limit);
        assert_eq!(
            in_flight as usize,
            waits.len() - queue.len(),
            "each place in flight is a waiter's"
        );
        assert!(
            queue.len() == 0 || in_flight >= limit,
            "{} wait while {in_flight} of {limit} are in flight",
            queue.len()
        );
    }

    fn run(shared: Arc<Shared>, held: Option<Guard>, arrivals: usize) {
        let threads: Vec<_> = (0..arrivals)
            .map(|_| {
                let shared = Arc::clone(&shared);
                shuttle::thread::spawn(move || arrive(&shared))
            })
            .collect();
        // A request in flight from the start ends while the others arrive.
        drop(held);
        let waits: Vec<Pending> = threads
            .into_iter()
            .filter_map(|t| t.join().unwrap())
            .collect();
        settled(&shared, &waits);
        // The waiters leave (their clients went away) at once, each on its own thread: a place
        // handed to one that is leaving goes on to the next, and in the end every place is back.
        let leaving: Vec<_> = waits
            .into_iter()
            .map(|wait| shuttle::thread::spawn(move || drop(wait)))
            .collect();
        for thread in leaving {
            thread.join().unwrap();
        }
        let queue = shared.queue.as_ref().unwrap();
        assert_eq!(
            (shared.in_flight.load(Ordering::SeqCst), queue.len()),
            (0, 0)
        );
    }

    fn held(shared: &Arc<Shared>) -> Guard {
        let parts = http::Request::new(()).into_parts().0;
        match shared.admit(&parts) {
            Ok(Admitted::Now(Held::Shed(guard))) => guard,
            _ => panic!("the first request is admitted"),
        }
    }

    #[test]
    fn places_given_back_go_to_the_waiters() {
        shuttle::check_pct(
            || {
                let shared = layer(Limit::fixed(1));
                let first = held(&shared);
                run(shared, Some(first), 3);
            },
            crate::sync::pct_runs(),
            3,
        );
    }

    #[test]
    fn a_limit_that_grows_serves_the_waiters() {
        shuttle::check_pct(
            || {
                // AIMD at 1 in flight, its window one sample short of an increase: the request
                // in flight answers fast (the limit grows to 2) but keeps its place, so only
                // the new room can serve a waiter.
                let shared = layer(Limit::aimd(1, Duration::from_micros(1)).bounds(1, 4));
                {
                    let mut controller = shared.controller.lock();
                    for at in 0..9 {
                        controller.sample(Sample {
                            at: 1_000 + at,
                            nanos: 1,
                            in_flight: 1,
                            failed: false,
                            abandoned: false,
                        });
                    }
                }
                let mut first = held(&shared);
                let answering = shuttle::thread::spawn(move || {
                    first.answered(Answer::Served { failed: false });
                    first
                });
                let threads: Vec<_> = (0..2)
                    .map(|_| {
                        let shared = Arc::clone(&shared);
                        shuttle::thread::spawn(move || arrive(&shared))
                    })
                    .collect();
                let first = answering.join().unwrap();
                let waits: Vec<Pending> = threads
                    .into_iter()
                    .filter_map(|t| t.join().unwrap())
                    .collect();
                assert_eq!(shared.limit.load(Ordering::SeqCst), 2, "the window grew it");
                assert_eq!(shared.controller.lock().limit(), 2);
                // The first still holds one of the two places.
                let queue = shared.queue.as_ref().unwrap();
                let in_flight = shared.in_flight.load(Ordering::SeqCst);
                assert_eq!(in_flight as usize, 1 + waits.len() - queue.len());
                assert!(queue.len() == 0 || in_flight >= 2, "a waiter left behind");
                drop(first);
                drop(waits);
                assert_eq!(
                    (shared.in_flight.load(Ordering::SeqCst), queue.len()),
                    (0, 0)
                );
            },
            crate::sync::pct_runs(),
            3,
        );
    }
}
