//! cargo bench --bench memory_per_key
//!
//! Bytes per tracked key: tollgate's in-process store (each algorithm) and governor's keyed
//! limiter (`RateLimiter::keyed`), measured with a counting global allocator. Each limiter starts
//! empty, the keys (`user:0`, `user:1`, ...) are built beforehand, and then every key is checked
//! once (cost 1, admitted; 10 per second, burst 10), so that each holds one piece of live state.
//!
//! Two figures per limiter, each measured in a fresh process (so that no memory freed by an
//! earlier measurement is reused):
//! - **requested**: the net bytes the limiter asked the allocator for, divided by the number of
//!   keys: hash tables (with their spare capacity at that size), key copies, sliding log entries.
//!   It leaves out what the allocator adds per block (glibc rounds a 10-byte key copy up to a
//!   32-byte chunk), so the number of heap blocks per key is shown too;
//! - **resident**: the growth of the process's resident memory (`Rss` in
//!   `/proc/self/smaps_rollup`), divided by the number of keys: what the machine really pays,
//!   allocator overhead included (Linux only).
//!
//! A hash table doubles when it fills, so the figures depend on where the key count falls
//! between two powers of two: hence two sizes. And tollgate keeps a key of up to 23 bytes
//! inside its slot, so a third set has 32-byte keys.

#![allow(clippy::expect_used)] // a benchmark set-up that fails should stop loudly

use std::num::NonZeroU32;
use std::process::Command;
use std::time::Duration;

use governor::{Quota, RateLimiter};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tollgate::{MemoryStore, Policy, Rate};

#[global_allocator]
static GLOBAL: &StatsAlloc<std::alloc::System> = &INSTRUMENTED_SYSTEM;

const LIMITERS: [&str; 7] = [
    "gcra",
    "token_bucket",
    "leaky_bucket",
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "governor",
];
/// (key count, long keys?): short keys are `user:{i}`, long ones `api-key:{i:024}` (32 bytes,
/// past the 23 bytes tollgate keeps inside a slot).
const SETS: [(usize, bool); 3] = [(100_000, false), (1_000_000, false), (100_000, true)];

fn keys(count: usize, long: bool) -> Vec<String> {
    (0..count)
        .map(|i| {
            if long {
                format!("api-key:{i:024}")
            } else {
                format!("user:{i}")
            }
        })
        .collect()
}

fn policy(name: &str) -> Option<Policy> {
    let (rate, window) = (Rate::per_second(10), Duration::from_secs(1));
    let policy = match name {
        "gcra" => Policy::gcra(rate, 10),
        "token_bucket" => Policy::token_bucket(rate, 10),
        "leaky_bucket" => Policy::leaky_bucket(rate, 10),
        "fixed_window" => Policy::fixed_window(10, window),
        "sliding_window" => Policy::sliding_window(10, window),
        "sliding_log" => Policy::sliding_log(10, window),
        _ => return None,
    };
    Some(policy.expect("a valid policy"))
}

/// The process's resident memory in bytes, if the system says.
fn resident() -> Option<u64> {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = rollup.lines().find(|l| l.starts_with("Rss:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Fills one limiter with `count` keys and prints `requested blocks resident` per key.
fn measure(name: &str, count: usize, long: bool) {
    let keys = keys(count, long);
    let policy = policy(name);
    let store = MemoryStore::new();
    let governor = RateLimiter::keyed(Quota::per_second(NonZeroU32::new(10).expect("ten")));
    let before = resident();
    let region = Region::new(GLOBAL);
    match &policy {
        Some(policy) => {
            for key in &keys {
                let d = store.check_now(key, policy, 1).expect("a valid check");
                assert!(d.allowed());
            }
            assert_eq!(store.len(), count);
        }
        None => {
            for key in &keys {
                assert!(governor.check_key(key).is_ok());
            }
            assert_eq!(governor.len(), count);
        }
    }
    let change = region.change();
    let after = resident();
    let per_key = |x: f64| x / count as f64;
    let bytes = per_key(change.bytes_allocated as f64 - change.bytes_deallocated as f64);
    let blocks = per_key(change.allocations as f64 - change.deallocations as f64);
    let rss = match (before, after) {
        (Some(b), Some(a)) => format!("{:.1}", per_key(a as f64 - b as f64)),
        _ => "n/a".to_owned(),
    };
    println!("{bytes:.1} {blocks:.2} {rss}");
}

fn main() {
    // `cargo bench` passes `--bench`; a child gets `--one NAME COUNT LONG`.
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, name, count, long] = args.as_slice() {
        if flag == "--one" {
            measure(name, count.parse().expect("a key count"), long == "long");
            return;
        }
    }
    let me = std::env::current_exe().expect("the path of this benchmark");
    for (count, long) in SETS {
        let keys = keys(count, long);
        let (first, last) = (&keys[0], &keys[count - 1]);
        println!("\n{count} keys (`{first}` .. `{last}`):");
        drop(keys);
        println!(
            "  {:<24} {:>18} {:>14} {:>18}",
            "limiter", "requested B/key", "blocks/key", "resident B/key"
        );
        for name in LIMITERS {
            let out = Command::new(&me)
                .args(["--one", name, &count.to_string()])
                .arg(if long { "long" } else { "short" })
                .output()
                .expect("a child measurement");
            let text = String::from_utf8_lossy(&out.stdout);
            let fields: Vec<&str> = text.split_whitespace().collect();
            let label = match name {
                "governor" => "governor keyed".to_owned(),
                algorithm => format!("tollgate {algorithm}"),
            };
            match fields.as_slice() {
                [bytes, blocks, rss] => {
                    println!("  {label:<24} {bytes:>18} {blocks:>14} {rss:>18}")
                }
                _ => println!(
                    "  {label:<24} failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ),
            }
        }
    }
}
