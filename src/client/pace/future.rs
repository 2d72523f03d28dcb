//! The response future: the wait until the departure, the call, and what its answer says.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::{Shared, Sleeper, TokioSleeper};
use crate::answer::RefusalBody;
use crate::clock::{Clock, TokioClock};

/// A request with a departure: it lands when answered, or when its future is dropped.
struct Flight<C: Clock, Z> {
    shared: Arc<Shared<C, Z>>,
    key: u64,
    landed: bool,
}

impl<C: Clock, Z> Flight<C, Z> {
    fn answered<B>(&mut self, response: &Response<B>) {
        if !self.landed {
            self.landed = true;
            self.shared.landed(self.key, Some(response));
        }
    }
}

impl<C: Clock, Z> Drop for Flight<C, Z> {
    fn drop(&mut self) {
        if !self.landed {
            self.shared.landed(self.key, None::<&Response<()>>);
        }
    }
}

pin_project! {
    /// The response future of [`Pace`](super::Pace). Dropping it while it waits gives up the
    /// request (its departure stays reserved, so the spacing holds).
    pub struct ResponseFuture<S, ReqBody, C = TokioClock, Z = TokioSleeper>
    where
        S: Service<Request<ReqBody>>,
        C: Clock,
        Z: Sleeper,
    {
        #[pin]
        state: State<S, ReqBody, Z>,
        flight: Option<Flight<C, Z>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody, Z>
    where
        S: Service<Request<ReqBody>>,
        Z: Sleeper,
    {
        Waiting {
            #[pin]
            sleep: Z::Sleep,
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

impl<S, ReqBody, C, Z> ResponseFuture<S, ReqBody, C, Z>
where
    S: Service<Request<ReqBody>>,
    C: Clock,
    Z: Sleeper,
{
    fn flight(shared: Arc<Shared<C, Z>>, key: u64) -> Option<Flight<C, Z>> {
        Some(Flight {
            shared,
            key,
            landed: false,
        })
    }

    pub(crate) fn calling(future: S::Future, shared: Arc<Shared<C, Z>>, key: u64) -> Self {
        Self {
            state: State::Calling { future },
            flight: Self::flight(shared, key),
        }
    }

    pub(crate) fn waiting(
        sleep: Z::Sleep,
        request: Request<ReqBody>,
        inner: S,
        shared: Arc<Shared<C, Z>>,
        key: u64,
    ) -> Self {
        Self {
            state: State::Waiting {
                sleep,
                request: Some(request),
                inner: Some(inner),
            },
            flight: Self::flight(shared, key),
        }
    }

    pub(crate) fn refused(response: S::Response) -> Self {
        Self {
            state: State::Refused {
                response: Some(response),
            },
            flight: None,
        }
    }
}

impl<S, ReqBody, ResBody, C, Z> Future for ResponseFuture<S, ReqBody, C, Z>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: RefusalBody,
    C: Clock,
    Z: Sleeper,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut state = this.state;
        loop {
            match state.as_mut().project() {
                StateProj::Waiting {
                    sleep,
                    request,
                    inner,
                } => {
                    ready!(sleep.poll(cx));
                    let (Some(request), Some(inner)) = (request.take(), inner.take()) else {
                        return Poll::Ready(Ok(empty()));
                    };
                    state.set(State::Readying {
                        request: Some(request),
                        inner,
                    });
                }
                StateProj::Readying { request, inner } => {
                    ready!(inner.poll_ready(cx))?;
                    let Some(request) = request.take() else {
                        return Poll::Ready(Ok(empty()));
                    };
                    let future = inner.call(request);
                    state.set(State::Calling { future });
                }
                StateProj::Calling { future } => {
                    let result = ready!(future.poll(cx));
                    if let (Ok(response), Some(flight)) = (&result, this.flight.as_mut()) {
                        flight.answered(response);
                    }
                    // An error lands the request when the flight is dropped, saying nothing.
                    *this.flight = None;
                    return Poll::Ready(result);
                }
                StateProj::Refused { response } => {
                    return Poll::Ready(Ok(response.take().unwrap_or_else(empty)));
                }
            }
        }
    }
}

/// The answer of a future polled again after it completed (or after a panic).
fn empty<B: RefusalBody>() -> Response<B> {
    Response::new(B::refusal(bytes::Bytes::new()))
}

impl<S, ReqBody, C, Z> fmt::Debug for ResponseFuture<S, ReqBody, C, Z>
where
    S: Service<Request<ReqBody>>,
    C: Clock,
    Z: Sleeper,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
