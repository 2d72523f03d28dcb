//! The service: refused here with the throttle's probability, else sent.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Shared;
use crate::answer::RefusalBody;
use crate::clock::{Clock, TokioClock};

/// The service made by [`AdaptiveThrottleLayer`](super::AdaptiveThrottleLayer). Clones share
/// the layer's windows.
pub struct AdaptiveThrottle<S, C = TokioClock> {
    inner: S,
    shared: Arc<Shared<C>>,
}

impl<S, C> AdaptiveThrottle<S, C> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<C>>) -> Self {
        Self { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, C> Clone for AdaptiveThrottle<S, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, C> fmt::Debug for AdaptiveThrottle<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveThrottle")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, C, ReqBody, ResBody> Service<Request<ReqBody>> for AdaptiveThrottle<S, C>
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
        let key = self.shared.key(&request);
        let Some(bucket) = self.shared.throttle(key) else {
            let (parts, _) = request.into_parts();
            return ResponseFuture::refused(self.shared.refuse(&parts).map(ResBody::refusal));
        };
        // The ready service goes into the future; a clone stays for the next call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::called(inner.call(request), Arc::clone(&self.shared), key, bucket)
    }
}
