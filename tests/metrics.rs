//! The metrics of `tollgate::metrics`: each scenario builds its layers and stores under a
//! recorder of its own (`metrics::set_default_local_recorder`, on the test's one thread), drives
//! them on a manual clock or tokio's paused time, and checks what was counted. The last test
//! runs every scenario and requires every metric of the documented table to have been emitted.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower::{Service, ServiceBuilder, ServiceExt};

use tollgate::clock::{ManualClock, TokioClock};
use tollgate::key::Header;
use tollgate::limiter::{MissingKey, Rule, Tiers};
use tollgate::metrics as m;
use tollgate::shed::{ByHeader, Limit};
use tollgate::store::{FailurePolicy, ResilientStore};
use tollgate::{
    Check, ConcurrencyLimitLayer, Decision, LoadShedLayer, MemoryStore, Policy, Rate,
    RateLimitLayer, ShapeLayer, Store, StoreError,
};

/// One metric's value in a snapshot: its name, its labels, and the value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: DebugValue,
    described: bool,
}

/// What the scenario's recorder got, over one or more snapshots (a snapshot resets counters
/// and gauges: counters are added up, gauges are as each snapshot saw them).
#[derive(Default, Debug)]
struct Seen(Vec<Sample>);

impl Seen {
    fn take(&mut self, snapshotter: &Snapshotter) -> &mut Self {
        for (key, _unit, description, value) in snapshotter.snapshot().into_vec() {
            let labels = key
                .key()
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            self.0.push(Sample {
                name: key.key().name().to_owned(),
                labels,
                value,
                described: description.is_some(),
            });
        }
        self
    }

    fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&str, &str)],
    ) -> impl Iterator<Item = &'a DebugValue> + 'a {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.0
            .iter()
            .filter(move |s| s.name == name && s.labels == want)
            .map(|s| &s.value)
    }

    /// The counter's total over every snapshot.
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.matching(name, labels)
            .map(|v| match v {
                DebugValue::Counter(n) => *n,
                other => panic!("{name} is not a counter: {other:?}"),
            })
            .sum()
    }

    /// The gauge as each snapshot saw it.
    fn gauges(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        self.matching(name, labels)
            .map(|v| match v {
                DebugValue::Gauge(g) => g.into_inner(),
                other => panic!("{name} is not a gauge: {other:?}"),
            })
            .collect()
    }

    /// The histogram's values over every snapshot.
    fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        self.matching(name, labels)
            .flat_map(|v| match v {
                DebugValue::Histogram(h) => h.iter().map(|x| x.into_inner()).collect::<Vec<_>>(),
                other => panic!("{name} is not a histogram: {other:?}"),
            })
            .collect()
    }

    /// The metrics with a value other than nothing: a counter above zero, a gauge other than
    /// zero, a histogram with values.
    fn emitted(&self) -> BTreeSet<String> {
        self.0
            .iter()
            .filter(|s| match &s.value {
                DebugValue::Counter(n) => *n > 0,
                DebugValue::Gauge(g) => g.into_inner() != 0.0,
                DebugValue::Histogram(h) => !h.is_empty(),
            })
            .map(|s| s.name.clone())
            .collect()
    }
}

/// A recorder for one scenario, and what reads it.
fn recorder() -> (DebuggingRecorder, Snapshotter) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    (recorder, snapshotter)
}

fn ok_service()
-> impl Service<Request<String>, Response = Response<String>, Error = Infallible, Future: Send>
+ Clone
+ Send {
    tower::service_fn(|_: Request<String>| async { Ok(Response::new(String::from("ok"))) })
}

fn get(headers: &[(&str, &str)]) -> Request<String> {
    let mut request = Request::get("/");
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    request.body(String::new()).unwrap()
}

fn minute(limit: u64, name: &str) -> Policy {
    Policy::fixed_window(limit, Duration::from_secs(60))
        .unwrap()
        .named(name)
        .unwrap()
}

