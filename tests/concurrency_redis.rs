//! The concurrency limit on Redis: places are leases that every instance shares. Two instances
//! never have more than the limit in flight for one key (counted by the inner service itself);
//! the leases of an instance that crashes free their places after one lease time and not
//! before; renewals keep a long request's lease; a dead Redis follows the failure policy.
//! Real `redis-server` processes; Redis's clock is a manual clock where time matters.
#![cfg(feature = "redis")]

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tokio::sync::{mpsc, watch};
use tollgate::RedisStore;
use tollgate::clock::ManualClock;
use tollgate::concurrency::ConcurrencyLimitLayer;
use tollgate::key::Header;
use tollgate::limiter::Rule;
use tollgate::store::FailurePolicy;
use tower::{Layer, ServiceExt};

async fn store(url: &str, clock: Option<&ManualClock>) -> RedisStore {
    let mut builder = RedisStore::builder()
        .url(url)
        .timeout(Duration::from_millis(500));
    if let Some(clock) = clock {
        builder = builder.injected_clock(clock.clone());
    }
    builder.connect().await.unwrap()
}

fn per_user(store: RedisStore, max: u32, lease: Duration) -> ConcurrencyLimitLayer {
    ConcurrencyLimitLayer::builder()
        .rule(
            Rule::new("per-user").key(Header::from_static("x-user")),
            max,
        )
        .redis(store)
        .lease_time(lease)
        .build()
        .unwrap()
}

fn request(user: &str) -> Request<String> {
    Request::get("/")
        .header("x-user", user)
        .body(String::new())
        .unwrap()
}

/// The live leases of every key on the server.
fn live_leases(server: &support::RedisServer) -> usize {
    server
        .cli(&["--scan", "--pattern", "*:cc:*"])
        .lines()
        .filter(|k| !k.is_empty())
        .map(|k| server.cli(&["ZCARD", k]).trim().parse::<usize>().unwrap())
        .sum()
}

