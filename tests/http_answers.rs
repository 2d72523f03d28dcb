//! What clients see, through a real axum server over loopback: the IETF fields on admitted and
//! refused responses (parsed back as Structured Fields), 429 with Retry-After, no-store and a
//! problem+json body, the legacy profile, 503 for a failing store, missing keys, a custom
//! responder, the decision handed to the handler, and what `t` says for each algorithm (on
//! the in-process store and on Redis).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::routing::get;
use axum::{Extension, Router};
use bytes::Bytes;
use http::{Response, StatusCode};
use support::{Client, DownStore, serve, store};
use tollgate::clock::{Clock, ManualClock};
use tollgate::http::{HeaderProfile, Rejection, RejectionKind, ResetFormat};
use tollgate::key::{Header, PeerIp};
use tollgate::limiter::{MissingKey, Rule};
use tollgate::{Decision, Policy, Rate, RateLimitLayer, Store};

/// An app whose handler counts the requests it sees.
fn app<St: Store + Clone>(layer: RateLimitLayer<St>) -> (Router, Arc<AtomicUsize>) {
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    let app = Router::new()
        .route(
            "/",
            get(move || {
                counter.fetch_add(1, Ordering::SeqCst);
                async { "hello" }
            }),
        )
        .layer(layer);
    (app, seen)
}

fn burst_and_minute() -> Rule {
    Rule::new("per-ip").key(PeerIp::new()).policies([
        Policy::gcra(Rate::per_second(1), 3)
            .unwrap()
            .named("burst")
            .unwrap(),
        Policy::fixed_window(100, Duration::from_secs(60))
            .unwrap()
            .named("per-minute")
            .unwrap(),
    ])
}

