//! Request bodies that can be sent again.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Empty, Full};
use pin_project_lite::pin_project;

/// The most frames read ahead from a body: one that has more ready is sent once (its frames
/// still go out, as they come).
pub(crate) const MAX_READ_AHEAD_FRAMES: usize = 1024;

/// A request body type the retry layer knows how to send again.
///
/// A request is retried only if its body can be replayed; one that cannot is sent once and its
/// answer handed back as it is. There are two ways to replay a body, and each body type picks
/// the one that fits it:
///
/// - **Clone it** ([`Replay::cloning`]): for bodies that hold their bytes, such as
///   [`Full<Bytes>`](http_body_util::Full), [`Empty`](http_body_util::Empty) and `String`.
///   Cloning `Full<Bytes>` copies no bytes, and such a body is replayed whatever its size.
/// - **Read it ahead** ([`Replay::read_ahead`]): for streaming bodies that cannot be cloned
///   (`tonic::body::Body`, `axum::body::Body`, boxed bodies). Before the first attempt the
///   layer takes the frames the body has *ready now*, without waiting, up to the policy's
///   [`replay_limit`](super::RetryPolicyBuilder::replay_limit) (64 KiB by default) and 1,024
///   frames. If the body ended within that, the request is replayable and each attempt sends
///   those bytes. Otherwise the bytes read are sent first and the rest follows as it comes,
///   and the request is not retried. A unary gRPC request (one encoded message, ready at
///   once) is read whole; a stream that waits for its producer is never held back, so a
///   streaming or bidirectional call goes out as it would without the layer.
///
/// Why not buffer every body? Waiting for a body to end before sending it would hold a
/// streaming request until its producer finished (forever, for a call that waits for the
/// server's first answer), and buffering an unbounded body costs unbounded memory. Why not
/// require `B: Clone`? Neither tonic's body nor axum's is `Clone`, and a retry layer around a
/// tonic channel is half the point.
///
/// To replay your own body type, implement this trait with one of the two constructors.
pub trait ReplayBody: Body + Sized {
    /// Makes the body replayable if it can be: the body to send first, and a source of
    /// identical bodies for the retries (`None`: the request is sent once). `limit` is the
    /// most that may be read ahead.
    fn replay(self, limit: usize) -> (Self, Option<Replay<Self>>);
}

/// Makes copies of a request body for the retries: see [`ReplayBody`].
pub struct Replay<B: Body> {
    kind: Kind<B>,
}

enum Kind<B: Body> {
    Clone {
        body: B,
        clone: fn(&B) -> B,
    },
    Bytes {
        data: Bytes,
        trailers: Option<HeaderMap>,
        wrap: fn(ReadAhead<B>) -> B,
    },
}

impl<B: Body> Replay<B> {
    /// Replays `body` by cloning it: the body to send first, and its source of copies.
    pub fn cloning(body: B) -> (B, Option<Self>)
    where
        B: Clone,
    {
        let first = body.clone();
        let kind = Kind::Clone {
            body,
            clone: B::clone,
        };
        (first, Some(Self { kind }))
    }

