//! Hostile requests through the rate-limit layer: oversized and malformed header values, bytes
//! that are not UTF-8, 10,000 forwarding hops, keys of a megabyte, costs of 0 and `u64::MAX`,
//! and tier resolvers that fail, panic or never answer. For each: no panic, a documented
//! answer, and every other client's quota exactly as it was.
//!
//! The requests go through the real `RateLimitLayer` in front of an axum router (`oneshot`,
//! so that any `HeaderValue` can be sent, with the peer address as a request extension); one
//! test goes over loopback through a real server.

mod support;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use http_body_util::BodyExt;
use support::{Client, ok_app, serve, sf_list, store};
use tollgate::key::{Forwarded, Header, KeyExtractor, MAX_KEY_LEN, PeerIp};
use tollgate::limiter::{MissingKey, Rule, Tiers};
use tollgate::store::BoxError;
use tollgate::{Check, Policy, RateLimitLayer, Store};
use tower::ServiceExt;

const MINUTE: Duration = Duration::from_secs(60);

/// A store that remembers the longest key it was asked about.
#[derive(Clone)]
struct Recording<S> {
    inner: S,
    longest: Arc<AtomicUsize>,
}

impl<S: Store> Recording<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            longest: Arc::default(),
        }
    }

    fn longest(&self) -> usize {
        self.longest.load(Ordering::SeqCst)
    }
}

impl<S: Store> Store for Recording<S> {
    type Future = S::Future;

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        for c in checks {
            self.longest.fetch_max(c.key().len(), Ordering::SeqCst);
        }
        self.inner.check_all(checks)
    }

    fn max_key_len(&self) -> Option<usize> {
        self.inner.max_key_len()
    }
}

/// An app with one rule: `key`, a fixed window of `limit` a minute.
fn app<St: Store>(store: St, key: impl KeyExtractor, limit: u64) -> Router {
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("r")
                .key(key)
                .policy(Policy::fixed_window(limit, MINUTE).unwrap()),
        )
        .build()
        .unwrap();
    ok_app(layer)
}

/// Sends `GET /` from `peer` with these headers (each one a field line of its own).
async fn send(app: &Router, peer: &str, headers: &[(&str, HeaderValue)]) -> (StatusCode, String) {
    let (status, _, body) = send_full(app, peer, headers).await;
    (status, body)
}

/// [`send`], with the response's headers.
async fn send_full(
    app: &Router,
    peer: &str,
    headers: &[(&str, HeaderValue)],
) -> (StatusCode, HeaderMap, String) {
    let mut request = Request::get("/");
    for (name, value) in headers {
        request = request.header(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.clone(),
        );
    }
    let mut request = request.body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(peer.parse::<SocketAddr>().unwrap());
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// The `r` (remaining) parameter of the response's `RateLimit` field.
fn remaining(headers: &HeaderMap) -> i64 {
    let field = headers
        .get("ratelimit")
        .expect("RateLimit")
        .to_str()
        .unwrap();
    let list = sf_list(field);
    assert_eq!(list.len(), 1, "{field}");
    list[0].1["r"]
}

fn value(text: &str) -> HeaderValue {
    HeaderValue::from_str(text).unwrap()
}

/// How many of `n` requests are admitted (the rest must be 429).
async fn admitted(app: &Router, n: usize, peer: &str, headers: &[(&str, HeaderValue)]) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        match send(app, peer, headers).await.0 {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("{other}"),
        }
    }
    ok
}

#[tokio::test]
async fn api_keys_of_a_megabyte_or_not_utf8_are_hashed_or_escaped_and_limited_like_any_other() {
    hostile_api_keys(store().0).await;
}