#[tokio::test]
async fn admitted_responses_carry_the_ietf_fields() {
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(burst_and_minute())
        .build()
        .unwrap();
    let (app, _) = app(layer);
    let client = Client::new(serve(app).await);

    let first = client.get("/").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.text(), "hello");
    // The exact bytes, and the same parsed back as a Structured Fields List.
    assert_eq!(
        first.header("ratelimit-policy"),
        Some(r#""burst";q=3;w=3, "per-minute";q=100;w=60"#)
    );
    let policies = first.policies();
    assert_eq!(policies["burst"], (3, 3));
    assert_eq!(policies["per-minute"], (100, 60));
    // The policy closest to exhaustion: 2 of 3 left in the burst, one more back in 1 s.
    assert_eq!(first.header("ratelimit"), Some(r#""burst";r=2;t=1"#));
    assert_eq!(first.ratelimit(), ("burst".into(), 2, 1));
    assert!(first.header("retry-after").is_none());
    assert!(first.header("x-ratelimit-limit").is_none());

    // 1 left: full again in 2 s, but `t` is the time until more quota, one unit, in 1 s.
    let second = client.get("/").await;
    assert_eq!(second.ratelimit(), ("burst".into(), 1, 1));
}

#[tokio::test]
async fn refusals_are_429_with_retry_after_no_store_and_a_problem() {
    let (store, clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(burst_and_minute())
        .build()
        .unwrap();
    let (app, seen) = app(layer);
    let client = Client::new(serve(app).await);

    for _ in 0..3 {
        assert_eq!(client.get("/").await.status, StatusCode::OK);
    }
    let refused = client.get("/").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        seen.load(Ordering::SeqCst),
        3,
        "the handler never saw the refusal"
    );

    let retry_after = refused.retry_after().unwrap();
    assert_eq!(retry_after, 1);
    let (name, remaining, t) = refused.ratelimit();
    assert_eq!((name.as_str(), remaining), ("burst", 0));
    assert!(
        t as u64 <= retry_after,
        "t={t} later than Retry-After={retry_after}"
    );
    assert_eq!(refused.policies().len(), 2);
    assert_eq!(refused.header("cache-control"), Some("no-store"));
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json")
    );

    let problem = refused.json();
    assert_eq!(
        problem["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(problem["status"], 429);
    assert!(problem["title"].as_str().unwrap().contains("quota"));
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("\"burst\" allows 3 per 3 s"), "{detail}");
    assert_eq!(problem["violated-policies"], serde_json::json!(["burst"]));
    assert_eq!(problem["retry-after"], 1);

    // A refusal consumed nothing: exactly one interval later, one more request passes.
    clock.advance(Duration::from_secs(1));
    assert_eq!(client.get("/").await.status, StatusCode::OK);
    assert_eq!(client.get("/").await.status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn retry_after_rounds_up_and_t_never_exceeds_it() {
    let (store, clock) = store();
    // One request every 2.5 s.
    let rule = Rule::new("slow")
        .key(PeerIp::new())
        .policy(Policy::gcra(Rate::new(2, Duration::from_secs(5)), 1).unwrap());
    let layer = RateLimitLayer::builder(store).rule(rule).build().unwrap();
    let (app, _) = app(layer);
    let client = Client::new(serve(app).await);

    let first = client.get("/").await;
    assert_eq!(first.ratelimit(), ("slow".into(), 0, 3)); // 2.5 s, rounded up
    assert_eq!(first.policies()["slow"], (1, 3));
    let mut last_t = i64::MAX;
    for advance_ms in [0, 500, 1000, 900, 90] {
        clock.advance(Duration::from_millis(advance_ms));
        let refused = client.get("/").await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        let retry_after = refused.retry_after().unwrap();
        let (_, _, t) = refused.ratelimit();
        assert!(t as u64 <= retry_after);
        assert!(retry_after >= 1);
        assert!(t <= last_t);
        last_t = t;
    }
    // 2.49 s have passed: 10 ms to go, announced as 1 s.
    let refused = client.get("/").await;
    assert_eq!(refused.retry_after(), Some(1));
    clock.advance(Duration::from_millis(10));
    assert_eq!(client.get("/").await.status, StatusCode::OK);
}

#[tokio::test]
async fn header_profiles() {
    let rule = || {
        Rule::new("p")
            .key(PeerIp::new())
            .policy(Policy::fixed_window(2, Duration::from_secs(10)).unwrap())
    };
    let serve_with = |profile: HeaderProfile, reset: ResetFormat| {
        let (store, _clock) = store();
        let layer = RateLimitLayer::builder(store)
            .rule(rule())
            .headers(profile)
            .legacy_reset(reset)
            .build()
            .unwrap();
        async move { Client::new(serve(app(layer).0).await) }
    };

    let legacy = serve_with(HeaderProfile::Legacy, ResetFormat::DeltaSeconds).await;
    let ok = legacy.get("/").await;
    assert_eq!(ok.header("x-ratelimit-limit"), Some("2"));
    assert_eq!(ok.header("x-ratelimit-remaining"), Some("1"));
    assert_eq!(ok.header("x-ratelimit-reset"), Some("10"));
    assert!(ok.header("ratelimit").is_none() && ok.header("ratelimit-policy").is_none());
    legacy.get("/").await;
    let refused = legacy.get("/").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(
        refused.header("x-ratelimit-reset"),
        refused.header("retry-after")
    );

    let unix = serve_with(HeaderProfile::Legacy, ResetFormat::UnixSeconds).await;
    let reset: u64 = unix
        .get("/")
        .await
        .header("x-ratelimit-reset")
        .unwrap()
        .parse()
        .unwrap();
    assert!(reset > 1_700_000_000, "a Unix time: {reset}");

    let both = serve_with(HeaderProfile::Both, ResetFormat::DeltaSeconds).await;
    let ok = both.get("/").await;
    assert_eq!(ok.ratelimit(), ("p".into(), 1, 10));
    assert_eq!(ok.header("x-ratelimit-remaining"), Some("1"));

    let off = serve_with(HeaderProfile::Off, ResetFormat::DeltaSeconds).await;
    let ok = off.get("/").await;
    assert!(ok.headers.keys().all(|k| !k.as_str().contains("ratelimit")));
    off.get("/").await;
    let refused = off.get("/").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.retry_after(), Some(10));
    assert!(
        refused
            .headers
            .keys()
            .all(|k| !k.as_str().contains("ratelimit"))
    );
}

#[tokio::test]
async fn a_failing_store_is_503_never_429() {
    let layer = RateLimitLayer::builder(DownStore)
        .rule(
            Rule::new("per-ip")
                .key(PeerIp::new())
                .policy(Policy::gcra(Rate::per_second(1), 1).unwrap()),
        )
        .unavailable_retry_after(Duration::from_millis(4500))
        .build()
        .unwrap();
    let (app, seen) = app(layer);
    let client = Client::new(serve(app).await);
    let answer = client.get("/").await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.retry_after(), Some(5));
    assert_eq!(answer.header("cache-control"), Some("no-store"));
    assert_eq!(answer.json()["status"], 503);
    assert!(answer.header("ratelimit").is_none());
    assert_eq!(seen.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn missing_keys_follow_the_rule() {
    let policy = || Policy::fixed_window(1, Duration::from_secs(60)).unwrap();
    let (first_store, _clock) = store();
    let layer = RateLimitLayer::builder(first_store)
        .rule(
            Rule::new("by-tenant")
                .key(Header::from_static("x-tenant"))
                .on_missing_key(MissingKey::Skip)
                .policy(policy()),
        )
        .rule(
            Rule::new("by-key")
                .path("/")
                .key(Header::from_static("x-api-key"))
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
                .policy(policy()),
        )
        .build()
        .unwrap();
    let (app, seen) = app(layer);
    let app = app.route("/other", get(|| async { "other" }));
    let client = Client::new(serve(app).await);

    let no_key = client.get("/").await;
    assert_eq!(no_key.status, StatusCode::UNAUTHORIZED);
    assert_eq!(no_key.json()["status"], 401);
    assert!(no_key.json()["detail"].as_str().unwrap().contains("by-key"));
    assert_eq!(seen.load(Ordering::SeqCst), 0);

    // The tenant rule is skipped without the header; the key rule applies.
    let ok = client.get_with("/", &[("x-api-key", "k1")]).await;
    assert_eq!(ok.status, StatusCode::OK);
    assert_eq!(ok.policies().len(), 1);
    // A route no rule matches has no fields.
    let other = client.get("/other").await;
    assert_eq!(other.status, StatusCode::OK);
    assert!(other.header("ratelimit").is_none());

    // The default for a rule without a key is a loud 500 (here: no ConnectInfo behind a
    // plain `serve` would do the same for PeerIp).
    let (strict_store, _clock) = store();
    let strict = RateLimitLayer::builder(strict_store)
        .rule(
            Rule::new("strict")
                .key(Header::from_static("x-user"))
                .policy(policy()),
        )
        .build()
        .unwrap();
    let client = Client::new(serve(app_router(strict)).await);
    let answer = client.get("/").await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(answer.json()["detail"].as_str().unwrap().contains("strict"));
}

fn app_router<St: Store + Clone>(layer: RateLimitLayer<St>) -> Router {
    app(layer).0
}

#[tokio::test]
async fn the_responder_is_pluggable() {
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("p")
                .key(PeerIp::new())
                .policy(Policy::fixed_window(1, Duration::from_secs(30)).unwrap()),
        )
        .responder(|rejection: &Rejection<'_>| {
            assert_eq!(rejection.kind(), RejectionKind::Limited);
            assert_eq!(rejection.policy(), Some("p"));
            Response::builder()
                .status(StatusCode::TOO_MANY_REQUESTS)
                .header("content-type", "text/plain")
                .header(
                    "retry-after",
                    rejection.retry_after_secs().unwrap().to_string(),
                )
                .body(Bytes::from("slow down"))
                .unwrap()
        })
        .build()
        .unwrap();
    let client = Client::new(serve(app(layer).0).await);
    client.get("/").await;
    let refused = client.get("/").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.text(), "slow down");
    assert_eq!(refused.retry_after(), Some(30));
    // The fields are still added.
    assert_eq!(refused.ratelimit(), ("p".into(), 0, 30));
}

#[tokio::test]
async fn handlers_read_the_decision() {
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("p")
                .key(PeerIp::new())
                .policy(Policy::fixed_window(5, Duration::from_secs(30)).unwrap()),
        )
        .decision_extension(true)
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            get(|Extension(decision): Extension<Decision>| async move {
                format!("{} of {} left", decision.remaining(), decision.limit())
            }),
        )
        .layer(layer);
    let client = Client::new(serve(app).await);
    assert_eq!(client.get("/").await.text(), "4 of 5 left");
    assert_eq!(client.get("/").await.text(), "3 of 5 left");
}

