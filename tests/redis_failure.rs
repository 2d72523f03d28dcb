//! Redis killed during a test and restarted on the same port: errors are prompt, the failure
//! policy holds, the store reconnects by itself and reloads its scripts.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use tokio::time::Instant;
use tollgate::store::redis::RedisStore;
use tollgate::store::resilient::BreakerStatus;
use tollgate::store::{FailurePolicy, ResilientStore};
use tollgate::{MemoryStore, Policy, Rate, StoreError};

/// Waits (bounded) until `store` answers again; returns how long it took.
async fn until_back(store: &RedisStore, p: &Policy) -> Duration {
    let start = Instant::now();
    loop {
        if store.check("probe", p, 0).await.is_ok() {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "the store did not reconnect"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_is_a_prompt_error_and_the_store_recovers_by_itself() {
    let mut server = redis_or_skip!();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let p = Policy::fixed_window(3, Duration::from_secs(3600)).unwrap();
    assert!(store.check("k", &p, 1).await.unwrap().allowed());

    server.kill();
    for _ in 0..5 {
        let start = Instant::now();
        let r = store.check("k", &p, 1).await;
        assert!(
            matches!(r, Err(StoreError::Timeout(_) | StoreError::Backend(_))),
            "{r:?}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "took {:?}",
            start.elapsed()
        );
    }

    // Same port, empty server, empty script cache: the store finds it and reloads the script.
    server.restart();
    assert_eq!(cached_scripts(&server), 0);
    let took = until_back(&store, &p).await;
    assert!(took < Duration::from_secs(5), "reconnected after {took:?}");
    assert!(cached_scripts(&server) >= 1, "the script was not reloaded");
    // The restarted server is empty (nothing saved): a fresh window.
    for _ in 0..3 {
        assert!(store.check("k", &p, 1).await.unwrap().allowed());
    }
    assert!(!store.check("k", &p, 1).await.unwrap().allowed());
}

/// How many scripts the server has cached (`INFO memory`).
fn cached_scripts(server: &support::RedisServer) -> u64 {
    server
        .cli(&["INFO", "memory"])
        .lines()
        .find(|l| l.starts_with("number_of_cached_scripts:"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|n| n.trim().parse().ok())
        .expect("number_of_cached_scripts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failure_policy_holds_while_redis_is_down() {
    let mut server = redis_or_skip!();
    let redis = RedisStore::connect(&server.url()).await.unwrap();
    let fallback = ResilientStore::builder(redis.clone())
        .failure_policy(FailurePolicy::LocalFallback)
        .fallback_store(MemoryStore::new())
        .fallback_instances(2)
        .breaker(3, Duration::from_millis(500))
        .build();
    let open = ResilientStore::builder(redis.clone())
        .failure_policy(FailurePolicy::Open)
        .build();
    let closed = ResilientStore::new(redis.clone());
    let p = Policy::gcra(Rate::per_hour(1), 4).unwrap();
    assert!(fallback.check("k", &p, 1).await.unwrap().allowed());

    server.kill();
    let start = Instant::now();
    // Limit 4 shared by 2 instances: the local fallback admits 2 of these.
    let mut admitted = 0;
    for _ in 0..20 {
        let d = fallback.check("k", &p, 1).await.unwrap();
        admitted += u32::from(d.allowed());
    }
    assert_eq!(admitted, 2);
    // Three timeouts at most, then the breaker answers at once.
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(fallback.breaker_state(), BreakerStatus::Open);
    assert!(fallback.stats().short_circuited >= 17);

    assert!(open.check("k", &p, 1).await.unwrap().allowed());
    assert_eq!(open.stats().failed_open, 1);
    assert!(closed.check("k", &p, 1).await.is_err());

    server.restart();
    until_back(&redis, &p).await;
    // The breaker probes and closes by itself.
    let start = Instant::now();
    loop {
        let d = fallback.check("k2", &p, 1).await.unwrap();
        if fallback.breaker_state() == BreakerStatus::Closed {
            assert!(d.allowed());
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the breaker stayed open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_can_start_before_redis() {
    if !support::redis_available() {
        return;
    }
    let port = support::free_port();
    let store = RedisStore::builder()
        .url(format!("redis://127.0.0.1:{port}"))
        .wait_for_redis(false)
        .connect()
        .await
        .unwrap();
    let p = Policy::fixed_window(1, Duration::from_secs(3600)).unwrap();
    let start = Instant::now();
    assert!(store.check("k", &p, 1).await.is_err());
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    let server = support::RedisServer::start_on(port);
    until_back(&store, &p).await;
    assert!(store.check("k", &p, 1).await.unwrap().allowed());
    assert!(!store.check("k", &p, 1).await.unwrap().allowed());
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deny_cache_hit_does_not_close_the_breaker_while_redis_is_down() {
    let mut server = redis_or_skip!();
    let redis = RedisStore::builder()
        .url(server.url())
        .deny_cache(100)
        .deny_cache_max_age(Duration::from_secs(3600))
        .connect()
        .await
        .unwrap();
    // Opens on the first failure, and probes with the very next call.
    let store = ResilientStore::builder(redis)
        .breaker(1, Duration::ZERO)
        .build();
    let p = Policy::gcra(Rate::per_hour(1), 1).unwrap();
    assert!(store.check("k", &p, 1).await.unwrap().allowed());
    assert!(!store.check("k", &p, 1).await.unwrap().allowed()); // now in the deny cache

    server.kill();
    assert!(store.check("other", &p, 1).await.is_err());
    assert_eq!(store.breaker_state(), BreakerStatus::Open);
    // The probe is answered by the deny cache: that says nothing about Redis.
    let d = store.check("k", &p, 1).await.unwrap();
    assert!(!d.allowed() && !d.reached_backend());
    // Not closed: half open, the next probe due at once.
    assert_eq!(store.breaker_state(), BreakerStatus::HalfOpen);
    // So the next call probes Redis, still down, instead of finding the breaker closed.
    assert!(store.check("other", &p, 1).await.is_err());
    assert_eq!(store.stats().breaker_opened, 2);
}
