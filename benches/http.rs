//! The HTTP layer's own cost per request, in process (no sockets): an axum hello-world router
//! called with `oneshot`, bare, with tollgate's layer (in-process store, per-IP key, a limit
//! nobody reaches, the IETF fields on every response) and with tower_governor's
//! `GovernorLayer` (without headers, and with its `use_headers`), each both under
//! `Router::layer` and wrapped around the router, all in the same run.
//!
//! ```sh
//! cargo bench --bench http --features axum
//! ```
#![allow(missing_docs)]

mod apps;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use apps::{governor, governor_with_headers, hello, limited, limited_path, static_fields};
use axum::body::Body;
use axum::extract::ConnectInfo;
use criterion::{Criterion, criterion_group};
use http::{Request, StatusCode};
use tollgate::http::HeaderProfile;
use tower::{Service, ServiceBuilder, ServiceExt};

/// The peer every request comes from. The caller puts it into each request's extensions, as
/// `into_make_service_with_connect_info` does on a real server, so no app pays for a layer
/// that adds it.
const PEER: SocketAddr = SocketAddr::new(
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 7)),
    51000,
);

/// An IPv6 peer, for the row that shows what an IPv6 client's key costs.
const PEER6: SocketAddr = SocketAddr::new(
    std::net::IpAddr::V6(std::net::Ipv6Addr::new(
        0x2001, 0xdb8, 0x85a3, 0x8d3, 0x1319, 0x8a2e, 0x370, 0x7348,
    )),
    51000,
);

fn request(peer: SocketAddr, path: &'static str) -> Request<Body> {
    let mut request = Request::get(path).body(Body::empty()).unwrap_or_default();
    request.extensions_mut().insert(ConnectInfo(peer));
    request
}

/// A trivial tower service: the layer's own cost, without axum.
fn trivial() -> Trivial {
    fn answer(_: Request<Body>) -> std::future::Ready<Result<http::Response<Body>, Infallible>> {
        std::future::ready(Ok(http::Response::new(Body::empty())))
    }
    tower::service_fn(answer as fn(_) -> _)
}

type Trivial = tower::util::ServiceFn<
    fn(Request<Body>) -> std::future::Ready<Result<http::Response<Body>, Infallible>>,
>;

/// One app under test: `n` requests through a fresh clone each (as hyper clones the service
/// for every request), timed.
trait App: Send + Sync {
    /// `n` requests from the app's peer, moved to another network by `client` (one per
    /// thread, so that threads with distinct clients share only the layer, not a key).
    fn run(&self, runtime: &tokio::runtime::Runtime, n: u64, client: u8) -> Duration;
    fn status(&self, runtime: &tokio::runtime::Runtime) -> Option<StatusCode>;
}

