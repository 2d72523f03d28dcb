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
use crate::answer::{GRPC_STATUS, RefusalBody, Refused};

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
        // The wait is boxed, as its pending admission already is: the future and the
        // response move on every request, and the path that does not wait should not move
        // the bytes of one that does.
        Waiting { wait: Box<Wait<S, ReqBody>> },
        Called { #[pin] future: S::Future, held: Option<Held> },
        Refused { response: Option<Response<ResBody>> },
    }
}

/// A request that waits for a place (`pending`), then for `inner` to be ready.
struct Wait<S, ReqBody> {
    /// `None` once it has given the request its place (`held`).
    pending: Option<Pending>,
    request: Option<Request<ReqBody>>,
    inner: S,
    held: Option<Held>,
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
                wait: Box::new(Wait {
                    pending: Some(pending),
                    request: Some(request),
                    inner,
                    held: None,
                }),
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
                StateProj::Waiting { wait } => {
                    if wait.request.is_none() {
                        // Polled again after `call` panicked: nothing left to do but answer.
                        return Poll::Ready(Ok(empty()));
                    }
                    if let Some(pending) = &mut wait.pending {
                        match ready!(pending.as_mut().poll(cx)) {
                            Ok(held) => {
                                wait.pending = None;
                                wait.held = Some(held);
                            }
                            Err(refuse) => {
                                let Some(request) = wait.request.take() else {
                                    return Poll::Ready(Ok(empty()));
                                };
                                let (parts, _) = request.into_parts();
                                let response = refuse(&parts).map(ResBody::refusal);
                                self.as_mut().project().state.set(State::Refused {
                                    response: Some(response),
                                });
                                continue;
                            }
                        }
                    }
                    if let Err(error) = ready!(wait.inner.poll_ready(cx)) {
                        // The place goes back at once.
                        wait.held = None;
                        return Poll::Ready(Err(error));
                    }
                    let (Some(request), Some(held)) = (wait.request.take(), wait.held.take())
                    else {
                        return Poll::Ready(Ok(empty()));
                    };
                    // Should `call` panic, `held` is dropped on the way out: nothing leaks.
                    State::Called {
                        future: wait.inner.call(request),
                        held: Some(held),
                    }
                }
                StateProj::Called { future, held } => {
                    let result = ready!(future.poll(cx));
                    let mut held = held.take();
                    if let Some(held) = held.as_mut().filter(|held| held.learns()) {
                        held.answered(answer_of(&result));
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

/// How the inner service answered, as the shedder learns from it: a tollgate refusal; a
/// client error (a 4xx, or in the head of an HTTP 200 gRPC's `INVALID_ARGUMENT` (3),
/// `NOT_FOUND` (5), `PERMISSION_DENIED` (7) or `UNAUTHENTICATED` (16)); or served, failed when
/// the service is overloaded (an error, a 503 or a 504, or gRPC's `UNAVAILABLE` (14) or
/// `DEADLINE_EXCEEDED` (4) in the head of an HTTP 200: a trailers-only answer, as gRPC servers
/// send an error before any message). A `grpc-status` in trailers after a body is not read:
/// the request is timed when its head arrives.
fn answer_of<B, E>(result: &Result<Response<B>, E>) -> Answer {
    let response = match result {
        Ok(response) => response,
        Err(_) => return Answer::Served { failed: true },
    };
    if response.extensions().get::<Refused>().is_some() {
        return Answer::Refused;
    }
    match response.status().as_u16() {
        400..=499 => Answer::ClientError,
        503 | 504 => Answer::Served { failed: true },
        // The header's name is a constant: a name given as text would be parsed per response.
        200 => match response.headers().get(GRPC_STATUS).map(|v| v.as_bytes()) {
            Some(b"3" | b"5" | b"7" | b"16") => Answer::ClientError,
            Some(b"14" | b"4") => Answer::Served { failed: true },
            _ => Answer::Served { failed: false },
        },
        _ => Answer::Served { failed: false },
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
