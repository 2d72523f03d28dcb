//! Pacing from the fields: a client that slows down before it is refused.
//!
//! [`PaceLayer`] reads what each response says about the quota left (the `RateLimit` and
//! `RateLimit-Policy` fields, or the legacy `X-RateLimit-*` trio, through
//! [`ServerHints`](crate::client::ServerHints)) and spaces the following requests to the same
//! server (the URI's authority, else the `Host` header) so that the quota lasts until it
//! resets, each policy on its own. Requests with neither (as a layer around a tonic `Channel`
//! sees them: the channel adds its origin below the layer) are one server's, which is right
//! for a layer around one channel; give each channel its own layer rather than sharing one.
//! Each policy:
//!
//! - **ample** (more than half the quota left, `2r > q`): no wait at all. A client well within
//!   its quota pays nothing for pacing, and a long quota (a daily one, say) does not slow a
//!   client to its average rate while most of it is left. Without `q` (no
//!   `RateLimit-Policy`, no `X-RateLimit-Limit`) the quota is taken to be one more than the
//!   most ever reported remaining.
//! - **paced** (`r` left, `t` seconds to the reset): requests leave `t / (r + 1)` apart, so the
//!   `r` left go at `t/(r+1), 2t/(r+1), ..., rt/(r+1)`, the last one before the reset, never at
//!   it; with nothing left (`r = 0`) the next one leaves at the reset. Each response updates
//!   `r` and `t`, and the requests still out are taken off `r`, so concurrent callers share
//!   what is left instead of each spending it. Servers round `t` up (tollgate does), which
//!   only makes the client a little slower, never refused.
//! - **refused** (a `429` or `503`, or gRPC `RESOURCE_EXHAUSTED` or `UNAVAILABLE`, with a
//!   hint: `grpc-retry-pushback-ms`, `Retry-After`, or an exhausted quota's `t`): no request
//!   to that server leaves before the hint has passed, or a minute, whichever comes first (one
//!   answer with a day-long hint cannot cut the server off for a day). The quotas a refusal
//!   reports hold the server back no longer: a 429 with `"daily";r=0;t=86400` lets one request
//!   a minute ask again (until an answer says otherwise, the second request leaves at the
//!   second minute, and a local 429 for it says so: up to 120 s). (A `200` with `r=0` is another matter: the request was served, and
//!   the server says nothing is left until the reset, so the next one leaves at the reset.)
//!
//! A request whose departure is more than [`max_wait`](PaceLayerBuilder::max_wait) away (60 s
//! by default) is not sent: it is answered at once with `429 Too Many Requests` and the wait
//! as `Retry-After` (gRPC `RESOURCE_EXHAUSTED` with `grpc-retry-pushback-ms`), a problem+json
//! body naming the server's policy (the quota that holds it back, or the exhausted quota of the
//! refusal that closed the gate; in `grpc-message` for gRPC), marked
//! [`Refused`](crate::answer::Refused), so the caller decides whether it still wants to send it
//! then. Answers made by a tollgate layer inside this one (marked `Refused`) say nothing of the
//! server and are not read.
//!
//! Time goes through a [`Clock`](crate::clock::Clock) and waits through a [`Sleeper`]: tokio's
//! clock and timer by default (both follow tokio's paused time), a
//! [`ManualClock`](crate::clock::ManualClock) and a sleeper that advances it in a simulation.
//!
//! ```
//! use std::convert::Infallible;
//! use std::time::Duration;
//! use http::{Request, Response};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use tollgate::client::PaceLayer;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pace = PaceLayer::new();
//! // A server with 3 of 10 left for the next 8 seconds.
//! let mut client = ServiceBuilder::new().layer(pace.clone()).service_fn(|_: Request<String>| async {
//!     let mut response = Response::new(String::new());
//!     response.headers_mut().insert("ratelimit", "\"api\";r=3;t=8".parse().unwrap());
//!     response.headers_mut().insert("ratelimit-policy", "\"api\";q=10;w=60".parse().unwrap());
//!     Ok::<_, Infallible>(response)
//! });
//! let start = tokio::time::Instant::now();
//! client.ready().await?.call(Request::new(String::new())).await?; // leaves at once
//! client.ready().await?.call(Request::new(String::new())).await?; // 8 s / (3 + 1) later
//! assert_eq!(start.elapsed(), Duration::from_secs(2));
//! assert_eq!(pace.stats().delayed, 1);
//! # Ok(())
//! # }
//! ```

mod future;
mod layer;
mod plan;
mod service;

pub use future::ResponseFuture;
pub use layer::{
    DEFAULT_MAX_SERVERS, DEFAULT_MAX_WAIT, PaceLayer, PaceLayerBuilder, PaceStats, Sleeper,
    TokioSleeper,
};
pub use service::Pace;