/// One rule per algorithm, each keyed by its own header (requests without it skip the rule):
/// 3 per 30 s, or for the buckets one unit per 10 s with a burst of 3 (w = 30 as well).
fn one_rule_per_algorithm<St: Store>(store: St) -> RateLimitLayer<St> {
    let every = Duration::from_secs(10);
    let window = Duration::from_secs(30);
    let policies = [
        ("gcra", Policy::gcra(Rate::new(1, every), 3)),
        ("token", Policy::token_bucket(Rate::new(1, every), 3)),
        ("leaky", Policy::leaky_bucket(Rate::new(1, every), 3)),
        ("fixed", Policy::fixed_window(3, window)),
        ("log", Policy::sliding_log(3, window)),
        ("sliding", Policy::sliding_window(3, window)),
    ];
    let mut builder = RateLimitLayer::builder(store);
    for (name, policy) in policies {
        builder = builder.rule(
            Rule::new(name)
                .key(Header::from_static(match name {
                    "gcra" => "x-gcra",
                    "token" => "x-token",
                    "leaky" => "x-leaky",
                    "fixed" => "x-fixed",
                    "log" => "x-log",
                    _ => "x-sliding",
                }))
                .on_missing_key(MissingKey::Skip)
                .policy(policy.unwrap()),
        );
    }
    builder.build().unwrap()
}

