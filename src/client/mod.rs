//! The client half (feature `client`): what a well-behaved caller of a limited service does.
//!
//! - [`ServerHints`] reads what a response says about calling again: `Retry-After` (both
//!   forms), gRPC's `grpc-retry-pushback-ms`, the IETF `RateLimit` / `RateLimit-Policy` fields
//!   (parsed as Structured Fields) and the legacy `X-RateLimit-*` trio.
//! - [`RetryLayer`] retries what the server refused, when the server says (else after a backoff
//!   with full jitter), within a retry budget, idempotent requests only; with feature
//!   `reqwest`, [`RetryMiddleware`] does the same for reqwest.
//! - [`throttle`]: [`AdaptiveThrottleLayer`], Google SRE's client-side adaptive throttling:
//!   refuse locally, with a probability, while the backend refuses most requests.
//! - [`breaker`]: [`CircuitBreakerLayer`], after a run of failures stop calling for a while,
//!   then let one trial call through (the breaker of
//!   [`ResilientStore`](crate::store::ResilientStore)).
//! - [`pace`]: [`PaceLayer`], pacing from the `RateLimit` fields: space requests so that the
//!   quota left lasts until it resets, and wait out a refusal's hint.

pub mod breaker;
mod hints;
mod local;
pub mod pace;
pub mod retry;
pub mod throttle;

pub use breaker::CircuitBreakerLayer;
pub use hints::{MAX_HINT, Pushback, Quota, RetryHint, ServerHints};
pub use pace::PaceLayer;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub use retry::RetryMiddleware;
pub use retry::{
    GaveUp, GiveUp, Jitter, ReplayBody, RetryBudget, RetryConfigError, RetryLayer, RetryPolicy,
    RetryStats,
};
pub use throttle::AdaptiveThrottleLayer;
