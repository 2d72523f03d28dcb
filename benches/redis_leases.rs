//! Leased quota on one hot key, against the single-key ceiling of the same Redis.
//!
//! `cargo bench --features redis --bench redis_leases` starts its own `redis-server` on a free
//! loopback port and prints, in about half a minute:
//! - the ceiling: `redis-benchmark` running EVALSHA of the GCRA check script on one key
//!   (64 clients, pipeline 16);
//! - one hot key checked by 64 callers through two store instances in this process, without
//!   leases (two `RedisStore`s) and with them (two `LeasedStore`s): decisions per second,
//!   latency, and the script calls Redis ran;
//! - the same with a limit the callers exceed (GCRA, 200 000/s, burst 20 000): what was
//!   admitted, against the bound `B + r·(T + L)` over every span of the run;
//! - 100 000 keys that are never hot, without and with leases: the cost of the wrapper.
//!
//! Callers yield to the scheduler after each decision, as a server's request tasks do.
//! Knobs: `TOLLGATE_BENCH_THREADS` (tokio workers, default 2), `TOLLGATE_BENCH_SECS` (seconds
//! per row, default 3).

#[path = "redis_support/mod.rs"]
mod redis_support;
#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use redis_support::{ceiling, cpu_time_us, script_calls};
use tollgate::clock::{Clock, SystemClock};
use tollgate::store::redis::{DEFAULT_BUCKET_LIFETIME, LeasedStore, RedisStore};
use tollgate::{Policy, Rate, Store};

const KEYS: u64 = 100_000;
const CALLERS: u64 = 64;
/// Admissions are counted per slot of this length (by the time the check was made).
const SLOT_NS: u64 = 1_000_000;

struct Figures {
    per_sec: f64,
    admitted: u64,
    p50_us: f64,
    p99_us: f64,
    /// The longest any decision took (ns).
    max_ns: u64,
    /// Admitted units per slot since the start.
    slots: Vec<u64>,
    /// Script calls Redis ran during the row.
    calls: u64,
    secs: f64,
    /// This process's CPU time (user + system) per decision, in µs.
    cpu_us: f64,
}

/// `CALLERS` tasks, spread over `stores`, each checking its next key (the hot one, or one of
/// `KEYS` at random) for `run`, yielding after each decision.
async fn drive<S: Store + Clone>(
    server: &support::RedisServer,
    stores: &[S],
    policy: &Policy,
    spread: bool,
    run: Duration,
) -> Figures {
    let clock = Arc::new(SystemClock::new());
    let calls = script_calls(server);
    let cpu = cpu_time_us();
    let start = clock.now();
    let end = start + run.as_nanos() as u64;
    let slots = (run.as_nanos() as u64 / SLOT_NS + 2) as usize;
    let tasks: Vec<_> = (0..CALLERS)
        .map(|c| {
            let store = stores[c as usize % stores.len()].clone();
            let (policy, clock) = (policy.clone(), clock.clone());
            tokio::spawn(async move {
                let mut admitted = vec![0u64; slots];
                let mut lat = Vec::with_capacity(100_000);
                let (mut n, mut max) = (0u64, 0u64);
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ c;
                let names: Vec<String> = if spread {
                    Vec::new()
                } else {
                    vec!["hot".to_owned()]
                };
                let mut key = String::new();
                loop {
                    let t = clock.now();
                    if t >= end {
                        break;
                    }
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let name = if spread {
                        key.clear();
                        use std::fmt::Write as _;
                        let _ = write!(key, "k{}", x % KEYS);
                        &key
                    } else {
                        &names[0]
                    };
                    let d = store.check(name, &policy, 1).await.expect("check");
                    let took = clock.now() - t;
                    max = max.max(took);
                    if n % 16 == 0 {
                        lat.push(took);
                    }
                    n += 1;
                    if d.allowed() {
                        admitted[((t - start) / SLOT_NS) as usize] += 1;
                    }
                    tokio::task::yield_now().await;
                }
                (n, max, lat, admitted)
            })
        })
        .collect();
    let (mut n, mut max, mut lat) = (0, 0, Vec::new());
    let mut admitted = vec![0u64; slots];
    for t in tasks {
        let (tn, tmax, tlat, tadm) = t.await.expect("task");
        n += tn;
        max = max.max(tmax);
        lat.extend(tlat);
        for (a, b) in admitted.iter_mut().zip(tadm) {
            *a += b;
        }
    }
    let secs = (clock.now() - start) as f64 / 1e9;
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)] as f64 / 1000.0;
    Figures {
        per_sec: n as f64 / secs,
        admitted: admitted.iter().sum(),
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        max_ns: max,
        slots: admitted,
        calls: script_calls(server) - calls,
        secs,
        cpu_us: (cpu_time_us() - cpu) / n as f64,
    }
}

