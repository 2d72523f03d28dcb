//! The HTTP layer's own cost per request, in process (no sockets): an axum hello-world router
//! called with `oneshot`, bare, with tollgate's layer (in-process store, per-IP key, a limit
//! nobody reaches, the IETF fields on every response) and with tower_governor's
//! `GovernorLayer`, all in the same run.
//!
//! ```sh
//! cargo bench --bench http --features axum
//! ```
#![allow(missing_docs)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::{Extension, Router};
use criterion::{Criterion, criterion_group};
use http::{Request, StatusCode};
use tollgate::http::{HeaderProfile, RateLimit};
use tollgate::key::PeerIp;
use tollgate::limiter::Rule;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
use tower::{ServiceBuilder, ServiceExt};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

fn hello() -> Router {
    Router::new().route("/", get(|| async { "Hello, World!" }))
}

/// The peer every request comes from (as `into_make_service_with_connect_info` would say).
const PEER: SocketAddr = SocketAddr::new(
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 7)),
    51000,
);

fn with_peer(app: Router) -> Router {
    app.layer(Extension(ConnectInfo(PEER)))
}

fn bare() -> Router {
    with_peer(hello())
}

fn tollgate(profile: HeaderProfile, decision_extension: bool) -> Router {
    // 10^9 per second with a burst of 10^9: nobody reaches it.
    let policy = Policy::gcra(Rate::per_second(1_000_000_000), 1_000_000_000)
        .and_then(|p| p.named("per-ip"))
        .unwrap_or_else(|e| panic!("{e}"));
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::new("per-ip").key(PeerIp::new()).policy(policy))
        .headers(profile)
        .decision_extension(decision_extension)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    with_peer(hello().layer(layer))
}

/// The cost axum adds for any layer on a router (a boxed service and future per layer): a layer
/// that does nothing.
fn noop() -> Router {
    with_peer(hello().layer(tower::util::MapRequestLayer::new(|r: Request<Body>| r)))
}

fn governor() -> Router {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .finish()
        .unwrap_or_else(|| panic!("governor config"));
    with_peer(hello().layer(GovernorLayer::new(Arc::new(config))))
}

fn request() -> Request<Body> {
    Request::get("/").body(Body::empty()).unwrap_or_default()
}

/// A router, or a service wrapped around a whole router (no per-route boxing by axum), or
/// a trivial service alone and with the layer (the layer's own cost, without axum).
#[derive(Clone)]
enum App {
    Router(Router),
    Outside(RateLimit<Router, MemoryStore>),
    Trivial,
    TrivialLimited(RateLimit<Trivial, MemoryStore>),
}

type Trivial = tower::util::ServiceFn<
    fn(Request<Body>) -> std::future::Ready<Result<http::Response<Body>, Infallible>>,
>;

fn trivial() -> Trivial {
    fn answer(_: Request<Body>) -> std::future::Ready<Result<http::Response<Body>, Infallible>> {
        std::future::ready(Ok(http::Response::new(Body::empty())))
    }
    tower::service_fn(answer as fn(_) -> _)
}

async fn once(app: &App) -> Result<StatusCode, Infallible> {
    match app {
        App::Router(router) => Ok(router.clone().oneshot(request()).await?.status()),
        App::Trivial => Ok(trivial().oneshot(with_connect_info()).await?.status()),
        App::TrivialLimited(service) => {
            Ok(service.clone().oneshot(with_connect_info()).await?.status())
        }
        App::Outside(service) => {
            // What the router's extension layer does for the others.
            let mut request = request();
            request.extensions_mut().insert(ConnectInfo(PEER));
            Ok(service.clone().oneshot(request).await?.status())
        }
    }
}

/// tollgate around the whole router, as `ServiceBuilder` puts it.
fn tollgate_outside() -> App {
    let policy = Policy::gcra(Rate::per_second(1_000_000_000), 1_000_000_000)
        .and_then(|p| p.named("per-ip"))
        .unwrap_or_else(|e| panic!("{e}"));
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::new("per-ip").key(PeerIp::new()).policy(policy))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    App::Outside(ServiceBuilder::new().layer(layer).service(hello()))
}

