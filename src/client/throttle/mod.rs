//! Client-side adaptive throttling (Google SRE, "Handling Overload"): a client that refuses
//! requests itself while its backend refuses most of them, so that an overloaded backend does
//! not spend its capacity on refusing requests.
//!
//! Over a sliding window (two minutes, counted in [`THROTTLE_BUCKETS`] buckets of a second,
//! read through a [`Clock`](crate::clock::Clock)) the layer counts
//!
//! - **requests**: every request it was asked to send, the ones it refused itself included;
//! - **accepts**: the responses that are not a refusal, that is not `429` or `503`, not gRPC
//!   `RESOURCE_EXHAUSTED` (8) or `UNAVAILABLE` (14) in the response headers, and not an error
//!   of the inner service. Other statuses (a 404, a 500) are the backend's real answers: it
//!   took the request.
//!
//! and refuses each new request with probability `max(0, (requests - K * accepts) /
//! (requests + 1))`, `K` = 2 by default ([`DEFAULT_K`]). While the backend accepts at least one
//! request in `K`, nothing is refused. When it refuses everything, almost every request is
//! refused here, at no cost to the backend, and a few still go through: when the backend
//! recovers, their accepts bring the probability down, and as the refusals of the outage leave
//! the window (at most its two minutes later) it reaches zero.
//!
//! A refusal a tollgate layer inside this one made (an open breaker's 503, pacing's 429, marked
//! [`Refused`](crate::answer::Refused)) never reached the backend: the request is taken back
//! out of the window, counted neither as an accept (which would bring the refusals down during
//! an outage, while the breaker is open) nor as a refusal.
//!
//! A local refusal looks like the server's own: `503 Service Unavailable`
//! ([`RejectionKind::Overloaded`](crate::answer::RejectionKind::Overloaded)) with
//! `Retry-After` (1 s unless set), `Cache-Control: no-store` and a problem+json body, or for a
//! gRPC request `UNAVAILABLE` with `grpc-retry-pushback-ms`, marked
//! [`Refused`](crate::answer::Refused), made by the same [`Responder`](crate::answer::Responder)
//! path as every tollgate refusal; the inner service is not called. It is a 503, not a 429:
//! the client is not over a quota of its own, the backend is failing to serve, and a 503 (gRPC
//! `UNAVAILABLE`, as gRPC's own adaptive throttler answers) says so.
//!
//! One layer is one backend. With [`per_authority`](AdaptiveThrottleLayerBuilder::per_authority)
//! a layer keeps one window per authority of the requests' URIs (or `Host` headers), so one
//! client can call several backends. Requests with neither (as a layer around a tonic
//! `Channel` sees them: the channel adds its origin below the layer) share one window, which
//! is right for a layer around one channel, one backend; a layer shared by several channels
//! needs them told apart, by giving each its own layer. Draws come from a seeded generator
//! ([`seed`](AdaptiveThrottleLayerBuilder::seed)) so that tests see the same draws every run.
//!
//! In a client's stack it goes outside the retries (`pace -> throttle -> breaker -> retry ->
//! network`): it counts what the application asked for and the final answers.
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response, StatusCode};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use tollgate::answer::Refused;
//! use tollgate::client::AdaptiveThrottleLayer;
//! use tollgate::clock::ManualClock;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let throttle = AdaptiveThrottleLayer::builder().clock(ManualClock::new()).seed(7).build()?;
//! // A backend that refuses everything.
//! let mut client = ServiceBuilder::new().layer(throttle.clone()).service_fn(|_: Request<String>| async {
//!     let mut busy = Response::new(String::new());
//!     *busy.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
//!     Ok::<_, Infallible>(busy)
//! });
//! let mut local = 0;
//! for _ in 0..100 {
//!     let response = client.ready().await?.call(Request::new(String::new())).await?;
//!     assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
//!     local += usize::from(response.extensions().get::<Refused>().is_some());
//! }
//! // The backend saw a handful of them; the rest were refused here.
//! assert_eq!(throttle.stats().throttled, local as u64);
//! assert!(local > 80);
//! # Ok(())
//! # }
//! ```

mod future;
mod layer;
mod service;
mod window;

pub use future::ResponseFuture;
pub use layer::{
    AdaptiveThrottleLayer, AdaptiveThrottleLayerBuilder, DEFAULT_K, DEFAULT_MAX_BACKENDS,
    DEFAULT_THROTTLE_RETRY_AFTER, DEFAULT_THROTTLE_WINDOW, THROTTLE_BUCKETS, ThrottleError,
    ThrottleStats,
};
pub use service::AdaptiveThrottle;
pub use window::WindowCounts;
