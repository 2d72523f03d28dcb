//! The client half (feature `client`): what a well-behaved caller of a limited service does.
//!
//! - [`ServerHints`] reads what a response says about calling again: `Retry-After` (both
//!   forms), gRPC's `grpc-retry-pushback-ms`, the IETF `RateLimit` / `RateLimit-Policy` fields
//!   (parsed as Structured Fields) and the legacy `X-RateLimit-*` trio.
//! - [`RetryLayer`] retries what the server refused, when the server says (else after a backoff
//!   with full jitter), within a retry budget, idempotent requests only; with feature
//!   `reqwest`, [`RetryMiddleware`] does the same for reqwest.

mod hints;
pub mod retry;

pub use hints::{MAX_HINT, Pushback, Quota, RetryHint, ServerHints};
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub use retry::RetryMiddleware;
pub use retry::{
    GaveUp, GiveUp, Jitter, ReplayBody, RetryBudget, RetryConfigError, RetryLayer, RetryPolicy,
    RetryStats,
};
