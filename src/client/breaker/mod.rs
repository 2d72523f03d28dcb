//! A circuit breaker for outbound calls: after a run of failures, stop calling the backend for
//! a while, then let one trial call through.
//!
//! It is the breaker of [`ResilientStore`](crate::store::ResilientStore), one implementation
//! for both:
//!
//! - **closed**: calls go through; [`failures`](CircuitBreakerLayerBuilder::breaker)
//!   consecutive failing answers (5 by default) open it;
//! - **open**: for `open_for` (5 s by default) no call reaches the backend; each is answered
//!   here with `503 Service Unavailable` and a `Retry-After` of the time until the trial call
//!   (gRPC: `UNAVAILABLE` with `grpc-retry-pushback-ms`), a problem+json body, marked
//!   [`Refused`](crate::answer::Refused), through the crate's one answer path;
//! - **half-open**: the first call after `open_for` is the trial, alone; the others are still
//!   answered here. Its success closes the breaker, its failure opens it again for `open_for`.
//!   A trial whose caller gives up (its future dropped before the answer) opens it again too.
//!
//! What a failure is ([`Outcome::of`], or your own with
//! [`classify`](CircuitBreakerLayerBuilder::classify)): an error of the inner service, a `500`,
//! `502`, `503` or `504`, or gRPC `INTERNAL`, `UNAVAILABLE` or `DEADLINE_EXCEEDED`. A `429`
//! (gRPC `RESOURCE_EXHAUSTED`) is neither a failure nor a success: the backend is up and
//! refusing this client's quota, a matter for the retry layer and pacing, not for the breaker.
//! Answers made by a tollgate layer inside this one count for nothing either.
//!
//! Answers that arrive late count only for the state they were sent in: a call sent before the
//! breaker opened cannot close it with its success, nor one sent before a trial closed it open
//! it again.
//!
//! ```
//! use std::convert::Infallible;
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use tollgate::client::CircuitBreakerLayer;
//! use tollgate::clock::ManualClock;
//! use tollgate::store::resilient::BreakerStatus;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let clock = ManualClock::new();
//! let breaker = CircuitBreakerLayer::builder()
//!     .breaker(3, Duration::from_secs(10))
//!     .clock(clock.clone())
//!     .build();
//! let mut client = ServiceBuilder::new().layer(breaker.clone()).service_fn(|_: Request<String>| async {
//!     let mut down = Response::new(String::new());
//!     *down.status_mut() = StatusCode::BAD_GATEWAY;
//!     Ok::<_, Infallible>(down)
//! });
//! for _ in 0..3 {
//!     client.ready().await?.call(Request::new(String::new())).await?;
//! }
//! assert_eq!(breaker.status(), BreakerStatus::Open);
//! let refused = client.ready().await?.call(Request::new(String::new())).await?;
//! assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
//! assert_eq!(refused.headers()["retry-after"], "10");
//! assert_eq!(breaker.stats().short_circuited, 1);
//! # Ok(())
//! # }
//! ```

mod future;
mod layer;
mod service;

pub use crate::breaker::BreakerStatus;
pub use future::ResponseFuture;
pub use layer::{
    BreakerStats, CircuitBreakerLayer, CircuitBreakerLayerBuilder, DEFAULT_OUTBOUND_FAILURES,
    DEFAULT_OUTBOUND_OPEN_FOR, Outcome,
};
pub use service::CircuitBreaker;
