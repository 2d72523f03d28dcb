//! Concurrency limits: at most so many requests in flight per key, and optionally in all.
//!
//! A rate limit bounds arrivals, not work in flight: at 200 requests/s that each take 250 ms,
//! about 50 are in flight (Little's law), and if a dependency slows to 5 s the same 200/s means
//! 1,000 in flight while every client is within its quota. [`ConcurrencyLimitLayer`] bounds
//! what is in flight instead:
//!
//! - **Per key**: each [`Rule`](crate::limiter::Rule) (its methods, path, prefix or axum
//!   route template, key extractor, and what to do without a key, as for rate limits) allows
//!   at most so many requests in flight per key. Over it: `429 Too Many Requests` (the
//!   client's own doing), `Retry-After` estimated from how long that rule's requests have
//!   been staying in flight (at least 1 s, at most [`MAX_RETRY_AFTER`]), `Cache-Control: no-store` and a problem+json body
//!   of type [`TOO_MANY_IN_FLIGHT_TYPE`](crate::answer::TOO_MANY_IN_FLIGHT_TYPE).
//! - **In all**: an optional total cap over every request the layer sees. Over it: `503`
//!   (the service's limit, not the client's), with `Retry-After`.
//! - gRPC requests get `RESOURCE_EXHAUSTED` and `UNAVAILABLE` with `grpc-retry-pushback-ms`,
//!   as from the rate-limit layer: every layer answers through [`answer`](crate::answer).
//!
//! - **A short wait** (optional, [`queue`](ConcurrencyLimitLayerBuilder::queue)): up to so
//!   many requests that find their key or the cap full wait up to a maximum time for a place
//!   before being refused.
//!
//! A request holds its place until its response body has been sent in full, has failed, or
//! has been dropped ([`PermitBody`]): a streamed download counts until its last byte. A
//! request whose future is dropped (the client went away, a timeout layer fired) gives its
//! place back at once, and so does one whose inner service fails or panics. A key's entry
//! exists only while it has requests in flight, so memory follows the requests in flight, not
//! the keys ever seen, and a request of a key already in flight allocates nothing.
//!
//! # Too many requests in flight
//!
//! The answer when a key is at its limit: status 429, the problem type
//! [`TOO_MANY_IN_FLIGHT_TYPE`](crate::answer::TOO_MANY_IN_FLIGHT_TYPE), a `detail` naming the
//! rule, and `retry-after` in seconds.
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response, StatusCode};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use tollgate::ConcurrencyLimitLayer;
//! use tollgate::key::Header;
//! use tollgate::limiter::Rule;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let limits = ConcurrencyLimitLayer::builder()
//!     .rule(Rule::new("per-user").key(Header::from_static("x-user")), 1) // 1 in flight per user
//!     .total(100)                                                           // 100 in all
//!     .build()?;
//! let mut service = ServiceBuilder::new()
//!     .layer(limits.clone())
//!     .service_fn(|_: Request<String>| async { Ok::<_, Infallible>(Response::new(String::from("done"))) });
//! let request = |user: &str| Request::get("/").header("x-user", user).body(String::new()).unwrap();
//!
//! // Alice's first response is not sent yet: its body holds her place.
//! let first = service.ready().await?.call(request("alice")).await?;
//! assert_eq!(limits.in_flight("per-user", "alice"), 1);
//! let second = service.ready().await?.call(request("alice")).await?;
//! assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(second.headers()["retry-after"], "1");
//! // Bob has a place of his own.
//! let bob = service.ready().await?.call(request("bob")).await?;
//! assert_eq!(bob.status(), StatusCode::OK);
//! // Once Alice's body is done (sent, or dropped), her place is free again.
//! drop((first, bob));
//! assert_eq!(limits.in_flight("per-user", "alice"), 0);
//! assert_eq!(limits.tracked_keys(), 0);
//! let third = service.ready().await?.call(request("alice")).await?;
//! assert_eq!(third.status(), StatusCode::OK);
//! # Ok(())
//! # }
//! ```
//!
//! Put it inside the rate limit (a request refused by its quota should not take a place) and
//! around the work it protects.

mod layer;
mod service;
pub(crate) mod table;

pub use crate::inflight::{PermitBody, ResponseFuture};
pub use layer::{
    ConcurrencyError, ConcurrencyLimitLayer, ConcurrencyLimitLayerBuilder, MAX_RETRY_AFTER,
};
pub(crate) use layer::{Permit, bounded};
pub use service::ConcurrencyLimit;
