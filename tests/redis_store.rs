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

/// A GCRA key of 1,000 units, one a minute, driven by hand at one frozen instant: what one
/// slot of a cross-slot check (or a quota lease) consumes with a refund token, and its
/// refund.
struct Pending<'a> {
    server: &'a support::RedisServer,
    store: RedisStore,
    policy: Policy,
    name: String,
    sec: String,
}

impl<'a> Pending<'a> {
    /// (limit, interval in ns, horizon in ns) as the store sends them.
    const ARGS: [&'static str; 3] = ["1000", "60000000000", "60000000000000"];

    async fn new(server: &'a support::RedisServer, key: &str) -> Self {
        let clock = tollgate::clock::ManualClock::new();
        clock.set(Duration::from_secs(1_700_000_000));
        let store = RedisStore::builder()
            .url(server.url())
            .timeout(SLOW_MACHINE)
            .injected_clock(clock.clone())
            .connect()
            .await
            .unwrap();
        let policy = Policy::gcra(Rate::per_minute(1), 1_000).unwrap();
        let name = store.key_name(key, &policy);
        let sec = clock.elapsed().as_secs().to_string();
        Self {
            server,
            store,
            policy,
            name,
            sec,
        }
    }

    fn consume(&self, token: &str, cost: u64) {
        let [limit, interval, horizon] = Self::ARGS;
        let cost = cost.to_string();
        let out = self.server.cli(&[
            "EVAL",
            GCRA_CHECK_LUA,
            "1",
            &self.name,
            &self.sec,
            "0",
            "1000",
            "gcra",
            limit,
            interval,
            &cost,
            horizon,
            token,
        ]);
        assert!(out.starts_with("1\n1\n"), "{token}: {out:?}");
    }

    fn refund(&self, token: &str, cost: u64) {
        let [limit, interval, horizon] = Self::ARGS;
        let cost = cost.to_string();
        self.server.cli(&[
            "EVAL",
            GCRA_REFUND_LUA,
            "1",
            &self.name,
            &self.sec,
            "0",
            "refund",
            "gcra",
            limit,
            interval,
            &cost,
            horizon,
            token,
            "0",
            "0",
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
