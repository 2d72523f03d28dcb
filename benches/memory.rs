//! cargo bench --bench memory -- --warm-up-time 1 --measurement-time 3
//! MEMORY_BENCH_INTERLEAVED=1000 cargo bench --bench memory   # one thread, interleaved (~10 s)
//!
//! The in-process check, per algorithm, against governor's keyed limiter on the same workloads in
//! the same run. Only the decision is timed: the keys are built before the clock starts and the
//! loop does nothing but check and keep the answer alive.
//!
//! Workloads (every group name is `{traffic}/{keys}/{threads}`):
//! - traffic `admit`: a limit so generous that every check is admitted, so every check writes
//!   state (the common case of a service under its limits); `reject`: 10 per second, burst 10,
//!   so after the first few checks every key is over its limit (the cheap path of both);
//! - keys `hot`: one key; `100k`: 100,000 keys visited round-robin;
//! - threads `1t`: one thread; `2t`: two threads each doing half of the checks on the same
//!   limiter, timed from when both start to when both end (per-check time is wall time divided
//!   by all checks, so it is the inverse of the throughput of the pair).
//!
//! Both limiters read the machine's monotonic clock: tollgate's `SystemClock`, and governor's
//! default clock (`RateLimiter::keyed`, a `QuantaClock`); the group `clock` times one reading of
//! each, the floor under every check. BENCHMARKS.md has the figures.
//!
//! With `MEMORY_BENCH_INTERLEAVED=<rounds>`, criterion is left out: the one-thread workloads of
//! every limiter run in alternation, one batch of checks each per round (`MEMORY_BENCH_BATCH`,
//! 2,000 by default), so that a busy machine's load falls on all of them alike; it prints each
//! one's median and lowest batch per check and governor's median divided by its own.

#![allow(clippy::expect_used)]
// a benchmark set-up that fails should stop loudly
// Timing the threads of a two-thread run needs the real clock, not a limiter's.
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::Criterion;
use governor::clock::QuantaClock;
use governor::{Quota, RateLimiter};
use tollgate::clock::{Clock, SystemClock};
use tollgate::{MemoryStore, Policy, Rate};

const KEYS: usize = 100_000;

/// The two kinds of traffic: what a window admits (or a bucket holds) per what span.
#[derive(Clone, Copy)]
enum Traffic {
    /// One million per millisecond: a bucket's emission interval is 1 ns, so a check (tens of
    /// nanoseconds apart from the previous one on the same key) always finds room.
    Admit,
    /// Ten per second, burst ten.
    Reject,
}

impl Traffic {
    fn name(self) -> &'static str {
        match self {
            Traffic::Admit => "admit",
            Traffic::Reject => "reject",
        }
    }

    fn limit_and_span(self) -> (u32, Duration) {
        match self {
            Traffic::Admit => (1_000_000, Duration::from_millis(1)),
            Traffic::Reject => (10, Duration::from_secs(1)),
        }
    }

    fn policies(self) -> Vec<(&'static str, Policy)> {
        let (limit, span) = self.limit_and_span();
        let (limit, rate) = (u64::from(limit), Rate::new(u64::from(limit), span));
        let policies = [
            ("gcra", Policy::gcra(rate, limit)),
            ("token_bucket", Policy::token_bucket(rate, limit)),
            ("leaky_bucket", Policy::leaky_bucket(rate, limit)),
            ("fixed_window", Policy::fixed_window(limit, span)),
            ("sliding_window", Policy::sliding_window(limit, span)),
            ("sliding_log", Policy::sliding_log(limit, span)),
        ];
        policies
            .into_iter()
            .map(|(name, p)| (name, p.expect("a valid benchmark policy")))
            .collect()
    }

    /// The same rate and burst for governor.
    fn quota(self) -> Quota {
        let (limit, span) = self.limit_and_span();
        let burst = NonZeroU32::new(limit).expect("a positive limit");
        Quota::with_period(span / limit)
            .expect("a positive period")
            .allow_burst(burst)
    }
}

/// The keys a workload visits, built once.
struct Keys {
    name: &'static str,
    keys: Vec<String>,
}

fn key_sets() -> [Keys; 2] {
    [
        Keys {
            name: "hot",
            keys: vec!["user:hot".to_owned()],
        },
        Keys {
            name: "100k",
            keys: (0..KEYS).map(|i| format!("user:{i}")).collect(),
        },
    ]
}

/// Runs `iters` checks on `threads` threads, round-robin over `keys`, and returns the wall time
/// from the moment all threads start to the moment the last one ends. `cursor` carries the
/// position in the key list from one sample to the next, so that no sample starts on keys the
/// previous one left in the cache.
fn run<F>(check: &F, keys: &[String], cursor: &AtomicUsize, threads: usize, iters: u64) -> Duration
where
    F: Fn(&String) -> bool + Sync,
{
    let per_thread = iters.div_ceil(threads as u64);
    let base = cursor.fetch_add(per_thread as usize, Ordering::Relaxed) % keys.len();
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                // Each thread starts at its own place in the list (on one hot key, the same).
                let mut i = (base + t * keys.len() / threads) % keys.len();
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..per_thread {
                        black_box(check(black_box(&keys[i])));
                        i += 1;
                        if i == keys.len() {
                            i = 0;
                        }
                    }
                    (start, Instant::now())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a benchmark thread"))
            .collect()
    });
    let start = spans
        .iter()
        .map(|s| s.0)
        .min()
        .expect("one thread at least");
    let end = spans
        .iter()
        .map(|s| s.1)
        .max()
        .expect("one thread at least");
    // Scale to exactly `iters` checks when `iters` does not divide evenly.
    (end - start).mul_f64(iters as f64 / (per_thread * threads as u64) as f64)
}

