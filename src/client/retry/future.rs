//! The response future: the attempt, the wait, the next attempt.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::request::Parts;
use http::{Extensions, HeaderMap, Method, Request, Response, Uri, Version};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use super::body::Replay;
use super::policy::{Attempts, GaveUp, Next, RetryPolicy};

/// What a request is sent again with: its head, cloned once before the first attempt.
pub(crate) struct Head {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    extensions: Extensions,
}

impl Head {
    pub(crate) fn of(parts: &Parts) -> Self {
        Self {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            version: parts.version,
            headers: parts.headers.clone(),
            extensions: parts.extensions.clone(),
        }
    }

    fn request<B>(&self, body: B) -> Request<B> {
        let mut request = Request::new(body);
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = self.uri.clone();
        *request.version_mut() = self.version;
        *request.headers_mut() = self.headers.clone();
        *request.extensions_mut() = self.extensions.clone();
        request
    }
}

/// What the future needs to send a request again.
struct Again<S, B: Body> {
    service: S,
    attempts: Attempts,
    head: Head,
    replay: Replay<B>,
}

pin_project! {
    /// The response future of [`Retry`](super::Retry).
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
        ReqBody: Body,
    {
        #[pin]
        state: State<S::Future>,
        policy: RetryPolicy,
        again: Option<Again<S, ReqBody>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Calling { #[pin] future: F },
        Waiting { #[pin] sleep: Sleep },
        Readying,
    }
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
    ReqBody: Body,
{
    /// A request that is sent once (its answer is still classified, for the stats and the
    /// [`GaveUp`] mark).
    pub(crate) fn once(future: S::Future, policy: RetryPolicy) -> Self {
        Self {
            state: State::Calling { future },
            policy,
            again: None,
        }
    }

    pub(crate) fn retrying(
        future: S::Future,
        service: S,
        policy: RetryPolicy,
        attempts: Attempts,
        head: Head,
        replay: Replay<ReqBody>,
    ) -> Self {
        Self {
            state: State::Calling { future },
            policy,
            again: Some(Again {
                service,
                attempts,
                head,
                replay,
            }),
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: Body,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Calling { future } => {
                    let result = ready!(future.poll(cx));
                    let attempts = this.again.as_mut().map(|a| &mut a.attempts);
                    let next = match &result {
                        Ok(response) => this.policy.after_response(
                            attempts,
                            response.status(),
                            response.headers(),
                            response.extensions().get::<GaveUp>().is_some(),
                        ),
                        Err(_) => this.policy.after_error(attempts),
                    };
                    match next {
                        Next::Done => return Poll::Ready(result),
                        Next::GiveUp(reason) => {
                            let attempts = this.again.as_ref().map_or(1, |a| a.attempts.made());
                            return Poll::Ready(result.map(|mut response| {
                                mark(&mut response, reason, attempts);
                                response
                            }));
                        }
                        // Only a request that can be sent again is ever retried.
                        Next::Retry(_) if this.again.is_none() => return Poll::Ready(result),
                        Next::Retry(wait) if wait.is_zero() => {
                            this.state.set(State::Readying);
                        }
                        Next::Retry(wait) => {
                            let sleep = tokio::time::sleep(wait);
                            this.state.set(State::Waiting { sleep });
                        }
                    }
                }
                StateProj::Waiting { sleep } => {
                    ready!(sleep.poll(cx));
                    this.state.set(State::Readying);
                }
                StateProj::Readying => {
                    // Readying follows only a retry decided with `again` there (see above).
                    let Some(again) = this.again.as_mut() else {
                        unreachable!("a retry is only decided for a request that can be sent again")
                    };
                    ready!(again.service.poll_ready(cx))?;
                    let request = again.head.request(again.replay.body());
                    let future = again.service.call(request);
                    this.state.set(State::Calling { future });
                }
            }
        }
    }
}

/// Marks a response given up on, keeping the mark of an inner layer if there is one.
fn mark<B>(response: &mut Response<B>, reason: super::GiveUp, attempts: u32) {
    if response.extensions().get::<GaveUp>().is_none() {
        response
            .extensions_mut()
            .insert(GaveUp { reason, attempts });
    }
}

impl<S, ReqBody> fmt::Debug for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
    ReqBody: Body,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field(
                "retries",
                &self.again.as_ref().map(|a| a.attempts.made() - 1),
            )
            .finish_non_exhaustive()
    }
}
