//! `cargo run --example server -- --config examples/server/tollgate.toml`
//!
//! On Redis (the limits shared by several instances): `kind = "redis"` and a `url` in the
//! file's `[store]` (its comments show how), and tollgate's feature `redis`:
//! `cargo run --example server --features redis -- --config my-tollgate.toml`. Without the
//! feature, such a file is refused at start (`store.kind: the Redis store needs tollgate's
//! feature `redis``).
//!
//! A small API protected entirely by a configuration file (`examples/server/tollgate.toml`):
//! load shedding, rate limits per client address, per API key and plan, per user, and a
//! concurrency limit on exports. It serves:
//!
//! - `GET /`: a greeting; `POST /login`: 5 attempts per 15 minutes per address;
//! - `GET /search?q=..`: needs `x-api-key` (keys starting `pro-` are on the pro plan);
//! - `GET /export`: needs `authorization: Bearer <user>`, costs 10, takes 300 ms;
//! - `GET /health` and `GET /metrics` (Prometheus text), never limited.
//!
//! The configuration is reloaded on `SIGHUP` and when the file changes (checked every
//! second); a file with a problem is refused, the log names each bad field, and the running
//! limits stay. Options: `--config PATH`, `--addr 127.0.0.1:3000`, `--watch-every 1s`.
//! Logs go to stderr (`RUST_LOG=tollgate=debug` shows every decision).
//!
//! Try it:
//!
//! ```text
//! for i in $(seq 7); do curl -si -X POST localhost:3000/login | head -1; done
//! curl -si localhost:3000/search?q=x -H 'x-api-key: pro-123'
//! curl -s localhost:3000/metrics | grep tollgate_
//! ```

use std::error::Error;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::routing::{get, post};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::mpsc;
use tollgate::config::{Bindings, Config, ConfigErrors, ConfiguredStore, Reloader};
use tower::util::MapRequestLayer;

#[path = "../common/prometheus.rs"]
mod prometheus;
pub use prometheus::prometheus;

/// The signed-in user, as the authentication layer found it.
#[derive(Clone, Debug)]
pub struct User(pub String);

impl std::fmt::Display for User {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stand-in for real authentication: `Authorization: Bearer <user>` signs in `<user>`.
fn authenticate(mut request: Request) -> Request {
    let user = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .filter(|user| !user.is_empty() && user.len() <= 64)
        .map(|user| User(user.to_owned()));
    if let Some(user) = user {
        request.extensions_mut().insert(user);
    }
    request
}

/// What the file cannot say: where the user comes from, and how a key's plan is found.
pub fn bindings() -> Bindings {
    Bindings::new()
        .key("user", tollgate::key::Extension::<User>::new())
        .resolver("plans", |key: String| async move {
            // A real service asks its database here (the answer is cached per key).
            key.starts_with("pro-").then(|| "pro".to_owned())
        })
}

/// The application: the router behind the configured layers, and the reloader of its rate
/// limits.
#[derive(Debug)]
pub struct App {
    /// `/health` and `/metrics`, then everything else behind the limits.
    pub router: Router,
    /// Swaps the rate limits.
    pub reloader: Reloader<ConfiguredStore>,
}

/// Builds the application from the configuration at `path`.
pub async fn app(path: &Path, metrics: PrometheusHandle) -> Result<App, ConfigErrors> {
    let config = Config::from_toml_file(path)?;
    let bindings = bindings();
    let store = config.store().await?;
    let concurrency = store.concurrency_layer(&config, &bindings)?;
    let shed = config.shed_layer(&bindings)?;
    let (rate_limit, reloader) = config.reloadable_rate_limit_layer(store.clone(), bindings)?;
    // The in-process store's size, for its gauge, every few seconds (never per request).
    if let Some(memory) = store.memory().cloned() {
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(5));
            loop {
                every.tick().await;
                memory.record_metrics();
            }
        });
    }

    let mut api = Router::new()
        .route(
            "/",
            get(|| async { "tollgate's example API: try /search?q=x with an x-api-key\n" }),
        )
        .route("/login", post(|| async { "welcome\n" }))
        .route("/search", get(|| async { "3 results\n" }))
        .route(
            "/export",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                "export ready\n"
            }),
        );
    // Inner to outer (each `layer` wraps what is above it): what callers have in flight, their
    // quotas, who is calling, and first of all the shedder (the cheapest no).
    if let Some(concurrency) = concurrency {
        api = api.layer(concurrency);
    }
    api = api
        .layer(rate_limit)
        .layer(MapRequestLayer::new(authenticate));
    if let Some(shed) = shed {
        api = api.layer(shed);
    }
    // Never limited: the load balancer's health check and the metrics scrape.
    let router = Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .route(
            "/metrics",
            get(move || std::future::ready(metrics.render())),
        )
        .merge(api);
    Ok(App { router, reloader })
}

