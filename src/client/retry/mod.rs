//! Retries that honour the server: [`RetryLayer`], a tower layer for the client side of any
//! `Service<http::Request<B>>` answering `http::Response<_>` (hyper-util's client, a tonic
//! `Channel`, an axum `Router` in tests), and with feature `reqwest` the same policy as a
//! reqwest-middleware [`RetryMiddleware`].
//!
//! **What is retried.** `429` and `503`, and gRPC's `RESOURCE_EXHAUSTED` (8) and `UNAVAILABLE`
//! (14) read from a `grpc-status` header (a trailers-only answer, as tollgate's server sends);
//! if asked, the other 5xx ([`retry_server_errors`](RetryPolicyBuilder::retry_server_errors))
//! and the inner service's errors ([`retry_errors`](RetryPolicyBuilder::retry_errors)). Only
//! requests that are safe to send twice: idempotent methods (GET, HEAD, OPTIONS, PUT, DELETE,
//! TRACE), requests with an [`Idempotency-Key`](IDEMPOTENCY_KEY) header, or those a rule of
//! yours names ([`idempotent_when`](RetryPolicyBuilder::idempotent_when); gRPC calls are all
//! POSTs), and only when the body can be replayed ([`ReplayBody`]).
//!
//! **How long to wait.** The server's word first ([`ServerHints`](crate::client::ServerHints)):
//! `grpc-retry-pushback-ms` (a negative or malformed value: do not retry, as gRPC reads it), else `Retry-After` (seconds or an
//! HTTP date), else the `reset` of a `RateLimit` quota with nothing left. A random offset is
//! added to a hint, uniform below a tenth of it (at least 100 ms, at most
//! [`hint_spread`](RetryPolicyBuilder::hint_spread), 1 s), so that the thousands of clients
//! one reset instant refused do not all return at that instant. Without a hint, exponential
//! backoff with full jitter: retry `n` (from 0) waits uniformly in
//! `[0, min(cap, base * 2^n))`, base 200 ms and cap 20 s; [`Jitter`] also has equal and
//! decorrelated jitter, and none (for comparisons).
//!
//! **When to stop.** At 3 attempts in all; when the next attempt would start more than 30 s
//! after the first (so a hint longer than the time left ends the retries at once); when the
//! server says so; when the [`RetryBudget`] is spent (10 % of the requests over 10 s, plus
//! one retry per second): the caller then gets the last answer, marked with a [`GaveUp`] in
//! its extensions, and the [`RetryStats`] count why. The deadline does not cut an attempt
//! short: for a hard bound on the whole call, put a timeout outside the layer.
//!
//! The budget pays for a retry when it is decided, before the wait: a call dropped during the
//! wait (a timeout outside the layer) has spent a retry it never sent, and it counts in
//! [`RetryStats::retries`]. This errs the safe way (fewer retries, never more load on the
//! backend), by at most one retry per call dropped while waiting; paying after the wait
//! instead would let many waiting calls count on the same balance and all be refused at the
//! end of their waits, or all go at once.
//!
//! **Nested layers.** A service that calls a service that calls a service, each retrying 3
//! times, makes 27 calls at the bottom for one at the top. Budgets bound each layer to about
//! 1.1 times what it receives (1.1³ for three); and an outer layer does not retry an answer
//! an inner one already gave up on (it carries the [`GaveUp`] mark), so only the layer nearest
//! the failure retries and the bottom sees about 1.1 times the calls. The mark lives in the
//! response's extensions, inside one process; across a network hop, the middle service can
//! answer its caller with `grpc-retry-pushback-ms: -1` to say the same.
//!
//! ```
//! use std::convert::Infallible;
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use tower::{ServiceBuilder, ServiceExt};
//! use tollgate::client::{RetryLayer, RetryPolicy};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A service that refuses its first call with `Retry-After: 2`.
//! let calls = Arc::new(AtomicUsize::new(0));
//! let seen = calls.clone();
//! let service = tower::service_fn(move |_: Request<String>| {
//!     let first = seen.fetch_add(1, Ordering::SeqCst) == 0;
//!     let answer = match first {
//!         true => Response::builder().status(429).header("retry-after", "2"),
//!         false => Response::builder(),
//!     };
//!     async move { Ok::<_, Infallible>(answer.body(String::new()).unwrap()) }
//! });
//! let retry = RetryLayer::new(RetryPolicy::default());
//! let client = ServiceBuilder::new().layer(retry.clone()).service(service);
//!
//! let start = tokio::time::Instant::now();
//! let response = client.oneshot(Request::new(String::new())).await?;
//! assert_eq!(response.status(), StatusCode::OK);
//! // Two seconds as told, plus less than 200 ms of spread.
//! assert!(start.elapsed() >= Duration::from_secs(2));
//! assert!(start.elapsed() < Duration::from_millis(2200));
//! assert_eq!(retry.stats().retries, 1);
//! # Ok(())
//! # }
//! ```
//!
//! Around hyper-util's client (a `Full<Bytes>` body is replayed by cloning it, copying no
//! bytes):
//!
//! ```no_run
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use tower::{ServiceBuilder, ServiceExt};
//! use tollgate::client::{RetryLayer, RetryPolicy};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let policy = RetryPolicy::builder()
//!     .max_attempts(4)
//!     .deadline(Duration::from_secs(10))
//!     .build()?;
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new(policy))
//!     .service(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());
//!
//! let request = http::Request::get("http://api.example.com/items/7").body(Full::default())?;
//! let response = client.oneshot(request).await?;
//! # Ok(())
//! # }
//! ```

#![cfg_attr(
    feature = "tonic",
    doc = r#"
Around a tonic `Channel` (feature `tonic`, for `tonic::body::Body`, which cannot be cloned:
the layer reads the encoded request ahead, see [`ReplayBody`]). gRPC calls are all POSTs, so
name the methods that are safe to call twice:

```no_run
use tower::ServiceBuilder;
use tonic::transport::Channel;
use tollgate::client::{RetryLayer, RetryPolicy};

# async fn run() -> Result<(), Box<dyn std::error::Error>> {
let policy = RetryPolicy::builder()
    .idempotent_when(|_, path, _| path.starts_with("/inventory.Catalog/Get"))
    .build()?;
let channel = Channel::from_static("http://[::1]:50051").connect().await?;
let channel = ServiceBuilder::new()
    .layer(RetryLayer::new(policy))
    .service(channel);
// let mut client = CatalogClient::new(channel);   // any generated client
let mut grpc = tonic::client::Grpc::new(channel);
# Ok(())
# }
```
"#
)]

mod body;
mod budget;
mod future;
mod layer;
mod policy;
pub(crate) mod random;
#[cfg(feature = "reqwest")]
mod reqwest;
mod service;

pub use body::{ReadAhead, Replay, ReplayBody};
pub use budget::RetryBudget;
pub use future::ResponseFuture;
pub use layer::RetryLayer;
pub use policy::{
    DEFAULT_CLIENT_NAME, GaveUp, GiveUp, IDEMPOTENCY_KEY, Jitter, RetryConfigError, RetryPolicy,
    RetryPolicyBuilder, RetryStats,
};
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub use reqwest::RetryMiddleware;
pub use service::Retry;
