//! The apps both HTTP benchmarks measure: a hello-world router, tollgate's layer with a limit
//! nobody reaches, tower_governor's layer configured alike, and the floor of any layer that
//! sends the IETF fields (the two fields with values made once).

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use governor::clock::QuantaInstant;
use governor::middleware::{NoOpMiddleware, StateInformationMiddleware};
use tollgate::http::HeaderProfile;
use tollgate::key::PeerIp;
use tollgate::limiter::Rule;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::PeerIpKeyExtractor;

pub(crate) fn hello() -> Router {
    Router::new().route("/", get(|| async { "Hello, World!" }))
}

/// Per IP, 10^9 per second with a burst of 10^9: nobody reaches it, so every request is
/// admitted (and carries the fields of `profile`); with `decision_extension`, the decision
/// goes into the request's extensions (off by default).
pub(crate) fn limited(
    profile: HeaderProfile,
    decision_extension: bool,
) -> RateLimitLayer<MemoryStore> {
    let policy = Policy::gcra(Rate::per_second(1_000_000_000), 1_000_000_000)
        .and_then(|p| p.named("per-ip"))
        .unwrap_or_else(|e| panic!("{e}"));
    RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::new("per-ip").key(PeerIp::new()).policy(policy))
        .headers(profile)
        .decision_extension(decision_extension)
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// [`limited`] (with the IETF fields) for the paths under `prefix` only.
#[allow(dead_code)] // Only benches/http.rs uses it.
pub(crate) fn limited_path(prefix: &str) -> RateLimitLayer<MemoryStore> {
    let policy = Policy::gcra(Rate::per_second(1_000_000_000), 1_000_000_000)
        .and_then(|p| p.named("per-ip"))
        .unwrap_or_else(|e| panic!("{e}"));
    RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::new("per-ip")
                .path_prefix(prefix)
                .key(PeerIp::new())
                .policy(policy),
        )
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// tower_governor's per-IP layer, one request per nanosecond with a burst of 2^32 - 1.
pub(crate) fn governor() -> GovernorLayer<PeerIpKeyExtractor, NoOpMiddleware<QuantaInstant>, Body> {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .finish()
        .unwrap_or_else(|| panic!("governor config"));
    GovernorLayer::new(Arc::new(config))
}

/// The same with tower_governor's own headers on every response (`use_headers`:
/// `x-ratelimit-limit` and `x-ratelimit-remaining` on admitted requests): tollgate's like for
/// like, since tollgate sends its fields by default.
pub(crate) fn governor_with_headers()
-> GovernorLayer<PeerIpKeyExtractor, StateInformationMiddleware, Body> {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .use_headers()
        .finish()
        .unwrap_or_else(|| panic!("governor config"));
    GovernorLayer::new(Arc::new(config))
}

/// What any layer that sends the IETF fields pays at least: the two fields, with values made
/// once, inserted into the response (the http crate hashes a custom name on every insert).
pub(crate) fn static_fields<B>(mut response: http::Response<B>) -> http::Response<B> {
    use http::{HeaderName, HeaderValue};
    const POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
    const STATUS: HeaderName = HeaderName::from_static("ratelimit");
    let headers = response.headers_mut();
    headers.insert(
        POLICY,
        HeaderValue::from_static("\"per-ip\";q=1000000000;w=1"),
    );
    headers.insert(
        STATUS,
        HeaderValue::from_static("\"per-ip\";r=999999999;t=0"),
    );
    response
}
