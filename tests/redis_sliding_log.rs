//! The sliding log on Redis with large logs: a cross-slot refund touches only the newest
//! entries and a rejection finds its entries by bisection, in a few commands whatever the
//! length of the log, with the same decisions as `MemoryStore`. The commands a script issues
//! are read from the server's SLOWLOG (every command logged, inner script commands included).
//!
//! The ignored test `big_log_figures` gives the per-script figures of BENCHMARKS.md:
//!
//! ```sh
//! cargo test --features redis --test redis_sliding_log -- --ignored --nocapture
//! ```
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use futures_util::future::join_all;
use tollgate::clock::ManualClock;
use tollgate::store::redis::{KeySlots, RedisStore};
use tollgate::{Check, Decision, MAX_SLIDING_LOG_LIMIT, MemoryStore, Policy};

use support::vectors::T0;
use support::{RedisCluster, RedisServer};

const HOUR: Duration = Duration::from_secs(3600);

/// One list read of the log's head or tail: the header and 32 entries.
const WIDEST_READ: i64 = 66;

fn parts(d: &Decision) -> (bool, u64, u64, Duration, Option<Duration>, usize) {
    (
        d.allowed(),
        d.limit(),
        d.remaining(),
        d.reset_after(),
        d.retry_after(),
        d.index(),
    )
}

/// Log every command from now on (inner script commands included) and forget the past.
fn slowlog_on(node: &RedisServer) {
    node.cli(&["CONFIG", "SET", "slowlog-log-slower-than", "0"]);
    node.cli(&["CONFIG", "SET", "slowlog-max-len", "100000"]);
    node.cli(&["SLOWLOG", "RESET"]);
}

/// What the SLOWLOG holds: `redis-cli` prints each entry flat (id, time, microseconds, the
/// arguments, the client's address and name), one value a line.
struct Slowlog(Vec<String>);

impl Slowlog {
    fn read(node: &RedisServer) -> Self {
        let out = node.cli(&["SLOWLOG", "GET", "100000"]);
        Self(out.lines().map(str::to_owned).collect())
    }

    /// How many list commands (and DELs) the scripts issued, and the most list elements one
    /// LRANGE asked for (`i64::MAX` for a range from the head to the tail, such as `0 -1`).
    fn list_work(&self) -> (usize, i64) {
        const LIST: [&str; 11] = [
            "LRANGE", "LINDEX", "LLEN", "LSET", "LPOP", "RPOP", "LPUSH", "RPUSH", "LREM", "LTRIM",
            "DEL",
        ];
        let (mut commands, mut widest) = (0, 0);
        for (i, line) in self.0.iter().enumerate() {
            if !LIST.contains(&line.as_str()) {
                continue;
            }
            commands += 1;
            if line == "LRANGE" {
                let arg = |k: usize| self.0[i + k].parse::<i64>().unwrap();
                let (start, stop) = (arg(2), arg(3));
                let width = if (start < 0) == (stop < 0) {
                    stop - start + 1
                } else {
                    i64::MAX
                };
                widest = widest.max(width);
            }
        }
        (commands, widest)
    }

    /// The microseconds of each script run on `key`, oldest first, with whether it was a
    /// refund.
    fn scripts_on(&self, key: &str) -> Vec<(u64, bool)> {
        let mut out: Vec<(u64, bool)> = self
            .0
            .iter()
            .enumerate()
            .filter(|(i, line)| *line == "EVALSHA" && self.0[i + 3] == key)
            .map(|(i, _)| (self.0[i - 1].parse().unwrap(), self.0[i + 6] == "refund"))
            .collect();
        out.reverse();
        out
    }
}

/// Logs `n` requests of cost 1 on `key`, 1 ms apart, in both stores (pipelined on one
/// connection, so Redis sees them in order).
async fn fill(
    redis: &RedisStore,
    memory: &MemoryStore<ManualClock>,
    clock: &ManualClock,
    key: &str,
    policy: &Policy,
    n: usize,
) {
    let mut left = n;
    while left > 0 {
        let batch = left.min(2000);
        let mut calls = Vec::with_capacity(batch);
        for _ in 0..batch {
            clock.advance(Duration::from_millis(1));
            assert!(memory.check_now(key, policy, 1).unwrap().allowed());
            calls.push(redis.check(key, policy, 1));
        }
        for d in join_all(calls).await {
            assert!(d.unwrap().allowed());
        }
        left -= batch;
    }
}

