//! The shared test vectors against the Rust algorithms (through `MemoryStore` and a
//! `ManualClock`); `tests/redis_differential.rs` runs the same table against the Lua scripts.

mod support;

use std::time::Duration;

use tollgate::MemoryStore;
use tollgate::clock::ManualClock;

#[test]
fn vectors_hold_for_the_rust_algorithms() {
    for v in support::vectors::all() {
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(clock.clone());
        for (i, s) in v.steps.iter().enumerate() {
            clock.set(Duration::from_nanos(support::vectors::T0 + s.at));
            let d = store.check_now("k", &v.policy, s.cost).unwrap();
            support::vectors::assert_step(&v, i, &d);
        }
    }
}