/// The API keys of a megabyte, of bytes that are not UTF-8, and empty, through a rule of 3 a
/// minute keyed by `x-api-key` on `store`.
async fn hostile_api_keys<St: Store + Clone>(store: St) {
    let store = Recording::new(store);
    let app = app(store.clone(), Header::from_static("x-api-key"), 3);
    let good = [("x-api-key", value("good-key"))];
    assert_eq!(admitted(&app, 1, "192.0.2.1:1", &good).await, 1);

    // A key of a megabyte: replaced by its hash, so the store never sees more than
    // MAX_KEY_LEN bytes, and limited like any key (3 admitted, then 429).
    let mega = "k".repeat(1 << 20);
    let huge = [("x-api-key", value(&mega))];
    assert_eq!(admitted(&app, 5, "192.0.2.2:1", &huge).await, 3);
    assert!(store.longest() <= MAX_KEY_LEN, "{}", store.longest());
    // A megabyte differing in its last byte is another key: hashes do not merge them.
    let mut other = mega.clone();
    other.pop();
    other.push('j');
    assert_eq!(
        admitted(&app, 1, "192.0.2.2:1", &[("x-api-key", value(&other))]).await,
        1
    );
    // A megabyte of bytes that are not UTF-8 (3 MB once escaped): hashed too.
    let binary = HeaderValue::from_bytes(&vec![0xff; 1 << 20]).unwrap();
    assert_eq!(
        admitted(&app, 4, "192.0.2.2:1", &[("x-api-key", binary)]).await,
        3
    );
    assert!(store.longest() <= MAX_KEY_LEN, "{}", store.longest());

    // A short key that is not UTF-8 is its escaped bytes, a key of its own: neither the text
    // that spells its escape nor the good client's key.
    let latin1 = HeaderValue::from_bytes(b"caf\xe9").unwrap();
    assert_eq!(
        admitted(&app, 4, "192.0.2.3:1", &[("x-api-key", latin1)]).await,
        3
    );
    assert_eq!(
        admitted(&app, 1, "192.0.2.3:1", &[("x-api-key", value("caf%e9"))]).await,
        1
    );

    // An empty key is no key: by default the rule refuses it with a 500 naming the rule.
    let (status, body) = send(&app, "192.0.2.4:1", &[("x-api-key", value(""))]).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(body.contains(r#"Rule \"r\" found no key"#), "{body}");

    // The good client still has exactly its two requests left.
    assert_eq!(admitted(&app, 5, "192.0.2.1:1", &good).await, 2);
}

#[tokio::test]
async fn ten_thousand_forwarding_hops_cost_a_bounded_walk_and_give_one_stable_key() {
    forwarding_hops(store().0, store().0).await;
}

/// 10,000 forwarding hops through a rule of 2 a minute keyed by the client behind 10.0.0.0/8,
/// on `store`; the RFC 7239 header through the same rule on `rfc7239` (state of its own).
async fn forwarding_hops<St: Store + Clone>(store: St, rfc7239: St) {
    let store = Recording::new(store);
    let trusted = || Forwarded::trusting(["10.0.0.0/8"]).unwrap();
    let app = app(store.clone(), trusted(), 2);
    let proxy = "10.0.0.1:1";
    let xff = |v: &str| [("x-forwarded-for", value(v))];
    assert_eq!(admitted(&app, 1, proxy, &xff("192.0.2.1")).await, 1);

    // 10,000 client addresses, then our proxy: the hop next to the proxy is the client.
    let mut chain: Vec<String> = (0..10_000)
        .map(|i| format!("198.51.{}.{}", i / 256 % 256, i % 256))
        .collect();
    chain.push("10.9.9.9".into());
    let line = chain.join(", ");
    assert_eq!(admitted(&app, 3, proxy, &xff(&line)).await, 2);
    // ... which is the address 198.51.39.15 (the 10,000th), and nobody else.
    assert_eq!(admitted(&app, 1, proxy, &xff("198.51.39.15")).await, 0);

    // 10,000 trusted hops: the walk stops after 32 of them, at the last trusted one read, so
    // a client cannot make it read further or mint a key per request.
    let all_trusted: Vec<String> = (0..10_000)
        .map(|i| format!("10.1.{}.{}", i / 256 % 256, i % 256))
        .collect();
    assert_eq!(
        admitted(&app, 3, proxy, &xff(&all_trusted.join(","))).await,
        2
    );
    let thirty_second_from_the_right = &all_trusted[10_000 - 32];
    assert_eq!(
        admitted(&app, 1, proxy, &xff(thirty_second_from_the_right)).await,
        0
    );

    // 10,000 field lines of garbage and bytes that are not UTF-8: the key is the proxy.
    let mut lines: Vec<(&str, HeaderValue)> = Vec::new();
    for i in 0..10_000 {
        let v = if i % 2 == 0 {
            HeaderValue::from_bytes(b"\xff\xfe, 300.1.1.1").unwrap()
        } else {
            value("unknown, ,,, [::1")
        };
        lines.push(("x-forwarded-for", v));
    }
    assert_eq!(admitted(&app, 3, proxy, &lines).await, 2);
    // A megabyte of commas: the same.
    let commas = ",".repeat(1 << 20);
    assert_eq!(admitted(&app, 1, "10.0.0.2:1", &xff(&commas)).await, 1);
    assert!(store.longest() <= MAX_KEY_LEN);

    // The RFC 7239 header: 10,000 elements and an unterminated quote.
    let app7239 = app_rfc7239(rfc7239);
    let forwarded = |v: &str| [("forwarded", value(v))];
    let elements: Vec<String> = (0..10_000)
        .map(|i| format!("for=198.51.{}.{}", i / 256 % 256, i % 256))
        .collect();
    assert_eq!(
        admitted(&app7239, 3, proxy, &forwarded(&elements.join(", "))).await,
        2
    );
    let unterminated = format!("for=\"{}", "\\\"".repeat(50_000));
    assert_eq!(
        admitted(&app7239, 3, proxy, &forwarded(&unterminated)).await,
        2
    );

    // The good client behind the proxy still has exactly one request left.
    assert_eq!(admitted(&app, 3, proxy, &xff("192.0.2.1")).await, 1);
}

fn app_rfc7239<St: Store>(store: St) -> Router {
    let key = Forwarded::trusting(["10.0.0.0/8"]).unwrap().rfc7239();
    app(store, key, 2)
}

#[tokio::test]
async fn the_peer_address_ignores_whatever_headers_a_client_sends() {
    peer_address_ignores_headers(store().0).await;
}

/// Forwarding headers of 10,000 hops, bad bytes and a megabyte through a rule keyed by the
/// peer address, on `store`.
async fn peer_address_ignores_headers<St: Store>(store: St) {
    let app = app(store, PeerIp::new(), 2);
    let hostile = [
        ("x-forwarded-for", value(&"203.0.113.9, ".repeat(10_000))),
        ("forwarded", HeaderValue::from_bytes(b"for=\xff\"").unwrap()),
        ("x-real-ip", value(&"9".repeat(1 << 20))),
    ];
    assert_eq!(admitted(&app, 3, "192.0.2.7:1", &hostile).await, 2);
    // The headers were not its key: without them, 192.0.2.7 has nothing left.
    assert_eq!(admitted(&app, 1, "192.0.2.7:1", &[]).await, 0);
    assert_eq!(admitted(&app, 3, "192.0.2.8:1", &[]).await, 2);
}

#[tokio::test]
async fn costs_of_zero_and_u64_max_are_bounded() {
    costs_of_zero_and_max(store().0).await;
}

/// Costs of 0 and `u64::MAX` through a rule of 5 a minute keyed by the peer address, on
/// `store`.
async fn costs_of_zero_and_max<St: Store>(store: St) {
    // The cost comes from a header the client chooses (a bad idea, but possible): the cost
    // closure returns 0, u64::MAX, or 1.
    let cost = |parts: &http::request::Parts| match parts.headers.get("x-cost") {
        Some(v) if v == "0" => 0,
        Some(v) if v == "max" => u64::MAX,
        _ => 1,
    };
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("r")
                .key(PeerIp::new())
                .cost_fn(cost)
                .policy(Policy::fixed_window(5, MINUTE).unwrap()),
        )
        .build()
        .unwrap();
    let app = ok_app(layer);
    let zero = [("x-cost", value("0"))];
    let max = [("x-cost", value("max"))];

    // Cost 0 is admitted and consumes nothing: the next request of cost 1 leaves 4.
    assert_eq!(admitted(&app, 100, "192.0.2.1:1", &zero).await, 100);
    let (status, headers, _) = send_full(&app, "192.0.2.1:1", &[]).await;
    assert_eq!((status, remaining(&headers)), (StatusCode::OK, 4));
    assert_eq!(admitted(&app, 5, "192.0.2.1:1", &[]).await, 4);
    // On a spent quota, cost 0 still fits (0 more than the limit is not over it), and
    // changes nothing: the next request of cost 1 is refused, nothing remaining.
    let (status, _) = send(&app, "192.0.2.1:1", &zero).await;
    assert_eq!(status, StatusCode::OK);
    let (status, headers, _) = send_full(&app, "192.0.2.1:1", &[]).await;
    assert_eq!(
        (status, remaining(&headers)),
        (StatusCode::TOO_MANY_REQUESTS, 0)
    );

    // u64::MAX can never be admitted: refused as over the limit, on a fresh quota as on one
    // already touched, with no Retry-After (no wait would do), taking nothing. No overflow.
    for peer in ["192.0.2.2:1", "192.0.2.3:1"] {
        if peer == "192.0.2.3:1" {
            assert_eq!(admitted(&app, 1, peer, &[]).await, 1);
        }
        let (status, headers, body) = send_full(&app, peer, &max).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
        assert!(headers.get("retry-after").is_none(), "{body}");
        assert!(body.contains("never be admitted"), "{body}");
    }
    // The refused u64::MAX took nothing: 192.0.2.2 has its five, 192.0.2.3 four.
    assert_eq!(admitted(&app, 6, "192.0.2.2:1", &[]).await, 5);
    let (status, headers, _) = send_full(&app, "192.0.2.3:1", &[]).await;
    assert_eq!((status, remaining(&headers)), (StatusCode::OK, 3));
    assert_eq!(admitted(&app, 4, "192.0.2.3:1", &[]).await, 3);
}

/// A tiered rule keyed by `x-api-key`: "free" allows 2 a minute (the default), "pro" 5.
fn tiered<St: Store>(store: St, tiers: Tiers) -> Router {
    let tiers = tiers
        .tier(
            "free",
            [Policy::fixed_window(2, MINUTE)
                .unwrap()
                .named("free")
                .unwrap()],
        )
        .tier(
            "pro",
            [Policy::fixed_window(5, MINUTE)
                .unwrap()
                .named("pro")
                .unwrap()],
        )
        .default_tier("free");
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("plan")
                .key(Header::from_static("x-api-key"))
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
                .tiers(tiers),
        )
        .build()
        .unwrap();
    ok_app(layer)
}

