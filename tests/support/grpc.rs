//! A tiny gRPC service written by hand (prost messages with derive, tonic's generic server and
//! client), so the tests need no `protoc`.
#![allow(dead_code, unreachable_pub)]

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::uri::PathAndQuery;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::Channel;
use tonic_prost::ProstCodec;
use tower::Service;

/// `message HelloRequest { string name = 1; }`
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloRequest {
    #[prost(string, tag = "1")]
    pub name: String,
}

/// `message HelloReply { string message = 1; }`
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloReply {
    #[prost(string, tag = "1")]
    pub message: String,
}

/// `service Greeter { rpc SayHello(HelloRequest) returns (HelloReply); }`
#[derive(Clone, Debug, Default)]
pub struct Greeter;

pub const SAY_HELLO: &str = "/demo.Greeter/SayHello";

impl NamedService for Greeter {
    const NAME: &'static str = "demo.Greeter";
}

struct SayHello;

impl tonic::server::UnaryService<HelloRequest> for SayHello {
    type Response = HelloReply;
    type Future = Ready<Result<tonic::Response<HelloReply>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<HelloRequest>) -> Self::Future {
        let name = request.into_inner().name;
        ready(Ok(tonic::Response::new(HelloReply {
            message: format!("hello {name}"),
        })))
    }
}

impl Service<http::Request<Body>> for Greeter {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        Box::pin(async move {
            if request.uri().path() == SAY_HELLO {
                let mut grpc =
                    tonic::server::Grpc::new(ProstCodec::<HelloReply, HelloRequest>::default());
                Ok(grpc.unary(SayHello, request).await)
            } else {
                Ok(tonic::Status::unimplemented("no such method").into_http())
            }
        })
    }
}

/// Calls `SayHello` on `addr`.
pub async fn say_hello(
    channel: Channel,
    name: &str,
    metadata: &[(&'static str, &str)],
) -> Result<tonic::Response<HelloReply>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unknown(e.to_string()))?;
    let mut request = tonic::Request::new(HelloRequest { name: name.into() });
    for (k, v) in metadata {
        request.metadata_mut().insert(*k, v.parse().unwrap());
    }
    grpc.unary(
        request,
        PathAndQuery::from_static(SAY_HELLO),
        ProstCodec::<HelloRequest, HelloReply>::default(),
    )
    .await
}

/// A channel to a server on `addr`.
pub async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}
