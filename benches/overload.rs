//! The overload layers' own cost per request, in process: each around a trivial service
//! (answers at once), next to tower's `ConcurrencyLimit` and `LoadShed` and tower-acc's
//! adaptive `ConcurrencyLimit`, in alternation round after round so that a neighbour's load
//! hits every row alike; the median per request of each, and its difference to the bare
//! service.
//!
//! ```sh
//! cargo bench --bench overload --features axum
//! ```
#![allow(missing_docs)]

use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::body::Body;
use http::{Request, Response, StatusCode};
use tollgate::key::Header;
use tollgate::limiter::Rule;
use tollgate::shed::Limit;
use tollgate::{ConcurrencyLimitLayer, LoadShedLayer, MemoryStore, Rate, ShapeLayer};
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

type Ready = std::future::Ready<Result<Response<Body>, Infallible>>;

/// A trivial service: the layers' own cost, without axum's.
fn trivial() -> tower::util::ServiceFn<fn(Request<Body>) -> Ready> {
    fn answer(_: Request<Body>) -> Ready {
        std::future::ready(Ok(Response::new(Body::empty())))
    }
    tower::service_fn(answer as fn(_) -> _)
}

fn request() -> Request<Body> {
    let mut request = Request::get("/").body(Body::empty()).unwrap_or_default();
    request
        .headers_mut()
        .insert("x-user", http::HeaderValue::from_static("user-42"));
    request
}

/// One row: `n` requests through a fresh clone each (as hyper clones the service per request),
/// each response's body dropped at once, timed.
trait Row {
    fn run(&self, runtime: &tokio::runtime::Runtime, n: u64) -> Duration;
}

struct Svc<S>(S);

impl<S, B, E> Row for Svc<S>
where
    S: Service<Request<Body>, Response = Response<B>, Error = E> + Clone,
    E: std::fmt::Debug,
{
    fn run(&self, runtime: &tokio::runtime::Runtime, n: u64) -> Duration {
        runtime.block_on(async {
            // Measurement, not limiting: the wall clock is what a benchmark reads.
            #[allow(clippy::disallowed_methods)]
            let start = Instant::now();
            for _ in 0..n {
                let response = self.0.clone().oneshot(request()).await;
                let status = response
                    .map(|r| r.status())
                    .unwrap_or(StatusCode::IM_A_TEAPOT);
                assert_eq!(std::hint::black_box(status), StatusCode::OK);
            }
            start.elapsed()
        })
    }
}

fn row<S, B, E>(service: S) -> Box<dyn Row>
where
    S: Service<Request<Body>, Response = Response<B>, Error = E> + Clone + 'static,
    E: std::fmt::Debug,
{
    Box::new(Svc(service))
}

/// A layer that must build (a benchmark has no use for a bad configuration).
fn built<T, E: std::fmt::Display>(result: Result<T, E>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

fn rows() -> Vec<(&'static str, Box<dyn Row>)> {
    let per_user = || Rule::new("per-user").key(Header::from_static("x-user"));
    let concurrency_total = built(ConcurrencyLimitLayer::builder().total(1_000_000).build());
    let concurrency_key = built(
        ConcurrencyLimitLayer::builder()
            .rule(per_user(), 1_000_000)
            .build(),
    );
    let shed_fixed = built(LoadShedLayer::builder(Limit::fixed(1_000_000)).build());
    let shed_vegas = built(LoadShedLayer::builder(Limit::vegas(100).bounds(1, 1_000_000)).build());
    let shape = built(
        ShapeLayer::builder(MemoryStore::new())
            .rule(per_user(), Rate::per_second(1_000_000_000), 1_000_000_000)
            .build(),
    );
    vec![
        ("trivial service", row(trivial())),
        (
            "tower ConcurrencyLimit",
            row(ServiceBuilder::new()
                .concurrency_limit(1_000_000)
                .service(trivial())),
        ),
        (
            "tower LoadShed+ConcLimit",
            row(ServiceBuilder::new()
                .load_shed()
                .concurrency_limit(1_000_000)
                .service(trivial())
                .map_err(|e: BoxError| e.to_string())),
        ),
        (
            "tower-acc Vegas",
            row(ServiceBuilder::new()
                .layer(tower_acc::ConcurrencyLimitLayer::new(
                    tower_acc::Vegas::default(),
                ))
                .service(trivial())),
        ),
        (
            "tollgate concurrency, total",
            row(ServiceBuilder::new()
                .layer(concurrency_total)
                .service(trivial())),
        ),
        (
            "tollgate concurrency, key",
            row(ServiceBuilder::new()
                .layer(concurrency_key)
                .service(trivial())),
        ),
        (
            "tollgate shed, fixed",
            row(ServiceBuilder::new().layer(shed_fixed).service(trivial())),
        ),
        (
            "tollgate shed, Vegas",
            row(ServiceBuilder::new().layer(shed_vegas).service(trivial())),
        ),
        (
            "tollgate shape, key",
            row(ServiceBuilder::new().layer(shape).service(trivial())),
        ),
    ]
}

fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return;
    }
    let rounds: usize = std::env::var("OVERLOAD_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(31);
    const PER_ROUND: u64 = 20_000;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let rows = rows();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
    for _ in 0..rounds {
        for (i, (_, row)) in rows.iter().enumerate() {
            let took = row.run(&runtime, PER_ROUND);
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
    println!("interleaved medians ({rounds} rounds of {PER_ROUND} requests each):");
    for ((name, _), median) in rows.iter().zip(&medians) {
        println!(
            "  {name:<28} {median:>7.0} ns/request  {:>+6.0} ns vs the trivial service",
            median - medians[0]
        );
    }
}
