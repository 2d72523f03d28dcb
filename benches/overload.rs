//! The overload layers' own cost per request, in process: each around a trivial service
//! (answers at once), next to tower's `ConcurrencyLimit` and `LoadShed` and tower-acc's
//! adaptive `ConcurrencyLimit`, in alternation round after round so that a neighbour's load
//! hits every row alike; the median per request of each, and its difference to the bare
//! service. The `floor:` rows are what a feature of the layers costs on its own (the clock
//! reads that time a request; a value held until the response body ends; a key counted under
//! a lock), so that a layer's figure can be read as its features' floors plus the rest.
//!
//! ```sh
//! cargo bench --bench overload --features axum
//! # only the rows whose name holds one of these words (and the trivial service):
//! cargo bench --bench overload --features axum -- shed floor
//! # on a busy machine, many short rounds (the median keeps those no other process cut):
//! OVERLOAD_BENCH_ROUNDS=301 OVERLOAD_BENCH_REQUESTS=2000 cargo bench --bench overload --features axum
//! ```
#![allow(missing_docs)]

use std::convert::Infallible;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use http::{Request, Response, StatusCode};
use tollgate::clock::{Clock, SystemClock};
use tollgate::key::Header;
use tollgate::limiter::Rule;
use tollgate::shed::Limit;
use tollgate::{ConcurrencyLimitLayer, LoadShedLayer, MemoryStore, Rate, ShapeLayer};
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

type Ready = std::future::Ready<Result<Response<Body>, Infallible>>;

const X_USER: http::HeaderName = http::HeaderName::from_static("x-user");

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

/// A response body holding a value until it ends (the floor of a permit held to the body's
/// end: a reference count taken per request and given back when the body is dropped).
struct HeldBody<B> {
    inner: B,
    _held: Option<Arc<()>>,
}

impl<B: http_body::Body + Unpin> http_body::Body for HeldBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }
}

/// One row: `n` requests through a fresh clone each (as hyper clones the service per request),
/// each response's body dropped at once, timed.
trait Row {
    fn run(&self, runtime: &tokio::runtime::Runtime, n: u64) -> Duration;
    /// The bytes of the service's response future and of its response, moved on every
    /// request.
    fn sizes(&self) -> (usize, usize);
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

    fn sizes(&self) -> (usize, usize) {
        (
            std::mem::size_of::<S::Future>(),
            std::mem::size_of::<S::Response>(),
        )
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
    let shed_fair = built(
        LoadShedLayer::builder(Limit::fixed(1_000_000))
            .fair_by(Header::from_static("x-user"))
            .build(),
    );
    let shed_vegas = built(LoadShedLayer::builder(Limit::vegas(100).bounds(1, 1_000_000)).build());
    let shape = built(
        ShapeLayer::builder(MemoryStore::new())
            .rule(per_user(), Rate::per_second(1_000_000_000), 1_000_000_000)
            .build(),
    );
    let clock = SystemClock::new();
    let (before, after) = (clock.clone(), clock);
    let held = Arc::new(());
    let shards: Arc<[parking_lot::Mutex<u32>]> = (0..32).map(|_| Default::default()).collect();
    let hasher = foldhash::fast::RandomState::default();
    vec![
        ("trivial service", row(trivial())),
        (
            "floor: two clock reads",
            row(ServiceBuilder::new()
                .map_request(move |r: Request<Body>| {
                    std::hint::black_box(before.now());
                    r
                })
                .map_response(move |r: Response<Body>| {
                    std::hint::black_box(after.now());
                    r
                })
                .service(trivial())),
        ),
        (
            "floor: held to body end",
            row(ServiceBuilder::new()
                .map_response(move |r: Response<Body>| {
                    let held = Some(Arc::clone(&held));
                    r.map(|inner| HeldBody { inner, _held: held })
                })
                .service(trivial())),
        ),
        (
            "floor: key, lock twice",
            row(ServiceBuilder::new()
                .map_request(move |r: Request<Body>| {
                    // A key read from a header and hashed, and a count in its shard taken and
                    // given back, each under the shard's lock: a per-key limit's least work
                    // (without its map of keys).
                    let key = r.headers().get(&X_USER).map(|v| v.as_bytes());
                    let shard = &shards[(hasher.hash_one(key) % 32) as usize];
                    *shard.lock() += 1;
                    *shard.lock() -= 1;
                    r
                })
                .service(trivial())),
        ),
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
            "tollgate shed, fixed, fair",
            row(ServiceBuilder::new().layer(shed_fair).service(trivial())),
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
    // On a busy machine, shorter rounds (more of them) are less often cut by another
    // process, and the median keeps those that were not.
    let per_round: u64 = std::env::var("OVERLOAD_BENCH_REQUESTS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(20_000);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    // Words that pick rows by name (cargo passes `--bench` too); none: every row.
    let words: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let rows: Vec<_> = rows()
        .into_iter()
        .enumerate()
        .filter(|(i, (name, _))| {
            *i == 0 || words.is_empty() || words.iter().any(|w| name.contains(w.as_str()))
        })
        .map(|(_, row)| row)
        .collect();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
    for _ in 0..rounds {
        for (i, (_, row)) in rows.iter().enumerate() {
            let took = row.run(&runtime, per_round);
            samples[i].push(took.as_nanos() as f64 / per_round as f64);
        }
    }
    let medians: Vec<f64> = samples
        .iter_mut()
        .map(|s| {
            s.sort_by(f64::total_cmp);
            s[s.len() / 2]
        })
        .collect();
    println!("interleaved medians ({rounds} rounds of {per_round} requests each):");
    for ((name, row), median) in rows.iter().zip(&medians) {
        let (future, response) = row.sizes();
        println!(
            "  {name:<30} {median:>7.0} ns/request  {:>+6.0} ns vs the trivial service  \
             (future {future} B, response {response} B)",
            median - medians[0]
        );
    }
}
