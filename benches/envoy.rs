//! tollgate as Envoy's rate limit service: `ShouldRateLimit` calls per second over loopback
//! gRPC, 64 concurrent callers (Envoy's side), on the in-process store and on Redis, beside
//! the same service called in process and `redis-benchmark`'s ceiling for the script it runs.
//!
//! `cargo bench --features envoy,redis --bench envoy` starts its own `redis-server` on a free
//! loopback port and prints, in about half a minute:
//! - the service called in process (no gRPC), on `MemoryStore`;
//! - over gRPC: `MemoryStore`; `RedisStore` and `LeasedStore` on one hot descriptor (a GCRA
//!   limit nobody reaches, so every call is an admission);
//! - `redis-benchmark` EVALSHA of the GCRA check script on one key (64 clients, pipeline 16).
//!
//! envoyproxy/ratelimit (Go) is not run beside it: no Go toolchain can be installed here.
//! Knobs: `TOLLGATE_BENCH_THREADS` (tokio workers, default 2), `TOLLGATE_BENCH_SECS` (seconds
//! a row, default 3).

#[path = "redis_support/mod.rs"]
mod redis_support;
#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use redis_support::{ceiling, cpu_time_us, script_calls};
use tokio::net::TcpListener;
use tollgate::clock::{Clock, SystemClock};
use tollgate::envoy::proto::rate_limit_descriptor::Entry;
use tollgate::envoy::proto::rate_limit_service_client::RateLimitServiceClient;
use tollgate::envoy::proto::{RateLimitDescriptor, RateLimitRequest};
use tollgate::envoy::{Config, RateLimitService};
use tollgate::store::redis::{LeasedStore, RedisStore};
use tollgate::{MemoryStore, Policy, Rate, Store};
use tonic::transport::Channel;
use tonic::transport::server::TcpIncoming;

const CALLERS: usize = 64;

/// One hot descriptor whose limit is never reached: every call is an admission.
const CONFIG: &str = "domain: bench
descriptors:
  - key: tenant
    rate_limit: { unit: second, requests_per_unit: 100000000, algorithm: gcra, burst: 10000000 }
";

fn request() -> RateLimitRequest {
    RateLimitRequest {
        domain: "bench".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "tenant".into(),
                value: "hot".into(),
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

struct Figures {
    per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    cpu_us: f64,
}

/// `CALLERS` tasks for `run`, each calling `call` again and again; their latencies, this
/// process's CPU per call (server and callers alike).
async fn drive<F, Fut>(run: Duration, call: F) -> Figures
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let clock = SystemClock::new();
    let cpu = cpu_time_us();
    let start = clock.now();
    let end = start + u64::try_from(run.as_nanos()).unwrap_or(u64::MAX);
    let tasks: Vec<_> = (0..CALLERS)
        .map(|_| {
            let call = call.clone();
            tokio::spawn(async move {
                let clock = SystemClock::new();
                let mut lat = Vec::new();
                while clock.now() < end {
                    let t = clock.now();
                    call().await;
                    lat.push(clock.now() - t);
                }
                lat
            })
        })
        .collect();
    let mut lat = Vec::new();
    for task in tasks {
        lat.extend(task.await.expect("caller"));
    }
    let secs = (clock.now() - start) as f64 / 1e9;
    lat.sort_unstable();
    let at = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)] as f64 / 1e3;
    Figures {
        per_sec: lat.len() as f64 / secs,
        p50_us: at(0.5),
        p99_us: at(0.99),
        cpu_us: (cpu_time_us() - cpu) / lat.len() as f64,
    }
}

/// Serves `service` on a free loopback port; a client on one HTTP/2 connection (as Envoy's
/// `rate_limit_cluster` with one host).
async fn serve<S: Store>(service: RateLimitService<S>) -> RateLimitServiceClient<Channel> {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(TcpIncoming::from(listener).with_nodelay(Some(true)))
            .await
            .expect("serve");
    });
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    RateLimitServiceClient::new(channel)
}

async fn over_grpc<S: Store>(service: RateLimitService<S>, run: Duration) -> Figures {
    let client = serve(service).await;
    drive(run, move || {
        let mut client = client.clone();
        async move {
            let answer = client.should_rate_limit(request()).await.expect("answer");
            assert_eq!(answer.into_inner().overall_code, 1, "admitted");
        }
    })
    .await
}

fn main() {
    let Some(server) = support::RedisServer::start() else {
        return;
    };
    let threads: usize = std::env::var("TOLLGATE_BENCH_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let run = Duration::from_secs(
        std::env::var("TOLLGATE_BENCH_SECS")
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or(3),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let config = || Config::from_yaml(CONFIG).expect("config");
        let redis = |prefix: &'static str| {
            RedisStore::builder()
                .url(server.url())
                .prefix(prefix)
                .timeout(Duration::from_secs(5))
                .connect()
        };
        println!(
            "{threads} tokio workers, {CALLERS} callers, {} s a row, one hot descriptor (GCRA, never reached)\n",
            run.as_secs()
        );
        println!("| path | store | calls/s | p50 | p99 | CPU per call (client and server) |");
        println!("| --- | --- | ---: | ---: | ---: | ---: |");
        let row = |path: &str, store: &str, f: &Figures| {
            println!(
                "| {path} | {store} | {:.0} | {:.0} µs | {:.0} µs | {:.1} µs |",
                f.per_sec, f.p50_us, f.p99_us, f.cpu_us
            );
        };
        let local = Arc::new(RateLimitService::new(MemoryStore::new(), config()));
        let f = drive(run, move || {
            let local = Arc::clone(&local);
            async move {
                let answer = local.decide(&request()).await.expect("answer");
                assert_eq!(answer.overall_code, 1, "admitted");
            }
        })
        .await;
        row("in process (`decide`)", "MemoryStore", &f);
        let f = over_grpc(RateLimitService::new(MemoryStore::new(), config()), run).await;
        row("gRPC, loopback", "MemoryStore", &f);
        let plain = redis("plain:").await.expect("connect");
        let policy = Policy::gcra(Rate::per_second(100_000_000), 10_000_000).expect("policy");
        let sha = plain.check_script_sha(policy.algorithm()).to_owned();
        let before = script_calls(&server);
        let f = over_grpc(RateLimitService::new(plain, config()), run).await;
        let plain_calls = script_calls(&server) - before;
        row("gRPC, loopback", "RedisStore", &f);
        let leased = LeasedStore::new(redis("leased:").await.expect("connect"));
        let before = script_calls(&server);
        let f = over_grpc(RateLimitService::new(leased, config()), run).await;
        let leased_calls = script_calls(&server) - before;
        row("gRPC, loopback", "LeasedStore", &f);
        println!(
            "\nscripts Redis ran: {plain_calls} without leases, {leased_calls} with them ({} s each)",
            run.as_secs()
        );
        let top = ceiling(server.port, &sha, &policy, 0);
        println!(
            "\nceiling: redis-benchmark EVALSHA of the gcra script, one key, -c 64 -P 16: {top:.0}/s"
        );
    });
}
