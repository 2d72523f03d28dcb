//! Tiers through a real server: a slow resolver is asked once per key and cache time, the tier
//! picks the policies, unknown tiers fall back to the default, and the cache expires on the
//! limiter's clock.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::StatusCode;
use support::{ok_client, store};
use tokio::sync::{Semaphore, mpsc};
use tollgate::key::Header;
use tollgate::limiter::{MissingKey, Rule, Tiers};
use tollgate::{Policy, RateLimitLayer};

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
