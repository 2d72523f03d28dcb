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
//! - **Per tier**: with [`tiered`](ConcurrencyLimitLayerBuilder::tiered), the limit of a key
//!   follows its tier (free, pro), found by a [`Tiers`](crate::limiter::Tiers) resolver.
//! - **In all**: an optional total cap over every request the layer sees. Over it: `503`
//!   (the service's limit, not the client's), with `Retry-After`.
//! - gRPC requests get `RESOURCE_EXHAUSTED` and `UNAVAILABLE` with `grpc-retry-pushback-ms`,
//!   as from the rate-limit layer: every layer answers through [`answer`](crate::answer).
//!
//! - **A short, fair wait** (optional, [`queue`](ConcurrencyLimitLayerBuilder::queue)): up
//!   to so many requests that find their key or the cap full wait up to a maximum time for a
//!   place before being refused, served fairly between keys ([Fairness](#fairness)).
//!
//! A request holds its place until its response body has been sent in full, has failed, or
//! has been dropped ([`PermitBody`]): a streamed download counts until its last byte. A
//! request whose future is dropped (the client went away, a timeout layer fired) gives its
//! place back at once, and so does one whose inner service fails or panics. A key's entry
//! exists only while it has requests in flight, so memory follows the requests in flight, not
//! the keys ever seen, and a request of a key already in flight allocates nothing.
//!
//! # Fairness
//!
//! With a [queue](ConcurrencyLimitLayerBuilder::queue), waiting is fair between keys. A
//! *flow* is the key of the first rule that applies to a request (the requests no rule
//! applies to make one flow); the queue keeps its waiters per flow, and a flow exists only
//! while one of its requests waits, so the queue's memory follows its length, not the number
//! of keys. What a flow is promised, while its requests wait (up to the longest wait):
//!
//! 1. **No overtaking.** A place given back while requests wait is handed to a waiter it
//!    fits, and a newcomer that finds anyone waiting is ordered with them: it gets a place at
//!    once only if no waiter can use that place.
//! 2. **Fair order.** Among the waiters a place fits, the oldest waiter of the flow whose key
//!    holds the fewest places goes first (ties: the flow served least recently by the queue,
//!    then the one that entered it first). A request of a key with nothing in flight that
//!    waits for the total cap is therefore admitted when a place under the cap is next given
//!    back, by any key, unless waiters of other keys holding nothing are ahead of it (then it
//!    is admitted within as many places given back as there are such flows ahead of it).
//! 3. **Its share of the queue.** A flow waits in at most `max_waiting` divided by the number
//!    of flows waiting (at least one place), and in at most as many places as its key has;
//!    when the queue is full, a newcomer whose flow is under its share pushes out the newest
//!    waiter of the longest flow, if that flow is over its share (that waiter is refused as
//!    if the queue had been full). A flow under its share is not refused for a full queue
//!    while some flow is over its share (with more flows than places in the queue, every
//!    share is one place, and a newcomer is refused).
//! 4. **Its own places in order.** A place of a key goes to the oldest waiter of that key's
//!    flow that it fits (a key of a later rule has waiters in many flows: each flow is served
//!    in the order of point 2).
//!
//! A waiter whose client goes away (its future dropped) leaves at once and takes nothing; a
//! place handed to it as it went goes on to the next waiter. What is not promised: places in
//! flight are not taken back, so a key that holds many places with long requests keeps them
//! until those requests end (fairness acts on each place given back, not on those held), and
//! a key still takes any place no one waits for. The wait is timed on the layer's
//! [clock](ConcurrencyLimitLayerBuilder::clock).
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
//! # Across instances
//!
//! With the `redis` feature, [`redis`](ConcurrencyLimitLayerBuilder::redis) counts each rule's
//! places on a [`RedisStore`](crate::RedisStore), so that the instances of a service together
//! never have more than a rule's limit in flight for one key. Each admitted request holds a
//! *lease* per key: a member of a sorted set of lease deadlines kept per key, taken by one
//! script that first drops the leases past their deadline (with the time from Redis `TIME`),
//! renewed every third of the [lease time](ConcurrencyLimitLayerBuilder::lease_time) while
//! the request runs, and removed when its response ends. An instance that crashes stops
//! renewing: its leases free their places after one lease time, and not before.
//!
//! ```no_run
//! # #[cfg(feature = "redis")]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use tollgate::key::Header;
//! use tollgate::limiter::Rule;
//! use tollgate::{ConcurrencyLimitLayer, RedisStore};
//!
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//! let limits = ConcurrencyLimitLayer::builder()
//!     .rule(Rule::new("per-tenant").key(Header::from_static("x-tenant")), 20)
//!     .redis(store)
//!     .lease_time(Duration::from_secs(10))
//!     .build()?;
//! # let _ = limits;
//! # Ok(())
//! # }
//! ```
//!
//! A request first takes its place in process (a key over its limit on this instance alone
//! costs no call to Redis), then its leases; the total cap stays in process, since it protects
//! this instance. When Redis fails, [`on_store_error`](ConcurrencyLimitLayerBuilder::on_store_error)
//! decides: each instance goes on with its own limit (the default), or refuses with `503`.
//! [`lease_stats`](ConcurrencyLimitLayer::lease_stats) counts what the leases did.
//!
//! Put it inside the rate limit (a request refused by its quota should not take a place) and
//! around the work it protects.

mod admission;
mod fair;
mod layer;
#[cfg(feature = "redis")]
mod leases;
mod service;
mod shared;
pub(crate) mod table;
mod telemetry;

pub use crate::inflight::{PermitBody, ResponseFuture};
pub use layer::{
    ConcurrencyError, ConcurrencyLimitLayer, ConcurrencyLimitLayerBuilder,
    DEFAULT_CONCURRENCY_LAYER_NAME, MAX_RETRY_AFTER,
};
pub(crate) use layer::{Permit, bounded};
pub use service::ConcurrencyLimit;

#[cfg(feature = "redis")]
pub use leases::LeaseStats;
#[cfg(feature = "redis")]
pub use leases::{DEFAULT_LEASE_TIME, MAX_LEASE_TIME, MIN_LEASE_TIME};
