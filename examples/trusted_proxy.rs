//! cargo run --example trusted_proxy
//!
//! Per-client limits behind a load balancer. The server trusts one proxy (127.0.0.1, standing
//! in for the load balancer) and keys requests by the client address it reports in
//! `X-Forwarded-For`. A client that connects directly (from 127.0.0.2) and forges the header
//! is keyed by its own address instead: forging a fresh address per request buys nothing.
//! Runs on loopback and exits.

use std::net::{IpAddr, SocketAddr};

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http::Request;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tollgate::key::Forwarded;
use tollgate::limiter::Rule;
use tollgate::{MemoryStore, Policy, RateLimitLayer};

fn client_from(local: IpAddr) -> Client<HttpConnector, Empty<Bytes>> {
    let mut connector = HttpConnector::new();
    connector.set_local_address(Some(local));
    Client::builder(TokioExecutor::new()).build(connector)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let per_client = Rule::new("per-client")
        // Only our load balancer's X-Forwarded-For is believed; IPv6 clients by /64.
        .key(Forwarded::trusting(["127.0.0.1/32"])?)
        .policy(Policy::fixed_window(3, std::time::Duration::from_secs(60))?);
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(per_client)
        .build()?;
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, app).await
    });

    let proxy = client_from("127.0.0.1".parse()?);
    let direct = client_from("127.0.0.2".parse()?);
    let send = |client: &Client<HttpConnector, Empty<Bytes>>, forwarded_for: &str| {
        let request = Request::get(format!("http://{addr}/"))
            .header("x-forwarded-for", forwarded_for)
            .body(Empty::new());
        let client = client.clone();
        async move { Ok::<_, Box<dyn std::error::Error>>(client.request(request?).await?.status()) }
    };

    println!("limit: 3 per minute per client\n");
    println!("through the trusted proxy (the header is believed):");
    for client_ip in [
        "198.51.100.1",
        "198.51.100.1",
        "198.51.100.2",
        "198.51.100.1",
        "198.51.100.1",
    ] {
        // What the proxy appends: whatever the client claimed, then the address it saw.
        let header = format!("10.66.66.66, {client_ip}");
        println!(
            "  client {client_ip:<13} -> {}",
            send(&proxy, &header).await?
        );
    }
    println!("\ndirectly from 127.0.0.2, forging a new address each time (the header is ignored):");
    for i in 1..=5 {
        let forged = format!("203.0.113.{i}");
        println!("  claims {forged:<13} -> {}", send(&direct, &forged).await?);
    }
    Ok(())
}
