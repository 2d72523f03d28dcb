//! The shaper: requests leave at a constant rate, delays are exactly k/r, the wait is bounded,
//! and two shapers sharing one Redis keep one rate. In process under paused tokio time.

mod support;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::request::Parts;
use http::{Request, Response, StatusCode};
use tokio::time::Instant;
use tollgate::clock::{ManualClock, TokioClock};
use tollgate::key::{Global, Header};
use tollgate::limiter::Rule;
use tollgate::shape::ShapeError;
use tollgate::{Decision, MemoryStore, Rate, ShapeLayer, Store};
use tower::{Layer, ServiceExt};

const MS: u64 = 1_000_000;

/// A service that notes when each request reaches it (nanoseconds after `start`).
fn recorder(
    start: Instant,
    seen: Arc<Mutex<Vec<u64>>>,
) -> impl tower::Service<
    Request<String>,
    Response = Response<String>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<String>, Infallible>> + Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |_: Request<String>| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(start.elapsed().as_nanos() as u64);
            Ok(Response::new(String::new()))
        }
    })
}

fn shaper<St: Store>(store: St, rate: Rate, queue: u64) -> ShapeLayer<St> {
    ShapeLayer::builder(store)
        .rule(Rule::new("upstream").key(Global), rate, queue)
        .build()
        .unwrap()
}

/// The most of `times` (sorted) inside any `[t, t + span)`.
fn most_in_any(times: &[u64], span: u64) -> usize {
    let mut end = 0;
    let mut best = 0;
    for (start, &t) in times.iter().enumerate() {
        while end < times.len() && times[end] < t + span {
            end += 1;
        }
        best = best.max(end - start);
    }
    best
}

/// The reference burst experiment's leaky-queue row, through the real layer: of its 80
/// arrivals (10 at the rate, a burst of 20, then 50 at twice the rate), a queue of 10 leaving
/// at 10 per second accepts 30, and never more than 10 leave in any second.
#[tokio::test(start_paused = true)]
async fn the_reference_burst_through_the_layer() {
    let steady = (0..10).map(|i| 50 * MS + i * 100 * MS);
    let burst = (0..20).map(|i| 1_000 * MS + i * 5 * MS);
    let pressure = (0..50).map(|i| 1_100 * MS + i * 20 * MS);
    let trace: Vec<u64> = steady.chain(burst).chain(pressure).collect();

    let layer = shaper(
        MemoryStore::with_clock(TokioClock::new()),
        Rate::per_second(10),
        10,
    );
    let start = Instant::now();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let service = layer.layer(recorder(start, seen.clone()));
    let mut answers = Vec::new();
    for &at in &trace {
        tokio::time::sleep_until(start + Duration::from_nanos(at)).await;
        answers.push(tokio::spawn(
            service.clone().oneshot(Request::new(String::new())),
        ));
    }
    let mut accepted = 0;
    for answer in answers {
        accepted += usize::from(answer.await.unwrap().unwrap().status() == StatusCode::OK);
    }
    let mut left = seen.lock().unwrap().clone();
    left.sort_unstable();
    assert_eq!(accepted, 30);
    assert_eq!(left.len(), 30);
    assert_eq!(most_in_any(&left, 1_000 * MS), 10);
    // Each leaves one interval after the one before it, or after arriving at an empty queue.
    let mut expected = Vec::new();
    let mut last = 0u64;
    let mut waiting: std::collections::VecDeque<u64> = Default::default();
    for &at in &trace {
        while waiting.front().is_some_and(|&leaves| leaves <= at) {
            waiting.pop_front();
        }
        if waiting.len() < 10 {
            last = last.max(at) + 100 * MS;
            waiting.push_back(last);
            expected.push(last);
        }
    }
    assert_eq!(left, expected);
}

/// The request with k - 1 ahead of it leaves k / r after arriving; past the queue, a request
/// is refused at once with the exact time until it would fit.
#[tokio::test(start_paused = true)]
async fn delays_are_k_over_r_and_the_wait_is_bounded() {
    let layer = shaper(
        MemoryStore::with_clock(TokioClock::new()),
        Rate::per_second(4),
        3,
    );
    let start = Instant::now();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let service = layer.layer(recorder(start, seen.clone()));
    let answers: Vec<_> = (0..5)
        .map(|_| tokio::spawn(service.clone().oneshot(Request::new(String::new()))))
        .collect();
    let mut statuses = Vec::new();
    let mut retry = Vec::new();
    for answer in answers {
        let response = answer.await.unwrap().unwrap();
        statuses.push(response.status().as_u16());
        retry.push(
            response
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_owned()),
        );
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    assert_eq!(*seen.lock().unwrap(), [250 * MS, 500 * MS, 750 * MS]);
    // The fourth would have waited 1 s with 750 ms allowed: it fits 250 ms later.
    assert_eq!(retry[3].as_deref(), Some("1"));
    // Refused at once: they never waited.
    assert!(start.elapsed() >= Duration::from_millis(750));
    // After the queue drains, one waits one interval again.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = Instant::now();
    service
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(before.elapsed(), Duration::from_millis(250));
}