/// The rate-limit layer: decisions by outcome, the cost consumed per policy, the tier cache.
async fn rate_limit_scenario() -> Seen {
    let (recorder, snapshotter) = recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let clock = ManualClock::new();
    let layer = RateLimitLayer::builder(MemoryStore::with_clock(clock.clone()))
        .rule(
            Rule::new("per-user")
                .key(Header::from_static("x-user"))
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
                .cost(2)
                .policies([minute(4, "per-minute"), minute(100, "per-hour")]),
        )
        .rule(
            Rule::new("trial")
                .key(Header::from_static("x-user"))
                .policy(minute(1, "trial"))
                .shadow(),
        )
        .build()
        .unwrap();
    let tiered = RateLimitLayer::builder(MemoryStore::with_clock(clock.clone()))
        .rule(
            Rule::new("plan").key(Header::from_static("x-key")).tiers(
                Tiers::new(
                    |key: String| async move { key.starts_with("pro").then(|| "pro".into()) },
                )
                .tier("free", [minute(1, "free")])
                .tier("pro", [minute(10, "pro")])
                .clock(clock.clone()),
            ),
        )
        .build()
        .unwrap();
    let service = ServiceBuilder::new().layer(layer).service(ok_service());
    let mut statuses = Vec::new();
    for headers in [
        &[("x-user", "alice")][..],
        &[("x-user", "alice")],
        &[("x-user", "alice")],
        &[],
    ] {
        let response = service.clone().oneshot(get(headers)).await.unwrap();
        statuses.push(response.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 401]);
    let tiered = ServiceBuilder::new().layer(tiered).service(ok_service());
    for _ in 0..2 {
        let response = tiered
            .clone()
            .oneshot(get(&[("x-key", "pro-1")]))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }

    let mut seen = Seen::default();
    seen.take(&snapshotter);
    let decisions = |rule, policy, outcome| {
        seen.counter(
            m::DECISIONS_TOTAL,
            &[("rule", rule), ("policy", policy), ("outcome", outcome)],
        )
    };
    // An admission is the rule's (every policy admitted); a refusal names the policy.
    assert_eq!(decisions("per-user", "", "admitted"), 2);
    assert_eq!(decisions("per-user", "per-minute", "limited"), 1);
    assert_eq!(decisions("per-user", "per-hour", "limited"), 0);
    assert_eq!(decisions("per-user", "", "no_key"), 1);
    // The shadow rule: one request it would have admitted, one it would have refused.
    assert_eq!(decisions("trial", "", "admitted"), 1);
    assert_eq!(decisions("trial", "trial", "shadow_limited"), 1);
    assert_eq!(decisions("plan", "", "admitted"), 2);
    // Nothing else was counted: one per request and rule that decided it.
    let all: u64 = seen
        .0
        .iter()
        .filter(|s| s.name == m::DECISIONS_TOTAL)
        .map(|s| match s.value {
            DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum();
    assert_eq!(all, 4 + 2 + 2);
    // Every policy of the rule pays the cost of each admitted request; the refused one
    // consumed nothing.
    let cost = |rule, policy| {
        seen.counter(
            m::COST_CONSUMED_TOTAL,
            &[("rule", rule), ("policy", policy)],
        )
    };
    assert_eq!(cost("per-user", "per-minute"), 4);
    assert_eq!(cost("per-user", "per-hour"), 4);
    assert_eq!(cost("trial", "trial"), 1);
    assert_eq!(cost("plan", "pro"), 2);
    let tier = |result| seen.counter(m::TIER_CACHE_TOTAL, &[("rule", "plan"), ("result", result)]);
    assert_eq!((tier("miss"), tier("hit")), (1, 1));
    // No key ever shows in a label.
    assert!(seen.0.iter().all(|s| {
        s.labels
            .values()
            .all(|v| !v.contains("alice") && !v.contains("pro-1"))
    }));
    seen
}

const OK: u8 = 0;
const FAIL: u8 = 1;
const HANG: u8 = 2;

/// A store that answers, fails or hangs, as told.
#[derive(Clone, Default)]
struct Flaky(Arc<AtomicU8>);

impl Flaky {
    fn set(&self, mode: u8) {
        self.0.store(mode, Ordering::SeqCst);
    }
}

impl Store for Flaky {
    type Future = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>;

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        let limit = checks.first().map_or(1, |c| c.policy().limit());
        match self.0.load(Ordering::SeqCst) {
            OK => Box::pin(std::future::ready(Ok(Decision::admitted(
                limit,
                limit - 1,
                Duration::ZERO,
            )))),
            FAIL => Box::pin(std::future::ready(Err(StoreError::Backend("down".into())))),
            _ => Box::pin(std::future::pending()),
        }
    }
}

/// A `ResilientStore` under the rate-limit layer: latency, errors by kind, the failure
/// policies' actions, the breaker's state and transitions, and the layer's store errors.
async fn store_scenario() -> Seen {
    let (recorder, snapshotter) = recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let flaky = Flaky::default();
    let store = ResilientStore::builder(flaky.clone())
        .name("primary")
        .timeout(Duration::from_millis(100))
        .breaker(2, Duration::from_secs(1))
        .build();
    let layer = RateLimitLayer::builder(store.clone())
        .rule(Rule::new("global").policy(minute(100, "global")))
        .rule(Rule::new("burst").policy(minute(1_000, "burst")))
        .build()
        .unwrap();
    let service = ServiceBuilder::new().layer(layer).service(ok_service());
    let status = || async { service.clone().oneshot(get(&[])).await.unwrap().status() };
    let mut seen = Seen::default();

    assert_eq!(status().await, StatusCode::OK);
    flaky.set(FAIL);
    assert_eq!(status().await, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(status().await, StatusCode::SERVICE_UNAVAILABLE); // opens the breaker
    assert_eq!(status().await, StatusCode::SERVICE_UNAVAILABLE); // refused by it
    seen.take(&snapshotter);
    assert_eq!(
        seen.gauges(m::BREAKER_STATE, &[("store", "primary")]),
        [2.0]
    );
    // The probe hangs: a timeout, and the breaker opens again.
    flaky.set(HANG);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(status().await, StatusCode::SERVICE_UNAVAILABLE);
    // The store is back: the next probe closes it.
    flaky.set(OK);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(status().await, StatusCode::OK);
    // A caller's mistake: no failure policy, no latency.
    let p = minute(1, "tiny");
    assert!(matches!(
        store.check("k", &p, 2).await,
        Err(StoreError::CostExceedsLimit { .. })
    ));
    // The other failure policies.
    let failing = Flaky::default();
    failing.set(FAIL);
    for (name, policy) in [
        ("lenient", FailurePolicy::Open),
        ("local", FailurePolicy::LocalFallback),
    ] {
        let store = ResilientStore::builder(failing.clone())
            .name(name)
            .failure_policy(policy)
            .build();
        assert!(store.check("k", &p, 1).await.unwrap().allowed());
    }
    seen.take(&snapshotter);

    let store_label = [("store", "primary")];
    let errors = |kind| {
        seen.counter(
            m::STORE_ERRORS_TOTAL,
            &[("store", "primary"), ("kind", kind)],
        )
    };
    assert_eq!(errors("backend"), 2);
    assert_eq!(errors("circuit_open"), 1);
    assert_eq!(errors("timeout"), 1);
    assert_eq!(errors("invalid"), 1);
    let action = |store, action| {
        seen.counter(
            m::STORE_FAILURE_POLICY_TOTAL,
            &[("store", store), ("action", action)],
        )
    };
    assert_eq!(action("primary", "fail_closed"), 4);
    assert_eq!(action("lenient", "fail_open"), 1);
    assert_eq!(action("local", "fallback"), 1);
    // Every call that reached the store was timed (paused time: the timeout took exactly 100
    // ms, the others nothing).
    let mut latencies = seen.histogram(m::STORE_DURATION_SECONDS, &store_label);
    latencies.sort_by(f64::total_cmp);
    assert_eq!(latencies, [0.0, 0.0, 0.0, 0.0, 0.1]);
    let to = |to| {
        seen.counter(
            m::BREAKER_TRANSITIONS_TOTAL,
            &[("store", "primary"), ("to", to)],
        )
    };
    assert_eq!((to("open"), to("half_open"), to("closed")), (2, 2, 1));
    assert_eq!(
        seen.gauges(m::BREAKER_STATE, &store_label).last(),
        Some(&0.0)
    );
    // Each rule that applied could not decide; each admitted the two that went through.
    for rule in ["global", "burst"] {
        let decisions = |outcome| {
            seen.counter(
                m::DECISIONS_TOTAL,
                &[("rule", rule), ("policy", ""), ("outcome", outcome)],
            )
        };
        assert_eq!((decisions("store_error"), decisions("admitted")), (4, 2));
    }
    // A layer whose store fails open: its admissions are the failure policy's, not the
    // store's, and consume nothing.
    let open = ResilientStore::builder(failing.clone())
        .name("lenient-layer")
        .failure_policy(FailurePolicy::Open)
        .build();
    let layer = RateLimitLayer::builder(open)
        .rule(Rule::new("open-rule").policy(minute(100, "open-policy")))
        .build()
        .unwrap();
    let service = ServiceBuilder::new().layer(layer).service(ok_service());
    for _ in 0..3 {
        assert_eq!(
            service.clone().oneshot(get(&[])).await.unwrap().status(),
            StatusCode::OK
        );
    }
    seen.take(&snapshotter);
    let decisions = |outcome| {
        seen.counter(
            m::DECISIONS_TOTAL,
            &[("rule", "open-rule"), ("policy", ""), ("outcome", outcome)],
        )
    };
    assert_eq!((decisions("failure_policy"), decisions("admitted")), (3, 0));
    assert_eq!(
        seen.counter(
            m::COST_CONSUMED_TOTAL,
            &[("rule", "open-rule"), ("policy", "open-policy")]
        ),
        0
    );
    seen
}

/// The in-process store: its size when asked or swept, and its evictions as they happen.
async fn memory_store_scenario() -> Seen {
    let (recorder, snapshotter) = recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let clock = ManualClock::new();
    let store = MemoryStore::builder()
        .name("local")
        .clock(clock.clone())
        .shards(1)
        .max_keys(16)
        .build();
    let hour = Policy::fixed_window(1, Duration::from_secs(3600)).unwrap();
    for i in 0..40 {
        store.check_now(&format!("k{i}"), &hour, 1).unwrap();
    }
    assert!(store.evicted() > 0);
    store.record_metrics();
    let mut seen = Seen::default();
    seen.take(&snapshotter);
    let label = [("store", "local")];
    assert_eq!(
        seen.counter(m::MEMORY_STORE_EVICTIONS_TOTAL, &label),
        store.evicted()
    );
    assert_eq!(
        seen.gauges(m::MEMORY_STORE_KEYS, &label),
        [store.len() as f64]
    );
    // A sweep after every state has recovered sets it too.
    clock.advance(Duration::from_secs(3600));
    store.sweep();
    store.check_now("again", &hour, 1).unwrap();
    seen.take(&snapshotter);
    assert_eq!(seen.gauges(m::MEMORY_STORE_KEYS, &label).last(), Some(&0.0));
    seen
}

/// The concurrency layer: in flight, refusals by reason, the queue's waits.
async fn concurrency_scenario() -> Seen {
    let (recorder, snapshotter) = recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let layer = ConcurrencyLimitLayer::builder()
        .name("api")
        .rule(
            Rule::new("per-user")
                .key(Header::from_static("x-user"))
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED)),
            1,
        )
        .total(2)
        .queue(4, Duration::from_millis(100))
        .clock(TokioClock::new())
        .build()
        .unwrap();
    let service = ServiceBuilder::new().layer(layer).service(ok_service());
    let call = |user: Option<&str>| {
        let headers: Vec<(&str, &str)> = user.into_iter().map(|u| ("x-user", u)).collect();
        service.clone().oneshot(get(&headers))
    };
    // Bodies not sent yet: their places are held.
    let alice = call(Some("alice")).await.unwrap();
    let bob = call(Some("bob")).await.unwrap();
    assert_eq!(call(Some("alice")).await.unwrap().status(), 429); // waited, busy
    assert_eq!(call(Some("carol")).await.unwrap().status(), 503); // waited, full
    assert_eq!(call(None).await.unwrap().status(), 401);
    let mut seen = Seen::default();
    seen.take(&snapshotter);
    let layer = [("layer", "api")];
    assert_eq!(seen.gauges(m::IN_FLIGHT, &layer), [2.0]);
    let refused = |rule, reason| {
        seen.counter(
            m::CONCURRENCY_REFUSED_TOTAL,
            &[("layer", "api"), ("rule", rule), ("reason", reason)],
        )
    };
    assert_eq!(refused("per-user", "busy"), 1);
    assert_eq!(refused("", "full"), 1);
    assert_eq!(refused("per-user", "no_key"), 1);
    assert_eq!(
        seen.histogram(m::QUEUE_DURATION_SECONDS, &layer),
        [0.1, 0.1]
    );
    drop((alice, bob));
    seen.take(&snapshotter);
    // The snapshot before reset the gauge to zero: the two bodies ended since.
    assert_eq!(seen.gauges(m::IN_FLIGHT, &layer).last(), Some(&-2.0));
    seen
}

