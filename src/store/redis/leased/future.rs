//! [`LeasedFuture`]: the future of a leased check.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::Decision;
use crate::store::StoreError;
use crate::store::redis::ResponseFuture;
// Named in the docs of LeasedFuture.
#[cfg(doc)]
use crate::store::redis::{LeasedStore, RedisStore};

/// The future of a [`LeasedStore`] check: ready at once when leases answer it, the
/// [`RedisStore`]'s own future when no lease is involved, and otherwise a task that finishes
/// the leases' bookkeeping even if this future is dropped.
#[must_use = "futures do nothing unless polled"]
pub struct LeasedFuture {
    state: FutureState,
}

enum FutureState {
    Ready(Option<Result<Decision, StoreError>>),
    Redis(ResponseFuture),
    Spawned(tokio::task::JoinHandle<Result<Decision, StoreError>>),
    Boxed(Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send + 'static>>),
}

impl LeasedFuture {
    pub(super) fn ready(r: Result<Decision, StoreError>) -> Self {
        Self {
            state: FutureState::Ready(Some(r)),
        }
    }

    pub(super) fn redis(f: ResponseFuture) -> Self {
        Self {
            state: FutureState::Redis(f),
        }
    }

    pub(super) fn spawned(h: tokio::task::JoinHandle<Result<Decision, StoreError>>) -> Self {
        Self {
            state: FutureState::Spawned(h),
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

impl Future for LeasedFuture {
    type Output = Result<Decision, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            FutureState::Ready(r) => match r.take() {
                Some(r) => Poll::Ready(r),
                None => Poll::Pending,
            },
            FutureState::Redis(f) => Pin::new(f).poll(cx),
            FutureState::Spawned(h) => Pin::new(h).poll(cx).map(|r| match r {
                Ok(r) => r,
                Err(e) => Err(StoreError::Backend(Box::new(e))),
            }),
            FutureState::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for LeasedFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            FutureState::Ready(_) => "ready",
            FutureState::Redis(_) => "redis",
            FutureState::Spawned(_) => "spawned",
            FutureState::Boxed(_) => "waiting",
        };
        f.debug_struct("LeasedFuture")
            .field("state", &state)
            .finish()
    }
}