    /// Replays `body` by reading ahead the frames it has ready now, up to `limit` bytes, and
    /// sending them again; `wrap` turns what was read (and any rest) back into a `B`. The
    /// body is polled without a waker that anything will use: a body that is not ready is
    /// left as it is.
    pub fn read_ahead(mut body: B, limit: usize, wrap: fn(ReadAhead<B>) -> B) -> (B, Option<Self>)
    where
        B: Body<Data = Bytes> + Unpin,
    {
        let mut cx = Context::from_waker(Waker::noop());
        let mut data = BytesMut::new();
        let mut trailers = None;
        for _ in 0..MAX_READ_AHEAD_FRAMES {
            let frame = match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(Some(Err(error))) => {
                    // Sent on as it came: the inner service sees the body fail.
                    let partial = ReadAhead::new(data.freeze(), trailers, Some(error), None);
                    return (wrap(partial), None);
                }
                Poll::Ready(None) => {
                    let data = data.freeze();
                    let first = wrap(ReadAhead::new(data.clone(), trailers.clone(), None, None));
                    let kind = Kind::Bytes {
                        data,
                        trailers,
                        wrap,
                    };
                    return (first, Some(Self { kind }));
                }
                Poll::Pending => {
                    let partial = ReadAhead::new(data.freeze(), trailers, None, Some(body));
                    return (wrap(partial), None);
                }
            };
            match frame.into_data() {
                Ok(chunk) => data.extend_from_slice(&chunk),
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers = Some(t);
                    }
                }
            }
            if data.len() > limit {
                break;
            }
        }
        // Longer than the limit, or too many frames (a body of empty frames, always ready,
        // would be read ahead for ever): what was read goes first, the rest as it comes.
        let partial = ReadAhead::new(data.freeze(), trailers, None, Some(body));
        (wrap(partial), None)
    }

    /// A body for one more attempt.
    pub(crate) fn body(&self) -> B {
        match &self.kind {
            Kind::Clone { body, clone } => clone(body),
            Kind::Bytes {
                data,
                trailers,
                wrap,
            } => wrap(ReadAhead::new(data.clone(), trailers.clone(), None, None)),
        }
    }
}

impl<B: Body> fmt::Debug for Replay<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Clone { .. } => f.write_str("Replay::Clone"),
            Kind::Bytes { data, .. } => write!(f, "Replay::Bytes({} bytes)", data.len()),
        }
    }
}

pin_project! {
    /// A body read ahead: the bytes read, then its trailers and its error (when it failed), or
    /// what was left of it (for a body that was not ready, or longer than the limit) and then
    /// its trailers.
    pub struct ReadAhead<B: Body> {
        data: Option<Bytes>,
        trailers: Option<HeaderMap>,
        error: Option<B::Error>,
        #[pin]
        rest: Option<B>,
    }
}

impl<B: Body> ReadAhead<B> {
    fn new(
        data: Bytes,
        trailers: Option<HeaderMap>,
        error: Option<B::Error>,
        rest: Option<B>,
    ) -> Self {
        Self {
            data: (!data.is_empty()).then_some(data),
            trailers,
            error,
            rest,
        }
    }
}

impl<B: Body<Data = Bytes>> Body for ReadAhead<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        if let Some(data) = this.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if let Some(error) = this.error.take() {
            // Trailers read ahead came before the error (it ended the reading): they go first.
            if let Some(trailers) = this.trailers.take() {
                *this.error = Some(error);
                return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
            }
            return Poll::Ready(Some(Err(error)));
        }
        if let Some(rest) = this.rest.as_mut().as_pin_mut() {
            match ready!(rest.poll_frame(cx)) {
                Some(frame) => return Poll::Ready(Some(frame)),
                // The rest ended: the trailers read ahead (if any) come last.
                None => this.rest.set(None),
            }
        }
        Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none()
            && self.error.is_none()
            && self.trailers.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let read = self.data.as_ref().map_or(0, |d| d.len() as u64);
        match &self.rest {
            Some(rest) => {
                let hint = rest.size_hint();
                let mut sum = SizeHint::new();
                sum.set_lower(hint.lower().saturating_add(read));
                if let Some(upper) = hint.upper() {
                    sum.set_upper(upper.saturating_add(read));
                }
                sum
            }
            None => SizeHint::with_exact(read),
        }
    }
}

impl<B: Body> fmt::Debug for ReadAhead<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadAhead")
            .field("data", &self.data.as_ref().map(Bytes::len))
            .field("trailers", &self.trailers.is_some())
            .field("rest", &self.rest.is_some())
            .finish_non_exhaustive()
    }
}

impl<D: bytes::Buf + Clone> ReplayBody for Full<D> {
    fn replay(self, _: usize) -> (Self, Option<Replay<Self>>) {
        Replay::cloning(self)
    }
}

impl<D: bytes::Buf> ReplayBody for Empty<D> {
    fn replay(self, _: usize) -> (Self, Option<Replay<Self>>) {
        Replay::cloning(self)
    }
}

