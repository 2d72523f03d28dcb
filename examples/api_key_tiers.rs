//! cargo run --example api_key_tiers
//!
//! Limits by plan: each API key belongs to a tier (free or pro) that a slow "database" knows.
//! The tier is looked up once per key and remembered for a minute, so the database sees one
//! query per key, not one per request. A request without a key is refused with 401. Runs on
//! loopback and exits.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::routing::get;
use axum::{Extension, Router};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::key::Header;
use tollgate::limiter::{MissingKey, Rule, Tiers};
use tollgate::{Decision, MemoryStore, Policy, Rate, RateLimitLayer};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The "database": API key -> plan, answering in 20 ms.
    let plans: Arc<HashMap<&str, &str>> = Arc::new(HashMap::from([("key-alice", "pro")]));
    let queries = Arc::new(AtomicUsize::new(0));
    let resolver = {
        let (plans, queries) = (plans.clone(), queries.clone());
        move |api_key: String| {
            let (plans, queries) = (plans.clone(), queries.clone());
            async move {
                queries.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                plans.get(api_key.as_str()).map(|plan| plan.to_string())
            }
        }
    };
    let tiers = Tiers::new(resolver)
        .tier(
            "free",
            [Policy::gcra(Rate::per_minute(60), 3)?.named("free")?],
        )
        .tier(
            "pro",
            [Policy::gcra(Rate::per_minute(600), 10)?.named("pro")?],
        )
        .default_tier("free")
        .cache_for(Duration::from_secs(60));
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::new("plan")
                .key(Header::from_static("x-api-key"))
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
                .tiers(tiers),
        )
        .decision_extension(true) // handlers read the decision
        .build()?;
    // Handlers see the decision.
    let app = Router::new()
        .route(
            "/",
            get(|Extension(d): Extension<Decision>| async move {
                format!("{} of {} left", d.remaining(), d.limit())
            }),
        )
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, app).await
    });

    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    for (who, key) in [
        ("alice (pro)", Some("key-alice")),
        ("bob (free)", Some("key-bob")),
        ("anonymous", None),
    ] {
        println!("{who}:");
        for _ in 0..5 {
            let mut request = Request::get(format!("http://{addr}/"));
            if let Some(key) = key {
                request = request.header("x-api-key", key);
            }
            let response = client.request(request.body(Empty::new())?).await?;
            let status = response.status();
            let ratelimit = response
                .headers()
                .get("ratelimit")
                .map(|v| v.to_str().unwrap_or("?").to_owned())
                .unwrap_or_else(|| "-".into());
            let body = response.into_body().collect().await?.to_bytes();
            let body = String::from_utf8_lossy(&body);
            let body: String = body.chars().take(40).collect();
            println!("  {status:<22} RateLimit: {ratelimit:<22} {body}");
            if key.is_none() {
                break;
            }
        }
    }
    println!(
        "\ndatabase queries: {} (one per key)",
        queries.load(Ordering::SeqCst)
    );
    Ok(())
}
