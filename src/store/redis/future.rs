//! [`ResponseFuture`]: the future of a check.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::Decision;
use crate::store::StoreError;

/// The future of a Redis check: ready at once for an invalid call or a deny-cache hit, boxed
/// otherwise.
#[must_use = "futures do nothing unless polled"]
pub struct ResponseFuture {
    state: FutureState,
}

type BoxFuture = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send + 'static>>;

enum FutureState {
    Ready(Option<Result<Decision, StoreError>>),
    Boxed(BoxFuture),
}

impl ResponseFuture {
    pub(super) fn ready(r: Result<Decision, StoreError>) -> Self {
        Self {
            state: FutureState::Ready(Some(r)),
        }
    }

    pub(super) fn boxed(
        f: impl Future<Output = Result<Decision, StoreError>> + Send + 'static,
    ) -> Self {
        Self {
            state: FutureState::Boxed(Box::pin(f)),
        }
    }
}

impl Future for ResponseFuture {
    type Output = Result<Decision, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            FutureState::Ready(r) => match r.take() {
                Some(r) => Poll::Ready(r),
                None => Poll::Pending,
            },
            FutureState::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            FutureState::Ready(_) => "ready",
            FutureState::Boxed(_) => "pending",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
