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
//! `--metrics 127.0.0.1:9102` serves Prometheus text on `http://127.0.0.1:9102/metrics`: the
//! `tollgate_envoy_*` metrics (hits per domain, descriptor and outcome; calls; store errors;
//! reloads) and the store's.
//!
//! The configuration is read again when its files change (checked every second, or
//! `--watch-every 500ms`; a change is applied once two looks in a row agree) and on SIGHUP. A
//! configuration with problems is reported, each with its path, and the running one kept;
//! counters of unchanged limits carry on. Ctrl-C or SIGTERM: the health service reports
//! NOT_SERVING, calls in flight finish, and the server exits (it stops accepting connections
//! at once, so take an instance out of Envoy's cluster before stopping it: health checks do
//! not get the time to see NOT_SERVING). `examples/envoy/envoy.yaml` is
//! the Envoy side.
//!
//! ```text
//! grpcurl -plaintext -d '{"domain":"edge","descriptors":[{"entries":[{"key":"remote_address","value":"10.0.0.1"}]}]}' \
//!   127.0.0.1:8081 envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit
//! curl -s 127.0.0.1:9102/metrics | grep tollgate_envoy_
//! ```

use std::error::Error;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tollgate::Store;
use tollgate::answer::HeaderProfile;
use tollgate::envoy::proto::rate_limit_service_server::RateLimitServiceServer;
use tollgate::envoy::{Config, ConfigError, RateLimitService};
use tonic::transport::server::TcpIncoming;

#[path = "common/prometheus.rs"]
mod prometheus;
pub use prometheus::prometheus;

/// The command line.
#[derive(Debug)]
struct Args {
    config: PathBuf,
    listen: SocketAddr,
    redis: Option<String>,
    headers: HeaderProfile,
    metrics: Option<SocketAddr>,
    watch_every: Duration,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut config = None;
    let mut listen = SocketAddr::from(([127, 0, 0, 1], 8081));
    let mut redis = None;
    let mut headers = HeaderProfile::Off;
    let mut metrics = None;
    let mut watch_every = Duration::from_secs(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--config" => config = Some(PathBuf::from(value()?)),
            "--listen" => listen = value()?.parse().map_err(|e| format!("--listen: {e}"))?,
            "--redis" => redis = Some(value()?),
            "--metrics" => metrics = Some(value()?.parse().map_err(|e| format!("--metrics: {e}"))?),
            "--watch-every" => {
                let text = value()?;
                let (number, unit) = match text.strip_suffix("ms") {
                    Some(n) => (n, Duration::from_millis(1)),
                    None => (text.strip_suffix('s').unwrap_or(""), Duration::from_secs(1)),
                };
                watch_every = number
                    .parse::<u32>()
                    .ok()
                    .filter(|n| *n > 0)
                    .map(|n| unit * n)
                    .ok_or(format!("--watch-every: 500ms or 2s, not {text}"))?;
            }
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
        metrics,
        watch_every,
    })
}

/// Reads one YAML file, or every `*.yaml` / `*.yml` file of a folder (in name order).
fn load(path: &Path) -> Result<Config, ConfigError> {
    Config::from_path(path)
}

/// The largest configuration file the watcher reads (a bigger one reads as unreadable).
const MAX_FILE: u64 = 16 << 20;

/// What the configuration's files hold now: each `*.yaml` / `*.yml` file of the folder (or the
/// one file) with its content, in name order; a file that cannot be read holds nothing, and
/// so does anything that is not a regular file (a FIFO would block the read, a device never
/// end it) or is larger than [`MAX_FILE`].
fn snapshot(path: &Path) -> Vec<(PathBuf, Option<Vec<u8>>)> {
    let files = if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
            .collect();
        files.sort();
        files
    } else {
        vec![path.to_owned()]
    };
    files
        .into_iter()
        .map(|f| {
            let readable = std::fs::metadata(&f).is_ok_and(|m| m.is_file() && m.len() <= MAX_FILE);
            let content = readable.then(|| std::fs::read(&f).ok()).flatten();
            (f, content)
        })
        .collect()
}

