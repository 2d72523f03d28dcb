//! cargo run --example server_burst
//!
//! A real axum server with tollgate's layer on the in-process store, on a loopback port: one
//! client sends a burst of 12 requests, and every answer is printed (status, `RateLimit`,
//! `RateLimit-Policy`, `Retry-After`). The limits: 5 per second with bursts of 5, and 8 per
//! minute, per client address. Then the server stops and the program exits.
//!
//! The main demo (`examples/burst.rs`) includes this file as a module and calls `run`.

use std::net::SocketAddr;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::routing::get;
use bytes::Bytes;
use http::request::Parts;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::limiter::Rule;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};

/// The number of requests in the burst.
pub(crate) const BURST: usize = 12;

/// Starts the server, sends the burst, prints what came back, and stops the server.
pub(crate) async fn run() -> Result<(), Box<dyn std::error::Error>> {
    // The client's address, as axum's ConnectInfo has it (with feature `axum`,
    // `tollgate::key::PeerIp::new()` reads it the same way).
    let peer = |parts: &Parts| {
        let ConnectInfo(addr) = parts.extensions.get::<ConnectInfo<SocketAddr>>()?;
        Some(addr.ip().to_string())
    };
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::new("per-client").key(peer).policies([
            Policy::gcra(Rate::per_second(5), 5)?.named("per-second")?,
            Policy::sliding_window(8, std::time::Duration::from_secs(60))?.named("per-minute")?,
        ]))
        .build()?;
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(async {
            let _ = stopped.await;
        })
        .await
    });

    println!("server on http://{addr}: 5/s (burst 5) and 8/min per client; a burst of {BURST}:\n");
    println!(
        "{:>3}  {:<6} {:<32} {:<44} Retry-After",
        "#", "status", "RateLimit", "RateLimit-Policy"
    );
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    for i in 1..=BURST {
        let response = client.get(format!("http://{addr}/").parse()?).await?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_owned()
        };
        let (status, ratelimit, policy, retry) = (
            response.status(),
            header("ratelimit"),
            header("ratelimit-policy"),
            header("retry-after"),
        );
        response.into_body().collect().await?;
        println!(
            "{i:>3}  {:<6} {ratelimit:<32} {policy:<44} {retry}",
            status.as_u16()
        );
    }

    let _ = stop.send(());
    server.await??;
    Ok(())
}

#[allow(dead_code)] // when this file is a module of another example
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    run().await
}