/// A resolver's boxed answer.
type Answer = Pin<Box<dyn Future<Output = Result<Option<String>, BoxError>> + Send>>;

/// The resolver of the tier tests: `pro-*` keys are pro; `slow-*` never answer, `boom-*`
/// panic in the future, `sync-boom-*` panic before returning one, `err-*` fail.
fn resolver(calls: Arc<AtomicUsize>) -> impl Fn(String) -> Answer + Send + Sync + 'static {
    move |key: String| {
        calls.fetch_add(1, Ordering::SeqCst);
        if key.starts_with("sync-boom-") {
            panic!("resolver panicked before answering");
        }
        Box::pin(async move {
            if key.starts_with("slow-") {
                std::future::pending::<()>().await;
            }
            if key.starts_with("boom-") {
                panic!("resolver panicked while answering");
            }
            if key.starts_with("err-") {
                return Err("database unreachable".into());
            }
            Ok(key.starts_with("pro-").then(|| "pro".to_owned()))
        })
    }
}

fn api_key(key: &str) -> [(&'static str, HeaderValue); 1] {
    [("x-api-key", value(key))]
}

#[tokio::test(start_paused = true)]
async fn a_resolver_that_never_answers_is_cut_off_at_the_timeout_and_the_default_tier_applies() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = tiered(store().0, Tiers::new(resolver(calls.clone())));
    let start = tokio::time::Instant::now();
    let (status, _) = send(&app, "192.0.2.1:1", &api_key("slow-1")).await;
    assert_eq!(status, StatusCode::OK);
    // Exactly the default timeout, 1 s, of tokio's (paused) time.
    assert_eq!(start.elapsed(), tollgate::limiter::DEFAULT_TIER_TIMEOUT);
    // The default tier's 2, and nothing remembered: each request asks again.
    assert_eq!(
        admitted(&app, 3, "192.0.2.1:1", &api_key("slow-1")).await,
        1
    );
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    assert_eq!(start.elapsed(), Duration::from_secs(4));

    // The timeout is the rule's to set.
    let app = tiered(
        store().0,
        Tiers::new(resolver(calls.clone())).timeout(Duration::from_millis(250)),
    );
    let start = tokio::time::Instant::now();
    assert_eq!(
        send(&app, "192.0.2.1:1", &api_key("slow-2")).await.0,
        StatusCode::OK
    );
    assert_eq!(start.elapsed(), Duration::from_millis(250));
    // A resolver that answers in time is unaffected, and remembered.
    assert_eq!(admitted(&app, 6, "192.0.2.1:1", &api_key("pro-1")).await, 5);
    assert_eq!(start.elapsed(), Duration::from_millis(250));
}

