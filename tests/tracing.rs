//! The tracing spans and events of `tollgate::telemetry`, caught by a small capturing layer
//! set as the test thread's default subscriber: their names, levels and fields, and that a
//! key shows only at DEBUG (hashed or plain, when asked), never above.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::{Layer as _, Service, ServiceBuilder, ServiceExt};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record as SpanValues};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{Layer, Registry};

use tollgate::clock::TokioClock;
use tollgate::key::Header;
use tollgate::limiter::{MissingKey, Rule, Tiers};
use tollgate::shed::{Criticality, Limit};
use tollgate::store::ResilientStore;
use tollgate::telemetry::KeyTrace;
use tollgate::{
    Check, ConcurrencyLimitLayer, Decision, LoadShedLayer, MemoryStore, Policy, Rate,
    RateLimitLayer, ShapeLayer, Store, StoreError,
};

/// A span or an event, as the subscriber saw it (a span with the fields recorded since).
#[derive(Clone, Debug)]
struct Caught {
    span: bool,
    name: String,
    level: Level,
    fields: BTreeMap<String, String>,
    /// The span an event happened in.
    parent: Option<String>,
}

impl Caught {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

/// Where a span's record is kept.
struct Index(usize);

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Caught>>>);

impl Capture {
    fn all(&self) -> Vec<Caught> {
        self.0.lock().unwrap().clone()
    }

    fn named(&self, name: &str) -> Vec<Caught> {
        self.all().into_iter().filter(|c| c.name == name).collect()
    }

    /// Sets a subscriber with this layer (and `max`) as the thread's default.
    fn install(&self, max: LevelFilter) -> tracing::subscriber::DefaultGuard {
        let subscriber = Registry::default().with(self.clone().with_filter(max));
        tracing::subscriber::set_default(subscriber)
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        let mut caught = self.0.lock().unwrap();
        caught.push(Caught {
            span: true,
            name: attrs.metadata().name().to_owned(),
            level: *attrs.metadata().level(),
            fields,
            parent: None,
        });
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Index(caught.len() - 1));
        }
    }

    fn on_record(&self, id: &Id, values: &SpanValues<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let Some(&Index(i)) = span.extensions().get::<Index>() else {
            return;
        };
        values.record(&mut Fields(&mut self.0.lock().unwrap()[i].fields));
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().push(Caught {
            span: false,
            name: event.metadata().name().to_owned(),
            level: *event.metadata().level(),
            fields,
            parent: ctx.event_span(event).map(|s| s.name().to_owned()),
        });
    }
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

/// A rate-limit layer over an in-process store, keyed by `x-user`, showing keys as `trace`
/// says: two policies, and a shadow rule.
fn limited(trace: KeyTrace) -> RateLimitLayer<MemoryStore<tollgate::clock::ManualClock>> {
    RateLimitLayer::builder(MemoryStore::with_clock(tollgate::clock::ManualClock::new()))
        .rule(
            Rule::new("per-user")
                .key(Header::from_static("x-user"))
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
                .policies([minute(2, "per-minute"), minute(100, "per-hour")]),
        )
        .rule(
            Rule::new("trial")
                .key(Header::from_static("x-user"))
                .policy(minute(1, "trial"))
                .shadow(),
        )
        .trace_keys(trace)
        .build()
        .unwrap()
}

/// Three requests of alice (admitted, admitted, limited) and one without a key.
async fn drive<St: Store>(layer: RateLimitLayer<St>) -> Vec<u16> {
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
    statuses
}

