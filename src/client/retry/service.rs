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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{RetryLayer, RetryStats};
    use tower::ServiceExt;
    use tower_layer::Layer;

    /// Refuses its first `refusals` calls with a bare 503; not ready while `busy`.
    #[derive(Clone)]
    struct Flaky {
        refusals: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        busy: bool,
    }

    impl Service<Request<String>> for Flaky {
        type Response = Response<String>;
        type Error = &'static str;
        type Future = std::future::Ready<Result<Response<String>, &'static str>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            if self.busy {
                Poll::Ready(Err("busy"))
            } else {
                Poll::Ready(Ok(()))
            }
        }

        fn call(&mut self, _: Request<String>) -> Self::Future {
            use std::sync::atomic::Ordering;
            let refuse = self
                .refusals
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            let mut response = Response::new(String::new());
            if refuse {
                *response.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
            }
            std::future::ready(Ok(response))
        }
    }

    fn flaky(refusals: usize, busy: bool) -> Flaky {
        Flaky {
            refusals: std::sync::Arc::new(refusals.into()),
            busy,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_service_and_its_future() {
        let layer = RetryLayer::new(RetryPolicy::builder().seed(3).build().unwrap());
        let mut retry = layer.layer(flaky(1, false));
        assert_eq!(
            retry
                .get_ref()
                .refusals
                .load(std::sync::atomic::Ordering::SeqCst),
            1
        );
        retry.ready().await.unwrap();
        let future = retry.call(Request::new(String::new()));
        assert_eq!(
            format!("{future:?}"),
            "ResponseFuture { retries: Some(0), .. }"
        );
        let response = future.await.unwrap();
        assert_eq!(response.status(), http::StatusCode::OK);
        let expected = RetryStats {
            requests: 1,
            retries: 1,
            ..RetryStats::default()
        };
        assert_eq!(layer.stats(), expected);
        assert_eq!(layer.policy().stats(), expected);
        assert_eq!(retry.policy().stats(), expected);
        // A POST is sent once.
        let post = Request::post("/").body(String::new()).unwrap();
        let future = retry.call(post);
        assert_eq!(
            format!("{future:?}"),
            "ResponseFuture { retries: None, .. }"
        );
        // Readiness is the inner service's.
        let busy = layer.layer(flaky(0, true));
        assert_eq!(
            busy.oneshot(Request::new(String::new())).await.unwrap_err(),
            "busy"
        );
    }
}