#[tokio::test(start_paused = true)]
async fn a_resolver_that_never_answers_holds_no_other_request() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = tiered(store().0, Tiers::new(resolver(calls.clone())));
    let slow = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, "192.0.2.1:1", &api_key("slow-1")).await })
    };
    tokio::task::yield_now().await;
    let start = tokio::time::Instant::now();
    // Meanwhile a pro client is served at once.
    assert_eq!(admitted(&app, 6, "192.0.2.2:1", &api_key("pro-1")).await, 5);
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert!(!slow.is_finished());
    assert_eq!(slow.await.unwrap().0, StatusCode::OK);
}

#[tokio::test]
async fn a_resolver_that_fails_or_panics_gives_the_default_tier_and_is_asked_again() {
    for key in ["err-1", "boom-1", "sync-boom-1"] {
        let calls = Arc::new(AtomicUsize::new(0));
        let app = tiered(store().0, Tiers::new(resolver(calls.clone())));
        // The default tier (free, 2 a minute), not a dropped connection nor a 5xx.
        assert_eq!(
            admitted(&app, 3, "192.0.2.1:1", &api_key(key)).await,
            2,
            "{key}"
        );
        // Not remembered: every request asked.
        assert_eq!(calls.load(Ordering::SeqCst), 3, "{key}");
        // The service goes on: a pro client gets its 5.
        assert_eq!(
            admitted(&app, 6, "192.0.2.2:1", &api_key("pro-1")).await,
            5,
            "{key}"
        );
    }
}

