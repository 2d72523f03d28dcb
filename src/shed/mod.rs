//! Load shedding: refuse early, least important first, when the service has no capacity left.
//!
//! A rate limit keeps each client within its share; it does not notice that the service
//! itself got slower. [`LoadShedLayer`] does: it decides before the inner service is called
//! (and before the body is read) whether the service can take one more request, and if not
//! answers `503 Service Unavailable` with a `Retry-After` spread over a few seconds (so shed
//! clients do not come back in one wave), `Cache-Control: no-store` and a problem body; gRPC
//! requests get `UNAVAILABLE` with `grpc-retry-pushback-ms`.
//!
//! - **Capacity**: a number of requests in flight, fixed ([`Limit::fixed`]) or adaptive,
//!   following the latency the service shows ([`Limit::vegas`], the default choice, or
//!   [`Limit::aimd`]), always within bounds so it can neither collapse to zero nor grow
//!   without limit. A request holds its place until its response body ends. Fast answers
//!   that are not the service's own (a scanner's 404s behind the shedder, requests given up
//!   early) cannot lower Vegas's time without queueing on their own, and failures (an error,
//!   503, 504, gRPC `UNAVAILABLE` or `DEADLINE_EXCEEDED`) lower a limit only in a window that
//!   is slow or near the limit ([`Limit::back_off_on_any_failure`] to count them always).
//! - **An operator's signal** ([`LoadShedLayerBuilder::utilization`]): a closure that says how
//!   busy the service is from 0 to 1 (a worker pool, tokio's runtime metrics), for a shedder
//!   like Stripe's worker-utilization shedder.
//! - **Priorities**: a [`Classifier`] puts each request in a [`Criticality`] class (the
//!   names of Google's SRE practice). Each class is shed from a share of capacity on:
//!   `sheddable` from 70 %, `sheddable_plus` from 80 %, `critical` from 90 %, `critical_plus`
//!   only at 100 %, so that capacity stays for the traffic that matters most. Requests are
//!   not pre-empted: a flood of sheddable requests that arrives while the service is idle may
//!   hold up to its share until those requests finish, and critical traffic has the rest.
//! - **Fairness** ([`LoadShedLayerBuilder::fair_by`]): with a tenant key, once the service is
//!   busy, a tenant with its fair share in flight is shed before anyone else, so one noisy
//!   tenant cannot make thirty small ones lose their requests.
//!
//! - **A queue** ([`LoadShedLayerBuilder::queue`], none by default): a request its class has
//!   no room for may wait, a bounded number at once and each at most a longest wait, for a
//!   place to be given back. The place is handed to a waiter whose class may use it, so
//!   newcomers cannot overtake the queue; a waiter whose client goes away leaves it and takes
//!   nothing; a full queue sheds at once.
//! - **Discipline** ([`Discipline`]): oldest first, newest first, or (the default) adaptive
//!   LIFO as Facebook runs it: oldest first while the queue is healthy, newest first while it
//!   is overloaded (standing, or more than half full), so that under overload the requests
//!   served are those whose clients are still waiting.
//! - **Queueing delay, CoDel-style** ([`LoadShedLayerBuilder::codel`], 5 ms and 100 ms by
//!   default, as in Kathleen Nichols and Van Jacobson's CoDel and Facebook's servers): when the
//!   oldest waiter's wait has not fallen below the target through a whole interval, the queue
//!   *stands*: it only adds latency. Waiters then wait at most the target, and adaptive LIFO
//!   serves the newest. With a fixed limit at what the service serves at once, this is a
//!   capacity signal of its own.
//! - **Deadlines** ([`LoadShedLayerBuilder::deadline_header`]): a client's declared timeout
//!   (`grpc-timeout`, or plain milliseconds) bounds its wait, less the time the service takes
//!   to answer; a malformed value is ignored.
//!
//! Put it outermost: shedding is the cheapest "no", and it protects the rate limiter's store
//! too.
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response, StatusCode};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use tollgate::LoadShedLayer;
//! use tollgate::shed::{ByHeader, Criticality, Limit};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let shed = LoadShedLayer::builder(Limit::fixed(10))
//!     .classify(ByHeader::from_static("x-criticality")) // set by our own edge
//!     .build()?;
//! let mut service = ServiceBuilder::new()
//!     .layer(shed.clone())
//!     .service_fn(|_: Request<String>| async { Ok::<_, Infallible>(Response::new(String::new())) });
//! let request = |class: &str| {
//!     Request::get("/").header("x-criticality", class).body(String::new()).unwrap()
//! };
//! // Seven sheddable responses in flight (their bodies not sent yet): sheddable is now shed...
//! let mut held = Vec::new();
//! for _ in 0..7 {
//!     held.push(service.ready().await?.call(request("sheddable")).await?);
//! }
//! let shed_one = service.ready().await?.call(request("sheddable")).await?;
//! assert_eq!(shed_one.status(), StatusCode::SERVICE_UNAVAILABLE);
//! assert!((1..=3).contains(&shed_one.headers()["retry-after"].to_str()?.parse::<u64>()?));
//! // ... while critical traffic still has room.
//! let critical = service.ready().await?.call(request("critical")).await?;
//! assert_eq!(critical.status(), StatusCode::OK);
//! assert_eq!(shed.stats().shed(Criticality::Sheddable), 1);
//! # Ok(())
//! # }
//! ```
//!
//! # A queue
//!
//! One request at a time, up to ten waiting, each up to 100 ms, or less if its client says
//! so. The place of the first is handed to the request that waited; the one that declared a
//! timeout of 20 ms is shed at 20 ms.
//!
//! ```
//! use std::convert::Infallible;
//! use std::time::Duration;
//! use http::{HeaderName, Request, Response, StatusCode};
//! use tower::{ServiceBuilder, ServiceExt};
//! use tollgate::LoadShedLayer;
//! use tollgate::clock::TokioClock;
//! use tollgate::shed::{Criticality, Limit};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let shed = LoadShedLayer::builder(Limit::fixed(1))
//!     .queue(10, Duration::from_millis(100))
//!     .deadline_header(HeaderName::from_static("grpc-timeout"))
//!     .clock(TokioClock::new()) // tokio's paused time, for this example
//!     .build()?;
//! let service = ServiceBuilder::new()
//!     .layer(shed.clone())
//!     .service_fn(|_: Request<String>| async { Ok::<_, Infallible>(Response::new(String::new())) });
//!
//! // Its body holds the place until it is sent (here: dropped).
//! let first = service.clone().oneshot(Request::new(String::new())).await?;
//! let start = tokio::time::Instant::now();
//! let patient = tokio::spawn(service.clone().oneshot(Request::new(String::new())));
//! let hurried = Request::get("/").header("grpc-timeout", "20m").body(String::new())?;
//! let hurried = tokio::spawn(service.clone().oneshot(hurried));
//! tokio::time::sleep(Duration::from_millis(30)).await;
//! assert_eq!(shed.queued(), 1); // the hurried one has gone
//! drop(first);
//! assert_eq!(patient.await??.status(), StatusCode::OK);
//! assert_eq!(start.elapsed(), Duration::from_millis(30));
//! assert_eq!(hurried.await??.status(), StatusCode::SERVICE_UNAVAILABLE);
//! assert_eq!(shed.stats().timed_out(Criticality::Critical), 1);
//! # Ok(())
//! # }
//! ```

mod classify;
mod deadline;
mod fair;
mod layer;
mod limit;
mod queue;
mod service;
mod shared;
mod telemetry;

pub use crate::inflight::{PermitBody, ResponseFuture};
pub use classify::{ByHeader, Classifier, Criticality, UnknownCriticality};
pub(crate) use layer::Guard;
pub use layer::{
    DEFAULT_FAIR_FROM, DEFAULT_SHED_JITTER, DEFAULT_SHED_LAYER_NAME, DEFAULT_SHED_RETRY_AFTER,
    LoadShedLayer, LoadShedLayerBuilder, ShedError, ShedStats,
};
pub use limit::Limit;
pub use queue::{DEFAULT_CODEL_INTERVAL, DEFAULT_CODEL_TARGET, Discipline};
pub use service::LoadShed;
