//! The throttle's configuration, and the state every clone of it shares.

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http::request::Parts;
use parking_lot::Mutex;
use tower_layer::Layer;

use super::service::AdaptiveThrottle;
use super::window::{Window, WindowCounts};
use crate::answer::{DefaultResponder, RejectionKind, Responder};
use crate::client::retry::random::Rng;
use crate::clock::{Clock, TokioClock};
use crate::telemetry::Counter;

/// The default multiplier `K`: the backend may refuse up to half of the requests before the
/// client refuses any itself (Google SRE's recommendation).
pub const DEFAULT_K: f64 = 2.0;
/// The default span of the window the ratio is taken over: two minutes, as in Google SRE.
pub const DEFAULT_THROTTLE_WINDOW: Duration = Duration::from_secs(120);
/// The buckets a window is counted in: a two-minute window slides a second at a time.
pub const THROTTLE_BUCKETS: usize = 120;
/// The default `Retry-After` of a local refusal.
pub const DEFAULT_THROTTLE_RETRY_AFTER: Duration = Duration::from_secs(1);
/// The default number of backends remembered by a layer keyed by authority.
pub const DEFAULT_MAX_BACKENDS: usize = 1024;

/// The largest `K` taken (beyond it the throttle would never refuse anything anyway).
const MAX_K: f64 = 1_000_000.0;

/// Client-side adaptive throttling: see the [module docs](super).
pub struct AdaptiveThrottleLayer<C = TokioClock> {
    pub(crate) shared: Arc<Shared<C>>,
}

impl<C> Clone for AdaptiveThrottleLayer<C> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl AdaptiveThrottleLayer {
    /// The defaults: `K` = 2, a two-minute window, one backend, tokio's clock.
    pub fn new() -> Self {
        Self::builder().build_with_defaults()
    }

    /// A builder, with the defaults.
    pub fn builder() -> AdaptiveThrottleLayerBuilder {
        AdaptiveThrottleLayerBuilder {
            clock: TokioClock::new(),
            k: DEFAULT_K,
            window: DEFAULT_THROTTLE_WINDOW,
            retry_after: DEFAULT_THROTTLE_RETRY_AFTER,
            max_backends: None,
            seed: None,
            responder: Box::new(DefaultResponder),
            name: crate::client::retry::DEFAULT_CLIENT_NAME.to_owned(),
        }
    }
}

impl Default for AdaptiveThrottleLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> AdaptiveThrottleLayer<C> {
    /// The counters since the layer was built.
    pub fn stats(&self) -> ThrottleStats {
        ThrottleStats {
            requests: self.shared.requests.load(Ordering::Relaxed),
            throttled: self.shared.throttled.load(Ordering::Relaxed),
        }
    }

    /// The window's counts now: of the one backend, or with
    /// [`per_authority`](AdaptiveThrottleLayerBuilder::per_authority) of the backend at
    /// `authority` (`host:port` as the requests' URIs spell it; empty counts if unknown).
    pub fn counts(&self, authority: &str) -> WindowCounts {
        let now = self.shared.clock.now();
        let key = self.shared.key_of(authority);
        let mut windows = self.shared.windows.lock();
        match &mut *windows {
            Windows::One(w) => w.counts(now),
            Windows::Keyed { map, .. } => map.get_mut(&key).map_or(
                WindowCounts {
                    requests: 0,
                    accepts: 0,
                },
                |w| w.counts(now),
            ),
        }
    }

    /// `K`.
    pub fn k(&self) -> f64 {
        self.shared.k
    }
}

impl<S, C> Layer<S> for AdaptiveThrottleLayer<C> {
    type Service = AdaptiveThrottle<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        AdaptiveThrottle::new(inner, Arc::clone(&self.shared))
    }
}

impl<C> fmt::Debug for AdaptiveThrottleLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveThrottleLayer")
            .field("k", &self.shared.k)
            .field("window", &self.shared.window)
            .field("per_authority", &self.shared.keyed.is_some())
            .finish_non_exhaustive()
    }
}

/// Counters of an [`AdaptiveThrottleLayer`], since it was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ThrottleStats {
    /// Requests the layer was asked to send.
    pub requests: u64,
    /// Of those, the ones it refused itself.
    pub throttled: u64,
}

/// A bad [`AdaptiveThrottleLayerBuilder`] setting.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum ThrottleError {
    /// `K` must be a number from 1 to 1,000,000.
    InvalidK(f64),
    /// The window must be from 120 ms (a millisecond per bucket) to `u64::MAX` nanoseconds.
    InvalidWindow(Duration),
    /// A layer keyed by authority must remember at least one backend.
    NoBackends,
}

