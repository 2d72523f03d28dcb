//! The response future: the backend's answer, read as a success, a failure or neither.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;

use super::layer::{Outcome, Shared};
use crate::breaker::{Permit, ProbeGuard};
use crate::clock::{Clock, TokioClock};

pin_project! {
    /// The response future of [`CircuitBreaker`](super::CircuitBreaker). Dropping a trial
    /// call's future before its answer opens the breaker again for its whole `open_for`.
    pub struct ResponseFuture<F, B, C: Clock = TokioClock> {
        #[pin]
        state: State<F, B, C>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B, C: Clock> {
        Called {
            #[pin]
            future: F,
            shared: Arc<Shared<C>>,
            permit: Permit,
            guard: ProbeGuard<C>,
        },
        Refused { response: Option<Response<B>> },
    }
}

impl<F, B, C: Clock> ResponseFuture<F, B, C> {
    pub(crate) fn called(
        future: F,
        shared: Arc<Shared<C>>,
        permit: Permit,
        guard: ProbeGuard<C>,
    ) -> Self {
        Self {
            state: State::Called {
                future,
                shared,
                permit,
                guard,
            },
        }
    }

    pub(crate) fn refused(response: Response<B>) -> Self {
        Self {
            state: State::Refused {
                response: Some(response),
            },
        }
    }
}

impl<F, B, E, C> Future for ResponseFuture<F, B, C>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: crate::answer::RefusalBody,
    C: Clock,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Called {
                future,
                shared,
                permit,
                guard,
            } => {
                let result = ready!(future.poll(cx));
                let outcome = match &result {
                    Ok(response) => shared.outcome(response),
                    Err(_) => Outcome::Failure,
                };
                match outcome {
                    Outcome::Success => shared.breaker.success(*permit),
                    Outcome::Failure => shared.failure(*permit),
                    Outcome::Ignore => guard.release(),
                }
                Poll::Ready(result)
            }
            StateProj::Refused { response } => Poll::Ready(Ok(response
                .take()
                .unwrap_or_else(|| Response::new(B::refusal(bytes::Bytes::new()))))),
        }
    }
}

impl<F, B, C: Clock> fmt::Debug for ResponseFuture<F, B, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
