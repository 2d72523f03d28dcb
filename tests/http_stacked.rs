//! Stacked rules (user, tenant, global) through a real server: a request is admitted only if
//! every rule admits it, and a refused request consumes from none of them.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::{ok_client, store};
use tollgate::key::{Global, Header};
use tollgate::limiter::Rule;
use tollgate::{Check, Policy, RateLimitLayer};

fn window(limit: u64) -> Policy {
    Policy::fixed_window(limit, Duration::from_secs(60)).unwrap()
}

#[tokio::test]
async fn stacked_rules_consume_nothing_on_refusal() {
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store.clone())
        .rule(
            Rule::new("user")
                .key(Header::from_static("x-user"))
                .policy(window(2)),
        )
        .rule(
            Rule::new("tenant")
                .key(Header::from_static("x-tenant"))
                .policy(window(3)),
        )
        .rule(Rule::new("global").key(Global).policy(window(100)))
        .build()
        .unwrap();
    let client = ok_client(layer).await;
    let get = |user: &'static str| {
        let client = client.clone();
        async move {
            client
                .get_with("/", &[("x-user", user), ("x-tenant", "acme")])
                .await
        }
    };

    let a1 = get("alice").await;
    assert_eq!(a1.status, StatusCode::OK);
    assert_eq!(
        a1.header("ratelimit-policy"),
        Some(r#""user";q=2;w=60, "tenant";q=3;w=60, "global";q=100;w=60"#)
    );
    assert_eq!(a1.ratelimit(), ("user".into(), 1, 60));
    assert_eq!(get("alice").await.ratelimit(), ("user".into(), 0, 60));

    // Alice is over her limit; the refusal names her rule and costs the tenant nothing.
    for _ in 0..5 {
        let refused = get("alice").await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.json()["violated-policies"][0], "user");
    }
    let b1 = get("bob").await;
    assert_eq!(b1.status, StatusCode::OK, "the tenant still had one left");
    assert_eq!(b1.ratelimit(), ("tenant".into(), 0, 60));

    // Now the tenant is out: Bob is refused by it, and his own count stays at one.
    let refused = get("bob").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.json()["violated-policies"][0], "tenant");
    let peek = |key: &'static str, limit| {
        let policy = window(limit);
        let store = store.clone();
        async move {
            store
                .check_all(&[Check::new(key, &policy, 0)])
                .await
                .unwrap()
                .remaining()
        }
    };
    assert_eq!(peek("bob@user", 2).await, 1);
    assert_eq!(peek("alice@user", 2).await, 0);
    assert_eq!(peek("acme@tenant", 3).await, 0);
    assert_eq!(
        peek("@global", 100).await,
        97,
        "only the three admitted requests"
    );
}

/// A per-address bucket and a search quota (requests with `x-search`), costing 1 and 5.
fn ip_and_search<St: tollgate::Store>(store: St) -> RateLimitLayer<St> {
    RateLimitLayer::builder(store)
        .rule(
            Rule::new("per-ip")
                .key(Header::from_static("x-ip"))
                .policy(tollgate::Policy::token_bucket(tollgate::Rate::per_second(1), 20).unwrap()),
        )
        .rule(
            Rule::new("search")
                .key(Header::from_static("x-search"))
                .on_missing_key(tollgate::limiter::MissingKey::Skip)
                .cost(5)
                .policy(window(30)),
        )
        .build()
        .unwrap()
}

/// `RateLimit` names the policy that runs out first for requests like this one: after one
/// search, 19 more requests fit the address's bucket but only 5 more searches fit the quota.
async fn names_the_policy_that_runs_out_first<St: tollgate::Store>(store: St) {
    let client = ok_client(ip_and_search(store)).await;
    let searching = [("x-ip", "192.0.2.1"), ("x-search", "all")];
    let search = client.get_with("/", &searching).await;
    assert_eq!(search.status, StatusCode::OK);
    let (name, remaining, _) = search.ratelimit();
    assert_eq!((name.as_str(), remaining), ("search", 25));
    // A request of cost 1 elsewhere: only the address's bucket applies.
    let other = client.get_with("/", &[("x-ip", "192.0.2.1")]).await;
    assert_eq!(other.ratelimit().0, "per-ip");
    // Searches until the quota refuses: the field told the truth each time.
    for left in (0..5).rev() {
        let search = client.get_with("/", &searching).await;
        assert_eq!(search.status, StatusCode::OK);
        assert_eq!(search.ratelimit().0, "search");
        assert_eq!(search.ratelimit().1, left * 5);
    }
    let refused = client.get_with("/", &searching).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.json()["violated-policies"][0], "search");
}

#[tokio::test]
async fn ratelimit_names_the_policy_that_runs_out_first_in_memory() {
    let (store, _clock) = store();
    names_the_policy_that_runs_out_first(store).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn ratelimit_names_the_policy_that_runs_out_first_on_redis() {
    let server = redis_or_skip!();
    let store = tollgate::RedisStore::builder()
        .url(server.url())
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    names_the_policy_that_runs_out_first(store).await;
}
