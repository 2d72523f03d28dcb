//! The service: decides in `call()`, before the inner service sees the request.

use std::fmt;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Source;
use crate::Store;
use crate::answer::RefusalBody;

/// The rate-limiting service made by [`RateLimitLayer`](super::RateLimitLayer).
///
/// `poll_ready` is the inner service's. `call` finds the rules that apply and asks the store
/// about all of them at once. The in-process store answers right there, so `call` decides and
/// calls the ready inner service itself; with a store that answers later, the ready inner
/// service moves into the response future (a clone takes its place) and is called once the
/// store has admitted the request. A refused request never reaches the inner service and is
/// answered with an `Ok` response (429, 503 or gRPC), so no error handling is needed in
/// axum. The body is never read.
pub struct RateLimit<S, St> {
    inner: S,
    source: Source<St>,
}

impl<S, St> RateLimit<S, St> {
    pub(crate) fn from_source(inner: S, source: Source<St>) -> Self {
        Self { inner, source }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, without the limits.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, St> Clone for RateLimit<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            source: self.source.clone(),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for RateLimit<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("limiter", &self.source.current().limiter)
            .finish()
    }
}

impl<S, St, B, ResBody> Service<Request<B>> for RateLimit<S, St>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    St: Store,
    ResBody: RefusalBody,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S, St, B>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    #[inline]
    fn call(&mut self, request: Request<B>) -> Self::Future {
        match &self.source {
            Source::Fixed(shared) => ResponseFuture::call(shared, &mut self.inner, request),
            // One load: the request sees the configuration of this instant whole, and keeps
            // it (the future holds it) whatever a reload does meanwhile.
            Source::Live(cell) => ResponseFuture::call(&cell.load(), &mut self.inner, request),
        }
    }
}
