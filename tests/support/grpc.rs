//! The tests' and the example's gRPC service: `tests/proto/greeter.proto`, with the server and
//! client tonic-prost-build generated from it (`demo.rs`, checked by
//! `generated_code_is_current`; protox compiles the proto, so no `protoc` is needed).
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;

use tonic::transport::Channel;

#[allow(
    clippy::all,
    missing_docs,
    missing_debug_implementations,
    unreachable_pub
)]
mod demo {
    include!("demo.rs");
}

pub use demo::greeter_client::GreeterClient;
pub use demo::greeter_server::GreeterServer;
pub use demo::{HelloReply, HelloRequest};

/// The service: says hello.
#[derive(Clone, Debug, Default)]
pub struct Hello;

#[tonic::async_trait]
impl demo::greeter_server::Greeter for Hello {
    async fn say_hello(
        &self,
        request: tonic::Request<HelloRequest>,
    ) -> Result<tonic::Response<HelloReply>, tonic::Status> {
        let name = request.into_inner().name;
        Ok(tonic::Response::new(HelloReply {
            message: format!("hello {name}"),
        }))
    }
}

/// The generated server around [`Hello`].
pub fn greeter() -> GreeterServer<Hello> {
    GreeterServer::new(Hello)
}

/// Calls `SayHello` on `channel` with the generated client.
pub async fn say_hello(
    channel: Channel,
    name: &str,
    metadata: &[(&'static str, &str)],
) -> Result<tonic::Response<HelloReply>, tonic::Status> {
    let mut request = tonic::Request::new(HelloRequest { name: name.into() });
    for (k, v) in metadata {
        request.metadata_mut().insert(*k, v.parse().unwrap());
    }
    GreeterClient::new(channel).say_hello(request).await
}

/// A channel to a server on `addr`.
pub async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}
