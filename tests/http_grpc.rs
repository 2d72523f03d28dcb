//! gRPC through a real tonic server and client over loopback: a limit is the status
//! `RESOURCE_EXHAUSTED` with a message and `grpc-retry-pushback-ms`, a failing store is
//! `UNAVAILABLE`, and admitted calls carry the rate-limit fields as metadata.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use http::request::Parts;
use support::grpc::{channel, greeter, say_hello};
use support::{DownStore, store};
use tollgate::key::KeyExtractor;
use tollgate::limiter::Rule;
use tollgate::{Policy, Rate, RateLimitLayer, Store};
use tonic::Code;
use tonic::transport::server::{TcpConnectInfo, TcpIncoming};

/// tonic puts the peer into the extensions as `TcpConnectInfo`; a closure makes it a key.
fn tonic_peer() -> impl KeyExtractor {
    |parts: &Parts| {
        let info = parts.extensions.get::<TcpConnectInfo>()?;
        Some(info.remote_addr()?.ip().to_string())
    }
}

/// Two calls per second per peer, bursts of two.
fn calls<St: Store>(store: St) -> RateLimitLayer<St> {
    RateLimitLayer::builder(store)
        .rule(
            Rule::new("calls")
                .key(tonic_peer())
                .policy(Policy::gcra(Rate::per_second(2), 2).unwrap()),
        )
        .build()
        .unwrap()
}

async fn serve_grpc<St: Store>(layer: RateLimitLayer<St>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .layer(layer)
            .add_service(greeter())
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    addr
}

#[tokio::test]
async fn a_limit_is_resource_exhausted_with_pushback() {
    let (store, clock) = store();
    let layer = calls(store);
    let channel = channel(serve_grpc(layer).await).await;

    let reply = say_hello(channel.clone(), "ada", &[]).await.unwrap();
    assert_eq!(reply.get_ref().message, "hello ada");
    // The fields arrive as metadata.
    let metadata = reply.metadata();
    assert_eq!(metadata.get("ratelimit").unwrap(), r#""calls";r=1;t=1"#);
    assert_eq!(
        metadata.get("ratelimit-policy").unwrap(),
        r#""calls";q=2;w=1"#
    );
    say_hello(channel.clone(), "ada", &[]).await.unwrap();

    let status = say_hello(channel.clone(), "ada", &[]).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("rate limit"),
        "{}",
        status.message()
    );
    assert!(status.message().contains("calls"), "{}", status.message());
    let pushback = status.metadata().get("grpc-retry-pushback-ms").unwrap();
    assert_eq!(pushback, "500");
    assert_eq!(
        status.metadata().get("ratelimit").unwrap(),
        r#""calls";r=0;t=1"#
    );

    clock.advance(Duration::from_millis(500));
    assert!(say_hello(channel, "ada", &[]).await.is_ok());
}

#[tokio::test]
async fn a_failing_store_is_unavailable() {
    let layer = calls(DownStore);
    let channel = channel(serve_grpc(layer).await).await;
    let status = say_hello(channel, "ada", &[]).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(
        status.metadata().get("grpc-retry-pushback-ms").unwrap(),
        "1000"
    );
}

#[tokio::test]
async fn per_api_key_metadata() {
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("key")
                .key(tollgate::key::Header::from_static("x-api-key"))
                .on_missing_key(tollgate::limiter::MissingKey::Reject(
                    http::StatusCode::UNAUTHORIZED,
                ))
                .policy(Policy::fixed_window(1, Duration::from_secs(60)).unwrap()),
        )
        .build()
        .unwrap();
    let channel = channel(serve_grpc(layer).await).await;
    let status = say_hello(channel.clone(), "x", &[]).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(
        say_hello(channel.clone(), "x", &[("x-api-key", "k1")])
            .await
            .is_ok()
    );
    assert!(
        say_hello(channel.clone(), "x", &[("x-api-key", "k2")])
            .await
            .is_ok()
    );
    let status = say_hello(channel, "x", &[("x-api-key", "k1")])
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
}

/// The service's code in `tests/support/demo.rs` is what tonic-prost-build generates from
/// `tests/proto/greeter.proto` (compiled by protox, so no `protoc`). `TOLLGATE_BLESS=1`
/// rewrites it.
#[test]
fn generated_code_is_current() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let descriptors = protox::compile([root.join("proto/greeter.proto")], [root.join("proto")])
        .unwrap_or_else(|e| panic!("greeter.proto: {e}"));
    let out = std::env::temp_dir().join(format!("tollgate-grpc-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    tonic_prost_build::configure()
        .out_dir(&out)
        .compile_fds(descriptors)
        .unwrap();
    let generated = std::fs::read_to_string(out.join("demo.rs")).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    let committed_path = root.join("support/demo.rs");
    if std::env::var_os("TOLLGATE_BLESS").is_some() {
        std::fs::write(&committed_path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    assert!(
        committed == generated,
        "tests/support/demo.rs is not what greeter.proto generates: rerun with TOLLGATE_BLESS=1"
    );
}
