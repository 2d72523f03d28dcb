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
//!   without limit. A request holds its place until its response body ends.
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

mod classify;
mod deadline;
mod layer;
mod limit;
mod queue;
mod service;

pub use crate::inflight::{PermitBody, ResponseFuture};
pub use classify::{ByHeader, Classifier, Criticality, UnknownCriticality};
pub(crate) use layer::Guard;
pub use layer::{
    DEFAULT_FAIR_FROM, DEFAULT_SHED_JITTER, DEFAULT_SHED_RETRY_AFTER, LoadShedLayer,
    LoadShedLayerBuilder, ShedError, ShedStats,
};
pub use limit::Limit;
pub use queue::{DEFAULT_CODEL_INTERVAL, DEFAULT_CODEL_TARGET, Discipline};
pub use service::LoadShed;
