//! The service: a permit per request, or an answer.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::body::PermitBody;
use super::future::ResponseFuture;
use super::layer::Shared;
use crate::answer::RefusalBody;

/// The service made by [`ConcurrencyLimitLayer`](super::ConcurrencyLimitLayer). Clones share
/// the layer's counts.
pub struct ConcurrencyLimit<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> ConcurrencyLimit<S> {
    pub(crate) fn new(inner: S, shared: Arc<Shared>) -> Self {
        Self { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone> Clone for ConcurrencyLimit<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for ConcurrencyLimit<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLimit")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for ConcurrencyLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: RefusalBody,
{
    type Response = Response<PermitBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (parts, body) = request.into_parts();
        match self.shared.admit(&parts) {
            Ok(permit) => {
                // The ready service goes into the future; a clone stays for the next call.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                // Should `call` panic, `permit` is dropped on the way out: nothing leaks.
                let future = inner.call(Request::from_parts(parts, body));
                ResponseFuture::called(future, permit)
            }
            Err(refusal) => {
                let answer = self.shared.answer(&parts, refusal);
                ResponseFuture::refused(answer.map(ResBody::refusal))
            }
        }
    }
}
