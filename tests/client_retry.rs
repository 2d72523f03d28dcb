//! The retry layer (`tollgate::client::RetryLayer`): against a real tollgate-limited axum server
//! on loopback (each form of the server's hint, a hint past the deadline, the budget running
//! out, non-idempotent requests), through tonic and reqwest, and in simulations under tokio's
//! paused time: a herd of 200 clients refused at one instant, and the load three nested retry
//! layers put on a failing service.
//!
//! The server runs in the test's own runtime with a `TokioClock` store, so its windows follow
//! the paused time the client waits in: no test waits in real time.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::Request as AxumRequest;
use axum::response::Response as AxumResponse;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tollgate::client::retry::Retry;
use tollgate::client::{GaveUp, GiveUp, Jitter, RetryBudget, RetryLayer, RetryPolicy, RetryStats};
use tollgate::clock::TokioClock;
use tollgate::key::Global;
use tollgate::limiter::Rule;
use tollgate::{MemoryStore, Policy, RateLimitLayer};
use tower::{Layer, ServiceBuilder, ServiceExt};

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);

type Hyper = HyperClient<HttpConnector, Full<Bytes>>;

/// One limit for everyone, on tokio's (paused) clock.
fn limit(policy: Policy) -> RateLimitLayer<MemoryStore<TokioClock>> {
    RateLimitLayer::builder(MemoryStore::with_clock(TokioClock::new()))
        .rule(Rule::new("all").key(Global).policy(policy))
        .build()
        .unwrap()
}

/// A server answering "ok" to GET and POST on `/` behind `limit`, its answers passed through
/// `rewrite`, counting every request that reaches it.
async fn server(policy: Policy, rewrite: fn(&mut HeaderMap)) -> (SocketAddr, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let app = Router::new()
        .route(
            "/",
            axum::routing::get(|| async { "ok" }).post(|| async { "ok" }),
        )
        .layer(limit(policy))
        .layer(axum::middleware::map_response(
            move |mut response: AxumResponse| async move {
                rewrite(response.headers_mut());
                response
            },
        ))
        .layer(axum::middleware::map_request(
            move |request: AxumRequest| {
                counter.fetch_add(1, Ordering::SeqCst);
                async move { Ok::<_, Infallible>(request) }
            },
        ));
    (support::serve(app).await, calls)
}

fn as_is(_: &mut HeaderMap) {}

/// A real HTTP client behind the retry layer.
fn client(policy: &RetryPolicy) -> Retry<Hyper> {
    RetryLayer::new(policy.clone()).layer(HyperClient::builder(TokioExecutor::new()).build_http())
}

fn policy() -> tollgate::client::retry::RetryPolicyBuilder {
    RetryPolicy::builder().seed(7)
}

/// What the caller got, and how long it waited.
#[derive(Debug)]
struct Got {
    status: StatusCode,
    headers: HeaderMap,
    gave_up: Option<GaveUp>,
    waited: Duration,
}

async fn call(
    client: &Retry<Hyper>,
    method: Method,
    addr: SocketAddr,
    headers: &[(&str, &str)],
) -> Got {
    let mut request = Request::builder()
        .method(method)
        .uri(format!("http://{addr}/"));
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let request = request
        .body(Full::new(Bytes::from_static(b"payload")))
        .unwrap();
    let start = Instant::now();
    let response = client.clone().oneshot(request).await.unwrap();
    Got {
        status: response.status(),
        headers: response.headers().clone(),
        gave_up: response.extensions().get::<GaveUp>().copied(),
        waited: start.elapsed(),
    }
}

async fn get(client: &Retry<Hyper>, addr: SocketAddr) -> Got {
    call(client, Method::GET, addr, &[]).await
}

fn within(waited: Duration, from: Duration, below: Duration) {
    assert!(
        waited >= from && waited < below,
        "waited {waited:?}, not in [{from:?}, {below:?})"
    );
}

fn stats(requests: u64, retries: u64) -> RetryStats {
    let mut s = RetryStats::default();
    s.requests = requests;
    s.retries = retries;
    s
}

