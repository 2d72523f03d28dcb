//! cargo run --example tonic --features tonic
//!
//! A tonic gRPC server behind tollgate's layer, and a tonic client calling it until it is
//! limited: the client sees the status `RESOURCE_EXHAUSTED` with the wait in
//! `grpc-retry-pushback-ms`. The service is written without code generation (prost messages by
//! hand), so no `protoc` is needed. Runs on loopback and exits.

#[path = "../tests/support/grpc.rs"]
mod grpc;

use http::request::Parts;
use tollgate::limiter::Rule;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
use tonic::transport::server::{TcpConnectInfo, TcpIncoming};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // tonic puts the peer address into the request extensions as TcpConnectInfo.
    let peer = |parts: &Parts| {
        let info = parts.extensions.get::<TcpConnectInfo>()?;
        Some(info.remote_addr()?.ip().to_string())
    };
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::new("calls")
                .key(peer)
                .policy(Policy::gcra(Rate::per_second(2), 3)?.named("calls-per-second")?),
        )
        .build()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .layer(layer)
            .add_service(grpc::Greeter)
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
    });

    let channel = grpc::channel(addr).await;
    println!("limit: 2 calls per second, bursts of 3\n");
    for i in 1..=5 {
        match grpc::say_hello(channel.clone(), "world", &[]).await {
            Ok(reply) => {
                let ratelimit = reply
                    .metadata()
                    .get("ratelimit")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-")
                    .to_owned();
                println!(
                    "{i}: OK {:?}  ratelimit: {ratelimit}",
                    reply.into_inner().message
                );
            }
            Err(status) => {
                let pushback = status
                    .metadata()
                    .get("grpc-retry-pushback-ms")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-");
                println!(
                    "{i}: {:?} {:?}  retry in {pushback} ms",
                    status.code(),
                    status.message()
                );
            }
        }
    }
    Ok(())
}
