//! Soak with faults: a real axum server with the rate-limit layer on the Redis store behind
//! `ResilientStore` (fail open, timeout 100 ms, breaker), under steady load from concurrent
//! clients on loopback, while Redis is killed and restarted, frozen with SIGSTOP for longer
//! than the timeout (a hang, not a crash), and slowed by a delaying TCP proxy. Bounded in time
//! and stopping by itself: `SOAK_SECONDS` (default 12, as in CI; RELIABILITY.md has a
//! 120-second run) is split into five phases: calm, killed, frozen, slowed, calm.
//!
//! Recorded and checked: every answer is 200 or 429 (no 5xx: fail open is the policy), the
//! server answers to the end, no key is admitted above its limit in any window that Redis
//! decided, and while the breaker is open no request waits for a timeout. Printed: requests
//! served, admissions by the failure policy, recovery after each fault, latencies by phase.
#![cfg(feature = "redis")]
// A soak runs on real time: it measures latencies and recovery, and maps each admission to the
// Redis window (whole seconds since the epoch) it was counted in.
#![allow(clippy::disallowed_methods)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::Extension;
use axum::routing::get;
use http::StatusCode;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tollgate::key::Header;
use tollgate::limiter::Rule;
use tollgate::store::redis::{RedisStore, RedisStoreBuilder};
use tollgate::store::resilient::BreakerStatus;
use tollgate::store::{FailurePolicy, ResilientStore};
use tollgate::{Decision, Policy, RateLimitLayer};

const LIMIT: u64 = 20;
/// One soak at a time: two at once on a 2-core machine would measure each other.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const TIMEOUT: Duration = Duration::from_millis(100);

