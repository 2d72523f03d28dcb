//! `cargo run --example envoy_rls --features envoy -- --config examples/envoy/config`
//!
//! On Redis, shared by every instance: `--features envoy,redis` and `--redis redis://127.0.0.1:6379`.
//!
//! tollgate as Envoy's rate limit service: `envoy.service.ratelimit.v3.RateLimitService` over
//! gRPC on `--listen` (default `127.0.0.1:8081`), configured by envoyproxy/ratelimit's YAML
//! files (`--config`: one file, or a folder whose `*.yaml` / `*.yml` files are all read), with
//! `grpc.health.v1` health checking for Envoy's cluster. `--headers ietf|legacy|both|off`
//! (default `off`) asks Envoy to add tollgate's rate-limit fields to its responses.
//!
//! SIGHUP reads the configuration again (a configuration with problems is reported and the
//! running one kept; counters of unchanged limits carry on). Ctrl-C or SIGTERM: the health
//! service reports NOT_SERVING, calls in flight finish, and the server exits.
//! `examples/envoy/envoy.yaml` is the Envoy side.

use std::error::Error;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use tokio::net::TcpListener;
use tollgate::Store;
use tollgate::answer::HeaderProfile;
use tollgate::envoy::proto::rate_limit_service_server::RateLimitServiceServer;
use tollgate::envoy::{Config, RateLimitService};
use tonic::transport::server::TcpIncoming;

/// The command line.
#[derive(Debug)]
struct Args {
    config: PathBuf,
    listen: SocketAddr,
    redis: Option<String>,
    headers: HeaderProfile,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut config = None;
    let mut listen = SocketAddr::from(([127, 0, 0, 1], 8081));
    let mut redis = None;
    let mut headers = HeaderProfile::Off;
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--config" => config = Some(PathBuf::from(value()?)),
            "--listen" => listen = value()?.parse().map_err(|e| format!("--listen: {e}"))?,
            "--redis" => redis = Some(value()?),
            "--headers" => {
                headers = match value()?.as_str() {
                    "ietf" => HeaderProfile::Ietf,
                    "legacy" => HeaderProfile::Legacy,
                    "both" => HeaderProfile::Both,
                    "off" => HeaderProfile::Off,
                    other => {
                        return Err(format!("--headers: ietf, legacy, both or off, not {other}"));
                    }
                }
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(Args {
        config: config.ok_or("--config FILE_OR_FOLDER is required")?,
        listen,
        redis,
        headers,
    })
}

/// Reads one YAML file, or every `*.yaml` / `*.yml` file of a folder (in name order).
fn load(path: &Path) -> Result<Config, Box<dyn Error>> {
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
            .collect();
        files.sort();
        files
    } else {
        vec![path.to_owned()]
    };
    let texts = files
        .iter()
        .map(|f| Ok((f.display().to_string(), std::fs::read_to_string(f)?)))
        .collect::<Result<Vec<_>, std::io::Error>>()?;
    Ok(Config::from_files(
        texts.iter().map(|(n, t)| (n.as_str(), t.as_str())),
    )?)
}

/// Serves until `shutdown` completes, then drains: the health service says NOT_SERVING first.
async fn serve<S: Store>(
    service: RateLimitService<S>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Box<dyn Error + Send + Sync>> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<RateLimitServiceServer<RateLimitService<S>>>()
        .await;
    let drain = async move {
        shutdown.await;
        reporter
            .set_not_serving::<RateLimitServiceServer<RateLimitService<S>>>()
            .await;
    };
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), drain)
        .await?;
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn stop_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!("shutting down: finishing the calls in flight");
}

/// Reads the configuration again on every SIGHUP.
fn reload_on_hangup<S: Store>(service: RateLimitService<S>, path: PathBuf) {
    tokio::spawn(async move {
        let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        else {
            return;
        };
        while hup.recv().await.is_some() {
            match load(&path) {
                Ok(config) => {
                    service.set_config(config);
                    eprintln!("configuration reloaded from {}", path.display());
                }
                Err(e) => eprintln!("configuration kept: {e}"),
            }
        }
    });
}

async fn run<S: Store>(store: S, args: Args) -> Result<(), Box<dyn Error>> {
    let config = load(&args.config)?;
    let service = RateLimitService::new(store, config).headers(args.headers);
    reload_on_hangup(service.clone(), args.config.clone());
    let listener = TcpListener::bind(args.listen).await?;
    eprintln!("Envoy rate limit service on {}", listener.local_addr()?);
    serve(service, listener, stop_signal())
        .await
        .map_err(|e| e as Box<dyn Error>)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args = parse_args(std::env::args().skip(1))?;
    match args.redis.clone() {
        None => run(tollgate::MemoryStore::new(), args).await,
        #[cfg(feature = "redis")]
        Some(url) => run(tollgate::RedisStore::connect(&url).await?, args).await,
        #[cfg(not(feature = "redis"))]
        Some(_) => Err("--redis needs tollgate's feature `redis`: --features envoy,redis".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate::MemoryStore;
    use tollgate::envoy::proto::rate_limit_descriptor::Entry;
    use tollgate::envoy::proto::rate_limit_service_client::RateLimitServiceClient;
    use tollgate::envoy::proto::{RateLimitDescriptor, RateLimitRequest};
    use tonic::transport::Channel;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    const SHIPPED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/envoy/config");

    #[test]
    fn the_command_line_is_read() {
        let args = |a: &[&str]| parse_args(a.iter().map(|s| s.to_string()));
        let a = args(&[
            "--config",
            "x.yaml",
            "--listen",
            "0.0.0.0:9",
            "--headers",
            "both",
        ])
        .unwrap();
        assert_eq!(
            (a.config, a.listen.port(), a.headers),
            (PathBuf::from("x.yaml"), 9, HeaderProfile::Both)
        );
        assert!(args(&[]).unwrap_err().contains("--config"));
        assert!(args(&["--config", "x", "--headers", "loud"]).is_err());
    }

    #[test]
    fn the_shipped_configuration_reads_as_a_folder_and_as_files() {
        let config = load(Path::new(SHIPPED)).unwrap();
        let mut domains: Vec<_> = config.domains().collect();
        domains.sort_unstable();
        assert_eq!(domains, ["edge", "messaging"]);
        load(&Path::new(SHIPPED).join("edge.yaml")).unwrap();
    }

    #[tokio::test]
    async fn it_serves_health_and_should_rate_limit_and_stops_when_told() {
        let service = RateLimitService::new(MemoryStore::new(), load(Path::new(SHIPPED)).unwrap());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(service, listener, async move {
            let _ = stopped.await;
        }));
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let health = HealthClient::new(channel.clone())
            .check(HealthCheckRequest {
                service: "envoy.service.ratelimit.v3.RateLimitService".into(),
            })
            .await
            .unwrap();
        assert_eq!(health.into_inner().status(), ServingStatus::Serving);

        let mut client = RateLimitServiceClient::new(channel);
        let request = RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "remote_address".into(),
                    value: "50.0.0.5".into(),
                }],
                ..Default::default()
            }],
            hits_addend: 0,
        };
        let answer = client
            .should_rate_limit(request)
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            answer.overall_code, 2,
            "OVER_LIMIT: that address gets nothing"
        );

        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }
}
