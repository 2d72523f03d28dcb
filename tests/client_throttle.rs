//! The client's adaptive throttling and outbound circuit breaker, against simulated backends:
//! the throttle's local refusals against Google SRE's formula (many requests, a fixed seed),
//! what it sends an overloaded backend, its recovery when the backend recovers, and the
//! breaker's run, trial call and reopening. Time is a manual clock or tokio's paused time.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tollgate::answer::{Refused, RejectionKind};
use tollgate::client::breaker::{BreakerStatus, Outcome};
use tollgate::client::throttle::ThrottleError;
use tollgate::client::{AdaptiveThrottleLayer, CircuitBreakerLayer};
use tollgate::clock::{Clock, ManualClock};
use tower::{Service, ServiceBuilder, ServiceExt};

const SECOND: u64 = 1_000_000_000;

/// A backend that takes `capacity` requests per second of `clock` (0: none, `u64::MAX`: all)
/// and answers the rest with 503; it counts what it received.
#[derive(Clone)]
struct Backend {
    clock: ManualClock,
    capacity: Arc<AtomicU64>,
    /// (second, taken in that second)
    taken: Arc<parking_lot::Mutex<(u64, u64)>>,
    received: Arc<AtomicU64>,
}

impl Backend {
    fn new(clock: &ManualClock, capacity: u64) -> Self {
        Backend {
            clock: clock.clone(),
            capacity: Arc::new(AtomicU64::new(capacity)),
            taken: Arc::default(),
            received: Arc::default(),
        }
    }

    fn answer(&self) -> StatusCode {
        self.received.fetch_add(1, Ordering::Relaxed);
        let second = self.clock.now() / SECOND;
        let mut taken = self.taken.lock();
        if taken.0 != second {
            *taken = (second, 0);
        }
        if taken.1 < self.capacity.load(Ordering::Relaxed) {
            taken.1 += 1;
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        }
    }

    fn service(
        &self,
    ) -> impl Service<
        Request<String>,
        Response = Response<String>,
        Error = Infallible,
        Future = impl Future<Output = Result<Response<String>, Infallible>> + Send,
    > + Clone
    + Send
    + 'static {
        let backend = self.clone();
        tower::service_fn(move |_: Request<String>| {
            let status = backend.answer();
            async move {
                let mut response = Response::new(String::new());
                *response.status_mut() = status;
                Ok(response)
            }
        })
    }
}

/// Requests and accepts per second, kept by the test itself: the window the throttle should
/// see (the current second and the 119 before it).
#[derive(Default)]
struct Model {
    seconds: Vec<(u64, u64)>,
}

impl Model {
    fn at(&mut self, second: u64) -> &mut (u64, u64) {
        let s = second as usize;
        if self.seconds.len() <= s {
            self.seconds.resize(s + 1, (0, 0));
        }
        &mut self.seconds[s]
    }

    fn counts(&mut self, second: u64) -> (u64, u64) {
        self.at(second);
        let from = second.saturating_sub(119) as usize;
        self.seconds[from..=second as usize]
            .iter()
            .fold((0, 0), |(r, a), (dr, da)| (r + dr, a + da))
    }
}

fn formula(requests: u64, accepts: u64) -> f64 {
    ((requests as f64 - 2.0 * accepts as f64) / (requests as f64 + 1.0)).max(0.0)
}

fn is_local<B>(response: &Response<B>) -> bool {
    response.extensions().get::<Refused>().is_some()
}

/// Sends `per_second` requests a second for `seconds` from `start_s` through `client`, checking
/// each refusal's probability against the formula on the test's own window. Returns, per
/// second, the requests refused locally.
#[allow(clippy::too_many_arguments)]
async fn drive<S>(
    client: &mut S,
    layer: &AdaptiveThrottleLayer<ManualClock>,
    clock: &ManualClock,
    model: &mut Model,
    stats: &mut Calibration,
    start_s: u64,
    seconds: u64,
    per_second: u64,
) -> Vec<u64>
where
    S: Service<Request<String>, Response = Response<String>, Error = Infallible>,
{
    let mut refused = Vec::new();
    for s in start_s..start_s + seconds {
        let mut this_second = 0;
        for i in 0..per_second {
            clock.set(Duration::from_nanos(s * SECOND + i * SECOND / per_second));
            let (requests, accepts) = model.counts(s);
            let seen = layer.counts("");
            assert_eq!(
                (seen.requests, seen.accepts),
                (requests, accepts),
                "at {s} s"
            );
            let p = formula(requests, accepts);
            let response = client
                .ready()
                .await
                .unwrap()
                .call(Request::new(String::new()))
                .await
                .unwrap();
            let local = is_local(&response);
            stats.add(p, local);
            this_second += u64::from(local);
            let counts = model.at(s);
            counts.0 += 1;
            counts.1 += u64::from(response.status() == StatusCode::OK);
        }
        refused.push(this_second);
    }
    refused
}