#[tokio::test]
async fn rejections_on_a_large_log_bisect_instead_of_scanning() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    clock.set(Duration::from_nanos(T0 + 123_456_789));
    let redis = RedisStore::builder()
        .url(server.url())
        .pool_size(1)
        .timeout(Duration::from_secs(10))
        .injected_clock(clock.clone())
        .connect()
        .await
        .unwrap();
    let memory = MemoryStore::with_clock(clock.clone());
    let limit = MAX_SLIDING_LOG_LIMIT;
    let p = Policy::sliding_log(limit, HOUR).unwrap();
    const N: u64 = 20_000;
    fill(&redis, &memory, &clock, "big", &p, N as usize).await;
    let first = clock.elapsed() - Duration::from_millis(N - 1);
    // log2(N) reads to find the first live entry and as many to find the entry that decides
    // retry_after, a few to read the ends; scanning would take N / 32.
    let bound = 2 * (64 - N.leading_zeros() as usize) + 6;

    // Nothing expired; the entry that decides is half way.
    slowlog_on(&server);
    let cost = limit - N / 2;
    let m = memory.check_now("big", &p, cost).unwrap();
    let r = redis.check("big", &p, cost).await.unwrap();
    assert!(!m.allowed());
    assert_eq!(parts(&m), parts(&r));
    let (commands, widest) = Slowlog::read(&server).list_work();
    eprintln!("rejection: {commands} list commands, {widest} elements at most");
    assert!(
        commands <= bound && widest <= WIDEST_READ,
        "{commands} list commands (at most {bound}), {widest} elements at once"
    );

    // Three quarters have left the window (but no admission pruned them); all of the rest
    // has to expire for this cost.
    clock.set(first + HOUR + Duration::from_millis(3 * N / 4 - 1));
    slowlog_on(&server);
    let m = memory.check_now("big", &p, limit).unwrap();
    let r = redis.check("big", &p, limit).await.unwrap();
    assert_eq!(m.remaining(), limit - N / 4);
    assert_eq!(parts(&m), parts(&r));
    let (commands, widest) = Slowlog::read(&server).list_work();
    eprintln!("rejection: {commands} list commands, {widest} elements at most");
    assert!(
        commands <= bound && widest <= WIDEST_READ,
        "{commands} list commands (at most {bound}), {widest} elements at once"
    );

    // An admission prunes them at last, and both stores still agree.
    let m = memory.check_now("big", &p, 1).unwrap();
    let r = redis.check("big", &p, 1).await.unwrap();
    assert!(m.allowed());
    assert_eq!(parts(&m), parts(&r));
}

