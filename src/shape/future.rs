//! The response future: the store's reservation, the wait until the departure, the call.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use super::layer::Shared;
use crate::Store;
use crate::answer::RefusalBody;

/// Waits shorter than this (the resolution of tokio's timer, which would round them up to its
/// next millisecond) are not waited: at rates above 1,000 per second a request may leave up to
/// a millisecond before its slot.
const MIN_WAIT: std::time::Duration = std::time::Duration::from_millis(1);

pin_project! {
    /// The response future of [`Shape`](super::Shape). Dropping it while it waits gives up the
    /// request (its departure slot stays taken, so the rate remains a bound).
    pub struct ResponseFuture<S, St, ReqBody>
    where
        S: Service<Request<ReqBody>>,
        St: Store,
    {
        #[pin]
        state: State<S, St, ReqBody>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, St, ReqBody>
    where
        S: Service<Request<ReqBody>>,
        St: Store,
    {
        Checking {
            #[pin]
            check: St::Future,
            rule: u16,
            request: Option<Request<ReqBody>>,
            inner: Option<S>,
            shared: Arc<super::layer::Shared<St>>,
        },
        Waiting {
            #[pin]
            sleep: Sleep,
            request: Option<Request<ReqBody>>,
            inner: Option<S>,
        },
        Readying {
            request: Option<Request<ReqBody>>,
            inner: S,
        },
        Calling { #[pin] future: S::Future },
        Refused { response: Option<S::Response> },
    }
}

impl<S, St, ReqBody> ResponseFuture<S, St, ReqBody>
where
    S: Service<Request<ReqBody>>,
    St: Store,
{
    pub(crate) fn calling(future: S::Future) -> Self {
        Self {
            state: State::Calling { future },
        }
    }

    pub(crate) fn refused(response: S::Response) -> Self {
        Self {
            state: State::Refused {
                response: Some(response),
            },
        }
    }

    pub(crate) fn checking(
        check: St::Future,
        rule: u16,
        request: Request<ReqBody>,
        inner: S,
        shared: Arc<Shared<St>>,
    ) -> Self {
        Self {
            state: State::Checking {
                check,
                rule,
                request: Some(request),
                inner: Some(inner),
                shared,
            },
        }
    }
}

impl<S, St, ReqBody, ResBody> Future for ResponseFuture<S, St, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
    ResBody: RefusalBody,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Checking {
                    check,
                    rule,
                    request,
                    inner,
                    shared,
                } => {
                    let outcome = ready!(check.poll(cx));
                    let (Some(mut request), Some(inner)) = (request.take(), inner.take()) else {
                        return Poll::Ready(Ok(Response::new(ResBody::refusal(
                            bytes::Bytes::new(),
                        ))));
                    };
                    match outcome {
                        Ok(decision) if decision.allowed() => {
                            // The departure is the reservation's end: wait until then.
                            let wait = decision.reset_after();
                            shared.admitted(wait);
                            request.extensions_mut().insert(decision);
                            if wait < MIN_WAIT {
                                // tokio's timer would round it up to its next tick.
                                state.set(State::Readying {
                                    request: Some(request),
                                    inner,
                                });
                                continue;
                            }
                            state.set(State::Waiting {
                                sleep: tokio::time::sleep(wait),
                                request: Some(request),
                                inner: Some(inner),
                            });
                        }
                        outcome => {
                            let (parts, _) = request.into_parts();
                            let answer = shared.refused(&parts, *rule, outcome);
                            return Poll::Ready(Ok(answer.map(ResBody::refusal)));
                        }
                    }
                }
                StateProj::Waiting {
                    sleep,
                    request,
                    inner,
                } => {
                    ready!(sleep.poll(cx));
                    let (Some(request), Some(inner)) = (request.take(), inner.take()) else {
                        return Poll::Ready(Ok(Response::new(ResBody::refusal(
                            bytes::Bytes::new(),
                        ))));
                    };
                    state.set(State::Readying {
                        request: Some(request),
                        inner,
                    });
                }
                StateProj::Readying { request, inner } => {
                    ready!(inner.poll_ready(cx))?;
                    let Some(request) = request.take() else {
                        return Poll::Ready(Ok(Response::new(ResBody::refusal(
                            bytes::Bytes::new(),
                        ))));
                    };
                    let future = inner.call(request);
                    state.set(State::Calling { future });
                }
                StateProj::Calling { future } => return future.poll(cx),
                StateProj::Refused { response } => {
                    return Poll::Ready(Ok(response
                        .take()
                        .unwrap_or_else(|| Response::new(ResBody::refusal(bytes::Bytes::new())))));
                }
            }
        }
    }
}

impl<S, St, ReqBody> fmt::Debug for ResponseFuture<S, St, ReqBody>
where
    S: Service<Request<ReqBody>>,
    St: Store,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