#[tokio::test]
async fn a_plain_option_resolver_still_works_and_none_is_remembered() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let app = tiered(
        store().0,
        Tiers::new(move |key: String| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move { (key == "pro-1").then(|| "pro".to_owned()) }
        }),
    );
    assert_eq!(admitted(&app, 3, "192.0.2.1:1", &api_key("x")).await, 2);
    assert_eq!(admitted(&app, 6, "192.0.2.1:1", &api_key("pro-1")).await, 5);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// The good clients' admitted counts on `store`, with or without a flood of hostile requests
/// between their requests.
async fn good_clients_admitted<St: Store>(store: St, flood: bool) -> [usize; 3] {
    let calls = Arc::new(AtomicUsize::new(0));
    let tiers = Tiers::new(resolver(calls)).timeout(Duration::from_millis(100));
    let tiers = tiers
        .tier(
            "free",
            [Policy::fixed_window(3, MINUTE)
                .unwrap()
                .named("free")
                .unwrap()],
        )
        .tier(
            "pro",
            [Policy::fixed_window(7, MINUTE)
                .unwrap()
                .named("pro")
                .unwrap()],
        )
        .default_tier("free");
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("per-ip")
                .key(Forwarded::trusting(["10.0.0.0/8"]).unwrap())
                .policy(Policy::fixed_window(10, MINUTE).unwrap()),
        )
        .rule(
            Rule::new("plan")
                .key(Header::from_static("x-api-key"))
                .on_missing_key(MissingKey::Skip)
                .tiers(tiers),
        )
        .build()
        .unwrap();
    let app = ok_app(layer);
    let proxy = "10.0.0.1:1";
    let pro = [
        ("x-forwarded-for", value("192.0.2.1")),
        ("x-api-key", value("pro-good")),
    ];
    let free = [
        ("x-forwarded-for", value("192.0.2.2")),
        ("x-api-key", value("free-good")),
    ];
    let anonymous = [("x-forwarded-for", value("192.0.2.3"))];
    let mega = "m".repeat(1 << 20);
    let many_hops = vec!["198.51.100.1"; 10_000].join(",");
    let mut counts = [0; 3];
    for round in 0..15 {
        if flood {
            let mut hostile = Vec::new();
            for i in 0..200 {
                let n = round * 200 + i;
                let addr = format!("203.0.{}.{}", n / 256 % 256, n % 256);
                let headers = match i % 8 {
                    0 => vec![("x-api-key", value(&format!("slow-{n}")))],
                    1 => vec![("x-api-key", value(&format!("boom-{n}")))],
                    2 => vec![("x-api-key", value(&format!("sync-boom-{n}")))],
                    3 => vec![("x-api-key", value(&format!("err-{n}")))],
                    4 => vec![("x-api-key", value(&mega))],
                    5 => vec![("x-forwarded-for", value(&many_hops))],
                    6 => vec![(
                        "x-api-key",
                        HeaderValue::from_bytes(&[0xff, 0xfe, (n % 256) as u8 | 0x80]).unwrap(),
                    )],
                    // A pro client of its own.
                    _ => vec![("x-api-key", value(&format!("pro-{n}")))],
                };
                let mut headers = headers;
                if i % 8 != 5 {
                    headers.push(("x-forwarded-for", value(&addr)));
                }
                let app = app.clone();
                hostile.push(tokio::spawn(async move {
                    send(&app, "10.0.0.9:1", &headers).await.0
                }));
            }
            for h in hostile {
                let status = h.await.unwrap();
                assert!(
                    status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS,
                    "{status}"
                );
            }
        }
        for (i, headers) in [&pro[..], &free[..], &anonymous[..]]
            .into_iter()
            .enumerate()
        {
            if send(&app, proxy, headers).await.0 == StatusCode::OK {
                counts[i] += 1;
            }
        }
    }
    counts
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_hostile_requests_changes_nothing_a_well_behaved_client_gets() {
    let calm = good_clients_admitted(store().0, false).await;
    // pro: its tier's 7; free: its tier's 3; no API key: its address's 10.
    assert_eq!(calm, [7, 3, 10]);
    // 3,000 hostile requests between theirs (resolvers that time out, panic or fail, keys of
    // a megabyte or not UTF-8, 10,000 hops, new pro clients): exactly the same.
    assert_eq!(good_clients_admitted(store().0, true).await, calm);
}