/// A service, the peer its requests come from, and the path they ask for.
struct Svc<S>(S, SocketAddr, &'static str);

impl<S, B> App for Svc<S>
where
    S: Service<Request<Body>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync,
{
    fn run(&self, runtime: &tokio::runtime::Runtime, n: u64, client: u8) -> Duration {
        let peer = match self.1.ip() {
            std::net::IpAddr::V4(ip) => {
                let [a, b, c, d] = ip.octets();
                std::net::Ipv4Addr::new(a, b, c.wrapping_add(client), d).into()
            }
            std::net::IpAddr::V6(ip) => {
                let mut groups = ip.segments();
                groups[3] = groups[3].wrapping_add(u16::from(client));
                std::net::Ipv6Addr::from(groups).into()
            }
        };
        let peer = SocketAddr::new(peer, self.1.port());
        runtime.block_on(async {
            // Measurement, not limiting: the wall clock is what a benchmark reads.
            #[allow(clippy::disallowed_methods)]
            let start = Instant::now();
            for _ in 0..n {
                let response = self.0.clone().oneshot(request(peer, self.2)).await;
                let _ = std::hint::black_box(response.map(|r| r.status()));
            }
            start.elapsed()
        })
    }

    fn status(&self, runtime: &tokio::runtime::Runtime) -> Option<StatusCode> {
        runtime
            .block_on(self.0.clone().oneshot(request(self.1, self.2)))
            .ok()
            .map(|r| r.status())
    }
}

fn app<S, B>(service: S) -> Box<dyn App>
where
    S: Service<Request<Body>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
{
    Box::new(Svc(service, PEER, "/"))
}

/// Makes one app.
type Maker = fn() -> Box<dyn App>;

/// The apps, in the order of the tables in BENCHMARKS.md; `HTTP_BENCH_ONLY` takes an index
/// and makes only that one (so that its count of instructions does not depend on what the
/// others left on the heap).
fn makers() -> Vec<(&'static str, Maker)> {
    fn around<L: tower::Layer<axum::Router>>(l: L) -> L::Service {
        ServiceBuilder::new().layer(l).service(hello())
    }
    vec![
        ("bare axum", || app(hello())),
        ("axum + a no-op layer", || {
            app(hello().layer(tower::util::MapRequestLayer::new(|r: Request<Body>| r)))
        }),
        ("tollgate", || {
            app(hello().layer(limited(HeaderProfile::Ietf, false)))
        }),
        ("tollgate + decision ext.", || {
            app(hello().layer(limited(HeaderProfile::Ietf, true)))
        }),
        ("tollgate, no fields", || {
            app(hello().layer(limited(HeaderProfile::Off, false)))
        }),
        ("tower_governor", || app(hello().layer(governor()))),
        ("tollgate around router", || {
            app(around(limited(HeaderProfile::Ietf, false)))
        }),
        ("tower_governor around rtr", || {
            app(ServiceBuilder::new()
                .layer(governor())
                .service(hello().into_service::<Body>()))
        }),
        ("static fields around rtr", || {
            app(ServiceBuilder::new()
                .map_response(static_fields)
                .service(hello().into_service::<Body>()))
        }),
        ("tollgate around, IPv6 peer", || {
            Box::new(Svc(around(limited(HeaderProfile::Ietf, false)), PEER6, "/"))
        }),
        ("tollgate around, no fields", || {
            app(around(limited(HeaderProfile::Off, false)))
        }),
        ("trivial service", || app(trivial())),
        ("trivial + tollgate", || {
            app(ServiceBuilder::new()
                .layer(limited(HeaderProfile::Ietf, false))
                .service(trivial()))
        }),
        ("tower_governor + headers", || {
            app(hello().layer(governor_with_headers()))
        }),
        ("tower_gov. + headers around", || {
            app(ServiceBuilder::new()
                .layer(governor_with_headers())
                .service(hello().into_service::<Body>()))
        }),
        // What any layer with shared state pays under `Router::layer`, where axum clones the
        // route's service for every request: the no-op layer, holding an `Arc`.
        ("no-op layer holding an Arc", || {
            let shared = Arc::new(0_u64);
            app(hello().layer(tower::util::MapRequestLayer::new(
                move |r: Request<Body>| {
                    std::hint::black_box(&shared);
                    r
                },
            )))
        }),
        // A path rule (`path_prefix("/api")`) in front of the trivial service, asked for a
        // plain path (no escape, no dot segment: matched as it is) and for the same path
        // spelled with escapes (decoded and normalised first).
        ("trivial + tollgate, path rule", || {
            Box::new(Svc(
                ServiceBuilder::new()
                    .layer(limited_path("/api"))
                    .service(trivial()),
                PEER,
                "/api/v1/users/42/export",
            ))
        }),
        ("trivial + tollgate, escaped path", || {
            Box::new(Svc(
                ServiceBuilder::new()
                    .layer(limited_path("/api"))
                    .service(trivial()),
                PEER,
                "/%61pi/v1/users/%34%32/export",
            ))
        }),
    ]
}

fn apps() -> Vec<(&'static str, Box<dyn App>)> {
    makers()
        .into_iter()
        .map(|(name, make)| (name, make()))
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

fn bench(c: &mut Criterion) {
    let runtime = runtime();
    let apps = apps();
    // Every app answers 200 before it is timed.
    for (name, app) in &apps {
        let status = app.status(&runtime);
        assert_eq!(status, Some(StatusCode::OK), "{name}: {status:?}");
    }
    let mut group = c.benchmark_group("http/in_process");
    group.measurement_time(Duration::from_secs(4));
    for (name, app) in &apps {
        group.bench_function(*name, |b| {
            b.iter_custom(|iters| app.run(&runtime, iters, 0))
        });
    }
    group.finish();
}

/// The same apps in alternation, round after round, so that a neighbour's load hits all of
/// them alike: the median per request of each, and its difference to the first row. With
/// `HTTP_BENCH_THREADS=n`, n threads (each with its own runtime) drive one app at once, as
/// the worker threads of a server do: what shared state costs when cores contend for it.
fn interleaved() {
    const ROUNDS: usize = 31;
    const PER_ROUND: u64 = 20_000;
    let threads: usize = std::env::var("HTTP_BENCH_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(1)
        .max(1);
    let apart = std::env::var("HTTP_BENCH_CLIENTS").is_ok_and(|c| c == "apart");
    // `HTTP_BENCH_APPS=0,6,11`: only these rows (the first one is the baseline).
    let mut apps = apps();
    if let Ok(only) = std::env::var("HTTP_BENCH_APPS") {
        let keep: Vec<usize> = only
            .split(',')
            .filter_map(|i| i.trim().parse().ok())
            .collect();
        let mut all: Vec<_> = apps.into_iter().map(Some).collect();
        apps = keep
            .iter()
            .filter_map(|&i| all.get_mut(i)?.take())
            .collect();
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); apps.len()];
    for _ in 0..ROUNDS {
        for (i, (_, app)) in apps.iter().enumerate() {
            let took = std::thread::scope(|scope| {
                let runs: Vec<_> = (0..threads)
                    .map(|t| {
                        // One client per thread with `HTTP_BENCH_CLIENTS=apart`, else one
                        // client on every thread.
                        let client = if apart { t as u8 } else { 0 };
                        scope.spawn(move || app.run(&runtime(), PER_ROUND, client))
                    })
                    .collect();
                runs.into_iter()
                    .filter_map(|run| run.join().ok())
                    .max()
                    .unwrap_or_default()
            });
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
    println!(
        "\ninterleaved medians ({ROUNDS} rounds of {PER_ROUND} requests each, on {threads} thread(s) at once):"
    );
    for ((name, _), median) in apps.iter().zip(&medians) {
        println!(
            "  {name:<26} {median:>7.0} ns/request  {:>+6.0} ns vs the first row",
            median - medians[0]
        );
    }
}

/// `n` requests to `app`: what `scripts/instructions` counts (callgrind's
/// `--toggle-collect=*measured*`).
#[inline(never)]
fn measured(app: &dyn App, runtime: &tokio::runtime::Runtime, n: u64) -> Duration {
    app.run(runtime, n, 0)
}

criterion_group!(benches, bench);

fn main() {
    // `HTTP_BENCH_ONLY=<index> HTTP_BENCH_N=<n>`: just n requests to one app, for counting
    // instructions with `perf stat` (two runs with different n: the difference is per request).
    if let (Ok(index), Ok(n)) = (
        std::env::var("HTTP_BENCH_ONLY"),
        std::env::var("HTTP_BENCH_N"),
    ) {
        let (Ok(index), Ok(n)) = (index.parse::<usize>(), n.parse::<u64>()) else {
            return;
        };
        if let Some((name, make)) = makers().get(index) {
            let app = make();
            let runtime = runtime();
            // Warm: the clock's calibration (a loop that runs for a while, not per request)
            // and first allocations happen here, outside what is counted.
            let _ = app.run(&runtime, 100, 0);
            let took = measured(&*app, &runtime, n);
            println!("{name}: {n} requests in {took:?}");
        }
        return;
    }
    // `HTTP_BENCH_INTERLEAVED=1`: the interleaved medians alone (a few seconds);
    // `HTTP_BENCH_THREADS=2` as well: two threads drive each app at once.
    if std::env::var_os("HTTP_BENCH_INTERLEAVED").is_some() {
        interleaved();
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
    if !std::env::args().any(|a| a == "--test" || a == "--list") {
        interleaved();
    }
}
