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
//! - **Fairness** ([`LoadShedLayerBuilder::fair_by`]): with a tenant key, a tenant below its
//!   fair share of the limit (shared among the tenants that asked within the last second) is
//!   never refused for fairness, and once the service is busy a tenant at or above it is shed
//!   before anyone else, so one noisy tenant cannot make thirty small ones lose their
//!   requests, nor keep the places it holds from newcomers. The promise is stated exactly
//!   [below](#fairness).
//!
//! - **A queue** ([`LoadShedLayerBuilder::queue`], none by default): a request its class has
//!   no room for may wait, a bounded number at once and each at most a longest wait, for a
//!   place to be given back. The place is handed to a waiter of the highest class that may
//!   use it (with fairness, of the tenant holding fewest places), so newcomers cannot
//!   overtake the queue; a waiter whose client goes away leaves it and takes nothing; a full
//!   queue sheds its lowest class's newest waiter for an arrival of a higher class, and the
//!   arrival at once otherwise.
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
//!   to answer on the request's route (a moving average per axum route template, when the
//!   layer is inside the router: a slow route's time is not taken from a fast route's
//!   deadline; one average for every route otherwise); a malformed value is ignored.
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
//! # Fairness
//!
//! With [`fair_by`](LoadShedLayerBuilder::fair_by), each request's tenant is remembered from
//! the moment it asks, admitted or refused, until a second after it last asked (on the
//! layer's clock), and while it holds a place or waits. A tenant's **fair share** is the
//! limit divided among the tenants so remembered, rounded up, and at most
//! [`fair_cap`](LoadShedLayerBuilder::fair_cap) of the limit when that is set. This is what a
//! tenant is promised:
//!
//! 1. **A tenant below its fair share is never refused for fairness.** A request of a tenant
//!    whose places held and requests waiting are fewer than its fair share (and whose
//!    requests waiting are fewer than its share of the queue, point 4) is refused only when
//!    its class has no place free and it cannot wait (no queue, the queue is full of waiters
//!    of its class or above, or its deadline leaves no time): as it would be without
//!    fairness.
//! 2. **Tenants at or above their fair share give way.** Once `fair_from` of the limit is in
//!    flight (0.8 by default), a request of a tenant holding its fair share or more is
//!    refused. Below `fair_from`, it takes a place only while that leaves free, within its
//!    class's share of capacity, the fair share of each remembered tenant that holds no place
//!    (together at most half the limit). With `fair_cap`, no tenant ever holds more than the
//!    cap.
//! 3. **So a small tenant gets the next places given back.** A tenant that holds less than its
//!    fair share and finds every place its class may use taken, by tenants over their shares
//!    past `fair_from`, is admitted at its next ask after a place is given back (with a queue,
//!    it waits and is handed the place): the k-th such newcomer within k completions of any
//!    request, as no tenant over its share takes a place meanwhile. In `tests/shed.rs`, a tenant
//!    holding 18 of 20 places with requests of 1 s: five newcomers got the first five places
//!    given back, and the noisy tenant none meanwhile (before this promise they waited until
//!    the noisy tenant's requests ended).
//! 4. **The queue.** A place given back goes to the highest class that may use it, within it
//!    to the tenant holding fewest places (then the one given a place longest ago), and among
//!    that tenant's waiters in the [`Discipline`]'s order. A tenant may have at most its share
//!    of the queue's places waiting (the queue's length divided among the remembered
//!    tenants, at least one), and at most its fair share in flight and waiting past
//!    `fair_from`. A full queue sheds its lowest class's newest waiter for a higher class,
//!    and the newest waiter of the tenant most over its queue share for a tenant below its
//!    own.
//!
//! What a tenant can still do to another:
//!
//! - **Hold what it took.** Nothing is pre-empted: places taken while the service was calm
//!   (up to `fair_from`, or the whole class share while it was alone) are held until those
//!   requests end. A newcomer waits for completions; give long requests a `fair_cap`.
//! - **Win a race for a free place** below `fair_from`, up to the headroom of point 2: a
//!   tenant never seen before reserves nothing until it asks.
//! - **Dilute the shares** by naming tenants: key tenants by what your authentication vouches
//!   for. A tenant counts from its first ask, refused or not, so requests under made-up names
//!   cost their sender nothing but lower every share (4,096 of them a second make every share
//!   one place, and reserve half the limit for tenants that hold none). At most 4,096 tenants
//!   are told apart: past that, tenants not yet remembered share one entry (and one share)
//!   until entries expire. Where the tenant key is not authenticated before the shedder, key
//!   fairness by what the client cannot choose (its address behind trusted proxies).
//! - **Use more time with the same places**: the share counts places, not how long each is
//!   held.
//! - **Contend with it on one lock**: the table of tenants is one lock, taken a few times per
//!   request that has a tenant key.
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