/// `t` says when more quota comes, per algorithm (the crate docs' table): a request at 0 s,
/// one at 4 s, then more at 4 s until one is refused. Admitted, `t` never passes `w`; refused,
/// it is `Retry-After`, never less.
async fn t_says_when_more_quota_comes<St: Store + Clone>(store: St, clock: ManualClock) {
    let (app, _) = app(one_rule_per_algorithm(store));
    let client = Client::new(serve(app).await);
    // (header, t at 0 s, t at 4 s)
    let expected = [
        ("x-gcra", 10, 6),     // the next unit: reset_after mod 10 s
        ("x-token", 10, 6),    //
        ("x-leaky", 10, 6),    //
        ("x-fixed", 30, 26),   // the window's end
        ("x-log", 30, 30),     // full recovery: the newest entry's age out
        ("x-sliding", 30, 26), // the current window's end
    ];
    for (header, at_0, at_4) in expected {
        let with = [(header, "k")];
        let get = || client.get_with("/", &with);
        let first = get().await;
        assert_eq!(first.status, StatusCode::OK);
        let (_, r, t) = first.ratelimit();
        assert_eq!((r, t), (2, at_0), "{header} at 0 s");
        clock.advance(Duration::from_secs(4));
        let second = get().await;
        assert_eq!(second.ratelimit().2, at_4, "{header} at 4 s");
        let refused = loop {
            let answer = get().await;
            let (_, _, t) = answer.ratelimit();
            let w = answer.policies().values().next().unwrap().1;
            if answer.status == StatusCode::OK {
                assert!(t <= w, "{header}: t = {t} past w = {w}");
                continue;
            }
            break answer;
        };
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{header}");
        let retry_after = refused.retry_after().unwrap();
        assert_eq!(
            refused.ratelimit().2,
            retry_after as i64,
            "{header}: t == Retry-After"
        );
        // The next algorithm starts at the start of a window.
        let window = 30_000_000_000;
        clock.advance(Duration::from_nanos(window - clock.now() % window));
    }
}

