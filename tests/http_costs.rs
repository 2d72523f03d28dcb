//! Weighted costs through a real server: a fixed weight per route and a closure over the
//! request, against one shared bucket.

mod support;

use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use http::{Method, StatusCode};
use support::{Client, ok_client, serve, store};
use tollgate::key::PeerIp;
use tollgate::limiter::Rule;
use tollgate::{Policy, Rate, RateLimitLayer};

#[tokio::test]
async fn expensive_routes_cost_more_from_one_bucket() {
    let (store, clock) = store();
    let layer = RateLimitLayer::builder(store)
        // One bucket per client; a search costs 1, an export 4.
        .rule(
            Rule::new("api")
                .key(PeerIp::new())
                .cost_fn(|parts| if parts.uri.path() == "/export" { 4 } else { 1 })
                .policy(Policy::token_bucket(Rate::per_second(1), 10).unwrap()),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route("/search", get(|| async { "results" }))
        .route("/export", post(|| async { "exported" }));
    let client = Client::new(serve(app.layer(layer)).await);

    let export = || client.send(Method::POST, "/export", &[]);
    // `t`: the next token is back in 1 s (the bucket is full again in 4, then 8).
    assert_eq!(export().await.ratelimit(), ("api".into(), 6, 1));
    assert_eq!(export().await.ratelimit(), ("api".into(), 2, 1));
    // 2 tokens left: an export (4) is refused and waits for exactly 2 more...
    let refused = export().await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.retry_after(), Some(2));
    assert_eq!(refused.ratelimit(), ("api".into(), 2, 2));
    // ...while a search (1) still fits: the refused export took nothing.
    let search = client.get("/search").await;
    assert_eq!(search.status, StatusCode::OK);
    assert_eq!(search.ratelimit(), ("api".into(), 1, 1));
    clock.advance(Duration::from_secs(3));
    assert_eq!(export().await.status, StatusCode::OK);
}

#[tokio::test]
async fn a_fixed_weight_per_route() {
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("export")
                .method(Method::POST)
                .path("/export")
                .key(PeerIp::new())
                .cost(4)
                .policy(Policy::fixed_window(10, Duration::from_secs(60)).unwrap()),
        )
        .build()
        .unwrap();
    let app = Router::new().route(
        "/export",
        post(|| async { "exported" }).get(|| async { "form" }),
    );
    let client = Client::new(serve(app.layer(layer)).await);
    let export = || client.send(Method::POST, "/export", &[]);
    assert_eq!(export().await.ratelimit(), ("export".into(), 6, 60));
    assert_eq!(export().await.ratelimit(), ("export".into(), 2, 60));
    let refused = export().await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.ratelimit(), ("export".into(), 2, 60));
    // GET is not the rule's method: free.
    let form = client.get("/export").await;
    assert_eq!(form.status, StatusCode::OK);
    assert!(form.header("ratelimit").is_none());
}

#[tokio::test]
async fn costs_from_a_closure_over_the_request() {
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("units")
                .key(PeerIp::new())
                // The client says how many items it asks for; the cost is that, at least 1.
                .cost_fn(|parts| {
                    parts
                        .headers
                        .get("x-items")
                        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                        .unwrap_or(1)
                        .max(1)
                })
                .policy(Policy::fixed_window(100, Duration::from_secs(60)).unwrap()),
        )
        .build()
        .unwrap();
    let client = ok_client(layer).await;

    let a = client.get_with("/", &[("x-items", "30")]).await;
    assert_eq!(a.ratelimit(), ("units".into(), 70, 60));
    let b = client.get_with("/", &[("x-items", "not a number")]).await;
    assert_eq!(b.ratelimit(), ("units".into(), 69, 60));
    let c = client.get_with("/", &[("x-items", "70")]).await;
    assert_eq!(c.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(c.ratelimit().1, 69);
    // A cost above the limit can never be admitted: refused as over the limit, with no time to
    // come back at (no `Retry-After`, no `RateLimit`; the quotas are listed), and it consumes
    // nothing.
    let huge = client.get_with("/", &[("x-items", "100000")]).await;
    assert_eq!(huge.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(huge.retry_after(), None);
    assert!(huge.header("ratelimit").is_none());
    assert_eq!(huge.policies()["units"], (100, 60));
    let body = huge.json();
    assert_eq!(body["violated-policies"][0], "units");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("never be admitted")
    );
    assert!(body.get("retry-after").is_none());
    let d = client.get_with("/", &[("x-items", "69")]).await;
    assert_eq!(d.status, StatusCode::OK);
    assert_eq!(d.ratelimit().1, 0);
}

/// The same policy twice in one rule: one state in the store, counted twice per request. It
/// is refused when the layer is built (before the fix the layer was built, admitted 5 of a
/// limit of 10 at cost 1, and answered 503 to every request at cost 6: the store merged the
/// two checks into one above the limit).
#[tokio::test]
async fn a_policy_listed_twice_is_refused_at_build() {
    use tollgate::limiter::LimiterError;
    let policy = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
    for (cost, tiers) in [(1, false), (6, false), (1, true)] {
        let mut rule = Rule::new("dup").cost(cost);
        rule = if tiers {
            rule.tiers(
                tollgate::limiter::Tiers::new(|_: String| async { None })
                    .tier("free", [policy.clone(), policy.clone()]),
            )
        } else {
            rule.policies([policy.clone(), policy.clone()])
        };
        let error = RateLimitLayer::builder(store().0)
            .rule(rule)
            .build()
            .expect_err("refused");
        assert!(
            matches!(
                error,
                LimiterError::DuplicatePolicy {
                    first: 0,
                    again: 1,
                    ..
                }
            ),
            "{error}"
        );
    }
}

/// A store that finds a cost it can never admit answers with an error; the layer answers it
/// as the refusal it is (429, no Retry-After), never as a failure: a 503, which a fail-open
/// policy turns into an admission. Through `ResilientStore` failing open too.
#[tokio::test]
async fn a_cost_a_store_can_never_admit_is_a_refusal_not_a_503() {
    use tollgate::store::{FailurePolicy, ResilientStore};
    use tollgate::{Check, Decision, Store, StoreError};

    /// A store whose every check costs more than its policy's limit, as it says.
    #[derive(Clone)]
    struct OverLimit;

    impl Store for OverLimit {
        type Future = std::future::Ready<Result<Decision, StoreError>>;

        fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
            let last = checks.len() - 1;
            std::future::ready(Err(StoreError::CostExceedsLimit {
                index: last,
                cost: 7,
                limit: checks[last].policy().limit(),
            }))
        }
    }

    let policy = |limit| Policy::fixed_window(limit, Duration::from_secs(60)).unwrap();
    let rules = || {
        [
            Rule::new("one").key(PeerIp::new()).policy(policy(5)),
            Rule::new("two")
                .key(PeerIp::new())
                .policies([policy(5), policy(6)]),
        ]
    };
    for rule in rules() {
        let name = rule.name().to_owned();
        let plain = RateLimitLayer::builder(OverLimit)
            .rule(rule)
            .build()
            .unwrap();
        let client = ok_client(plain).await;
        let answer = client.get("/").await;
        assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS, "{name}");
        assert_eq!(answer.retry_after(), None, "{name}");
        assert!(answer.text().contains("never be admitted"), "{name}");
    }
    for rule in rules() {
        let open = ResilientStore::builder(OverLimit)
            .failure_policy(FailurePolicy::Open)
            .build();
        let layer = RateLimitLayer::builder(open).rule(rule).build().unwrap();
        let answer = ok_client(layer).await.get("/").await;
        assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    }
}