impl fmt::Display for ThrottleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ThrottleError::InvalidK(k) => write!(f, "K must be from 1 to 1000000, not {k}"),
            ThrottleError::InvalidWindow(w) => write!(
                f,
                "the throttle's window must be from 120 ms to u64::MAX ns, not {w:?}"
            ),
            ThrottleError::NoBackends => {
                f.write_str("a throttle keyed by authority must remember at least one backend")
            }
        }
    }
}

impl std::error::Error for ThrottleError {}

/// Builds an [`AdaptiveThrottleLayer`]; validated by
/// [`build`](AdaptiveThrottleLayerBuilder::build).
pub struct AdaptiveThrottleLayerBuilder<C = TokioClock> {
    clock: C,
    k: f64,
    window: Duration,
    retry_after: Duration,
    max_backends: Option<usize>,
    seed: Option<u64>,
    responder: Box<dyn Responder>,
    name: String,
}

impl<C> fmt::Debug for AdaptiveThrottleLayerBuilder<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveThrottleLayerBuilder")
            .field("name", &self.name)
            .field("k", &self.k)
            .field("window", &self.window)
            .field("retry_after", &self.retry_after)
            .field("max_backends", &self.max_backends)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl<C: Clock> AdaptiveThrottleLayerBuilder<C> {
    /// The multiplier `K` (default 2, at least 1): the client refuses requests itself once the
    /// backend accepts fewer than one in `K`. Lower is more aggressive (1.1 refuses almost as
    /// soon as the backend does), higher lets more requests reach a struggling backend.
    pub fn k(mut self, k: f64) -> Self {
        self.k = k;
        self
    }

    /// The span the ratio is taken over (default two minutes), counted in
    /// [`THROTTLE_BUCKETS`] buckets.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// The `Retry-After` of a local refusal (default 1 s).
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// One window per backend, by the request's authority (the URI's, else the `Host`
    /// header's), remembering at most `max_backends` (the one idle longest is forgotten first).
    /// Without this, the layer is one backend's: put one layer on each backend's client.
    pub fn per_authority(mut self, max_backends: usize) -> Self {
        self.max_backends = Some(max_backends);
        self
    }

    /// The seed of the local refusals' draws (default: a random one), for tests that must see
    /// the same draws every run.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// How local refusals are answered ([`DefaultResponder`] unless set).
    pub fn responder(mut self, responder: impl Responder) -> Self {
        self.responder = Box::new(responder);
        self
    }

    /// The clock the window reads (default [`TokioClock`], which follows tokio's paused time).
    pub fn clock<C2: Clock>(self, clock: C2) -> AdaptiveThrottleLayerBuilder<C2> {
        AdaptiveThrottleLayerBuilder {
            clock,
            k: self.k,
            window: self.window,
            retry_after: self.retry_after,
            max_backends: self.max_backends,
            seed: self.seed,
            responder: self.responder,
            name: self.name,
        }
    }

    /// The throttle's name in metrics (the `client` label;
    /// [`DEFAULT_CLIENT_NAME`](crate::client::retry::DEFAULT_CLIENT_NAME) unless set): give
    /// each throttle of a process its own.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Validates the settings and builds the layer, and registers its metrics (feature
    /// `metrics`: install the recorder first).
    pub fn build(self) -> Result<AdaptiveThrottleLayer<C>, ThrottleError> {
        if !(1.0..=MAX_K).contains(&self.k) {
            return Err(ThrottleError::InvalidK(self.k));
        }
        let width = u64::try_from(self.window.as_nanos())
            .ok()
            .filter(|&n| n >= 120_000_000)
            .ok_or(ThrottleError::InvalidWindow(self.window))?
            / THROTTLE_BUCKETS as u64;
        if self.max_backends == Some(0) {
            return Err(ThrottleError::NoBackends);
        }
        // Within 1..=1e6, so k * 1000 rounds to an integer up to 1e9.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let k_milli = (self.k * 1000.0).round() as u64;
        let seed = self
            .seed
            .unwrap_or_else(|| foldhash::fast::RandomState::default().hash_one(0u8));
        let windows = match self.max_backends {
            None => Windows::One(Window::new(THROTTLE_BUCKETS, width)),
            Some(max) => Windows::Keyed {
                map: HashMap::new(),
                max,
            },
        };
        Ok(AdaptiveThrottleLayer {
            shared: Arc::new(Shared {
                clock: self.clock,
                k: self.k,
                k_milli,
                window: self.window,
                width,
                retry_after: self.retry_after,
                responder: self.responder,
                rng: Rng::new(seed),
                keyed: self
                    .max_backends
                    .map(|_| foldhash::fast::RandomState::default()),
                windows: Mutex::new(windows),
                requests: AtomicU64::new(0),
                throttled: AtomicU64::new(0),
                throttled_metric: Counter::new(
                    crate::metrics::CLIENT_THROTTLED_TOTAL,
                    &[("client", &self.name)],
                ),
            }),
        })
    }
}

