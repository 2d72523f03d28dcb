//! The service: a call through the breaker, or a local answer while it is open.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Shared;
use crate::answer::RefusalBody;
use crate::breaker::{Permit, ProbeGuard};
use crate::clock::{Clock, TokioClock};

/// The service made by [`CircuitBreakerLayer`](super::CircuitBreakerLayer). Clones share the
/// layer's breaker.
pub struct CircuitBreaker<S, C = TokioClock> {
    inner: S,
    shared: Arc<Shared<C>>,
}

impl<S, C> CircuitBreaker<S, C> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<C>>) -> Self {
        Self { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, C> Clone for CircuitBreaker<S, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, C> fmt::Debug for CircuitBreaker<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, C, ReqBody, ResBody> Service<Request<ReqBody>> for CircuitBreaker<S, C>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    C: Clock,
    ResBody: RefusalBody,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, C>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let permit = self.shared.breaker.permit();
        if permit == Permit::Refuse {
            let (parts, _) = request.into_parts();
            return ResponseFuture::refused(self.shared.refuse(&parts).map(ResBody::refusal));
        }
        // Made before the call, so that a trial call that panics or is dropped before its
        // answer opens the breaker again instead of holding it half-open.
        let guard = ProbeGuard::new(Arc::clone(&self.shared.breaker), permit);
        // The ready service goes into the future; a clone stays for the next call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::called(inner.call(request), Arc::clone(&self.shared), permit, guard)
    }
}