/// A TCP proxy in front of Redis that holds every chunk for `delay_ms` (0: none).
async fn proxy(upstream: u16, delay_ms: Arc<AtomicU64>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let delay_ms = delay_ms.clone();
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    return;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let up = pipe(cr, sw, delay_ms.clone());
                let down = pipe(sr, cw, delay_ms);
                let _ = tokio::join!(up, down);
            });
        }
    });
    port
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay_ms: Arc<AtomicU64>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let d = delay_ms.load(Ordering::Relaxed);
        if d > 0 {
            tokio::time::sleep(Duration::from_millis(d)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// What one request saw.
struct Seen {
    phase: usize,
    key: usize,
    status: StatusCode,
    /// Admitted by the failure policy (not decided by Redis).
    by_policy: bool,
    /// The Redis window it was counted in (its end, in whole seconds since the epoch).
    window: u64,
    /// When it was sent, from the start of the run.
    sent: Duration,
    latency: Duration,
    /// The breaker was open when it was sent and when it came back.
    breaker_open: bool,
}

fn soak_seconds(default: u64) -> u64 {
    std::env::var("SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
        .max(5)
}

/// What every soak runs: the Redis store of `redis` (timeout `TIMEOUT`) behind
/// `ResilientStore` (fail open), a server with the layer on it, and the load on that server.
async fn start(redis: RedisStoreBuilder) -> (ResilientStore<RedisStore>, support::Client, Load) {
    let redis = redis.timeout(TIMEOUT).connect().await.unwrap();
    let store = ResilientStore::builder(redis)
        .timeout(TIMEOUT)
        .failure_policy(FailurePolicy::Open)
        .breaker(3, Duration::from_millis(500))
        .build();
    let client = server_with(&store).await;
    let load = Load::start(&client, &store);
    (store, client, load)
}

/// A server with the layer on `store` (per-user, `LIMIT` a second) whose handler reports
/// the Redis window each admission was counted in and whether the failure policy admitted it.
async fn server_with(store: &ResilientStore<RedisStore>) -> support::Client {
    let layer = RateLimitLayer::builder(store.clone())
        .rule(
            Rule::new("per-user")
                .key(Header::from_static("x-user"))
                .policy(Policy::fixed_window(LIMIT, Duration::from_secs(1)).unwrap()),
        )
        .decision_extension(true)
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            get(|Extension(d): Extension<Decision>| async move {
                let end = SystemTime::now() + d.reset_after();
                let end = end.duration_since(UNIX_EPOCH).unwrap_or_default();
                let window = (end.as_millis() as u64 + 500) / 1000;
                let by_policy = if d.is_failure_policy() { "1" } else { "0" };
                (
                    [
                        ("x-window", window.to_string()),
                        ("x-by-policy", by_policy.into()),
                    ],
                    "ok",
                )
            }),
        )
        .layer(layer);
    support::Client::new(support::serve(app).await)
}

/// Steady load: 16 clients, 8 users, about 400 requests a second in all (far above the
/// limits), each request recorded with the phase it was sent in.
struct Load {
    started: Instant,
    phase: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<Seen>>>,
    clients: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(client: &support::Client, store: &ResilientStore<RedisStore>) -> Self {
        let started = Instant::now();
        let phase = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::<Seen>::new()));
        let users = 8;
        let clients = (0..16)
            .map(|c| {
                let (client, phase, stop, seen, store) = (
                    client.clone(),
                    phase.clone(),
                    stop.clone(),
                    seen.clone(),
                    store.clone(),
                );
                tokio::spawn(async move {
                    let mut i = c;
                    while !stop.load(Ordering::Relaxed) {
                        let key = i % users;
                        i += 7;
                        let open_before = store.breaker_state() == BreakerStatus::Open;
                        let start = Instant::now();
                        let sent = start.duration_since(started);
                        let user = key.to_string();
                        let answer = client.get_with("/", &[("x-user", &user)]).await;
                        let latency = start.elapsed();
                        let open_after = store.breaker_state() == BreakerStatus::Open;
                        let header = |name: &str| {
                            answer
                                .headers
                                .get(name)
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned)
                        };
                        seen.lock().push(Seen {
                            phase: phase.load(Ordering::Relaxed) as usize,
                            key,
                            status: answer.status,
                            by_policy: header("x-by-policy").as_deref() == Some("1"),
                            window: header("x-window").and_then(|w| w.parse().ok()).unwrap_or(0),
                            sent,
                            latency,
                            breaker_open: open_before && open_after,
                        });
                        tokio::time::sleep(Duration::from_millis(40)).await;
                    }
                })
            })
            .collect();
        Self {
            started,
            phase,
            stop,
            seen,
            clients,
        }
    }

    fn phase(&self, p: u64) {
        self.phase.store(p, Ordering::Relaxed);
    }

    /// Stops the clients, checks what every soak must hold and prints the figures.
    async fn finish(
        self,
        name: &str,
        client: &support::Client,
        store: &ResilientStore<RedisStore>,
        faults_ended: &[(&str, Instant)],
        phases: usize,
    ) {
        self.stop.store(true, Ordering::Relaxed);
        for c in self.clients {
            c.await.expect("a client task panicked");
        }
        // The server still answers.
        let last = client.get_with("/", &[("x-user", "last")]).await;
        assert_eq!(last.status, StatusCode::OK);
        let seen = self.seen.lock();
        let total = seen.len();
        let fivexx = seen.iter().filter(|s| s.status.is_server_error()).count();
        let other = seen
            .iter()
            .filter(|s| s.status != StatusCode::OK && s.status != StatusCode::TOO_MANY_REQUESTS)
            .count();
        let ok = seen.iter().filter(|s| s.status == StatusCode::OK).count();
        let by_policy = seen.iter().filter(|s| s.by_policy).count();
        let limited = seen
            .iter()
            .filter(|s| s.status == StatusCode::TOO_MANY_REQUESTS)
            .count();
        eprintln!(
            "{name}: {total} requests, {ok} admitted ({by_policy} by the failure policy), {limited} limited, {fivexx} 5xx, {other} other"
        );
        assert_eq!(fivexx, 0, "no 5xx: the failure policy is fail open");
        assert_eq!(other, 0);
        // No key above its limit in a window Redis decided.
        let mut counts = std::collections::HashMap::new();
        for s in seen
            .iter()
            .filter(|s| s.status == StatusCode::OK && !s.by_policy)
        {
            *counts.entry((s.key, s.window)).or_insert(0u64) += 1;
        }
        let worst = counts.values().copied().max().unwrap_or(0);
        eprintln!("most admitted by Redis in one key's window: {worst} (limit {LIMIT})");
        assert!(worst <= LIMIT, "{worst} admitted in one window");
        // Recovery: from the end of each fault to the first answer Redis decided again.
        for (fault, at) in faults_ended {
            let ended = at.duration_since(self.started);
            let back = seen
                .iter()
                .filter(|s| s.sent >= ended && !s.by_policy)
                .map(|s| s.sent + s.latency)
                .min()
                .map(|b| b.saturating_sub(ended));
            eprintln!("{fault}: Redis decided again {back:?} after the fault ended");
            assert!(back.is_some(), "{fault}: Redis never decided again");
        }
        for p in 0..phases {
            let mut l: Vec<Duration> = seen
                .iter()
                .filter(|s| s.phase == p)
                .map(|s| s.latency)
                .collect();
            l.sort();
            if let Some(max) = l.last() {
                eprintln!(
                    "phase {p}: {} requests, p50 {:?}, p99 {:?}, max {max:?}",
                    l.len(),
                    l[l.len() / 2],
                    l[l.len() * 99 / 100]
                );
            }
        }
        let open: Vec<Duration> = seen
            .iter()
            .filter(|s| s.breaker_open)
            .map(|s| s.latency)
            .collect();
        // A request sent just as the breaker's open time ends can be its probe, and wait;
        // every other request sent while it is open is answered at once.
        let waited = open.iter().filter(|l| **l >= TIMEOUT).count() as u64;
        let fast = open.iter().filter(|l| **l < TIMEOUT).max().copied();
        let stats = store.stats();
        eprintln!(
            "breaker open: {} requests, {waited} waited for a timeout (probes: the breaker opened {} times), the others at most {fast:?}; {stats:?}",
            open.len(),
            stats.breaker_opened
        );
        assert!(!open.is_empty(), "the breaker opened");
        assert!(
            waited <= stats.breaker_opened,
            "no request but the probes waits for a timeout while the breaker is open"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_under_load_survives_redis_killed_frozen_and_slowed() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let Some(mut server) = support::RedisServer::start() else {
        return;
    };
    let phase_len = Duration::from_secs(soak_seconds(12)) / 5;
    let delay_ms = Arc::new(AtomicU64::new(0));
    let port = proxy(server.port, delay_ms.clone()).await;
    let (store, client, load) =
        start(RedisStore::builder().url(format!("redis://127.0.0.1:{port}"))).await;
    let mut ended = Vec::new();
    // 0: calm.
    tokio::time::sleep(phase_len).await;
    // 1: killed for half the phase, then restarted (empty: nothing saved).
    load.phase(1);
    server.kill();
    tokio::time::sleep(phase_len / 2).await;
    server.restart();
    ended.push(("killed", Instant::now()));
    tokio::time::sleep(phase_len / 2).await;
    // 2: frozen (SIGSTOP) for half the phase: connections stay open and answer nothing.
    load.phase(2);
    server.signal("STOP");
    tokio::time::sleep(phase_len / 2).await;
    server.signal("CONT");
    ended.push(("frozen", Instant::now()));
    tokio::time::sleep(phase_len / 2).await;
    // 3: slowed: every chunk held 150 ms (above the timeout) for half the phase.
    load.phase(3);
    delay_ms.store(150, Ordering::Relaxed);
    tokio::time::sleep(phase_len / 2).await;
    delay_ms.store(0, Ordering::Relaxed);
    ended.push(("slowed", Instant::now()));
    tokio::time::sleep(phase_len / 2).await;
    // 4: calm.
    load.phase(4);
    tokio::time::sleep(phase_len).await;
    load.finish("single node", &client, &store, &ended, 5).await;
}

/// The same load on a three-master Cluster while one master is killed and restarted (empty;
/// it rejoins with its slots from its nodes.conf): the keys on the other masters are decided
/// as before, those of its slots by the failure policy until it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_under_load_survives_a_cluster_master_killed() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let Some(mut cluster) = support::RedisCluster::start() else {
        return;
    };
    let phase_len = Duration::from_secs(soak_seconds(9)) / 3;
    let (store, client, load) = start(RedisStore::builder().cluster(cluster.nodes())).await;
    let mut ended = Vec::new();
    tokio::time::sleep(phase_len).await;
    load.phase(1);
    cluster.nodes[0].kill();
    tokio::time::sleep(phase_len / 2).await;
    cluster.nodes[0].restart();
    ended.push(("master killed", Instant::now()));
    tokio::time::sleep(phase_len / 2).await;
    load.phase(2);
    tokio::time::sleep(phase_len).await;
    load.finish("cluster", &client, &store, &ended, 3).await;
}