/// Watches the configuration's files for changes, one look at a time.
#[derive(Debug)]
struct Watch {
    path: PathBuf,
    /// What the running configuration was read from.
    applied: Vec<(PathBuf, Option<Vec<u8>>)>,
    /// A change seen at the last look, not yet applied.
    seen: Option<Vec<(PathBuf, Option<Vec<u8>>)>>,
}

impl Watch {
    fn new(path: PathBuf) -> Self {
        let applied = snapshot(&path);
        Watch {
            path,
            applied,
            seen: None,
        }
    }

    /// One look: when the files differ from what the running configuration was read from, and
    /// the last look saw them as they are now (a file caught while an editor writes it can be
    /// valid YAML; replacing files by a rename is atomic and best), the configuration is read
    /// again and put in place, or refused and the running one kept. `None`: nothing to do.
    fn poll<S: Store>(&mut self, service: &RateLimitService<S>) -> Option<Result<(), ConfigError>> {
        let now = snapshot(&self.path);
        if now == self.applied {
            self.seen = None;
            return None;
        }
        if self.seen.as_ref() != Some(&now) {
            self.seen = Some(now);
            return None;
        }
        self.seen = None;
        // A refused configuration is not tried again until the files change again.
        self.applied = now;
        Some(service.reload_from(&self.path))
    }
}

/// Says what a reload did.
fn report(path: &Path, why: &str, result: &Result<(), ConfigError>) {
    match result {
        Ok(()) => eprintln!("configuration reloaded from {} ({why})", path.display()),
        Err(e) => eprintln!("configuration kept ({why}): {e}"),
    }
}

/// Looks at the configuration's files every `every` and reloads when they changed; sends each
/// reload's result on `done` (and stops when nobody listens).
async fn watch<S: Store>(
    service: RateLimitService<S>,
    mut watch: Watch,
    every: Duration,
    done: tokio::sync::mpsc::UnboundedSender<bool>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Some(result) = watch.poll(&service) {
            report(&watch.path, "the files changed", &result);
            if done.send(result.is_ok()).is_err() {
                return;
            }
        }
    }
}

/// Serves `GET /metrics` (Prometheus text) on `listener`, for good.
async fn serve_metrics(listener: TcpListener, metrics: PrometheusHandle) -> std::io::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || std::future::ready(metrics.render())),
    );
    axum::serve(listener, app).await
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
        .serve_with_incoming_shutdown(TcpIncoming::from(listener).with_nodelay(Some(true)), drain)
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
    // Installed here, before the task runs: a SIGHUP with no handler yet ends the process.
    let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else {
        eprintln!("SIGHUP cannot be handled: the configuration is reloaded on changes only");
        return;
    };
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            report(&path, "SIGHUP", &service.reload_from(&path));
        }
    });
}

