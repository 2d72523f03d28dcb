//! tollgate as Envoy's rate limit service, end to end over gRPC: a tonic client plays Envoy
//! and calls `ShouldRateLimit` on a real tonic server over loopback. One test per matching
//! rule of envoyproxy/ratelimit (its README's cases, in our words), the all-or-nothing
//! decision, every algorithm against the store itself, bad input, and two servers on one
//! real Redis.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::TcpListener;
use tollgate::answer::HeaderProfile;
use tollgate::clock::ManualClock;
use tollgate::envoy::proto::rate_limit_descriptor::{Entry, RateLimitOverride};
use tollgate::envoy::proto::rate_limit_response::Code;
use tollgate::envoy::proto::rate_limit_service_client::RateLimitServiceClient;
use tollgate::envoy::proto::{
    RateLimitDescriptor, RateLimitRequest, RateLimitResponse, RateLimitUnit,
};
use tollgate::envoy::{Config, RateLimitService};
use tollgate::{Check, Decision, MemoryStore, Policy, Rate, Store, StoreError};
use tonic::transport::Channel;
use tonic::transport::server::TcpIncoming;

/// A memory store on a manual clock that counts its `check_all` calls.
#[derive(Clone)]
struct Counting {
    store: MemoryStore<ManualClock>,
    calls: Arc<AtomicUsize>,
}

impl Store for Counting {
    type Future = <MemoryStore<ManualClock> as Store>::Future;

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.store.check_all(checks)
    }
}

impl Counting {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

fn counting() -> (Counting, ManualClock) {
    let clock = ManualClock::new();
    let store = Counting {
        store: MemoryStore::with_clock(clock.clone()),
        calls: Arc::default(),
    };
    (store, clock)
}

/// Serves `service` on a free loopback port and returns a client: Envoy's side.
async fn serve<S: Store>(service: RateLimitService<S>) -> RateLimitServiceClient<Channel> {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    RateLimitServiceClient::new(channel)
}

fn config(yaml: &str) -> Config {
    Config::from_yaml(yaml).unwrap_or_else(|e| panic!("{e}"))
}

/// A descriptor of `(key, value)` entries.
fn d(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..Default::default()
    }
}

fn req(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

async fn call(
    client: &mut RateLimitServiceClient<Channel>,
    request: RateLimitRequest,
) -> RateLimitResponse {
    client
        .should_rate_limit(request)
        .await
        .unwrap()
        .into_inner()
}

/// The overall code of `n` identical calls.
async fn codes(
    client: &mut RateLimitServiceClient<Channel>,
    request: &RateLimitRequest,
    n: usize,
) -> Vec<Code> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(call(client, request.clone()).await.overall_code());
    }
    out
}

use Code::{Ok as OK, OverLimit as OVER};

