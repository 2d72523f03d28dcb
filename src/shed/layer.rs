//! The shedder's configuration: its layer, builder, stats and errors.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::HeaderName;
use http::request::Parts;
use tower_layer::Layer;

use super::classify::{Classifier, Criticality};
use super::deadline::Typical;
use super::fair::Tenants;
use super::limit::{Limit, LimitKind};
use super::queue::{DEFAULT_CODEL_INTERVAL, DEFAULT_CODEL_TARGET, Discipline, Queue};
use super::service::LoadShed;
use super::shared::Fair;
pub(super) use super::shared::NoPlace;
pub(crate) use super::shared::{Guard, Place, Shared};
use super::telemetry::Telemetry;
pub(crate) use super::telemetry::{Reason, Shed};
use crate::answer::{DefaultResponder, Responder};
use crate::clock::{Clock, SystemClock};
use crate::key::KeyExtractor;
use crate::sync::{AtomicU32, AtomicU64, Mutex};

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
            fair_cap: 1.0,
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
    fair_cap: f64,
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

    /// Fair shedding among tenants keyed by `tenant`: a tenant's fair share is the limit
    /// divided among the tenants that asked within the last second (in flight, waiting, or
    /// admitted or refused then), at least one place. Once more than a share of capacity is in
    /// use ([`LoadShedLayerBuilder::fair_from`], 0.8 by default), a tenant with at least its
    /// fair share in flight is shed before anyone else; below that, it takes a place only
    /// while that leaves one free for each recent tenant holding none (for at most half the
    /// limit). A tenant below its fair share is never refused for fairness. With a queue,
    /// places given back go to the tenant holding fewest. The promise is stated in the
    /// [module docs](crate::shed#fairness). Requests without a key are shed by class only. Key
    /// tenants by something your authentication vouches for: a client that can name a fresh
    /// tenant per request dilutes everyone's fair share.
    pub fn fair_by(mut self, tenant: impl KeyExtractor) -> Self {
        self.fair = Some(Box::new(tenant));
        self
    }

    /// The share of capacity (0 to 1) from which tenants above their fair share are shed first.
    pub fn fair_from(mut self, share: f64) -> Self {
        self.fair_from = share;
        self
    }

    /// The most of the limit (0.001 to 1, 1 by default: no cap) one tenant may hold at once,
    /// whatever the load: for services whose requests are long (downloads, long polls,
    /// exports), so that a tenant alone on an idle service cannot take the places the next
    /// tenants will need, as nothing is pre-empted. With a cap of 0.5, a second tenant always
    /// finds half the limit. Only with [`fair_by`](LoadShedLayerBuilder::fair_by).
    pub fn fair_cap(mut self, share: f64) -> Self {
        self.fair_cap = share;
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
    /// timeouts. The wait runs on the layer's [`clock`](LoadShedLayerBuilder::clock): tokio's
    /// timer for clocks that keep its pace (the system's, [`TokioClock`](crate::clock::TokioClock)),
    /// the clock's own wait otherwise ([`Clock::sleep_until`]; a
    /// [`ManualClock`](crate::clock::ManualClock) ends it when advanced). No queue unless set;
    /// both numbers must be above zero.
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
    /// queue at most that timeout less the time the service typically takes to answer on its
    /// route (a moving average of that route's recent answers, each weighing an eighth), so
    /// that it is not served after its client gave up; one whose timeout leaves no time to
    /// wait is shed at once when it finds no room. The timeout bounds the wait only: a request
    /// that finds room is admitted whatever it declares.
    ///
    /// A route is an axum route template (`MatchedPath`), which exists only once the router
    /// has matched the request: put the layer inside the router (`Router::layer`) for an
    /// average per route. The first 64 templates get one each; requests without a template
    /// (a layer around the whole router, a service that is not axum's) and those of further
    /// templates share one average.
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
        if !(self.fair_cap.is_finite() && (0.001..=1.0).contains(&self.fair_cap)) {
            return Err(ShedError::InvalidFairCap(self.fair_cap));
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
                learns: !matches!(self.limit.kind, LimitKind::Fixed)
                    || queue.as_ref().is_some_and(Queue::has_deadlines),
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
                    tenants: Tenants::new(),
                    from: (self.fair_from * 1000.0).round() as u64,
                    cap: (self.fair_cap * 1000.0).round() as u64,
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
                typical: Typical::new(),
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
            .field("fair_cap", &self.fair_cap)
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
    /// A cap on one tenant's share that is not within [0.001, 1].
    InvalidFairCap(f64),
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
            ShedError::InvalidFairCap(share) => {
                write!(f, "fair_cap is {share}: give a number in [0.001, 1]")
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