fn bench_workload<F>(
    c: &mut Criterion,
    group: &str,
    name: &str,
    keys: &[String],
    threads: usize,
    check: F,
) where
    F: Fn(&String) -> bool + Sync,
{
    let cursor = AtomicUsize::new(0);
    // Touch every key once first, so that the store holds them all before timing.
    for key in keys {
        check(key);
    }
    c.benchmark_group(group).bench_function(name, |b| {
        b.iter_custom(|iters| run(&check, keys, &cursor, threads, iters))
    });
}

fn in_process(c: &mut Criterion) {
    for traffic in [Traffic::Admit, Traffic::Reject] {
        for keys in key_sets() {
            for threads in [1, 2] {
                let group = format!("{}/{}/{threads}t", traffic.name(), keys.name);
                for (name, policy) in traffic.policies() {
                    let store = MemoryStore::new();
                    bench_workload(c, &group, name, &keys.keys, threads, |key| {
                        store.check_now(key, &policy, 1).is_ok_and(|d| d.allowed())
                    });
                }
                let governor = RateLimiter::keyed(traffic.quota());
                bench_workload(c, &group, "governor", &keys.keys, threads, |key| {
                    governor.check_key(key).is_ok()
                });
            }
        }
    }
}

/// The floor under every check: one reading of each limiter's clock.
fn clocks(c: &mut Criterion) {
    let mut group = c.benchmark_group("clock");
    let tollgate = SystemClock::new();
    group.bench_function("tollgate_system_clock", |b| b.iter(|| tollgate.now()));
    let governor = QuantaClock::default();
    group.bench_function("governor_quanta_clock", |b| {
        b.iter(|| governor::clock::Clock::now(&governor))
    });
    group.finish();
}

/// One thread, round after round: in each round every (workload, limiter) pair runs one batch
/// of `batch` checks, timed, in turn, so that a neighbour's load falls on every pair alike.
/// Per pair, the median and the lowest batch, per check: on a busy machine the lowest is the
/// batch that no other process cut into.
fn interleaved(rounds: usize, batch: usize) {
    type Limiter<'a> = Box<dyn Fn(&String) -> bool + 'a>;
    struct Pair<'a> {
        workload: String,
        name: &'static str,
        keys: &'a [String],
        check: Limiter<'a>,
        cursor: usize,
        times: Vec<f64>,
    }
    let key_sets = key_sets();
    let mut pairs: Vec<Pair<'_>> = Vec::new();
    for traffic in [Traffic::Admit, Traffic::Reject] {
        for keys in &key_sets {
            let workload = format!("{}/{}/1t", traffic.name(), keys.name);
            for (name, policy) in traffic.policies() {
                let store = MemoryStore::new();
                let check: Limiter<'_> = Box::new(move |key: &String| {
                    store.check_now(key, &policy, 1).is_ok_and(|d| d.allowed())
                });
                pairs.push(Pair {
                    workload: workload.clone(),
                    name,
                    keys: &keys.keys,
                    check,
                    cursor: 0,
                    times: Vec::with_capacity(rounds),
                });
            }
            let governor = RateLimiter::keyed(traffic.quota());
            pairs.push(Pair {
                workload: workload.clone(),
                name: "governor",
                keys: &keys.keys,
                check: Box::new(move |key: &String| governor.check_key(key).is_ok()),
                cursor: 0,
                times: Vec::with_capacity(rounds),
            });
        }
    }
    for pair in &pairs {
        for key in pair.keys {
            (pair.check)(key);
        }
    }
    for _ in 0..rounds {
        for pair in &mut pairs {
            let (keys, check) = (pair.keys, &pair.check);
            let mut i = pair.cursor;
            let start = Instant::now();
            for _ in 0..batch {
                black_box(check(black_box(&keys[i])));
                i += 1;
                if i == keys.len() {
                    i = 0;
                }
            }
            let took = start.elapsed();
            pair.cursor = i;
            pair.times.push(took.as_nanos() as f64 / batch as f64);
        }
    }
    println!(
        "ns per check, {rounds} rounds of {batch} checks: the median batch, the lowest in \
         brackets; then governor's median divided by this one's (above 1: tollgate is faster)"
    );
    let stats: Vec<(f64, f64)> = pairs
        .iter_mut()
        .map(|pair| {
            pair.times.sort_by(f64::total_cmp);
            (pair.times[pair.times.len() / 2], pair.times[0])
        })
        .collect();
    for (pair, (median, lowest)) in pairs.iter().zip(&stats) {
        let governor = pairs
            .iter()
            .zip(&stats)
            .find(|(p, _)| p.workload == pair.workload && p.name == "governor")
            .map_or(f64::NAN, |(_, s)| s.0);
        println!(
            "{:<16} {:<15} {median:>7.1} ({lowest:>5.1})  {:.2}x",
            pair.workload,
            pair.name,
            governor / median
        );
    }
}

fn main() {
    // `MEMORY_BENCH_INTERLEAVED=<rounds>`: the one-thread workloads of every limiter in
    // alternation (`MEMORY_BENCH_BATCH` checks a batch, 2,000 by default), a minute or so.
    if let Some(rounds) = std::env::var("MEMORY_BENCH_INTERLEAVED")
        .ok()
        .and_then(|r| r.parse().ok())
    {
        let batch = std::env::var("MEMORY_BENCH_BATCH")
            .ok()
            .and_then(|b| b.parse().ok())
            .unwrap_or(2_000);
        interleaved(rounds, batch);
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    clocks(&mut c);
    in_process(&mut c);
    c.final_summary();
}
