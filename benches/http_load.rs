//! Loopback load: hello-world axum servers (bare; with tollgate's layer, with it but no
//! rate-limit fields, with tower_governor's `GovernorLayer`, each under `Router::layer`; and
//! both layers wrapped around the whole router; tower_governor with its own headers
//! (`use_headers`) in both places; and a layer that only inserts the two IETF fields with
//! values made once, the floor of any layer that sends them) driven by `wrk` in the same run,
//! in alternation, for requests per second and the 99th percentile latency.
//!
//! ```sh
//! apt-get install -y wrk          # Debian's wrk
//! cargo bench --bench http_load --features axum
//! ```
//!
//! The servers share one tokio worker thread, wrk gets one thread: on a two-core machine each
//! side has a core. Every run is bounded: `ROUNDS` x 9 servers x `SECONDS` seconds.
#![allow(missing_docs)]

mod apps;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::Command;

use apps::{governor, governor_with_headers, hello, limited, static_fields};
use axum::Extension;
use axum::extract::{ConnectInfo, Request};
use axum::response::Response;
use axum::serve::IncomingStream;
use tokio::net::TcpListener;
use tollgate::http::HeaderProfile;
use tower::{Layer, Service, ServiceBuilder};

/// Rounds, unless `HTTP_LOAD_ROUNDS` says otherwise (at most 50).
const ROUNDS: usize = 7;
const SECONDS: u32 = 3;
const CONNECTIONS: u32 = 32;

/// Serves `service` as `into_make_service_with_connect_info` serves a router: each connection
/// gets a clone that puts the peer address into every request.
async fn serve<S>(listener: TcpListener, service: S) -> std::io::Result<()>
where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + Sync + 'static,
    S::Future: Send,
{
    let make = tower::service_fn(move |incoming: IncomingStream<'_, TcpListener>| {
        let with_peer = Extension(ConnectInfo(*incoming.remote_addr())).layer(service.clone());
        std::future::ready(Ok::<_, Infallible>(with_peer))
    });
    axum::serve(listener, make).await
}

/// Binds a loopback port and serves `service` there.
async fn spawn<S>(service: S) -> SocketAddr
where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + Sync + 'static,
    S::Future: Send,
{
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(serve(listener, service));
    addr
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
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
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
        vec![
            ("bare axum", spawn(hello()).await),
            (
                "tollgate",
                spawn(hello().layer(limited(HeaderProfile::Ietf, false))).await,
            ),
            (
                "tollgate, no fields",
                spawn(hello().layer(limited(HeaderProfile::Off, false))).await,
            ),
            ("tower_governor", spawn(hello().layer(governor())).await),
            (
                "tollgate around",
                spawn(
                    ServiceBuilder::new()
                        .layer(limited(HeaderProfile::Ietf, false))
                        .service(hello()),
                )
                .await,
            ),
            (
                "tower_governor around",
                spawn(
                    ServiceBuilder::new()
                        .layer(governor())
                        .service(hello().into_service()),
                )
                .await,
            ),
            (
                "tower_governor + headers",
                spawn(hello().layer(governor_with_headers())).await,
            ),
            (
                "tower_gov. + headers around",
                spawn(
                    ServiceBuilder::new()
                        .layer(governor_with_headers())
                        .service(hello().into_service()),
                )
                .await,
            ),
            (
                "static fields around",
                spawn(
                    ServiceBuilder::new()
                        .map_response(static_fields)
                        .service(hello().into_service()),
                )
                .await,
            ),
        ]
    });
    let rounds = std::env::var("HTTP_LOAD_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(ROUNDS)
        .clamp(1, 50);
    let mut results: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); servers.len()];
    // Each server's share of the bare server's rate in the same round: the host's load drifts
    // from round to round, and a round's servers run within seconds of each other.
    let mut shares: Vec<Vec<f64>> = vec![Vec::new(); servers.len()];
    for round in 1..=rounds {
        let mut bare = None;
        for (i, (name, addr)) in servers.iter().enumerate() {
            match wrk(*addr) {
                Some((rps, p99)) => {
                    println!("round {round}: {name:<27} {rps:>9.0} req/s  p99 {p99:>7.0} us");
                    results[i].0.push(rps);
                    results[i].1.push(p99);
                    if i == 0 {
                        bare = Some(rps);
                    }
                    if let Some(bare) = bare {
                        shares[i].push(rps / bare);
                    }
                }
                None => println!("round {round}: {name}: wrk gave no figures"),
            }
        }
    }
    let Some((bare_rps, _)) = results.first().map(|(r, p)| (median(&mut r.clone()), p)) else {
        return;
    };
    println!(
        "\nmedians of {rounds} rounds (wrk -t1 -c{CONNECTIONS} -d{SECONDS}s, server on one worker thread):"
    );
    for (((name, _), (rps, p99)), shares) in servers.iter().zip(results.iter_mut()).zip(&mut shares)
    {
        if rps.is_empty() {
            continue;
        }
        let (rps, p99) = (median(rps), median(p99));
        println!(
            "  {name:<27} {rps:>9.0} req/s ({:.3}x bare)  p99 {p99:>6.0} us  share of bare in the same round {:.3}x",
            rps / bare_rps,
            median(shares),
        );
    }
}
