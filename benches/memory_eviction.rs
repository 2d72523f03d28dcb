//! cargo bench --bench memory_eviction [-- SCENARIO]
//!
//! What a new key costs a full shard of the in-process store: one shard of 16,384 pairs, on a
//! manual clock, filled before the clock starts; then new keys, each checked once, and the time
//! per new key (the least of five runs). Scenarios (all by default, or the one named, once,
//! with an optional count of new keys: `valgrind --tool=cachegrind` counts the instructions of
//! a scenario with 65,536 new keys and with none, and the difference divided by 65,536 is the
//! instructions per new key):
//!
//! - `steady-P` (P = 100, 99, 98, 95, 90): one new key per microsecond, each recovering after
//!   P % of the shard's capacity in microseconds, so at 100 % one pair recovers per new key
//!   and nothing live is forgotten (GCRA, one per 16,384·P/100 µs, burst 1);
//! - `flood-ALG` (ALG = gcra, sliding_window, sliding_log, fixed_window): a flood of new keys
//!   in a shard full of live state (5 per 15 minutes, one request per key, one new key per
//!   microsecond): nothing recovers, so every pair the shard makes room for is forgotten live,
//!   and the shard is full of pairs that consumed one unit each.

#![allow(clippy::expect_used)]
// a benchmark set-up that fails should stop loudly
// Timing a run needs the real clock, not the store's manual one.
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use tollgate::clock::ManualClock;
use tollgate::{MemoryStore, Policy, Rate};

const CAP: usize = 16_384;
/// New keys per run, past the fill.
const NEW: usize = 4 * CAP;

fn store() -> MemoryStore<ManualClock> {
    MemoryStore::builder()
        .clock(ManualClock::new())
        .max_keys(CAP)
        .shards(1)
        .build()
}

fn policy(name: &str) -> Option<Policy> {
    let w = Duration::from_secs(15 * 60);
    let p = match name {
        "gcra" => Policy::gcra(Rate::new(5, w), 5),
        "sliding_window" => Policy::sliding_window(5, w),
        "sliding_log" => Policy::sliding_log(5, w),
        "fixed_window" => Policy::fixed_window(5, w),
        _ => return None,
    };
    Some(p.expect("policy"))
}

/// Fills a shard with `policy`, one key per microsecond, then times `new` more: ns per new key,
/// and how many live pairs were forgotten.
fn run(policy: &Policy, new: usize) -> (f64, u64) {
    let store = store();
    let keys: Vec<String> = (0..CAP + new).map(|i| format!("k{i}")).collect();
    let us = Duration::from_micros(1);
    for key in &keys[..CAP] {
        black_box(store.check_now(key, policy, 1).expect("check"));
        store.clock().advance(us);
    }
    let evicted = store.evicted();
    let start = Instant::now();
    for key in &keys[CAP..] {
        black_box(store.check_now(key, policy, 1).expect("check"));
        store.clock().advance(us);
    }
    let ns = start.elapsed().as_nanos() as f64 / new.max(1) as f64;
    assert!(store.len() <= CAP);
    (ns, store.evicted() - evicted)
}

fn scenario(name: &str) -> Option<Policy> {
    if let Some(p) = name.strip_prefix("steady-") {
        let percent: u64 = p.parse().ok()?;
        let every = Duration::from_micros(CAP as u64 * percent / 100);
        return Some(Policy::gcra(Rate::new(1, every), 1).expect("policy"));
    }
    policy(name.strip_prefix("flood-")?)
}

fn main() {
    let all = [
        "steady-100",
        "steady-99",
        "steady-98",
        "steady-95",
        "steady-90",
        "flood-gcra",
        "flood-sliding_window",
        "flood-sliding_log",
        "flood-fixed_window",
    ];
    // `cargo bench` passes `--bench`; any other argument names a scenario.
    let chosen: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let (names, runs, new): (Vec<&str>, usize, usize) = match chosen.as_slice() {
        [] => (all.to_vec(), 5, NEW),
        [one] => (vec![one.as_str()], 1, NEW),
        [one, new, ..] => (
            vec![one.as_str()],
            1,
            new.parse().expect("a count of new keys"),
        ),
    };
    println!("| scenario | ns per new key (least of {runs}) | live pairs forgotten |");
    println!("| --- | ---: | ---: |");
    for name in names {
        let policy = scenario(name).expect("a scenario: steady-P or flood-ALG");
        let mut best = f64::MAX;
        let mut evicted = 0;
        for _ in 0..runs {
            let (ns, e) = run(&policy, new);
            best = best.min(ns);
            evicted = e;
        }
        println!("| {name} | {best:.0} | {evicted} |");
    }
}