/// Reloads the file and says what happened.
pub fn reload(reloader: &Reloader<ConfiguredStore>, path: &Path, why: &str) -> bool {
    match reloader.reload_file(path) {
        Ok(summary) => {
            tracing::info!(%summary, why, "configuration reloaded");
            true
        }
        Err(errors) => {
            tracing::warn!(
                why,
                "configuration refused; the running one stays:\n{}",
                indent(&errors.to_string())
            );
            false
        }
    }
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

/// Reloads when the file's content changes (and then stays the same for one more check),
/// checking every `every`; reports each attempt.
pub async fn watch(
    path: PathBuf,
    reloader: Reloader<ConfiguredStore>,
    every: Duration,
    done: mpsc::UnboundedSender<bool>,
) {
    let mut last = tokio::fs::read(&path).await.ok();
    // A change is applied once two reads in a row agree, so that a file caught while an
    // editor writes it (a prefix can be valid TOML) is not applied. Replacing the file by a
    // rename is atomic and best.
    let mut seen: Option<Vec<u8>> = None;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = tokio::fs::read(&path).await.ok();
        if now.is_none() || now == last {
            seen = None;
            continue;
        }
        if seen != now {
            seen = now;
            continue;
        }
        last = seen.take();
        if done
            .send(reload(&reloader, &path, "the file changed"))
            .is_err()
        {
            return;
        }
    }
}

/// Reloads on every `SIGHUP`; reports each attempt.
#[cfg(unix)]
pub fn on_hangup(
    path: PathBuf,
    reloader: Reloader<ConfiguredStore>,
    done: mpsc::UnboundedSender<bool>,
) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            if done.send(reload(&reloader, &path, "SIGHUP")).is_err() {
                return;
            }
        }
    });
    Ok(())
}

struct Options {
    config: PathBuf,
    addr: SocketAddr,
    watch_every: Duration,
}