async fn run<S: Store>(store: S, args: Args) -> Result<(), Box<dyn Error>> {
    // The files as they are before they are read: a change made while they are read is seen.
    let watcher = Watch::new(args.config.clone());
    let config = load(&args.config)?;
    let service = RateLimitService::new(store, config).headers(args.headers);
    reload_on_hangup(service.clone(), args.config.clone());
    let (done, mut reports) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(watch(service.clone(), watcher, args.watch_every, done));
    tokio::spawn(async move { while reports.recv().await.is_some() {} });
    let listener = TcpListener::bind(args.listen).await?;
    eprintln!("Envoy rate limit service on {}", listener.local_addr()?);
    serve(service, listener, stop_signal())
        .await
        .map_err(|e| e as Box<dyn Error>)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args = parse_args(std::env::args().skip(1))?;
    // The recorder before the store and the service: they register their metrics when built.
    if let Some(addr) = args.metrics {
        let metrics = prometheus()?;
        let listener = TcpListener::bind(addr).await?;
        eprintln!("metrics on http://{}/metrics", listener.local_addr()?);
        tokio::spawn(serve_metrics(listener, metrics));
    }
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
        let a = args(&[
            "--config",
            "x",
            "--metrics",
            "127.0.0.1:9102",
            "--watch-every",
            "250ms",
        ])
        .unwrap();
        assert_eq!(a.metrics, Some(SocketAddr::from(([127, 0, 0, 1], 9102))));
        assert_eq!(a.watch_every, Duration::from_millis(250));
        assert_eq!(
            args(&["--config", "x", "--watch-every", "2s"])
                .unwrap()
                .watch_every,
            Duration::from_secs(2)
        );
        assert_eq!(
            args(&["--config", "x"]).unwrap().watch_every,
            Duration::from_secs(1)
        );
        for bad in ["0s", "1h", "", "ms"] {
            assert!(
                args(&["--config", "x", "--watch-every", bad]).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_shipped_configuration_reads_as_a_folder_and_as_files() {
        let config = load(Path::new(SHIPPED)).unwrap();
        let mut domains: Vec<_> = config.domains().collect();
        domains.sort_unstable();
        assert_eq!(domains, ["edge", "messaging"]);
        load(&Path::new(SHIPPED).join("edge.yaml")).unwrap();
    }

    /// `GET /metrics` over a plain HTTP/1.0 connection: the status line and the body.
    async fn scrape(addr: SocketAddr) -> (String, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await.unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        (head.lines().next().unwrap().to_owned(), body.to_owned())
    }

    #[tokio::test]
    async fn it_serves_health_should_rate_limit_and_metrics_and_stops_when_told() {
        // The recorder first: the service registers its metrics when built.
        let metrics = prometheus().unwrap();
        let metrics_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics_addr = metrics_listener.local_addr().unwrap();
        tokio::spawn(serve_metrics(metrics_listener, metrics));
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

        // The recorder is the process's: other tests' calls may add to these series.
        let (status, text) = scrape(metrics_addr).await;
        assert_eq!(status, "HTTP/1.0 200 OK");
        assert!(text.contains("# HELP tollgate_envoy_hits_total"), "{text}");
        for series in [
            r#"tollgate_envoy_hits_total{domain="edge",descriptor="remote_address_50.0.0.5",outcome="over_limit"}"#,
            r#"tollgate_envoy_calls_total{domain="edge",result="over_limit"}"#,
        ] {
            let value = text
                .lines()
                .find_map(|line| line.strip_prefix(series))
                .and_then(|v| v.trim().parse::<f64>().ok());
            assert!(value.is_some_and(|v| v >= 1.0), "{series} in\n{text}");
        }

        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }

    fn edge_request(address: &str) -> RateLimitRequest {
        RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "remote_address".into(),
                    value: address.into(),
                }],
                ..Default::default()
            }],
            hits_addend: 0,
        }
    }

    /// A folder of its own holding a copy of the shipped configuration.
    fn config_copy(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("tollgate-envoy-rls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for file in ["edge.yaml", "messaging.yaml"] {
            std::fs::copy(Path::new(SHIPPED).join(file), dir.join(file)).unwrap();
        }
        dir
    }

    /// A changed file is applied once two looks agree; a broken one is refused and the
    /// running limits, and their counts, stay; a mended one is applied.
    #[tokio::test]
    async fn a_change_of_the_files_is_reloaded_and_a_broken_one_refused() {
        let dir = config_copy("poll");
        // A manual clock: the one-second windows stay where they are.
        let store = MemoryStore::with_clock(tollgate::clock::ManualClock::new());
        let service = RateLimitService::new(store, load(&dir).unwrap());
        let mut watch = Watch::new(dir.clone());
        assert!(watch.poll(&service).is_none(), "nothing changed");
        let remaining = |answer: tollgate::envoy::proto::RateLimitResponse| {
            (answer.overall_code, answer.statuses[0].limit_remaining)
        };
        let a = edge_request("10.0.0.1");
        assert_eq!(remaining(service.decide(&a).await.unwrap()), (1, 9));

        // Another address limit in a new file of the folder, and 50.0.0.5 let in.
        let edge = std::fs::read_to_string(dir.join("edge.yaml")).unwrap();
        let shipped = edge.clone();
        std::fs::write(
            dir.join("edge.yaml"),
            edge.replace("requests_per_unit: 0", "requests_per_unit: 3"),
        )
        .unwrap();
        assert!(
            watch.poll(&service).is_none(),
            "first look: wait for a second"
        );
        assert!(matches!(watch.poll(&service), Some(Ok(()))));
        assert!(watch.poll(&service).is_none(), "applied once");
        let blocked = edge_request("50.0.0.5");
        assert_eq!(remaining(service.decide(&blocked).await.unwrap()), (1, 2));
        assert_eq!(
            remaining(service.decide(&a).await.unwrap()),
            (1, 8),
            "an unchanged limit keeps its count"
        );

        // A broken file: refused, with its path; the running limits stay.
        std::fs::write(
            dir.join("zz.yaml"),
            "domain: edge\ndescriptors: [{ key: x, rate_limit: { unit: fortnight } }]\n",
        )
        .unwrap();
        assert!(watch.poll(&service).is_none());
        let refused = watch.poll(&service).unwrap().unwrap_err();
        let text = refused.to_string();
        assert!(text.contains("zz.yaml"), "{text}");
        assert!(text.contains("fortnight"), "{text}");
        assert!(
            watch.poll(&service).is_none(),
            "not tried again until the files change"
        );
        assert_eq!(remaining(service.decide(&blocked).await.unwrap()), (1, 1));
        assert_eq!(remaining(service.decide(&a).await.unwrap()), (1, 7));

        // Mended: the shipped file again, without the broken one.
        std::fs::remove_file(dir.join("zz.yaml")).unwrap();
        std::fs::write(dir.join("edge.yaml"), shipped).unwrap();
        watch.poll(&service);
        assert!(matches!(watch.poll(&service), Some(Ok(()))));
        assert_eq!(service.decide(&blocked).await.unwrap().overall_code, 2);
        assert_eq!(remaining(service.decide(&a).await.unwrap()), (1, 6));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// What is not a regular file (a FIFO, a device behind a symlink) is not read: it reads
    /// as an unreadable file, as a folder does.
    #[cfg(unix)]
    #[test]
    fn the_watcher_reads_regular_files_only() {
        let dir = config_copy("special");
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero.yaml")).unwrap();
        std::fs::create_dir(dir.join("folder.yaml")).unwrap();
        let seen = snapshot(&dir);
        let of = |name: &str| seen.iter().find(|(p, _)| p.ends_with(name)).map(|(_, c)| c);
        assert_eq!(of("zero.yaml"), Some(&None));
        assert_eq!(of("folder.yaml"), Some(&None));
        assert!(of("edge.yaml").is_some_and(Option::is_some));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The watcher's loop looks every `every`, on tokio's paused time.
    #[tokio::test(start_paused = true)]
    async fn the_watcher_looks_every_interval() {
        let dir = config_copy("loop");
        let service = RateLimitService::new(MemoryStore::new(), load(&dir).unwrap());
        let (done, mut reports) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(watch(
            service.clone(),
            Watch::new(dir.clone()),
            Duration::from_secs(1),
            done,
        ));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            reports.try_recv().is_err(),
            "nothing changed, nothing reloaded"
        );
        let edge = std::fs::read_to_string(dir.join("edge.yaml")).unwrap();
        std::fs::write(
            dir.join("edge.yaml"),
            edge.replace("requests_per_unit: 0", "requests_per_unit: 3"),
        )
        .unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(reports.recv().await, Some(true));
        assert!(
            started.elapsed() <= Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        let blocked = edge_request("50.0.0.5");
        assert_eq!(service.decide(&blocked).await.unwrap().overall_code, 1);
        std::fs::remove_dir_all(&dir).ok();
    }
}
