//! cargo bench --bench memory_per_key
//!
//! Bytes per tracked key: tollgate's in-process store (each algorithm) and governor's keyed
//! limiter, measured with a counting global allocator. Each limiter starts empty, the keys are
//! built beforehand, and then every key is checked once (cost 1, admitted), so that each holds
//! one piece of live state. What the allocator was asked for, net, divided by the number of
//! keys is the figure: the hash tables (including their spare capacity at that size), the
//! copies of the keys, and for the sliding log its entries.
//!
//! Two things the figure leaves out, the same for both: the allocator's own overhead per block
//! (glibc rounds a 10-byte key copy up to a 32-byte chunk, for example), shown separately as the
//! number of heap blocks per key; and that a hash table doubles, so the figure depends on where
//! the key count falls between two powers of two (hence two sizes).

#![allow(clippy::expect_used)] // a benchmark set-up that fails should stop loudly

use std::num::NonZeroU32;
use std::time::Duration;

use governor::{Quota, RateLimiter};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tollgate::{MemoryStore, Policy, Rate};

#[global_allocator]
static GLOBAL: &StatsAlloc<std::alloc::System> = &INSTRUMENTED_SYSTEM;

/// Net bytes and blocks allocated while `fill` runs, per key.
fn per_key(keys: usize, fill: impl FnOnce()) -> (f64, f64) {
    let region = Region::new(GLOBAL);
    fill();
    let change = region.change();
    let bytes = change.bytes_allocated as f64 - change.bytes_deallocated as f64;
    let blocks = change.allocations as f64 - change.deallocations as f64;
    (bytes / keys as f64, blocks / keys as f64)
}

fn main() {
    // `cargo bench` passes `--bench`; this binary takes no options.
    let policies = [
        ("gcra", Policy::gcra(Rate::per_second(10), 10)),
        (
            "token_bucket",
            Policy::token_bucket(Rate::per_second(10), 10),
        ),
        (
            "leaky_bucket",
            Policy::leaky_bucket(Rate::per_second(10), 10),
        ),
        (
            "fixed_window",
            Policy::fixed_window(10, Duration::from_secs(1)),
        ),
        (
            "sliding_window",
            Policy::sliding_window(10, Duration::from_secs(1)),
        ),
        (
            "sliding_log",
            Policy::sliding_log(10, Duration::from_secs(1)),
        ),
    ];
    println!("bytes per tracked key (net heap bytes requested / keys; heap blocks per key)");
    for count in [100_000usize, 1_000_000] {
        let keys: Vec<String> = (0..count).map(|i| format!("user:{i}")).collect();
        let key_len = keys.iter().map(String::len).sum::<usize>() as f64 / count as f64;
        println!("\n{count} keys of {key_len:.1} bytes on average:");
        for (name, policy) in &policies {
            let policy = policy.as_ref().expect("a valid policy");
            let store = MemoryStore::new();
            let (bytes, blocks) = per_key(count, || {
                for key in &keys {
                    let d = store.check_now(key, policy, 1).expect("a valid check");
                    assert!(d.allowed());
                }
            });
            assert_eq!(store.len(), count);
            println!("  tollgate {name:<16} {bytes:>6.1} bytes/key  {blocks:.2} blocks/key");
        }
        let quota = Quota::per_second(NonZeroU32::new(10).expect("ten"));
        let governor = RateLimiter::keyed(quota);
        let (bytes, blocks) = per_key(count, || {
            for key in &keys {
                assert!(governor.check_key(key).is_ok());
            }
        });
        assert_eq!(governor.len(), count);
        println!("  governor keyed          {bytes:>6.1} bytes/key  {blocks:.2} blocks/key");
    }
}