/// The Cluster node that holds `name`.
fn holder<'a>(cluster: &'a RedisCluster, name: &str) -> &'a RedisServer {
    cluster
        .nodes
        .iter()
        .find(|n| n.cli(&["EXISTS", name]).trim() == "1")
        .expect("a node holds the key")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_slot_refund_on_a_large_log_touches_only_its_newest_entry() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let clock = ManualClock::new();
    clock.set(Duration::from_nanos(T0 + 123_456_789));
    let redis = RedisStore::builder()
        .cluster(cluster.nodes())
        .key_slots(KeySlots::PerKey)
        .pool_size(1)
        .timeout(Duration::from_secs(10))
        .injected_clock(clock.clone())
        .connect()
        .await
        .unwrap();
    let memory = MemoryStore::with_clock(clock.clone());
    let tenant = Policy::sliding_log(MAX_SLIDING_LOG_LIMIT, HOUR).unwrap();
    let per_user = Policy::fixed_window(1, Duration::from_secs(86_400)).unwrap();
    fill(&redis, &memory, &clock, "tenant", &tenant, 20_000).await;
    let checks = [
        Check::new("user", &per_user, 1),
        Check::new("tenant", &tenant, 1),
    ];
    clock.advance(Duration::from_millis(1));
    assert!(memory.check_all_now(&checks).unwrap().allowed());
    assert!(redis.check_all(&checks).await.unwrap().allowed());
    let node = holder(&cluster, &redis.key_name("tenant", &tenant));

    // The user is over its limit: the tenant's log admits, then is refunded.
    for _ in 0..3 {
        clock.advance(Duration::from_millis(1));
        slowlog_on(node);
        let m = memory.check_all_now(&checks).unwrap();
        let r = redis.check_all(&checks).await.unwrap();
        assert!(!m.allowed() && m.index() == 0);
        assert_eq!(parts(&m), parts(&r));
        let log = Slowlog::read(node);
        let scripts = log.scripts_on(&redis.key_name("tenant", &tenant));
        assert_eq!(
            scripts.iter().map(|s| s.1).collect::<Vec<_>>(),
            [false, true],
            "one check, then one refund"
        );
        let (commands, widest) = log.list_work();
        eprintln!("check and refund: {commands} list commands, {widest} elements at most");
        assert!(
            commands <= 12 && widest <= WIDEST_READ,
            "{commands} list commands, {widest} elements at once"
        );
    }
    // Exact: the tenant's log is as if those calls had never come.
    let m = memory.check_now("tenant", &tenant, 0).unwrap();
    let r = redis.check("tenant", &tenant, 0).await.unwrap();
    assert_eq!(m.remaining(), MAX_SLIDING_LOG_LIMIT - 20_001);
    assert_eq!(parts(&m), parts(&r));
}

/// xorshift64*: a seeded generator, so a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// Logs longer than the entries read with the header (bisection over LINDEX), long expired
/// stretches, large costs, and a log that lives longer than its base may (rebased with live
/// entries): the same decisions as `MemoryStore`.
#[tokio::test]
async fn long_logs_decide_like_memory() {
    let server = redis_or_skip!();
    let ms = Duration::from_millis;
    let day = Duration::from_secs(86_400);
    // (policy, largest time step, largest cost)
    let cases = [
        (Policy::sliding_log(300, ms(90)).unwrap(), ms(2), 40),
        (Policy::sliding_log(64, ms(1000)).unwrap(), ms(20), 3),
        (
            Policy::sliding_log(2000, ms(50)).unwrap(),
            Duration::from_micros(200),
            2000,
        ),
        (Policy::sliding_log(1000, 20 * day).unwrap(), day / 4, 30),
    ];
    for (n, (policy, max_step, max_cost)) in cases.into_iter().enumerate() {
        let mut rng = Rng(0x51_1d1e_u64 + n as u64);
        let clock = ManualClock::new();
        clock.set(Duration::from_nanos(T0 + rng.below(1 << 40)));
        let memory = MemoryStore::with_clock(clock.clone());
        let redis = RedisStore::builder()
            .url(server.url())
            .prefix(format!("long{n}:"))
            .timeout(Duration::from_secs(10))
            .injected_clock(clock.clone())
            .connect()
            .await
            .unwrap();
        let max_step = max_step.as_nanos() as u64;
        for i in 0..1500 {
            let step = match rng.below(50) {
                0 => policy.window().as_nanos() as u64 / 2 + rng.below(max_step),
                1..=9 => 0,
                _ => rng.below(max_step + 1),
            };
            clock.advance(Duration::from_nanos(step));
            let cost = match rng.below(20) {
                0 => rng.below(policy.limit() + 1),
                1 => 0,
                _ => 1 + rng.below(max_cost),
            };
            let m = memory.check_now("k", &policy, cost).unwrap();
            let r = redis.check("k", &policy, cost).await.unwrap();
            assert_eq!(parts(&m), parts(&r), "{policy:?} step {i}: cost {cost}");
        }
    }
}

/// The check and refund scripts as the store builds them (`src/store/redis/mod.rs`), to run
/// them by hand in an order that concurrent calls only produce by chance.
const CHECK_LUA: &str = concat!(
    include_str!("../src/store/redis/common.lua"),
    include_str!("../src/store/redis/sliding_log.lua"),
    include_str!("../src/store/redis/check.lua"),
);
const REFUND_LUA: &str = concat!(
    include_str!("../src/store/redis/common.lua"),
    include_str!("../src/store/redis/sliding_log.lua"),
    include_str!("../src/store/redis/refund.lua"),
);