/// Each key has its own queue; a request's cost takes that many places; a request dropped
/// while it waits never reaches the service.
#[tokio::test(start_paused = true)]
async fn keys_costs_and_cancellation() {
    let layer = ShapeLayer::builder(MemoryStore::with_clock(TokioClock::new()))
        .rule(
            Rule::new("api")
                .key(Header::from_static("x-key"))
                .cost_fn(|p: &Parts| {
                    p.headers
                        .get("x-units")
                        .map_or(1, |v| v.to_str().unwrap().parse().unwrap())
                }),
            Rate::per_second(10),
            10,
        )
        .build()
        .unwrap();
    let start = Instant::now();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let service = layer.layer(recorder(start, seen.clone()));
    let request = |key: &str, units: u64| {
        Request::get("/")
            .header("x-key", key)
            .header("x-units", units.to_string())
            .body(String::new())
            .unwrap()
    };
    // Five units for a: it leaves after 500 ms; b has a queue of its own.
    let a = tokio::spawn(service.clone().oneshot(request("a", 5)));
    let b = tokio::spawn(service.clone().oneshot(request("b", 1)));
    a.await.unwrap().unwrap();
    b.await.unwrap().unwrap();
    let mut left = seen.lock().unwrap().clone();
    left.sort_unstable();
    assert_eq!(left, [100 * MS, 500 * MS]);
    // Dropped while it waits: the service never sees it.
    let waiting = service.clone().oneshot(request("c", 1));
    let timed_out = tokio::time::timeout(Duration::from_millis(50), waiting).await;
    assert!(timed_out.is_err());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(seen.lock().unwrap().len(), 2);
}

#[test]
fn bad_configuration() {
    let b = || ShapeLayer::builder(MemoryStore::new());
    assert_eq!(b().build().unwrap_err(), ShapeError::NoRule);
    assert!(matches!(
        b().rule(Rule::new("a"), Rate::per_second(0), 1).build(),
        Err(ShapeError::Policy { .. })
    ));
    assert!(matches!(
        b().rule(Rule::new("a"), Rate::per_second(1), 0).build(),
        Err(ShapeError::Policy { .. })
    ));
    assert!(matches!(
        b().rule(Rule::new("a"), Rate::per_second(1), 1)
            .rule(Rule::new("a"), Rate::per_second(1), 1)
            .build(),
        Err(ShapeError::DuplicateRule(_))
    ));
    let short = MemoryStore::builder().max_key_len(10).build();
    assert!(matches!(
        ShapeLayer::builder(short)
            .rule(Rule::new("a"), Rate::per_second(1), 1)
            .build(),
        Err(ShapeError::StoreKeyTooShort { max: 10 })
    ));
}

/// Two shapers on one Redis (two connections, as two instances would have) share one queue:
/// every departure slot is taken once, one interval apart, and what does not fit is refused.
/// Redis's clock is pinned by a manual clock, so the slots do not depend on when the commands
/// arrive; the requests really wait for their slots (at most 100 ms).
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shapers_on_one_redis_keep_one_rate() {
    use tollgate::RedisStore;
    let Some(server) = support::RedisServer::start() else {
        return;
    };
    let clock = ManualClock::new();
    let connect = || async {
        RedisStore::builder()
            .url(server.url())
            .injected_clock(clock.clone())
            .timeout(Duration::from_secs(5))
            .connect()
            .await
            .unwrap()
    };
    let slots = Arc::new(Mutex::new(Vec::new()));
    let service = || {
        let slots = slots.clone();
        tower::service_fn(move |r: Request<String>| {
            let slots = slots.clone();
            async move {
                let decision = *r.extensions().get::<Decision>().unwrap();
                slots
                    .lock()
                    .unwrap()
                    .push(decision.reset_after().as_millis());
                Ok::<_, Infallible>(Response::new(String::new()))
            }
        })
    };
    let one = shaper(connect().await, Rate::per_second(100), 10).layer(service());
    let two = shaper(connect().await, Rate::per_second(100), 10).layer(service());
    let mut answers = Vec::new();
    for i in 0..30 {
        let service = if i % 2 == 0 { one.clone() } else { two.clone() };
        answers.push(tokio::spawn(async move {
            service
                .oneshot(Request::new(String::new()))
                .await
                .unwrap()
                .status()
        }));
    }
    let mut accepted = 0;
    for answer in answers {
        accepted += usize::from(answer.await.unwrap() == StatusCode::OK);
    }
    let mut taken = slots.lock().unwrap().clone();
    taken.sort_unstable();
    assert_eq!(accepted, 10);
    assert_eq!(taken, (1..=10).map(|k| k * 10).collect::<Vec<u128>>());
}

