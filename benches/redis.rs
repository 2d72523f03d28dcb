//! The Redis store under load, beside the ceiling of the same script run by `redis-benchmark`.
//!
//! `cargo bench --features redis --bench redis` starts its own `redis-server` on a free
//! loopback port and prints, in about a minute:
//! - decisions per second and p50/p99 latency for 1 and 64 concurrent callers, on one hot key
//!   and over 100k keys, for GCRA and the token bucket;
//! - `redis-benchmark` EVALSHA of the same script (`-P 16`, 64 clients): the ceiling;
//! - a flood of rejected requests with the deny cache: how many reach Redis;
//! - `MEMORY USAGE` per tracked key for each algorithm.
//!
//! Knobs: `TOLLGATE_BENCH_POOL` (connections, default 4), `TOLLGATE_BENCH_THREADS` (tokio
//! workers, default 2), `TOLLGATE_BENCH_QUICK` (only the load figures).

#[path = "redis_support/mod.rs"]
mod redis_support;
#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use redis_support::{ceiling, cpu_time_us, script_calls};
use tollgate::clock::{Clock, SystemClock};
use tollgate::store::redis::RedisStore;
use tollgate::{Policy, Rate};

const RUN: Duration = Duration::from_secs(3);
const KEYS: u64 = 100_000;

struct Figures {
    per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    /// This process's CPU time (user + system) per decision.
    cpu_us: f64,
}

/// Runs `callers` tasks for [`RUN`], each calling `op` again and again with its next key (one
/// hot key, or one of [`KEYS`] at random, named by `name`; made before the clock starts), and
/// sums up their latencies and this process's CPU.
async fn drive<F, Fut>(
    callers: u64,
    spread: bool,
    name: fn(Option<u64>) -> String,
    op: F,
) -> Figures
where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let clock = Arc::new(SystemClock::new());
    let cpu = cpu_time_us();
    let end = clock.now() + RUN.as_nanos() as u64;
    let tasks: Vec<_> = (0..callers)
        .map(|c| {
            let (op, clock) = (op.clone(), clock.clone());
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(200_000);
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ c;
                while clock.now() < end {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let key = name(spread.then_some(x % KEYS));
                    let t = clock.now();
                    op(key).await;
                    lat.push(clock.now() - t);
                }
                lat
            })
        })
        .collect();
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.expect("task"));
    }
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)] as f64 / 1000.0;
    Figures {
        per_sec: lat.len() as f64 / RUN.as_secs_f64(),
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        cpu_us: (cpu_time_us() - cpu) / lat.len() as f64,
    }
}

async fn load(store: &RedisStore, policy: &Policy, callers: usize, spread: bool) -> Figures {
    let (store, policy) = (store.clone(), policy.clone());
    let name = |n: Option<u64>| n.map_or_else(|| "hot".to_owned(), |n| format!("k{n}"));
    drive(callers as u64, spread, name, move |key| {
        let (store, policy) = (store.clone(), policy.clone());
        async move {
            store.check(&key, &policy, 1).await.expect("check");
        }
    })
    .await
}

/// The same script through fred alone (a pool of the same size, 64 tasks, fixed arguments):
/// what the store costs beyond the client it runs on.
async fn fred_alone(
    url: &str,
    pool_size: usize,
    sha: &str,
    policy: &Policy,
    spread: bool,
) -> Figures {
    use fred::prelude::*;
    let config = Config::from_url(url).expect("url");
    let pool = Builder::from_config(config)
        .build_pool(pool_size)
        .expect("pool");
    pool.init().await.expect("connect");
    let args: Vec<String> = vec![
        String::new(),
        "0".into(),
        "1000".into(),
        policy.algorithm().as_str().into(),
        policy.limit().to_string(),
        policy.interval().as_nanos().to_string(),
        "1".into(),
        policy.window().as_nanos().to_string(),
        String::new(),
    ];
    let (caller_pool, sha) = (pool.clone(), sha.to_owned());
    let name =
        |n: Option<u64>| n.map_or_else(|| "fred:{hot}".to_owned(), |n| format!("fred:{{{n}}}"));
    let figures = drive(64, spread, name, move |key| {
        let (pool, sha, args) = (caller_pool.clone(), sha.clone(), args.clone());
        async move {
            let _: Vec<i64> = pool
                .evalsha(sha.as_str(), key, args)
                .await
                .expect("evalsha");
        }
    })
    .await;
    let _ = pool.quit().await;
    figures
}

fn memory_usage(server: &support::RedisServer, name: &str) -> u64 {
    server
        .cli(&["MEMORY", "USAGE", name, "SAMPLES", "0"])
        .trim()
        .parse()
        .unwrap_or(0)
}