/// The local refusals against the probabilities the formula gave them, in all and by decile
/// of the probability.
#[derive(Default)]
struct Calibration {
    n: u64,
    refused: u64,
    expected: f64,
    variance: f64,
    bins: [(u64, f64, u64); 10],
}

impl Calibration {
    fn add(&mut self, p: f64, refused: bool) {
        self.n += 1;
        self.refused += u64::from(refused);
        self.expected += p;
        self.variance += p * (1.0 - p);
        let bin = &mut self.bins[((p * 10.0) as usize).min(9)];
        bin.0 += 1;
        bin.1 += p;
        bin.2 += u64::from(refused);
    }

    /// Observed within four standard deviations of the expected, in all and in each decile
    /// with enough draws.
    fn check(&self, what: &str) {
        let sigma = self.variance.sqrt();
        println!(
            "{what}: {} requests, {} refused locally, {:.1} expected by the formula (sigma {:.1})",
            self.n, self.refused, self.expected, sigma
        );
        assert!(
            (self.refused as f64 - self.expected).abs() <= 4.0 * sigma.max(1.0),
            "{what}: {} refused, {:.1} expected",
            self.refused,
            self.expected
        );
        for (i, &(n, sum_p, refused)) in self.bins.iter().enumerate() {
            if n < 200 {
                continue;
            }
            let mean = sum_p / n as f64;
            let rate = refused as f64 / n as f64;
            let tolerance = 4.0 * (mean * (1.0 - mean) / n as f64).sqrt() + 0.005;
            println!(
                "  p in [{:.1}, {:.1}): {n} draws, mean p {mean:.3}, refused {rate:.3}",
                i as f64 / 10.0,
                (i + 1) as f64 / 10.0
            );
            assert!(
                (rate - mean).abs() <= tolerance,
                "{what}: decile {i}: refused {rate:.4}, formula {mean:.4}"
            );
        }
    }
}

fn throttle(clock: &ManualClock, seed: u64) -> AdaptiveThrottleLayer<ManualClock> {
    AdaptiveThrottleLayer::builder()
        .clock(clock.clone())
        .seed(seed)
        .build()
        .unwrap()
}

/// A backend that can take 20 requests a second, offered 100: every local refusal is drawn
/// with the formula's probability on the window the test keeps itself, and at equilibrium the
/// backend receives about K = 2 times what it can accept (the rest is refused locally, never
/// reaching it).
#[tokio::test]
async fn the_local_refusals_follow_the_formula() {
    let clock = ManualClock::new();
    let layer = throttle(&clock, 42);
    let backend = Backend::new(&clock, 20);
    let mut client = ServiceBuilder::new()
        .layer(layer.clone())
        .service(backend.service());
    let mut model = Model::default();
    let mut stats = Calibration::default();
    drive(
        &mut client,
        &layer,
        &clock,
        &mut model,
        &mut stats,
        0,
        300,
        100,
    )
    .await;
    let before = backend.received.load(Ordering::Relaxed);
    drive(
        &mut client,
        &layer,
        &clock,
        &mut model,
        &mut stats,
        300,
        300,
        100,
    )
    .await;
    stats.check("overloaded backend (capacity 20/s, offered 100/s, 10 min)");
    let per_second = (backend.received.load(Ordering::Relaxed) - before) as f64 / 300.0;
    println!(
        "at equilibrium the backend receives {per_second:.1} requests/s for a capacity of 20/s (K = 2)"
    );
    assert!((36.0..=44.0).contains(&per_second), "{per_second}");
    assert_eq!(layer.stats().requests, 60_000);
    assert_eq!(layer.stats().throttled, stats.refused);
}

/// The same with other seeds and K: the draws follow the formula whatever the seed, and K is
/// the multiplier of the equilibrium.
#[tokio::test]
async fn the_formula_holds_for_other_seeds_and_k() {
    for (seed, k) in [(1, 2.0), (7, 1.5), (99, 3.0)] {
        let clock = ManualClock::new();
        let layer = AdaptiveThrottleLayer::builder()
            .clock(clock.clone())
            .seed(seed)
            .k(k)
            .build()
            .unwrap();
        let backend = Backend::new(&clock, 10);
        let mut client = ServiceBuilder::new()
            .layer(layer.clone())
            .service(backend.service());
        let mut refused = (0u64, 0.0f64, 0.0f64);
        for i in 0..24_000u64 {
            clock.set(Duration::from_millis(10 * i));
            let counts = layer.counts("");
            let p = counts.rejection_probability(k);
            let response = client
                .ready()
                .await
                .unwrap()
                .call(Request::new(String::new()))
                .await
                .unwrap();
            refused.0 += u64::from(is_local(&response));
            refused.1 += p;
            refused.2 += p * (1.0 - p);
        }
        let received = backend.received.load(Ordering::Relaxed) as f64 / 240.0;
        println!(
            "seed {seed}, K {k}: {} refused locally, {:.1} expected; backend receives {received:.1}/s for 10/s",
            refused.0, refused.1
        );
        assert!((refused.0 as f64 - refused.1).abs() <= 4.0 * refused.2.sqrt());
        // Averaged over the first window too, where it has not settled yet: within 25 %.
        assert!(
            (received - 10.0 * k).abs() <= 2.5 * k,
            "K {k}: {received} per second"
        );
    }
}

