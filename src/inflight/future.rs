//! The response future: the inner call with its permit, or a ready answer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::Response;
use pin_project_lite::pin_project;

use super::body::PermitBody;
use super::{Answer, Held};
use crate::answer::{RefusalBody, Refused};

pin_project! {
    /// The response future of [`ConcurrencyLimit`](crate::concurrency::ConcurrencyLimit) and
    /// [`LoadShed`](crate::shed::LoadShed). Dropping it before it is done (the client went
    /// away, a timeout fired) gives the request's place back at once.
    pub struct ResponseFuture<F, B> {
        #[pin]
        state: State<F, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B> {
        Called { #[pin] future: F, held: Option<Held> },
        Refused { response: Option<Response<B>> },
    }
}

impl<F, B> ResponseFuture<F, B> {
    pub(crate) fn called(future: F, held: Held) -> Self {
        Self {
            state: State::Called {
                future,
                held: Some(held),
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

impl<F, B, E> Future for ResponseFuture<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: RefusalBody,
{
    type Output = Result<Response<PermitBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Called { future, held } => {
                let result = ready!(future.poll(cx));
                let mut held = held.take();
                let answer = match &result {
                    Ok(r) if r.extensions().get::<Refused>().is_some() => Answer::Refused,
                    Ok(r) => Answer::Served {
                        failed: matches!(r.status().as_u16(), 503 | 504),
                    },
                    Err(_) => Answer::Served { failed: true },
                };
                if let Some(held) = &mut held {
                    held.answered(answer);
                }
                // An error gives the place back here; a response hands it to its body.
                Poll::Ready(result.map(|response| response.map(|b| PermitBody::new(b, held))))
            }
            StateProj::Refused { response } => Poll::Ready(Ok(response
                .take()
                .map(|r| r.map(|b| PermitBody::new(b, None)))
                // Polled again after its answer: an empty one.
                .unwrap_or_else(|| {
                    Response::new(PermitBody::new(B::refusal(Bytes::new()), None))
                }))),
        }
    }
}

impl<F, B> fmt::Debug for ResponseFuture<F, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