/// The bound over every span of slots: admissions made in slots i..=j happened within
/// (j - i + 1) slots; what they spent was consumed at most L before (leases) or at most the
/// longest decision after (calls to Redis). So at most B + floor((span + L + longest) / I).
/// Returns the tightest margin (bound - admitted) and that span's admissions and length.
fn bound_margin(policy: &Policy, f: &Figures, lifetime: u64) -> (i64, u64, u64) {
    let interval = policy.interval().as_nanos() as u64;
    let mut tightest = (i64::MAX, 0, 0);
    for i in 0..f.slots.len() {
        let mut sum = 0;
        for j in i..f.slots.len() {
            sum += f.slots[j];
            let span = (j - i + 1) as u64 * SLOT_NS;
            let bound = policy.limit() + (span + lifetime + f.max_ns) / interval;
            let margin = bound as i64 - sum as i64;
            if margin < tightest.0 {
                tightest = (margin, sum, span);
            }
        }
    }
    tightest
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
        let connect = |prefix: &'static str| {
            RedisStore::builder()
                .url(server.url())
                .prefix(prefix)
                .timeout(Duration::from_secs(5))
                .connect()
        };
        println!(
            "redis-server {}, {threads} tokio workers, {CALLERS} callers over two store instances, {} s a row",
            server
                .cli(&["INFO", "server"])
                .lines()
                .find(|l| l.starts_with("redis_version"))
                .unwrap_or("?")
                .trim(),
            run.as_secs()
        );
        // Room enough that the limit never refuses: every decision is an admission.
        let roomy = Policy::gcra(Rate::per_second(100_000_000), 10_000_000).expect("policy");
        // A limit the callers exceed many times over.
        let tight = Policy::gcra(Rate::per_second(200_000), 20_000).expect("policy");
        let plain = [connect("plain:").await.expect("connect"), connect("plain:").await.expect("connect")];
        let leased = [
            LeasedStore::new(connect("leased:").await.expect("connect")),
            LeasedStore::new(connect("leased:").await.expect("connect")),
        ];
        let top = ceiling(server.port, plain[0].check_script_sha(roomy.algorithm()), &roomy, 0);
        println!("\nceiling: redis-benchmark EVALSHA of the gcra script, one key, -c 64 -P 16: {top:.0}/s\n");
        println!("| store | keys | limit | decisions/s | × ceiling | p50 | p99 | client CPU per decision | admitted/s | script calls/s |");
        println!("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        let row = |name: &str, keys: &str, limit: &str, f: &Figures| {
            println!(
                "| {name} | {keys} | {limit} | {:.0} | {:.2} | {:.1} µs | {:.1} µs | {:.2} µs | {:.0} | {:.0} |",
                f.per_sec,
                f.per_sec / top,
                f.p50_us,
                f.p99_us,
                f.cpu_us,
                f.admitted as f64 / f.secs,
                f.calls as f64 / f.secs
            );
        };
        let f = drive(&server, &plain, &roomy, false, run).await;
        row("RedisStore ×2", "1 (hot)", "never reached", &f);
        let f = drive(&server, &leased, &roomy, false, run).await;
        row("LeasedStore ×2", "1 (hot)", "never reached", &f);
        let (hot_leased, hot_top) = (f.per_sec, top);
        let f = drive(&server, &plain, &tight, false, run).await;
        row("RedisStore ×2", "1 (hot)", "200k/s, burst 20k", &f);
        let (margin_plain, _, _) = bound_margin(&tight, &f, 0);
        let f = drive(&server, &leased, &tight, false, run).await;
        row("LeasedStore ×2", "1 (hot)", "200k/s, burst 20k", &f);
        let lifetime = DEFAULT_BUCKET_LIFETIME.as_nanos() as u64;
        let (margin, sum, span) = bound_margin(&tight, &f, lifetime);
        let spread_plain = drive(&server, &plain, &roomy, true, run).await;
        row("RedisStore ×2", "100k", "never reached", &spread_plain);
        let spread_leased = drive(&server, &leased, &roomy, true, run).await;
        row("LeasedStore ×2", "100k", "never reached", &spread_leased);

        println!();
        println!(
            "hot key with leases: {:.1}× the ceiling (target: 10×)",
            hot_leased / hot_top
        );
        println!(
            "bound B + r·(T + L + longest decision {:.1} ms), every span of 1 ms slots: tightest {sum} admitted in {:.0} ms, {margin} under the bound ({})",
            f.max_ns as f64 / 1e6,
            span as f64 / 1e6,
            if margin >= 0 { "holds" } else { "BROKEN" }
        );
        println!("(without leases, against B + r·(T + longest decision): {margin_plain} under)");
        let capacity = (tight.limit() as f64 + f.secs * 200_000.0) / f.secs;
        println!(
            "admitted under the exceeded limit: {:.0}/s with leases, of the {capacity:.0}/s the bucket could give (B + r·T over the row)",
            f.admitted as f64 / f.secs
        );
        println!(
            "100k keys never hot: {:.0}/s with leases, {:.0}/s without ({:+.1}%); client CPU {:.2} against {:.2} µs a decision",
            spread_leased.per_sec,
            spread_plain.per_sec,
            100.0 * (spread_leased.per_sec / spread_plain.per_sec - 1.0),
            spread_leased.cpu_us,
            spread_plain.cpu_us
        );
        // The wrapper's own cost on keys that are not hot, without the noise of the round
        // trip: each check built (the call prepared, its future boxed) and dropped unsent.
        let names: Vec<String> = (0..KEYS).map(|k| format!("k{k}")).collect();
        let prepare = |f: &dyn Fn(&str)| {
            let clock = SystemClock::new();
            let t = clock.now();
            for i in 0..1_000_000u64 {
                f(&names[(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as usize % names.len()]);
            }
            (clock.now() - t) as f64 / 1e6
        };
        let mut unsent = [0.0f64; 2];
        for _ in 0..3 {
            unsent[0] += prepare(&|k| drop(plain[0].check(k, &roomy, 1))) / 3.0;
            unsent[1] += prepare(&|k| drop(leased[0].check(k, &roomy, 1))) / 3.0;
        }
        println!(
            "a check on a key that is not hot, prepared and dropped unsent (1M keys' worth, 3 rounds): {:.0} ns with leases, {:.0} ns without",
            unsent[1], unsent[0]
        );
        let stats: Vec<_> = leased.iter().map(|s| s.stats()).collect();
        println!("lease stats: {stats:?}");
        for s in &leased {
            s.shutdown().await.expect("shutdown");
        }
        assert!(margin >= 0, "the bound was broken");
    });
}