/// The shedder: in flight, its limit, what it shed by class and reason, the queue's waits.
async fn shed_scenario() -> Seen {
    let (recorder, snapshotter) = recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let front = LoadShedLayer::builder(Limit::fixed(1))
        .name("front")
        .classify(ByHeader::from_static("x-criticality"))
        .queue(1, Duration::from_millis(50))
        .clock(TokioClock::new())
        .build()
        .unwrap();
    let edge = LoadShedLayer::builder(Limit::fixed(1))
        .name("edge")
        .build()
        .unwrap();
    let service = ServiceBuilder::new()
        .layer(front.clone())
        .service(ok_service());
    let held = service.clone().oneshot(get(&[])).await.unwrap();
    let waiting = tokio::spawn(
        service
            .clone()
            .oneshot(get(&[("x-criticality", "sheddable")])),
    );
    while front.queued() == 0 {
        tokio::task::yield_now().await;
    }
    // Of the waiter's class: it cannot make the waiter give way.
    let full = service
        .clone()
        .oneshot(get(&[("x-criticality", "sheddable")]))
        .await
        .unwrap();
    assert_eq!(full.status(), 503);
    assert_eq!(waiting.await.unwrap().unwrap().status(), 503);
    let edge = ServiceBuilder::new().layer(edge).service(ok_service());
    let edge_held = edge.clone().oneshot(get(&[])).await.unwrap();
    assert_eq!(edge.clone().oneshot(get(&[])).await.unwrap().status(), 503);

    let mut seen = Seen::default();
    seen.take(&snapshotter);
    let shed = |layer, class, reason| {
        seen.counter(
            m::SHED_TOTAL,
            &[("layer", layer), ("class", class), ("reason", reason)],
        )
    };
    assert_eq!(shed("front", "sheddable", "timed_out"), 1);
    assert_eq!(shed("front", "sheddable", "queue_full"), 1);
    assert_eq!(shed("edge", "critical", "capacity"), 1);
    assert_eq!(seen.gauges(m::SHED_LIMIT, &[("layer", "front")]), [1.0]);
    assert_eq!(seen.gauges(m::IN_FLIGHT, &[("layer", "front")]), [1.0]);
    assert_eq!(seen.gauges(m::IN_FLIGHT, &[("layer", "edge")]), [1.0]);
    assert_eq!(
        seen.histogram(m::QUEUE_DURATION_SECONDS, &[("layer", "front")]),
        [0.05]
    );
    drop((held, edge_held));
    seen
}

