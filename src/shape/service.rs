//! The service: reserve a departure, wait for it, then call the inner service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::{Plan, Shared};
use crate::Store;
use crate::answer::RefusalBody;

/// The service made by [`ShapeLayer`](super::ShapeLayer). Clones share the layer's store and
/// rules.
pub struct Shape<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S, St> Shape<S, St> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<St>>) -> Self {
        Self { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, St> Clone for Shape<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for Shape<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shape")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for Shape<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    St: Store,
    ResBody: RefusalBody,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S, St, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (parts, body) = request.into_parts();
        match self.shared.plan(&parts) {
            Plan::Pass => {
                // The ready service goes into the future; a clone stays for the next call.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::calling(inner.call(Request::from_parts(parts, body)))
            }
            Plan::Refuse(answer) => ResponseFuture::refused(answer.map(ResBody::refusal)),
            // A request that may wait takes a clone and makes it ready after its wait: the
            // ready service stays here, so that a request waiting for its slot holds no place
            // of the inner service (a pool, a buffer, a concurrency limit) meanwhile.
            Plan::Check { check, rule } => ResponseFuture::checking(
                check,
                rule,
                Request::from_parts(parts, body),
                self.inner.clone(),
                self.shared.clone(),
            ),
        }
    }
}
