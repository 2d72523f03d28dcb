//! High contention, exact totals: many threads on the same keys, with time frozen so that
//! every total is known exactly.
//!
//! - The in-process store's stacked checks: threads race on stacks that share a tenant and a
//!   global limit; exactly the tenant's limit is admitted, and every policy of the stack holds
//!   exactly what was admitted (all or nothing: no partial consumption survives a refusal).
//! - The concurrency limit: requests race for per-user and total places on a multi-threaded
//!   runtime; the places held never exceed the caps, and every count returns to zero.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tollgate::clock::ManualClock;
use tollgate::key::Header;
use tollgate::limiter::Rule;
use tollgate::{Check, ConcurrencyLimitLayer, MemoryStore, Policy, Rate};
use tower::{Layer, ServiceExt};

const DAY: Duration = Duration::from_secs(86_400);

#[test]
fn stacked_checks_from_many_threads_admit_exactly_the_limit() {
    let clock = ManualClock::new();
    clock.set(Duration::from_secs(1_000_000));
    let store = MemoryStore::with_clock(clock.clone());
    let per_user = Policy::fixed_window(50, DAY).unwrap();
    let tenant = Policy::gcra(Rate::per_hour(1), 1_000).unwrap();
    let global = Policy::sliding_log(3_000, DAY).unwrap();
    let users = 100;
    let threads = 8;
    let per_thread = 2_000;
    let admitted = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (store, admitted) = (&store, &admitted);
            let (per_user, tenant, global) = (&per_user, &tenant, &global);
            scope.spawn(move || {
                for i in 0..per_thread {
                    let user = format!("user:{}", (t * 7 + i) % users);
                    let stack = [
                        Check::new(&user, per_user, 1),
                        Check::new("tenant", tenant, 1),
                        Check::new("global", global, 1),
                    ];
                    if store.check_all_now(&stack).unwrap().allowed() {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    // 16,000 requests for 5,000 user places: the tenant's 1,000 is what runs out.
    let admitted = admitted.into_inner();
    assert_eq!(admitted, 1_000);
    let left = |key: &str, policy: &Policy| store.check_now(key, policy, 0).unwrap().remaining();
    assert_eq!(left("tenant", &tenant), 0);
    assert_eq!(left("global", &global), 3_000 - admitted);
    let users_used: u64 = (0..users)
        .map(|u| 50 - left(&format!("user:{u}"), &per_user))
        .sum();
    assert_eq!(
        users_used, admitted,
        "no partial consumption survives a refusal"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrency_places_never_exceed_their_caps_and_all_come_back() {
    let limits = ConcurrencyLimitLayer::builder()
        .rule(Rule::new("per-user").key(Header::from_static("x-user")), 3)
        .total(8)
        .build()
        .unwrap();
    let inside = Arc::new(AtomicU64::new(0));
    let peak = Arc::new(AtomicU64::new(0));
    let per_user: Arc<Vec<AtomicU64>> = Arc::new((0..5).map(|_| AtomicU64::new(0)).collect());
    let user_peak: Arc<Vec<AtomicU64>> = Arc::new((0..5).map(|_| AtomicU64::new(0)).collect());
    let service = {
        let (inside, peak) = (inside.clone(), peak.clone());
        let (per_user, user_peak) = (per_user.clone(), user_peak.clone());
        limits.layer(tower::service_fn(move |r: Request<String>| {
            let (inside, peak) = (inside.clone(), peak.clone());
            let (per_user, user_peak) = (per_user.clone(), user_peak.clone());
            async move {
                let u: usize = r.headers()["x-user"].to_str().unwrap().parse().unwrap();
                peak.fetch_max(inside.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                user_peak[u].fetch_max(
                    per_user[u].fetch_add(1, Ordering::SeqCst) + 1,
                    Ordering::SeqCst,
                );
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                per_user[u].fetch_sub(1, Ordering::SeqCst);
                inside.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, std::convert::Infallible>(Response::new(String::new()))
            }
        }))
    };
    let tasks: Vec<_> = (0..4_000)
        .map(|i| {
            let service = service.clone();
            tokio::spawn(async move {
                let request = Request::builder()
                    .header("x-user", (i % 5).to_string())
                    .body(String::new())
                    .unwrap();
                service.oneshot(request).await.unwrap().status()
            })
        })
        .collect();
    let (mut ok, mut refused) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => refused += 1,
            other => panic!("{other}"),
        }
    }
    assert_eq!(ok + refused, 4_000);
    assert!(ok > 0);
    assert!(peak.load(Ordering::SeqCst) <= 8, "total cap");
    for u in 0..5 {
        assert!(user_peak[u].load(Ordering::SeqCst) <= 3, "user {u}");
        assert_eq!(limits.in_flight("per-user", &u.to_string()), 0);
    }
    assert_eq!(limits.total_in_flight(), 0);
    assert_eq!(inside.load(Ordering::SeqCst), 0);
}
