//! For the HTTP tests: a real axum server on a loopback port, a real HTTP client, a
//! store that fails, and the Structured Fields readers.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tollgate::clock::ManualClock;
use tollgate::store::BoxError;
use tollgate::{Check, Decision, MemoryStore, Store, StoreError};

/// A router answering "ok" on `/`, behind `layer`.
pub fn ok_app<St: Store>(layer: tollgate::RateLimitLayer<St>) -> Router {
    Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(layer)
}

/// A client of [`ok_app`] served on a free loopback port.
pub async fn ok_client<St: Store>(layer: tollgate::RateLimitLayer<St>) -> Client {
    Client::new(serve(ok_app(layer)).await)
}

/// Serves `app` on 127.0.0.1 (a free port), with `ConnectInfo<SocketAddr>`.
pub async fn serve(app: Router) -> SocketAddr {
    serve_on("127.0.0.1:0", app).await
}

/// Serves `app` on `addr`, with `ConnectInfo<SocketAddr>`.
pub async fn serve_on(addr: &str, app: Router) -> SocketAddr {
    serve_service_on(addr, app).await
}

/// Serves any service (a router, or a layer wrapped around one) on `addr`, with
/// `ConnectInfo<SocketAddr>`.
pub async fn serve_service_on<S>(addr: &str, service: S) -> SocketAddr
where
    S: tower::Service<
            axum::extract::Request,
            Response = axum::response::Response,
            Error = Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
{
    use axum::ServiceExt;
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let make = ServiceExt::<axum::extract::Request>::into_make_service_with_connect_info::<
        SocketAddr,
    >(service);
    tokio::spawn(async move { axum::serve(listener, make).await.unwrap() });
    addr
}

/// A response as the client saw it.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }

    /// `Retry-After` in seconds.
    pub fn retry_after(&self) -> Option<u64> {
        self.header("retry-after").map(|v| v.parse().unwrap())
    }

    /// The `RateLimit-Policy` list: name -> (q, w).
    pub fn policies(&self) -> BTreeMap<String, (i64, i64)> {
        let value = self.header("ratelimit-policy").expect("RateLimit-Policy");
        sf_list(value)
            .into_iter()
            .map(|(name, params)| (name, (params["q"], params["w"])))
            .collect()
    }

    /// The `RateLimit` item: (name, r, t).
    pub fn ratelimit(&self) -> (String, i64, i64) {
        let value = self.header("ratelimit").expect("RateLimit");
        let mut list = sf_list(value);
        assert_eq!(list.len(), 1, "one RateLimit item: {value}");
        let (name, params) = list.remove(0);
        assert_eq!(params.len(), 2, "r and t only: {value}");
        (name, params["r"], params["t"])
    }
}

/// Parses a Structured Fields List whose members are Strings with Integer parameters.
pub fn sf_list(value: &str) -> Vec<(String, BTreeMap<String, i64>)> {
    let list: sfv::List = sfv::Parser::new(value)
        .parse()
        .unwrap_or_else(|e| panic!("not a Structured Fields List: {value:?}: {e}"));
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = item
                    .bare_item
                    .as_string()
                    .unwrap_or_else(|| panic!("member is not a String: {value}"))
                    .as_str()
                    .to_owned();
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| {
                        let n = v
                            .as_integer()
                            .unwrap_or_else(|| panic!("{k} is not an Integer: {value}"));
                        (k.as_str().to_owned(), i64::from(n))
                    })
                    .collect();
                (name, params)
            }
            sfv::ListEntry::InnerList(_) => panic!("inner list in {value}"),
        })
        .collect()
}

/// A real HTTP/1.1 client.
#[derive(Clone)]
pub struct Client {
    inner: HyperClient<HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
}

impl Client {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            inner: HyperClient::builder(TokioExecutor::new()).build_http(),
            addr,
        }
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.send(http::Method::GET, path, &[]).await
    }

    pub async fn get_with(&self, path: &str, headers: &[(&str, &str)]) -> Answer {
        self.send(http::Method::GET, path, headers).await
    }

    pub async fn send(&self, method: http::Method, path: &str, headers: &[(&str, &str)]) -> Answer {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("http://{}{}", self.addr, path));
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        let request = request.body(Full::new(Bytes::new())).unwrap();
        let response = tokio::time::timeout(Duration::from_secs(30), self.inner.request(request))
            .await
            .expect("the server answers")
            .unwrap();
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }
}

/// An in-process store on a manual clock.
pub fn store() -> (MemoryStore<ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    (MemoryStore::with_clock(clock.clone()), clock)
}

/// A store whose backend is always down.
#[derive(Clone, Debug, Default)]
pub struct DownStore;

impl Store for DownStore {
    type Future = std::future::Ready<Result<Decision, StoreError>>;

    fn check_all(&self, _: &[Check<'_>]) -> Self::Future {
        let error: BoxError = "connection refused".into();
        std::future::ready(Err(StoreError::Backend(error)))
    }
}

/// A store that answers on the second poll, as a network store would: it wraps the in-process
/// store and counts how often it was asked.
#[derive(Clone, Debug)]
pub struct LateStore {
    pub inner: MemoryStore<ManualClock>,
    pub asked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl LateStore {
    pub fn new(inner: MemoryStore<ManualClock>) -> Self {
        Self {
            inner,
            asked: Default::default(),
        }
    }
}

/// Ready on the second poll (it wakes itself after the first).
pub struct Late(Option<Result<Decision, StoreError>>, bool);

impl std::future::Future for Late {
    type Output = Result<Decision, StoreError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        if !self.1 {
            self.1 = true;
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        std::task::Poll::Ready(self.0.take().expect("polled after completion"))
    }
}

impl Store for LateStore {
    type Future = Late;

    fn check_all(&self, checks: &[Check<'_>]) -> Late {
        self.asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Late(Some(self.inner.check_all_now(checks)), false)
    }
}