/// The shaper: each admitted request's wait, and its refusals.
async fn shape_scenario() -> Seen {
    let (recorder, snapshotter) = recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let layer = ShapeLayer::builder(MemoryStore::with_clock(TokioClock::new()))
        .name("upstream")
        .rule(
            Rule::new("api")
                .key(Header::from_static("x-user"))
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED)),
            Rate::per_second(10),
            2,
        )
        .build()
        .unwrap();
    let service = ServiceBuilder::new().layer(layer).service(ok_service());
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(tokio::spawn(
            service.clone().oneshot(get(&[("x-user", "alice")])),
        ));
    }
    let mut statuses = Vec::new();
    for answer in answers {
        statuses.push(answer.await.unwrap().unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429]);
    assert_eq!(
        service.clone().oneshot(get(&[])).await.unwrap().status(),
        401
    );
    let mut seen = Seen::default();
    seen.take(&snapshotter);
    let refused = |reason| {
        seen.counter(
            m::SHAPE_REFUSED_TOTAL,
            &[("layer", "upstream"), ("rule", "api"), ("reason", reason)],
        )
    };
    assert_eq!((refused("limited"), refused("no_key")), (1, 1));
    assert_eq!(
        seen.histogram(m::QUEUE_DURATION_SECONDS, &[("layer", "upstream")]),
        [0.1, 0.2]
    );
    seen
}