/// Overload, then the backend recovers: the probability falls as the refusals of the
/// overload leave the window, and within one window (two minutes) nothing is refused locally.
#[tokio::test]
async fn the_throttle_recovers_when_an_overloaded_backend_recovers() {
    let clock = ManualClock::new();
    let layer = throttle(&clock, 5);
    let backend = Backend::new(&clock, 20);
    let mut client = ServiceBuilder::new()
        .layer(layer.clone())
        .service(backend.service());
    let mut model = Model::default();
    let mut stats = Calibration::default();
    let during = drive(
        &mut client,
        &layer,
        &clock,
        &mut model,
        &mut stats,
        0,
        240,
        100,
    )
    .await;
    let last: u64 = during[230..].iter().sum();
    assert!(last > 500, "still throttling at the end: {last} of 1000");
    backend.capacity.store(u64::MAX, Ordering::Relaxed);
    let after = drive(
        &mut client,
        &layer,
        &clock,
        &mut model,
        &mut stats,
        240,
        240,
        100,
    )
    .await;
    stats.check("overload then recovery");
    let clear = after.iter().rposition(|&n| n > 0).map_or(0, |s| s + 1);
    println!(
        "overloaded backend recovered: local refusals in the first seconds {:?}; none from {clear} s on",
        &after[..10]
    );
    assert!(
        clear <= 120,
        "still refusing locally {clear} s after the recovery"
    );
    assert_eq!(after[120..].iter().sum::<u64>(), 0);
}

/// A complete outage, then the backend recovers. During the outage almost everything is
/// refused locally (the backend sees a trickle). After it, the refusals of the outage leave the
/// window within its two minutes, but the throttle's own refusals count as requests too (as
/// Google SRE counts them), so the window stays full of requests with almost no accepts: only
/// the formula's `+ 1` lets about one request per window through at first, and each accept
/// lets about K more through before it leaves the window. The accepts grow by about K per
/// window until they pass half the requests: recovery takes several windows. The figures are
/// printed, with those of a 30 s window, which recovers four times as fast.
#[tokio::test]
async fn the_throttle_recovers_after_an_outage() {
    let clock = ManualClock::new();
    let layer = throttle(&clock, 11);
    let backend = Backend::new(&clock, 0);
    let mut client = ServiceBuilder::new()
        .layer(layer.clone())
        .service(backend.service());
    let mut model = Model::default();
    let mut stats = Calibration::default();
    let during = drive(
        &mut client,
        &layer,
        &clock,
        &mut model,
        &mut stats,
        0,
        180,
        10,
    )
    .await;
    let received = backend.received.load(Ordering::Relaxed);
    println!(
        "outage of 180 s at 10 requests/s: the backend received {received} of 1800, {} in the last minute",
        600 - during[120..].iter().sum::<u64>()
    );
    assert!(received <= 30, "{received}");
    backend.capacity.store(u64::MAX, Ordering::Relaxed);
    let after = drive(
        &mut client,
        &layer,
        &clock,
        &mut model,
        &mut stats,
        180,
        3600,
        10,
    )
    .await;
    stats.check("outage then recovery (2 min window)");
    let (half, clear) = recovery(&after);
    println!(
        "after the outage (2 min window): half the requests pass from {half} s, none is refused locally from {clear} s"
    );
    // Deterministic (a fixed seed); the bound leaves room for an unlucky first draw.
    assert!(clear <= 2400, "{clear}");
    assert_eq!(after[clear..].iter().sum::<u64>(), 0);
    assert!(half < clear);

    // The same outage with a 30 s window.
    let clock = ManualClock::new();
    let layer = AdaptiveThrottleLayer::builder()
        .clock(clock.clone())
        .seed(11)
        .window(Duration::from_secs(30))
        .build()
        .unwrap();
    let backend = Backend::new(&clock, 0);
    let mut client = ServiceBuilder::new()
        .layer(layer.clone())
        .service(backend.service());
    let mut after = Vec::new();
    for s in 0..1080u64 {
        if s == 180 {
            backend.capacity.store(u64::MAX, Ordering::Relaxed);
        }
        let mut refused = 0;
        for i in 0..10 {
            clock.set(Duration::from_millis(s * 1000 + i * 100));
            let r = call_throttled(&mut client).await;
            refused += u64::from(is_local(&r));
        }
        if s >= 180 {
            after.push(refused);
        }
    }
    let (half_30, clear_30) = recovery(&after);
    println!(
        "after the outage (30 s window): half the requests pass from {half_30} s, none is refused locally from {clear_30} s"
    );
    assert!(clear_30 < clear / 2, "{clear_30} vs {clear}");
}