fn with_connect_info() -> Request<Body> {
    let mut request = request();
    request.extensions_mut().insert(ConnectInfo(PEER));
    request
}

fn trivial_limited() -> App {
    let policy = Policy::gcra(Rate::per_second(1_000_000_000), 1_000_000_000)
        .and_then(|p| p.named("per-ip"))
        .unwrap_or_else(|e| panic!("{e}"));
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::new("per-ip").key(PeerIp::new()).policy(policy))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    App::TrivialLimited(ServiceBuilder::new().layer(layer).service(trivial()))
}

fn apps() -> Vec<(&'static str, App)> {
    vec![
        ("bare axum", App::Router(bare())),
        ("axum + a no-op layer", App::Router(noop())),
        ("tollgate", App::Router(tollgate(HeaderProfile::Ietf, true))),
        (
            "tollgate, no fields/ext.",
            App::Router(tollgate(HeaderProfile::Off, false)),
        ),
        ("tollgate around router", tollgate_outside()),
        ("tower_governor", App::Router(governor())),
        ("trivial service", App::Trivial),
        (
            "tollgate, no decision ext.",
            App::Router(tollgate(HeaderProfile::Ietf, false)),
        ),
        ("trivial + tollgate", trivial_limited()),
    ]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// `n` requests, in nanoseconds.
fn run(runtime: &tokio::runtime::Runtime, app: &App, n: u64) -> Duration {
    runtime.block_on(async {
        // Measurement, not limiting: the wall clock is what a benchmark reads.
        #[allow(clippy::disallowed_methods)]
        let start = Instant::now();
        for _ in 0..n {
            let _ = std::hint::black_box(once(app).await);
        }
        start.elapsed()
    })
}

fn bench(c: &mut Criterion) {
    let runtime = runtime();
    let apps = apps();
    // Every app answers 200 before it is timed.
    for (name, app) in &apps {
        let status = runtime.block_on(once(app));
        assert_eq!(status, Ok(StatusCode::OK), "{name}: {status:?}");
    }
    let mut group = c.benchmark_group("http/in_process");
    group.measurement_time(Duration::from_secs(4));
    for (name, app) in &apps {
        group.bench_function(*name, |b| b.iter_custom(|iters| run(&runtime, app, iters)));
    }
    group.finish();
}

/// The same apps in alternation, round after round, so that a neighbour's load hits all of
/// them alike: the median per request of each, and its difference to bare axum.
fn interleaved() {
    const ROUNDS: usize = 31;
    const PER_ROUND: u64 = 20_000;
    let runtime = runtime();
    let apps = apps();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); apps.len()];
    for _ in 0..ROUNDS {
        for (i, (_, app)) in apps.iter().enumerate() {
            let took = run(&runtime, app, PER_ROUND);
            samples[i].push(took.as_nanos() as f64 / PER_ROUND as f64);
        }
    }
    let medians: Vec<f64> = samples
        .iter_mut()
        .map(|s| {
            s.sort_by(f64::total_cmp);
            s[s.len() / 2]
        })
        .collect();
    println!("\ninterleaved medians ({ROUNDS} rounds of {PER_ROUND} requests each):");
    for ((name, _), median) in apps.iter().zip(&medians) {
        println!(
            "  {name:<26} {median:>7.0} ns/request  {:>+6.0} ns vs bare",
            median - medians[0]
        );
    }
}

criterion_group!(benches, bench);

fn main() {
    // `HTTP_BENCH_ONLY=<index> HTTP_BENCH_N=<n>`: just n requests to one app, for counting
    // instructions with `perf stat` (two runs with different n: the difference is per request).
    if let (Ok(index), Ok(n)) = (
        std::env::var("HTTP_BENCH_ONLY"),
        std::env::var("HTTP_BENCH_N"),
    ) {
        let apps = apps();
        let (Ok(index), Ok(n)) = (index.parse::<usize>(), n.parse::<u64>()) else {
            return;
        };
        if let Some((name, app)) = apps.get(index) {
            let took = run(&runtime(), app, n);
            println!("{name}: {n} requests in {took:?}");
        }
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
    if !std::env::args().any(|a| a == "--test" || a == "--list") {
        interleaved();
    }
}