/// Refunds that land after other admissions on the same log (the entry refunded is not the
/// newest, or shares its time with other requests) are exact: the log is as if the refunded
/// call had never come, entry by entry.
#[tokio::test]
async fn refunds_behind_later_admissions_are_exact() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    clock.set(Duration::from_nanos(T0 + 123_456_789));
    let redis = RedisStore::builder()
        .url(server.url())
        .timeout(Duration::from_secs(10))
        .injected_clock(clock.clone())
        .connect()
        .await
        .unwrap();
    let memory = MemoryStore::with_clock(clock.clone());
    let tenant = Policy::sliding_log(40, HOUR).unwrap();
    let (limit, window) = (tenant.limit().to_string(), HOUR.as_nanos().to_string());
    let time = |clock: &ManualClock| {
        let ns = clock.elapsed().as_nanos();
        (
            (ns / 1_000_000_000).to_string(),
            (ns % 1_000_000_000).to_string(),
        )
    };
    // (costs of the requests at the refunded call's time, then 1 ms apart after it)
    let cases: [(&[u64], &[u64]); 5] = [
        (&[], &[1, 3]),
        (&[1], &[]),
        (&[2], &[1, 1, 2]),
        (&[], &[2; 12]),
        (&[1, 1], &[4]),
    ];
    for (n, (same_time, later)) in cases.into_iter().enumerate() {
        let key = format!("tenant{n}");
        let name = redis.key_name(&key, &tenant);
        // A stacked call consumes 2 here, and will be refunded (another slot rejected it).
        clock.advance(Duration::from_millis(1));
        let (sec, nsec) = time(&clock);
        let out = server.cli(&[
            "EVAL",
            CHECK_LUA,
            "1",
            &name,
            &sec,
            &nsec,
            "1000",
            "sliding_log",
            &limit,
            &window,
            "2",
            &window,
            "",
        ]);
        let out: Vec<&str> = out.lines().collect();
        assert_eq!(out[..2], ["1", "1"], "{out:?}");
        let (ref_b, ref_t) = (out[5], out[6]);
        for &cost in same_time {
            assert!(redis.check(&key, &tenant, cost).await.unwrap().allowed());
            assert!(memory.check_now(&key, &tenant, cost).unwrap().allowed());
        }
        for &cost in later {
            clock.advance(Duration::from_millis(1));
            assert!(redis.check(&key, &tenant, cost).await.unwrap().allowed());
            assert!(memory.check_now(&key, &tenant, cost).unwrap().allowed());
        }
        let (sec, nsec) = time(&clock);
        server.cli(&[
            "EVAL",
            REFUND_LUA,
            "1",
            &name,
            &sec,
            &nsec,
            "refund",
            "sliding_log",
            &limit,
            &window,
            "2",
            &window,
            "",
            ref_b,
            ref_t,
        ]);
        // Which entries are left, and with what costs, shows in retry_after for each cost
        // over what remains (rejections change nothing).
        clock.advance(Duration::from_millis(1));
        let m = memory.check_now(&key, &tenant, 0).unwrap();
        let r = redis.check(&key, &tenant, 0).await.unwrap();
        assert_eq!(parts(&m), parts(&r), "case {n}");
        for cost in m.remaining() + 1..=tenant.limit() {
            let m = memory.check_now(&key, &tenant, cost).unwrap();
            let r = redis.check(&key, &tenant, cost).await.unwrap();
            assert!(!m.allowed());
            assert_eq!(parts(&m), parts(&r), "case {n}, cost {cost}");
        }
    }
    // A refund of the only entry leaves no key behind.
    let name = redis.key_name("alone", &tenant);
    let (sec, nsec) = time(&clock);
    let out = server.cli(&[
        "EVAL",
        CHECK_LUA,
        "1",
        &name,
        &sec,
        &nsec,
        "1000",
        "sliding_log",
        &limit,
        &window,
        "3",
        &window,
        "",
    ]);
    let out: Vec<&str> = out.lines().collect();
    server.cli(&[
        "EVAL",
        REFUND_LUA,
        "1",
        &name,
        &sec,
        &nsec,
        "refund",
        "sliding_log",
        &limit,
        &window,
        "3",
        &window,
        "",
        out[5],
        out[6],
    ]);
    assert_eq!(server.cli(&["EXISTS", &name]).trim(), "0");
}