/// The Redis store's deny cache (with a real `redis-server`; `None` without one).
#[cfg(feature = "redis")]
async fn deny_cache_scenario() -> Option<Seen> {
    let server = support::RedisServer::start()?;
    let (recorder, snapshotter) = recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let store = tollgate::RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .url(server.url())
        .deny_cache(100)
        .connect()
        .await
        .unwrap();
    let p = Policy::gcra(Rate::per_hour(1), 1).unwrap();
    assert!(store.check("k", &p, 1).await.unwrap().allowed());
    for _ in 0..4 {
        assert!(!store.check("k", &p, 1).await.unwrap().allowed());
    }
    let mut seen = Seen::default();
    seen.take(&snapshotter);
    // The first refusal came from Redis, the next three from the cache.
    assert_eq!(seen.counter(m::DENY_CACHE_HITS_TOTAL, &[]), 3);
    Some(seen)
}

#[cfg(not(feature = "redis"))]
async fn deny_cache_scenario() -> Option<Seen> {
    None
}

/// The client half: retries and give-ups by reason, the outbound breaker, the throttle.
#[cfg(feature = "client")]
async fn client_scenario() -> Seen {
    use tollgate::client::{
        AdaptiveThrottleLayer, CircuitBreakerLayer, RetryBudget, RetryLayer, RetryPolicy,
    };
    let (recorder, snapshotter) = recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let refusing = |status: u16| {
        tower::service_fn(move |_: Request<String>| async move {
            let response = Response::builder()
                .status(status)
                .header("retry-after", "1")
                .body(String::new())
                .unwrap();
            Ok::<_, Infallible>(response)
        })
    };
    // Two attempts: one retry, then it gives up.
    let payments = RetryPolicy::builder()
        .name("payments")
        .max_attempts(2)
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(payments))
        .service(refusing(429));
    assert_eq!(client.oneshot(get(&[])).await.unwrap().status(), 429);
    // An empty budget: no retry at all.
    let search = RetryPolicy::builder()
        .name("search")
        .budget(RetryBudget::new(0, 0, Duration::from_secs(10)).unwrap())
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(search))
        .service(refusing(429));
    assert_eq!(client.oneshot(get(&[])).await.unwrap().status(), 429);
    // A breaker that opens at the first failure.
    let breaker = CircuitBreakerLayer::builder()
        .name("inventory")
        .breaker(1, Duration::from_secs(5))
        .build();
    let client = ServiceBuilder::new()
        .layer(breaker.clone())
        .service(refusing(503));
    assert_eq!(
        client.clone().oneshot(get(&[])).await.unwrap().status(),
        503
    );
    assert_eq!(
        breaker.status(),
        tollgate::store::resilient::BreakerStatus::Open
    );
    // A throttle over a backend that refuses everything.
    let throttle = AdaptiveThrottleLayer::builder()
        .name("search")
        .seed(7)
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(throttle.clone())
        .service(refusing(503));
    for _ in 0..50 {
        client.clone().oneshot(get(&[])).await.unwrap();
    }
    assert!(throttle.stats().throttled > 0);

    let mut seen = Seen::default();
    seen.take(&snapshotter);
    let client = |name| [("client", name)];
    let gave_up = |name, reason| {
        seen.counter(
            m::CLIENT_GAVE_UP_TOTAL,
            &[("client", name), ("reason", reason)],
        )
    };
    assert_eq!(
        seen.counter(m::CLIENT_RETRIES_TOTAL, &client("payments")),
        1
    );
    assert_eq!(gave_up("payments", "attempts"), 1);
    assert_eq!(seen.counter(m::CLIENT_RETRIES_TOTAL, &client("search")), 0);
    assert_eq!(gave_up("search", "budget"), 1);
    assert_eq!(
        seen.gauges(m::CLIENT_BREAKER_STATE, &client("inventory")),
        [2.0]
    );
    assert_eq!(
        seen.counter(
            m::CLIENT_BREAKER_TRANSITIONS_TOTAL,
            &[("client", "inventory"), ("to", "open")]
        ),
        1
    );
    assert_eq!(
        seen.counter(m::CLIENT_THROTTLED_TOTAL, &client("search")),
        throttle.stats().throttled
    );
    seen
}