const MESSAGING: &str = "
domain: messaging
descriptors:
  # a placeholder level, and below it a key with no value: any number, a counter each
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: { unit: day, requests_per_unit: 2 }
  - key: to_number
    rate_limit: { unit: day, requests_per_unit: 3 }
  - key: remote_address
    rate_limit: { unit: second, requests_per_unit: 2 }
  - key: remote_address
    value: 50.0.0.5
    rate_limit: { unit: second, requests_per_unit: 0 }
  - key: ldap
    rate_limit: { unlimited: true }
  - key: service
    descriptors:
      - key: user
        value: user-a
        shadow_mode: true
        rate_limit: { unit: second, requests_per_unit: 1 }
      - key: user
        value: user-b
        rate_limit: { unit: second, requests_per_unit: 1 }
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bk
        rate_limit: { name: specific_limit, unit: second, requests_per_unit: 1 }
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bk
        rate_limit: { replaces: [{ name: specific_limit }], unit: second, requests_per_unit: 3 }
  - key: path
    value: /api/*/action
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: { unit: hour, requests_per_unit: 2 }
  - key: per_day
    rate_limit: { unit: day, requests_per_unit: 1 }
  - key: per_day_big
    rate_limit: { unit: day, requests_per_unit: 10 }
";

async fn messaging() -> (RateLimitServiceClient<Channel>, Counting, ManualClock) {
    let (store, clock) = counting();
    let client = serve(RateLimitService::new(store.clone(), config(MESSAGING))).await;
    (client, store, clock)
}

#[tokio::test]
async fn a_key_without_a_value_counts_each_value_apart_below_a_placeholder() {
    let (mut c, _, _) = messaging().await;
    let marketing = |n: &str| {
        req(
            "messaging",
            vec![d(&[("message_type", "marketing"), ("to_number", n)])],
        )
    };
    assert_eq!(codes(&mut c, &marketing("206111"), 3).await, [OK, OK, OVER]);
    assert_eq!(codes(&mut c, &marketing("206222"), 1).await, [OK]);
    // The placeholder alone has no limit; the top-level key has its own.
    let placeholder = req("messaging", vec![d(&[("message_type", "marketing")])]);
    assert!(
        call(&mut c, placeholder).await.statuses[0]
            .current_limit
            .is_none()
    );
    let number = req("messaging", vec![d(&[("to_number", "206111")])]);
    assert_eq!(codes(&mut c, &number, 4).await, [OK, OK, OK, OVER]);
}

#[tokio::test]
async fn an_exact_value_is_matched_before_the_key_alone() {
    let (mut c, store, _) = messaging().await;
    let any = req("messaging", vec![d(&[("remote_address", "50.0.0.1")])]);
    assert_eq!(codes(&mut c, &any, 3).await, [OK, OK, OVER]);
    let black = req("messaging", vec![d(&[("remote_address", "50.0.0.5")])]);
    let before = store.calls();
    let r = call(&mut c, black).await;
    assert_eq!(r.overall_code(), OVER);
    assert_eq!(
        r.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        0
    );
    assert_eq!(store.calls(), before, "a limit of 0 needs no store");
}

#[tokio::test]
async fn a_descriptor_deeper_than_the_tree_matches_nothing() {
    let (mut c, store, _) = messaging().await;
    let deep = req("messaging", vec![d(&[("to_number", "1"), ("extra", "x")])]);
    let r = call(&mut c, deep.clone()).await;
    assert_eq!(r.overall_code(), OK);
    assert!(r.statuses[0].current_limit.is_none());
    assert_eq!(codes(&mut c, &deep, 5).await, [OK; 5]);
    assert_eq!(store.calls(), 0);
}

#[tokio::test]
async fn unlimited_is_ok_with_everything_remaining_and_never_counted() {
    let (mut c, store, _) = messaging().await;
    let r = call(&mut c, req("messaging", vec![d(&[("ldap", "x")])])).await;
    assert_eq!(r.overall_code(), OK);
    assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
    assert_eq!(store.calls(), 0);
}

#[tokio::test]
async fn shadow_mode_answers_ok_whatever_the_count() {
    let (mut c, _, _) = messaging().await;
    let a = req(
        "messaging",
        vec![d(&[("service", "auth"), ("user", "user-a")])],
    );
    let got = codes(&mut c, &a, 3).await;
    assert_eq!(got, [OK, OK, OK]);
    let b = req(
        "messaging",
        vec![d(&[("service", "auth"), ("user", "user-b")])],
    );
    assert_eq!(codes(&mut c, &b, 2).await, [OK, OVER]);
}

#[tokio::test]
async fn a_limit_that_replaces_another_takes_its_place() {
    let (mut c, _, _) = messaging().await;
    let one = d(&[("key_1", "value_1"), ("user", "bk")]);
    let two = d(&[("key_2", "value_2"), ("user", "bk")]);
    // Both together: the 1/s limit is replaced by the 3/s one and not counted.
    let both = req("messaging", vec![one.clone(), two]);
    let r = call(&mut c, both.clone()).await;
    assert!(r.statuses[0].current_limit.is_none(), "replaced");
    assert_eq!(
        r.statuses[1]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        3
    );
    assert_eq!(codes(&mut c, &both, 3).await, [OK, OK, OVER]);
    // Alone, the replaced limit still has its whole second.
    assert_eq!(
        codes(&mut c, &req("messaging", vec![one]), 2).await,
        [OK, OVER]
    );
}

#[tokio::test]
async fn wildcards_match_and_a_shared_threshold_is_one_counter() {
    let (mut c, _, _) = messaging().await;
    let path = |p: &str| req("messaging", vec![d(&[("path", p)])]);
    assert_eq!(codes(&mut c, &path("/api/1/action"), 2).await, [OK, OVER]);
    assert_eq!(
        codes(&mut c, &path("/api/2/action"), 1).await,
        [OK],
        "a counter per value"
    );
    assert!(
        call(&mut c, path("/api/1/other")).await.statuses[0]
            .current_limit
            .is_none()
    );
    let file = |f: &str| req("messaging", vec![d(&[("files", f)])]);
    assert_eq!(codes(&mut c, &file("files/a.pdf"), 1).await, [OK]);
    assert_eq!(codes(&mut c, &file("files/b.csv"), 1).await, [OK]);
    assert_eq!(
        codes(&mut c, &file("files/c.txt"), 1).await,
        [OVER],
        "one shared counter"
    );
}

#[tokio::test]
async fn a_limit_sent_by_envoy_overrides_the_configured_one() {
    let (mut c, _, _) = messaging().await;
    let mut one = d(&[("to_number", "555")]);
    one.limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: RateLimitUnit::Minute as i32,
    });
    let r = req("messaging", vec![one]);
    assert_eq!(codes(&mut c, &r, 2).await, [OK, OVER]);
    // The configured 3 a day for the same number is a separate counter.
    let plain = req("messaging", vec![d(&[("to_number", "555")])]);
    assert_eq!(codes(&mut c, &plain, 1).await, [OK]);
    // Unit 7 is a week, as envoyproxy/ratelimit reads it; 8 is no unit.
    let mut weekly = d(&[("to_number", "556")]);
    weekly.limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: 7,
    });
    let answer = call(&mut c, req("messaging", vec![weekly.clone()])).await;
    let limit = answer.statuses[0].current_limit.clone().unwrap();
    assert_eq!((answer.overall_code(), limit.unit), (OK, 7));
    assert!(answer.statuses[0].duration_until_reset.unwrap().seconds <= 7 * 86_400);
    assert_eq!(
        codes(&mut c, &req("messaging", vec![weekly.clone()]), 1).await,
        [OVER]
    );
    weekly.limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: 8,
    });
    let e = c
        .should_rate_limit(req("messaging", vec![weekly]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn hits_addend_is_the_cost_and_zero_is_a_peek() {
    let (mut c, _, _) = messaging().await;
    let mut r = req("messaging", vec![d(&[("per_day_big", "k")])]);
    r.hits_addend = 4;
    let first = call(&mut c, r.clone()).await;
    assert_eq!(
        (first.overall_code(), first.statuses[0].limit_remaining),
        (OK, 6)
    );
    // Per descriptor, over the request's: 0 peeks.
    let mut peek = r.clone();
    peek.descriptors[0].hits_addend = Some(0);
    let p = call(&mut c, peek).await;
    assert_eq!((p.overall_code(), p.statuses[0].limit_remaining), (OK, 6));
    assert_eq!(
        codes(&mut c, &r, 2).await,
        [OK, OVER],
        "6 left: one more 4, then no"
    );
    // The refusal counted nothing: 2 are still there.
    let mut two = r.clone();
    two.descriptors[0].hits_addend = Some(2);
    let last = call(&mut c, two).await;
    assert_eq!(
        (last.overall_code(), last.statuses[0].limit_remaining),
        (OK, 0)
    );
}

#[tokio::test]
async fn stacked_descriptors_are_all_or_nothing_in_one_store_call() {
    let (mut c, store, _) = messaging().await;
    let small = d(&[("per_day", "u")]);
    let big = d(&[("per_day_big", "u")]);
    let both = req("messaging", vec![small, big.clone()]);
    let r = call(&mut c, both.clone()).await;
    assert_eq!(r.overall_code(), OK);
    assert_eq!(store.calls(), 1, "one store call for both descriptors");
    let r = call(&mut c, both).await;
    assert_eq!(r.overall_code(), OVER);
    assert_eq!(r.statuses[0].code(), OVER);
    assert_eq!(r.statuses[1].code(), OK);
    // The refused call took nothing from the big limit: 9 left before this call, 8 after.
    let alone = call(&mut c, req("messaging", vec![big])).await;
    assert_eq!(alone.statuses[0].limit_remaining, 8);
}

#[tokio::test]
async fn a_plain_limit_is_a_fixed_window_of_its_unit() {
    let (mut c, _, clock) = messaging().await;
    clock.advance(Duration::from_millis(300));
    let r = req("messaging", vec![d(&[("remote_address", "10.0.0.9")])]);
    assert_eq!(codes(&mut c, &r, 2).await, [OK, OK]);
    let over = call(&mut c, r.clone()).await;
    assert_eq!(over.overall_code(), OVER);
    let until = over.statuses[0].duration_until_reset.unwrap();
    assert_eq!(
        (until.seconds, until.nanos),
        (0, 700_000_000),
        "until the second ends"
    );
    clock.advance(Duration::from_millis(700));
    assert_eq!(codes(&mut c, &r, 3).await, [OK, OK, OVER]);
}

#[tokio::test]
async fn every_algorithm_decides_through_the_service_as_the_store_does() {
    for (algorithm, policy) in [
        (
            "fixed_window",
            Policy::fixed_window(5, Duration::from_secs(60)).unwrap(),
        ),
        (
            "sliding_window",
            Policy::sliding_window(5, Duration::from_secs(60)).unwrap(),
        ),
        (
            "sliding_log",
            Policy::sliding_log(5, Duration::from_secs(60)).unwrap(),
        ),
        (
            "token_bucket",
            Policy::token_bucket(Rate::per_minute(5), 3).unwrap(),
        ),
        (
            "leaky_bucket",
            Policy::leaky_bucket(Rate::per_minute(5), 3).unwrap(),
        ),
        ("gcra", Policy::gcra(Rate::per_minute(5), 3).unwrap()),
    ] {
        let burst = if policy.limit() == 3 {
            ", burst: 3"
        } else {
            ""
        };
        let yaml = format!(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{ unit: minute, requests_per_unit: 5, algorithm: {algorithm}{burst} }}\n"
        );
        let (store, clock) = counting();
        let mut c = serve(RateLimitService::new(store, config(&yaml))).await;
        let direct = MemoryStore::with_clock(clock.clone());
        let r = req("d", vec![d(&[("k", "v")])]);
        for step in 0..40 {
            clock.advance(Duration::from_millis(1700));
            let cost = 1 + step % 2;
            let mut r = r.clone();
            r.hits_addend = cost;
            let got = call(&mut c, r).await;
            let want: Decision = direct.check_now("k", &policy, u64::from(cost)).unwrap();
            assert_eq!(
                got.overall_code() == OK,
                want.allowed(),
                "{algorithm} step {step}"
            );
            assert_eq!(
                u64::from(got.statuses[0].limit_remaining),
                want.remaining(),
                "{algorithm} step {step}"
            );
        }
    }
}

#[tokio::test]
async fn the_response_carries_the_fields_tollgate_sends() {
    let (store, _) = counting();
    let service = RateLimitService::new(store, config(MESSAGING)).headers(HeaderProfile::Both);
    let mut c = serve(service).await;
    let r = call(&mut c, req("messaging", vec![d(&[("per_day_big", "h")])])).await;
    let headers: Vec<(String, String)> = r
        .response_headers_to_add
        .into_iter()
        .map(|h| (h.key, h.value))
        .collect();
    let get = |k: &str| {
        headers
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(get("ratelimit-policy"), Some("\"envoy\";q=10;w=86400"));
    assert_eq!(get("ratelimit"), Some("\"envoy\";r=9;t=86400"));
    assert_eq!(get("x-ratelimit-limit"), Some("10"));
    assert_eq!(get("x-ratelimit-remaining"), Some("9"));
    assert_eq!(get("x-ratelimit-reset"), Some("86400"));
}

#[tokio::test]
async fn bad_input_is_a_clear_status_and_counts_nothing() {
    let (mut c, store, _) = messaging().await;
    let invalid = |s: tonic::Status| {
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
        s.message().to_owned()
    };
    let ok = d(&[("per_day", "bad")]);
    // Empty domain; no descriptors; a descriptor with no entries; an empty key.
    let e = c
        .should_rate_limit(req("", vec![ok.clone()]))
        .await
        .unwrap_err();
    assert!(invalid(e).contains("domain"));
    let e = c
        .should_rate_limit(req("messaging", vec![]))
        .await
        .unwrap_err();
    invalid(e);
    let e = c
        .should_rate_limit(req("messaging", vec![ok.clone(), d(&[])]))
        .await
        .unwrap_err();
    assert!(invalid(e).contains("descriptor 1 has no entries"));
    let e = c
        .should_rate_limit(req("messaging", vec![d(&[("", "v")])]))
        .await
        .unwrap_err();
    invalid(e);
    // More entries in one descriptor than any tree is deep.
    let keys: Vec<String> = (0..65).map(|i| format!("k{i}")).collect();
    let deep: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "v")).collect();
    let e = c
        .should_rate_limit(req("messaging", vec![d(&deep)]))
        .await
        .unwrap_err();
    assert!(invalid(e).contains("65 entries, more than 64"));
    // A megabyte value.
    let big = "x".repeat(1 << 20);
    let e = c
        .should_rate_limit(req(
            "messaging",
            vec![ok.clone(), d(&[("to_number", &big)])],
        ))
        .await
        .unwrap_err();
    assert!(invalid(e).contains("longer than 1024 bytes"));
    // 10,000 descriptors.
    let e = c
        .should_rate_limit(req("messaging", vec![ok.clone(); 10_000]))
        .await
        .unwrap_err();
    assert!(invalid(e).contains("10000 descriptors"));
    // Negative hits.
    let mut negative = ok.clone();
    negative.is_negative_hits = true;
    let e = c
        .should_rate_limit(req("messaging", vec![negative]))
        .await
        .unwrap_err();
    invalid(e);
    // An override without a unit.
    let mut no_unit = ok.clone();
    no_unit.limit = Some(RateLimitOverride {
        requests_per_unit: 5,
        unit: 0,
    });
    let e = c
        .should_rate_limit(req("messaging", vec![no_unit]))
        .await
        .unwrap_err();
    invalid(e);
    // hits_addend of u32::MAX: over any limit, decided without the store.
    let mut huge = req("messaging", vec![ok.clone()]);
    huge.hits_addend = u32::MAX;
    assert_eq!(call(&mut c, huge).await.overall_code(), OVER);
    assert_eq!(store.calls(), 0, "nothing reached the store");
    // An unknown domain is OK for every descriptor, as in envoyproxy/ratelimit.
    let r = call(&mut c, req("nobody", vec![ok.clone()])).await;
    assert_eq!(r.overall_code(), OK);
    assert!(r.statuses[0].current_limit.is_none());
    // And the limit is whole: its one call a day is still there.
    assert_eq!(
        codes(&mut c, &req("messaging", vec![ok]), 2).await,
        [OK, OVER]
    );
}

#[tokio::test]
async fn a_reload_keeps_the_counts_of_unchanged_limits() {
    let (store, _) = counting();
    let service = RateLimitService::new(store, config(MESSAGING));
    let mut c = serve(service.clone()).await;
    let kept = req("messaging", vec![d(&[("per_day", "r")])]);
    let changed = req("messaging", vec![d(&[("per_day_big", "r")])]);
    assert_eq!(codes(&mut c, &kept, 2).await, [OK, OVER]);
    assert_eq!(
        call(&mut c, changed.clone()).await.statuses[0].limit_remaining,
        9
    );
    let reloaded = MESSAGING.replace(
        "key: per_day_big\n    rate_limit: { unit: day, requests_per_unit: 10 }",
        "key: per_day_big\n    rate_limit: { unit: day, requests_per_unit: 20 }",
    );
    assert_ne!(reloaded, MESSAGING);
    service.set_config(config(&reloaded));
    assert_eq!(
        codes(&mut c, &kept, 1).await,
        [OVER],
        "unchanged: still spent"
    );
    let fresh = call(&mut c, changed).await;
    assert_eq!(
        fresh.statuses[0].limit_remaining, 19,
        "changed: a new counter"
    );
}

/// A store whose backend is always down.
#[derive(Clone)]
struct Down;

impl Store for Down {
    type Future = std::future::Ready<Result<Decision, StoreError>>;

    fn check_all(&self, _: &[Check<'_>]) -> Self::Future {
        std::future::ready(Err(StoreError::Backend("connection refused".into())))
    }
}

#[tokio::test]
async fn a_failing_store_is_unavailable_for_envoy_to_apply_failure_mode_deny() {
    let mut c = serve(RateLimitService::new(Down, config(MESSAGING))).await;
    let e = c
        .should_rate_limit(req("messaging", vec![d(&[("per_day", "x")])]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    // A call that needs no store still answers.
    let r = call(&mut c, req("messaging", vec![d(&[("ldap", "x")])])).await;
    assert_eq!(r.overall_code(), OK);
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_on_one_redis_admit_exactly_the_limit() {
    use tollgate::store::redis::RedisStore;
    let server = redis_or_skip!();
    let connect = || {
        RedisStore::builder()
            .url(server.url())
            .timeout(Duration::from_secs(10))
            .connect()
    };
    let yaml = "domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit: { unit: day, requests_per_unit: 50 }\n";
    let a = serve(RateLimitService::new(
        connect().await.unwrap(),
        config(yaml),
    ))
    .await;
    let b = serve(RateLimitService::new(
        connect().await.unwrap(),
        config(yaml),
    ))
    .await;
    let tasks: Vec<_> = (0..400)
        .map(|i| {
            let mut client = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move {
                let r = req("edge", vec![d(&[("tenant", "acme")])]);
                call(&mut client, r).await.overall_code() == OK
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(admitted, 50);
}

#[test]
fn envoy_generated_code_is_current() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/envoy");
    let descriptors = protox::compile([root.join("rls.proto")], [root.clone()])
        .unwrap_or_else(|e| panic!("rls.proto: {e}"));
    let out = std::env::temp_dir().join(format!("tollgate-envoy-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    tonic_prost_build::configure()
        .build_transport(false)
        .out_dir(&out)
        .compile_fds(descriptors)
        .unwrap();
    let generated = std::fs::read_to_string(out.join("envoy.service.ratelimit.v3.rs")).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    let committed_path = root.join("envoy.service.ratelimit.v3.rs");
    if std::env::var_os("TOLLGATE_BLESS").is_some() {
        std::fs::write(&committed_path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    assert!(
        committed == generated,
        "src/envoy/envoy.service.ratelimit.v3.rs is not what rls.proto generates: rerun with TOLLGATE_BLESS=1"
    );
}
