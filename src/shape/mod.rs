//! Shaping: the leaky bucket as a queue, a soft limit that delays instead of refusing.
//!
//! [`ShapeLayer`] lets the requests of each key leave at a constant rate: a burst is not
//! refused, it waits and comes out evenly, and the service behind never sees more than the
//! rate. The queue is bounded: at most `queue` units of cost wait per key, so a request waits
//! at most `queue / rate`, and one that would wait longer is refused at once with `429` and
//! the exact `Retry-After` (when it would fit in the queue). With a rate `r`, the request
//! with `k - 1` ahead of it leaves `k / r` after it arrived (the first one interval after
//! arriving at an empty queue).
//!
//! So even a lone request after an idle spell waits one interval (a minute at one per
//! minute), and a request of cost `c` waits `c` intervals: a departure is the end of the
//! request's own reservation of the rate. This is the model's choice, kept on purpose (the
//! departures are exactly `k / r`, on one process or several sharing Redis); letting the
//! first request of an idle queue leave at once would keep the rate too, but would change
//! every departure by one interval. At low rates, where one interval is long, put a rate
//! limit (which admits at once, up to a burst) in front instead of a shaper.
//!
//! The queue is kept as GCRA keeps a bucket: one departure time per key, in the layer's
//! [`Store`](crate::Store). In process, a [`MemoryStore`](crate::MemoryStore); on a
//! `RedisStore`, each request reserves the next departure slot in one atomic script on Redis's
//! clock and then waits for it in its own process, so several instances together shape to one
//! rate. Rules are the rate limit's [`Rule`](crate::limiter::Rule)s (methods, paths, route
//! templates, any key, a cost per request); the first rule that matches a request shapes it.
//!
//! It works the same around a client: shaping the calls to a third-party API that charges per
//! call, counted in that API's own units with [`Rule::cost_fn`](crate::limiter::Rule::cost_fn).
//! The waiting uses tokio's timer: run it on a tokio runtime. Its resolution is a millisecond,
//! so at rates above 1,000 per second a wait shorter than that is not waited (a request may
//! leave up to a millisecond early; the rate still holds over any longer span).
//!
//! ```
//! use std::convert::Infallible;
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use tollgate::{MemoryStore, Rate, ShapeLayer};
//! use tollgate::clock::TokioClock;
//! use tollgate::key::Global;
//! use tollgate::limiter::Rule;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // 10 per second for the whole service; at most 5 may wait (half a second).
//! let shape = ShapeLayer::builder(MemoryStore::with_clock(TokioClock::new()))
//!     .rule(Rule::new("upstream").key(Global), Rate::per_second(10), 5)
//!     .build()?;
//! let service = ServiceBuilder::new()
//!     .layer(shape)
//!     .service_fn(|_: Request<String>| async { Ok::<_, Infallible>(Response::new(String::new())) });
//!
//! let start = tokio::time::Instant::now();
//! let mut answers = Vec::new();
//! for _ in 0..6 {
//!     answers.push(tokio::spawn(service.clone().oneshot(Request::new(String::new()))));
//! }
//! let mut left = Vec::new();
//! for answer in answers {
//!     let response = answer.await??;
//!     left.push((response.status(), start.elapsed().as_millis()));
//! }
//! // Five leave 100 ms apart; the sixth would have waited 600 ms and is refused at once,
//! // told to come back when it would fit.
//! assert_eq!(&left[..5], [100, 200, 300, 400, 500].map(|ms| (StatusCode::OK, ms)));
//! assert_eq!(left[5].0, StatusCode::TOO_MANY_REQUESTS);
//! # Ok(())
//! # }
//! ```

mod future;
mod layer;
mod service;

pub use future::ResponseFuture;
pub use layer::{DEFAULT_SHAPE_LAYER_NAME, ShapeError, ShapeLayer, ShapeLayerBuilder};
pub use service::Shape;