/// A memory store that can be switched off: then every call fails.
#[cfg(feature = "envoy")]
#[derive(Clone)]
struct Switched {
    store: MemoryStore<ManualClock>,
    down: Arc<std::sync::atomic::AtomicBool>,
}

#[cfg(feature = "envoy")]
impl Store for Switched {
    type Future = std::future::Ready<Result<Decision, StoreError>>;

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        if self.down.load(Ordering::SeqCst) {
            return std::future::ready(Err(StoreError::Backend("down".into())));
        }
        self.store.check_all(checks)
    }
}

/// Envoy's rate limit service: hits by domain, configured path and outcome (detailed labels
/// bounded), calls by result, the store's failures by pass, reloads.
#[cfg(feature = "envoy")]
async fn envoy_scenario() -> Seen {
    use tollgate::envoy::proto::rate_limit_descriptor::{Entry, RateLimitOverride};
    use tollgate::envoy::proto::{RateLimitDescriptor, RateLimitRequest, RateLimitUnit};
    use tollgate::envoy::{Config, RateLimitService};

    const EDGE: &str = "
domain: edge
descriptors:
  - key: remote_address
    rate_limit: { unit: minute, requests_per_unit: 10 }
  - key: path
    value: /login
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: user
    detailed_metric: true
    rate_limit: { unit: minute, requests_per_unit: 100 }
  - key: beta
    shadow_mode: true
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: ldap
    rate_limit: { unlimited: true }
";
    let (recorder, snapshotter) = recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let down = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let store = Switched {
        store: MemoryStore::with_clock(ManualClock::new()),
        down: Arc::clone(&down),
    };
    let service =
        RateLimitService::new(store, Config::from_yaml(EDGE).unwrap()).max_metric_descriptors(3);
    let d = |entries: &[(&str, &str)], hits: Option<u64>| RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        hits_addend: hits,
        ..Default::default()
    };
    let req = |domain: &str, descriptors| RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    };
    let code = |r: Result<tollgate::envoy::proto::RateLimitResponse, tonic::Status>| {
        r.map(|r| r.overall_code).map_err(|s| s.code())
    };
    let login = || {
        req(
            "edge",
            vec![
                d(&[("remote_address", "10.0.0.1")], None),
                d(&[("path", "/login")], None),
            ],
        )
    };
    // Both admitted: 0 of 1 left is near for the login limit, which decided; the address
    // (9 of 10 left) within. Then the login limit refuses, and the address, all or nothing,
    // counts nothing.
    assert_eq!(code(service.decide(&login()).await), Ok(1));
    assert_eq!(code(service.decide(&login()).await), Ok(2));
    // 8 more: 1 of 10 left is near.
    let eight = req("edge", vec![d(&[("remote_address", "10.0.0.1")], Some(8))]);
    assert_eq!(code(service.decide(&eight).await), Ok(1));
    // A limit sent by Envoy, then detailed labels: three at most, the fourth counts under the
    // configured path.
    let mut sent = d(&[("remote_address", "10.0.0.2")], None);
    sent.limit = Some(RateLimitOverride {
        requests_per_unit: 100,
        unit: RateLimitUnit::Minute as i32,
    });
    assert_eq!(code(service.decide(&req("edge", vec![sent])).await), Ok(1));
    for user in ["u1", "u2", "u3", "u1"] {
        let call = req("edge", vec![d(&[("user", user)], None)]);
        assert_eq!(code(service.decide(&call).await), Ok(1));
    }
    // The shadow limit: admitted (near), then it would refuse; both calls are OK.
    let beta = req("edge", vec![d(&[("beta", "x")], None)]);
    assert_eq!(code(service.decide(&beta).await), Ok(1));
    assert_eq!(code(service.decide(&beta).await), Ok(1));
    // Unlimited: a call, no hits.
    let ldap = req("edge", vec![d(&[("ldap", "x")], None)]);
    assert_eq!(code(service.decide(&ldap).await), Ok(1));
    // Bad input and an unknown domain (its name is not a label).
    let empty = req("", vec![d(&[("a", "b")], None)]);
    assert_eq!(
        code(service.decide(&empty).await),
        Err(tonic::Code::InvalidArgument)
    );
    let elsewhere = req("elsewhere", vec![d(&[("a", "b")], None)]);
    assert_eq!(code(service.decide(&elsewhere).await), Ok(1));
    // The store down: an enforced limit is UNAVAILABLE, a shadow one goes uncounted.
    down.store(true, Ordering::SeqCst);
    let address = req("edge", vec![d(&[("remote_address", "10.0.0.3")], None)]);
    assert_eq!(
        code(service.decide(&address).await),
        Err(tonic::Code::Unavailable)
    );
    assert_eq!(code(service.decide(&beta).await), Ok(1));
    down.store(false, Ordering::SeqCst);
    // Reloads: one put in place, one refused.
    service.set_config(Config::from_yaml(EDGE).unwrap());
    assert!(service.reload_from("/nonexistent/tollgate-envoy").is_err());

    let mut seen = Seen::default();
    seen.take(&snapshotter);
    let hits = |descriptor, outcome| {
        seen.counter(
            m::ENVOY_HITS_TOTAL,
            &[
                ("domain", "edge"),
                ("descriptor", descriptor),
                ("outcome", outcome),
            ],
        )
    };
    assert_eq!(hits("remote_address", "within_limit"), 1);
    assert_eq!(hits("remote_address", "not_counted"), 1);
    assert_eq!(hits("remote_address", "near_limit"), 8);
    assert_eq!(hits("remote_address", "over_limit"), 0);
    assert_eq!(hits("path_/login", "near_limit"), 1);
    assert_eq!(hits("path_/login", "over_limit"), 1);
    assert_eq!(hits("override:remote_address", "within_limit"), 1);
    assert_eq!(hits("user_u1", "within_limit"), 2);
    assert_eq!(hits("user_u2", "within_limit"), 1);
    assert_eq!(hits("user_u3", "within_limit"), 0, "past the bound");
    assert_eq!(hits("user", "within_limit"), 1, "under the configured path");
    assert_eq!(hits("beta", "near_limit"), 1);
    assert_eq!(hits("beta", "shadow_mode"), 1);
    assert_eq!(hits("ldap", "within_limit"), 0, "unlimited is not counted");
    let calls = |domain, result| {
        seen.counter(
            m::ENVOY_CALLS_TOTAL,
            &[("domain", domain), ("result", result)],
        )
    };
    assert_eq!(calls("edge", "ok"), 11);
    assert_eq!(calls("edge", "over_limit"), 1);
    assert_eq!(calls("edge", "store_error"), 1);
    assert_eq!(calls("", "invalid"), 1);
    assert_eq!(calls("", "unknown_domain"), 1);
    let failed = |pass| {
        seen.counter(
            m::ENVOY_STORE_ERRORS_TOTAL,
            &[("domain", "edge"), ("pass", pass)],
        )
    };
    assert_eq!((failed("enforced"), failed("shadow")), (1, 1));
    let reloads = |result| seen.counter(m::ENVOY_CONFIG_RELOADS_TOTAL, &[("result", result)]);
    assert_eq!((reloads("success"), reloads("error")), (1, 1));
    seen
}

