//! The concurrency limit: a permit per request, held until the response body ends, given back
//! on every path (completion, error, panic, cancellation), and Little's law under a slowdown.
//! Paused tokio time and simulated services only: no real sleeps.

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use tollgate::ConcurrencyLimitLayer;
use tollgate::clock::TokioClock;
use tollgate::concurrency::ConcurrencyError;
use tollgate::key::{Global, Header};
use tollgate::limiter::{MissingKey, Rule};
use tower::{Layer, Service, ServiceExt};

type TestBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// A body of `n` data frames.
struct Frames(u8);

impl Body for Frames {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.0 == 0 {
            return Poll::Ready(None);
        }
        self.0 -= 1;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"chunk")))))
    }
}

fn frames(n: u8) -> TestBody {
    Frames(n).boxed_unsync()
}

/// The panics these tests cause on purpose print nothing; any other still does.
fn quiet_expected_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .copied()
            .unwrap_or_default();
        if !message.contains("panic") {
            default(info);
        }
    }));
}

fn request(user: &str, path: &str) -> Request<String> {
    Request::get(path)
        .header("x-user", user)
        .body(String::new())
        .unwrap()
}

fn per_user(max: u32) -> ConcurrencyLimitLayer {
    ConcurrencyLimitLayer::builder()
        .rule(
            Rule::new("per-user").key(Header::from_static("x-user")),
            max,
        )
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn the_permit_lives_until_the_body_ends() {
    let limits = per_user(1);
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(3)))
    }));
    let response = service.clone().oneshot(request("a", "/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // The handler has returned; the body has not been sent: still in flight.
    assert_eq!(limits.in_flight("per-user", "a"), 1);
    let refused = service.clone().oneshot(request("a", "/")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let mut body = response.into_body();
    for _ in 0..3 {
        assert!(body.frame().await.is_some());
        assert_eq!(limits.in_flight("per-user", "a"), 1, "until the last byte");
    }
    assert!(body.frame().await.is_none());
    assert!(!body.holds_permit());
    assert_eq!(limits.in_flight("per-user", "a"), 0);
    assert_eq!(limits.tracked_keys(), 0);
}

#[tokio::test(start_paused = true)]
async fn cancellation_errors_and_panics_give_the_permit_back() {
    quiet_expected_panics();
    let limits = per_user(1);
    let service = limits.layer(tower::service_fn(|r: Request<String>| {
        if r.uri().path() == "/panic-in-call" {
            panic!("the inner service panicked in call");
        }
        async move {
            match r.uri().path() {
                "/slow" => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Ok(Response::new(frames(1)))
                }
                "/error" => Err(std::io::Error::other("inner failure")),
                "/panic" => panic!("the inner service panicked"),
                _ => Ok(Response::new(frames(1))),
            }
        }
    }));
    // Cancelled: the client went away before the answer.
    let mut slow = service.clone();
    let pending = slow.call(request("a", "/slow"));
    assert_eq!(limits.in_flight("per-user", "a"), 1);
    drop(pending);
    assert_eq!(limits.in_flight("per-user", "a"), 0);
    // A timeout around it.
    let timed_out = tokio::time::timeout(
        Duration::from_secs(1),
        service.clone().oneshot(request("a", "/slow")),
    )
    .await;
    assert!(timed_out.is_err());
    assert_eq!(limits.in_flight("per-user", "a"), 0);
    // An error.
    assert!(
        service
            .clone()
            .oneshot(request("a", "/error"))
            .await
            .is_err()
    );
    assert_eq!(limits.in_flight("per-user", "a"), 0);
    // A panic while polled, on a task of its own.
    let task = tokio::spawn(service.clone().oneshot(request("a", "/panic")));
    assert!(task.await.unwrap_err().is_panic());
    assert_eq!(limits.in_flight("per-user", "a"), 0);
    // A panic inside `call` itself.
    let mut s = service.clone();
    let called = std::panic::catch_unwind(AssertUnwindSafe(|| {
        drop(s.call(request("a", "/panic-in-call")));
    }));
    assert!(called.is_err());
    assert_eq!(limits.in_flight("per-user", "a"), 0);
    assert_eq!(limits.tracked_keys(), 0);
    // And the key works as before.
    let ok = service.clone().oneshot(request("a", "/")).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
}

/// A small deterministic generator (xorshift64*), so a failure replays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

/// 10,000 random steps of starting, finishing, cancelling and panicking requests and of
/// reading and dropping bodies: after every step the places held equal the admitted requests
/// still alive, no limit is ever passed, and at the end every count is back at zero.
#[tokio::test(start_paused = true)]
async fn random_mixes_leave_every_count_at_zero() {
    quiet_expected_panics();
    let limits = ConcurrencyLimitLayer::builder()
        .rule(Rule::new("per-user").key(Header::from_static("x-user")), 3)
        .rule(Rule::new("exports").path_prefix("/export").key(Global), 4)
        .total(8)
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|r: Request<String>| {
        let outcome = r.headers()["x-outcome"].to_str().unwrap().to_owned();
        if outcome == "panic-in-call" {
            panic!("panic in call");
        }
        async move {
            match outcome.as_str() {
                "error" => Err(std::io::Error::other("failed")),
                "panic" => panic!("panic while polled"),
                "slow" => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok(Response::new(frames(2)))
                }
                "hang" => std::future::pending().await,
                _ => Ok(Response::new(frames(3))),
            }
        }
    }));
    type Pending = Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<
                        Response<tollgate::concurrency::PermitBody<TestBody>>,
                        std::io::Error,
                    >,
                > + Send,
        >,
    >;
    let mut futures: Vec<(Pending, bool)> = Vec::new();
    let mut bodies: Vec<tollgate::concurrency::PermitBody<TestBody>> = Vec::new();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let users = ["u0", "u1", "u2", "u3"];
    let outcomes = [
        "ok",
        "ok",
        "ok",
        "slow",
        "error",
        "panic",
        "hang",
        "panic-in-call",
    ];
    let (mut admitted, mut refused) = (0, 0);
    for step in 0..10_000 {
        match rng.below(6) {
            0 | 1 => {
                let path = if rng.below(2) == 0 { "/export/x" } else { "/" };
                let mut r = request(users[rng.below(users.len())], path);
                let outcome = outcomes[rng.below(outcomes.len())];
                r.headers_mut()
                    .insert("x-outcome", outcome.parse().unwrap());
                let before = limits.total_in_flight();
                let mut s = service.clone();
                let called = std::panic::catch_unwind(AssertUnwindSafe(|| s.call(r)));
                if let Ok(future) = called {
                    let took = limits.total_in_flight() > before;
                    admitted += usize::from(took);
                    refused += usize::from(!took);
                    futures.push((Box::pin(future), took));
                }
            }
            2 if !futures.is_empty() => {
                // Run one to its end (or cancel it after a while: a hanging one).
                let (future, _) = futures.swap_remove(rng.below(futures.len()));
                let mut task = tokio::spawn(future);
                match tokio::time::timeout(Duration::from_secs(1), &mut task).await {
                    Ok(Ok(Ok(response))) => bodies.push(response.into_body()),
                    Ok(_) => {} // an error, or a panic on the task
                    Err(_) => {
                        // It hangs: cancel it, as a timeout layer would.
                        task.abort();
                        assert!(task.await.unwrap_err().is_cancelled());
                    }
                }
            }
            3 if !futures.is_empty() => drop(futures.swap_remove(rng.below(futures.len()))),
            4 if !bodies.is_empty() => {
                let i = rng.below(bodies.len());
                if bodies[i].frame().await.is_none() {
                    bodies.swap_remove(i);
                }
            }
            5 if !bodies.is_empty() => drop(bodies.swap_remove(rng.below(bodies.len()))),
            _ => {}
        }
        let live = futures.iter().filter(|(_, took)| *took).count()
            + bodies.iter().filter(|b| b.holds_permit()).count();
        let held = limits.total_in_flight() as usize;
        assert_eq!(held, live, "step {step}: places held and requests alive");
        assert!(held <= 8, "step {step}: total cap passed");
        for u in users {
            assert!(limits.in_flight("per-user", u) <= 3, "step {step}");
        }
        assert!(limits.in_flight("exports", "") <= 4, "step {step}");
    }
    assert!(
        admitted > 1_000 && refused > 100,
        "{admitted} admitted, {refused} refused"
    );
    drop(futures);
    drop(bodies);
    assert_eq!(limits.total_in_flight(), 0);
    assert_eq!(limits.tracked_keys(), 0);
    for u in users {
        assert_eq!(limits.in_flight("per-user", u), 0);
    }
}

