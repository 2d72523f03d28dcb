//! The pacer's configuration, the sleeper, and the state every clone of it shares.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use parking_lot::Mutex;
use tower_layer::Layer;

use super::plan::{Refusal, Server};
use super::service::Pace;
use crate::answer::{DefaultResponder, RejectionKind, Responder};
use crate::client::local::{made_locally, refused_by_server, server_key};
use crate::client::{RetryHint, ServerHints};
use crate::clock::{Clock, TokioClock};

/// The default longest wait: a request that would wait longer is refused at once.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(60);
/// The default number of servers remembered.
pub const DEFAULT_MAX_SERVERS: usize = 1024;

/// Waits: how the pacer holds a request back until its departure.
///
/// [`TokioSleeper`] is the default; any `Fn(Duration) -> impl Future<Output = ()>` is a sleeper
/// too, for a simulation that moves a [`ManualClock`](crate::clock::ManualClock) instead:
///
/// ```
/// use std::time::Duration;
/// use tollgate::client::PaceLayer;
/// use tollgate::clock::ManualClock;
///
/// let clock = ManualClock::new();
/// let time = clock.clone();
/// let pace = PaceLayer::builder()
///     .clock(clock)
///     .sleeper(move |wait: Duration| {
///         time.advance(wait);
///         std::future::ready(())
///     })
///     .build();
/// # let _ = pace;
/// ```
pub trait Sleeper: Send + Sync + 'static {
    /// The wait's future.
    type Sleep: Future<Output = ()> + Send;

    /// A future that is ready after `wait`.
    fn sleep(&self, wait: Duration) -> Self::Sleep;
}

/// tokio's timer (`tokio::time::sleep`), which follows tokio's paused time.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokioSleeper;

impl Sleeper for TokioSleeper {
    type Sleep = tokio::time::Sleep;

    fn sleep(&self, wait: Duration) -> Self::Sleep {
        tokio::time::sleep(wait)
    }
}

impl<F, Fut> Sleeper for F
where
    F: Fn(Duration) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    type Sleep = Fut;

    fn sleep(&self, wait: Duration) -> Fut {
        self(wait)
    }
}

/// Paces requests by the servers' `RateLimit` fields: see the [module docs](super).
pub struct PaceLayer<C = TokioClock, Z = TokioSleeper> {
    pub(crate) shared: Arc<Shared<C, Z>>,
}

impl<C, Z> Clone for PaceLayer<C, Z> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl PaceLayer {
    /// The defaults: tokio's clock and timer, waits up to 60 s, 1024 servers remembered.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder, with the defaults.
    pub fn builder() -> PaceLayerBuilder {
        PaceLayerBuilder {
            clock: TokioClock::new(),
            sleeper: TokioSleeper,
            max_wait: DEFAULT_MAX_WAIT,
            max_servers: DEFAULT_MAX_SERVERS,
            responder: Box::new(DefaultResponder),
        }
    }
}

impl Default for PaceLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<C, Z> PaceLayer<C, Z> {
    /// The counters since the layer was built.
    pub fn stats(&self) -> PaceStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PaceStats {
            requests: get(&c.requests),
            delayed: get(&c.delayed),
            waited: Duration::from_nanos(get(&c.waited)),
            refused: get(&c.refused),
        }
    }
}

impl<S, C, Z> Layer<S> for PaceLayer<C, Z> {
    type Service = Pace<S, C, Z>;

    fn layer(&self, inner: S) -> Self::Service {
        Pace::new(inner, Arc::clone(&self.shared))
    }
}

impl<C, Z> fmt::Debug for PaceLayer<C, Z> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PaceLayer")
            .field("max_wait", &self.shared.max_wait)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Counters of a [`PaceLayer`], since it was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PaceStats {
    /// Requests the layer was asked to send.
    pub requests: u64,
    /// Of those, the ones held back before they left.
    pub delayed: u64,
    /// Their waits, added up (saturating at `u64::MAX` nanoseconds).
    pub waited: Duration,
    /// Requests refused here because their wait was longer than the longest allowed.
    pub refused: u64,
}

/// Builds a [`PaceLayer`].
pub struct PaceLayerBuilder<C = TokioClock, Z = TokioSleeper> {
    clock: C,
    sleeper: Z,
    max_wait: Duration,
    max_servers: usize,
    responder: Box<dyn Responder>,
}

impl<C, Z> fmt::Debug for PaceLayerBuilder<C, Z> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PaceLayerBuilder")
            .field("max_wait", &self.max_wait)
            .field("max_servers", &self.max_servers)
            .finish_non_exhaustive()
    }
}