/// When half the requests of a second pass again, and from when none is refused, in seconds
/// after the recovery.
fn recovery(refused_per_second: &[u64]) -> (usize, usize) {
    let half = refused_per_second
        .iter()
        .position(|&n| n <= 5)
        .unwrap_or(refused_per_second.len());
    let clear = refused_per_second
        .iter()
        .rposition(|&n| n > 0)
        .map_or(0, |s| s + 1);
    (half, clear)
}

async fn call_throttled<S>(client: &mut S) -> Response<String>
where
    S: Service<Request<String>, Response = Response<String>, Error = Infallible>,
{
    client
        .ready()
        .await
        .unwrap()
        .call(Request::new(String::new()))
        .await
        .unwrap()
}

/// A local refusal is the server's own kind of answer: 503 with Retry-After, no-store and a
/// problem+json body, or for gRPC `UNAVAILABLE` with a pushback; marked Refused; the backend
/// is not called.
#[tokio::test]
async fn a_local_refusal_looks_like_the_servers_own() {
    let clock = ManualClock::new();
    let layer = AdaptiveThrottleLayer::builder()
        .clock(clock.clone())
        .seed(3)
        .retry_after(Duration::from_secs(2))
        .build()
        .unwrap();
    let backend = Backend::new(&clock, 0);
    let mut client = ServiceBuilder::new()
        .layer(layer.clone())
        .service(backend.service());
    let (mut http, mut grpc) = (None, None);
    for i in 0..200 {
        let request = if i % 2 == 0 {
            Request::new(String::new())
        } else {
            Request::post("/svc/M")
                .header("content-type", "application/grpc")
                .body(String::new())
                .unwrap()
        };
        let before = backend.received.load(Ordering::Relaxed);
        let response = client.ready().await.unwrap().call(request).await.unwrap();
        if is_local(&response) {
            assert_eq!(backend.received.load(Ordering::Relaxed), before);
            assert_eq!(
                response.extensions().get::<Refused>().unwrap().kind,
                RejectionKind::Overloaded
            );
            if i % 2 == 0 {
                http.get_or_insert(response);
            } else {
                grpc.get_or_insert(response);
            }
        }
    }
    let http = http.expect("a local refusal");
    assert_eq!(http.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(http.headers()["retry-after"], "2");
    assert_eq!(http.headers()["cache-control"], "no-store");
    assert_eq!(http.headers()["content-type"], "application/problem+json");
    let body: serde_json::Value =
        serde_json::from_slice(&http.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["status"], 503);
    let grpc = grpc.expect("a local gRPC refusal");
    assert_eq!(grpc.status(), StatusCode::OK);
    assert_eq!(grpc.headers()["grpc-status"], "14");
    assert_eq!(grpc.headers()["grpc-retry-pushback-ms"], "2000");
    let stats = layer.stats();
    assert_eq!(stats.requests, 200);
    assert_eq!(
        stats.requests - stats.throttled,
        backend.received.load(Ordering::Relaxed)
    );
}

/// What counts as accepted: anything but 429, 503, gRPC 8 and 14, and errors. A 500 or a 404
/// is the backend's real answer.
#[tokio::test]
async fn accepts_are_answers_that_are_not_refusals() {
    let answers: [(u16, Option<&str>, bool); 8] = [
        (200, None, true),
        (404, None, true),
        (500, None, true),
        (429, None, false),
        (503, None, false),
        (200, Some("8"), false),
        (200, Some("14"), false),
        (200, Some("13"), true),
    ];
    for (status, grpc, accepted) in answers {
        let clock = ManualClock::new();
        let layer = throttle(&clock, 1);
        let mut client = ServiceBuilder::new().layer(layer.clone()).service_fn(
            move |_: Request<String>| async move {
                let mut r = Response::new(String::new());
                *r.status_mut() = StatusCode::from_u16(status).unwrap();
                if let Some(code) = grpc {
                    r.headers_mut().insert("grpc-status", code.parse().unwrap());
                }
                Ok::<_, Infallible>(r)
            },
        );
        client
            .ready()
            .await
            .unwrap()
            .call(Request::new(String::new()))
            .await
            .unwrap();
        let counts = layer.counts("");
        assert_eq!(
            (counts.requests, counts.accepts),
            (1, u64::from(accepted)),
            "{status} {grpc:?}"
        );
    }
    // An error is not accepted either.
    let clock = ManualClock::new();
    let layer = throttle(&clock, 1);
    let mut client =
        ServiceBuilder::new()
            .layer(layer.clone())
            .service_fn(|_: Request<String>| async {
                Err::<Response<String>, _>(std::io::Error::other("connection refused"))
            });
    let _ = client
        .ready()
        .await
        .unwrap()
        .call(Request::new(String::new()))
        .await;
    assert_eq!(layer.counts("").accepts, 0);
    assert_eq!(layer.counts("").requests, 1);
}

/// Keyed by authority: a failing backend is throttled, a healthy one behind the same layer is
/// not; a full map forgets the backend idle longest.
#[tokio::test]
async fn per_authority_windows_keep_backends_apart() {
    let clock = ManualClock::new();
    let layer = AdaptiveThrottleLayer::builder()
        .clock(clock.clone())
        .seed(9)
        .per_authority(2)
        .build()
        .unwrap();
    let mut client = ServiceBuilder::new().layer(layer.clone()).service_fn(
        |request: Request<String>| async move {
            let mut r = Response::new(String::new());
            if request.uri().host() == Some("down.example") {
                *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            }
            Ok::<_, Infallible>(r)
        },
    );
    let mut send = async |uri: &str| {
        let request = Request::get(uri).body(String::new()).unwrap();
        let response = client.ready().await.unwrap().call(request).await.unwrap();
        is_local(&response)
    };
    let mut local = (0, 0);
    for _ in 0..200 {
        local.0 += u32::from(send("http://down.example/x").await);
        local.1 += u32::from(send("http://UP.example/y").await);
    }
    assert!(local.0 > 150, "{local:?}");
    assert_eq!(local.1, 0);
    assert_eq!(layer.counts("up.example").accepts, 200);
    assert_eq!(layer.counts("down.example").accepts, 0);
    assert_eq!(layer.counts("other.example").requests, 0);
    // A third backend when two are remembered: the one idle longest (down.example) goes.
    clock.advance(Duration::from_secs(5));
    send("http://up.example/").await;
    clock.advance(Duration::from_secs(5));
    send("http://third.example/").await;
    assert_eq!(layer.counts("down.example").requests, 0);
    assert_eq!(layer.counts("up.example").requests, 201);
    assert_eq!(layer.counts("third.example").requests, 1);
}

#[test]
fn bad_settings_are_refused_at_construction() {
    let build = |k: f64, window: Duration| {
        AdaptiveThrottleLayer::builder()
            .k(k)
            .window(window)
            .build()
            .map(|_| ())
    };
    let minute = Duration::from_secs(60);
    assert_eq!(build(0.99, minute), Err(ThrottleError::InvalidK(0.99)));
    assert!(matches!(
        build(f64::NAN, minute),
        Err(ThrottleError::InvalidK(_))
    ));
    assert!(build(f64::INFINITY, minute).is_err());
    assert!(build(1.0, minute).is_ok());
    assert!(build(1_000_000.0, minute).is_ok());
    assert!(build(1_000_001.0, minute).is_err());
    assert_eq!(
        build(2.0, Duration::from_millis(119)),
        Err(ThrottleError::InvalidWindow(Duration::from_millis(119)))
    );
    assert!(build(2.0, Duration::from_millis(120)).is_ok());
    assert!(build(2.0, Duration::MAX).is_err());
    let e = AdaptiveThrottleLayer::builder()
        .per_authority(0)
        .build()
        .unwrap_err();
    assert_eq!(e, ThrottleError::NoBackends);
    assert!(e.to_string().contains("at least one backend"));
    assert!(
        build(0.5, minute)
            .unwrap_err()
            .to_string()
            .contains("not 0.5")
    );
    let layer = AdaptiveThrottleLayer::new();
    assert_eq!(layer.k(), 2.0);
    assert!(format!("{layer:?}").contains("k: 2.0"));
}

/// A window shorter than two minutes slides faster: after an overload the old refusals leave
/// within the shorter window.
#[tokio::test]
async fn the_window_can_be_shorter() {
    let clock = ManualClock::new();
    let layer = AdaptiveThrottleLayer::builder()
        .clock(clock.clone())
        .seed(2)
        .window(Duration::from_secs(12))
        .build()
        .unwrap();
    let backend = Backend::new(&clock, 0);
    let mut client = ServiceBuilder::new()
        .layer(layer.clone())
        .service(backend.service());
    for i in 0..1000u64 {
        clock.set(Duration::from_millis(10 * i));
        let _ = client
            .ready()
            .await
            .unwrap()
            .call(Request::new(String::new()))
            .await;
    }
    // 10 s at 100/s, all in the 12 s window (buckets of 100 ms).
    assert_eq!(layer.counts("").requests, 1000);
    clock.set(Duration::from_millis(10_000 + 12_000));
    assert_eq!(layer.counts("").requests, 0);
}

// ---------------------------------------------------------------------------------------------
// The outbound circuit breaker, under tokio's paused time (its default clock follows it).

/// A backend whose answer the test sets: a status, an error, or a wait for `release`.
#[derive(Clone, Default)]
struct Scripted {
    status: Arc<AtomicU64>,
    fail: Arc<AtomicBool>,
    hold: Arc<AtomicBool>,
    release: Arc<Notify>,
    calls: Arc<AtomicU64>,
}

impl Scripted {
    fn set(&self, status: u16) {
        self.fail.store(false, Ordering::SeqCst);
        self.status.store(u64::from(status), Ordering::SeqCst);
    }

    fn error(&self) {
        self.fail.store(true, Ordering::SeqCst);
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    fn service(
        &self,
    ) -> impl Service<
        Request<String>,
        Response = Response<String>,
        Error = std::io::Error,
        Future = impl Future<Output = Result<Response<String>, std::io::Error>> + Send,
    > + Clone
    + Send
    + 'static {
        let me = self.clone();
        tower::service_fn(move |_: Request<String>| {
            let me = me.clone();
            me.calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if me.hold.load(Ordering::SeqCst) {
                    me.release.notified().await;
                }
                if me.fail.load(Ordering::SeqCst) {
                    return Err(std::io::Error::other("connection reset"));
                }
                let mut r = Response::new(String::new());
                *r.status_mut() = StatusCode::from_u16(me.status.load(Ordering::SeqCst) as u16)
                    .unwrap_or(StatusCode::OK);
                Ok(r)
            }
        })
    }
}

