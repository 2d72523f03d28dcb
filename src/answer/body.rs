//! The bodies the layers answer refused requests with.

use std::convert::Infallible;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::{BoxBody, UnsyncBoxBody};
use http_body_util::{BodyExt, Full};
use pin_project_lite::pin_project;

/// A response body type that can carry the layer's answer to a refused request.
///
/// [`RateLimit`](crate::http::RateLimit), like every layer of the crate, answers with the
/// inner service's own body type: an admitted response passes through untouched (axum, for
/// one, would box any other body type once more on every response), and a refusal's body (a
/// problem+json document, or nothing for gRPC) is made with [`RefusalBody::refusal`].
///
/// Implemented for axum's body (feature `axum`), tonic's (feature `tonic`),
/// `http_body_util::Full<Bytes>`, `BoxBody<Bytes, E>`, `UnsyncBoxBody<Bytes, E>`, `String`,
/// and [`ResponseBody`], which wraps any other body:
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response, StatusCode};
/// use http_body_util::Empty;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tollgate::http::ResponseBody;
/// use tollgate::key::Global;
/// use tollgate::limiter::Rule;
/// use tollgate::{MemoryStore, Policy, RateLimitLayer, Rate};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let limit = RateLimitLayer::builder(MemoryStore::new())
///     .rule(Rule::new("all").key(Global).policy(Policy::gcra(Rate::per_second(1), 1)?))
///     .build()?;
/// // `Empty` cannot carry a refusal's body: wrap it.
/// let service = ServiceBuilder::new()
///     .layer(limit)
///     .map_response(|r: Response<Empty<Bytes>>| r.map(ResponseBody::new))
///     .service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(Empty::new())) });
/// let first = service.clone().oneshot(Request::new(())).await?;
/// let second = service.oneshot(Request::new(())).await?;
/// assert_eq!((first.status(), second.status()), (StatusCode::OK, StatusCode::TOO_MANY_REQUESTS));
/// # Ok(())
/// # }
/// ```
#[diagnostic::on_unimplemented(
    message = "the rate-limit layer cannot answer a refusal with a `{Self}` body",
    label = "the inner service's response body",
    note = "put the layer inside the one that changes the body type (tower-http's compression, for one), or map the inner responses with `.map_response(|r| r.map(tollgate::http::ResponseBody::new))`"
)]
pub trait RefusalBody {
    /// A body holding `bytes` (possibly empty).
    fn refusal(bytes: Bytes) -> Self;
}

impl<B> RefusalBody for ResponseBody<B> {
    fn refusal(bytes: Bytes) -> Self {
        ResponseBody::full(bytes)
    }
}

impl RefusalBody for Full<Bytes> {
    fn refusal(bytes: Bytes) -> Self {
        Full::new(bytes)
    }
}

impl<E: 'static> RefusalBody for BoxBody<Bytes, E> {
    fn refusal(bytes: Bytes) -> Self {
        Full::new(bytes)
            .map_err(|never: Infallible| match never {})
            .boxed()
    }
}

impl<E: 'static> RefusalBody for UnsyncBoxBody<Bytes, E> {
    fn refusal(bytes: Bytes) -> Self {
        Full::new(bytes)
            .map_err(|never: Infallible| match never {})
            .boxed_unsync()
    }
}

impl RefusalBody for String {
    fn refusal(bytes: Bytes) -> Self {
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(feature = "axum")]
impl RefusalBody for axum::body::Body {
    fn refusal(bytes: Bytes) -> Self {
        axum::body::Body::from(bytes)
    }
}

#[cfg(feature = "tonic")]
impl RefusalBody for tonic::body::Body {
    fn refusal(bytes: Bytes) -> Self {
        if bytes.is_empty() {
            tonic::body::Body::empty()
        } else {
            tonic::body::Body::new(Full::new(bytes))
        }
    }
}

pin_project! {
    /// Any response body, or the layer's own short answer: for an inner service whose body
    /// type is not a [`RefusalBody`] (map its responses with [`ResponseBody::new`]).
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Full { data: Option<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    /// Wraps the inner service's body.
    pub fn new(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            kind: Kind::Full { data },
        }
    }
}

impl<B: fmt::Debug> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Inner { body } => f.debug_tuple("ResponseBody::Inner").field(body).finish(),
            Kind::Full { data } => f.debug_tuple("ResponseBody::Full").field(data).finish(),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn text<B: Body<Data = Bytes>>(body: B) -> String
    where
        B::Error: fmt::Debug,
    {
        let bytes = body.collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    /// Every body type carries the refusal's bytes, and an empty refusal is an empty body.
    #[tokio::test]
    async fn every_refusal_body_carries_the_answer() {
        let answer = || Bytes::from_static(b"{\"status\":429}");
        let want = "{\"status\":429}";
        assert_eq!(text(Full::<Bytes>::refusal(answer())).await, want);
        assert_eq!(
            text(BoxBody::<Bytes, std::io::Error>::refusal(answer())).await,
            want
        );
        assert_eq!(
            text(UnsyncBoxBody::<Bytes, std::io::Error>::refusal(answer())).await,
            want
        );
        assert_eq!(String::refusal(answer()), want);
        assert_eq!(
            text(ResponseBody::<Full<Bytes>>::refusal(answer())).await,
            want
        );
        assert!(ResponseBody::<Full<Bytes>>::refusal(Bytes::new()).is_end_stream());
        #[cfg(feature = "axum")]
        assert_eq!(text(axum::body::Body::refusal(answer())).await, want);
        #[cfg(feature = "tonic")]
        {
            assert_eq!(text(tonic::body::Body::refusal(answer())).await, want);
            assert!(tonic::body::Body::refusal(Bytes::new()).is_end_stream());
        }
    }
}