#[tokio::test]
async fn a_debug_span_per_decision_with_rule_policy_outcome_and_remaining() {
    let capture = Capture::default();
    let _subscriber = capture.install(LevelFilter::TRACE);
    assert_eq!(drive(limited(KeyTrace::None)).await, [200, 200, 429, 401]);

    let spans = capture.named("tollgate.decision");
    assert_eq!(spans.len(), 4);
    assert!(spans.iter().all(|s| s.span && s.level == Level::DEBUG));
    let summary: Vec<_> = spans
        .iter()
        .map(|s| {
            (
                s.field("outcome").unwrap_or(""),
                s.field("rule").unwrap_or(""),
                s.field("policy").unwrap_or(""),
                s.field("remaining").unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("admitted", "per-user", "per-minute", "1"),
            ("admitted", "per-user", "per-minute", "0"),
            ("limited", "per-user", "per-minute", "0"),
            ("no_key", "per-user", "", ""),
        ]
    );
    // No key unless asked for.
    assert!(spans.iter().all(|s| s.field("key").is_none()));
    // The shadow rule's refusal, at DEBUG, inside the second decision's span.
    let shadow = capture.named("tollgate.shadow_limited");
    assert_eq!(shadow.len(), 1);
    assert_eq!(shadow[0].level, Level::DEBUG);
    assert_eq!(shadow[0].field("rule"), Some("trial"));
    assert_eq!(shadow[0].parent.as_deref(), Some("tollgate.decision"));
    assert!(
        capture
            .all()
            .iter()
            .all(|c| !format!("{c:?}").contains("alice"))
    );
}

#[tokio::test]
async fn keys_are_hashed_or_plain_only_when_asked_and_only_at_debug() {
    let capture = Capture::default();
    let _subscriber = capture.install(LevelFilter::TRACE);
    drive(limited(KeyTrace::Hashed)).await;
    let hashed = KeyTrace::Hashed.show("alice@per-user");
    assert_eq!(hashed.len(), 12);
    let keys: Vec<_> = capture
        .named("tollgate.decision")
        .iter()
        .map(|s| s.field("key").map(str::to_owned))
        .collect();
    assert_eq!(
        keys,
        [
            Some(hashed.clone()),
            Some(hashed.clone()),
            Some(hashed),
            None
        ]
    );
    assert!(
        capture
            .all()
            .iter()
            .all(|c| !format!("{c:?}").contains("alice"))
    );

    let capture = Capture::default();
    let _subscriber = capture.install(LevelFilter::TRACE);
    drive(limited(KeyTrace::Plain)).await;
    let spans = capture.named("tollgate.decision");
    assert_eq!(spans[0].field("key"), Some("alice@per-user"));
    // Shown, but only at DEBUG.
    for c in capture.all() {
        if format!("{c:?}").contains("alice") {
            assert!(c.level >= Level::DEBUG, "{c:?}");
        }
    }
}

/// With DEBUG off, the decision span is not made at all (and nothing else is said about a
/// request that goes well).
#[tokio::test]
async fn nothing_above_debug_for_decisions() {
    let capture = Capture::default();
    let _subscriber = capture.install(LevelFilter::INFO);
    drive(limited(KeyTrace::Plain)).await;
    assert!(capture.all().is_empty(), "{:?}", capture.all());
}

const OK: u8 = 0;
const FAIL: u8 = 1;

/// A store that answers or fails, as told.
#[derive(Clone, Default)]
struct Flaky(Arc<AtomicU8>);

impl Store for Flaky {
    type Future = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>;

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        let limit = checks.first().map_or(1, |c| c.policy().limit());
        let answer = match self.0.load(Ordering::SeqCst) {
            OK => Ok(Decision::admitted(limit, limit - 1, Duration::ZERO)),
            _ => Err(StoreError::Backend("connection refused".into())),
        };
        Box::pin(std::future::ready(answer))
    }
}

