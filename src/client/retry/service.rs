//! The service: send, and send again while the policy says so.

use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::body::ReplayBody;
use super::future::{Head, ResponseFuture};
use super::policy::RetryPolicy;

/// The service made by [`RetryLayer`](super::RetryLayer).
#[derive(Clone, Debug)]
pub struct Retry<S> {
    inner: S,
    policy: RetryPolicy,
}

impl<S> Retry<S> {
    pub(crate) fn new(inner: S, policy: RetryPolicy) -> Self {
        Self { inner, policy }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The policy deciding the retries.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Retry<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ReqBody: ReplayBody,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The ready service goes into the future; a clone stays for the next call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some(attempts) =
            self.policy
                .begin(request.method(), request.uri().path(), request.headers())
        else {
            let future = inner.call(request);
            return ResponseFuture::once(future, self.policy.clone());
        };
        let (parts, body) = request.into_parts();
        let (body, replay) = body.replay(self.policy.replay_limit());
        let Some(replay) = replay else {
            let future = inner.call(Request::from_parts(parts, body));
            return ResponseFuture::once(future, self.policy.clone());
        };
        let head = Head::of(&parts);
        let future = inner.call(Request::from_parts(parts, body));
        ResponseFuture::retrying(future, inner, self.policy.clone(), attempts, head, replay)
    }
}