/// A request waiting for its slot holds no place of the inner service: around a concurrency
/// limit of one, another request goes through at once.
#[tokio::test(start_paused = true)]
async fn a_waiting_request_holds_no_place_inside() {
    let layer = ShapeLayer::builder(MemoryStore::with_clock(TokioClock::new()))
        .rule(
            Rule::new("slow").path("/slow").key(Global),
            Rate::per_second(1),
            5,
        )
        .build()
        .unwrap();
    let start = Instant::now();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let service = tower::ServiceBuilder::new()
        .layer(layer)
        .concurrency_limit(1)
        .service(recorder(start, seen.clone()));
    let get = |path: &str| Request::get(path).body(String::new()).unwrap();
    let slow = tokio::spawn(service.clone().oneshot(get("/slow")));
    tokio::task::yield_now().await;
    let fast = service.clone().oneshot(get("/fast")).await.unwrap();
    assert_eq!(fast.status(), StatusCode::OK);
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "the fast request did not wait"
    );
    assert_eq!(slow.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(*seen.lock().unwrap(), [0, 1_000 * MS]);
}

/// A cost above the queue can never fit: such a request is refused at once, and cheaper ones
/// still leave at the rate. Before the fix the cost was cut to the queue's size, so cost-5
/// requests through 10 per second with a queue of 2 left every 200 ms: 25 units a second.
#[tokio::test(start_paused = true)]
async fn a_cost_above_the_queue_is_refused_not_cut() {
    let shape = ShapeLayer::builder(MemoryStore::with_clock(TokioClock::new()))
        .rule(
            Rule::new("upstream").key(Global).cost_fn(|parts: &Parts| {
                parts
                    .headers
                    .get("x-cost")
                    .map_or(1, |v| v.to_str().unwrap().parse().unwrap())
            }),
            Rate::per_second(10),
            2,
        )
        .build()
        .unwrap();
    let start = Instant::now();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let service = shape.layer(recorder(start, seen.clone()));
    let costly = |cost: &str| {
        Request::get("/")
            .header("x-cost", cost)
            .body(String::new())
            .unwrap()
    };
    for _ in 0..10 {
        let refused = service.clone().oneshot(costly("5")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(refused.headers().get("retry-after").is_none());
        // Nor does its body tell the client to come back: it never fits.
        let body = http_body_util::BodyExt::collect(refused.into_body())
            .await
            .unwrap()
            .to_bytes();
        let body = String::from_utf8_lossy(&body);
        assert!(body.contains("can never be admitted"), "{body}");
        assert!(
            !body.contains("retry-after") && !body.contains("Retry in"),
            "{body}"
        );
    }
    assert_eq!(start.elapsed(), Duration::ZERO, "refused at once");
    assert!(seen.lock().unwrap().is_empty(), "none reached the service");
    // A cost of 2 fits (the whole queue): it leaves after its whole cost.
    let fits = service.clone().oneshot(costly("2")).await.unwrap();
    assert_eq!(fits.status(), StatusCode::OK);
    assert_eq!(start.elapsed(), Duration::from_millis(200));
}

/// The 429 body states a bucket's rate and burst exactly: a shaper of 10 per second with a
/// queue of 2 allows 2 per 200 ms, 10 a second (it used to say "2 per 1 s", rounding the
/// window up to whole seconds).
#[tokio::test(start_paused = true)]
async fn the_refusal_states_the_rate_and_the_burst() {
    let shape = shaper(
        MemoryStore::with_clock(TokioClock::new()),
        Rate::per_second(10),
        2,
    );
    let service = shape.layer(recorder(Instant::now(), Arc::new(Mutex::new(Vec::new()))));
    let mut waiting = Vec::new();
    for _ in 0..2 {
        waiting.push(tokio::spawn(
            service.clone().oneshot(Request::new(String::new())),
        ));
    }
    tokio::task::yield_now().await;
    let refused = service
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = http_body_util::BodyExt::collect(refused.into_body())
        .await
        .unwrap()
        .to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        problem["detail"].as_str().unwrap(),
        "Policy \"upstream\" allows 2 per 200 ms (10 per second, in bursts of up to 2); this \
         request would exceed it. Retry in 1 s."
    );
    for w in waiting {
        assert_eq!(w.await.unwrap().unwrap().status(), StatusCode::OK);
    }
}