/// A failing store is a WARN (with the store's name and the error, never the key), the breaker
/// opening a WARN, its probe a DEBUG, its closing an INFO.
#[tokio::test(start_paused = true)]
async fn store_failures_and_the_breaker_at_their_levels() {
    let capture = Capture::default();
    let _subscriber = capture.install(LevelFilter::TRACE);
    let flaky = Flaky::default();
    let store = ResilientStore::builder(flaky.clone())
        .name("sessions")
        .breaker(2, Duration::from_secs(1))
        .build();
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("per-user")
                .key(Header::from_static("x-user"))
                .policy(minute(100, "per-minute")),
        )
        .trace_keys(KeyTrace::Plain)
        .build()
        .unwrap();
    let service = ServiceBuilder::new().layer(layer).service(ok_service());
    let status = || async {
        let request = get(&[("x-user", "alice")]);
        service.clone().oneshot(request).await.unwrap().status()
    };
    flaky.0.store(FAIL, Ordering::SeqCst);
    for _ in 0..3 {
        assert_eq!(status().await, StatusCode::SERVICE_UNAVAILABLE);
    }
    flaky.0.store(OK, Ordering::SeqCst);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(status().await, StatusCode::OK);

    let failed = capture.named("tollgate.store.failed");
    assert_eq!(
        failed.len(),
        2,
        "the third call was refused by the open breaker"
    );
    // One WARN a second at most: the second failure, in the same second, at DEBUG.
    let levels: Vec<_> = failed.iter().map(|e| e.level).collect();
    assert_eq!(levels, [Level::WARN, Level::DEBUG]);
    for event in &failed {
        assert_eq!(event.field("store"), Some("sessions"));
        assert_eq!(event.field("kind"), Some("backend"));
        assert!(event.field("error").unwrap().contains("connection refused"));
        // Not inside the DEBUG decision span, which may carry the key: a subscriber that
        // prints an event's spans would show the key at WARN.
        assert_eq!(event.parent, None);
    }
    let levels = |name| {
        capture
            .named(name)
            .iter()
            .map(|c| c.level)
            .collect::<Vec<_>>()
    };
    assert_eq!(levels("tollgate.breaker.opened"), [Level::WARN]);
    assert_eq!(levels("tollgate.breaker.half_open"), [Level::DEBUG]);
    assert_eq!(levels("tollgate.breaker.closed"), [Level::INFO]);
    let opened = &capture.named("tollgate.breaker.opened")[0];
    assert_eq!(opened.parent, None);
    assert_eq!(capture.named("tollgate.breaker.closed")[0].parent, None);
    assert_eq!(opened.field("store"), Some("sessions"));
    assert_eq!(opened.field("open_for"), Some("1s"));
    let outcomes: Vec<_> = capture
        .named("tollgate.decision")
        .iter()
        .map(|s| s.field("outcome").unwrap_or("").to_owned())
        .collect();
    assert_eq!(
        outcomes,
        ["store_error", "store_error", "store_error", "admitted"]
    );
    // The key was asked for in plain: only the DEBUG decision spans show it.
    for c in capture.all() {
        if format!("{c:?}").contains("alice") {
            assert!(c.span && c.level == Level::DEBUG, "{c:?}");
        }
    }
}