impl ReplayBody for String {
    fn replay(self, _: usize) -> (Self, Option<Replay<Self>>) {
        Replay::cloning(self)
    }
}

impl<E: Send + Sync + 'static> ReplayBody for http_body_util::combinators::BoxBody<Bytes, E> {
    fn replay(self, limit: usize) -> (Self, Option<Replay<Self>>) {
        Replay::read_ahead(self, limit, Self::new)
    }
}

impl<E: Send + 'static> ReplayBody for http_body_util::combinators::UnsyncBoxBody<Bytes, E> {
    fn replay(self, limit: usize) -> (Self, Option<Replay<Self>>) {
        Replay::read_ahead(self, limit, Self::new)
    }
}

#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
impl ReplayBody for tonic::body::Body {
    fn replay(self, limit: usize) -> (Self, Option<Replay<Self>>) {
        Replay::read_ahead(self, limit, Self::new)
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl ReplayBody for axum::body::Body {
    fn replay(self, limit: usize) -> (Self, Option<Replay<Self>>) {
        Replay::read_ahead(self, limit, Self::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use http_body_util::combinators::UnsyncBoxBody;
    use std::convert::Infallible;

    type Boxed = UnsyncBoxBody<Bytes, Infallible>;

    async fn bytes<B: Body<Data = Bytes>>(body: B) -> (Bytes, Option<HeaderMap>)
    where
        B::Error: fmt::Debug,
    {
        let collected = body.collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        (collected.to_bytes(), trailers)
    }

    /// A body of `chunks`, each frame ready only after `pending` polls said Pending.
    struct Chunks {
        chunks: Vec<&'static [u8]>,
        pending: usize,
    }

    impl Body for Chunks {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if self.pending > 0 {
                self.pending -= 1;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if self.chunks.is_empty() {
                return Poll::Ready(None);
            }
            let chunk = self.chunks.remove(0);
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(chunk)))))
        }
    }

    fn boxed(chunks: Vec<&'static [u8]>, pending: usize) -> Boxed {
        Chunks { chunks, pending }.boxed_unsync()
    }

    #[tokio::test]
    async fn cloned_bodies_replay_whole() {
        let (first, replay) = Full::new(Bytes::from_static(b"hello")).replay(0);
        let replay = replay.unwrap();
        assert_eq!(bytes(first).await.0, "hello");
        assert_eq!(bytes(replay.body()).await.0, "hello");
        assert_eq!(bytes(replay.body()).await.0, "hello");
        let (first, replay) = String::from("text").replay(0);
        assert_eq!(first, "text");
        assert_eq!(replay.unwrap().body(), "text");
        assert!(Empty::<Bytes>::new().replay(0).1.is_some());
        assert_eq!(
            format!("{:?}", Replay::cloning(String::new()).1.unwrap()),
            "Replay::Clone"
        );
    }

    #[tokio::test]
    async fn a_ready_body_is_read_ahead() {
        let (first, replay) = boxed(vec![b"ab", b"cd"], 0).replay(4);
        let replay = replay.expect("ended within the limit");
        assert_eq!(format!("{replay:?}"), "Replay::Bytes(4 bytes)");
        assert_eq!(first.size_hint().exact(), Some(4));
        assert_eq!(bytes(first).await.0, "abcd");
        assert_eq!(bytes(replay.body()).await.0, "abcd");
        assert_eq!(bytes(replay.body()).await.0, "abcd");
        // An empty body is replayable and ends at once.
        let (first, replay) = boxed(vec![], 0).replay(0);
        assert!(first.is_end_stream());
        assert!(replay.unwrap().body().is_end_stream());
    }

    #[tokio::test]
    async fn a_long_body_is_sent_whole_but_once() {
        let (first, replay) = boxed(vec![b"ab", b"cd", b"ef"], 0).replay(3);
        assert!(replay.is_none());
        assert!(!first.is_end_stream());
        assert_eq!(bytes(first).await.0, "abcdef");
        // At the limit exactly it is still replayable.
        assert!(boxed(vec![b"ab", b"cd"], 0).replay(4).1.is_some());
    }