#[cfg(feature = "envoy")]
#[tokio::test]
async fn envoy_hits_calls_store_errors_and_reloads() {
    envoy_scenario().await;
}

#[cfg(feature = "client")]
#[tokio::test(start_paused = true)]
async fn client_retries_give_ups_breaker_and_throttle() {
    client_scenario().await;
}

#[tokio::test]
async fn rate_limit_decisions_costs_and_tier_cache() {
    rate_limit_scenario().await;
}

#[tokio::test(start_paused = true)]
async fn resilient_store_latency_errors_failure_policy_and_breaker() {
    store_scenario().await;
}

#[tokio::test]
async fn memory_store_size_and_evictions() {
    memory_store_scenario().await;
}

#[tokio::test(start_paused = true)]
async fn concurrency_in_flight_refusals_and_queue() {
    concurrency_scenario().await;
}

#[tokio::test(start_paused = true)]
async fn shedder_in_flight_limit_shed_and_queue() {
    shed_scenario().await;
}

#[tokio::test(start_paused = true)]
async fn shaper_waits_and_refusals() {
    shape_scenario().await;
}

#[tokio::test]
async fn deny_cache_hits() {
    if deny_cache_scenario().await.is_none() {
        eprintln!("SKIPPED: no redis-server (or the redis feature is off)");
    }
}