async fn call<S>(client: &mut S) -> Result<Response<String>, std::io::Error>
where
    S: Service<Request<String>, Response = Response<String>, Error = std::io::Error>,
{
    client
        .ready()
        .await?
        .call(Request::new(String::new()))
        .await
}

/// Opens after the run (errors and 5xx mixed), answers locally while open (the backend is not
/// called), lets exactly one trial through after the wait, closes on its success.
#[tokio::test(start_paused = true)]
async fn the_breaker_opens_after_the_run_and_one_trial_closes_it() {
    let backend = Scripted::default();
    backend.set(200);
    let breaker = CircuitBreakerLayer::builder()
        .breaker(4, Duration::from_secs(10))
        .build();
    let mut client = ServiceBuilder::new()
        .layer(breaker.clone())
        .service(backend.service());
    // A success in the middle ends a run.
    for status in [500, 502, 200, 503, 504] {
        backend.set(status);
        call(&mut client).await.unwrap();
    }
    assert_eq!(breaker.status(), BreakerStatus::Closed);
    backend.error();
    assert!(call(&mut client).await.is_err());
    assert_eq!(breaker.status(), BreakerStatus::Closed);
    backend.set(500);
    call(&mut client).await.unwrap();
    assert_eq!(breaker.status(), BreakerStatus::Open);
    assert_eq!(breaker.stats().opened, 1);
    assert_eq!(breaker.stats().failures, 6);
    // Open: answered here, with the time until the trial.
    let calls = backend.calls();
    tokio::time::advance(Duration::from_millis(2500)).await;
    let refused = call(&mut client).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["retry-after"], "8");
    assert!(is_local(&refused));
    assert_eq!(backend.calls(), calls);
    // After the wait, one trial, held by the backend: the others are still answered here.
    tokio::time::advance(Duration::from_millis(7500)).await;
    backend.set(200);
    backend.hold.store(true, Ordering::SeqCst);
    let mut trial_client = client.clone();
    let trial = tokio::spawn(async move { call(&mut trial_client).await });
    tokio::task::yield_now().await;
    assert_eq!(breaker.status(), BreakerStatus::HalfOpen);
    for _ in 0..5 {
        let r = call(&mut client).await.unwrap();
        assert!(is_local(&r));
        // While a trial is out, a failure would reopen for the whole wait.
        assert_eq!(r.headers()["retry-after"], "10");
    }
    assert_eq!(backend.calls(), calls + 1);
    backend.hold.store(false, Ordering::SeqCst);
    backend.release.notify_one();
    assert_eq!(trial.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(breaker.status(), BreakerStatus::Closed);
    assert_eq!(call(&mut client).await.unwrap().status(), StatusCode::OK);
    assert_eq!(breaker.stats().short_circuited, 6);
}