/// A tier resolver that gives no answer (an error, a panic, a timeout) is a WARN naming the
/// rule and why (at most one a second), outside the decision span; the resolver's error text,
/// which may hold the key, only at DEBUG.
#[tokio::test(start_paused = true)]
async fn a_failing_tier_resolver_is_a_warn_without_the_key() {
    use tollgate::store::BoxError;
    let capture = Capture::default();
    let _subscriber = capture.install(LevelFilter::TRACE);
    let resolver = |key: String| async move {
        match key.as_str() {
            "alice-err" => Err::<Option<String>, BoxError>(format!("no plan row for {key}").into()),
            "alice-panic" => panic!("the resolver panicked on {key}"),
            _ => {
                std::future::pending::<()>().await;
                Ok(None)
            }
        }
    };
    let tiers = Tiers::new(resolver)
        .tier("free", [minute(100, "free")])
        .timeout(Duration::from_millis(100))
        .clock(TokioClock::new());
    let layer = RateLimitLayer::builder(MemoryStore::with_clock(TokioClock::new()))
        .rule(
            Rule::new("plan")
                .key(Header::from_static("x-user"))
                .tiers(tiers),
        )
        .build()
        .unwrap();
    let service = ServiceBuilder::new().layer(layer).service(ok_service());
    // A second apart, each is a WARN.
    for key in ["alice-err", "alice-panic", "alice-slow"] {
        let response = service.clone().oneshot(get(&[("x-user", key)])).await;
        assert_eq!(response.unwrap().status(), StatusCode::OK, "{key}");
        tokio::time::advance(Duration::from_secs(1)).await;
    }

    let fallbacks = capture.named("tollgate.tier_fallback");
    let seen: Vec<_> = fallbacks
        .iter()
        .map(|e| (e.level, e.field("rule"), e.field("reason")))
        .collect();
    assert_eq!(
        seen,
        [
            (Level::WARN, Some("plan"), Some("error")),
            (Level::WARN, Some("plan"), Some("panic")),
            (Level::WARN, Some("plan"), Some("timeout")),
        ]
    );
    for event in &fallbacks {
        assert_eq!(event.field("error"), None);
        assert_eq!(event.parent, None);
    }
    let errors = capture.named("tollgate.tier_fallback.error");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].level, Level::DEBUG);
    assert_eq!(errors[0].field("rule"), Some("plan"));
    assert!(
        errors[0]
            .field("error")
            .unwrap()
            .contains("no plan row for alice-err"),
        "{errors:?}"
    );
    // The key shows in the resolver's error text, at DEBUG, and nowhere above it.
    for c in capture.all() {
        if format!("{c:?}").contains("alice") {
            assert!(c.level >= Level::DEBUG, "{c:?}");
        }
    }

    // Within a second, the first is a WARN and the others DEBUG: a resolver that is down does
    // not log a WARN line per request.
    for _ in 0..4 {
        let response = service
            .clone()
            .oneshot(get(&[("x-user", "alice-err")]))
            .await;
        assert_eq!(response.unwrap().status(), StatusCode::OK);
    }
    let levels: Vec<_> = capture.named("tollgate.tier_fallback")[3..]
        .iter()
        .map(|e| e.level)
        .collect();
    assert_eq!(
        levels,
        [Level::WARN, Level::DEBUG, Level::DEBUG, Level::DEBUG]
    );
}