/// Arrivals at 200/s for `seconds` to a service that takes `latency`, through a total cap of
/// `cap`: the most requests the service itself ever had in flight, and how many it served.
async fn drive(cap: u32, latency: Duration, seconds: u64) -> (u64, u64) {
    let limits = ConcurrencyLimitLayer::builder().total(cap).build().unwrap();
    let inside = Arc::new(AtomicU64::new(0));
    let peak = Arc::new(AtomicU64::new(0));
    let served = Arc::new(AtomicU64::new(0));
    let service = {
        let (inside, peak) = (inside.clone(), peak.clone());
        limits.layer(tower::service_fn(move |_: Request<String>| {
            let (inside, peak) = (inside.clone(), peak.clone());
            async move {
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(latency).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, Infallible>(Response::new(frames(1)))
            }
        }))
    };
    let mut tasks = Vec::new();
    for _ in 0..200 * seconds {
        let (service, served) = (service.clone(), served.clone());
        tasks.push(tokio::spawn(async move {
            let response = service.oneshot(request("any", "/")).await.unwrap();
            if response.status() == StatusCode::OK {
                served.fetch_add(1, Ordering::SeqCst);
            }
            let _ = response.into_body().collect().await;
        }));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(limits.total_in_flight(), 0);
    (peak.load(Ordering::SeqCst), served.load(Ordering::SeqCst))
}

/// Little's law: at 200/s and 250 ms about 50 requests are in flight. When the service slows
/// 20x (5 s), the same arrivals mean about 1,000 in flight without a limit; with a cap of 60,
/// in flight stays at 60 and what is served falls in proportion, to about 60 / 5 s = 12/s.
#[tokio::test(start_paused = true)]
async fn littles_law_under_a_20x_slowdown() {
    let (peak, served) = drive(60, Duration::from_millis(250), 10).await;
    assert!((45..=60).contains(&peak), "healthy: {peak} in flight");
    assert_eq!(served, 2_000, "healthy: everything is served");

    let (peak, served) = drive(u32::MAX, Duration::from_secs(5), 10).await;
    assert!(peak >= 990, "slow, unlimited: {peak} in flight");

    let (peak, served_limited) = drive(60, Duration::from_secs(5), 10).await;
    assert_eq!(peak, 60, "slow, limited: in flight is bounded");
    // 10 s of arrivals plus the last 5 s: at most 60 every 5 s, three rounds at most.
    assert!(
        (120..=180).contains(&served_limited),
        "slow, limited: {served_limited} served (unlimited: {served})"
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_total_cap_is_503_and_grpc_gets_its_codes() {
    let limits = ConcurrencyLimitLayer::builder()
        .rule(Rule::new("per-user").key(Header::from_static("x-user")), 1)
        .total(2)
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let a = service.clone().oneshot(request("a", "/")).await.unwrap();
    let b = service.clone().oneshot(request("b", "/")).await.unwrap();
    let c = service.clone().oneshot(request("c", "/")).await.unwrap();
    assert_eq!(c.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(c.headers()["retry-after"], "1");
    assert_eq!(c.headers()["cache-control"], "no-store");
    assert_eq!(c.headers()["content-type"], "application/problem+json");
    // Refused by the total cap: c took no per-user place.
    assert_eq!(limits.in_flight("per-user", "c"), 0);
    // Over the per-user limit: 429 with the problem type of its own.
    let again = service.clone().oneshot(request("a", "/")).await.unwrap();
    assert_eq!(again.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = again.into_body().collect().await.unwrap().to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], tollgate::answer::TOO_MANY_IN_FLIGHT_TYPE);
    assert_eq!(problem["status"], 429);
    assert_eq!(problem["retry-after"], 1);
    // gRPC: RESOURCE_EXHAUSTED for a key at its limit, UNAVAILABLE for the cap, with pushback.
    let grpc = |user: &str| {
        let mut r = request(user, "/greeter.Greeter/SayHello");
        r.headers_mut()
            .insert("content-type", "application/grpc".parse().unwrap());
        r
    };
    let busy = service.clone().oneshot(grpc("a")).await.unwrap();
    assert_eq!(busy.status(), StatusCode::OK);
    assert_eq!(busy.headers()["grpc-status"], "8");
    assert_eq!(busy.headers()["grpc-retry-pushback-ms"], "1000");
    let full = service.clone().oneshot(grpc("d")).await.unwrap();
    assert_eq!(full.headers()["grpc-status"], "14");
    drop((a, b));
    assert_eq!(limits.total_in_flight(), 0);
}

/// The `Retry-After` of a key at its limit follows how long its rule's requests stay in
/// flight (at least 1 s).
#[tokio::test(start_paused = true)]
async fn retry_after_follows_the_observed_latency() {
    let clock = tollgate::clock::ManualClock::new();
    let limits = ConcurrencyLimitLayer::builder()
        .rule(Rule::new("per-user").key(Header::from_static("x-user")), 1)
        .clock(clock.clone())
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    // Each request stays 8 s in flight.
    for _ in 0..30 {
        let response = service.clone().oneshot(request("a", "/")).await.unwrap();
        clock.advance(Duration::from_secs(8));
        drop(response);
    }
    let held = service.clone().oneshot(request("a", "/")).await.unwrap();
    // Refusals teach nothing about how long requests stay: many of them change nothing.
    for _ in 0..50 {
        let refused = service.clone().oneshot(request("a", "/")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    let refused = service.clone().oneshot(request("a", "/")).await.unwrap();
    assert_eq!(refused.headers()["retry-after"], "8");
    drop(held);
    // Hours in flight (a stream) still send clients away for a minute at most.
    for _ in 0..30 {
        let response = service.clone().oneshot(request("a", "/")).await.unwrap();
        clock.advance(Duration::from_secs(3 * 3600));
        drop(response);
    }
    let held = service.clone().oneshot(request("a", "/")).await.unwrap();
    let refused = service.clone().oneshot(request("a", "/")).await.unwrap();
    assert_eq!(refused.headers()["retry-after"], "60");
    drop(held);
}

#[tokio::test]
async fn missing_keys_and_bad_configuration() {
    let limits = ConcurrencyLimitLayer::builder()
        .rule(
            Rule::new("per-key")
                .key(Header::from_static("x-api-key"))
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED)),
            1,
        )
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let no_key = service.oneshot(request("a", "/")).await.unwrap();
    assert_eq!(no_key.status(), StatusCode::UNAUTHORIZED);

    let err = |b: tollgate::concurrency::ConcurrencyLimitLayerBuilder| b.build().unwrap_err();
    let b = ConcurrencyLimitLayer::builder;
    assert_eq!(err(b()), ConcurrencyError::NothingToLimit);
    assert_eq!(
        err(b().total(0)),
        ConcurrencyError::ZeroLimit("total".into())
    );
    assert_eq!(
        err(b().rule(Rule::new("a"), 0)),
        ConcurrencyError::ZeroLimit("a".into())
    );
    assert!(matches!(
        err(b().rule(Rule::new("a b"), 1)),
        ConcurrencyError::InvalidRuleName(_)
    ));
    assert!(matches!(
        err(b().rule(Rule::new("a"), 1).rule(Rule::new("a"), 2)),
        ConcurrencyError::DuplicateRule(_)
    ));
    let with_policy =
        Rule::new("a").policy(tollgate::Policy::fixed_window(1, Duration::from_secs(1)).unwrap());
    assert!(matches!(
        err(b().rule(with_policy, 1)),
        ConcurrencyError::NotAConcurrencyRule(_)
    ));
    assert!(err(b()).to_string().contains(".total"));
}

fn queued(max: u32, total: Option<u32>, max_waiting: usize) -> ConcurrencyLimitLayer {
    let mut builder = ConcurrencyLimitLayer::builder()
        .rule(
            Rule::new("per-user").key(Header::from_static("x-user")),
            max,
        )
        .queue(max_waiting, Duration::from_millis(100))
        .clock(TokioClock::new());
    if let Some(total) = total {
        builder = builder.total(total);
    }
    builder.build().unwrap()
}

/// With a queue, a request that finds its key full waits for a place: it gets the place as
/// soon as one is given back, with no time passing.
#[tokio::test(start_paused = true)]
async fn a_queued_request_gets_the_first_place_given_back() {
    let limits = queued(1, None, 4);
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let first = service.clone().oneshot(request("a", "/")).await.unwrap();
    let start = tokio::time::Instant::now();
    let second = tokio::spawn(service.clone().oneshot(request("a", "/")));
    tokio::task::yield_now().await;
    assert_eq!(limits.queued(), 1);
    // Another key does not wait, and its place going back does not serve the waiter.
    let other = service.clone().oneshot(request("b", "/")).await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);
    drop(other);
    tokio::task::yield_now().await;
    assert!(!second.is_finished());
    assert_eq!(limits.queued(), 1);
    drop(first);
    let second = second.await.unwrap().unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(limits.queued(), 0);
    assert_eq!(limits.in_flight("per-user", "a"), 1);
    drop(second);
    assert_eq!(limits.tracked_keys(), 0);
}

/// A request that waits out the longest wait is refused then, as it would have been at once;
/// one that finds the queue full is refused at once.
#[tokio::test(start_paused = true)]
async fn the_wait_is_bounded_in_time_and_in_length() {
    let limits = queued(1, None, 1);
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let _first = service.clone().oneshot(request("a", "/")).await.unwrap();
    let start = tokio::time::Instant::now();
    let waiter = tokio::spawn(service.clone().oneshot(request("a", "/")));
    tokio::task::yield_now().await;
    assert_eq!(limits.queued(), 1);
    let full = service.clone().oneshot(request("a", "/")).await.unwrap();
    assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(start.elapsed(), Duration::ZERO, "refused at once");
    let waited = waiter.await.unwrap().unwrap();
    assert_eq!(waited.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(waited.headers()["retry-after"], "1");
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    assert_eq!(limits.queued(), 0);
    assert_eq!(limits.in_flight("per-user", "a"), 1);
}

/// A waiter whose future is dropped leaves the queue and takes nothing; the total cap queues
/// too, and answers 503 when the wait runs out.
#[tokio::test(start_paused = true)]
async fn dropped_waiters_leave_and_the_total_cap_queues_too() {
    let limits = queued(2, Some(1), 4);
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let first = service.clone().oneshot(request("a", "/")).await.unwrap();
    let gone = tokio::spawn(service.clone().oneshot(request("b", "/")));
    let waiter = tokio::spawn(service.clone().oneshot(request("c", "/")));
    tokio::task::yield_now().await;
    assert_eq!(limits.queued(), 2);
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    assert_eq!(limits.queued(), 1);
    drop(first);
    let admitted = waiter.await.unwrap().unwrap();
    assert_eq!(admitted.status(), StatusCode::OK);
    assert_eq!(limits.in_flight("per-user", "b"), 0);
    assert_eq!(limits.in_flight("per-user", "c"), 1);
    let start = tokio::time::Instant::now();
    let refused = service.clone().oneshot(request("d", "/")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    drop(admitted);
    assert_eq!((limits.total_in_flight(), limits.tracked_keys()), (0, 0));
}

/// A tiered rule's limit per key follows the key's tier: the resolver is asked once per key
/// (its answers are remembered), an unknown answer means the default tier.
#[tokio::test(start_paused = true)]
async fn tiered_limits_follow_each_keys_tier() {
    use tollgate::limiter::Tiers;
    let asked = Arc::new(AtomicU64::new(0));
    let plans = {
        let asked = asked.clone();
        Tiers::new(move |key: String| {
            asked.fetch_add(1, Ordering::SeqCst);
            async move {
                match key.split('-').next() {
                    Some("pro") => Some("pro".to_owned()),
                    Some("odd") => Some("platinum".to_owned()),
                    _ => None,
                }
            }
        })
        .default_tier("free")
    };
    let limits = ConcurrencyLimitLayer::builder()
        .tiered(
            Rule::new("per-user").key(Header::from_static("x-user")),
            plans,
            [("pro", 3), ("free", 1)],
        )
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let mut held = Vec::new();
    let statuses = |user: &'static str, n: usize| {
        let service = service.clone();
        async move {
            let mut out = Vec::new();
            for _ in 0..n {
                let r = service.clone().oneshot(request(user, "/")).await.unwrap();
                out.push((r.status().as_u16(), r));
            }
            out
        }
    };
    for (user, expected) in [
        ("pro-1", vec![200, 200, 200, 429]),
        ("free-1", vec![200, 429]),
        ("odd-1", vec![200, 429]),
    ] {
        let answers = statuses(user, expected.len()).await;
        assert_eq!(
            answers.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            expected,
            "{user}"
        );
        held.extend(answers.into_iter().map(|(_, r)| r));
    }
    assert_eq!(asked.load(Ordering::SeqCst), 3, "once per key");
    assert_eq!(limits.in_flight("per-user", "pro-1"), 3);
    drop(held);
    assert_eq!(limits.tracked_keys(), 0);
}

#[test]
fn tiered_rules_are_checked() {
    use tollgate::limiter::Tiers;
    let resolver = |_: String| async { None };
    let build = |tiers: Tiers, limits: Vec<(&str, u32)>| {
        ConcurrencyLimitLayer::builder()
            .tiered(Rule::new("r").key(Global), tiers, limits)
            .build()
            .unwrap_err()
    };
    let invalid = |e: ConcurrencyError| matches!(e, ConcurrencyError::InvalidTiers { .. });
    assert!(invalid(build(Tiers::new(resolver), vec![])));
    assert!(invalid(build(
        Tiers::new(resolver),
        vec![("a", 1), ("a", 2)]
    )));
    assert!(invalid(build(Tiers::new(resolver), vec![("a b", 1)])));
    assert!(invalid(build(
        Tiers::new(resolver).default_tier("gold"),
        vec![("a", 1)]
    )));
    let with_policies = Tiers::new(resolver).tier(
        "a",
        [tollgate::Policy::gcra(tollgate::Rate::per_second(1), 1).unwrap()],
    );
    assert!(invalid(build(with_policies, vec![("a", 1)])));
    assert_eq!(
        build(Tiers::new(resolver), vec![("a", 1), ("b", 0)]),
        ConcurrencyError::ZeroLimit("r/b".into())
    );
}

/// At most as many requests wait for a key as it has places: one client cannot fill the
/// queue that every key shares.
#[tokio::test(start_paused = true)]
async fn one_key_cannot_fill_the_queue() {
    let limits = queued(1, None, 8);
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let _a = service.clone().oneshot(request("a", "/")).await.unwrap();
    let _b = service.clone().oneshot(request("b", "/")).await.unwrap();
    let start = tokio::time::Instant::now();
    let waiting = tokio::spawn(service.clone().oneshot(request("a", "/")));
    tokio::task::yield_now().await;
    let refused = service.clone().oneshot(request("a", "/")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(start.elapsed(), Duration::ZERO, "refused at once");
    // Another key still finds room.
    let other = tokio::spawn(service.clone().oneshot(request("b", "/")));
    tokio::task::yield_now().await;
    assert_eq!(limits.queued(), 2);
    assert_eq!(
        waiting.await.unwrap().unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        other.await.unwrap().unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(limits.queued(), 0);
}

/// A key too long to keep whole (it is hashed in the table) is still asked about as it is.
#[tokio::test(start_paused = true)]
async fn a_long_key_gets_its_own_tier() {
    use tollgate::limiter::Tiers;
    let plans =
        Tiers::new(|key: String| async move { key.starts_with("pro-").then(|| "pro".to_owned()) });
    let limits = ConcurrencyLimitLayer::builder()
        .tiered(
            Rule::new("per-user").key(Header::from_static("x-user")),
            plans,
            [("free", 1), ("pro", 2)],
        )
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let user = format!("pro-{}", "x".repeat(4_000));
    let first = service.clone().oneshot(request(&user, "/")).await.unwrap();
    let second = service.clone().oneshot(request(&user, "/")).await.unwrap();
    assert_eq!(
        (first.status(), second.status()),
        (StatusCode::OK, StatusCode::OK)
    );
    let third = service.clone().oneshot(request(&user, "/")).await.unwrap();
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// The per-key bound on waiters holds whatever refused the request: with the total cap full,
/// one user (a per-key limit of 1) takes one waiting place, not all four, and the next user
/// still waits. Before the fix only a per-key refusal took a per-key place: one user held the
/// whole queue and the next got `503` at once.
#[tokio::test(start_paused = true)]
async fn one_key_cannot_fill_the_queue_when_the_total_cap_refuses() {
    let limits = ConcurrencyLimitLayer::builder()
        .rule(Rule::new("per-user").key(Header::from_static("x-user")), 1)
        .total(2)
        .queue(4, Duration::from_secs(5))
        .clock(TokioClock::new())
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    // The total cap is full: two other users hold both places.
    let _a = service.clone().oneshot(request("a", "/")).await.unwrap();
    let _b = service.clone().oneshot(request("b", "/")).await.unwrap();
    let start = tokio::time::Instant::now();
    let first = tokio::spawn(service.clone().oneshot(request("c", "/")));
    tokio::task::yield_now().await;
    assert_eq!(limits.queued(), 1);
    // User c again: its key has one place, and one request of it waits already.
    let refused = service.clone().oneshot(request("c", "/")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(start.elapsed(), Duration::ZERO, "refused at once");
    // Another user still finds a waiting place.
    let other = tokio::spawn(service.clone().oneshot(request("d", "/")));
    tokio::task::yield_now().await;
    assert_eq!(limits.queued(), 2);
    drop((_a, _b));
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(other.await.unwrap().unwrap().status(), StatusCode::OK);
}

/// The queue's settings agree with `LoadShedLayer`'s: no places or no wait is refused at
/// build, and a wait of `Duration::MAX` is no deadline (it used to overflow `Instant + wait`
/// and panic in the first request that waited).
#[tokio::test(start_paused = true)]
async fn queue_settings_agree_with_the_shedder() {
    let b = || ConcurrencyLimitLayer::builder().total(1);
    for (places, wait) in [(0, Duration::from_secs(1)), (4, Duration::ZERO)] {
        assert_eq!(
            b().queue(places, wait).build().unwrap_err(),
            ConcurrencyError::InvalidQueue {
                max_waiting: places,
                max_wait: wait
            }
        );
    }
    let limits = b().queue(4, Duration::MAX).build().unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let held = service.clone().oneshot(request("a", "/")).await.unwrap();
    let waiting = tokio::spawn(service.clone().oneshot(request("b", "/")));
    tokio::time::sleep(Duration::from_secs(3_600)).await;
    assert_eq!(limits.queued(), 1, "still waiting after an hour");
    drop(held);
    assert_eq!(waiting.await.unwrap().unwrap().status(), StatusCode::OK);
}

// ---------------------------------------------------------------------------------------------
// Fairness of the queue: scenarios under paused time, exact.

/// A service whose requests hold their place for a given time: the handler waits it out, then
/// answers with a body that the caller drops at once.
fn timed_service(
    limits: &ConcurrencyLimitLayer,
    hold: impl Fn(&str) -> Duration + Clone + Send + Sync + 'static,
) -> tower::util::BoxCloneService<
    Request<String>,
    Response<tollgate::concurrency::PermitBody<TestBody>>,
    Infallible,
> {
    tower::util::BoxCloneService::new(limits.layer(tower::service_fn(
        move |request: Request<String>| {
            let user = request.headers()["x-user"].to_str().unwrap().to_owned();
            let hold = hold(&user);
            async move {
                tokio::time::sleep(hold).await;
                Ok::<_, Infallible>(Response::new(frames(1)))
            }
        },
    )))
}

/// A layer with a total cap, a per-key limit that does not bind before it, and a fair queue.
fn capped(total: u32, max_waiting: usize, max_wait: Duration) -> ConcurrencyLimitLayer {
    ConcurrencyLimitLayer::builder()
        .rule(
            Rule::new("per-user").key(Header::from_static("x-user")),
            total,
        )
        .total(total)
        .queue(max_waiting, max_wait)
        .clock(TokioClock::new())
        .build()
        .unwrap()
}

/// A small deterministic generator (xorshift), for holding times that do not all end at once.
struct Jitter(u64);

impl Jitter {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Four small keys each send one request at a time (30 ms apart) beside a large key `a` that
/// keeps the total cap full; returns the small keys' mean wait (time to their answer less the
/// time their request holds its place) and how many of them were refused. `a_workers` is how
/// many requests `a` keeps outstanding: 10 fill the cap only, 40 fill the queue as well.
async fn small_keys_wait(a_workers: usize) -> (Duration, usize) {
    let limits = capped(10, 20, Duration::from_secs(5));
    let hold = |user: &str| {
        // 80 to 120 ms, a different time for each request of the key.
        let seed = user.bytes().fold(0x9e37_79b9_7f4a_7c15_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut jitter = Jitter(seed ^ n.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1);
        Duration::from_millis(80 + jitter.next() % 41)
    };
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    COUNTER.store(1, Ordering::Relaxed);
    let service = timed_service(&limits, hold);
    let end = tokio::time::Instant::now() + Duration::from_secs(20);
    for worker in 0..a_workers {
        let service = service.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_micros(worker as u64)).await;
            while tokio::time::Instant::now() < end {
                let answer = service.clone().oneshot(request("a", "/")).await.unwrap();
                if answer.status() != StatusCode::OK {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        });
    }
    let small: Vec<_> = ["b", "c", "d", "e"]
        .into_iter()
        .map(|user| {
            let service = service.clone();
            tokio::spawn(async move {
                let (mut waited, mut served, mut refused) = (Duration::ZERO, 0u32, 0usize);
                tokio::time::sleep(Duration::from_millis(500)).await;
                while tokio::time::Instant::now() < end {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    let start = tokio::time::Instant::now();
                    let answer = service.clone().oneshot(request(user, "/")).await.unwrap();
                    if answer.status() == StatusCode::OK {
                        // Its holding time is 80 to 120 ms: the wait is what passed before the
                        // handler started, which the test cannot see; count whole latency.
                        waited += start.elapsed();
                        served += 1;
                    } else {
                        refused += 1;
                    }
                }
                (waited, served, refused)
            })
        })
        .collect();
    let (mut waited, mut served, mut refused) = (Duration::ZERO, 0, 0);
    for key in small {
        let (w, s, r) = key.await.unwrap();
        waited += w;
        served += s;
        refused += r;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(limits.total_in_flight(), 0);
    (waited / served.max(1), refused)
}

/// A key that fills the queue (40 requests outstanding under a cap of 10 and a queue of 20)
/// does not change how long the other keys wait, within 10 %, against the same key keeping
/// only the cap full; none of them is refused. (With no large key at all the small keys do
/// not wait: 100.3 ms, their holding time, against 111.9 ms beside a key at the cap, the wait
/// for the next completion, since places held are not taken back; printed.) Before the fair queue, the large key's
/// requests took each place given back first (a newcomer of the key it came from took it
/// before the woken waiters ran) and filled the queue: the small keys waited out the queue's
/// longest wait and were refused.
#[tokio::test(start_paused = true)]
async fn a_key_that_fills_the_queue_does_not_slow_the_others() {
    let (idle, _) = small_keys_wait(0).await;
    let (alone, refused_alone) = small_keys_wait(10).await;
    let (flooded, refused_flooded) = small_keys_wait(40).await;
    println!(
        "small keys' mean latency: {idle:?} with no large key, {alone:?} beside a key at the \
         cap, {flooded:?} beside one filling the queue"
    );
    assert_eq!((refused_alone, refused_flooded), (0, 0));
    let (lo, hi) = (alone.mul_f64(0.9), alone.mul_f64(1.1));
    assert!(
        (lo..=hi).contains(&flooded),
        "{flooded:?} not within 10 % of {alone:?}"
    );
}

/// A key holding 18 of a total cap of 20 with long requests (streams that outlast the test),
/// and a key that keeps the other two busy with 1 s requests: each of five newcomer keys,
/// arriving between two completions, is admitted at the first completion after it arrived.
/// Before, the busy key's next request took the place given back before the woken newcomer
/// ran, and the newcomer was refused when its wait ran out.
#[tokio::test(start_paused = true)]
async fn a_newcomer_is_admitted_at_the_next_completion_beside_long_requests() {
    type Log = Arc<std::sync::Mutex<Vec<(String, tokio::time::Instant, tokio::time::Instant)>>>;
    let limits = capped(20, 8, Duration::from_secs(5));
    // Each handler notes its key, when it started (was admitted) and when it will end.
    let log: Log = Arc::default();
    let service = {
        let log = log.clone();
        limits.layer(tower::service_fn(move |request: Request<String>| {
            let user = request.headers()["x-user"].to_str().unwrap().to_owned();
            let hold = match user.as_str() {
                "long" => Duration::from_secs(3_600),
                "busy" => Duration::from_secs(1),
                _ => Duration::from_millis(300),
            };
            let now = tokio::time::Instant::now();
            log.lock().unwrap().push((user, now, now + hold));
            async move {
                tokio::time::sleep(hold).await;
                Ok::<_, Infallible>(Response::new(frames(1)))
            }
        }))
    };
    let start = tokio::time::Instant::now();
    for _ in 0..18 {
        tokio::spawn(service.clone().oneshot(request("long", "/")));
    }
    tokio::task::yield_now().await;
    assert_eq!(limits.in_flight("per-user", "long"), 18);
    for _ in 0..2 {
        let service = service.clone();
        tokio::spawn(async move {
            loop {
                let answer = service.clone().oneshot(request("busy", "/")).await.unwrap();
                if answer.status() != StatusCode::OK {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        });
    }
    let mut waited = 0;
    for i in 0..5u64 {
        tokio::time::sleep_until(start + Duration::from_millis(1_000 * i + 500)).await;
        let user = format!("new-{i}");
        let asked = tokio::time::Instant::now();
        let answer = service.clone().oneshot(request(&user, "/")).await.unwrap();
        assert_eq!(answer.status(), StatusCode::OK, "{user}");
        let log = log.lock().unwrap();
        let admitted = log.iter().find(|(u, ..)| *u == user).unwrap().1;
        let next_completion = log
            .iter()
            .filter(|(u, _, end)| *u != user && *end > asked)
            .map(|(.., end)| *end)
            .min()
            .unwrap();
        // At once if a place was free, else at the first completion after it asked.
        assert!(
            admitted == asked || admitted == next_completion,
            "{user}: asked at {:?}, admitted at {:?}, next completion at {:?}",
            asked - start,
            admitted - start,
            next_completion - start
        );
        waited += usize::from(admitted > asked);
    }
    assert!(waited >= 3, "only {waited} newcomers found the cap full");
}

/// 30 keys whose demands span two orders of magnitude, at 150 % of a total cap's capacity:
/// what each key gets, divided by its max-min fair share, with its Jain's fairness index.
async fn jain_index(queue: bool) -> f64 {
    const CAP: u32 = 20;
    const HOLD: Duration = Duration::from_millis(100);
    let mut builder = ConcurrencyLimitLayer::builder()
        .rule(
            Rule::new("per-user").key(Header::from_static("x-user")),
            CAP,
        )
        .total(CAP)
        .clock(TokioClock::new());
    if queue {
        builder = builder.queue(40, Duration::from_millis(500));
    }
    let limits = builder.build().unwrap();
    let service = timed_service(&limits, |_: &str| HOLD);
    // Demands from 1 to 100 (geometric), scaled to 1.5 times the capacity (CAP / HOLD).
    let capacity = f64::from(CAP) / HOLD.as_secs_f64();
    let raw: Vec<f64> = (0..30).map(|i| 100f64.powf(f64::from(i) / 29.0)).collect();
    let scale = 1.5 * capacity / raw.iter().sum::<f64>();
    let demand: Vec<f64> = raw.iter().map(|d| d * scale).collect();
    // The max-min fair share: the smaller of each demand and the level that fills capacity.
    let (mut lo, mut hi) = (0.0, capacity);
    for _ in 0..100 {
        let level = (lo + hi) / 2.0;
        if demand.iter().map(|d| d.min(level)).sum::<f64>() > capacity {
            hi = level;
        } else {
            lo = level;
        }
    }
    let fair: Vec<f64> = demand.iter().map(|d| d.min(lo)).collect();
    let received: Arc<Vec<AtomicU64>> = Arc::new((0..30).map(|_| AtomicU64::new(0)).collect());
    let warm_up = tokio::time::Instant::now() + Duration::from_secs(2);
    let end = warm_up + Duration::from_secs(30);
    for (key, rate) in demand.iter().enumerate() {
        let (service, received) = (service.clone(), received.clone());
        let interval = Duration::from_secs_f64(1.0 / rate);
        tokio::spawn(async move {
            // Each key starts at its own phase.
            tokio::time::sleep(interval.mul_f64(key as f64 / 30.0)).await;
            let mut ticks = tokio::time::interval(interval);
            loop {
                ticks.tick().await;
                if tokio::time::Instant::now() >= end {
                    break;
                }
                let (service, received) = (service.clone(), received.clone());
                tokio::spawn(async move {
                    let user = format!("k{key}");
                    let answer = service.oneshot(request(&user, "/")).await.unwrap();
                    let now = tokio::time::Instant::now();
                    if answer.status() == StatusCode::OK && now >= warm_up && now < end {
                        received[key].fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
    }
    tokio::time::sleep_until(end + Duration::from_secs(2)).await;
    let seconds = (end - warm_up).as_secs_f64();
    let x: Vec<f64> = (0..30)
        .map(|k| received[k].load(Ordering::Relaxed) as f64 / seconds / fair[k])
        .collect();
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    sum * sum / (30.0 * squares)
}

/// Jain's fairness index of what 30 keys (demands over two orders of magnitude, 150 % load)
/// receive divided by their max-min fair share is at least 0.95 with the fair queue; the
/// figure without a queue (the cap alone refuses whoever finds it full) is printed beside it.
#[tokio::test(start_paused = true)]
async fn thirty_keys_at_150_percent_get_their_max_min_fair_share() {
    let fair = jain_index(true).await;
    let plain = jain_index(false).await;
    println!(
        "Jain's index of received / max-min fair share: {fair:.3} with the fair queue, {plain:.3} without a queue"
    );
    assert!(fair >= 0.95, "{fair}");
}

/// A tier resolver that never answers: the request is decided after the tiers' timeout, in
/// the default tier (here `free`, one in flight), and the next request of the key asks again
/// (a fallback is remembered for nobody).
#[tokio::test(start_paused = true)]
async fn a_hanging_resolver_falls_back_to_the_default_tier_after_the_timeout() {
    use tollgate::limiter::Tiers;
    let plans = Tiers::new(|_: String| std::future::pending::<Option<String>>())
        .default_tier("free")
        .timeout(Duration::from_millis(250));
    let limits = ConcurrencyLimitLayer::builder()
        .tiered(
            Rule::new("per-user").key(Header::from_static("x-user")),
            plans,
            [("free", 1), ("pro", 5)],
        )
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let start = tokio::time::Instant::now();
    let first = service.clone().oneshot(request("u", "/")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(start.elapsed(), Duration::from_millis(250));
    let second = service.clone().oneshot(request("u", "/")).await.unwrap();
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS, "free: one");
    assert_eq!(start.elapsed(), Duration::from_millis(500));
}

/// 100 concurrent requests for one key whose tier is not known: the resolver is asked once,
/// and all of them are decided by its answer (`pro`, 5 in flight: 5 admitted, 95 refused).
/// Before, each request asked the resolver for itself: 100 lookups of one key.
#[tokio::test(start_paused = true)]
async fn concurrent_requests_for_an_unknown_key_share_one_lookup() {
    use tollgate::limiter::Tiers;
    let asked = Arc::new(AtomicU64::new(0));
    let plans = {
        let asked = asked.clone();
        Tiers::new(move |_: String| {
            asked.fetch_add(1, Ordering::SeqCst);
            async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Some("pro".to_owned())
            }
        })
        .default_tier("free")
    };
    let limits = ConcurrencyLimitLayer::builder()
        .tiered(
            Rule::new("per-user").key(Header::from_static("x-user")),
            plans,
            [("free", 1), ("pro", 5)],
        )
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let calls: Vec<_> = (0..100)
        .map(|_| tokio::spawn(service.clone().oneshot(request("u", "/"))))
        .collect();
    let mut statuses = Vec::new();
    for call in calls {
        statuses.push(call.await.unwrap().unwrap());
    }
    assert_eq!(asked.load(Ordering::SeqCst), 1, "one lookup for one key");
    let ok = statuses
        .iter()
        .filter(|r| r.status() == StatusCode::OK)
        .count();
    assert_eq!(ok, 5, "all decided by the pro tier");
    assert_eq!(limits.in_flight("per-user", "u"), 5);
}

/// The queue's wait is timed on the layer's clock: with a `ManualClock` that does not move, a
/// waiter is still waiting after an hour of tokio's time; once the clock has passed its longest
/// wait, it is refused (at the timer's next look, one longest wait later on tokio's time).
/// Before, the wait ran on tokio's timer whatever the layer's clock said.
#[tokio::test(start_paused = true)]
async fn the_queue_waits_on_the_layers_clock() {
    let clock = tollgate::clock::ManualClock::new();
    let limits = ConcurrencyLimitLayer::builder()
        .rule(Rule::new("per-user").key(Header::from_static("x-user")), 1)
        .queue(4, Duration::from_millis(100))
        .clock(clock.clone())
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let _held = service.clone().oneshot(request("a", "/")).await.unwrap();
    let waiter = tokio::spawn(service.clone().oneshot(request("a", "/")));
    tokio::time::sleep(Duration::from_secs(3_600)).await;
    assert_eq!(limits.queued(), 1, "the clock has not moved");
    assert!(!waiter.is_finished());
    clock.advance(Duration::from_millis(100));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        waiter.await.unwrap().unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(limits.queued(), 0);
}

/// A place of a key goes to that key's oldest waiter: two wait for key `a` (two places, both
/// held); one place given back serves the first, and the second still waits.
#[tokio::test(start_paused = true)]
async fn a_keys_place_goes_to_its_oldest_waiter() {
    let limits = queued(2, None, 8);
    let service = limits.layer(tower::service_fn(|request: Request<String>| async move {
        let tag = request.uri().path().to_owned();
        let mut response = Response::new(frames(1));
        response.headers_mut().insert("x-tag", tag.parse().unwrap());
        Ok::<_, Infallible>(response)
    }));
    let first = service
        .clone()
        .oneshot(request("a", "/held-1"))
        .await
        .unwrap();
    let _second = service
        .clone()
        .oneshot(request("a", "/held-2"))
        .await
        .unwrap();
    let older = tokio::spawn(service.clone().oneshot(request("a", "/older")));
    tokio::task::yield_now().await;
    let newer = tokio::spawn(service.clone().oneshot(request("a", "/newer")));
    tokio::task::yield_now().await;
    assert_eq!(limits.queued(), 2);
    drop(first);
    let served = older.await.unwrap().unwrap();
    assert_eq!(served.headers()["x-tag"], "/older");
    tokio::task::yield_now().await;
    assert!(!newer.is_finished());
    assert_eq!(limits.queued(), 1);
    drop(served);
    assert_eq!(newer.await.unwrap().unwrap().headers()["x-tag"], "/newer");
}

/// A full queue makes room for a key under its share: key `a` waits in all 4 places (alone,
/// its share is the whole queue); key `b` arrives, the shares become 2 each, and `a`'s newest
/// waiter is refused at once (`503`, as for a full queue) while `b` waits. Before, `b` was
/// refused.
#[tokio::test(start_paused = true)]
async fn a_full_queue_pushes_out_the_longest_flows_newest_waiter() {
    // Up to 8 of a key may wait (its places), the queue holds 4, one place in all.
    let limits = ConcurrencyLimitLayer::builder()
        .rule(Rule::new("per-user").key(Header::from_static("x-user")), 8)
        .total(1)
        .queue(4, Duration::from_secs(5))
        .clock(TokioClock::new())
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let held = service.clone().oneshot(request("z", "/")).await.unwrap();
    let start = tokio::time::Instant::now();
    let mut a: Vec<_> = (0..4)
        .map(|i| {
            let service = service.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(i)).await;
                service.oneshot(request("a", "/")).await.unwrap().status()
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(limits.queued(), 4);
    let b = tokio::spawn(service.clone().oneshot(request("b", "/")));
    tokio::task::yield_now().await;
    assert_eq!(limits.queued(), 4, "b in, one of a out");
    let newest = a.pop().unwrap();
    assert_eq!(newest.await.unwrap(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(10),
        "refused at once"
    );
    // b holds nothing, a nothing either: the oldest flow (a) goes first, then b.
    drop(held);
    assert_eq!(a.remove(0).await.unwrap(), StatusCode::OK);
    assert_eq!(b.await.unwrap().unwrap().status(), StatusCode::OK);
}

/// With two rules, a key's oldest waiter may lack the other rule's place while a younger one
/// has it: a place of the key given back goes to the younger one, which fits (only the oldest
/// was tried, and the younger waited out its wait while a place it fits was free).
#[tokio::test(start_paused = true)]
async fn a_flows_younger_waiter_that_fits_is_served() {
    let limits = ConcurrencyLimitLayer::builder()
        .rule(Rule::new("per-user").key(Header::from_static("x-user")), 2)
        .rule(Rule::new("per-ip").key(Header::from_static("x-ip")), 1)
        .queue(4, Duration::from_secs(5))
        .clock(TokioClock::new())
        .build()
        .unwrap();
    let service = limits.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(frames(1)))
    }));
    let request = |user: &str, ip: &str| {
        Request::get("/")
            .header("x-user", user)
            .header("x-ip", ip)
            .body(String::new())
            .unwrap()
    };
    let _ip_x = service
        .clone()
        .oneshot(request("other", "x"))
        .await
        .unwrap();
    let _u1 = service.clone().oneshot(request("u", "z")).await.unwrap();
    let u2 = service.clone().oneshot(request("u", "q")).await.unwrap();
    let start = tokio::time::Instant::now();
    // The oldest waits for u and for ip x; the younger for u only.
    let older = tokio::spawn(service.clone().oneshot(request("u", "x")));
    tokio::task::yield_now().await;
    let younger = tokio::spawn(service.clone().oneshot(request("u", "y")));
    tokio::task::yield_now().await;
    assert_eq!(limits.queued(), 2);
    drop(u2);
    let younger = younger.await.unwrap().unwrap();
    assert_eq!(younger.status(), StatusCode::OK);
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "served when u's place came back"
    );
    assert_eq!(limits.queued(), 1);
    assert!(!older.is_finished());
}