    #[tokio::test]
    async fn a_body_that_is_not_ready_is_not_waited_for() {
        let (first, replay) = boxed(vec![b"ab", b"cd"], 1).replay(1024);
        assert!(replay.is_none());
        assert_eq!(bytes(first).await.0, "abcd");
        // Read up to the first pause, then the rest as it comes.
        let mut body = Chunks {
            chunks: vec![b"ab", b"cd"],
            pending: 0,
        };
        let mut cx = Context::from_waker(Waker::noop());
        let _ = Pin::new(&mut body).poll_frame(&mut cx);
        body.pending = 0;
        let (first, replay) = Replay::read_ahead(body.boxed_unsync(), 1024, UnsyncBoxBody::new);
        assert!(replay.is_some());
        assert_eq!(bytes(first).await.0, "cd");
    }

    /// A body of frames (or errors), all ready.
    struct Frames<E>(Vec<Result<Frame<Bytes>, E>>);

    impl<E: Unpin> Body for Frames<E> {
        type Data = Bytes;
        type Error = E;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, E>>> {
            Poll::Ready((!self.0.is_empty()).then(|| self.0.remove(0)))
        }
    }

    #[tokio::test]
    async fn trailers_are_replayed() {
        let mut t = HeaderMap::new();
        t.insert("grpc-status", "0".parse().unwrap());
        let body = Frames::<Infallible>(vec![
            Ok(Frame::data(Bytes::from_static(b"x"))),
            Ok(Frame::trailers(t.clone())),
        ]);
        let (first, replay) = Replay::read_ahead(body.boxed_unsync(), 10, UnsyncBoxBody::new);
        let replay = replay.unwrap();
        assert_eq!(
            bytes(first).await,
            (Bytes::from_static(b"x"), Some(t.clone()))
        );
        assert_eq!(
            bytes(replay.body()).await,
            (Bytes::from_static(b"x"), Some(t))
        );
    }