#[tokio::test]
async fn over_loopback_a_header_flood_is_answered_and_the_neighbours_keep_their_quota() {
    header_flood_over_loopback(store().0).await;
}

/// 10,000 hops over loopback, through a real server, on `store`.
async fn header_flood_over_loopback<St: Store>(store: St) {
    // The loopback address plays the trusted proxy.
    let key = Forwarded::trusting(["127.0.0.0/8"]).unwrap();
    let client = Client::new(serve(app(store, key, 2)).await);
    let hops: Vec<String> = (0..10_000)
        .map(|i| format!("198.51.{}.{}", i / 256 % 256, i % 256))
        .collect();
    let line = hops.join(",");
    for expected in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        let answer = client.get_with("/", &[("x-forwarded-for", &line)]).await;
        assert_eq!(answer.status, expected);
    }
    // They were counted against the hop next to the proxy, the 10,000th.
    let last_hop = client
        .get_with("/", &[("x-forwarded-for", "198.51.39.15")])
        .await;
    assert_eq!(last_hop.status, StatusCode::TOO_MANY_REQUESTS);
    let neighbour = client
        .get_with("/", &[("x-forwarded-for", "192.0.2.1")])
        .await;
    assert_eq!(neighbour.status, StatusCode::OK);
}

/// The same hostile requests on the Redis store, behind a `ResilientStore` as a production
/// service runs it; then the keyspace, to see what the requests wrote to Redis.
///
/// These run on tokio's real clock: paused, it would jump ahead while a call waits on Redis
/// and fire the call's timeout. No decision depends on the machine's speed (the scripts read
/// a clock that never moves); only the flood's hanging tier resolvers wait out their 100 ms.
#[cfg(feature = "redis")]
mod on_redis {
    use super::*;
    use support::RedisServer;
    use tollgate::RedisStore;
    use tollgate::clock::ManualClock;
    use tollgate::store::{FailurePolicy, ResilientStore};

