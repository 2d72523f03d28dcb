//! The breaker's configuration, and the state every clone of it shares.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Response, StatusCode};
use tower_layer::Layer;

use super::service::CircuitBreaker;
use crate::answer::{DefaultResponder, RejectionKind, Responder};
use crate::breaker::{Breaker, BreakerStatus, Permit};
use crate::client::local::{GRPC_RESOURCE_EXHAUSTED, GRPC_UNAVAILABLE, grpc_status};
use crate::clock::{Clock, TokioClock};

/// The default number of consecutive failures that opens an outbound breaker.
pub const DEFAULT_OUTBOUND_FAILURES: u32 = 5;
/// The default time an outbound breaker stays open before its trial call.
pub const DEFAULT_OUTBOUND_OPEN_FOR: Duration = Duration::from_secs(5);

/// gRPC's `DEADLINE_EXCEEDED`.
const GRPC_DEADLINE_EXCEEDED: u16 = 4;
/// gRPC's `INTERNAL`.
const GRPC_INTERNAL: u16 = 13;

/// What an answer says about the backend's health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// It works: the run of failures ends, and a trial call closes the breaker.
    Success,
    /// It failed: one more in the run, and a trial call opens the breaker again.
    Failure,
    /// Nothing either way: the run stays as it is, and a trial call answered so hands the
    /// trial to the next call.
    Ignore,
}

impl Outcome {
    /// The default reading of a response:
    ///
    /// - `500`, `502`, `503`, `504`, and gRPC `INTERNAL` (13), `UNAVAILABLE` (14) and
    ///   `DEADLINE_EXCEEDED` (4) in the response headers: [`Failure`](Outcome::Failure);
    /// - `429` and gRPC `RESOURCE_EXHAUSTED` (8): [`Ignore`](Outcome::Ignore). The backend is
    ///   up and refuses this client for its quota, which says nothing of its health; the
    ///   retry layer and pacing deal with it, and the breaker neither counts it as a failure
    ///   (it would cut off every call for a quota that resets on its own) nor as a success
    ///   (a backend shedding load with 503s and 429s in turn still opens the breaker);
    /// - everything else (2xx, 3xx, other 4xx, `501`, ...): [`Success`](Outcome::Success),
    ///   the backend answered.
    ///
    /// Errors of the inner service (connection refused, reset, a timeout layer's error) are
    /// always failures.
    pub fn of(status: StatusCode, headers: &HeaderMap) -> Outcome {
        match grpc_status(headers) {
            Some(GRPC_INTERNAL | GRPC_UNAVAILABLE | GRPC_DEADLINE_EXCEEDED) => {
                return Outcome::Failure;
            }
            Some(GRPC_RESOURCE_EXHAUSTED) => return Outcome::Ignore,
            _ => {}
        }
        match status.as_u16() {
            500 | 502 | 503 | 504 => Outcome::Failure,
            429 => Outcome::Ignore,
            _ => Outcome::Success,
        }
    }
}

type Classify = Box<dyn Fn(StatusCode, &HeaderMap) -> Outcome + Send + Sync>;

/// A circuit breaker for outbound calls: see the [module docs](super).
pub struct CircuitBreakerLayer<C = TokioClock> {
    pub(crate) shared: Arc<Shared<C>>,
}

impl<C> Clone for CircuitBreakerLayer<C> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl CircuitBreakerLayer {
    /// The defaults: open after 5 consecutive failures, for 5 s before each trial call.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder, with the defaults.
    pub fn builder() -> CircuitBreakerLayerBuilder {
        CircuitBreakerLayerBuilder {
            clock: TokioClock::new(),
            failures: DEFAULT_OUTBOUND_FAILURES,
            open_for: DEFAULT_OUTBOUND_OPEN_FOR,
            classify: Box::new(Outcome::of),
            responder: Box::new(DefaultResponder),
            name: crate::client::retry::DEFAULT_CLIENT_NAME.to_owned(),
        }
    }
}

impl Default for CircuitBreakerLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> CircuitBreakerLayer<C> {
    /// The breaker's state now.
    pub fn status(&self) -> BreakerStatus {
        self.shared.breaker.status()
    }

    /// The counters since the layer was built.
    pub fn stats(&self) -> BreakerStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        BreakerStats {
            failures: get(&c.failures),
            short_circuited: get(&c.short_circuited),
            opened: get(&c.opened),
        }
    }
}

impl<S, C> Layer<S> for CircuitBreakerLayer<C> {
    type Service = CircuitBreaker<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        CircuitBreaker::new(inner, Arc::clone(&self.shared))
    }
}