/// `describe` gives every metric its description.
#[tokio::test]
async fn describe_covers_every_metric() {
    let (recorder, snapshotter) = recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    m::describe();
    for metric in m::ALL {
        let labels: Vec<(&str, &str)> = metric.labels.iter().map(|l| (*l, "x")).collect();
        let labels: Vec<metrics::Label> = labels
            .iter()
            .map(|(k, v)| metrics::Label::new(*k, *v))
            .collect();
        match metric.kind {
            m::Kind::Counter => metrics::counter!(metric.name, labels).increment(1),
            m::Kind::Gauge => metrics::gauge!(metric.name, labels).set(1.0),
            m::Kind::Histogram => metrics::histogram!(metric.name, labels).record(1.0),
            _ => unreachable!(),
        }
    }
    let mut seen = Seen::default();
    seen.take(&snapshotter);
    assert_eq!(seen.0.len(), m::ALL.len());
    assert!(seen.0.iter().all(|s| s.described), "{seen:?}");
}

/// The names in the table of `tollgate::metrics`, read from its source.
fn documented() -> BTreeSet<String> {
    include_str!("../src/metrics.rs")
        .lines()
        .filter_map(|line| line.strip_prefix("//! | `"))
        .filter_map(|rest| rest.split('`').next())
        .map(str::to_owned)
        .collect()
}

/// The README's metric table names the same metrics as `tollgate::metrics::ALL`, with the
/// same labels.
#[test]
fn the_readme_table_lists_every_metric() {
    let readme = include_str!("../README.md");
    let mut listed = BTreeMap::new();
    for line in readme.lines() {
        let Some(rest) = line.strip_prefix("| `tollgate_") else {
            continue;
        };
        let cells: Vec<&str> = rest.split('|').map(str::trim).collect();
        let name = format!("tollgate_{}", cells[0].trim_end_matches('`'));
        let labels: Vec<String> = cells[2]
            .split(", ")
            .map(|l| l.trim().trim_matches('`').to_owned())
            .filter(|l| !l.is_empty())
            .collect();
        assert!(
            listed.insert(name.clone(), labels).is_none(),
            "{name} twice"
        );
    }
    let all: BTreeMap<String, Vec<String>> = m::ALL
        .iter()
        .map(|m| {
            let labels = m.labels.iter().map(|l| (*l).to_owned()).collect();
            (m.name.to_owned(), labels)
        })
        .collect();
    assert_eq!(listed, all);
}

/// Every metric in the table is emitted by some scenario above, and the table, `ALL` and what
/// the scenarios emitted name the same metrics.
#[tokio::test(start_paused = true)]
async fn every_documented_metric_is_emitted() {
    let documented = documented();
    assert_eq!(documented.len(), 26, "{documented:?}");
    let all: BTreeSet<String> = m::ALL.iter().map(|m| m.name.to_owned()).collect();
    assert_eq!(
        documented, all,
        "the table and tollgate::metrics::ALL differ"
    );

    let mut emitted = BTreeSet::new();
    // Paused time for all: the scenarios that use the manual clock do not mind.
    for seen in [
        rate_limit_scenario().await,
        store_scenario().await,
        memory_store_scenario().await,
        concurrency_scenario().await,
        shed_scenario().await,
        shape_scenario().await,
        #[cfg(feature = "client")]
        client_scenario().await,
        #[cfg(feature = "envoy")]
        envoy_scenario().await,
    ] {
        emitted.extend(seen.emitted());
    }
    // Real time for the real Redis server's timeouts.
    tokio::time::resume();
    match deny_cache_scenario().await {
        Some(seen) => emitted.extend(seen.emitted()),
        None if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("the deny cache's metric needs redis-server and the redis feature under CI")
        }
        None => {
            eprintln!("SKIPPED: {} (no redis-server)", m::DENY_CACHE_HITS_TOTAL);
            emitted.insert(m::DENY_CACHE_HITS_TOTAL.to_owned());
        }
    }
    if cfg!(not(feature = "envoy")) {
        emitted.extend(
            documented
                .iter()
                .filter(|name| name.starts_with("tollgate_envoy_"))
                .cloned(),
        );
    }
    if cfg!(not(feature = "client")) {
        emitted.extend(
            documented
                .iter()
                .filter(|name| name.starts_with("tollgate_client_"))
                .cloned(),
        );
    }
    let missing: Vec<_> = documented.difference(&emitted).collect();
    assert!(missing.is_empty(), "never emitted: {missing:?}");
    let undocumented: Vec<_> = emitted.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "not in the table: {undocumented:?}"
    );
}