    /// Generous: these tests are about answers and keys, not speed, and CI machines stall.
    const SLOW_MACHINE: Duration = Duration::from_secs(5);

    /// The longest key name the store writes for any key: the prefix, `{` a 16-digit tag `}:`,
    /// the algorithm, `:` a 16-digit fingerprint `:`, and at most 128 bytes of escaped key (a
    /// longer one is `#` and a SHA-256 of 64 digits).
    fn longest_name(prefix: &str) -> usize {
        prefix.len() + 19 + 4 + 18 + 128
    }

    /// The Redis store on `server` under `prefix`, behind a `ResilientStore` that fails open
    /// (as the soak runs it). The scripts read the time from a clock that never moves, so a
    /// minute's window cannot end in the middle of a test.
    async fn resilient(server: &RedisServer, prefix: &str) -> ResilientStore<RedisStore> {
        let redis = RedisStore::builder()
            .url(server.url())
            .prefix(prefix)
            .injected_clock(ManualClock::new())
            .timeout(SLOW_MACHINE)
            .connect()
            .await
            .unwrap();
        ResilientStore::builder(redis)
            .timeout(SLOW_MACHINE)
            .failure_policy(FailurePolicy::Open)
            .build()
    }

    /// Every call reached Redis and was answered by it: no failure, no open breaker, nothing
    /// admitted by the failure policy.
    fn assert_redis_answered_every_call(store: &ResilientStore<RedisStore>) {
        let stats = store.stats();
        assert_eq!(
            (
                stats.failures,
                stats.short_circuited,
                stats.failed_open,
                stats.breaker_opened
            ),
            (0, 0, 0, 0),
            "{stats:?}"
        );
    }

    /// Every key on `server` with its PTTL, read by one script (`support::keys_with_ttl` runs
    /// `redis-cli` once a key, and the flood writes thousands). A name holding a line break
    /// would misalign the reply, and fail the parse.
    fn keys_with_ttl(server: &RedisServer) -> Vec<(String, i64)> {
        let script = "local out = {} \
            for _, k in ipairs(redis.call('KEYS', '*')) do \
                out[#out + 1] = k; out[#out + 1] = redis.call('PTTL', k) \
            end \
            return out";
        let reply = server.cli(&["EVAL", script, "0"]);
        let lines: Vec<&str> = reply.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(lines.len() % 2, 0, "{reply}");
        lines
            .chunks(2)
            .map(|pair| {
                let ttl = pair[1].parse().unwrap_or_else(|_| panic!("{pair:?}"));
                (pair[0].to_owned(), ttl)
            })
            .collect()
    }

