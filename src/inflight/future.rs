//! The response future: a wait for a place, the inner call with its place, or a ready answer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::PermitBody;
use super::{Answer, Held, Pending};
use crate::answer::{RefusalBody, Refused};

pin_project! {
    /// The response future of [`ConcurrencyLimit`](crate::concurrency::ConcurrencyLimit) and
    /// [`LoadShed`](crate::shed::LoadShed). Dropping it before it is done (the client went
    /// away, a timeout fired) gives the request's place back at once, or leaves the queue it
    /// was waiting in.
    pub struct ResponseFuture<S, ReqBody, ResBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody, ResBody>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody, ResBody>
    where
        S: Service<Request<ReqBody>>,
    {
        Waiting {
            pending: Pending,
            request: Option<Request<ReqBody>>,
            inner: Option<S>,
        },
        Readying {
            request: Option<Request<ReqBody>>,
            inner: S,
            held: Option<Held>,
        },
        Called { #[pin] future: S::Future, held: Option<Held> },
        Refused { response: Option<Response<ResBody>> },
    }
}

impl<S, ReqBody, ResBody> ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn called(future: S::Future, held: Held) -> Self {
        Self {
            state: State::Called {
                future,
                held: Some(held),
            },
        }
    }

    pub(crate) fn refused(response: Response<ResBody>) -> Self {
        Self {
            state: State::Refused {
                response: Some(response),
            },
        }
    }

    /// Waits for `pending` to give the request a place, then makes `inner` ready and calls it.
    /// `inner` is a clone not made ready yet: a waiting request holds no place of a pool,
    /// buffer or concurrency limit inside.
    pub(crate) fn waiting(pending: Pending, request: Request<ReqBody>, inner: S) -> Self {
        Self {
            state: State::Waiting {
                pending,
                request: Some(request),
                inner: Some(inner),
            },
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: RefusalBody,
{
    type Output = Result<Response<PermitBody<ResBody>>, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let next = match self.as_mut().project().state.project() {
                StateProj::Waiting {
                    pending,
                    request,
                    inner,
                } => {
                    if request.is_none() || inner.is_none() {
                        // Polled again after `call` panicked: nothing left to do but answer.
                        return Poll::Ready(Ok(empty()));
                    }
                    let outcome = ready!(pending.as_mut().poll(cx));
                    let (Some(request), Some(inner)) = (request.take(), inner.take()) else {
                        return Poll::Ready(Ok(empty()));
                    };
                    match outcome {
                        Ok(held) => State::Readying {
                            request: Some(request),
                            inner,
                            held: Some(held),
                        },
                        Err(refuse) => {
                            let (parts, _) = request.into_parts();
                            State::Refused {
                                response: Some(refuse(&parts).map(ResBody::refusal)),
                            }
                        }
                    }
                }
                StateProj::Readying {
                    request,
                    inner,
                    held,
                } => {
                    // An error here drops `held`: the place goes back.
                    ready!(inner.poll_ready(cx))?;
                    let (Some(request), Some(held)) = (request.take(), held.take()) else {
                        return Poll::Ready(Ok(empty()));
                    };
                    // Should `call` panic, `held` is dropped on the way out: nothing leaks.
                    State::Called {
                        future: inner.call(request),
                        held: Some(held),
                    }
                }
                StateProj::Called { future, held } => {
                    let result = ready!(future.poll(cx));
                    let mut held = held.take();
                    let answer = match &result {
                        Ok(r) if r.extensions().get::<Refused>().is_some() => Answer::Refused,
                        Ok(r) if client_error(r) => Answer::ClientError,
                        Ok(r) => Answer::Served {
                            failed: overloaded(r),
                        },
                        Err(_) => Answer::Served { failed: true },
                    };
                    if let Some(held) = &mut held {
                        held.answered(answer);
                    }
                    // An error gives the place back here; a response hands it to its body.
                    return Poll::Ready(
                        result.map(|response| response.map(|b| PermitBody::new(b, held))),
                    );
                }
                StateProj::Refused { response } => {
                    return Poll::Ready(Ok(response
                        .take()
                        .map(|r| r.map(|b| PermitBody::new(b, None)))
                        // Polled again after its answer: an empty one.
                        .unwrap_or_else(empty)));
                }
            };
            self.as_mut().project().state.set(next);
        }
    }
}

/// Whether an answer says the service is overloaded: a 503 or a 504, or gRPC's `UNAVAILABLE`
/// (14) or `DEADLINE_EXCEEDED` (4) in the head of an HTTP 200 (a trailers-only answer, as gRPC
/// servers send an error before any message). A `grpc-status` in trailers after a body is not
/// read: the request is timed when its head arrives.
fn overloaded<B>(response: &Response<B>) -> bool {
    match response.status().as_u16() {
        503 | 504 => true,
        200 => response
            .headers()
            .get("grpc-status")
            .is_some_and(|v| matches!(v.as_bytes(), b"14" | b"4")),
        _ => false,
    }
}

/// Whether an answer is the client's error: a 4xx, or in the head of an HTTP 200 gRPC's
/// `INVALID_ARGUMENT` (3), `NOT_FOUND` (5), `PERMISSION_DENIED` (7) or `UNAUTHENTICATED` (16).
fn client_error<B>(response: &Response<B>) -> bool {
    match response.status().as_u16() {
        400..=499 => true,
        200 => response
            .headers()
            .get("grpc-status")
            .is_some_and(|v| matches!(v.as_bytes(), b"3" | b"5" | b"7" | b"16")),
        _ => false,
    }
}

fn empty<B: RefusalBody>() -> Response<PermitBody<B>> {
    Response::new(PermitBody::new(B::refusal(Bytes::new()), None))
}

impl<S, ReqBody, ResBody> fmt::Debug for ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
