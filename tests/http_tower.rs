//! Tower correctness: the service is `Clone + Send + Sync`, `poll_ready` is the inner
//! service's, the ready inner service is the one that gets the request, a refused request
//! never reaches the inner service, and no body is ever read.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::Empty;
use support::store;
use tollgate::clock::ManualClock;
use tollgate::http::{RateLimit, ResponseBody, ResponseFuture};
use tollgate::key::PeerIp;
use tollgate::limiter::Rule;
use tollgate::{MemoryStore, Policy, RateLimitLayer};
use tower::{Service, ServiceBuilder, ServiceExt};

/// A request body that records whether anyone polled it.
struct Watched(Arc<AtomicBool>);

impl Body for Watched {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.store(true, Ordering::SeqCst);
        Poll::Ready(None)
    }
}

/// An inner service that must be polled ready (on this very instance) before each call, and
/// is ready only when the test says so.
#[derive(Clone)]
struct Strict {
    open: Arc<AtomicBool>,
    ready: bool,
    calls: Arc<AtomicUsize>,
}

impl<B> Service<Request<B>> for Strict {
    // `Empty` cannot carry a refusal's body: the layer's wrapper can.
    type Response = Response<ResponseBody<Empty<Bytes>>>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        if self.open.load(Ordering::SeqCst) {
            self.ready = true;
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    fn call(&mut self, _: Request<B>) -> Self::Future {
        assert!(self.ready, "called without poll_ready on this instance");
        self.ready = false;
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(Response::new(ResponseBody::new(Empty::new()))))
    }
}

fn layer(limit: u64) -> RateLimitLayer<MemoryStore<ManualClock>> {
    let (store, _clock) = store();
    RateLimitLayer::builder(store)
        .rule(
            Rule::new("p")
                .key(PeerIp::new())
                .policy(Policy::fixed_window(limit, Duration::from_secs(60)).unwrap()),
        )
        .build()
        .unwrap()
}

fn request(polled: &Arc<AtomicBool>) -> Request<Watched> {
    let mut r = Request::new(Watched(polled.clone()));
    r.extensions_mut()
        .insert("192.0.2.1:4000".parse::<SocketAddr>().unwrap());
    r
}

/// One request through `service`, once it is ready.
async fn send<S>(service: &mut S, polled: &Arc<AtomicBool>) -> S::Response
where
    S: Service<Request<Watched>>,
    S::Error: std::fmt::Debug,
{
    let ready = ServiceExt::<Request<Watched>>::ready(service)
        .await
        .unwrap();
    ready.call(request(polled)).await.unwrap()
}

#[test]
fn services_and_futures_are_send_sync_clone() {
    fn clone_send_sync<T: Clone + Send + Sync + 'static>() {}
    fn send<T: Send + 'static>() {}
    clone_send_sync::<RateLimitLayer<MemoryStore>>();
    clone_send_sync::<RateLimit<Strict, MemoryStore>>();
    send::<ResponseFuture<Strict, MemoryStore, Watched>>();
}

#[tokio::test]
async fn readiness_is_forwarded_and_the_ready_instance_is_called() {
    let open = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicUsize::new(0));
    let inner = Strict {
        open: open.clone(),
        ready: false,
        calls: calls.clone(),
    };
    let mut service = ServiceBuilder::new().layer(layer(2)).service(inner);
    let mut cx = Context::from_waker(Waker::noop());
    assert!(
        Service::<Request<Watched>>::poll_ready(&mut service, &mut cx).is_pending(),
        "the inner service is not ready"
    );
    open.store(true, Ordering::SeqCst);

    let polled = Arc::new(AtomicBool::new(false));
    for expected in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        let response = send(&mut service, &polled).await;
        assert_eq!(response.status(), expected);
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the refused request never reached it"
    );
    assert!(!polled.load(Ordering::SeqCst), "no body was read");
}

#[tokio::test]
async fn clones_share_one_limit() {
    let open = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicUsize::new(0));
    let inner = Strict {
        open,
        ready: false,
        calls,
    };
    let layer = layer(3);
    // Two services from one layer, and a clone of one of them.
    let a = ServiceBuilder::new()
        .layer(layer.clone())
        .service(inner.clone());
    let b = ServiceBuilder::new().layer(layer).service(inner);
    let c = a.clone();
    let polled = Arc::new(AtomicBool::new(false));
    let mut statuses = Vec::new();
    for service in [a.clone(), b.clone(), c.clone(), a, b, c] {
        statuses.push(service.oneshot(request(&polled)).await.unwrap().status());
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == StatusCode::OK).count(),
        3,
        "{statuses:?}"
    );
}

#[tokio::test]
async fn a_store_that_answers_later_gets_the_ready_instance_and_the_same_answers() {
    let (memory, _clock) = store();
    let late = support::LateStore::new(memory);
    let layer = RateLimitLayer::builder(late.clone())
        .rule(
            Rule::new("p")
                .key(PeerIp::new())
                .policy(Policy::fixed_window(2, Duration::from_secs(60)).unwrap()),
        )
        .rule(
            Rule::new("shadow")
                .key(PeerIp::new())
                .policy(Policy::fixed_window(1, Duration::from_secs(60)).unwrap())
                .shadow(),
        )
        .build()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let inner = Strict {
        open: Arc::new(AtomicBool::new(true)),
        ready: false,
        calls: calls.clone(),
    };
    let mut service = ServiceBuilder::new().layer(layer).service(inner);
    let polled = Arc::new(AtomicBool::new(false));
    let mut answers = Vec::new();
    for _ in 0..3 {
        let response = send(&mut service, &polled).await;
        answers.push((
            response.status(),
            response.headers().get("ratelimit").cloned(),
        ));
    }
    assert_eq!(answers[0].0, StatusCode::OK);
    assert_eq!(answers[0].1.as_ref().unwrap(), r#""p";r=1;t=60"#);
    assert_eq!(answers[1].0, StatusCode::OK);
    assert_eq!(answers[2].0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // Enforced and shadow checks for the two admitted requests, the enforced one for the third.
    assert_eq!(late.asked.load(Ordering::SeqCst), 5);
    assert!(!polled.load(Ordering::SeqCst));
}