fn main() {
    let Some(server) = support::RedisServer::start() else {
        return;
    };
    let threads: usize = std::env::var("TOLLGATE_BENCH_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let pool: usize = std::env::var("TOLLGATE_BENCH_POOL").ok().and_then(|p| p.parse().ok()).unwrap_or(tollgate::store::redis::DEFAULT_POOL_SIZE);
        let store = RedisStore::builder()
            .url(server.url())
            .pool_size(pool)
            .timeout(Duration::from_secs(5))
            .connect()
            .await
            .expect("connect");
        println!("pool size {pool}, {threads} tokio workers");
        // Large bursts, so that the load measures admissions, not rejections.
        let gcra = Policy::gcra(Rate::per_second(1_000_000), 1_000_000).expect("policy");
        let bucket = Policy::token_bucket(Rate::per_second(1_000_000), 1_000_000).expect("policy");
        println!("redis-server {}", server.cli(&["INFO", "server"]).lines().find(|l| l.starts_with("redis_version")).unwrap_or("?").trim());
        println!();
        println!("| algorithm | keys | callers | decisions/s | p50 | p99 | client CPU per decision | redis-benchmark EVALSHA -P 16 | share |");
        println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        let only_load = std::env::var("TOLLGATE_BENCH_QUICK").is_ok();
        for policy in [&gcra, &bucket] {
            let name = policy.algorithm().as_str();
            let sha = store.check_script_sha(policy.algorithm());
            for spread in [false, true] {
                let top = ceiling(server.port, sha, policy, if spread { KEYS } else { 0 });
                let keys = if spread { "100k" } else { "1 (hot)" };
                for callers in [1, 64] {
                    let f = load(&store, policy, callers, spread).await;
                    let share = if callers == 64 { format!("{:.0}%", 100.0 * f.per_sec / top) } else { "".into() };
                    println!(
                        "| {name} | {keys} | {callers} | {:.0} | {:.0} µs | {:.0} µs | {:.1} µs | {top:.0}/s | {share} |",
                        f.per_sec, f.p50_us, f.p99_us, f.cpu_us
                    );
                }
                let f = fred_alone(&server.url(), pool, sha, policy, spread).await;
                println!(
                    "| {name}, fred alone | {keys} | 64 | {:.0} | {:.0} µs | {:.0} µs | {:.1} µs | {top:.0}/s | {:.0}% |",
                    f.per_sec, f.p50_us, f.p99_us, f.cpu_us, 100.0 * f.per_sec / top
                );
            }
        }

        // What a call across slots pays for running in a task of its own: a place under the
        // bound (`max_cross_slot_calls`), `tokio::spawn` and a oneshot answer, one call at a
        // time, beside one EVALSHA's round trip (the 1-caller p50 above).
        let bound = Arc::new(tokio::sync::Semaphore::new(tollgate::store::redis::DEFAULT_MAX_CROSS_SLOT_CALLS));
        let clock = SystemClock::new();
        let n = 200_000u32;
        let t = clock.now();
        for _ in 0..n {
            let permit = Arc::clone(&bound).try_acquire_owned().expect("a place");
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                let _permit = permit;
                let _ = tx.send(1u8);
            });
            rx.await.expect("answer");
        }
        println!(
            "\na call across slots, its own task (bound, spawn, oneshot): {:.2} µs a call",
            (clock.now() - t) as f64 / 1e3 / f64::from(n)
        );

        if only_load {
            return;
        }
        // A flood of rejected requests on one key, with and without the deny cache.
        let tight = Policy::gcra(Rate::per_hour(1), 1).expect("policy");
        for cache in [0usize, 10_000] {
            let s = RedisStore::builder()
                .url(server.url())
                .deny_cache(cache)
                .timeout(Duration::from_secs(5))
                .prefix(format!("flood{cache}:"))
                .connect()
                .await
                .expect("connect");
            s.check("flood", &tight, 1).await.expect("check");
            let before = script_calls(&server);
            let clock = SystemClock::new();
            let t = clock.now();
            let n = 200_000u64;
            let tasks: Vec<_> = (0..64)
                .map(|_| {
                    let (s, p) = (s.clone(), tight.clone());
                    tokio::spawn(async move {
                        for _ in 0..n / 64 {
                            assert!(!s.check("flood", &p, 1).await.expect("check").allowed());
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.expect("task");
            }
            let secs = (clock.now() - t) as f64 / 1e9;
            let calls = script_calls(&server) - before;
            println!(
                "\nrejected flood, 64 callers, deny cache {}: {:.0} decisions/s, {} of {} reached Redis",
                if cache > 0 { "on" } else { "off" },
                (n / 64 * 64) as f64 / secs,
                calls,
                n / 64 * 64
            );
        }

        // Memory per tracked key.
        println!("\n| algorithm | MEMORY USAGE per key |");
        println!("| --- | ---: |");
        let day = Duration::from_secs(86_400);
        let cases = [
            ("fixed_window", Policy::fixed_window(100, day).expect("policy"), 1),
            ("sliding_window", Policy::sliding_window(100, day).expect("policy"), 1),
            ("token_bucket", Policy::token_bucket(Rate::per_second(10), 100).expect("policy"), 1),
            ("leaky_bucket", Policy::leaky_bucket(Rate::per_second(10), 100).expect("policy"), 1),
            ("gcra", Policy::gcra(Rate::per_second(10), 100).expect("policy"), 1),
            ("sliding_log, 1 entry", Policy::sliding_log(100, day).expect("policy"), 1),
            ("sliding_log, 10 entries", Policy::sliding_log(100, day).expect("policy"), 10),
            ("sliding_log, 100 entries (full)", Policy::sliding_log(100, day).expect("policy"), 100),
        ];
        for (n, (name, policy, entries)) in cases.iter().enumerate() {
            let mut total = 0;
            for i in 0..100 {
                let key = format!("mem{n}:user:{i}");
                for _ in 0..*entries {
                    store.check(&key, policy, 1).await.expect("check");
                    if *entries > 1 {
                        // Distinct times: one log entry each.
                        tokio::time::sleep(Duration::from_micros(50)).await;
                    }
                }
                total += memory_usage(&server, &store.key_name(&key, policy));
            }
            println!("| {name} | {} B |", total / 100);
        }
    });
}