/// Releases go back off the request's path: waits (bounded) until Redis has them all.
async fn until_no_leases(server: &support::RedisServer) {
    for _ in 0..500 {
        if live_leases(server) == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("leases left on Redis: {}", live_leases(server));
}

enum Event {
    Entered,
    Refused(StatusCode),
}

/// Two instances, each with its own connection, 24 concurrent slow requests of one key
/// (limit 3) and 6 of another: the inner services, which count what they run, never see more
/// than 3 of a key at once, and exactly 3 run; once they end, their leases are gone from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_never_run_more_than_the_limit_of_a_key() {
    let server = redis_or_skip!();
    let url = server.url();
    let (events, mut seen) = mpsc::unbounded_channel();
    let (open, gate) = watch::channel(false);
    let running = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let most = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let instance = |store: RedisStore| {
        let (events, gate, running, most) =
            (events.clone(), gate.clone(), running.clone(), most.clone());
        per_user(store, 3, Duration::from_secs(10)).layer(tower::service_fn(
            move |r: Request<String>| {
                let (events, mut gate, running, most) =
                    (events.clone(), gate.clone(), running.clone(), most.clone());
                async move {
                    let i = usize::from(r.headers()["x-user"] == "b");
                    let now = running[i].fetch_add(1, Ordering::SeqCst) + 1;
                    most[i].fetch_max(now, Ordering::SeqCst);
                    events.send(Event::Entered).unwrap();
                    gate.wait_for(|open| *open).await.unwrap();
                    running[i].fetch_sub(1, Ordering::SeqCst);
                    Ok::<_, Infallible>(Response::new(String::new()))
                }
            },
        ))
    };
    let one = instance(store(&url, None).await);
    let two = instance(store(&url, None).await);
    let mut tasks = Vec::new();
    for n in 0..30 {
        let service = if n % 2 == 0 { one.clone() } else { two.clone() };
        let user = if n % 5 == 4 { "b" } else { "a" };
        let events = events.clone();
        tasks.push(tokio::spawn(async move {
            let response = service.oneshot(request(user)).await.unwrap();
            if response.status() != StatusCode::OK {
                events.send(Event::Refused(response.status())).unwrap();
            }
            response
        }));
    }
    let (mut entered, mut refused) = (0, 0);
    while entered + refused < 30 {
        match seen.recv().await.unwrap() {
            Event::Entered => entered += 1,
            Event::Refused(status) => {
                assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
                refused += 1;
            }
        }
    }
    assert_eq!(entered, 6, "3 of each key run");
    assert_eq!(live_leases(&server), 6);
    open.send(true).unwrap();
    for task in tasks {
        drop(task.await.unwrap());
    }
    assert_eq!(most[0].load(Ordering::SeqCst), 3);
    assert_eq!(most[1].load(Ordering::SeqCst), 3);
    until_no_leases(&server).await;
    // The places are free again for the next requests, on either instance.
    for service in [&one, &one, &two] {
        let r = service.clone().oneshot(request("a")).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
}

/// An instance that crashes with two requests in flight (its runtime, its connections and its
/// renewer gone at once, nothing given back) holds their places for one lease time, and not a
/// moment longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_instances_leases_expire_after_the_lease_time() {
    let server = redis_or_skip!();
    let url = server.url();
    let clock = ManualClock::new();
    let lease = Duration::from_secs(5);
    let crashed = {
        let (url, clock) = (url.clone(), clock.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let layer = per_user(store(&url, Some(&clock)).await, 2, lease);
                let service = layer.layer(tower::service_fn(|_: Request<String>| async {
                    Ok::<_, Infallible>(Response::new(String::new()))
                }));
                for _ in 0..2 {
                    let response = service.clone().oneshot(request("c")).await.unwrap();
                    assert_eq!(response.status(), StatusCode::OK);
                    // Its body holds the place; the crash comes before it ends.
                    std::mem::forget(response);
                }
                assert_eq!(layer.lease_stats().live, 2);
            });
            runtime.shutdown_background();
        })
    };
    crashed.join().unwrap();
    assert_eq!(live_leases(&server), 2);
    let survivor = per_user(store(&url, Some(&clock)).await, 2, lease);
    let service = survivor.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    clock.advance(lease - Duration::from_millis(1));
    let refused = service.clone().oneshot(request("c")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    clock.advance(Duration::from_millis(1));
    let mut admitted = Vec::new();
    for _ in 0..2 {
        let response = service.clone().oneshot(request("c")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        admitted.push(response);
    }
    let stats = survivor.lease_stats();
    assert_eq!((stats.granted, stats.refused, stats.live), (2, 1, 2));
    assert_eq!(live_leases(&server), 2, "the crashed leases are gone");
    drop(admitted);
    until_no_leases(&server).await;
}

/// Renewal keeps a long request's lease past the lease time; a lease not renewed in time is
/// lost (counted) and put back, since its request still runs. The lease time is long enough
/// that the background renewer (every third of it, in real time) never runs here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_keep_long_requests_counted() {
    let server = redis_or_skip!();
    let url = server.url();
    let clock = ManualClock::new();
    let lease = Duration::from_secs(60);
    let long = per_user(store(&url, Some(&clock)).await, 1, lease);
    let other = per_user(store(&url, Some(&clock)).await, 1, lease);
    let ok = || {
        tower::service_fn(|_: Request<String>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        })
    };
    let (long_service, other_service) = (long.layer(ok()), other.layer(ok()));
    let running = long_service.clone().oneshot(request("d")).await.unwrap();
    assert_eq!(running.status(), StatusCode::OK);
    for _ in 0..3 {
        clock.advance(Duration::from_secs(40));
        long.renew_leases().await;
        let r = other_service.clone().oneshot(request("d")).await.unwrap();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS, "still counted");
    }
    assert_eq!(long.lease_stats().renewed, 3);
    clock.advance(lease);
    let taken = other_service.clone().oneshot(request("d")).await.unwrap();
    assert_eq!(taken.status(), StatusCode::OK, "an unrenewed lease expires");
    long.renew_leases().await;
    assert_eq!(long.lease_stats().lost, 1);
    // Both requests run: Redis counts both again, and a third is refused.
    assert_eq!(live_leases(&server), 2);
    let third = other_service.clone().oneshot(request("d")).await.unwrap();
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    drop((running, taken));
    until_no_leases(&server).await;
}