#[tokio::test(start_paused = true)]
async fn retry_after_in_seconds() {
    let (addr, calls) = server(Policy::fixed_window(1, 2 * S).unwrap(), as_is).await;
    let policy = policy().build().unwrap();
    let client = client(&policy);
    assert_eq!(get(&client, addr).await.status, StatusCode::OK);
    // Refused with `Retry-After: 2`: back after 2 s and less than a tenth more (at least the
    // 100 ms floor of the spread: 200 ms here).
    let got = get(&client, addr).await;
    assert_eq!(got.status, StatusCode::OK, "{got:?}");
    within(got.waited, 2 * S, 2200 * MS);
    assert_eq!(got.gave_up, None);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(policy.stats(), stats(2, 1));
}

/// Rewrites `Retry-After: n` as the HTTP date n + 1 seconds from now (one more second, since a
/// date is whole seconds and the fraction of the current one is lost).
#[allow(clippy::disallowed_methods)] // an HTTP date is wall-clock time
fn retry_after_as_date(headers: &mut HeaderMap) {
    let Some(secs) = headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
    else {
        return;
    };
    let at = std::time::SystemTime::now() + Duration::from_secs(secs + 1);
    let date = httpdate::fmt_http_date(at);
    headers.insert("retry-after", HeaderValue::from_str(&date).unwrap());
}

#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date() {
    let (addr, calls) = server(Policy::fixed_window(1, 2 * S).unwrap(), retry_after_as_date).await;
    let policy = policy().build().unwrap();
    let client = client(&policy);
    assert_eq!(get(&client, addr).await.status, StatusCode::OK);
    let got = get(&client, addr).await;
    assert_eq!(got.status, StatusCode::OK, "{got:?}");
    // The date is 2 to 3 s away when read (it lost the current second's fraction).
    within(got.waited, 2 * S, 3300 * MS);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(policy.stats(), stats(2, 1));
}

#[tokio::test(start_paused = true)]
async fn grpc_pushback_is_waited() {
    let (addr, calls) = server(Policy::fixed_window(1, 2 * S).unwrap(), as_is).await;
    let policy = policy().build().unwrap();
    let client = client(&policy);
    let grpc = [("content-type", "application/grpc")];
    assert_eq!(
        call(&client, Method::GET, addr, &grpc).await.status,
        StatusCode::OK
    );
    // tollgate answers gRPC with HTTP 200, `grpc-status: 8` and `grpc-retry-pushback-ms`.
    let got = call(&client, Method::GET, addr, &grpc).await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.headers.get("grpc-status"), None, "{got:?}");
    within(got.waited, 2 * S, 2200 * MS);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(policy.stats(), stats(2, 1));
}

fn negative_pushback(headers: &mut HeaderMap) {
    if headers.contains_key("grpc-retry-pushback-ms") {
        headers.insert("grpc-retry-pushback-ms", HeaderValue::from_static("-1"));
    }
}