/// A failed trial reopens the breaker for the whole wait; a trial whose caller gives up
/// reopens it too; an error trial is a failure.
#[tokio::test(start_paused = true)]
async fn a_failed_or_abandoned_trial_reopens_the_breaker() {
    let backend = Scripted::default();
    let breaker = CircuitBreakerLayer::builder()
        .breaker(2, Duration::from_secs(5))
        .build();
    let mut client = ServiceBuilder::new()
        .layer(breaker.clone())
        .service(backend.service());
    backend.set(503);
    call(&mut client).await.unwrap();
    call(&mut client).await.unwrap();
    assert_eq!(breaker.status(), BreakerStatus::Open);
    tokio::time::advance(Duration::from_secs(5)).await;
    // The trial fails: open again, for 5 s from now.
    backend.error();
    assert!(call(&mut client).await.is_err());
    assert_eq!(breaker.status(), BreakerStatus::Open);
    assert_eq!(breaker.stats().opened, 2);
    tokio::time::advance(Duration::from_millis(4999)).await;
    assert!(is_local(&call(&mut client).await.unwrap()));
    tokio::time::advance(Duration::from_millis(1)).await;
    // The trial's caller gives up before the answer: open again.
    backend.set(200);
    backend.hold.store(true, Ordering::SeqCst);
    let calls = backend.calls();
    let abandoned = tokio::time::timeout(Duration::from_secs(1), call(&mut client)).await;
    assert!(abandoned.is_err());
    assert_eq!(backend.calls(), calls + 1);
    assert_eq!(breaker.status(), BreakerStatus::Open);
    let r = call(&mut client).await.unwrap();
    assert!(is_local(&r));
    assert_eq!(r.headers()["retry-after"], "5");
    backend.hold.store(false, Ordering::SeqCst);
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(call(&mut client).await.unwrap().status(), StatusCode::OK);
    assert_eq!(breaker.status(), BreakerStatus::Closed);
}

