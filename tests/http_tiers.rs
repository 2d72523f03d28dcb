//! Tiers through a real server: a slow resolver is asked once per key and cache time, the tier
//! picks the policies, unknown tiers fall back to the default, and the cache expires on the
//! limiter's clock. In-process on paused time: concurrent requests for one key share one
//! lookup (single flight), also when the resolver hangs or the request looking up goes away.

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use support::{ok_client, sf_list, store};
use tokio::sync::{Semaphore, mpsc};
use tollgate::clock::TokioClock;
use tollgate::key::Header;
use tollgate::limiter::{MissingKey, Rule, TierResolver, Tiers};
use tollgate::{MemoryStore, Policy, RateLimitLayer};
use tower::{Service, ServiceBuilder, ServiceExt};

#[tokio::test]
async fn a_slow_resolver_is_cached_and_tiers_pick_the_policies() {
    let (store, clock) = store();
    let calls = Arc::new(AtomicUsize::new(0));
    // The resolver stands for a slow database: each answer waits for a permit from the test.
    let gate = Arc::new(Semaphore::new(0));
    let (asked_tx, mut asked) = mpsc::unbounded_channel::<String>();
    let resolver = {
        let (calls, gate) = (calls.clone(), gate.clone());
        move |key: String| {
            calls.fetch_add(1, Ordering::SeqCst);
            let _ = asked_tx.send(key.clone());
            let gate = gate.clone();
            async move {
                gate.acquire().await.unwrap().forget();
                match key.as_str() {
                    "k-pro" => Some("pro".to_owned()),
                    "k-odd" => Some("platinum".to_owned()), // not a tier we know
                    _ => None,
                }
            }
        }
    };
    let window = Duration::from_secs(3600);
    let tiers = Tiers::new(resolver)
        .tier(
            "free",
            [Policy::fixed_window(2, window)
                .unwrap()
                .named("free")
                .unwrap()],
        )
        .tier(
            "pro",
            [Policy::fixed_window(5, window)
                .unwrap()
                .named("pro")
                .unwrap()],
        )
        .default_tier("free")
        .cache_for(Duration::from_secs(30))
        .clock(clock.clone());
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("plan")
                .key(Header::from_static("x-api-key"))
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
                .tiers(tiers),
        )
        .build()
        .unwrap();
    let client = ok_client(layer).await;
    let get = |key: &'static str| {
        let client = client.clone();
        async move { client.get_with("/", &[("x-api-key", key)]).await }
    };

    // The first request waits for the resolver; nothing is answered until it does.
    let first = tokio::spawn(get("k-pro"));
    assert_eq!(asked.recv().await.as_deref(), Some("k-pro"));
    assert!(!first.is_finished());
    gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.ratelimit(), ("pro".into(), 4, 3600));
    assert_eq!(first.policies()["pro"], (5, 3600));

    // Cached: the gate is shut, yet the next requests pass at once.
    for remaining in [3, 2] {
        let answer = tokio::time::timeout(Duration::from_secs(20), get("k-pro"))
            .await
            .expect("a cached tier needs no resolver");
        assert_eq!(answer.ratelimit(), ("pro".into(), remaining, 3600));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // No tier, and an unknown tier: the default (free) tier's policies.
    gate.add_permits(2);
    let anon = get("k-anon").await;
    assert_eq!(anon.ratelimit(), ("free".into(), 1, 3600));
    let odd = get("k-odd").await;
    assert_eq!(odd.ratelimit(), ("free".into(), 1, 3600));
    get("k-anon").await;
    assert_eq!(get("k-anon").await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(calls.load(Ordering::SeqCst), 3);

    // After the cache time the resolver is asked again.
    clock.advance(Duration::from_secs(30));
    gate.add_permits(1);
    let again = get("k-pro").await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    assert_eq!(again.ratelimit().0, "pro");

    // No key at all: the rule's choice (401), and no resolver call.
    assert_eq!(client.get("/").await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

// Single flight: one lookup per key at a time, shared by the requests that wait for it.
// In-process (a service called with `oneshot`) on tokio's paused time.

const HOUR: Duration = Duration::from_secs(3600);

/// Tiers of distinct policy names (`{prefix}free`, 100 an hour, the default;
/// `{prefix}pro`, 1,000), timed on tokio's clock.
fn plans(prefix: &str, resolver: impl TierResolver) -> Tiers {
    let policy = |limit, name: &str| {
        Policy::fixed_window(limit, HOUR)
            .unwrap()
            .named(format!("{prefix}{name}"))
            .unwrap()
    };
    Tiers::new(resolver)
        .tier("free", [policy(100, "free")])
        .tier("pro", [policy(1000, "pro")])
        .default_tier("free")
        .clock(TokioClock::new())
}

/// The rule `plan` on `x-api-key` with `tiers`, and a shadow rule with `shadow`'s, in front
/// of a service that answers 200.
fn tiered(
    tiers: Tiers,
    shadow: Option<Tiers>,
) -> impl Service<
    Request<String>,
    Response = Response<String>,
    Error = Infallible,
    Future: Send + 'static,
> + Clone
+ Send
+ 'static {
    let key = || Header::from_static("x-api-key");
    let mut layer = RateLimitLayer::builder(MemoryStore::with_clock(TokioClock::new()))
        .rule(Rule::new("plan").key(key()).tiers(tiers));
    if let Some(shadow) = shadow {
        layer = layer.rule(Rule::new("next-plan").key(key()).tiers(shadow).shadow());
    }
    ServiceBuilder::new()
        .layer(layer.build().unwrap())
        .service(tower::service_fn(|_: Request<String>| async {
            Ok::<_, Infallible>(Response::new(String::from("ok")))
        }))
}

/// A request for `key`: its status, the policy its `RateLimit` field names (the tier that
/// decided it) and what remains of it.
async fn send<S>(service: S, key: &'static str) -> (StatusCode, String, i64)
where
    S: Service<Request<String>, Response = Response<String>, Error = Infallible>,
{
    let request = Request::get("/")
        .header("x-api-key", key)
        .body(String::new())
        .unwrap();
    let response = service.oneshot(request).await.unwrap();
    let field = response.headers()["ratelimit"].to_str().unwrap();
    let (name, params) = sf_list(field).remove(0);
    (response.status(), name, params["r"])
}

/// A resolver that counts its calls and answers `pro` for each permit `gate` gives.
fn gated(calls: &Arc<AtomicUsize>, gate: &Arc<Semaphore>) -> impl TierResolver + use<> {
    let (calls, gate) = (calls.clone(), gate.clone());
    move |_: String| {
        calls.fetch_add(1, Ordering::SeqCst);
        let gate = gate.clone();
        async move {
            gate.acquire().await.unwrap().forget();
            Some("pro".to_owned())
        }
    }
}

/// Lets every spawned request run until it waits on something: paused time moves on to the
/// sleep's end only once every task waits.
async fn idle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

#[tokio::test(start_paused = true)]
async fn concurrent_requests_for_an_unknown_key_share_one_lookup() {
    let (calls, shadow_calls) = (Arc::default(), Arc::default());
    let gate = Arc::new(Semaphore::new(0));
    // The shadow rule's resolver answers at once, as each request comes to it in turn.
    let open = Arc::new(Semaphore::new(1000));
    let service = tiered(
        plans("", gated(&calls, &gate)),
        Some(plans("next-", gated(&shadow_calls, &open))),
    );
    let requests: Vec<_> = (0..100)
        .map(|_| tokio::spawn(send(service.clone(), "k-1")))
        .collect();
    idle().await;
    // All 100 wait for one lookup.
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(requests.iter().all(|r| !r.is_finished()));
    gate.add_permits(1);
    let mut remaining = Vec::new();
    for request in requests {
        let (status, policy, left) = request.await.unwrap();
        assert_eq!((status, policy.as_str()), (StatusCode::OK, "pro"));
        remaining.push(left);
    }
    // Each counted once, all in the pro tier.
    remaining.sort_unstable();
    assert_eq!(remaining, (900..1000).collect::<Vec<_>>());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // The shadow rule's tier too: asked once, not once per request.
    assert_eq!(shadow_calls.load(Ordering::SeqCst), 1);
    // Remembered: the next request asks nothing.
    assert_eq!(send(service, "k-1").await.1, "pro");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn requests_waiting_on_a_hung_resolver_get_the_default_tier_at_the_timeout() {
    let calls = Arc::new(AtomicUsize::new(0));
    let hung = {
        let calls = calls.clone();
        move |_: String| {
            calls.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Option<String>>()
        }
    };
    let service = tiered(plans("", hung), None);
    let start = tokio::time::Instant::now();
    let requests: Vec<_> = (0..100)
        .map(|_| {
            let service = service.clone();
            tokio::spawn(async move {
                let answer = send(service, "k-1").await;
                (answer, start.elapsed())
            })
        })
        .collect();
    for request in requests {
        let ((status, policy, _), waited) = request.await.unwrap();
        assert_eq!((status, policy.as_str()), (StatusCode::OK, "free"));
        assert_eq!(waited, tollgate::limiter::DEFAULT_TIER_TIMEOUT);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // A fallback is not remembered: the next request asks again.
    assert_eq!(send(service, "k-1").await.1, "free");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn when_the_request_looking_up_goes_away_one_waiting_takes_over() {
    let calls = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Semaphore::new(0));
    let service = tiered(plans("", gated(&calls, &gate)), None);
    let leader = tokio::spawn(send(service.clone(), "k-1"));
    idle().await;
    let followers: Vec<_> = (0..3)
        .map(|_| tokio::spawn(send(service.clone(), "k-1")))
        .collect();
    idle().await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the followers wait");
    // Its client gives up mid-lookup: one follower asks in its place.
    leader.abort();
    assert!(leader.await.unwrap_err().is_cancelled());
    idle().await;
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    gate.add_permits(1);
    for follower in followers {
        let (status, policy, _) = follower.await.unwrap();
        assert_eq!((status, policy.as_str()), (StatusCode::OK, "pro"));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A shadow rule's tier lookup never holds a request up: the enforced rules decide first, a
/// refused request asks no resolver at all, and an admitted one goes on while the shadow
/// rule's tier is looked up on a task of its own (one lookup per key at a time), the rule
/// skipping the key until its tier is known. Before the fix, with the shadow resolver hung,
/// every request waited the full second, refused ones too, each asking again (reported:
/// statuses [200, 429, 429], waits [1 s, 1 s, 1 s], 3 calls; here each request waited 1 s).
#[tokio::test(start_paused = true)]
async fn a_shadow_rules_lookup_never_holds_a_request() {
    use tollgate::limiter::ShadowRejection;

    let calls = Arc::new(AtomicUsize::new(0));
    let hung = {
        let calls = calls.clone();
        move |_: String| {
            calls.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Option<String>>()
        }
    };
    let layer = RateLimitLayer::builder(MemoryStore::with_clock(TokioClock::new()))
        .rule(
            Rule::new("per-key")
                .key(Header::from_static("x-api-key"))
                .policy(Policy::fixed_window(2, HOUR).unwrap()),
        )
        .rule(
            Rule::new("next-plan")
                .key(Header::from_static("x-api-key"))
                .tiers(plans("next-", hung))
                .shadow(),
        )
        .build()
        .unwrap();
    let service = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(|_: Request<String>| async {
            Ok::<_, Infallible>(Response::new(String::from("ok")))
        }));
    let request = |key: &'static str| {
        Request::get("/")
            .header("x-api-key", key)
            .body(String::new())
            .unwrap()
    };
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let start = tokio::time::Instant::now();
        let response = service.clone().oneshot(request("k-1")).await.unwrap();
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "no wait for the shadow rule"
        );
        statuses.push(response.status());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    idle().await;
    // Asked once, for the first admitted request, on its own task: the second found the
    // lookup under way, the refused one asked nothing.
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Another key: the same, without waiting either.
    for _ in 0..2 {
        let start = tokio::time::Instant::now();
        let response = service.clone().oneshot(request("k-2")).await.unwrap();
        assert_eq!(
            (response.status(), start.elapsed()),
            (StatusCode::OK, Duration::ZERO)
        );
        assert!(response.extensions().get::<ShadowRejection>().is_none());
        idle().await;
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // A resolver that answers: the key's first admitted request goes on unchecked by the
    // shadow rule, its tier is looked up meanwhile, and the next requests are checked in it.
    let layer = RateLimitLayer::builder(MemoryStore::with_clock(TokioClock::new()))
        .rule(Rule::new("all").policy(Policy::fixed_window(100, HOUR).unwrap()))
        .rule(
            Rule::new("next-plan")
                .key(Header::from_static("x-api-key"))
                .tiers(
                    Tiers::new(|_: String| async { Some("tiny".to_owned()) })
                        .tier("free", [Policy::fixed_window(100, HOUR).unwrap()])
                        .tier("tiny", [Policy::fixed_window(1, HOUR).unwrap()])
                        .clock(TokioClock::new()),
                )
                .shadow(),
        )
        .build()
        .unwrap();
    let service = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(|request: Request<String>| async move {
            let rejected = request.extensions().get::<ShadowRejection>().is_some();
            Ok::<_, Infallible>(Response::new(rejected.to_string()))
        }));
    let mut shadow_rejected = Vec::new();
    for _ in 0..3 {
        let response = service.clone().oneshot(request("k-3")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        shadow_rejected.push(response.into_body());
        idle().await;
    }
    // Unchecked (tier unknown), then 1 of the tier's 1, then refused in shadow.
    assert_eq!(shadow_rejected, ["false", "false", "true"]);
}
