//! Loopback load: hello-world axum servers (bare, with tollgate's layer, with it but no
//! rate-limit fields, with tower_governor's `GovernorLayer`) driven by `wrk` in the same run,
//! in alternation, for requests per second and the 99th percentile latency.
//!
//! ```sh
//! apt-get install -y wrk          # Debian's wrk
//! cargo bench --bench http_load --features axum
//! ```
//!
//! The servers share one tokio worker thread, wrk gets one thread: on a two-core machine each
//! side has a core. Every run is bounded: `ROUNDS` x 4 servers x `SECONDS` seconds.
#![allow(missing_docs)]

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use tollgate::http::HeaderProfile;
use tollgate::key::PeerIp;
use tollgate::limiter::Rule;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

const ROUNDS: usize = 7;
const SECONDS: u32 = 3;
const CONNECTIONS: u32 = 32;

fn hello() -> Router {
    Router::new().route("/", get(|| async { "Hello, World!" }))
}

fn layer(profile: HeaderProfile) -> RateLimitLayer<MemoryStore> {
    // A limit nobody reaches, so every request is admitted (and carries the fields).
    let policy = Policy::gcra(Rate::per_second(1_000_000_000), 1_000_000_000)
        .and_then(|p| p.named("per-ip"))
        .unwrap_or_else(|e| panic!("{e}"));
    RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::new("per-ip").key(PeerIp::new()).policy(policy))
        .headers(profile)
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

fn tollgate() -> Router {
    hello().layer(layer(HeaderProfile::Ietf))
}

fn tollgate_no_fields() -> Router {
    hello().layer(layer(HeaderProfile::Off))
}

fn governor() -> Router {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .finish()
        .unwrap_or_else(|| panic!("governor config"));
    hello().layer(GovernorLayer::new(Arc::new(config)))
}

/// (requests per second, p99 in microseconds) of one wrk run.
fn wrk(addr: SocketAddr) -> Option<(f64, f64)> {
    let output = Command::new("wrk")
        .args([
            "-t1",
            &format!("-c{CONNECTIONS}"),
            &format!("-d{SECONDS}s"),
            "--latency",
            &format!("http://{addr}/"),
        ])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let rps = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Requests/sec:"))?
        .trim()
        .parse()
        .ok()?;
    let p99 = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("99%"))
        .and_then(|v| micros(v.trim()))?;
    Some((rps, p99))
}

fn micros(value: &str) -> Option<f64> {
    let split = value.find(|c: char| c.is_ascii_alphabetic())?;
    let (number, unit) = value.split_at(split);
    let n: f64 = number.parse().ok()?;
    Some(match unit {
        "us" => n,
        "ms" => n * 1e3,
        "s" => n * 1e6,
        _ => return None,
    })
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    if Command::new("wrk").arg("--version").output().is_err() {
        println!("wrk is not installed (apt-get install -y wrk): no load run");
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let servers: Vec<(&str, SocketAddr)> = runtime.block_on(async {
        let mut servers = Vec::new();
        for (name, app) in [
            ("bare axum", hello()),
            ("tollgate", tollgate()),
            ("tollgate, no fields", tollgate_no_fields()),
            ("tower_governor", governor()),
        ] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
            tokio::spawn(async move {
                let app = app.into_make_service_with_connect_info::<SocketAddr>();
                axum::serve(listener, app).await
            });
            servers.push((name, addr));
        }
        servers
    });
    let mut results: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); servers.len()];
    for round in 1..=ROUNDS {
        for (i, (name, addr)) in servers.iter().enumerate() {
            match wrk(*addr) {
                Some((rps, p99)) => {
                    println!("round {round}: {name:<20} {rps:>9.0} req/s  p99 {p99:>7.0} us");
                    results[i].0.push(rps);
                    results[i].1.push(p99);
                }
                None => println!("round {round}: {name}: wrk gave no figures"),
            }
        }
    }
    let Some((bare_rps, _)) = results.first().map(|(r, p)| (median(&mut r.clone()), p)) else {
        return;
    };
    println!(
        "\nmedians of {ROUNDS} rounds (wrk -t1 -c{CONNECTIONS} -d{SECONDS}s, server on one worker thread):"
    );
    for ((name, _), (rps, p99)) in servers.iter().zip(results.iter_mut()) {
        if rps.is_empty() {
            continue;
        }
        let (rps, p99) = (median(rps), median(p99));
        println!(
            "  {name:<20} {rps:>9.0} req/s ({:.3}x bare)  p99 {p99:>6.0} us",
            rps / bare_rps
        );
    }
}