/// A 429 (or gRPC RESOURCE_EXHAUSTED) is neither a failure nor a success: it neither ends a run
/// nor adds to it, and a trial answered so hands the trial to the next call. Other answers (a
/// 404, a 501) are successes.
#[tokio::test(start_paused = true)]
async fn a_429_counts_for_nothing() {
    let backend = Scripted::default();
    let breaker = CircuitBreakerLayer::builder()
        .breaker(3, Duration::from_secs(5))
        .build();
    let mut client = ServiceBuilder::new()
        .layer(breaker.clone())
        .service(backend.service());
    for status in [503, 429, 503, 429, 429] {
        backend.set(status);
        call(&mut client).await.unwrap();
    }
    assert_eq!(breaker.status(), BreakerStatus::Closed);
    backend.set(503);
    call(&mut client).await.unwrap();
    assert_eq!(breaker.status(), BreakerStatus::Open);
    tokio::time::advance(Duration::from_secs(5)).await;
    backend.set(429);
    let calls = backend.calls();
    assert_eq!(
        call(&mut client).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Not closed by it: half open still, the next trial due at once.
    assert_eq!(breaker.status(), BreakerStatus::HalfOpen);
    // The next call is the trial, at once.
    backend.set(404);
    assert_eq!(
        call(&mut client).await.unwrap().status(),
        StatusCode::NOT_FOUND
    );
    assert_eq!(backend.calls(), calls + 2);
    assert_eq!(breaker.status(), BreakerStatus::Closed);
    // The default reading, directly.
    let grpc = |code: &'static str| {
        let mut h = http::HeaderMap::new();
        h.insert("grpc-status", code.parse().unwrap());
        Outcome::of(StatusCode::OK, &h)
    };
    assert_eq!(grpc("8"), Outcome::Ignore);
    assert_eq!(grpc("14"), Outcome::Failure);
    assert_eq!(grpc("13"), Outcome::Failure);
    assert_eq!(grpc("4"), Outcome::Failure);
    assert_eq!(grpc("5"), Outcome::Success);
    let none = http::HeaderMap::new();
    assert_eq!(
        Outcome::of(StatusCode::NOT_IMPLEMENTED, &none),
        Outcome::Success
    );
    assert_eq!(
        Outcome::of(StatusCode::GATEWAY_TIMEOUT, &none),
        Outcome::Failure
    );
}

/// A classifier of one's own, and the answer while open to a gRPC request.
#[tokio::test(start_paused = true)]
async fn a_custom_reading_and_the_grpc_answer() {
    let backend = Scripted::default();
    let breaker = CircuitBreakerLayer::builder()
        .breaker(1, Duration::from_millis(1500))
        .classify(|status, _| {
            if status == StatusCode::IM_A_TEAPOT {
                Outcome::Failure
            } else {
                Outcome::Success
            }
        })
        .build();
    let mut client = ServiceBuilder::new()
        .layer(breaker.clone())
        .service(backend.service());
    backend.set(500);
    for _ in 0..3 {
        call(&mut client).await.unwrap();
    }
    // 500s are successes to this classifier.
    assert_eq!(breaker.status(), BreakerStatus::Closed);
    backend.set(418);
    call(&mut client).await.unwrap();
    assert_eq!(breaker.status(), BreakerStatus::Open);
    let request = Request::post("/svc/M")
        .header("content-type", "application/grpc+proto")
        .body(String::new())
        .unwrap();
    let r = client.ready().await.unwrap().call(request).await.unwrap();
    assert_eq!(r.headers()["grpc-status"], "14");
    assert_eq!(r.headers()["grpc-retry-pushback-ms"], "1500");
    assert!(format!("{breaker:?}").contains("Open"));
}