impl AdaptiveThrottleLayerBuilder {
    /// The defaults are valid.
    fn build_with_defaults(self) -> AdaptiveThrottleLayer {
        match self.build() {
            Ok(layer) => layer,
            Err(e) => unreachable!("the default settings are valid: {e}"),
        }
    }
}

enum Windows {
    One(Window),
    Keyed {
        map: HashMap<u64, Window>,
        max: usize,
    },
}

pub(crate) struct Shared<C> {
    clock: C,
    k: f64,
    k_milli: u64,
    window: Duration,
    width: u64,
    retry_after: Duration,
    responder: Box<dyn Responder>,
    /// The draws (SplitMix64: a counter, mixed).
    rng: Rng,
    /// Hashes authorities, when keyed by them.
    keyed: Option<foldhash::fast::RandomState>,
    windows: Mutex<Windows>,
    requests: AtomicU64,
    throttled: AtomicU64,
    /// `tollgate_client_throttled_total`.
    throttled_metric: Counter,
}

impl<C: Clock> Shared<C> {
    /// The key of a request's backend when keyed by authority (else 0, unused).
    pub(crate) fn key<B>(&self, request: &http::Request<B>) -> u64 {
        self.keyed.as_ref().map_or(0, |hasher| {
            crate::client::local::server_key(request, hasher)
        })
    }

    fn key_of(&self, authority: &str) -> u64 {
        self.keyed.as_ref().map_or(0, |hasher| {
            crate::client::local::authority_key(authority, hasher)
        })
    }

    /// A draw uniform over the `u64`s (the retry policy's SplitMix64).
    fn draw(&self) -> u64 {
        self.rng.next_u64()
    }

    /// Counts a request to the backend of `key`: `None` if it is refused here, else the bucket
    /// it was counted in.
    pub(crate) fn throttle(&self, key: u64) -> Option<u64> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let draw = self.draw();
        let now = self.clock.now();
        let (refused, bucket) =
            self.with_window(key, |w| (w.request(now, draw, self.k_milli), w.bucket()));
        if refused {
            self.throttled.fetch_add(1, Ordering::Relaxed);
            self.throttled_metric.increment(1);
            return None;
        }
        Some(bucket)
    }

    /// A request to the backend of `key`, counted in `bucket`, was refused by a tollgate layer
    /// inside (a breaker, pacing): it never reached the backend, and is taken back.
    pub(crate) fn unsent(&self, key: u64, bucket: u64) {
        let now = self.clock.now();
        let mut windows = self.windows.lock();
        let window = match &mut *windows {
            Windows::One(w) => Some(w),
            Windows::Keyed { map, .. } => map.get_mut(&key),
        };
        if let Some(window) = window {
            window.unsent(now, bucket);
        }
    }

    /// The backend of `key` accepted a request.
    pub(crate) fn accepted(&self, key: u64) {
        let now = self.clock.now();
        self.with_window(key, |w| w.accept(now));
    }

    fn with_window<T>(&self, key: u64, f: impl FnOnce(&mut Window) -> T) -> T {
        let mut windows = self.windows.lock();
        match &mut *windows {
            Windows::Keyed { map, max } => {
                if !map.contains_key(&key) && map.len() >= *max {
                    // Forget the backend idle longest (a scan, only at capacity).
                    let idle = map
                        .iter()
                        .min_by_key(|(_, w)| w.last_seen())
                        .map(|(k, _)| *k);
                    if let Some(idle) = idle {
                        map.remove(&idle);
                    }
                }
                let window = map
                    .entry(key)
                    .or_insert_with(|| Window::new(THROTTLE_BUCKETS, self.width));
                f(window)
            }
            Windows::One(window) => f(window),
        }
    }

    /// The local refusal of a request.
    pub(crate) fn refuse(&self, parts: &Parts) -> Response<Bytes> {
        crate::client::local::answer(
            &*self.responder,
            parts,
            RejectionKind::Overloaded,
            None,
            Some(self.retry_after),
        )
    }
}
