//! Retries that honour the server: [`RetryLayer`].
//!
//! PLACEHOLDER

mod body;
mod budget;
mod future;
mod layer;
mod policy;
mod random;
#[cfg(feature = "reqwest")]
mod reqwest;
mod service;

pub use body::{ReadAhead, Replay, ReplayBody};
pub use budget::RetryBudget;
pub use future::ResponseFuture;
pub use layer::RetryLayer;
pub use policy::{
    GaveUp, GiveUp, IDEMPOTENCY_KEY, Jitter, RetryConfigError, RetryPolicy, RetryPolicyBuilder,
    RetryStats,
};
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub use reqwest::RetryMiddleware;
pub use service::Retry;