#[tokio::test]
async fn t_says_when_more_quota_comes_in_memory() {
    let (store, clock) = store();
    t_says_when_more_quota_comes(store, clock).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn t_says_when_more_quota_comes_on_redis() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    let store = tollgate::RedisStore::builder()
        .url(server.url())
        .injected_clock(clock.clone())
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    t_says_when_more_quota_comes(store, clock).await;
}

// `t` against the retry it promises, generated.

mod promises {
    use std::convert::Infallible;

    use http::Request;
    use proptest::prelude::*;
    use tower::{ServiceBuilder, ServiceExt};

    use super::support::sf_list;
    use super::*;

    fn policy(algorithm: usize, limit: u64, secs: u64) -> Policy {
        let span = Duration::from_secs(secs);
        match algorithm {
            0 => Policy::gcra(Rate::new(1, span), limit),
            1 => Policy::token_bucket(Rate::new(1, span), limit),
            2 => Policy::leaky_bucket(Rate::new(1, span), limit),
            3 => Policy::fixed_window(limit, span),
            4 => Policy::sliding_log(limit, span),
            _ => Policy::sliding_window(limit, span),
        }
        .unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Whenever a response leaves nothing (`r=0`) or refuses, a client that waits the `t`
        /// it says (on a refusal, also `Retry-After`) and asks again is admitted, for every
        /// algorithm: `t` never sends a client back too early. (Before the fix, the sliding
        /// window said `t` = the current window's end, when the previous window still weighs.)
        #[test]
        fn waiting_t_after_r_0_or_a_refusal_is_enough(
            algorithm in 0usize..6,
            limit in 1u64..6,
            secs in 1u64..20,
            // Half seconds: requests land on whole seconds, where a rounded `t` is exact.
            start in 0u64..60,
            gaps in prop::collection::vec(0u64..30, 1..40),
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let clock = ManualClock::new();
            clock.advance(Duration::from_secs(start));
            let layer = RateLimitLayer::builder(tollgate::MemoryStore::with_clock(clock.clone()))
                .rule(Rule::new("p").policy(policy(algorithm, limit, secs)))
                .build()
                .unwrap();
            let service = ServiceBuilder::new().layer(layer).service(tower::service_fn(
                |_: Request<()>| async { Ok::<_, Infallible>(Response::new(String::new())) },
            ));
            // (status, r, t, Retry-After)
            let send = || {
                let response = runtime
                    .block_on(service.clone().oneshot(Request::new(())))
                    .unwrap();
                let field = response.headers()["ratelimit"].to_str().unwrap().to_owned();
                let (_, params) = sf_list(&field).remove(0);
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().parse::<i64>().unwrap());
                (response.status(), params["r"], params["t"], retry_after)
            };
            for gap in gaps {
                clock.advance(Duration::from_millis(500 * gap));
                let (status, r, t, retry_after) = send();
                if status == StatusCode::OK && r > 0 {
                    continue;
                }
                if status != StatusCode::OK {
                    prop_assert_eq!(Some(t), retry_after, "t is Retry-After");
                }
                clock.advance(Duration::from_secs(t as u64));
                let (again, ..) = send();
                prop_assert_eq!(
                    again,
                    StatusCode::OK,
                    "{:?} said r={};t={} ({})", policy(algorithm, limit, secs), r, t, status
                );
            }
        }
    }
}