/// Requests dropped while their lease is being taken (a client gone, a timeout) leave no
/// lease behind, whenever the drop comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_dropped_while_leasing_leave_no_lease() {
    let server = redis_or_skip!();
    let layer = per_user(
        store(&server.url(), None).await,
        100,
        Duration::from_secs(60),
    );
    let service = layer.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let mut tasks = Vec::new();
    for n in 0..60 {
        let service = service.clone();
        let task = tokio::spawn(async move { service.oneshot(request("f")).await });
        // Dropped at every stage: before the script is sent, while it runs, after.
        for _ in 0..(n % 6) {
            tokio::task::yield_now().await;
        }
        task.abort();
        tasks.push(task);
    }
    for task in tasks {
        if let Ok(done) = task.await {
            drop(done.unwrap());
        }
    }
    until_no_leases(&server).await;
    assert_eq!(layer.in_flight("per-user", "f"), 0);
    assert_eq!(layer.lease_stats().live, 0);
}

/// A lease time too short for the store's timeout is refused when the layer is built.
#[tokio::test]
async fn a_lease_time_is_checked_against_the_timeout() {
    let server = redis_or_skip!();
    let built = ConcurrencyLimitLayer::builder()
        .rule(Rule::new("per-user").key(Header::from_static("x-user")), 1)
        .redis(store(&server.url(), None).await)
        .lease_time(Duration::from_millis(1_400))
        .build();
    assert!(matches!(
        built,
        Err(tollgate::concurrency::ConcurrencyError::LeaseTime(_))
    ));
}

/// Redis dies: by default each instance goes on with its own in-process limit; with
/// `FailurePolicy::Closed` requests are refused with 503. When Redis is back, leases resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_follows_the_failure_policy() {
    let mut server = redis_or_skip!();
    let url = server.url();
    let ok = || {
        tower::service_fn(|_: Request<String>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        })
    };
    let fallback = per_user(store(&url, None).await, 2, Duration::from_secs(10));
    let closed = ConcurrencyLimitLayer::builder()
        .rule(Rule::new("per-user").key(Header::from_static("x-user")), 2)
        .redis(store(&url, None).await)
        .on_store_error(FailurePolicy::Closed)
        .build()
        .unwrap();
    let (fallback_service, closed_service) = (fallback.layer(ok()), closed.layer(ok()));
    server.kill();
    let first = fallback_service
        .clone()
        .oneshot(request("e"))
        .await
        .unwrap();
    let second = fallback_service
        .clone()
        .oneshot(request("e"))
        .await
        .unwrap();
    let third = fallback_service
        .clone()
        .oneshot(request("e"))
        .await
        .unwrap();
    assert_eq!(
        [first.status(), second.status(), third.status()],
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ],
        "the in-process limit holds"
    );
    let stats = fallback.lease_stats();
    assert_eq!((stats.without_redis, stats.live), (2, 0));
    assert!(stats.errors >= 2);
    let refused = closed_service.clone().oneshot(request("e")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(
        closed.in_flight("per-user", "e"),
        0,
        "the local place went back"
    );
    drop((first, second, third));
    server.restart();
    let mut back = None;
    for _ in 0..500 {
        let r = closed_service.clone().oneshot(request("e")).await.unwrap();
        if r.status() == StatusCode::OK {
            back = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(back.is_some(), "leases resume when Redis is back");
    assert_eq!(closed.lease_stats().live, 1);
}
