//! The shedder's configuration, and the state every clone of it shares.

use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Response, StatusCode};
use parking_lot::Mutex;
use tower_layer::Layer;

use super::classify::{Classifier, Criticality};
use super::limit::{Controller, Limit, LimitKind, Sample};
use super::service::LoadShed;
use crate::answer::{DefaultResponder, Rejection, RejectionKind, Responder};
use crate::clock::{Clock, SystemClock};
use crate::concurrency::table::InFlight;
use crate::inflight::Answer;
use crate::key::{Key, KeyExtractor};

/// The default least `Retry-After` of a shed request.
pub const DEFAULT_SHED_RETRY_AFTER: Duration = Duration::from_secs(1);
/// The default spread added to it, so that shed clients do not all come back at once.
pub const DEFAULT_SHED_JITTER: Duration = Duration::from_secs(2);
/// The default share of capacity past which tenants above their fair share are shed first.
pub const DEFAULT_FAIR_FROM: f64 = 0.8;

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
        }
    }

    /// The limit now (it moves with an adaptive [`Limit`]).
    pub fn limit(&self) -> u32 {
        self.shared.limit.load(Ordering::Relaxed)
    }

    /// Requests admitted and not yet done (their bodies not ended).
    pub fn in_flight(&self) -> u32 {
        self.shared.in_flight.load(Ordering::Acquire)
    }

    /// Requests admitted and shed so far, per class.
    pub fn stats(&self) -> ShedStats {
        let load = |a: &[AtomicU64; 4]| a.each_ref().map(|n| n.load(Ordering::Relaxed));
        ShedStats {
            admitted: load(&self.shared.admitted),
            shed: load(&self.shared.shed),
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
            .field("limit", &self.limit())
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

/// Requests admitted and shed, per [`Criticality`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShedStats {
    admitted: [u64; 4],
    shed: [u64; 4],
}

impl ShedStats {
    /// Requests of `class` admitted.
    pub fn admitted(&self, class: Criticality) -> u64 {
        self.admitted[class.index()]
    }

    /// Requests of `class` shed.
    pub fn shed(&self, class: Criticality) -> u64 {
        self.shed[class.index()]
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
}

impl LoadShedLayerBuilder {
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

    /// The clock that times requests for an adaptive limit (the system's monotonic clock
    /// unless set; [`TokioClock`](crate::clock::TokioClock) for simulations under tokio's
    /// paused time).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Validates the settings and builds the layer.
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
        let controller = self.limit.controller();
        let limit = controller.limit();
        Ok(LoadShedLayer {
            shared: Arc::new(Shared {
                limit: AtomicU32::new(limit),
                controller: Mutex::new(controller),
                in_flight: AtomicU32::new(0),
                shares: self.shares,
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

/// What every clone of the layer shares.
pub(crate) struct Shared {
    /// The controller's limit, read on every request without its lock.
    limit: AtomicU32,
    controller: Mutex<Controller>,
    in_flight: AtomicU32,
    /// Each class's share of capacity, in thousandths.
    shares: [u16; 4],
    classifier: Box<dyn Classifier>,
    utilization: Option<Box<dyn Fn() -> f64 + Send + Sync>>,
    fair: Option<Fair>,
    /// The least `Retry-After` and its spread, in whole seconds.
    retry_after: u64,
    jitter: u64,
    draws: AtomicU64,
    hasher: foldhash::fast::RandomState,
    admitted: [AtomicU64; 4],
    shed: [AtomicU64; 4],
    responder: Box<dyn Responder>,
    clock: Arc<dyn Clock>,
}

struct Fair {
    key: Box<dyn KeyExtractor>,
    tenants: InFlight,
    /// The share of capacity past which fairness applies, in thousandths.
    from: u64,
}

/// The place of a request admitted by the shedder; dropping it gives the place back.
pub(crate) struct Guard {
    shared: Arc<Shared>,
    started: u64,
    /// Requests in flight when it was admitted, itself included.
    in_flight: u32,
    tenant: Option<(u64, Key)>,
    answered: bool,
    /// Whether the request got past every check (a guard dropped while being refused teaches
    /// nothing).
    admitted: bool,
}

impl Guard {
    /// The inner service answered: the adaptive limit learns how long it took, unless a
    /// tollgate layer inside refused the request.
    pub(crate) fn answered(&mut self, answer: Answer) {
        if std::mem::replace(&mut self.answered, true) {
            return;
        }
        if let Answer::Served { failed } = answer {
            self.sample(failed);
        }
    }

    fn sample(&self, failed: bool) {
        let shared = &self.shared;
        let now = shared.clock.now();
        let nanos = now.saturating_sub(self.started).max(1);
        let mut controller = shared.controller.lock();
        controller.sample(Sample {
            at: now,
            nanos,
            in_flight: self.in_flight,
            failed,
        });
        shared.limit.store(controller.limit(), Ordering::Relaxed);
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        // Dropped before the service answered (the client went away, a timeout fired): its
        // time so far is a sample too, or a service that hangs would teach nothing.
        if !self.answered && self.admitted {
            self.sample(false);
        }
        self.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
        if let (Some((hash, key)), Some(fair)) = (&self.tenant, &self.shared.fair) {
            fair.tenants.release(*hash, key);
        }
    }
}

impl Shared {
    /// Admits a request, or sheds it (the class it was shed as).
    pub(crate) fn admit(self: &Arc<Self>, parts: &Parts) -> Result<Guard, Criticality> {
        let class = self.classifier.classify(parts);
        let share = u64::from(self.shares[class.index()]);
        if let Some(signal) = &self.utilization {
            let busy = signal();
            if busy * 1000.0 >= share as f64 {
                return Err(class);
            }
        }
        let limit = u64::from(self.limit.load(Ordering::Relaxed));
        let threshold = u32::try_from((limit * share / 1000).max(1)).unwrap_or(u32::MAX);
        let Ok(before) = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < threshold).then_some(n + 1)
            })
        else {
            return Err(class);
        };
        let mut guard = Guard {
            shared: Arc::clone(self),
            started: self.clock.now(),
            in_flight: before + 1,
            tenant: None,
            answered: false,
            admitted: false,
        };
        if let Some(fair) = &self.fair {
            let mut key = Key::new();
            if fair.key.extract_into(parts, &mut key) {
                key.push_raw("@tenant");
                let key = crate::concurrency::bounded(key);
                let hash = fair.tenants.hash(key.as_str());
                let max = if u64::from(before) * 1000 >= limit * fair.from {
                    // Near capacity: a tenant with its fair share in flight waits its turn.
                    // The tenants in flight, this one counted once.
                    let mut tenants = u64::try_from(fair.tenants.keys()).unwrap_or(u64::MAX);
                    if fair.tenants.count(key.as_str()) == 0 {
                        tenants = tenants.saturating_add(1);
                    }
                    u32::try_from((limit / tenants.max(1)).max(1)).unwrap_or(u32::MAX)
                } else {
                    u32::MAX
                };
                if !fair.tenants.acquire(hash, &key, max) {
                    drop(guard);
                    return Err(class);
                }
                guard.tenant = Some((hash, key));
            }
        }
        self.admitted[class.index()].fetch_add(1, Ordering::Relaxed);
        guard.admitted = true;
        Ok(guard)
    }

    /// The answer to a request shed as `class`.
    pub(crate) fn refuse(&self, parts: &Parts, class: Criticality) -> Response<Bytes> {
        self.shed[class.index()].fetch_add(1, Ordering::Relaxed);
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