impl<C: Clock, Z: Sleeper> PaceLayerBuilder<C, Z> {
    /// The longest a request waits for its departure (default 60 s). One that would wait
    /// longer is not sent: it is answered at once with `429` (gRPC `RESOURCE_EXHAUSTED`) and
    /// the wait as `Retry-After`, so the caller decides whether it still wants to send it.
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = max_wait;
        self
    }

    /// The most servers (authorities) remembered (default 1024, at least 1); the one idle
    /// longest is forgotten first.
    pub fn max_servers(mut self, max_servers: usize) -> Self {
        self.max_servers = max_servers.max(1);
        self
    }

    /// How requests refused for a wait too long are answered ([`DefaultResponder`] unless
    /// set).
    pub fn responder(mut self, responder: impl Responder) -> Self {
        self.responder = Box::new(responder);
        self
    }

    /// The clock departures are reckoned on (default [`TokioClock`]). It must be the time line
    /// the sleeper waits on.
    pub fn clock<C2: Clock>(self, clock: C2) -> PaceLayerBuilder<C2, Z> {
        PaceLayerBuilder {
            clock,
            sleeper: self.sleeper,
            max_wait: self.max_wait,
            max_servers: self.max_servers,
            responder: self.responder,
        }
    }

    /// How requests wait for their departure (default [`TokioSleeper`]).
    pub fn sleeper<Z2: Sleeper>(self, sleeper: Z2) -> PaceLayerBuilder<C, Z2> {
        PaceLayerBuilder {
            clock: self.clock,
            sleeper,
            max_wait: self.max_wait,
            max_servers: self.max_servers,
            responder: self.responder,
        }
    }

    /// Builds the layer.
    pub fn build(self) -> PaceLayer<C, Z> {
        PaceLayer {
            shared: Arc::new(Shared {
                clock: self.clock,
                sleeper: self.sleeper,
                max_wait: self.max_wait,
                max_servers: self.max_servers,
                responder: self.responder,
                hasher: foldhash::fast::RandomState::default(),
                servers: Mutex::new(HashMap::new()),
                counters: Counters::default(),
            }),
        }
    }
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    delayed: AtomicU64,
    waited: AtomicU64,
    refused: AtomicU64,
}

pub(crate) struct Shared<C, Z> {
    clock: C,
    pub(crate) sleeper: Z,
    max_wait: Duration,
    max_servers: usize,
    responder: Box<dyn Responder>,
    hasher: foldhash::fast::RandomState,
    servers: Mutex<HashMap<u64, Server>>,
    counters: Counters,
}

/// When a request may leave.
pub(crate) enum Departure {
    /// Now.
    Now,
    /// After this wait.
    After(Duration),
    /// Not at all: the answer.
    Refused(Response<Bytes>),
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl<C: Clock, Z> Shared<C, Z> {
    /// The server of a request.
    pub(crate) fn key<B>(&self, request: &Request<B>) -> u64 {
        server_key(request, &self.hasher)
    }

    /// Reserves the departure of a request to the server of `key`.
    pub(crate) fn depart(&self, key: u64, parts: &Parts) -> Departure {
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let now = self.clock.now();
        let mut servers = self.servers.lock();
        if !servers.contains_key(&key) && servers.len() >= self.max_servers {
            // Forget the server idle longest (a scan, only at capacity).
            let idle = servers
                .iter()
                .min_by_key(|(_, s)| s.last_used)
                .map(|(k, _)| *k);
            if let Some(idle) = idle {
                servers.remove(&idle);
            }
        }
        let server = servers.entry(key).or_default();
        match server.depart(now, nanos(self.max_wait)) {
            Ok(at) if at <= now => Departure::Now,
            Ok(at) => {
                let wait = at - now;
                self.counters.delayed.fetch_add(1, Ordering::Relaxed);
                let _ =
                    self.counters
                        .waited
                        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                            Some(w.saturating_add(wait))
                        });
                Departure::After(Duration::from_nanos(wait))
            }
            Err(too_long) => {
                self.counters.refused.fetch_add(1, Ordering::Relaxed);
                Departure::Refused(crate::client::local::answer(
                    &*self.responder,
                    parts,
                    RejectionKind::Limited,
                    too_long.policy,
                    Some(Duration::from_nanos(too_long.wait)),
                ))
            }
        }
    }

    /// A request to the server of `key` was answered (`Some`), or gave up (`None`).
    pub(crate) fn landed<B>(&self, key: u64, response: Option<&Response<B>>) {
        // Read before the lock: parsing the fields takes a while.
        let said = response.filter(|r| !made_locally(r)).map(|r| {
            let hints = ServerHints::read(r.headers());
            // A refusal is a refusal whatever its hint: one that says "do not retry" (or no
            // usable wait) still caps its quotas' hold at a minute, with no wait of its own.
            let refused_for =
                refused_by_server(r.status(), r.headers()).then(|| match hints.retry() {
                    RetryHint::After(d) => nanos(d),
                    _ => 0,
                });
            (hints, refused_for)
        });
        let now = self.clock.now();
        let mut servers = self.servers.lock();
        let Some(server) = servers.get_mut(&key) else {
            return;
        };
        server.landed();
        if let Some((hints, refused_for)) = said {
            // The refusal names the quota it found exhausted (the longest to reset).
            let refused = refused_for.map(|wait| Refusal {
                wait,
                policy: hints
                    .quotas
                    .iter()
                    .filter(|q| q.remaining == 0)
                    .max_by_key(|q| q.reset)
                    .and_then(|q| q.policy.as_deref()),
            });
            server.observe(now, &hints.quotas, refused);
        }
    }
}