    /// Issue 24, 4: data, then trailers, then `Pending` (a channel body whose sender is
    /// alive): the trailers were kept aside and then lost when the rest ended.
    #[tokio::test]
    async fn trailers_before_a_pause_are_sent_at_the_end() {
        /// Data, trailers, then one `Pending` before the end.
        struct Paused {
            step: usize,
        }
        impl Body for Paused {
            type Data = Bytes;
            type Error = Infallible;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
                self.step += 1;
                match self.step {
                    1 => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"x"))))),
                    2 => {
                        let mut t = HeaderMap::new();
                        t.insert("x-checksum", "42".parse().unwrap());
                        Poll::Ready(Some(Ok(Frame::trailers(t))))
                    }
                    3 => {
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                    _ => Poll::Ready(None),
                }
            }
        }
        let (first, replay) =
            Replay::read_ahead(Paused { step: 0 }.boxed_unsync(), 10, UnsyncBoxBody::new);
        assert!(replay.is_none(), "not ended when read: sent once");
        let (data, trailers) = bytes(first).await;
        assert_eq!(data, "x");
        assert_eq!(trailers.expect("the trailers")["x-checksum"], "42");
    }

    #[tokio::test]
    async fn an_error_is_passed_on() {
        let body = Frames(vec![
            Ok(Frame::data(Bytes::from_static(b"a"))),
            Err("broken"),
        ]);
        let (first, replay) = Replay::read_ahead(body.boxed_unsync(), 10, UnsyncBoxBody::new);
        assert!(replay.is_none());
        assert!(!first.is_end_stream());
        assert_eq!(first.size_hint().lower(), 1);
        assert_eq!(first.collect().await.unwrap_err(), "broken");
        // An error before any data is not the end of the body either.
        let (first, _) = Replay::read_ahead(
            Frames(vec![Err("broken")]).boxed_unsync(),
            10,
            UnsyncBoxBody::new,
        );
        assert!(!first.is_end_stream());
        assert_eq!(first.collect().await.unwrap_err(), "broken");
    }

    /// Data, trailers, then an error: the replayed frames keep that order (the error used to
    /// come before the trailers).
    #[tokio::test]
    async fn an_error_after_the_trailers_comes_after_them() {
        let mut t = HeaderMap::new();
        t.insert("x-checksum", "42".parse().unwrap());
        let body = Frames(vec![
            Ok(Frame::data(Bytes::from_static(b"a"))),
            Ok(Frame::trailers(t)),
            Err("broken"),
        ]);
        let (mut first, replay) = Replay::read_ahead(body.boxed_unsync(), 10, UnsyncBoxBody::new);
        assert!(replay.is_none());
        let mut frames = Vec::new();
        while let Some(frame) = first.frame().await {
            frames.push(match frame {
                Ok(f) if f.is_data() => "data",
                Ok(f) if f.is_trailers() => "trailers",
                Ok(_) => "other",
                Err(_) => "error",
            });
        }
        assert_eq!(frames, ["data", "trailers", "error"]);
    }

    /// A body of empty frames, always ready: reading ahead stops after so many frames (it used
    /// to spin for ever), and the body is sent once, every frame of it.
    #[tokio::test]
    async fn a_body_of_endless_empty_frames_is_not_read_ahead_for_ever() {
        struct Empties(usize);
        impl Body for Empties {
            type Data = Bytes;
            type Error = Infallible;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
                if self.0 == 0 {
                    return Poll::Ready(None);
                }
                self.0 -= 1;
                Poll::Ready(Some(Ok(Frame::data(Bytes::new()))))
            }
        }
        let (first, replay) = Replay::read_ahead(
            Empties(MAX_READ_AHEAD_FRAMES + 1).boxed_unsync(),
            10,
            UnsyncBoxBody::new,
        );
        assert!(replay.is_none(), "too many frames to hold: sent once");
        assert_eq!(bytes(first).await.0, "");
        // Within the bound it is replayable.
        let (_, replay) = Replay::read_ahead(
            Empties(MAX_READ_AHEAD_FRAMES - 1).boxed_unsync(),
            10,
            UnsyncBoxBody::new,
        );
        assert!(replay.is_some());
    }

    #[tokio::test]
    async fn the_streaming_bodies_are_read_ahead() {
        let data = || Frames::<Infallible>(vec![Ok(Frame::data(Bytes::from_static(b"abc")))]);
        let (first, replay) = data().boxed().replay(16);
        assert_eq!(bytes(first).await.0, "abc");
        assert_eq!(bytes(replay.unwrap().body()).await.0, "abc");
        #[cfg(feature = "axum")]
        {
            let (first, replay) = axum::body::Body::new(data()).replay(16);
            assert_eq!(bytes(first).await.0, "abc");
            assert_eq!(bytes(replay.unwrap().body()).await.0, "abc");
        }
        #[cfg(feature = "tonic")]
        {
            let (first, replay) = tonic::body::Body::new(data()).replay(16);
            assert_eq!(bytes(first).await.0, "abc");
            assert_eq!(bytes(replay.unwrap().body()).await.0, "abc");
            assert!(tonic::body::Body::new(data()).replay(2).1.is_none());
        }
    }

    #[test]
    fn read_ahead_shows_what_it_holds() {
        let body = ReadAhead::<Full<Bytes>>::new(Bytes::from_static(b"ab"), None, None, None);
        assert_eq!(
            format!("{body:?}"),
            "ReadAhead { data: Some(2), trailers: false, rest: false, .. }"
        );
        assert!(!body.is_end_stream());
        let done = ReadAhead::<Full<Bytes>>::new(Bytes::new(), None, None, None);
        assert!(done.is_end_stream());
        let trailers =
            ReadAhead::<Full<Bytes>>::new(Bytes::new(), Some(HeaderMap::new()), None, None);
        assert!(!trailers.is_end_stream());
        let rest = ReadAhead::new(
            Bytes::new(),
            None,
            None,
            Some(Full::new(Bytes::from_static(b"x"))),
        );
        assert!(!rest.is_end_stream());
        assert_eq!(rest.size_hint().exact(), Some(1));
    }
}