/// Refusals made by a tollgate layer inside the breaker never reached the backend: they count
/// for nothing, even to a classifier that reads every non-2xx as a failure.
#[tokio::test(start_paused = true)]
async fn refusals_made_inside_count_for_nothing() {
    use tollgate::key::Global;
    use tollgate::limiter::Rule;
    use tollgate::{MemoryStore, Policy, RateLimitLayer};

    let strict = |status: StatusCode, _: &http::HeaderMap| {
        if status.is_success() {
            Outcome::Success
        } else {
            Outcome::Failure
        }
    };
    let backend = Scripted::default();
    backend.set(200);
    let breaker = CircuitBreakerLayer::builder()
        .breaker(1, Duration::from_secs(5))
        .classify(strict)
        .build();
    let limit = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::new("one")
                .key(Global)
                .policy(Policy::fixed_window(1, Duration::from_secs(3600)).unwrap()),
        )
        .build()
        .unwrap();
    let mut client = ServiceBuilder::new()
        .layer(breaker.clone())
        .layer(limit)
        .service(backend.service());
    assert_eq!(call(&mut client).await.unwrap().status(), StatusCode::OK);
    for _ in 0..5 {
        let r = call(&mut client).await.unwrap();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(is_local(&r));
    }
    assert_eq!(backend.calls(), 1);
    assert_eq!(breaker.status(), BreakerStatus::Closed);
    // The same answer from the backend itself is a failure to this classifier.
    let breaker = CircuitBreakerLayer::builder()
        .breaker(1, Duration::from_secs(5))
        .classify(strict)
        .build();
    let mut client = ServiceBuilder::new()
        .layer(breaker.clone())
        .service(backend.service());
    backend.set(429);
    call(&mut client).await.unwrap();
    assert_eq!(breaker.status(), BreakerStatus::Open);
}

/// An open breaker inside the throttle answers with its own 503s (marked `Refused`): those
/// requests never reached the backend, and the throttle takes them back out of its window.
/// They were counted as accepts, which brought the throttle's refusals down during an outage.
#[tokio::test(start_paused = true)]
async fn an_inner_breakers_refusals_are_taken_out_of_the_window() {
    let clock = ManualClock::new();
    let throttle = throttle(&clock, 1);
    let backend = Scripted::default();
    let breaker = CircuitBreakerLayer::builder()
        .breaker(2, Duration::from_secs(3600))
        .build();
    let mut client = ServiceBuilder::new()
        .layer(throttle.clone())
        .layer(breaker.clone())
        .service(backend.service());
    backend.set(200);
    for _ in 0..10 {
        assert_eq!(call(&mut client).await.unwrap().status(), StatusCode::OK);
    }
    // The outage: two 503s open the breaker, which answers the next eight itself.
    backend.set(503);
    for _ in 0..10 {
        let r = call(&mut client).await.unwrap();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(breaker.status(), BreakerStatus::Open);
    assert_eq!(backend.calls(), 12);
    assert_eq!(throttle.stats().throttled, 0);
    // What reached the backend: 12 requests, 10 accepts.
    let counts = throttle.counts("");
    assert_eq!((counts.requests, counts.accepts), (12, 10));
}

/// A service that is never ready.
#[derive(Clone, Debug)]
struct Busy;

impl Service<Request<String>> for Busy {
    type Response = Response<String>;
    type Error = &'static str;
    type Future = std::future::Ready<Result<Response<String>, &'static str>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), &'static str>> {
        std::task::Poll::Ready(Err("busy"))
    }

    fn call(&mut self, _: Request<String>) -> Self::Future {
        std::future::ready(Ok(Response::new(String::new())))
    }
}

/// The throttle's readiness is its inner service's; its builder, service and future print.
#[tokio::test]
async fn readiness_is_the_inner_services_and_the_parts_print() {
    use tower::Layer;
    let builder = AdaptiveThrottleLayer::builder()
        .k(3.0)
        .window(Duration::from_secs(60))
        .name("backend")
        .seed(9);
    let shown = format!("{builder:?}");
    assert!(
        shown.starts_with("AdaptiveThrottleLayerBuilder {"),
        "{shown}"
    );
    for part in [
        "name: \"backend\"",
        "k: 3.0",
        "window: 60s",
        "seed: Some(9)",
    ] {
        assert!(shown.contains(part), "{shown}");
    }
    let layer = builder.build().unwrap();
    let mut busy = layer.layer(Busy);
    assert_eq!(format!("{busy:?}"), "AdaptiveThrottle { inner: Busy, .. }");
    assert!(matches!(busy.get_ref(), Busy));
    assert_eq!(busy.ready().await.unwrap_err(), "busy");
    let mut ok = layer.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let future = ok.ready().await.unwrap().call(Request::new(String::new()));
    assert_eq!(format!("{future:?}"), "ResponseFuture { .. }");
    assert_eq!(future.await.unwrap().status(), StatusCode::OK);
}