impl<C: Clock> fmt::Debug for CircuitBreakerLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreakerLayer")
            .field("breaker", &self.shared.breaker.state())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Counters of a [`CircuitBreakerLayer`], since it was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BreakerStats {
    /// Calls that reached the backend and failed (errors and failing answers).
    pub failures: u64,
    /// Calls answered here, without calling the backend, because the breaker was open.
    pub short_circuited: u64,
    /// Times the breaker opened.
    pub opened: u64,
}

/// Builds a [`CircuitBreakerLayer`].
pub struct CircuitBreakerLayerBuilder<C = TokioClock> {
    clock: C,
    failures: u32,
    open_for: Duration,
    classify: Classify,
    responder: Box<dyn Responder>,
    name: String,
}

impl<C> fmt::Debug for CircuitBreakerLayerBuilder<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreakerLayerBuilder")
            .field("name", &self.name)
            .field("failures", &self.failures)
            .field("open_for", &self.open_for)
            .finish_non_exhaustive()
    }
}

impl<C: Clock> CircuitBreakerLayerBuilder<C> {
    /// Open after `failures` consecutive failures (at least 1; default 5), for `open_for`
    /// before each trial call (default 5 s). An `open_for` too long for the clock to add
    /// (`Duration::MAX`, say) saturates: once open, the breaker never tries again.
    pub fn breaker(mut self, failures: u32, open_for: Duration) -> Self {
        self.failures = failures.max(1);
        self.open_for = open_for;
        self
    }

    /// How a response is read ([`Outcome::of`] unless set). Responses made by a tollgate layer
    /// inside this one (marked [`Refused`](crate::answer::Refused)) never reached the backend
    /// and are always [`Outcome::Ignore`]; errors are always [`Outcome::Failure`].
    pub fn classify(
        mut self,
        classify: impl Fn(StatusCode, &HeaderMap) -> Outcome + Send + Sync + 'static,
    ) -> Self {
        self.classify = Box::new(classify);
        self
    }

    /// How calls refused while the breaker is open are answered ([`DefaultResponder`] unless
    /// set).
    pub fn responder(mut self, responder: impl Responder) -> Self {
        self.responder = Box::new(responder);
        self
    }

    /// The clock the breaker reads (default [`TokioClock`], which follows tokio's paused time).
    pub fn clock<C2: Clock>(self, clock: C2) -> CircuitBreakerLayerBuilder<C2> {
        CircuitBreakerLayerBuilder {
            clock,
            failures: self.failures,
            open_for: self.open_for,
            classify: self.classify,
            responder: self.responder,
            name: self.name,
        }
    }

    /// The breaker's name in metrics (the `client` label) and logs
    /// ([`DEFAULT_CLIENT_NAME`](crate::client::retry::DEFAULT_CLIENT_NAME) unless set): give
    /// each outbound breaker of a process its own.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Builds the layer, and registers its metrics (feature `metrics`: install the recorder
    /// first).
    pub fn build(self) -> CircuitBreakerLayer<C> {
        // A probe unanswered for `open_for` (at least a second) lets another go.
        let breaker = Breaker::new(self.clock, self.failures, self.open_for)
            .probe_timeout(self.open_for.max(Duration::from_secs(1)));
        #[cfg(any(feature = "metrics", feature = "tracing"))]
        let breaker = breaker.observe(crate::breaker::observer(
            crate::breaker::Role::Client,
            &self.name.as_str().into(),
            self.open_for,
        ));
        CircuitBreakerLayer {
            shared: Arc::new(Shared {
                breaker: Arc::new(breaker),
                classify: self.classify,
                responder: self.responder,
                counters: Counters::default(),
            }),
        }
    }
}

#[derive(Default)]
struct Counters {
    failures: AtomicU64,
    short_circuited: AtomicU64,
    opened: AtomicU64,
}

pub(crate) struct Shared<C> {
    pub(crate) breaker: Arc<Breaker<C>>,
    classify: Classify,
    responder: Box<dyn Responder>,
    counters: Counters,
}

impl<C: Clock> Shared<C> {
    /// What the response says, unless it was made here.
    pub(crate) fn outcome<B>(&self, response: &Response<B>) -> Outcome {
        if crate::client::local::made_locally(response) {
            return Outcome::Ignore;
        }
        (self.classify)(response.status(), response.headers())
    }

    /// A failure of a call sent with `permit`.
    pub(crate) fn failure(&self, permit: Permit) {
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
        if self.breaker.failure(permit) {
            self.counters.opened.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The answer to a call the open breaker keeps from the backend: 503, `Retry-After` the
    /// time until the next trial call (while one is in flight, `open_for`, what its failure
    /// would cost).
    pub(crate) fn refuse(&self, parts: &Parts) -> Response<Bytes> {
        self.counters
            .short_circuited
            .fetch_add(1, Ordering::Relaxed);
        crate::client::local::answer(
            &*self.responder,
            parts,
            RejectionKind::Overloaded,
            None,
            self.breaker.next_probe_in(),
        )
    }
}
