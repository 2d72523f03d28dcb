//! The retry layer's configuration: a policy.

use tower_layer::Layer;

use super::policy::{RetryPolicy, RetryStats};
use super::service::Retry;

/// Retries the requests of an HTTP or gRPC client the way the server asks: see the
/// [module docs](super).
///
/// It holds a [`RetryPolicy`]; the services it makes, and their clones, share its budget,
/// random sequence and stats.
#[derive(Clone, Debug, Default)]
pub struct RetryLayer {
    policy: RetryPolicy,
}

impl RetryLayer {
    /// A layer deciding by `policy` ([`RetryPolicy::default`] for the defaults).
    pub fn new(policy: RetryPolicy) -> Self {
        Self { policy }
    }

    /// The layer's policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// What the layer has done so far (its services and their clones together).
    pub fn stats(&self) -> RetryStats {
        self.policy.stats()
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Retry::new(inner, self.policy.clone())
    }
}