#[tokio::test(start_paused = true)]
async fn a_negative_pushback_stops_at_once() {
    let (addr, calls) = server(Policy::fixed_window(1, 2 * S).unwrap(), negative_pushback).await;
    let policy = policy().build().unwrap();
    let client = client(&policy);
    let grpc = [("content-type", "application/grpc")];
    call(&client, Method::GET, addr, &grpc).await;
    let got = call(&client, Method::GET, addr, &grpc).await;
    assert_eq!(got.headers.get("grpc-status").unwrap(), "8");
    assert_eq!(got.waited, Duration::ZERO);
    assert_eq!(
        got.gave_up.map(|g| (g.reason, g.attempts)),
        Some((GiveUp::Stop, 1))
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(policy.stats().gave_up_stop, 1);
}

/// Leaves only the `RateLimit` fields as the hint.
fn ratelimit_field_only(headers: &mut HeaderMap) {
    headers.remove("retry-after");
    headers.remove("x-ratelimit-reset");
}

#[tokio::test(start_paused = true)]
async fn the_ratelimit_field_when_nothing_is_left() {
    let (addr, calls) = server(
        Policy::fixed_window(1, 2 * S).unwrap(),
        ratelimit_field_only,
    )
    .await;
    let policy = policy().build().unwrap();
    let client = client(&policy);
    get(&client, addr).await;
    let got = get(&client, addr).await;
    assert_eq!(got.status, StatusCode::OK, "{got:?}");
    // `RateLimit: "all";r=0;t=2`.
    within(got.waited, 2 * S, 2200 * MS);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn a_hint_past_the_deadline_ends_at_once() {
    let (addr, calls) = server(Policy::fixed_window(1, 60 * S).unwrap(), as_is).await;
    let policy = policy().deadline(10 * S).build().unwrap();
    let client = client(&policy);
    get(&client, addr).await;
    let got = get(&client, addr).await;
    assert_eq!(got.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(got.headers.get("retry-after").unwrap(), "60");
    assert_eq!(got.waited, Duration::ZERO);
    assert_eq!(
        got.gave_up.map(|g| (g.reason, g.attempts)),
        Some((GiveUp::Deadline, 1))
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(policy.stats().gave_up_deadline, 1);
}

/// Removes every hint, so that the client backs off on its own.
fn no_hints(headers: &mut HeaderMap) {
    for name in [
        "retry-after",
        "ratelimit",
        "ratelimit-policy",
        "x-ratelimit-reset",
    ] {
        headers.remove(name);
    }
}

#[tokio::test(start_paused = true)]
async fn the_budget_runs_out() {
    // One request per hour: every request after the first is refused. 10 % of the requests,
    // no floor: a retry is paid by ten requests.
    let (addr, calls) = server(Policy::fixed_window(1, 3600 * S).unwrap(), no_hints).await;
    let budget = RetryBudget::new(10, 0, 60 * S).unwrap();
    let policy = policy().budget(budget).max_attempts(2).build().unwrap();
    let client = client(&policy);
    let mut gave_up = Vec::new();
    for _ in 0..21 {
        gave_up.push(
            get(&client, addr)
                .await
                .gave_up
                .map(|g| (g.reason, g.attempts)),
        );
    }
    assert_eq!(gave_up[0], None);
    // The 10th and 20th requests have paid for one retry each; the others find it spent.
    for (i, g) in gave_up.iter().enumerate().skip(1) {
        let expected = if (i + 1) % 10 == 0 {
            (GiveUp::Attempts, 2)
        } else {
            (GiveUp::Budget, 1)
        };
        assert_eq!(*g, Some(expected), "request {}", i + 1);
    }
    let s = policy.stats();
    assert_eq!(
        (s.requests, s.retries, s.gave_up_budget, s.gave_up_attempts),
        (21, 2, 18, 2)
    );
    let calls = calls.load(Ordering::SeqCst);
    assert_eq!(calls, 23);
    println!(
        "budget: 21 requests, {calls} calls on the server ({:.2}x)",
        calls as f64 / 21.0
    );
}

#[tokio::test(start_paused = true)]
async fn a_post_is_retried_only_with_an_idempotency_key() {
    let (addr, calls) = server(Policy::fixed_window(1, 2 * S).unwrap(), as_is).await;
    let policy = policy().build().unwrap();
    let client = client(&policy);
    assert_eq!(
        call(&client, Method::POST, addr, &[]).await.status,
        StatusCode::OK
    );
    let got = call(&client, Method::POST, addr, &[]).await;
    assert_eq!(got.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(got.waited, Duration::ZERO);
    assert_eq!(
        got.gave_up.map(|g| (g.reason, g.attempts)),
        Some((GiveUp::NotReplayable, 1))
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let key = [("idempotency-key", "order-7f3a")];
    let got = call(&client, Method::POST, addr, &key).await;
    assert_eq!(got.status, StatusCode::OK, "{got:?}");
    within(got.waited, 2 * S, 2200 * MS);
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    let s = policy.stats();
    assert_eq!((s.requests, s.retries, s.not_replayable), (3, 1, 1));
}

/// A tonic client on a channel behind the retry layer: tonic's body cannot be cloned, so the
/// layer reads the encoded message ahead and sends it again.
#[cfg(feature = "tonic")]
#[tokio::test(start_paused = true)]
async fn a_tonic_channel_is_retried_on_resource_exhausted() {
    use support::grpc::{GreeterClient, HelloRequest, channel, greeter};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let layer = limit(Policy::fixed_window(1, 2 * S).unwrap());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .layer(layer)
            .add_service(greeter())
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    // gRPC calls are POSTs: SayHello is named as safe to call twice.
    let keyed = policy()
        .idempotent_when(|_, path, _| path == "/demo.Greeter/SayHello")
        .build()
        .unwrap();
    let retrying = ServiceBuilder::new()
        .layer(RetryLayer::new(keyed.clone()))
        .service(channel(addr).await);
    let mut greeter = GreeterClient::new(retrying);
    let hello = |name: &str| HelloRequest { name: name.into() };
    assert_eq!(
        greeter
            .say_hello(hello("ada"))
            .await
            .unwrap()
            .get_ref()
            .message,
        "hello ada"
    );
    let start = Instant::now();
    let reply = greeter.say_hello(hello("grace")).await.unwrap();
    assert_eq!(reply.get_ref().message, "hello grace");
    within(start.elapsed(), 2 * S, 2200 * MS);
    assert_eq!(keyed.stats(), stats(2, 1));
    // Without the rule, a POST is not retried.
    let plain = policy().build().unwrap();
    let mut greeter = GreeterClient::new(RetryLayer::new(plain.clone()).layer(channel(addr).await));
    let refused = greeter.say_hello(hello("ada")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert_eq!(plain.stats().not_replayable, 1);
}

/// The same policy through reqwest and reqwest-middleware.
#[cfg(feature = "reqwest")]
#[tokio::test(start_paused = true)]
async fn reqwest_with_the_middleware() {
    use reqwest_middleware::ClientBuilder;
    use tollgate::client::RetryMiddleware;
    let (addr, calls) = server(Policy::fixed_window(1, 2 * S).unwrap(), as_is).await;
    let policy = policy().build().unwrap();
    let middleware = RetryMiddleware::new(policy.clone());
    let client = ClientBuilder::new(reqwest_middleware::reqwest::Client::new())
        .with(middleware.clone())
        .build();
    let url = format!("http://{addr}/");
    assert_eq!(
        client.get(&url).send().await.unwrap().status(),
        StatusCode::OK
    );
    let start = Instant::now();
    let answer = client.get(&url).send().await.unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    assert!(start.elapsed() >= 2 * S, "{:?}", start.elapsed());
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    // A POST without a key is answered as it came.
    let answer = client.post(&url).body("x").send().await.unwrap();
    assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        answer.extensions().get::<GaveUp>().map(|g| g.reason),
        Some(GiveUp::NotReplayable)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    let s = policy.stats();
    assert_eq!((s.requests, s.retries, s.not_replayable), (3, 1, 1));
    // The middleware's clones share the policy's stats.
    assert_eq!(middleware.stats(), s);
}

// ---- Simulations, in process, under paused time ----

/// Arrival times (since the start) at an in-process service.
#[derive(Clone, Default)]
struct Arrivals(Arc<Mutex<Vec<Duration>>>);

impl Arrivals {
    fn histogram(&self, bucket: Duration) -> Vec<usize> {
        let times = self.0.lock().unwrap();
        let last = times.iter().max().copied().unwrap_or_default();
        let mut buckets = vec![0; (last.as_nanos() / bucket.as_nanos()) as usize + 1];
        for t in times.iter() {
            buckets[(t.as_nanos() / bucket.as_nanos()) as usize] += 1;
        }
        buckets
    }
}

/// 200 clients, each with its own retry policy (seeded `0..200`), call at the same instant a
/// service that takes `capacity` requests per 100 ms and refuses the others with a bare 503.
/// Returns the arrival histogram of the retries (100 ms buckets) and the time the last client
/// was served.
async fn herd(jitter: Jitter, capacity: usize) -> (Vec<usize>, Duration) {
    let start = Instant::now();
    let arrivals = Arrivals::default();
    let served = Arc::new(Mutex::new((0u128, 0usize)));
    let service = {
        let arrivals = arrivals.clone();
        tower::service_fn(move |_: Request<Full<Bytes>>| {
            let now = start.elapsed();
            let mut window = served.lock().unwrap();
            let slot = now.as_millis() / 100;
            if window.0 != slot {
                *window = (slot, 0);
            }
            let status = if window.1 < capacity {
                window.1 += 1;
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            if !now.is_zero() {
                arrivals.0.lock().unwrap().push(now);
            }
            let response = Response::builder().status(status).body(String::new());
            async move { Ok::<_, Infallible>(response.unwrap()) }
        })
    };
    let mut clients = Vec::new();
    for seed in 0..200 {
        let policy = RetryPolicy::builder()
            .jitter(jitter)
            .max_attempts(20)
            .deadline(120 * S)
            .budget(RetryBudget::new(10, 10, 10 * S).unwrap())
            .seed(seed)
            .build()
            .unwrap();
        let client = RetryLayer::new(policy).layer(service.clone());
        clients.push(tokio::spawn(async move {
            let response = client
                .oneshot(Request::new(Full::new(Bytes::new())))
                .await
                .unwrap();
            (response.status(), Instant::now())
        }));
    }
    let mut done = Duration::ZERO;
    for c in clients {
        let (status, at) = c.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        done = done.max(at - start);
    }
    (arrivals.histogram(100 * MS), done)
}

#[tokio::test(start_paused = true)]
async fn the_herd_spreads_with_jitter_and_comes_back_in_waves_without() {
    // 20 per 100 ms: the service could serve all 200 in one second if they came evenly.
    let (waves, done_waves) = herd(Jitter::None, 20).await;
    let (spread, done_spread) = herd(Jitter::Full, 20).await;
    println!("herd of 200, retries per 100 ms, no jitter ({done_waves:?} to serve all): {waves:?}");
    println!(
        "herd of 200, retries per 100 ms, full jitter ({done_spread:?} to serve all): {spread:?}"
    );
    // Without jitter every refused client returns in the same bucket: waves of all that are
    // left (180, then 160, ...), with nothing between them.
    assert_eq!(waves.iter().max(), Some(&180));
    let nonempty = waves.iter().filter(|n| **n > 0).count();
    assert!(nonempty <= 9, "{nonempty} buckets");
    // With full jitter no bucket holds more than a small multiple of the average over the
    // time the herd took (the first buckets hold the most: every first retry falls within
    // the first 200 ms), and the herd is served in about twice the time the service needs.
    let average = spread.iter().sum::<usize>() as f64 / spread.len() as f64;
    let peak = *spread.iter().max().unwrap();
    println!(
        "full jitter: peak {peak}, average {average:.1} per bucket ({:.1}x)",
        peak as f64 / average
    );
    assert!(
        (peak as f64) < 6.0 * average,
        "peak {peak}, average {average}"
    );
    assert!(peak < 140, "peak {peak}");
    assert!(
        spread.iter().filter(|n| **n > 0).count() >= 15,
        "{spread:?}"
    );
    assert!(
        done_spread < 3 * S && done_waves > 30 * S,
        "{done_spread:?} {done_waves:?}"
    );
}

/// 200 clients refused at one instant with `Retry-After: 5`: the offset added to the hint
/// spreads them over half a second instead of all at 5 s.
async fn hinted_herd(spread: Duration) -> Vec<usize> {
    let start = Instant::now();
    let arrivals = Arrivals::default();
    let service = {
        let arrivals = arrivals.clone();
        tower::service_fn(move |_: Request<String>| {
            let now = start.elapsed();
            let response = if now < 5 * S {
                Response::builder()
                    .status(StatusCode::TOO_MANY_REQUESTS)
                    .header("retry-after", "5")
            } else {
                arrivals.0.lock().unwrap().push(now - 5 * S);
                Response::builder()
            };
            async move { Ok::<_, Infallible>(response.body(String::new()).unwrap()) }
        })
    };
    let mut clients = Vec::new();
    for seed in 0..200 {
        let policy = RetryPolicy::builder()
            .hint_spread(spread)
            .seed(seed)
            .build()
            .unwrap();
        let client = RetryLayer::new(policy).layer(service.clone());
        clients.push(tokio::spawn(client.oneshot(Request::new(String::new()))));
    }
    for c in clients {
        assert_eq!(c.await.unwrap().unwrap().status(), StatusCode::OK);
    }
    arrivals.histogram(100 * MS)
}

#[tokio::test(start_paused = true)]
async fn a_shared_hint_is_spread_too() {
    let exact = hinted_herd(Duration::ZERO).await;
    let spread = hinted_herd(S).await;
    println!(
        "Retry-After: 5 to 200 clients, arrivals per 100 ms after 5 s: exact {exact:?}, spread {spread:?}"
    );
    assert_eq!(exact, [200]);
    assert_eq!(
        spread.len(),
        5,
        "within half a second (a tenth of the hint)"
    );
    assert!(spread.iter().all(|n| (20..=60).contains(n)), "{spread:?}");
}

/// Three retry layers of three attempts around a service that always answers 503; 2000
/// requests, 100 per second. Returns the calls on the service per request.
async fn amplification(policy: impl Fn(u64) -> RetryPolicy) -> (f64, [RetryStats; 3]) {
    let calls = Arc::new(AtomicUsize::new(0));
    let bottom = {
        let calls = calls.clone();
        tower::service_fn(move |_: Request<String>| {
            calls.fetch_add(1, Ordering::SeqCst);
            let response = Response::builder().status(StatusCode::SERVICE_UNAVAILABLE);
            async move { Ok::<_, Infallible>(response.body(String::new()).unwrap()) }
        })
    };
    let (outer, middle, inner) = (policy(1), policy(2), policy(3));
    let stack = ServiceBuilder::new()
        .layer(RetryLayer::new(outer.clone()))
        .layer(RetryLayer::new(middle.clone()))
        .layer(RetryLayer::new(inner.clone()))
        .service(bottom);
    let mut requests = Vec::new();
    for _ in 0..2000 {
        requests.push(tokio::spawn(
            stack.clone().oneshot(Request::new(String::new())),
        ));
        tokio::time::sleep(10 * MS).await;
    }
    for r in requests {
        assert_eq!(
            r.await.unwrap().unwrap().status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
    let ratio = calls.load(Ordering::SeqCst) as f64 / 2000.0;
    (ratio, [outer.stats(), middle.stats(), inner.stats()])
}

#[tokio::test(start_paused = true)]
async fn nested_layers_with_budgets_stay_near_one_call_per_request() {
    let naive = |seed| {
        RetryPolicy::builder()
            .no_budget()
            .retry_what_inner_layers_gave_up(true)
            .seed(seed)
            .build()
            .unwrap()
    };
    let budgets_only = |seed| {
        RetryPolicy::builder()
            .retry_what_inner_layers_gave_up(true)
            .seed(seed)
            .build()
            .unwrap()
    };
    let defaults = |seed| RetryPolicy::builder().seed(seed).build().unwrap();
    let (without, _) = amplification(naive).await;
    let (budgeted, _) = amplification(budgets_only).await;
    let (with, stats) = amplification(defaults).await;
    println!(
        "three nested layers of 3 attempts on a failing service, calls per request: \
         {without:.2}x without budgets, {budgeted:.3}x with budgets that each retry, \
         {with:.3}x with budgets (the defaults: only the innermost layer retries)"
    );
    assert_eq!(without, 27.0);
    assert!(budgeted < 1.4, "{budgeted}");
    assert!(with <= 1.12, "{with}");
    // The outer layers saw answers the inner one had given up on, and passed them up.
    let [outer, middle, inner] = stats;
    assert_eq!(outer.retries + middle.retries, 0);
    assert_eq!(outer.inner_gave_up, 2000);
    assert_eq!(
        (outer.requests, middle.requests, inner.requests),
        (2000, 2000, 2000)
    );
    assert!(inner.retries > 0 && inner.gave_up_budget > 0, "{inner:?}");
}
