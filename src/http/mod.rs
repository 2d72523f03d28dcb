//! The HTTP layer: [`RateLimitLayer`] runs a [`Limiter`](crate::limiter::Limiter)'s rules in
//! front of any tower HTTP service (axum, tonic, hyper) and answers with what clients
//! understand.
//!
//! - **Admitted** requests reach the inner service, and the response gains the IETF
//!   `RateLimit-Policy` and `RateLimit` fields (or the legacy `X-RateLimit-*` trio, or both,
//!   or none: see [`HeaderProfile`]). Handlers that want the [`Decision`](crate::Decision)
//!   itself (in axum, `Extension<Decision>`) turn on
//!   [`decision_extension(true)`](RateLimitLayerBuilder::decision_extension): it is off by
//!   default, since it costs an allocation per request.
//! - **Refused** requests never reach it: `429 Too Many Requests` with `Retry-After`,
//!   `Cache-Control: no-store` and an RFC 9457 `application/problem+json` body; a store that
//!   cannot decide gives `503` with `Retry-After`; a gRPC request gets HTTP 200 with
//!   `grpc-status` 8 or 14 instead. The answer is pluggable ([`Responder`]).
//!
//! The layer is `Clone + Send + Sync`, keeps one set of limits however many routes axum
//! applies it to (`Router::layer`, `Router::route_layer`, `ServiceBuilder`), never reads the
//! body, and needs no `HandleErrorLayer`: a refusal is an `Ok` response. Responses keep the
//! inner service's body type (see [`RefusalBody`]), so nothing is boxed again on the way out.
//!
//! **Where to put it.** Wrapped around the whole router (`ServiceBuilder::new().layer(limits)
//! .service(router)`, or `limits.layer(router)`), the layer runs once per request, before
//! routing. Under `Router::layer` axum wraps it around every route, boxed, and clones it for
//! every request: that alone costs 110 to 130 ns per request, even for a layer that does
//! nothing (BENCHMARKS.md). Rules on axum route templates (`Rule::route`) need the layer
//! inside the router (`Router::layer` or `Router::route_layer`), because `MatchedPath` exists
//! only once the router has matched a route; rules on paths and prefixes work in both places,
//! and in a router nested with `Router::nest` they match the full path, as it was before axum
//! stripped the nest's prefix. Paths are compared as the application reads them, decoded:
//! `/files/%65xports` is `/files/exports` (see [the limiter's rules on
//! paths](crate::limiter#paths)).
//!
//! ```no_run
//! use std::net::SocketAddr;
//! use axum::{Router, ServiceExt, extract::Request, routing::get};
//! use tower::Layer as _;
//! use tollgate::{MemoryStore, Policy, RateLimitLayer, Rate, key::PeerIp, limiter::Rule};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let limits = RateLimitLayer::builder(MemoryStore::new())
//!     .rule(Rule::new("per-ip").key(PeerIp::new()).policy(Policy::gcra(Rate::per_second(10), 20)?))
//!     .build()?;
//! let router = Router::new().route("/", get(|| async { "hello" }));
//! let app = limits.layer(router); // around the router: once per request
//! let make = ServiceExt::<Request>::into_make_service_with_connect_info::<SocketAddr>(app);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, make).await?;
//! # Ok(())
//! # }
//! ```
//!
//! ```
//! use std::convert::Infallible;
//! use std::net::SocketAddr;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use tollgate::{MemoryStore, Policy, RateLimitLayer, Rate};
//! use tollgate::clock::ManualClock;
//! use tollgate::key::PeerIp;
//! use tollgate::limiter::Rule;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = RateLimitLayer::builder(MemoryStore::with_clock(ManualClock::new()))
//!     .rule(Rule::new("per-ip").key(PeerIp::new()).policy(Policy::gcra(Rate::per_second(1), 2)?))
//!     .build()?;
//! let mut service = ServiceBuilder::new().layer(layer).service_fn(|_req: Request<String>| async {
//!     Ok::<_, Infallible>(Response::new(http_body_util::Full::new(Bytes::from("hello"))))
//! });
//!
//! let request = || {
//!     let mut r = Request::new(String::new());
//!     r.extensions_mut().insert("192.0.2.1:5000".parse::<SocketAddr>().unwrap());
//!     r
//! };
//! let first = service.ready().await?.call(request()).await?;
//! assert_eq!(first.status(), StatusCode::OK);
//! assert_eq!(first.headers()["ratelimit"], r#""per-ip";r=1;t=1"#);
//! assert_eq!(first.headers()["ratelimit-policy"], r#""per-ip";q=2;w=2"#);
//! service.ready().await?.call(request()).await?;
//! let third = service.ready().await?.call(request()).await?;
//! assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(third.headers()["retry-after"], "1");
//! # Ok(())
//! # }
//! ```
//!
//! # What the fields say
//!
//! `RateLimit-Policy: "name";q=Q;w=W` lists every policy that applied to the request: `q` its
//! limit (a bucket's burst), `w` its window in seconds (for a bucket, the time an empty burst
//! takes to refill). `RateLimit: "name";r=R;t=T` reports one of them, the one that runs out
//! first for requests like this one (the fewest further requests at their cost): `r` the
//! units left, and `t` what the IETF draft (draft-ietf-httpapi-ratelimit-headers) defines,
//! "the number of seconds until additional quota associated with the quota policy is made
//! available", rounded up:
//!
//! | algorithm | `t` on an admitted request | example (3 per 30 s, or 1 per 10 s with a burst of 3: `w=30`), requests at 0 s and 4 s |
//! | --- | --- | --- |
//! | GCRA, token bucket, leaky bucket | until the next unit is back: the time to full recovery modulo the interval (a whole interval when it divides exactly, 0 when full) | `r=2;t=10`, then `r=1;t=6` |
//! | fixed window | until the window ends | `r=2;t=30`, then `r=1;t=26` |
//! | sliding log | until the log has fully recovered (at most the window; its oldest entry may leave sooner, so a client waits a little more than it must, never less) | `r=2;t=30`, then `r=1;t=30` |
//! | sliding window counter | until the current window ends (never more than the window); with nothing left (`r=0`), a nanosecond more, rounded up: at the window's end the current window's count still weighs whole | `r=2;t=30`, then `r=1;t=26` |
//!
//! Whatever the algorithm, a client that waits `t` after a response of one policy that
//! leaves nothing (`r=0`) is admitted by it (a test generates traces to hold it so). With
//! several policies all used up, the field names the one that recovers fully last, whose `t`
//! may come before another's quota is back (the stores pick without the algorithms at hand).
//! On a refusal, `t` is the time until this request may be retried, the same number as
//! `Retry-After` (the draft asks that `Retry-After` never point before `t`). The legacy
//! `X-RateLimit-Reset` keeps its usual meaning, the time until the policy has fully recovered
//! (on a refusal, until the retry); the exact figure is [`Decision::reset_after`](crate::Decision::reset_after).
//!
//! ```
//! use std::convert::Infallible;
//! use std::time::Duration;
//! use http::{Request, Response};
//! use tower::{ServiceBuilder, ServiceExt};
//! use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
//! use tollgate::clock::ManualClock;
//! use tollgate::limiter::Rule;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ten_s = Rate::new(1, Duration::from_secs(10));
//! let half_minute = Duration::from_secs(30);
//! for (policy, at_0, at_4) in [
//!     (Policy::gcra(ten_s, 3)?, "r=2;t=10", "r=1;t=6"),
//!     (Policy::token_bucket(ten_s, 3)?, "r=2;t=10", "r=1;t=6"),
//!     (Policy::leaky_bucket(ten_s, 3)?, "r=2;t=10", "r=1;t=6"),
//!     (Policy::fixed_window(3, half_minute)?, "r=2;t=30", "r=1;t=26"),
//!     (Policy::sliding_log(3, half_minute)?, "r=2;t=30", "r=1;t=30"),
//!     (Policy::sliding_window(3, half_minute)?, "r=2;t=30", "r=1;t=26"),
//! ] {
//!     let clock = ManualClock::new();
//!     let limits = RateLimitLayer::builder(MemoryStore::with_clock(clock.clone()))
//!         .rule(Rule::new("p").policy(policy))
//!         .build()?;
//!     let service = ServiceBuilder::new().layer(limits).service_fn(|_: Request<()>| async {
//!         Ok::<_, Infallible>(Response::new(String::new()))
//!     });
//!     let t = |response: Response<String>| response.headers()["ratelimit"].to_str().map(str::to_owned);
//!     let first = service.clone().oneshot(Request::new(())).await?;
//!     assert_eq!(t(first)?, format!("\"p\";{at_0}"));
//!     clock.advance(Duration::from_secs(4));
//!     let second = service.clone().oneshot(Request::new(())).await?;
//!     assert_eq!(t(second)?, format!("\"p\";{at_4}"));
//! }
//! # Ok(())
//! # }
//! ```

mod future;
pub(crate) mod layer;
mod service;

pub use crate::answer::{
    DefaultResponder, GRPC_MESSAGE, GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS, HeaderProfile,
    QUOTA_EXCEEDED_TYPE, RATELIMIT, RATELIMIT_POLICY, RefusalBody, Rejection, RejectionKind,
    ResetFormat, Responder, ResponseBody, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING,
    X_RATELIMIT_RESET,
};
pub use future::ResponseFuture;
pub use layer::{
    CurrentLimiter, DEFAULT_UNAVAILABLE_RETRY_AFTER, RateLimitLayer, RateLimitLayerBuilder,
};
pub use service::RateLimit;