/// The figures of BENCHMARKS.md: one cross-slot `check_all` (a user's fixed window and a
/// tenant's sliding log of 500,000 entries, in different slots) that is refunded on the
/// tenant, or rejected by it; microseconds per script on the tenant's node, from SLOWLOG.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: fills a 500,000-entry log (about a minute)"]
async fn big_log_figures() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let clock = ManualClock::new();
    clock.set(Duration::from_nanos(T0 + 123_456_789));
    let redis = RedisStore::builder()
        .cluster(cluster.nodes())
        .pool_size(1)
        .timeout(Duration::from_secs(30))
        .injected_clock(clock.clone())
        .connect()
        .await
        .unwrap();
    let memory = MemoryStore::with_clock(clock.clone());
    let limit = MAX_SLIDING_LOG_LIMIT;
    let tenant = Policy::sliding_log(limit, HOUR).unwrap();
    let over = Policy::fixed_window(1, Duration::from_secs(86_400)).unwrap();
    let under = Policy::fixed_window(1 << 40, Duration::from_secs(86_400)).unwrap();
    const N: u64 = 500_000;
    fill(&redis, &memory, &clock, "tenant", &tenant, N as usize).await;
    let first = clock.elapsed() - Duration::from_millis(N - 1);
    let name = redis.key_name("tenant", &tenant);
    let node = holder(&cluster, &name);
    let len: u64 = node.cli(&["LLEN", &name]).trim().parse().unwrap();
    let bytes = node.cli(&["MEMORY", "USAGE", &name, "SAMPLES", "0"]);
    eprintln!("log: {len} list elements, {} bytes", bytes.trim());

    assert!(redis.check("user", &over, 1).await.unwrap().allowed());
    let bench = Bench {
        clock: &clock,
        redis: &redis,
        node,
        name: &name,
        tenant: &tenant,
    };
    bench
        .run("refunded (the user is over its limit)", &over, 1)
        .await;
    bench
        .run("rejected, 1 entry must expire", &under, limit - N + 1)
        .await;
    let half = limit - N / 2;
    bench
        .run("rejected, half of the entries must expire", &under, half)
        .await;
    clock.set(first + HOUR + Duration::from_millis(N / 2 - 1));
    let label = "rejected, half expired (not pruned), the rest must expire";
    bench.run(label, &under, limit).await;
}

struct Bench<'a> {
    clock: &'a ManualClock,
    redis: &'a RedisStore,
    node: &'a RedisServer,
    name: &'a str,
    tenant: &'a Policy,
}

impl Bench<'_> {
    /// Runs `[user, tenant]` (tenant with `cost`) a few times, all rejected, and prints the
    /// median microseconds of the tenant's scripts.
    async fn run(&self, label: &str, user: &Policy, cost: u64) {
        const ROUNDS: usize = 21;
        let median = |mut v: Vec<u64>| {
            v.sort_unstable();
            v.get(v.len() / 2)
                .map_or("-".to_owned(), |us| format!("{us} µs"))
        };
        let (mut checks, mut refunds) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            self.clock.advance(Duration::from_nanos(1));
            slowlog_on(self.node);
            let d = self
                .redis
                .check_all(&[
                    Check::new("user", user, 1),
                    Check::new("tenant", self.tenant, cost),
                ])
                .await
                .unwrap();
            assert!(!d.allowed(), "{label}");
            for (us, refund) in Slowlog::read(self.node).scripts_on(self.name) {
                if refund {
                    refunds.push(us);
                } else {
                    checks.push(us);
                }
            }
        }
        eprintln!(
            "{label}: check {}, refund {} (median of {ROUNDS})",
            median(checks),
            median(refunds)
        );
    }
}
