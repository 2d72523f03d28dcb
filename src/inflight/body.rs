//! The response body that holds the permit until it ends.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::Held;
use crate::answer::RefusalBody;

pin_project! {
    /// A response body of [`ConcurrencyLimit`](crate::concurrency::ConcurrencyLimit) and
    /// [`LoadShed`](crate::shed::LoadShed): the inner service's body, holding the request's
    /// place until its last frame has been sent, it fails, or it is dropped (the client went
    /// away). A streamed download counts as in flight until its last byte.
    pub struct PermitBody<B> {
        #[pin]
        inner: B,
        permit: Option<Held>,
    }
}

impl<B> PermitBody<B> {
    pub(crate) fn new(inner: B, permit: Option<Held>) -> Self {
        Self { inner, permit }
    }

    /// The inner body.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// Whether this body still holds its request's place.
    pub fn holds_permit(&self) -> bool {
        self.permit.is_some()
    }
}

/// An outer layer (a rate limit around a concurrency limit, say) answers in this body type
/// too: its refusal holds no place.
impl<B: RefusalBody> RefusalBody for PermitBody<B> {
    fn refusal(bytes: bytes::Bytes) -> Self {
        PermitBody::new(B::refusal(bytes), None)
    }
}

impl<B: Body> Body for PermitBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        match &frame {
            Some(Ok(_)) => {}
            // The end, or a failure: the request is no longer in flight.
            None | Some(Err(_)) => drop(this.permit.take()),
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> fmt::Debug for PermitBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PermitBody")
            .field("holds_permit", &self.permit.is_some())
            .finish_non_exhaustive()
    }
}
