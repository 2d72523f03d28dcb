//! The response future: the backend's answer, counted as accepted or not, or a local refusal.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;

use super::layer::Shared;
use crate::client::local::refused_by_server;
use crate::clock::{Clock, TokioClock};

pin_project! {
    /// The response future of [`AdaptiveThrottle`](super::AdaptiveThrottle).
    pub struct ResponseFuture<F, B, C = TokioClock> {
        #[pin]
        state: State<F, B, C>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B, C> {
        Called { #[pin] future: F, shared: Arc<Shared<C>>, key: u64, bucket: u64 },
        Refused { response: Option<Response<B>> },
    }
}

impl<F, B, C> ResponseFuture<F, B, C> {
    pub(crate) fn called(future: F, shared: Arc<Shared<C>>, key: u64, bucket: u64) -> Self {
        Self {
            state: State::Called {
                future,
                shared,
                key,
                bucket,
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
                key,
                bucket,
            } => {
                let result = ready!(future.poll(cx));
                if let Ok(response) = &result {
                    if crate::client::local::made_locally(response) {
                        // A refusal a tollgate layer inside made (an open breaker, pacing)
                        // never reached the backend: it counts neither for it (as an accept,
                        // which would lower the refusals during an outage) nor against it.
                        shared.unsent(*key, *bucket);
                    } else if !refused_by_server(response.status(), response.headers()) {
                        shared.accepted(*key);
                    }
                }
                Poll::Ready(result)
            }
            StateProj::Refused { response } => Poll::Ready(Ok(response
                .take()
                .unwrap_or_else(|| Response::new(B::refusal(bytes::Bytes::new()))))),
        }
    }
}

impl<F, B, C> fmt::Debug for ResponseFuture<F, B, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