fn options() -> Result<Options, Box<dyn Error>> {
    let mut options = Options {
        config: PathBuf::from("examples/server/tollgate.toml"),
        addr: SocketAddr::from(([127, 0, 0, 1], 3000)),
        watch_every: Duration::from_secs(1),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--config" => options.config = value()?.into(),
            "--addr" => options.addr = value()?.parse()?,
            "--watch-every" => {
                options.watch_every = value()?.parse::<tollgate::config::HumanDuration>()?.get()
            }
            other => return Err(format!("unknown option {other:?}").into()),
        }
    }
    Ok(options)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    // Logs to stderr: INFO and up unless RUST_LOG says otherwise (tollgate=debug: every decision).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let options = options()?;
    let metrics = prometheus()?;
    let App { router, reloader } = match app(&options.config, metrics).await {
        Ok(app) => app,
        Err(errors) => {
            eprintln!(
                "{}: not started:\n{}",
                options.config.display(),
                indent(&errors.to_string())
            );
            std::process::exit(2);
        }
    };
    let (done, mut reports) = mpsc::unbounded_channel();
    #[cfg(unix)]
    on_hangup(options.config.clone(), reloader.clone(), done.clone())?;
    tokio::spawn(watch(
        options.config.clone(),
        reloader,
        options.watch_every,
        done,
    ));
    tokio::spawn(async move { while reports.recv().await.is_some() {} });

    let listener = tokio::net::TcpListener::bind(options.addr).await?;
    tracing::info!(
        "listening on http://{} with {} (reloads on SIGHUP and on change)",
        listener.local_addr()?,
        options.config.display()
    );
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;
    use http_body_util::{BodyExt, Empty};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    type HttpClient =
        Client<hyper_util::client::legacy::connect::HttpConnector, Empty<bytes::Bytes>>;

    /// A copy of the shipped configuration in a file of the test's own.
    fn config_copy(name: &str) -> PathBuf {
        let path =
            std::env::temp_dir().join(format!("tollgate-{}-{name}.toml", std::process::id()));
        let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/server/tollgate.toml");
        std::fs::copy(shipped, &path).unwrap();
        path
    }

    async fn serve(path: &Path) -> (SocketAddr, Reloader<ConfiguredStore>) {
        let App { router, reloader } = app(path, prometheus().unwrap()).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(
                listener,
                router.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .unwrap();
        });
        (addr, reloader)
    }

    async fn call(
        client: &HttpClient,
        addr: SocketAddr,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> (StatusCode, http::HeaderMap, String) {
        let mut request = http::Request::builder()
            .method(method)
            .uri(format!("http://{addr}{path}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = client
            .request(request.body(Empty::new()).unwrap())
            .await
            .unwrap();
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        (
            parts.status,
            parts.headers,
            String::from_utf8_lossy(&body).into_owned(),
        )
    }

    /// The shipped file starts the server, and every protection answers as documented, over
    /// loopback; a reload by SIGHUP applies a changed limit and refuses a broken file.
    #[tokio::test]
    async fn the_server_end_to_end_with_a_reload() {
        let path = config_copy("e2e");
        let (addr, reloader) = serve(&path).await;
        let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();

        // Logins: 5 per 15 minutes per address, then 429 with the fields.
        for _ in 0..5 {
            let (status, ..) = call(&client, addr, "POST", "/login", &[]).await;
            assert_eq!(status, StatusCode::OK);
        }
        let (status, headers, body) = call(&client, addr, "POST", "/login", &[]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert!(
            headers["retry-after"]
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
                > 800
        );
        assert!(
            headers["ratelimit"]
                .to_str()
                .unwrap()
                .starts_with("\"login\";r=0")
        );
        assert!(body.contains("quota"), "{body}");

        // Search: no key is 401; a pro key runs under the pro plan.
        let (status, ..) = call(&client, addr, "GET", "/search?q=x", &[]).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        let (status, headers, _) = call(
            &client,
            addr,
            "GET",
            "/search?q=x",
            &[("x-api-key", "pro-1")],
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            headers["ratelimit-policy"]
                .to_str()
                .unwrap()
                .contains("\"pro\";q=100")
        );

        // Exports need a user; the health check is never limited (more than the burst of 40).
        let (status, ..) = call(&client, addr, "GET", "/export", &[]).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        for _ in 0..60 {
            let (status, ..) = call(&client, addr, "GET", "/health", &[]).await;
            assert_eq!(status, StatusCode::OK);
        }
        let (status, _, text) = call(&client, addr, "GET", "/metrics", &[]).await;
        assert_eq!(status, StatusCode::OK);
        for series in [
            r#"tollgate_decisions_total{rule="login",policy="login",outcome="limited"} 1"#,
            r#"tollgate_decisions_total{rule="login",policy="",outcome="admitted"} 5"#,
            r#"tollgate_decisions_total{rule="search",policy="",outcome="no_key"} 1"#,
            "# HELP tollgate_decisions_total",
            "tollgate_in_flight{layer=\"shed\"}",
            "tollgate_shed_limit{layer=\"shed\"}",
        ] {
            assert!(text.contains(series), "{series} in\n{text}");
        }

        // SIGHUP with a raised login limit: the next attempt is admitted (a changed policy
        // starts fresh).
        let (done, mut reports) = mpsc::unbounded_channel();
        on_hangup(path.clone(), reloader.clone(), done).unwrap();
        let shipped = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, shipped.replace("\"5 per 15m\"", "\"6 per 15m\"")).unwrap();
        hang_up();
        assert_eq!(reports.recv().await, Some(true));
        let (status, ..) = call(&client, addr, "POST", "/login", &[]).await;
        assert_eq!(status, StatusCode::OK);

        // A broken file is refused and the limits stay.
        std::fs::write(&path, shipped.replace("\"5 per 15m\"", "\"5 per 0s\"")).unwrap();
        hang_up();
        assert_eq!(reports.recv().await, Some(false));
        let running = reloader.current();
        assert!(running.rules.iter().any(|r| r.name == "login"));
        let (status, ..) = call(&client, addr, "GET", "/", &[]).await;
        assert_eq!(status, StatusCode::OK);
        std::fs::remove_file(&path).ok();
    }

    /// The alert rules and the dashboard use only metrics tollgate records, with their labels.
    #[test]
    fn alerts_and_dashboard_name_documented_metrics() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/server/");
        let alerts = std::fs::read_to_string(format!("{dir}alerts.yml")).unwrap();
        let dashboard = std::fs::read_to_string(format!("{dir}grafana.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&dashboard).unwrap();
        let mut used = 0;
        let mut on_dashboard = std::collections::BTreeSet::new();
        for (text, is_dashboard) in [(&alerts, false), (&dashboard, true)] {
            for (at, _) in text.match_indices("tollgate_") {
                let name: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let base = name.strip_suffix("_bucket").unwrap_or(&name);
                let metric = tollgate::metrics::ALL.iter().find(|m| m.name == base);
                assert!(metric.is_some(), "{name} is not a documented metric");
                if is_dashboard {
                    on_dashboard.insert(base.to_owned());
                }
                // The labels grouped by or matched on are the metric's own.
                let rest = &text[at + name.len()..];
                if let Some(selector) = rest.strip_prefix('{') {
                    let selector = &selector[..selector.find('}').unwrap()];
                    for matcher in selector.split(',') {
                        let label = matcher.split(['=', '!', '~']).next().unwrap().trim();
                        assert!(
                            metric.unwrap().labels.contains(&label),
                            "{name}: no label {label:?}"
                        );
                    }
                }
                used += 1;
            }
        }
        assert!(used > 20);
        // The dashboard shows every metric tollgate records.
        let missing: Vec<_> = tollgate::metrics::ALL
            .iter()
            .map(|m| m.name)
            .filter(|name| !on_dashboard.contains(*name))
            .collect();
        assert!(missing.is_empty(), "not on the dashboard: {missing:?}");
    }

    /// The Redis store that the shipped file shows in comments, put in place of the memory
    /// store as the comments say, makes a valid configuration (with feature `redis`).
    #[cfg(feature = "redis")]
    #[test]
    fn the_shipped_file_on_redis_is_valid() {
        let shipped = include_str!("tollgate.toml");
        let is_option = |line: &str| {
            line.split_once(" = ").is_some_and(|(name, _)| {
                !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
            })
        };
        let mut in_store = false;
        let mut on_redis = String::new();
        for line in shipped.lines() {
            if line.starts_with('[') {
                in_store = line == "[store]";
            }
            let line = match line.strip_prefix("# ") {
                Some(option) if in_store && is_option(option) => option,
                _ if in_store && is_option(line) => continue, // the memory store's lines
                _ => line,
            };
            on_redis.push_str(line);
            on_redis.push('\n');
        }
        let config = Config::from_toml(&on_redis).unwrap_or_else(|e| panic!("{e}\n{on_redis}"));
        assert_eq!(config.store.kind, tollgate::config::StoreKind::Redis);
        assert_eq!(config.store.instances, Some(3));
        assert_eq!(config.store.deny_cache, Some(10_000));
    }

    fn hang_up() {
        let status = std::process::Command::new("kill")
            .args(["-HUP", &std::process::id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// The watcher reloads when the file's content changes, and only then.
    #[tokio::test(start_paused = true)]
    async fn a_changed_file_is_reloaded() {
        let path = config_copy("watch");
        let App { reloader, .. } = app(&path, prometheus().unwrap()).await.unwrap();
        let (done, mut reports) = mpsc::unbounded_channel();
        tokio::spawn(watch(
            path.clone(),
            reloader.clone(),
            Duration::from_secs(1),
            done,
        ));
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            reports.try_recv().is_err(),
            "nothing changed, nothing reloaded"
        );
        let shipped = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, shipped.replace("rate = \"20/s\"", "rate = \"30/s\"")).unwrap();
        assert_eq!(reports.recv().await, Some(true));
        let rule = reloader
            .current()
            .rules
            .into_iter()
            .find(|r| r.name == "per-client")
            .unwrap();
        assert_eq!(rule.policies[0].rate.unwrap().to_string(), "30/s");
        std::fs::remove_file(&path).ok();
    }
}
