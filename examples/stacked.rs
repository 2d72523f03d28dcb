//! cargo run --example stacked
//!
//! Stacked limits: per user, per tenant and global, decided all or nothing. An authentication
//! middleware puts the user and the tenant into the request extensions; the limiter keys two
//! rules by them. A user over their own limit costs the tenant nothing, and when the tenant is
//! out, every user of it is refused. Runs on loopback and exits.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::get;
use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::key::{Extension, Global};
use tollgate::limiter::{MissingKey, Rule};
use tollgate::{MemoryStore, Policy, RateLimitLayer};

#[derive(Clone)]
struct User(String);
#[derive(Clone)]
struct Tenant(String);

impl fmt::Display for User {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stand-in for real authentication: `Authorization: Bearer user@tenant`.
async fn authenticate(mut request: Request, next: Next) -> Result<Response, StatusCode> {
    let token = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(StatusCode::UNAUTHORIZED)?;
    let (user, tenant) = token.split_once('@').ok_or(StatusCode::UNAUTHORIZED)?;
    let (user, tenant) = (User(user.to_owned()), Tenant(tenant.to_owned()));
    request.extensions_mut().insert(user);
    request.extensions_mut().insert(tenant);
    Ok(next.run(request).await)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let minute = Duration::from_secs(60);
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::new("user")
                .key(Extension::<User>::new())
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
                .policy(Policy::fixed_window(3, minute)?),
        )
        .rule(
            Rule::new("tenant")
                .key(Extension::<Tenant>::new())
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
                .policy(Policy::fixed_window(5, minute)?),
        )
        .rule(
            Rule::new("global")
                .key(Global)
                .policy(Policy::fixed_window(1000, minute)?),
        )
        .build()?;
    // Layers run outside-in: authenticate first, then the limits.
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
        .layer(middleware::from_fn(authenticate));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, app).await
    });

    println!("limits: 3/min per user, 5/min per tenant, 1000/min in all\n");
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    for token in [
        "ann@acme",
        "ann@acme",
        "ann@acme",
        "ann@acme",
        "ann@acme", // ann runs out; acme pays 3
        "bob@acme",
        "bob@acme",
        "bob@acme",    // acme runs out after bob's second
        "cid@initech", // another tenant is untouched
    ] {
        let request = http::Request::get(format!("http://{addr}/"))
            .header("authorization", format!("Bearer {token}"))
            .body(Empty::new())?;
        let response = client.request(request).await?;
        let status = response.status();
        let ratelimit = response
            .headers()
            .get("ratelimit")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_owned();
        let body = response.into_body().collect().await?.to_bytes();
        let refused_by = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|problem| problem["violated-policies"][0].as_str().map(str::to_owned))
            .map(|p| format!("(refused by {p})"))
            .unwrap_or_default();
        println!(
            "{token:<12} {:<4} RateLimit: {ratelimit:<22} {refused_by}",
            status.as_u16()
        );
    }
    Ok(())
}
