//! Test vectors: one table, run against the Rust algorithms (`tests/algorithm_vectors.rs`)
//! and the Lua scripts (`tests/redis_differential.rs`). Times are offsets from `T0`, a Unix
//! time in nanoseconds (2026-01-01), so that the scripts meet realistic epoch values.

use std::time::Duration;

use tollgate::{Decision, Policy, Rate};

/// 2026-01-01T00:00:00Z in nanoseconds since the Unix epoch: a multiple of every window here.
pub const T0: u64 = 1_767_225_600_000_000_000;

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

/// One request and the decision it must get.
#[derive(Clone, Copy, Debug)]
pub struct Step {
    pub at: u64,
    pub cost: u64,
    pub allowed: bool,
    pub remaining: u64,
    pub reset: u64,
    pub retry: u64,
}

const fn ok(at: u64, cost: u64, remaining: u64, reset: u64) -> Step {
    Step {
        at,
        cost,
        allowed: true,
        remaining,
        reset,
        retry: 0,
    }
}

const fn no(at: u64, cost: u64, remaining: u64, reset: u64, retry: u64) -> Step {
    Step {
        at,
        cost,
        allowed: false,
        remaining,
        reset,
        retry,
    }
}

/// A named policy and the steps one key goes through.
pub struct Vector {
    pub name: &'static str,
    pub policy: Policy,
    pub steps: Vec<Step>,
}

pub fn all() -> Vec<Vector> {
    let hour = Duration::from_secs(3600);
    vec![
        Vector {
            name: "gcra 5/s burst 2",
            policy: Policy::gcra(Rate::per_second(5), 2).unwrap(),
            steps: vec![
                ok(0, 1, 1, 200 * MS),
                ok(0, 1, 0, 400 * MS),
                no(100 * MS, 1, 0, 300 * MS, 100 * MS),
                no(100 * MS, 2, 0, 300 * MS, 300 * MS),
                ok(300 * MS, 1, 0, 300 * MS),
                ok(5 * S, 2, 0, 400 * MS),
                ok(5 * S, 0, 0, 400 * MS),
            ],
        },
        Vector {
            name: "token bucket 5/s burst 2",
            policy: Policy::token_bucket(Rate::per_second(5), 2).unwrap(),
            steps: vec![
                ok(0, 1, 1, 200 * MS),
                ok(0, 1, 0, 400 * MS),
                no(100 * MS, 1, 0, 300 * MS, 100 * MS),
                ok(300 * MS, 1, 0, 300 * MS),
                no(300 * MS, 2, 0, 300 * MS, 300 * MS),
            ],
        },
        Vector {
            name: "leaky bucket 2/s capacity 3",
            policy: Policy::leaky_bucket(Rate::per_second(2), 3).unwrap(),
            steps: vec![
                ok(0, 2, 1, 1000 * MS),
                no(250 * MS, 2, 1, 750 * MS, 250 * MS),
                ok(250 * MS, 1, 0, 1250 * MS),
            ],
        },
        Vector {
            name: "fixed window 3 per second",
            policy: Policy::fixed_window(3, Duration::from_secs(1)).unwrap(),
            steps: vec![
                ok(S - 1, 2, 1, 1),
                no(S - 1, 2, 1, 1, 1),
                ok(S, 2, 1, S),
                ok(S + 500 * MS, 1, 0, 500 * MS),
                no(S + 500 * MS, 1, 0, 500 * MS, 500 * MS),
            ],
        },
        Vector {
            name: "sliding window 4 per second",
            policy: Policy::sliding_window(4, Duration::from_secs(1)).unwrap(),
            steps: vec![
                ok(500 * MS, 3, 1, 1500 * MS),
                ok(1250 * MS, 2, 0, 1750 * MS),
                no(1250 * MS, 1, 0, 1750 * MS, 83_333_334),
            ],
        },
        Vector {
            // prev * (W - elapsed) reaches 3.6e21, far past 2^53: the exact muldiv path.
            name: "sliding window 1e9 per hour",
            policy: Policy::sliding_window(1_000_000_000, hour).unwrap(),
            steps: vec![
                ok(10 * MS, 999_999_999, 1, 7200 * S - 10 * MS),
                // q = floor(999_999_999 * 3599 / 3600) = 999_722_221, so 277_779 fit.
                ok(3601 * S, 277_779, 0, 7199 * S),
                no(3601 * S, 1, 0, 7199 * S, 802),
            ],
        },
        Vector {
            name: "sliding log 3 per second",
            policy: Policy::sliding_log(3, Duration::from_secs(1)).unwrap(),
            steps: vec![
                ok(0, 1, 2, S),
                ok(400 * MS, 2, 0, S),
                no(600 * MS, 1, 0, 800 * MS, 400 * MS),
                ok(S, 1, 0, S),
                no(S + 100 * MS, 3, 0, 900 * MS, 900 * MS),
            ],
        },
    ]
}

/// Asserts that `d`, the decision for step `i` of `v`, is the one the table gives.
pub fn assert_step(v: &Vector, i: usize, d: &Decision) {
    let s = &v.steps[i];
    let got = (
        d.allowed(),
        d.remaining(),
        d.reset_after().as_nanos() as u64,
        d.retry_after().map_or(0, |r| r.as_nanos() as u64),
    );
    assert_eq!(
        got,
        (s.allowed, s.remaining, s.reset, s.retry),
        "{} step {i}",
        v.name
    );
}
