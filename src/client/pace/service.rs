//! The service: reserve a departure, wait for it, then call the inner service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::{Departure, Shared, Sleeper, TokioSleeper};
use crate::answer::RefusalBody;
use crate::clock::{Clock, TokioClock};

/// The service made by [`PaceLayer`](super::PaceLayer). Clones share the layer's servers.
pub struct Pace<S, C = TokioClock, Z = TokioSleeper> {
    inner: S,
    shared: Arc<Shared<C, Z>>,
}

impl<S, C, Z> Pace<S, C, Z> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<C, Z>>) -> Self {
        Self { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, C, Z> Clone for Pace<S, C, Z> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, C, Z> fmt::Debug for Pace<S, C, Z> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pace")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, C, Z, ReqBody, ResBody> Service<Request<ReqBody>> for Pace<S, C, Z>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    C: Clock,
    Z: Sleeper,
    ResBody: RefusalBody,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, C, Z>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let key = self.shared.key(&request);
        let (parts, body) = request.into_parts();
        let departure = self.shared.depart(key, &parts);
        let request = Request::from_parts(parts, body);
        let shared = Arc::clone(&self.shared);
        match departure {
            Departure::Now => {
                // The ready service goes into the future; a clone stays for the next call.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::calling(inner.call(request), shared, key)
            }
            // A request that waits takes a clone and makes it ready after its wait: the ready
            // service stays here, so a waiting request holds no place of the inner service (a
            // connection, a concurrency limit) meanwhile.
            Departure::After(wait) => {
                let sleep = self.shared.sleeper.sleep(wait);
                ResponseFuture::waiting(sleep, request, self.inner.clone(), shared, key)
            }
            Departure::Refused(answer) => ResponseFuture::refused(answer.map(ResBody::refusal)),
        }
    }
}
