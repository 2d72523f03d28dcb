//! Latency while the configuration is reloaded: requests through a reloadable rate-limit layer
//! (built from a file, two rules) on one thread, timed one by one, while another thread swaps
//! the configuration every millisecond (a changed policy each time, so that each reload builds
//! and swaps new rules), in alternation with rounds without reloads and rounds in which the
//! other thread reloads the running configuration itself every millisecond (the same work on
//! the other core, but nothing is swapped: an unchanged file swaps nothing).
//!
//! ```sh
//! cargo bench --bench reload
//! ```
#![allow(missing_docs)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{Request, Response};
use tollgate::MemoryStore;
use tollgate::config::{Bindings, Config};
use tower::{Service, ServiceBuilder, ServiceExt};

const ROUNDS: usize = 9;
const PER_ROUND: usize = 200_000;

fn config(name: &str) -> Config {
    Config::from_toml(&format!(
        r#"
        [[rules]]
        name = "one"
        policies = [{{ algorithm = "gcra", rate = "1000000000/s", name = "{name}" }}]
        [[rules]]
        name = "two"
        policies = [{{ algorithm = "fixed_window", limit = 1000000000, window = "1h", name = "{name}" }}]
        "#
    ))
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The latency of each request, in nanoseconds, sorted.
fn round<S>(runtime: &tokio::runtime::Runtime, service: &S) -> Vec<u64>
where
    S: Service<Request<String>, Response = Response<String>, Error = Infallible> + Clone,
{
    let mut times = Vec::with_capacity(PER_ROUND);
    runtime.block_on(async {
        for _ in 0..PER_ROUND {
            // Measurement, not limiting: the wall clock is what a benchmark reads.
            #[allow(clippy::disallowed_methods)]
            let start = Instant::now();
            let response = service.clone().oneshot(Request::new(String::new())).await;
            let _ = std::hint::black_box(response.map(|r| r.status()));
            times.push(u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX));
        }
    });
    times.sort_unstable();
    times
}

fn quantile(sorted: &[u64], q: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let (layer, reloader) = config("a")
        .reloadable_rate_limit_layer(MemoryStore::new(), Bindings::new())
        .unwrap_or_else(|e| panic!("{e}"));
    let handler = tower::service_fn(|_: Request<String>| {
        std::future::ready(Ok::<_, Infallible>(Response::new(String::new())))
    });
    let service = ServiceBuilder::new().layer(layer).service(handler);
    let configs = [config("a"), config("b")];
    println!(
        "{ROUNDS} rounds of {PER_ROUND} requests each, ns per request (reloads: one a millisecond):"
    );
    println!(
        "{:<16} {:>7} {:>7} {:>8} {:>9} {:>10}",
        "", "p50", "p99", "p99.9", "max", "reloads"
    );
    for r in 0..ROUNDS {
        // 0: no reload; 1: a changed configuration each time; 2: the same one.
        let mode = r % 3;
        let stop = AtomicBool::new(false);
        let reloads = AtomicU64::new(0);
        let times = std::thread::scope(|scope| {
            if mode > 0 {
                scope.spawn(|| {
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        if mode == 1 {
                            i += 1;
                        }
                        let _ = reloader.reload(configs[i % 2].clone());
                        reloads.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(Duration::from_millis(1));
                    }
                });
            }
            let times = round(&runtime, &service);
            stop.store(true, Ordering::Relaxed);
            times
        });
        println!(
            "{:<16} {:>7} {:>7} {:>8} {:>9} {:>10}",
            ["steady", "reloading", "same file"][mode],
            quantile(&times, 0.5),
            quantile(&times, 0.99),
            quantile(&times, 0.999),
            times[times.len() - 1],
            reloads.load(Ordering::Relaxed)
        );
    }
}
