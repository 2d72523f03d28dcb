//! cargo run --example redis_two_instances --features redis
//!
//! Two instances of one service share one limit through Redis. Two axum servers, each with
//! tollgate's layer on its own `RedisStore` (its own connections, as two processes would), on
//! two loopback ports; one client sends requests to them in turn. Together they admit exactly
//! the limit, and every answer's `RateLimit` field counts down across both. Set
//! `TOLLGATE_REDIS_URL` to use another server than redis://127.0.0.1:6379.

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
use tollgate::store::redis::RedisStore;
use tollgate::{Policy, Rate, RateLimitLayer};

/// Requests sent, alternately to each instance.
const REQUESTS: usize = 16;
/// The shared limit: 10 per minute per client, in bursts of 10.
const LIMIT: u64 = 10;

/// Starts one instance: its own store connections, the same rule.
async fn instance(url: &str, run: u32) -> Result<SocketAddr, Box<dyn std::error::Error>> {
    let store = RedisStore::connect(url).await?;
    // The client's address, plus this run's number so that two runs do not share a limit.
    let client = move |parts: &Parts| {
        let ConnectInfo(addr) = parts.extensions.get::<ConnectInfo<SocketAddr>>()?;
        Some(format!("{}:run{run}", addr.ip()))
    };
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("per-client")
                .key(client)
                .policy(Policy::gcra(Rate::per_minute(LIMIT), LIMIT)?.named("per-minute")?),
        )
        .build()?;
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let service = app.into_make_service_with_connect_info::<SocketAddr>();
        if let Err(e) = axum::serve(listener, service).await {
            eprintln!("server stopped: {e}");
        }
    });
    Ok(addr)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url =
        std::env::var("TOLLGATE_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let run = std::process::id();
    let servers = [instance(&url, run).await?, instance(&url, run).await?];
    println!("Redis: {url}");
    println!(
        "instances A on {} and B on {}, one limit of {LIMIT} per minute per client\n",
        servers[0], servers[1]
    );
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut admitted = [0; 2];
    for i in 0..REQUESTS {
        let which = i % 2;
        let response = client
            .get(format!("http://{}/", servers[which]).parse()?)
            .await?;
        let status = response.status();
        let field = |name| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_owned()
        };
        let (ratelimit, retry) = (field("ratelimit"), field("retry-after"));
        response.into_body().collect().await?;
        if status.is_success() {
            admitted[which] += 1;
        }
        let name = ["A", "B"][which];
        println!(
            "{:>2} -> {name}: {status}  RateLimit: {ratelimit}  Retry-After: {retry}",
            i + 1
        );
    }
    println!(
        "\nA admitted {}, B admitted {}: together {}, the one shared limit",
        admitted[0],
        admitted[1],
        admitted[0] + admitted[1]
    );
    if admitted[0] + admitted[1] != LIMIT {
        return Err("the two instances did not share one limit".into());
    }
    Ok(())
}
