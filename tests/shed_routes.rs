//! The shedder inside an axum router: a client's declared deadline leaves time for the route it
//! asks for, not for an average of every route. Paused tokio time, no real sleeps.
#![cfg(feature = "axum")]

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::Response;
use axum::routing::get;
use http::{Request, StatusCode};
use tollgate::LoadShedLayer;
use tollgate::clock::TokioClock;
use tollgate::shed::{Criticality, Limit};
use tower::{Layer, ServiceExt};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// One place, a queue whose waits only deadlines cut (CoDel's target above the longest wait).
fn shedder() -> LoadShedLayer {
    LoadShedLayer::builder(Limit::fixed(1))
        .queue(8, Duration::from_secs(1))
        .codel(Duration::from_secs(1), ms(100))
        .deadline_header(http::HeaderName::from_static("grpc-timeout"))
        .clock(TokioClock::new())
        .build()
        .unwrap()
}

/// A route that answers in 100 ms and one that answers in 1 ms.
fn routes() -> Router {
    Router::new()
        .route("/slow", get(|| async { tokio::time::sleep(ms(100)).await }))
        .route("/fast", get(|| async { tokio::time::sleep(ms(1)).await }))
}

fn request(path: &str, timeout: Option<&str>) -> Request<Body> {
    let mut request = Request::get(path);
    if let Some(timeout) = timeout {
        request = request.header("grpc-timeout", timeout);
    }
    request.body(Body::empty()).unwrap()
}

/// Sends a request on a task of its own: its status and how long it took, once it comes.
fn spawn_timed(
    router: &Router,
    request: Request<Body>,
) -> tokio::task::JoinHandle<(StatusCode, Duration)> {
    let router = router.clone();
    tokio::spawn(async move {
        let start = tokio::time::Instant::now();
        let answer = router.oneshot(request).await.unwrap();
        (answer.status(), start.elapsed())
    })
}

/// Each route teaches the shedder its answer time once (100 ms, then 1 ms), then a `/fast`
/// request holds the only place (its body not sent) until dropped: the response that holds it.
async fn warmed_up(router: &Router) -> Response {
    for path in ["/slow", "/fast"] {
        let answer = router.clone().oneshot(request(path, None)).await.unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
    }
    let holder = router
        .clone()
        .oneshot(request("/fast", None))
        .await
        .unwrap();
    assert_eq!(holder.status(), StatusCode::OK);
    holder
}

/// Under `Router::layer` each route has its own answer time: a 50 ms deadline on the 1 ms
/// route leaves 49 ms to wait (with one average for both routes, about 77 ms, it was shed at
/// once), while on the 100 ms route it leaves nothing and 130 ms leave 30.
#[tokio::test(start_paused = true)]
async fn a_deadline_leaves_the_time_of_its_own_route() {
    let shed = shedder();
    let router = routes().layer(shed.clone());
    let holder = warmed_up(&router).await;

    let fast = spawn_timed(&router, request("/fast", Some("50m")));
    let fast_late = spawn_timed(&router, request("/fast", Some("50m")));
    let slow = spawn_timed(&router, request("/slow", Some("50m")));
    let slow_longer = spawn_timed(&router, request("/slow", Some("130m")));
    assert_eq!(
        slow.await.unwrap(),
        (StatusCode::SERVICE_UNAVAILABLE, ms(0))
    );
    tokio::time::sleep(ms(20)).await;
    assert_eq!(shed.queued(), 3);
    // The place goes to the oldest waiter: served after its 20 ms wait and 1 ms of service.
    drop(holder);
    assert_eq!(fast.await.unwrap(), (StatusCode::OK, ms(21)));
    // The next `/fast` waits 49 ms at most: by then the first is done, so it is served too.
    let (status, took) = fast_late.await.unwrap();
    assert_eq!((status, took), (StatusCode::OK, ms(22)));
    // `/slow` with 130 ms got the place after it: 22 ms waited, then 100 ms of service.
    assert_eq!(slow_longer.await.unwrap(), (StatusCode::OK, ms(122)));
    assert_eq!(shed.stats().shed(Criticality::Critical), 1);
}

/// A `/slow` request with 130 ms waits at most 30 ms: it times out while the place stays
/// held, and its 50 ms neighbour on `/fast` waits up to its 49 ms.
#[tokio::test(start_paused = true)]
async fn each_route_waits_at_most_its_own_budget() {
    let shed = shedder();
    let router = routes().layer(shed.clone());
    let holder = warmed_up(&router).await;
    let slow = spawn_timed(&router, request("/slow", Some("130m")));
    let fast = spawn_timed(&router, request("/fast", Some("50m")));
    assert_eq!(
        slow.await.unwrap(),
        (StatusCode::SERVICE_UNAVAILABLE, ms(30))
    );
    assert_eq!(
        fast.await.unwrap(),
        (StatusCode::SERVICE_UNAVAILABLE, ms(49))
    );
    assert_eq!(shed.stats().timed_out(Criticality::Critical), 2);
    drop(holder);
}

/// Around the whole router there is no route template yet (axum sets `MatchedPath` when it
/// routes): every route shares one average, and the 50 ms deadline on the fast route is
/// spent on the slow route's time.
#[tokio::test(start_paused = true)]
async fn outside_the_router_every_route_shares_one_average() {
    let shed = shedder();
    let service = shed.layer(routes());
    let send = |path: &str, timeout: Option<&str>| service.clone().oneshot(request(path, timeout));
    for path in ["/slow", "/fast"] {
        assert_eq!(send(path, None).await.unwrap().status(), StatusCode::OK);
    }
    let holder = send("/fast", None).await.unwrap();
    // 100 ms, then two answers of 1 ms: about 77 ms, more than the 50 declared.
    let start = tokio::time::Instant::now();
    let fast = send("/fast", Some("50m")).await.unwrap();
    assert_eq!(
        (fast.status(), start.elapsed()),
        (StatusCode::SERVICE_UNAVAILABLE, ms(0))
    );
    let start = tokio::time::Instant::now();
    let fast = send("/fast", Some("100m")).await.unwrap();
    assert_eq!(fast.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        (ms(23)..=ms(24)).contains(&start.elapsed()),
        "100 ms less about 77: {:?}",
        start.elapsed()
    );
    drop(holder);
}
