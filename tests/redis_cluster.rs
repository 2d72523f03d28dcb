//! The Redis store on a three-master Cluster: keys spread over the slots, stacked checks
//! across slots never admit too much, and refunds give back exactly what was taken.
#![cfg(feature = "redis")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate::store::redis::{KeySlots, RedisStore};
use tollgate::{Check, Policy, Rate};

use support::RedisCluster;

async fn connect(cluster: &RedisCluster, slots: KeySlots) -> RedisStore {
    RedisStore::builder()
        .cluster(cluster.nodes())
        .key_slots(slots)
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .expect("connect to the cluster")
}

fn dbsize(node: &support::RedisServer) -> u64 {
    node.cli(&["DBSIZE"]).trim().parse().unwrap_or(0)
}

fn tenant_policies(limit: u64) -> Vec<Policy> {
    let day = Duration::from_secs(86_400);
    vec![
        Policy::fixed_window(limit, day).unwrap(),
        Policy::sliding_window(limit, day).unwrap(),
        Policy::sliding_log(limit, day).unwrap(),
        Policy::token_bucket(Rate::per_hour(1), limit).unwrap(),
        Policy::leaky_bucket(Rate::per_hour(1), limit).unwrap(),
        Policy::gcra(Rate::per_hour(1), limit).unwrap(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keys_spread_and_stacked_checks_never_over_admit() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let store = connect(&cluster, KeySlots::PerKey).await;
    assert!(store.is_cluster());

    // Keys spread over the three masters.
    let p = Policy::gcra(Rate::per_second(10), 10).unwrap();
    for i in 0..300 {
        assert!(
            store
                .check(&format!("spread:{i}"), &p, 1)
                .await
                .unwrap()
                .allowed()
        );
    }
    let sizes: Vec<u64> = cluster.nodes.iter().map(dbsize).collect();
    assert_eq!(sizes.iter().sum::<u64>(), 300);
    assert!(sizes.iter().all(|&n| n > 50), "{sizes:?}");

    // A hash-tag strategy puts one tenant's keys together: one atomic script.
    let tagged = connect(&cluster, KeySlots::UntilDelimiter('|')).await;
    let slot = |name: String| cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", &name]);
    assert_eq!(
        slot(tagged.key_name("acme|user:1", &p)),
        slot(tagged.key_name("acme|tenant", &p))
    );

    // Per user 2, per tenant 30 (then 200, more than the 120 requests); 40 users send 3 requests each, all at once,
    // through two store instances. The user and tenant keys sit in different slots (consume,
    // then refund).
    let per_user = Arc::new(Policy::fixed_window(2, Duration::from_secs(86_400)).unwrap());
    let other = connect(&cluster, KeySlots::PerKey).await;
    let cases = tenant_policies(30).into_iter().chain(tenant_policies(200));
    for (n, tenant) in cases.enumerate() {
        let limit = tenant.limit();
        let tenant = Arc::new(tenant);
        let admitted = Arc::new(AtomicU64::new(0));
        let per_user_admitted: Arc<Vec<AtomicU64>> =
            Arc::new((0..40).map(|_| AtomicU64::new(0)).collect());
        let tasks: Vec<_> = (0..120)
            .map(|i| {
                let store = if i % 2 == 0 {
                    store.clone()
                } else {
                    other.clone()
                };
                let (tenant, per_user) = (tenant.clone(), per_user.clone());
                let (admitted, per_user_admitted) = (admitted.clone(), per_user_admitted.clone());
                tokio::spawn(async move {
                    let user = format!("t{n}:user:{}", i % 40);
                    let tenant_key = format!("t{n}:tenant");
                    let checks = [
                        Check::new(&user, &per_user, 1),
                        Check::new(&tenant_key, &tenant, 1),
                    ];
                    if store.check_all(&checks).await.unwrap().allowed() {
                        admitted.fetch_add(1, Ordering::Relaxed);
                        per_user_admitted[i % 40].fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let admitted = admitted.load(Ordering::Relaxed);
        assert!(
            admitted <= limit,
            "{tenant:?}: {admitted} admitted, limit {limit}"
        );
        if limit == 200 {
            // The tenant never runs out: only the users' limits reject, and never wrongly.
            assert_eq!(admitted, 80, "{tenant:?}");
        }
        assert!(
            per_user_admitted
                .iter()
                .all(|a| a.load(Ordering::Relaxed) <= 2)
        );
        // Never more consumed than admitted, and exactly that: every refund gave back what
        // it took.
        let left = store
            .check(&format!("t{n}:tenant"), &tenant, 0)
            .await
            .unwrap()
            .remaining();
        assert!(
            left <= limit - admitted,
            "{tenant:?}: {left} left after {admitted} admitted"
        );
        // With the tenant never idle, the bucket refunds are exact too.
        assert_eq!(left, limit - admitted, "{tenant:?}: refunds were not exact");
        eprintln!("{:?}: {admitted} admitted, {left} left", tenant.algorithm());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_across_slots_are_exact_for_every_algorithm() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let store = connect(&cluster, KeySlots::PerKey).await;
    let slot = |name: String| cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", &name]);
    let per_user = Policy::fixed_window(1, Duration::from_secs(86_400)).unwrap();
    for (n, tenant) in tenant_policies(30).into_iter().enumerate() {
        let (user, tenant_key) = (format!("r{n}:user"), format!("r{n}:tenant"));
        assert_ne!(
            slot(store.key_name(&user, &per_user)),
            slot(store.key_name(&tenant_key, &tenant))
        );
        let checks = [
            Check::new(&user, &per_user, 1),
            Check::new(&tenant_key, &tenant, 1),
        ];
        assert!(store.check_all(&checks).await.unwrap().allowed());
        for _ in 0..5 {
            // The user's slot rejects; the tenant's slot consumed and is refunded.
            let d = store.check_all(&checks).await.unwrap();
            assert!(!d.allowed() && d.index() == 0);
        }
        let left = store
            .check(&tenant_key, &tenant, 0)
            .await
            .unwrap()
            .remaining();
        assert_eq!(left, 29, "{tenant:?}");
        // Interleaved with other admissions on the tenant, the refund stays exact.
        let other = format!("r{n}:other");
        let other_checks = [
            Check::new(&other, &per_user, 1),
            Check::new(&tenant_key, &tenant, 1),
        ];
        assert!(store.check_all(&other_checks).await.unwrap().allowed());
        assert!(!store.check_all(&checks).await.unwrap().allowed());
        assert!(
            store
                .check(&tenant_key, &tenant, 2)
                .await
                .unwrap()
                .allowed()
        );
        let left = store
            .check(&tenant_key, &tenant, 0)
            .await
            .unwrap()
            .remaining();
        assert_eq!(left, 26, "{tenant:?}");
    }
}

/// Random stacked checks through the Cluster (consume, then refund across slots) and through
/// `MemoryStore`, one after the other with one injected clock: identical decisions, which can
/// only hold if every refund restores exactly the state the rejected call found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stacked_checks_across_slots_decide_like_memory() {
    use tollgate::MemoryStore;
    use tollgate::clock::ManualClock;
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let clock = ManualClock::new();
    clock.set(Duration::from_nanos(support::vectors::T0 + 123_456_789));
    let redis = RedisStore::builder()
        .cluster(cluster.nodes())
        .timeout(Duration::from_secs(10))
        .injected_clock(clock.clone())
        .connect()
        .await
        .unwrap();
    let memory = MemoryStore::with_clock(clock.clone());
    let ms = Duration::from_millis;
    let policies = [
        Policy::fixed_window(4, ms(500)).unwrap(),
        Policy::sliding_window(4, ms(500)).unwrap(),
        Policy::sliding_log(4, ms(500)).unwrap(),
        Policy::token_bucket(Rate::per_second(6), 4).unwrap(),
        Policy::leaky_bucket(Rate::per_second(6), 4).unwrap(),
        Policy::gcra(Rate::per_second(6), 4).unwrap(),
    ];
    let keys = ["u1", "u2", "u3", "tenant"];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let mut refunded = 0;
    for i in 0..800 {
        clock.advance(Duration::from_nanos(next(30_000_000)));
        let n = 2 + next(2) as usize;
        let picks: Vec<(usize, usize, u64)> = (0..n)
            .map(|_| (next(4) as usize, next(6) as usize, next(4)))
            .collect();
        let checks: Vec<Check<'_>> = picks
            .iter()
            .map(|&(k, p, c)| Check::new(keys[k], &policies[p], c))
            .collect();
        let (m, r) = match (
            memory.check_all_now(&checks),
            redis.check_all(&checks).await,
        ) {
            (Ok(m), Ok(r)) => (m, r),
            (Err(m), Err(r)) => {
                assert_eq!(m.to_string(), r.to_string());
                continue;
            }
            (m, r) => panic!("step {i}: memory {m:?}, redis {r:?}"),
        };
        refunded += u32::from(!m.allowed());
        let parts = |d: &tollgate::Decision| {
            (
                d.allowed(),
                d.remaining(),
                d.reset_after(),
                d.retry_after(),
                d.index(),
            )
        };
        assert_eq!(parts(&m), parts(&r), "step {i}: {picks:?}");
    }
    assert!(
        refunded > 100,
        "too few rejections to exercise refunds: {refunded}"
    );
}

/// Script calls the Cluster's masters have served so far.
fn scripts_run(cluster: &RedisCluster) -> u64 {
    cluster
        .nodes
        .iter()
        .map(|node| {
            let info = node.cli(&["INFO", "commandstats"]);
            info.lines()
                .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
                .filter_map(|l| {
                    l.split("calls=")
                        .nth(1)?
                        .split(',')
                        .next()?
                        .parse::<u64>()
                        .ok()
                })
                .sum::<u64>()
        })
        .sum()
}

/// Under `KeySlots::UntilDelimiter`, the stacked rules of a `Limiter` whose keys share the
/// part before the delimiter are decided by one script on one slot, with no refund: the rule's
/// name, which the limiter adds to each key, does not move the key. With `PerKey`, the same
/// stack spans two slots (consume, then refund).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stacked_rules_share_a_slot_under_until_delimiter() {
    use http::request::Parts;
    use tollgate::RateLimitLayer;
    use tollgate::limiter::Rule;
    use tower::{Layer, ServiceExt};

    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    for (slots, scripts_per_request) in [(KeySlots::UntilDelimiter('/'), 1), (KeySlots::PerKey, 2)]
    {
        let store = connect(&cluster, slots.clone()).await;
        let day = Duration::from_secs(86_400);
        let tenant = format!("acme-{scripts_per_request}");
        let user = format!("{tenant}/42");
        let layer = RateLimitLayer::builder(store)
            .rule(
                Rule::new("per-user")
                    .key(move |_: &Parts| Some(user.clone()))
                    .policy(Policy::fixed_window(1, day).unwrap()),
            )
            .rule(
                Rule::new("per-tenant")
                    .key(move |_: &Parts| Some(tenant.clone()))
                    .policy(Policy::fixed_window(100, day).unwrap()),
            )
            .build()
            .unwrap();
        let service = layer.layer(tower::service_fn(|_: http::Request<String>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
        }));
        let mut statuses = Vec::new();
        let mut scripts = Vec::new();
        for _ in 0..2 {
            let before = scripts_run(&cluster);
            let response = service
                .clone()
                .oneshot(http::Request::new(String::new()))
                .await
                .unwrap();
            statuses.push(response.status().as_u16());
            scripts.push(scripts_run(&cluster) - before);
        }
        // The user's second request is refused; the tenant admits it, and under PerKey that
        // consumption is refunded by a third script.
        assert_eq!(statuses, [200, 429], "{slots:?}");
        if scripts_per_request == 1 {
            assert_eq!(scripts, [1, 1], "{slots:?}: one script per request");
        } else {
            assert!(scripts.iter().all(|&n| n >= 2), "{slots:?}: {scripts:?}");
        }
    }
}
