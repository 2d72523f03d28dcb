//! The Redis store on a single node: hostile keys, expiries, script reloads, the deny cache,
//! and the errors it reports.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use tollgate::store::redis::{RedisStore, UnsupportedPolicy};
use tollgate::{Check, Policy, Rate, StoreError};

/// Generous: these tests are about decisions and keys, not speed, and CI machines stall.
const SLOW_MACHINE: Duration = Duration::from_secs(5);

fn all_algorithms() -> Vec<Policy> {
    let day = Duration::from_secs(86_400);
    vec![
        Policy::fixed_window(1, day).unwrap(),
        Policy::sliding_window(1, day).unwrap(),
        Policy::sliding_log(1, day).unwrap(),
        Policy::token_bucket(Rate::per_hour(1), 1).unwrap(),
        Policy::leaky_bucket(Rate::per_hour(1), 1).unwrap(),
        Policy::gcra(Rate::per_hour(1), 1).unwrap(),
    ]
}

#[tokio::test]
async fn hostile_keys_stay_in_their_namespace_and_every_key_expires() {
    let server = redis_or_skip!();
    let store = RedisStore::builder()
        .timeout(SLOW_MACHINE)
        .url(server.url())
        .prefix("hostile:")
        .connect()
        .await
        .unwrap();
    let long = "k".repeat(20 * 1024);
    let longer = format!("{long}k");
    let keys: Vec<&str> = vec![
        "{slot}",
        "a}b{c",
        "{}",
        "line\nbreak",
        "line\nbreak\n",
        "\r\n*3\r\n$3\r\nDEL\r\n",
        "tab\there",
        "ключ🔑",
        "%7B",
        "{",
        "#deadbeef",
        "",
        " ",
        "a",
        "a:fw:0000000000000000:a",
        &long,
        &longer,
    ];
    let policies = all_algorithms();
    for p in &policies {
        for k in &keys {
            assert!(store.check(k, p, 1).await.unwrap().allowed(), "{k:?} {p:?}");
        }
        // Each key has its own state: the second request of every key is the one rejected.
        for k in &keys {
            assert!(
                !store.check(k, p, 1).await.unwrap().allowed(),
                "{k:?} {p:?}"
            );
        }
    }
    let written = support::keys_with_ttl(&server);
    assert_eq!(written.len(), keys.len() * policies.len());
    for (name, ttl) in &written {
        assert!(name.starts_with("hostile:{"), "{name}");
        assert_eq!(name.matches('{').count(), 1, "{name}");
        assert_eq!(name.matches('}').count(), 1, "{name}");
        assert!(name.len() < 160, "{} bytes: {name}", name.len());
        assert!(name.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{name:?}");
        assert!(*ttl > 0, "{name} has no expiry ({ttl})");
    }
    // The hash tag is ours (a digest): the user text cannot pick the slot.
    let name = store.key_name("{slot}", &policies[0]);
    let tag = &name[name.find('{').unwrap() + 1..name.find('}').unwrap()];
    assert_eq!(tag.len(), 16);
    assert!(tag.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
}

#[tokio::test]
async fn rejections_write_nothing_and_expiries_follow_recovery() {
    let server = redis_or_skip!();
    let store = RedisStore::builder()
        .timeout(SLOW_MACHINE)
        .url(server.url())
        .ttl_slack(Duration::ZERO)
        .connect()
        .await
        .unwrap();
    let p = Policy::gcra(Rate::per_second(1), 2).unwrap();
    let d = store.check("k", &p, 1).await.unwrap();
    assert!(d.allowed());
    let name = store.key_name("k", &p);
    let ttl: i64 = server.cli(&["PTTL", &name]).trim().parse().unwrap();
    assert!(ttl > 0 && ttl <= 1000, "{ttl}");
    // A rejected request on a fresh key writes no key at all.
    let big = Policy::fixed_window(3, Duration::from_secs(60)).unwrap();
    let other = Policy::fixed_window(1, Duration::from_secs(60)).unwrap();
    let before = support::keys_with_ttl(&server).len();
    let d = store
        .check_all(&[
            Check::new("x", &big, 1),
            Check::new("y", &other, 1),
            Check::new("y", &other, 1),
        ])
        .await;
    assert!(
        matches!(d, Err(StoreError::CostExceedsLimit { index: 2, .. })),
        "{d:?}"
    );
    assert_eq!(support::keys_with_ttl(&server).len(), before);
    assert!(store.check("y", &other, 1).await.unwrap().allowed());
    let d = store
        .check_all(&[Check::new("x", &big, 1), Check::new("y", &other, 1)])
        .await
        .unwrap();
    assert!(!d.allowed() && d.index() == 1);
    // All or nothing: "x" paid nothing.
    assert_eq!(support::keys_with_ttl(&server).len(), before + 1);
}

#[tokio::test]
async fn scripts_are_reloaded_after_script_flush() {
    let server = redis_or_skip!();
    let store = RedisStore::builder()
        .timeout(SLOW_MACHINE)
        .url(server.url())
        .connect()
        .await
        .unwrap();
    let p = Policy::fixed_window(2, Duration::from_secs(3600)).unwrap();
    assert!(store.check("k", &p, 1).await.unwrap().allowed());
    assert_eq!(server.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
    assert!(store.check("k", &p, 1).await.unwrap().allowed());
    assert!(!store.check("k", &p, 1).await.unwrap().allowed());
}

#[tokio::test]
async fn the_deny_cache_keeps_rejected_floods_off_redis() {
    let server = redis_or_skip!();
    let store = RedisStore::builder()
        .timeout(SLOW_MACHINE)
        .url(server.url())
        .deny_cache(1000)
        .connect()
        .await
        .unwrap();
    let p = Policy::gcra(Rate::per_hour(1), 1).unwrap();
    assert!(store.check("k", &p, 1).await.unwrap().allowed());
    let first = store.check("k", &p, 1).await.unwrap();
    assert!(!first.allowed());
    let calls = || {
        let stats = server.cli(&["INFO", "commandstats"]);
        stats
            .lines()
            .find(|l| l.starts_with("cmdstat_evalsha:"))
            .and_then(|l| l.split("calls=").nth(1))
            .and_then(|s| s.split(',').next())
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let before = calls();
    for _ in 0..1000 {
        let d = store.check("k", &p, 1).await.unwrap();
        assert!(!d.allowed());
        assert!(d.retry_after() <= first.retry_after());
    }
    assert_eq!(calls(), before, "rejected requests went to Redis");
    assert_eq!(store.deny_cache_len(), 1);
    // Other keys still go to Redis.
    assert!(store.check("other", &p, 1).await.unwrap().allowed());
    assert_eq!(calls(), before + 1);
}

#[tokio::test]
async fn invalid_checks_are_errors_not_rejections() {
    let server = redis_or_skip!();
    let store = RedisStore::builder()
        .timeout(SLOW_MACHINE)
        .url(server.url())
        .max_key_len(100)
        .connect()
        .await
        .unwrap();
    let year = Policy::fixed_window(10, Duration::from_secs(365 * 86_400)).unwrap();
    match store.check("k", &year, 1).await {
        Err(StoreError::Unsupported { index: 0, reason }) => {
            assert!(reason.contains("horizon"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let e: UnsupportedPolicy = RedisStore::supports(&year).unwrap_err();
    assert_eq!(e.what, "horizon (ns)");
    // A misconfigured policy never fails open.
    let open = tollgate::store::ResilientStore::builder(store.clone())
        .failure_policy(tollgate::store::FailurePolicy::Open)
        .build();
    assert!(matches!(
        open.check("k", &year, 1).await,
        Err(StoreError::Unsupported { .. })
    ));
    assert_eq!(open.stats().failed_open, 0);
    let p = Policy::gcra(Rate::per_second(1), 3).unwrap();
    assert!(matches!(
        store.check("k", &p, 4).await,
        Err(StoreError::CostExceedsLimit { .. })
    ));
    assert!(matches!(
        store.check(&"x".repeat(101), &p, 1).await,
        Err(StoreError::KeyTooLong {
            len: 101,
            max: 100,
            ..
        })
    ));
    let empty = store.check_all(&[]).await.unwrap();
    assert!(empty.allowed());
    assert!(
        RedisStore::builder()
            .timeout(SLOW_MACHINE)
            .url(server.url())
            .prefix("bad{")
            .connect()
            .await
            .is_err(),
        "a prefix with braces could pick the slot"
    );
}

#[tokio::test]
async fn a_primary_found_through_sentinel() {
    let server = redis_or_skip!();
    let sentinel = support::RedisSentinel::start(&server);
    let store = RedisStore::builder()
        .timeout(SLOW_MACHINE)
        .sentinel([("127.0.0.1", sentinel.port)], "mymaster")
        .connect()
        .await
        .unwrap();
    let p = Policy::fixed_window(2, Duration::from_secs(3600)).unwrap();
    assert!(store.check("k", &p, 1).await.unwrap().allowed());
    assert!(store.check("k", &p, 1).await.unwrap().allowed());
    assert!(!store.check("k", &p, 1).await.unwrap().allowed());
    // The state is on the primary the sentinel named.
    assert_eq!(support::keys_with_ttl(&server).len(), 1);
    let url = format!(
        "redis-sentinel://127.0.0.1:{}?sentinelServiceName=mymaster",
        sentinel.port
    );
    let by_url = RedisStore::connect(&url).await.unwrap();
    assert!(!by_url.check("k", &p, 1).await.unwrap().allowed());
}

/// The check and refund scripts of a GCRA key as the store builds them
/// (`src/store/redis/mod.rs`), to leave refunds pending in orders that concurrent calls only
/// produce by chance.
const GCRA_CHECK_LUA: &str = concat!(
    include_str!("../src/store/redis/common.lua"),
    include_str!("../src/store/redis/gcra.lua"),
    include_str!("../src/store/redis/check.lua"),
);
const GCRA_REFUND_LUA: &str = concat!(
    include_str!("../src/store/redis/common.lua"),
    include_str!("../src/store/redis/gcra.lua"),
    include_str!("../src/store/redis/refund.lua"),
);

const FIXED_WINDOW_CHECK_LUA: &str = concat!(
    include_str!("../src/store/redis/common.lua"),
    include_str!("../src/store/redis/arith.lua"),
    include_str!("../src/store/redis/fixed_window.lua"),
    include_str!("../src/store/redis/check.lua"),
);
const FIXED_WINDOW_REFUND_LUA: &str = concat!(
    include_str!("../src/store/redis/common.lua"),
    include_str!("../src/store/redis/fixed_window.lua"),
    include_str!("../src/store/redis/refund.lua"),
);

const SLIDING_WINDOW_CHECK_LUA: &str = concat!(
    include_str!("../src/store/redis/common.lua"),
    include_str!("../src/store/redis/arith.lua"),
    include_str!("../src/store/redis/sliding_window.lua"),
    include_str!("../src/store/redis/check.lua"),
);
const SLIDING_WINDOW_REFUND_LUA: &str = concat!(
    include_str!("../src/store/redis/common.lua"),
    include_str!("../src/store/redis/sliding_window.lua"),
    include_str!("../src/store/redis/refund.lua"),
);

/// A GCRA key of 1,000 units, one a minute, driven by hand at one frozen instant: what one
/// slot of a cross-slot check (or a quota lease) consumes with a refund token, and its
/// refund.
struct Pending<'a> {
    server: &'a support::RedisServer,
    store: RedisStore,
    policy: Policy,
    name: String,
    sec: String,
    /// The check and refund scripts of the policy's algorithm.
    scripts: [&'static str; 2],
    /// (limit, period in ns, horizon in ns) as the store sends them.
    args: [String; 3],
    clock: tollgate::clock::ManualClock,
    /// Where each token's consumption went, as the check script answered (ref_b, ref_t).
    refs: std::sync::Mutex<std::collections::HashMap<String, [String; 2]>>,
}

impl<'a> Pending<'a> {
    async fn new(server: &'a support::RedisServer, key: &str) -> Self {
        let policy = Policy::gcra(Rate::per_minute(1), 1_000).unwrap();
        Self::with_policy(server, key, policy, [GCRA_CHECK_LUA, GCRA_REFUND_LUA]).await
    }

    /// A sliding window of 1,000 units a minute.
    async fn sliding_window(server: &'a support::RedisServer, key: &str) -> Self {
        let policy = Policy::sliding_window(1_000, Duration::from_secs(60)).unwrap();
        Self::with_policy(
            server,
            key,
            policy,
            [SLIDING_WINDOW_CHECK_LUA, SLIDING_WINDOW_REFUND_LUA],
        )
        .await
    }

    /// Moves the scripts' time and the store's on by `secs` seconds.
    fn advance(&mut self, secs: u64) {
        self.clock.advance(Duration::from_secs(secs));
        self.sec = self.clock.elapsed().as_secs().to_string();
    }

    /// A fixed window of 1,000 units a minute.
    async fn fixed_window(server: &'a support::RedisServer, key: &str) -> Self {
        let policy = Policy::fixed_window(1_000, Duration::from_secs(60)).unwrap();
        Self::with_policy(
            server,
            key,
            policy,
            [FIXED_WINDOW_CHECK_LUA, FIXED_WINDOW_REFUND_LUA],
        )
        .await
    }

    async fn with_policy(
        server: &'a support::RedisServer,
        key: &str,
        policy: Policy,
        scripts: [&'static str; 2],
    ) -> Self {
        let clock = tollgate::clock::ManualClock::new();
        clock.set(Duration::from_secs(1_700_000_000));
        let store = RedisStore::builder()
            .url(server.url())
            .timeout(SLOW_MACHINE)
            .injected_clock(clock.clone())
            .connect()
            .await
            .unwrap();
        let name = store.key_name(key, &policy);
        let sec = clock.elapsed().as_secs().to_string();
        let args = [
            policy.limit().to_string(),
            policy.interval().as_nanos().to_string(),
            // The store's horizon: how long a state can matter (two windows for the sliding
            // window's estimate).
            (policy.window().as_nanos()
                * if policy.algorithm().as_str() == "sliding_window" {
                    2
                } else {
                    1
                })
            .to_string(),
        ];
        Self {
            server,
            store,
            policy,
            name,
            sec,
            scripts,
            args,
            clock,
            refs: Default::default(),
        }
    }

    fn consume(&self, token: &str, cost: u64) {
        let [limit, interval, horizon] = &self.args;
        let cost = cost.to_string();
        let out = self.server.cli(&[
            "EVAL",
            self.scripts[0],
            "1",
            &self.name,
            &self.sec,
            "0",
            "1000",
            self.policy.algorithm().as_str(),
            limit,
            interval,
            &cost,
            horizon,
            token,
        ]);
        assert!(out.starts_with("1\n1\n"), "{token}: {out:?}");
        // {all, allowed, remaining, reset_after, retry_after, ref_b, ref_t}
        let lines: Vec<&str> = out.lines().collect();
        let refs = [lines[5].to_owned(), lines[6].to_owned()];
        self.refs.lock().unwrap().insert(token.to_owned(), refs);
    }

    fn refund(&self, token: &str, cost: u64) {
        let [limit, interval, horizon] = &self.args;
        let cost = cost.to_string();
        let [ref_b, ref_t] = self.refs.lock().unwrap()[token].clone();
        self.server.cli(&[
            "EVAL",
            self.scripts[1],
            "1",
            &self.name,
            &self.sec,
            "0",
            "refund",
            self.policy.algorithm().as_str(),
            limit,
            interval,
            &cost,
            horizon,
            token,
            &ref_b,
            &ref_t,
        ]);
    }

    async fn remaining(&self, key: &str) -> u64 {
        self.store
            .check(key, &self.policy, 0)
            .await
            .unwrap()
            .remaining()
    }
}

/// A fixed window's refund takes back only what its own consumption counted: a refund that
/// comes twice, or after the consumption was lost (a failover to a replica that never saw
/// it), subtracts nothing, where it used to take back other requests' counts (over-admitting
/// them by its cost).
#[tokio::test]
async fn a_fixed_window_refund_takes_back_only_its_own_consumption() {
    let server = redis_or_skip!();
    let key = Pending::fixed_window(&server, "fw").await;
    key.consume("a", 5);
    key.consume("b", 3);
    assert_eq!(key.remaining("fw").await, 992);
    key.refund("a", 5);
    assert_eq!(key.remaining("fw").await, 997);
    // Twice: nothing more.
    key.refund("a", 5);
    assert_eq!(key.remaining("fw").await, 997);
    // The consumption is lost (the key as a promoted replica would have it), then others count.
    key.consume("c", 4);
    server.cli(&["DEL", &key.name]);
    key.consume("d", 2);
    key.refund("c", 4);
    assert_eq!(key.remaining("fw").await, 998);
    // A settled consumption stays counted, and can no longer be refunded.
    let settle = |token: &str| {
        let [limit, interval, horizon] = &key.args;
        server.cli(&[
            "EVAL",
            FIXED_WINDOW_REFUND_LUA,
            "1",
            &key.name,
            &key.sec,
            "0",
            "settle",
            "fixed_window",
            limit,
            interval,
            "2",
            horizon,
            token,
            "0",
            "0",
        ]);
    };
    settle("d");
    key.refund("d", 2);
    assert_eq!(key.remaining("fw").await, 998);
    // b's consumption was lost with the key: its refund finds nothing either.
    key.refund("b", 3);
    assert_eq!(key.remaining("fw").await, 998);
}

/// A state read as stale (older than its horizon, its key not expired yet: a long TTL slack)
/// starts afresh with no pending refunds: a late refund of the old state's consumption takes
/// nothing back from the new state's count.
#[tokio::test]
async fn a_stale_states_pending_refunds_do_not_carry_over() {
    let server = redis_or_skip!();
    let mut key = Pending::fixed_window(&server, "stale").await;
    key.consume("old", 5);
    // Past the window and the 2 s its state is kept for: stale, while Redis still has it.
    key.advance(63);
    key.consume("", 3);
    key.refund("old", 5);
    assert_eq!(key.remaining("stale").await, 997);
}

/// A sliding window's refund takes back only its own consumption too, from `cur` while its
/// window lasts and from `prev` in the next one; twice, or after the consumption was lost,
/// it subtracts nothing.
#[tokio::test]
async fn a_sliding_window_refund_takes_back_only_its_own_consumption() {
    let server = redis_or_skip!();
    let mut key = Pending::sliding_window(&server, "sw").await;
    // To the start of a window (Unix time 1,700,000,000 is 20 s into a minute).
    key.advance(40);
    key.consume("a", 5);
    key.consume("b", 3);
    key.consume("c", 2);
    key.refund("a", 5);
    key.refund("a", 5);
    assert_eq!(key.remaining("sw").await, 995);
    // Half-way through the next window: b and c count half (prev, rounded down), d whole.
    key.advance(90);
    key.consume("d", 4);
    assert_eq!(key.remaining("sw").await, 1_000 - 4 - 5 / 2);
    key.refund("b", 3);
    key.refund("b", 3);
    assert_eq!(key.remaining("sw").await, 1_000 - 4 - 2 / 2);
    key.refund("d", 4);
    key.refund("d", 4);
    assert_eq!(key.remaining("sw").await, 1_000 - 1);
    // Lost with the key (a failover), then others count: c's refund takes nothing back.
    server.cli(&["DEL", &key.name]);
    key.consume("e", 6);
    key.refund("c", 2);
    assert_eq!(key.remaining("sw").await, 994);
}

/// A bucket keeps its newest 256 pending refunds: when more are pending (the settles of
/// admitted calls can lag behind a burst), the oldest is forgotten, and a refund that comes
/// in a round trip, for one of the newest consumptions, still gives back what it took.
#[tokio::test]
async fn a_bucket_keeps_its_newest_pending_refunds() {
    let server = redis_or_skip!();
    let key = Pending::new(&server, "busy").await;
    for i in 0..300 {
        key.consume(&format!("t{i}"), 1);
    }
    assert_eq!(key.remaining("busy").await, 700);
    // Forgotten: t0 to t43.
    key.refund("t0", 1);
    key.refund("t43", 1);
    assert_eq!(key.remaining("busy").await, 700);
    // Kept: t44 to t299, each refunded once.
    key.refund("t299", 1);
    assert_eq!(key.remaining("busy").await, 701);
    key.refund("t44", 1);
    key.refund("t44", 1);
    assert_eq!(key.remaining("busy").await, 702);
}

/// A long-lived pending refund (a quota lease) stays whole while many younger consumptions
/// come and are refunded on a busy bucket: refunding a younger one changes nothing that older
/// writes saw. (Every refund used to lower every other entry's headroom, so a lease that
/// outlived a few dozen refused stacks could give back nothing.)
#[tokio::test]
async fn an_old_pending_refund_survives_younger_refunds() {
    let server = redis_or_skip!();
    let key = Pending::new(&server, "leased").await;
    key.consume("first", 2);
    key.consume("lease", 12);
    for i in 0..30 {
        key.consume(&format!("stack{i}"), 1);
        key.refund(&format!("stack{i}"), 1);
    }
    assert_eq!(key.remaining("leased").await, 1_000 - 14);
    key.refund("first", 2);
    assert_eq!(key.remaining("leased").await, 1_000 - 12);
    key.refund("lease", 12);
    assert_eq!(key.remaining("leased").await, 1_000);
}
