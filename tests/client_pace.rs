//! Pacing from the fields: a client reading the `RateLimit` fields (or the legacy trio) of a
//! real tollgate-protected axum server on loopback is never refused over ten windows and uses
//! the quota; a refusal's hint is waited out; a wait too long is answered here. The server's
//! store and the client's pacer share one manual clock, moved by the pacer's waits, so the run
//! is exact and takes no real time; the simulated servers run under tokio's paused time.

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::answer::{HeaderProfile, Refused, ResponseBody};
use tollgate::client::PaceLayer;
use tollgate::clock::{Clock, ManualClock};
use tollgate::key::Global;
use tollgate::limiter::Rule;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
use tower::{Service, ServiceBuilder, ServiceExt};

/// What a run saw.
#[derive(Debug, Default)]
struct Run {
    sent: u64,
    admitted: u64,
    refused: u64,
}

/// A pacing client against a real server limited by `policy` (named "api"), over `windows`
/// windows of `window`: requests one after another, as fast as the pacer lets them go.
async fn run(policy: Policy, profile: HeaderProfile, window: Duration, windows: u32) -> Run {
    let clock = ManualClock::new();
    let store = MemoryStore::with_clock(clock.clone());
    let limit = RateLimitLayer::builder(store)
        .rule(Rule::new("all").key(Global).policy(policy))
        .headers(profile)
        .build()
        .unwrap();
    let addr = support::serve(support::ok_app(limit)).await;
    let time = clock.clone();
    let pace = PaceLayer::builder()
        .clock(clock.clone())
        .sleeper(move |wait: Duration| {
            time.advance(wait);
            std::future::ready(())
        })
        .build();
    let hyper = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut client = ServiceBuilder::new()
        .layer(pace.clone())
        .map_response(|r: Response<hyper::body::Incoming>| r.map(ResponseBody::new))
        .service(hyper);
    let end = window * windows;
    let mut run = Run::default();
    while clock.elapsed() < end {
        let request = Request::get(format!("http://{addr}/"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let response = tokio::time::timeout(
            Duration::from_secs(30),
            client.ready().await.unwrap().call(request),
        )
        .await
        .expect("the server answers")
        .unwrap();
        // The server decided at the time the request left: past the end, it is not counted.
        if clock.elapsed() >= end {
            break;
        }
        run.sent += 1;
        match response.status() {
            StatusCode::OK => run.admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => run.refused += 1,
            other => panic!("unexpected {other}"),
        }
        response.into_body().collect().await.unwrap();
    }
    assert_eq!(pace.stats().refused, 0);
    run
}

/// N per window, fixed windows: over ten windows the client is never refused and uses at least
/// 90 % of the quota, with the IETF fields and with the legacy trio.
#[tokio::test]
async fn a_paced_client_is_never_refused_and_uses_the_quota() {
    let window = Duration::from_secs(10);
    for (n, profile) in [
        (10, HeaderProfile::Ietf),
        (10, HeaderProfile::Legacy),
        (100, HeaderProfile::Ietf),
        (7, HeaderProfile::Ietf),
    ] {
        let policy = Policy::fixed_window(n, window)
            .unwrap()
            .named("api")
            .unwrap();
        let r = run(policy, profile, window, 10).await;
        let share = r.admitted as f64 / (n * 10) as f64;
        println!(
            "fixed window, {n} per 10 s, {profile:?} fields, 10 windows: {} requests sent, {} refused, {:.1} % of the quota used",
            r.sent,
            r.refused,
            100.0 * share
        );
        assert_eq!(r.refused, 0, "{profile:?}, n = {n}");
        assert!(share >= 0.9, "{profile:?}, n = {n}: {share}");
    }
}

/// The other algorithms report in `t` the time until the quota has fully recovered: for the
/// sliding window counter up to two windows (the previous window's count weighs until the end
/// of the next), for the sliding log a window after the newest request. Pacing what remains
/// over that is never refused but uses about half of the quota; the buckets refill at their
/// rate, and pacing uses all of it (their burst on top). The figures are printed.
#[tokio::test]
async fn other_algorithms_are_never_refused() {
    let window = Duration::from_secs(10);
    let policies = [
        (
            "sliding window",
            Policy::sliding_window(10, window).unwrap(),
            0.45,
        ),
        (
            "sliding log",
            Policy::sliding_log(10, window).unwrap(),
            0.45,
        ),
        (
            "token bucket",
            Policy::token_bucket(Rate::new(10, window), 10).unwrap(),
            0.9,
        ),
        (
            "gcra",
            Policy::gcra(Rate::new(10, window), 10).unwrap(),
            0.9,
        ),
    ];
    for (name, policy, floor) in policies {
        let r = run(
            policy.named("api").unwrap(),
            HeaderProfile::Ietf,
            window,
            10,
        )
        .await;
        let share = r.admitted as f64 / 100.0;
        println!(
            "{name}, 10 per 10 s, 10 windows: {} requests sent, {} refused, {:.1} % of the quota used",
            r.sent,
            r.refused,
            100.0 * share
        );
        assert_eq!(r.refused, 0, "{name}");
        assert!(share >= floor, "{name}: {share}");
    }
}

/// A simulated server under paused time: answers as `answer` says for the n-th request, and
/// counts its calls.
fn server<F>(
    calls: Arc<AtomicU64>,
    answer: F,
) -> impl Service<
    Request<String>,
    Response = Response<String>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<String>, Infallible>> + Send,
> + Clone
+ Send
+ 'static
where
    F: Fn(u64) -> Response<String> + Clone + Send + Sync + 'static,
{
    tower::service_fn(move |_: Request<String>| {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        let response = answer(n);
        async move { Ok::<_, Infallible>(response) }
    })
}

fn response(status: u16, headers: &[(&'static str, &str)]) -> Response<String> {
    let mut r = Response::new(String::new());
    *r.status_mut() = StatusCode::from_u16(status).unwrap();
    for (k, v) in headers {
        r.headers_mut().insert(*k, v.parse().unwrap());
    }
    r
}

async fn call<S>(client: &mut S, request: Request<String>) -> Response<String>
where
    S: Service<Request<String>, Response = Response<String>, Error = Infallible>,
{
    client.ready().await.unwrap().call(request).await.unwrap()
}

fn get(uri: &str) -> Request<String> {
    Request::get(uri).body(String::new()).unwrap()
}

/// A 429 with `Retry-After`, or a gRPC `RESOURCE_EXHAUSTED` with a pushback: the next request
/// to that server leaves when the hint has passed.
#[tokio::test(start_paused = true)]
async fn a_refusal_is_waited_out() {
    let calls = Arc::new(AtomicU64::new(0));
    let mut client = ServiceBuilder::new()
        .layer(PaceLayer::new())
        .service(server(calls.clone(), |n| match n {
            0 => response(429, &[("retry-after", "3")]),
            1 => response(
                200,
                &[("grpc-status", "8"), ("grpc-retry-pushback-ms", "1500")],
            ),
            // A 200 with a Retry-After is not a refusal: nothing to wait.
            2 => response(200, &[("retry-after", "50")]),
            _ => response(200, &[]),
        }));
    let start = tokio::time::Instant::now();
    call(&mut client, get("http://a.example/")).await;
    call(&mut client, get("http://a.example/")).await;
    assert_eq!(start.elapsed(), Duration::from_secs(3));
    call(&mut client, get("http://a.example/")).await;
    assert_eq!(start.elapsed(), Duration::from_millis(4500));
    call(&mut client, get("http://a.example/")).await;
    call(&mut client, get("http://a.example/")).await;
    assert_eq!(start.elapsed(), Duration::from_millis(4500));
}

/// A departure further than `max_wait` is answered here with a 429 naming the policy and the
/// wait (gRPC: RESOURCE_EXHAUSTED with a pushback); the server is not called. Another server
/// is not held back.
#[tokio::test(start_paused = true)]
async fn a_wait_too_long_is_answered_here() {
    let calls = Arc::new(AtomicU64::new(0));
    let pace = PaceLayer::builder()
        .max_wait(Duration::from_secs(60))
        .build();
    let mut client =
        ServiceBuilder::new()
            .layer(pace.clone())
            .service(server(calls.clone(), |_| {
                response(
                    200,
                    &[
                        ("ratelimit", "\"daily\";r=0;t=3600"),
                        ("ratelimit-policy", "\"daily\";q=1000;w=86400"),
                    ],
                )
            }));
    call(&mut client, get("http://a.example/")).await;
    tokio::time::advance(Duration::from_secs(600)).await;
    let local = call(&mut client, get("http://a.example/")).await;
    assert_eq!(local.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(local.extensions().get::<Refused>().is_some());
    assert_eq!(local.headers()["retry-after"], "3000");
    let body: serde_json::Value = serde_json::from_str(local.body()).unwrap();
    assert_eq!(body["violated-policies"][0], "daily");
    let grpc = Request::post("http://a.example/svc/M")
        .header("content-type", "application/grpc")
        .body(String::new())
        .unwrap();
    let local = call(&mut client, grpc).await;
    assert_eq!(local.headers()["grpc-status"], "8");
    assert_eq!(local.headers()["grpc-retry-pushback-ms"], "3000000");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Another server leaves at once.
    let start = tokio::time::Instant::now();
    call(&mut client, get("http://b.example/")).await;
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let stats = pace.stats();
    assert_eq!((stats.requests, stats.refused, stats.delayed), (4, 2, 0));
    // Within max_wait, it waits.
    let pace = PaceLayer::builder()
        .max_wait(Duration::from_secs(3600))
        .build();
    let mut client = ServiceBuilder::new()
        .layer(pace.clone())
        .service(server(calls.clone(), |_| {
            response(200, &[("ratelimit", "\"daily\";r=0;t=3600")])
        }));
    call(&mut client, get("http://a.example/")).await;
    let start = tokio::time::Instant::now();
    call(&mut client, get("http://a.example/")).await;
    assert_eq!(start.elapsed(), Duration::from_secs(3600));
    assert_eq!(pace.stats().waited, Duration::from_secs(3600));
}

/// A server that answers `r=1` of 10 with 2 s to the reset, after `delay`, and notes when each
/// request arrived (from the start of the test, in milliseconds).
fn timed_server(
    delay: Duration,
    arrivals: Arc<parking_lot::Mutex<Vec<u128>>>,
) -> impl Service<
    Request<String>,
    Response = Response<String>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<String>, Infallible>> + Send,
> + Clone
+ Send
+ 'static {
    let start = tokio::time::Instant::now();
    tower::service_fn(move |_: Request<String>| {
        arrivals.lock().push(start.elapsed().as_millis());
        async move {
            tokio::time::sleep(delay).await;
            Ok::<_, Infallible>(response(
                200,
                &[
                    ("ratelimit", "\"p\";r=1;t=2"),
                    ("ratelimit-policy", "\"p\";q=10;w=2"),
                ],
            ))
        }
    })
}

/// Concurrent callers share what is left: the requests out are taken off what the server
/// reports, so an answer that comes while others are out does not hand their share out again.
#[tokio::test(start_paused = true)]
async fn requests_out_are_taken_off_the_remaining() {
    let arrivals = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut client = ServiceBuilder::new()
        .layer(PaceLayer::new())
        .service(timed_server(Duration::from_secs(5), arrivals.clone()));
    // Answered at 5 s: one left, 2 s to go: the next leaves 1 s later.
    call(&mut client, get("http://a.example/")).await;
    let (mut w, mut x) = (client.clone(), client.clone());
    let w = tokio::spawn(async move { call(&mut w, get("http://a.example/")).await });
    let x = tokio::spawn(async move { call(&mut x, get("http://a.example/")).await });
    // W leaves at 6 s, X at 7 s; W is answered at 11 s with one left, while X is still out:
    // nothing is left for anyone else, and the next leaves at the reset, 2 s later.
    w.await.unwrap();
    call(&mut client, get("http://a.example/")).await;
    x.await.unwrap();
    assert_eq!(*arrivals.lock(), [0, 6000, 7000, 13_000]);
}

/// A request given up while it waits for its departure no longer counts as out (its departure
/// stays reserved, so the spacing holds).
#[tokio::test(start_paused = true)]
async fn a_request_given_up_while_waiting_is_no_longer_out() {
    let arrivals = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut client = ServiceBuilder::new()
        .layer(PaceLayer::new())
        .service(timed_server(Duration::ZERO, arrivals.clone()));
    call(&mut client, get("http://a.example/")).await;
    let mut w = client.clone();
    let waiting = tokio::spawn(async move { call(&mut w, get("http://a.example/")).await });
    tokio::task::yield_now().await;
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    // X leaves after the departure W left reserved (2 s) and is answered with one left: with
    // nothing out, the next leaves 1 s later (2 s later, had W stayed counted).
    call(&mut client, get("http://a.example/")).await;
    call(&mut client, get("http://a.example/")).await;
    assert_eq!(*arrivals.lock(), [0, 2000, 3000]);
}

/// Answers made by a tollgate layer inside the pacer never reached the server: their fields
/// and hints are not read.
#[tokio::test(start_paused = true)]
async fn refusals_made_inside_are_not_read() {
    let calls = Arc::new(AtomicU64::new(0));
    let limit = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::new("one")
                .key(Global)
                .policy(Policy::fixed_window(1, Duration::from_secs(3600)).unwrap()),
        )
        // Its admissions carry no fields (they would be read: they are the limiter's word).
        .headers(HeaderProfile::Off)
        .build()
        .unwrap();
    let pace = PaceLayer::builder()
        .max_wait(Duration::from_secs(1))
        .build();
    let mut client = ServiceBuilder::new()
        .layer(pace.clone())
        .layer(limit)
        .service(server(calls.clone(), |_| response(200, &[])));
    let start = tokio::time::Instant::now();
    assert_eq!(
        call(&mut client, get("http://a.example/")).await.status(),
        StatusCode::OK
    );
    for _ in 0..3 {
        let r = call(&mut client, get("http://a.example/")).await;
        // The inner limiter's own 429 (Retry-After 3600), passed on; not a gate here.
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()["retry-after"], "3600");
    }
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(pace.stats().refused, 0);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// The servers remembered are bounded: the one idle longest is forgotten, with what it said.
#[tokio::test(start_paused = true)]
async fn the_servers_remembered_are_bounded() {
    let calls = Arc::new(AtomicU64::new(0));
    let pace = PaceLayer::builder().max_servers(1).build();
    let mut client = ServiceBuilder::new()
        .layer(pace.clone())
        .service(server(calls.clone(), |_| {
            response(429, &[("retry-after", "5")])
        }));
    call(&mut client, get("http://a.example/")).await;
    tokio::time::advance(Duration::from_millis(10)).await;
    call(&mut client, get("http://b.example/")).await;
    // a.example was forgotten: its gate with it.
    let start = tokio::time::Instant::now();
    call(&mut client, get("http://a.example/")).await;
    assert_eq!(start.elapsed(), Duration::ZERO);
    // The host header names the server when the URI does not.
    let with_host = |host: &str| {
        Request::get("/")
            .header("host", host)
            .body(String::new())
            .unwrap()
    };
    call(&mut client, with_host("c.example")).await;
    let start = tokio::time::Instant::now();
    call(&mut client, with_host("C.example")).await;
    assert_eq!(start.elapsed(), Duration::from_secs(5));
    assert!(format!("{pace:?}").contains("max_wait"));
}

/// The default clock follows tokio's paused time, and a request never waits on real time.
#[tokio::test(start_paused = true)]
async fn the_default_clock_and_sleeper_are_tokios() {
    let clock = tollgate::clock::TokioClock::new();
    let calls = Arc::new(AtomicU64::new(0));
    let mut client = ServiceBuilder::new()
        .layer(PaceLayer::default())
        .service(server(calls.clone(), |_| {
            response(
                200,
                &[
                    ("x-ratelimit-limit", "100"),
                    ("x-ratelimit-remaining", "9"),
                    ("x-ratelimit-reset", "30"),
                ],
            )
        }));
    for _ in 0..4 {
        call(&mut client, get("http://a.example/")).await;
    }
    // 9 left of 100, 30 s: 3 s apart.
    assert_eq!(clock.now(), 9_000_000_000);
}

/// What the pacer's builder and futures show when printed.
#[tokio::test(start_paused = true)]
async fn the_builder_and_the_future_print() {
    let builder = PaceLayer::builder()
        .max_wait(Duration::from_secs(5))
        .max_servers(7);
    let shown = format!("{builder:?}");
    assert!(shown.starts_with("PaceLayerBuilder {"), "{shown}");
    assert!(
        shown.contains("max_wait: 5s") && shown.contains("max_servers: 7"),
        "{shown}"
    );
    let pace = builder.build();
    assert!(format!("{pace:?}").contains("max_wait: 5s"));
    let calls = Arc::new(AtomicU64::new(0));
    let mut client = ServiceBuilder::new()
        .layer(pace)
        .service(server(calls, |_| response(200, &[])));
    let future = client.ready().await.unwrap().call(get("http://a.example/"));
    assert_eq!(format!("{future:?}"), "ResponseFuture { .. }");
    assert_eq!(future.await.unwrap().status(), StatusCode::OK);
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

/// The pacer's readiness is its inner service's, and the service prints its inner one.
#[tokio::test(start_paused = true)]
async fn readiness_is_the_inner_services() {
    use tower::Layer;
    let mut pace = PaceLayer::new().layer(Busy);
    assert_eq!(format!("{pace:?}"), "Pace { inner: Busy, .. }");
    assert!(matches!(pace.get_ref(), Busy));
    assert_eq!(pace.ready().await.unwrap_err(), "busy");
}

/// Issue 24, 3: a 429 whose exhausted quota resets in a day closed the gate for a minute, but
/// also set that quota's next departure a day ahead, so every later request was refused here
/// and the server never asked again (23 h later: still refused). It holds the server back a
/// minute at most, as the docs promise; the local refusals meanwhile name the quota.
#[tokio::test(start_paused = true)]
async fn a_refusals_daily_quota_holds_the_server_back_a_minute_at_most() {
    let calls = Arc::new(AtomicU64::new(0));
    let pace = PaceLayer::builder()
        .max_wait(Duration::from_secs(10))
        .build();
    let mut client =
        ServiceBuilder::new()
            .layer(pace.clone())
            .service(server(calls.clone(), |n| match n {
                0 => response(429, &[("ratelimit", "\"daily\";r=0;t=86400")]),
                _ => response(200, &[]),
            }));
    assert_eq!(
        call(&mut client, get("http://a.example/")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Within the minute: refused here, naming the server's policy.
    let local = call(&mut client, get("http://a.example/")).await;
    assert!(local.extensions().get::<Refused>().is_some());
    assert_eq!(local.headers()["retry-after"], "60");
    let body: serde_json::Value = serde_json::from_str(local.body()).unwrap();
    assert_eq!(body["violated-policies"][0], "daily");
    // After it, the server is asked again.
    tokio::time::advance(Duration::from_secs(60)).await;
    let again = call(&mut client, get("http://a.example/")).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert!(again.extensions().get::<Refused>().is_none());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    tokio::time::advance(Duration::from_secs(23 * 3600)).await;
    assert_eq!(
        call(&mut client, get("http://a.example/")).await.status(),
        StatusCode::OK
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

/// A refusal that also says "do not retry" (`grpc-retry-pushback-ms` that is negative or
/// malformed) is still a refusal: its daily quota holds the server back a minute at most (it
/// was taken as a 200's and closed the server for a day).
#[tokio::test(start_paused = true)]
async fn a_refusal_that_says_stop_holds_the_server_back_a_minute_at_most() {
    let calls = Arc::new(AtomicU64::new(0));
    let pace = PaceLayer::builder()
        .max_wait(Duration::from_secs(10))
        .build();
    let mut client =
        ServiceBuilder::new()
            .layer(pace.clone())
            .service(server(calls.clone(), |n| match n {
                0 => response(
                    429,
                    &[
                        ("ratelimit", "\"daily\";r=0;t=86400"),
                        ("grpc-retry-pushback-ms", "-1"),
                    ],
                ),
                _ => response(200, &[]),
            }));
    assert_eq!(
        call(&mut client, get("http://a.example/")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    tokio::time::advance(Duration::from_secs(61)).await;
    let again = call(&mut client, get("http://a.example/")).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// Issue 21, 2: a local refusal while a server's refusal holds the gate names the policy the
/// server's `RateLimit` field found exhausted, as every tollgate refusal names its policy (the
/// problem body's `violated-policies`, gRPC's `grpc-message`); a refusal that named none
/// names none.
#[tokio::test(start_paused = true)]
async fn a_local_refusal_names_the_servers_policy() {
    let calls = Arc::new(AtomicU64::new(0));
    let pace = PaceLayer::builder().max_wait(Duration::ZERO).build();
    let mut client =
        ServiceBuilder::new()
            .layer(pace.clone())
            .service(server(calls.clone(), |n| match n {
                0 => response(
                    429,
                    &[
                        ("retry-after", "5"),
                        ("ratelimit", "\"burst\";r=0;t=5, \"daily\";r=70;t=4000"),
                    ],
                ),
                1 => response(429, &[("retry-after", "5")]),
                _ => response(200, &[]),
            }));
    call(&mut client, get("http://a.example/")).await;
    let local = call(&mut client, get("http://a.example/")).await;
    assert!(local.extensions().get::<Refused>().is_some());
    let body: serde_json::Value = serde_json::from_str(local.body()).unwrap();
    assert_eq!(body["violated-policies"][0], "burst");
    assert!(body["detail"].as_str().unwrap().contains("\"burst\""));
    let grpc = Request::post("http://a.example/svc/M")
        .header("content-type", "application/grpc")
        .body(String::new())
        .unwrap();
    let local = call(&mut client, grpc).await;
    assert_eq!(local.headers()["grpc-status"], "8");
    let message = local.headers()["grpc-message"].to_str().unwrap();
    assert!(message.contains("burst"), "{message}");
    // A refusal with only Retry-After names no policy.
    tokio::time::advance(Duration::from_secs(5)).await;
    call(&mut client, get("http://a.example/")).await;
    let local = call(&mut client, get("http://a.example/")).await;
    assert!(local.extensions().get::<Refused>().is_some());
    let body: serde_json::Value = serde_json::from_str(local.body()).unwrap();
    assert_eq!(body["violated-policies"][0], "");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// Issue 24, 1: a plain 200 with `X-RateLimit-Remaining` and an `X-RateLimit-Reset` past what
/// `SystemTime` holds panicked the caller's task; it reads as the longest hint.
#[tokio::test(start_paused = true)]
async fn a_reset_past_the_end_of_time_does_not_panic() {
    let calls = Arc::new(AtomicU64::new(0));
    let pace = PaceLayer::builder()
        .max_wait(Duration::from_secs(1))
        .build();
    let mut client =
        ServiceBuilder::new()
            .layer(pace.clone())
            .service(server(calls.clone(), |_| {
                response(
                    200,
                    &[
                        ("x-ratelimit-remaining", "0"),
                        ("x-ratelimit-reset", "9223372036854775808"),
                    ],
                )
            }));
    assert_eq!(
        call(&mut client, get("http://a.example/")).await.status(),
        StatusCode::OK
    );
    // Nothing left until the reset, read as a day: refused here.
    let local = call(&mut client, get("http://a.example/")).await;
    assert_eq!(local.headers()["retry-after"], "86400");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