/// The overload layers say at DEBUG what they refuse, and the shedder when its limit moves.
#[tokio::test(start_paused = true)]
async fn overload_layers_refusals_and_limit_changes_at_debug() {
    let capture = Capture::default();
    let _subscriber = capture.install(LevelFilter::TRACE);

    let concurrency = ConcurrencyLimitLayer::builder()
        .name("api")
        .rule(Rule::new("per-user").key(Header::from_static("x-user")), 1)
        .build()
        .unwrap();
    let service = ServiceBuilder::new()
        .layer(concurrency)
        .service(ok_service());
    let held = service
        .clone()
        .oneshot(get(&[("x-user", "alice")]))
        .await
        .unwrap();
    let busy = service.clone().oneshot(get(&[("x-user", "alice")])).await;
    assert_eq!(busy.unwrap().status(), StatusCode::TOO_MANY_REQUESTS);
    drop(held);

    let shape = ShapeLayer::builder(MemoryStore::with_clock(TokioClock::new()))
        .name("upstream")
        .rule(
            Rule::new("per-user").key(Header::from_static("x-user")),
            Rate::per_second(1),
            1,
        )
        .build()
        .unwrap();
    let service = ServiceBuilder::new().layer(shape).service(ok_service());
    let first = tokio::spawn(service.clone().oneshot(get(&[("x-user", "alice")])));
    tokio::task::yield_now().await; // the first reserves its departure
    let second = service.clone().oneshot(get(&[("x-user", "alice")])).await;
    assert_eq!(second.unwrap().status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);

    // Ten requests to a service that hangs, given up after 300 ms: an AIMD limit with a
    // 100 ms target backs off from 10 to 9. Then one more than the limit is shed.
    let shed = LoadShedLayer::builder(Limit::aimd(10, Duration::from_millis(100)))
        .name("front")
        .classify(|_: &http::request::Parts| Criticality::CriticalPlus)
        .clock(TokioClock::new())
        .build()
        .unwrap();
    let hanging = shed.layer(tower::service_fn(|_: Request<String>| async {
        std::future::pending::<Result<Response<String>, Infallible>>().await
    }));
    let given_up: Vec<_> = (0..10)
        .map(|_| {
            let service = hanging.clone();
            tokio::spawn(tokio::time::timeout(
                Duration::from_millis(300),
                service.oneshot(get(&[])),
            ))
        })
        .collect();
    for request in given_up {
        assert!(request.await.unwrap().is_err());
    }
    assert_eq!(shed.limit(), 9);
    let mut calls = Vec::new();
    for _ in 0..10 {
        calls.push(tokio::spawn(hanging.clone().oneshot(get(&[]))));
    }
    while !calls.iter().any(|c| c.is_finished()) {
        tokio::task::yield_now().await;
    }
    let shed_answer = calls.remove(calls.iter().position(|c| c.is_finished()).unwrap());
    assert_eq!(
        shed_answer.await.unwrap().unwrap().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );

    let one = |name: &str| {
        let caught = capture.named(name);
        assert_eq!(caught.len(), 1, "{name}: {caught:?}");
        assert_eq!(caught[0].level, Level::DEBUG, "{name}");
        caught[0].fields.clone()
    };
    let refused = one("tollgate.concurrency.refused");
    assert_eq!(refused["layer"], "api");
    assert_eq!(refused["rule"], "per-user");
    assert_eq!(refused["reason"], "busy");
    let refused = one("tollgate.shape.refused");
    assert_eq!(refused["layer"], "upstream");
    assert_eq!(refused["reason"], "limited");
    let limit = one("tollgate.shed.limit");
    assert_eq!(
        (
            limit["layer"].as_str(),
            limit["from"].as_str(),
            limit["to"].as_str()
        ),
        ("front", "10", "9")
    );
    let shed_event = one("tollgate.shed");
    assert_eq!(shed_event["class"], "critical_plus");
    assert_eq!(shed_event["reason"], "capacity");
    // None of them names the key.
    assert!(
        capture
            .all()
            .iter()
            .all(|c| !format!("{c:?}").contains("alice"))
    );
    for call in calls {
        call.abort();
    }
}

/// The outbound breaker: opened at WARN, its trial call at DEBUG, closed at INFO.
#[cfg(feature = "client")]
#[tokio::test(start_paused = true)]
async fn the_outbound_breaker_at_its_levels() {
    use tollgate::client::CircuitBreakerLayer;
    let capture = Capture::default();
    let _subscriber = capture.install(LevelFilter::TRACE);
    let failing = Arc::new(AtomicU8::new(FAIL));
    let backend = {
        let failing = Arc::clone(&failing);
        tower::service_fn(move |_: Request<String>| {
            let status = match failing.load(Ordering::SeqCst) {
                FAIL => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::OK,
            };
            async move {
                let mut response = Response::new(String::new());
                *response.status_mut() = status;
                Ok::<_, Infallible>(response)
            }
        })
    };
    let breaker = CircuitBreakerLayer::builder()
        .name("inventory")
        .breaker(1, Duration::from_secs(5))
        .build();
    let client = ServiceBuilder::new().layer(breaker).service(backend);
    assert_eq!(
        client.clone().oneshot(get(&[])).await.unwrap().status(),
        503
    );
    failing.store(OK, Ordering::SeqCst);
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(
        client.clone().oneshot(get(&[])).await.unwrap().status(),
        200
    );
    let levels = |name| {
        capture
            .named(name)
            .iter()
            .map(|c| (c.level, c.field("client").map(str::to_owned)))
            .collect::<Vec<_>>()
    };
    let inventory = Some("inventory".to_owned());
    assert_eq!(
        levels("tollgate.client.breaker.opened"),
        [(Level::WARN, inventory.clone())]
    );
    assert_eq!(
        levels("tollgate.client.breaker.half_open"),
        [(Level::DEBUG, inventory.clone())]
    );
    assert_eq!(
        levels("tollgate.client.breaker.closed"),
        [(Level::INFO, inventory)]
    );
}