    /// Every key name on `server`, after checking that each is under one of `prefixes`,
    /// bounded in length, printable ASCII whose only braces are our hash tag, and expires.
    fn written_keys(server: &RedisServer, prefixes: &[&str]) -> Vec<String> {
        let keys = keys_with_ttl(server);
        for (name, ttl) in &keys {
            let Some(ours) = prefixes
                .iter()
                .find(|p| name.starts_with(&format!("{p}{{")))
            else {
                panic!("{name:?} is outside the prefixes {prefixes:?}");
            };
            assert!(
                name.len() <= longest_name(ours),
                "{} bytes: {name}",
                name.len()
            );
            assert!(name.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{name:?}");
            assert_eq!(name.matches('{').count(), 1, "{name}");
            assert_eq!(name.matches('}').count(), 1, "{name}");
            assert!(*ttl > 0, "{name} has no expiry ({ttl})");
        }
        keys.into_iter().map(|(name, _)| name).collect()
    }

    /// How many of `keys` are under `prefix`.
    fn under(keys: &[String], prefix: &str) -> usize {
        keys.iter().filter(|k| k.starts_with(prefix)).count()
    }

    #[tokio::test]
    async fn api_keys_of_a_megabyte_or_not_utf8_are_answered_limited_and_stored_bounded() {
        let server = redis_or_skip!();
        let store = resilient(&server, "hostile:").await;
        hostile_api_keys(store.clone()).await;

        // A key just short of MAX_KEY_LEN whose every byte the store escapes: the limiter
        // passes it as it is, and the store, not the limiter, must keep its name bounded.
        let braces = "{}".repeat(75);
        let app = app(store.clone(), Header::from_static("x-api-key"), 3);
        assert_eq!(
            admitted(&app, 4, "192.0.2.5:1", &[("x-api-key", value(&braces))]).await,
            3
        );

        // A short key that spells a hash tag: escaped, so that the only braces of its name
        // are the store's own (a client cannot pick the Cluster slot).
        assert_eq!(
            admitted(&app, 4, "192.0.2.6:1", &[("x-api-key", value("{slot}"))]).await,
            3
        );

        assert_redis_answered_every_call(&store);
        // One key each: the good key, the two megabytes, the binary megabyte, the Latin-1
        // key, the text of its escape, the braces and the tag. The empty key wrote nothing.
        let keys = written_keys(&server, &["hostile:"]);
        assert_eq!(keys.len(), 8, "{keys:#?}");
    }

    #[tokio::test]
    async fn ten_thousand_forwarding_hops_give_one_stable_key_each() {
        let server = redis_or_skip!();
        let xff = resilient(&server, "xff:").await;
        let rfc7239 = resilient(&server, "rfc7239:").await;
        forwarding_hops(xff.clone(), rfc7239.clone()).await;
        assert_redis_answered_every_call(&xff);
        assert_redis_answered_every_call(&rfc7239);

        let keys = written_keys(&server, &["xff:", "rfc7239:"]);
        // One key per client the walk found, however many hops it was sent: the good client,
        // the 10,000th hop, the 32nd trusted hop from the right, and the two proxies whose
        // headers were garbage.
        assert_eq!(under(&keys, "xff:"), 5, "{keys:#?}");
        // The 10,000th element, and the proxy for the unterminated quote.
        assert_eq!(under(&keys, "rfc7239:"), 2, "{keys:#?}");
    }

    #[tokio::test]
    async fn the_peer_address_ignores_whatever_headers_a_client_sends() {
        let server = redis_or_skip!();
        let store = resilient(&server, "peer:").await;
        peer_address_ignores_headers(store.clone()).await;
        assert_redis_answered_every_call(&store);
        assert_eq!(written_keys(&server, &["peer:"]).len(), 2);
    }

    #[tokio::test]
    async fn costs_of_zero_and_u64_max_are_bounded_and_corrupt_nothing() {
        let server = redis_or_skip!();
        let store = resilient(&server, "cost:").await;
        costs_of_zero_and_max(store.clone()).await;
        assert_redis_answered_every_call(&store);
        assert_eq!(written_keys(&server, &["cost:"]).len(), 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flood_of_hostile_requests_changes_nothing_a_well_behaved_client_gets() {
        let server = redis_or_skip!();
        let calm_store = resilient(&server, "calm:").await;
        let calm = good_clients_admitted(calm_store.clone(), false).await;
        assert_eq!(calm, [7, 3, 10]);
        let flood_store = resilient(&server, "flood:").await;
        assert_eq!(good_clients_admitted(flood_store.clone(), true).await, calm);
        // Redis answered every one of the 3,000 hostile requests and the good ones, and kept
        // every key bounded and expiring.
        assert_redis_answered_every_call(&calm_store);
        assert_redis_answered_every_call(&flood_store);
        let keys = written_keys(&server, &["calm:", "flood:"]);
        // Calm: the three addresses and the two API keys. Flooded: those 5, and at most one
        // key per rule for each of the 3,000 hostile requests (the 375 that send the same
        // megabyte key share one).
        assert_eq!(under(&keys, "calm:"), 5, "{keys:#?}");
        assert!(under(&keys, "flood:") <= 2 * 3_000 + 5, "{}", keys.len());
    }

    #[tokio::test]
    async fn over_loopback_a_header_flood_is_answered_and_the_neighbours_keep_their_quota() {
        let server = redis_or_skip!();
        let store = resilient(&server, "loopback:").await;
        header_flood_over_loopback(store.clone()).await;
        assert_redis_answered_every_call(&store);
        assert_eq!(written_keys(&server, &["loopback:"]).len(), 2);
    }
}
