//! The same traces through `MemoryStore` and `RedisStore` (time injected from one
//! `ManualClock`) must give identical decisions, for every algorithm; and the shared test
//! vectors hold for the Lua scripts.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::store::redis::RedisStore;
use tollgate::{Check, Decision, MemoryStore, Policy, Rate};

use support::vectors::{self, T0};

async fn redis_store(url: &str, clock: &ManualClock, prefix: &str) -> RedisStore {
    RedisStore::builder()
        .url(url)
        .prefix(prefix)
        .timeout(Duration::from_secs(5))
        .injected_clock(clock.clone())
        .connect()
        .await
        .expect("connect")
}

fn parts(d: &Decision) -> (bool, u64, u64, u64, u64, usize) {
    (
        d.allowed(),
        d.limit(),
        d.remaining(),
        d.reset_after().as_nanos() as u64,
        d.retry_after().map_or(0, |r| r.as_nanos() as u64),
        d.index(),
    )
}

#[tokio::test]
async fn vectors_hold_for_the_lua_scripts() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    let store = redis_store(&server.url(), &clock, "vec:").await;
    for v in vectors::all() {
        for (i, s) in v.steps.iter().enumerate() {
            clock.set(Duration::from_nanos(T0 + s.at));
            let d = store.check(v.name, &v.policy, s.cost).await.unwrap();
            vectors::assert_step(&v, i, &d);
        }
    }
}

/// xorshift64*: a seeded generator, so a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn policies() -> Vec<Policy> {
    let ms = Duration::from_millis;
    vec![
        Policy::gcra(Rate::per_second(3), 4).unwrap(),
        Policy::gcra(Rate::new(7, ms(100)), 1).unwrap(),
        Policy::token_bucket(Rate::per_second(3), 5).unwrap(),
        Policy::token_bucket(Rate::new(1000, ms(1)), 20).unwrap(),
        Policy::leaky_bucket(Rate::per_second(3), 4).unwrap(),
        Policy::leaky_bucket(Rate::new(2, ms(7)), 9).unwrap(),
        Policy::fixed_window(5, ms(700)).unwrap(),
        Policy::fixed_window(100, Duration::from_secs(3600)).unwrap(),
        Policy::sliding_window(5, ms(700)).unwrap(),
        Policy::sliding_window(1_000_000_000, Duration::from_secs(3600)).unwrap(),
        Policy::sliding_window(7, ms(3)).unwrap(),
        Policy::sliding_log(5, ms(700)).unwrap(),
        Policy::sliding_log(50, ms(90)).unwrap(),
    ]
}

/// A time step: mostly small, sometimes none, sometimes past the policy's horizon.
fn step(rng: &mut Rng, p: &Policy) -> u64 {
    let w = p.window().as_nanos() as u64;
    match rng.below(10) {
        0 | 1 => 0,
        2 => w + rng.below(w),
        3 => rng.below(w / 2 + 1),
        _ => rng.below(w / 8 + 1),
    }
}

fn cost(rng: &mut Rng, p: &Policy) -> u64 {
    match rng.below(6) {
        0 => 0,
        1 => rng.below(p.limit() + 1),
        _ => 1 + rng.below(p.limit().min(3)),
    }
}

#[tokio::test]
async fn random_traces_decide_alike() {
    let server = redis_or_skip!();
    // More seeds on demand: TOLLGATE_DIFF_SEEDS=50 cargo test --features redis ...
    let rounds: u64 = std::env::var("TOLLGATE_DIFF_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    for (n, policy) in (0..rounds).flat_map(|_| policies()).enumerate() {
        let seed = 0x9e37_79b9_7f4a_7c15 ^ (n as u64 + 1);
        let mut rng = Rng(seed);
        let clock = ManualClock::new();
        // Start anywhere in the current epoch, not on a window boundary.
        clock.set(Duration::from_nanos(T0 + rng.below(1 << 40)));
        let memory = MemoryStore::with_clock(clock.clone());
        let redis = redis_store(&server.url(), &clock, &format!("diff{n}:")).await;
        let keys = ["a", "b", "c"];
        let steps = if policy.limit() > 1000 { 150 } else { 600 };
        for i in 0..steps {
            if rng.below(20) == 0 {
                // Time sometimes runs backwards (a wall clock stepped back): both stores must
                // treat it as the latest time the state has seen.
                let back = rng.below(policy.window().as_nanos() as u64 / 4 + 1);
                clock.set(clock.elapsed().saturating_sub(Duration::from_nanos(back)));
            }
            clock.advance(Duration::from_nanos(step(&mut rng, &policy)));
            let key = keys[rng.below(3) as usize];
            let cost = if policy.limit() > 1000 {
                rng.below(policy.limit() / 3)
            } else {
                cost(&mut rng, &policy)
            };
            let m = memory.check_now(key, &policy, cost).unwrap();
            let r = redis.check(key, &policy, cost).await.unwrap();
            assert_eq!(
                parts(&m),
                parts(&r),
                "{policy:?} seed {seed:#x} step {i}: key {key} cost {cost} at {}",
                clock.elapsed().as_nanos()
            );
        }
    }
}

#[tokio::test]
async fn random_stacked_checks_decide_alike() {
    let server = redis_or_skip!();
    let ps = policies();
    let mut rng = Rng(0x5eed);
    let clock = ManualClock::new();
    clock.set(Duration::from_nanos(T0 + rng.below(1 << 40)));
    let memory = MemoryStore::with_clock(clock.clone());
    let redis = redis_store(&server.url(), &clock, "stack:").await;
    let keys = ["u1", "u2", "tenant"];
    for i in 0..1500 {
        clock.advance(Duration::from_nanos(rng.below(50_000_000)));
        let n = 1 + rng.below(3) as usize;
        let picks: Vec<(usize, usize, u64)> = (0..n)
            .map(|_| {
                let p = rng.below(ps.len() as u64) as usize;
                let c = if ps[p].limit() > 1000 {
                    rng.below(1000)
                } else {
                    rng.below(3)
                };
                (rng.below(3) as usize, p, c)
            })
            .collect();
        let checks: Vec<Check<'_>> = picks
            .iter()
            .map(|&(k, p, c)| Check::new(keys[k], &ps[p], c))
            .collect();
        let m = memory.check_all_now(&checks);
        let r = redis.check_all(&checks).await;
        match (m, r) {
            (Ok(m), Ok(r)) => assert_eq!(parts(&m), parts(&r), "step {i}: {picks:?}"),
            (Err(m), Err(r)) => assert_eq!(m.to_string(), r.to_string()),
            (m, r) => panic!("step {i}: memory {m:?}, redis {r:?}"),
        }
    }
}
