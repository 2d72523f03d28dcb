//! One Redis Cluster master down, at start and mid-run, for single keys and for stacks. The
//! promise: one node down fails only its keys, nothing is lost, and the service comes back by
//! itself.
//!
//! Real servers on the real clock (a Cluster's node timeout and fred's reconnections run on
//! it). Nothing here waits for a time to pass: each test polls for a condition within a
//! generous deadline, and counts outcomes rather than timing them. `--nocapture` prints the
//! figures RELIABILITY.md quotes (decisions per master while one is down, time to recover).
#![cfg(feature = "redis")]
// The real clock: a Cluster's node timeout and fred's reconnections run on it.
#![allow(clippy::disallowed_methods)]

mod support;

use std::time::{Duration, Instant};

use tollgate::store::redis::RedisStore;
use tollgate::{Policy, Rate};

use support::RedisCluster;

/// The tests run one at a time: each starts a Cluster and kills a node of it.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Generous: what a loaded two-core machine may make a live master take, many times over.
const TIMEOUT: Duration = Duration::from_secs(1);

/// How long a test waits for a condition before it fails.
const DEADLINE: Duration = Duration::from_secs(30);

fn roomy() -> Policy {
    Policy::gcra(Rate::per_second(1_000_000), 1_000_000).unwrap()
}

/// A three-master Cluster whose live masters keep serving while one is down.
fn cluster() -> Option<RedisCluster> {
    RedisCluster::start_with(&["--cluster-require-full-coverage", "no"])
}

async fn connect(cluster: &RedisCluster) -> Result<RedisStore, tollgate::StoreError> {
    RedisStore::builder()
        .cluster(cluster.nodes())
        .timeout(TIMEOUT)
        .connect()
        .await
}

/// `n` keys and the master each lives on (by the Cluster's map as node `ask` sees it).
fn layout(
    cluster: &RedisCluster,
    store: &RedisStore,
    policy: &Policy,
    n: usize,
    ask: usize,
) -> (Vec<String>, Vec<usize>) {
    let keys: Vec<String> = (0..n).map(|i| format!("user:{i}")).collect();
    let nodes = keys
        .iter()
        .map(|k| cluster.node_of(ask, &store.key_name(k, policy)))
        .collect();
    (keys, nodes)
}

/// Per master: (decided, failed).
type Tally = [(u32, u32); 3];

/// Checks every key at once (cost 1): each master's decided and failed checks.
async fn round(store: &RedisStore, keys: &[String], nodes: &[usize], policy: &Policy) -> Tally {
    let answers =
        futures_util::future::join_all(keys.iter().map(|k| store.check(k, policy, 1))).await;
    let mut tally = [(0, 0); 3];
    for (answer, &node) in answers.iter().zip(nodes) {
        match answer {
            Ok(_) => tally[node].0 += 1,
            Err(_) => tally[node].1 += 1,
        }
    }
    tally
}

/// Rounds until every key is decided: how long it took from `since`, and the rounds.
async fn until_all_decided(
    store: &RedisStore,
    keys: &[String],
    nodes: &[usize],
    policy: &Policy,
    since: Instant,
) -> (Duration, u32) {
    let mut rounds = 0;
    loop {
        rounds += 1;
        let tally = round(store, keys, nodes, policy).await;
        if tally.iter().all(|(_, failed)| *failed == 0) {
            return (since.elapsed(), rounds);
        }
        assert!(
            since.elapsed() < DEADLINE,
            "still failing {DEADLINE:?} after the master came back: {tally:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A service that (re)starts while one master is down connects with the others and decides
/// their keys; the down master's keys fail until it is back, and then are decided without
/// rebuilding the store. (The store used to need every master at connect: `Err(Timeout)`, and
/// no key limited; and a master first met while down was never reconnected: its keys failed
/// for the life of the process.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_connects_during_a_one_master_outage_and_finds_the_master_when_it_is_back() {
    let _serial = SERIAL.lock().await;
    let Some(mut cluster) = cluster() else {
        return;
    };
    let policy = roomy();
    let (keys, nodes) = {
        let names = connect(&cluster)
            .await
            .expect("connect with every master up");
        layout(&cluster, &names, &policy, 30, 1)
    };
    let down = 0;
    assert!(
        (1..3).all(|n| nodes.contains(&n)) && nodes.contains(&down),
        "{nodes:?}"
    );
    cluster.nodes[down].kill();

    let started = Instant::now();
    let store = connect(&cluster)
        .await
        .expect("connect while one master is down");
    let took = started.elapsed();
    let during = round(&store, &keys, &nodes, &policy).await;
    println!("connected during the outage in {took:?}; decided, failed per master: {during:?}");
    for (node, (decided, failed)) in during.iter().enumerate() {
        let on = nodes.iter().filter(|&&n| n == node).count() as u32;
        if node == down {
            assert_eq!((*decided, *failed), (0, on), "the down master's keys fail");
        } else {
            assert_eq!(
                (*decided, *failed),
                (on, 0),
                "master {node}'s keys are decided"
            );
        }
    }

    cluster.nodes[down].restart();
    let back = Instant::now();
    let (recovered, rounds) = until_all_decided(&store, &keys, &nodes, &policy, back).await;
    println!(
        "first met while down: every key decided {recovered:?} after the master was back ({rounds} rounds)"
    );
}

/// The first key `prefix{i}` whose Redis name under `policy` lives on a master `wanted` says.
fn key_on(
    cluster: &RedisCluster,
    store: &RedisStore,
    policy: &Policy,
    prefix: &str,
    ask: usize,
    wanted: impl Fn(usize) -> bool,
) -> String {
    (0..1_000)
        .map(|i| format!("{prefix}{i}"))
        .find(|k| wanted(cluster.node_of(ask, &store.key_name(k, policy))))
        .expect("a key on the wanted master")
}

/// A fixed window's count in Redis (0 when absent).
fn count(cluster: &RedisCluster, node: usize, name: &str) -> u64 {
    cluster.nodes[node]
        .cli(&["HGET", name, "count"])
        .trim()
        .parse()
        .unwrap_or(0)
}

/// A stack across a healthy master and a killed one: the healthy master's check is decided,
/// and charged, where it lives; only the killed master's check takes the failure policy; the
/// stack stays all or nothing. A tenant limit of 5 on a healthy master, spent before the
/// other master died, admits nothing more under any policy. (The whole stack used to go to
/// the failure policy: the local fallback admitted the tenant 5 more times, failing open 10.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_across_a_killed_master_is_decided_where_its_parts_live() {
    use tollgate::Check;
    use tollgate::store::resilient::BreakerStatus;
    use tollgate::store::{FailurePolicy, ResilientStore, StoreError};

    let _serial = SERIAL.lock().await;
    let Some(mut cluster) = cluster() else {
        return;
    };
    let store = connect(&cluster).await.expect("connect");
    let spent = Policy::fixed_window(5, Duration::from_secs(3600)).unwrap();
    let roomy = Policy::fixed_window(100, Duration::from_secs(3600)).unwrap();
    let down = 0;
    let user = key_on(&cluster, &store, &roomy, "user:", 1, |n| n == down);
    let policies = [
        FailurePolicy::LocalFallback,
        FailurePolicy::Open,
        FailurePolicy::Closed,
    ];
    // Per policy: a spent tenant and a roomy one, both on live masters.
    let tenants: Vec<(String, String)> = policies
        .iter()
        .enumerate()
        .map(|(n, _)| {
            let live = |node| node != down;
            (
                key_on(&cluster, &store, &spent, &format!("spent{n}:"), 1, live),
                key_on(&cluster, &store, &roomy, &format!("roomy{n}:"), 1, live),
            )
        })
        .collect();
    for (tenant, _) in &tenants {
        for _ in 0..5 {
            let stack = [Check::new(&user, &roomy, 1), Check::new(tenant, &spent, 1)];
            assert!(store.check_all(&stack).await.unwrap().allowed());
        }
    }
    cluster.nodes[down].kill();

    for (policy, (tenant, other)) in policies.into_iter().zip(&tenants) {
        let resilient = ResilientStore::builder(store.clone())
            .timeout(TIMEOUT * 2)
            .breaker(2, Duration::from_secs(3600))
            .failure_policy(policy)
            .build();
        // The killed master's breaker opens (two failures on its own key).
        for _ in 0..2 {
            let _ = resilient.check(&user, &roomy, 1).await;
        }
        let states = resilient.breaker_states();
        assert_eq!(
            states
                .iter()
                .filter(|(_, s)| *s == BreakerStatus::Open)
                .count(),
            1,
            "{policy:?}: {states:?}"
        );
        let (mut admitted, mut refused, mut by_policy, mut failed) = (0, 0, 0, 0);
        for _ in 0..10 {
            let stack = [Check::new(&user, &roomy, 1), Check::new(tenant, &spent, 1)];
            match resilient.check_all(&stack).await {
                Ok(d) if d.allowed() => admitted += 1,
                Ok(d) if d.reached_backend() => {
                    assert_eq!(d.index(), 1, "{policy:?}: the tenant refused");
                    refused += 1;
                }
                Ok(_) => by_policy += 1,
                Err(e) => {
                    assert!(matches!(e, StoreError::CircuitOpen), "{policy:?}: {e:?}");
                    failed += 1;
                }
            }
        }
        let tenant_node = cluster.node_of(1, &store.key_name(tenant, &spent));
        let counted = count(&cluster, tenant_node, &store.key_name(tenant, &spent));
        let tally = format!(
            "{policy:?}, 10 stacks on a killed master and a spent tenant: {admitted} admitted, \
             {refused} refused by Redis, {by_policy} refused by the policy, {failed} failed; \
             Redis counts the tenant {counted}"
        );
        println!("{tally}");
        assert_eq!((admitted, by_policy), (0, 0), "{tally}");
        assert_eq!(counted, 5, "{policy:?}");

        // A tenant with room: decided and charged where it lives (but under Closed, where
        // the stack fails as a whole and nothing is charged).
        let stack = [Check::new(&user, &roomy, 1), Check::new(other, &roomy, 1)];
        let answer = resilient.check_all(&stack).await;
        let other_node = cluster.node_of(1, &store.key_name(other, &roomy));
        let counted = count(&cluster, other_node, &store.key_name(other, &roomy));
        match policy {
            FailurePolicy::Closed => {
                assert!(matches!(answer, Err(StoreError::CircuitOpen)), "{answer:?}");
                assert_eq!(counted, 0, "nothing charged");
            }
            _ => {
                let d = answer.unwrap();
                assert!(d.allowed() && d.is_failure_policy(), "{policy:?}: {d:?}");
                assert_eq!(counted, 1, "{policy:?}: charged where it lives");
            }
        }
    }
}

/// Clients connected to `node`, but for the `redis-cli` that asks.
fn clients(cluster: &RedisCluster, node: usize) -> u64 {
    cluster.nodes[node]
        .cli(&["INFO", "clients"])
        .lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .expect("connected_clients")
        .saturating_sub(1)
}

/// A master that leaves the Cluster's map (its slots moved to the others) loses its pool: its
/// connections close, instead of reconnecting for the life of the process and being asked at
/// every read of the map. Every key is still decided, where its slot went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_of_a_master_that_left_the_map_is_dropped() {
    let _serial = SERIAL.lock().await;
    let Some(cluster) = cluster() else {
        return;
    };
    let store = connect(&cluster).await.expect("connect");
    let policy = roomy();
    let (keys, nodes) = layout(&cluster, &store, &policy, 30, 0);
    let tally = round(&store, &keys, &nodes, &policy).await;
    assert!(tally.iter().all(|(_, failed)| *failed == 0), "{tally:?}");
    let leaving = 2;
    assert!(
        clients(&cluster, leaving) >= 1,
        "the store is connected to the master that will leave"
    );
    // Every slot of the leaving master goes to the others.
    let id = cluster.nodes[leaving].cli(&["CLUSTER", "MYID"]);
    let out = std::process::Command::new("redis-cli")
        .args(["--cluster", "rebalance"])
        .arg(format!("127.0.0.1:{}", cluster.nodes[0].port))
        .args(["--cluster-weight", &format!("{}=0", id.trim())])
        .output()
        .expect("redis-cli --cluster rebalance");
    assert!(
        out.status.success(),
        "rebalance: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let nodes: Vec<usize> = keys
        .iter()
        .map(|k| cluster.node_of(0, &store.key_name(k, &policy)))
        .collect();
    assert!(!nodes.contains(&leaving), "{nodes:?}");
    // Calls follow the MOVED answers, and the store reads the map again.
    let started = Instant::now();
    loop {
        let tally = round(&store, &keys, &nodes, &policy).await;
        assert!(tally.iter().all(|(_, failed)| *failed == 0), "{tally:?}");
        if clients(&cluster, leaving) == 0 {
            break;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "{} connections still open to a master that left the map",
            clients(&cluster, leaving)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "a master that left the map: its pool closed {:?} after the move",
        started.elapsed()
    );
}

/// How a check or a stack was answered.
#[derive(Debug, Default, Clone, Copy)]
struct Outcomes {
    /// Decided by Redis alone.
    redis: u32,
    /// Admitted or refused in part or in whole by the failure policy (the local fallback).
    policy: u32,
    /// Failed (none expected under the fallback).
    errors: u32,
}

impl Outcomes {
    fn add(&mut self, answer: &Result<tollgate::Decision, tollgate::StoreError>) {
        match answer {
            Ok(d) if d.is_failure_policy() => self.policy += 1,
            Ok(_) => self.redis += 1,
            Err(_) => self.errors += 1,
        }
    }

    fn sum(&mut self, other: Outcomes) {
        self.redis += other.redis;
        self.policy += other.policy;
        self.errors += other.errors;
    }

    fn all(&self) -> u32 {
        self.redis + self.policy + self.errors
    }
}

/// One master killed under load and restarted, through `ResilientStore` with the local
/// fallback: single keys, and stacks of a user's key with a tenant's on a live master. While
/// it is down, the live masters' keys are decided by Redis throughout, and so are the live
/// parts of stacks that touch it (each tenant is charged in Redis for every stack it
/// admitted, but the stacks that were probes of the down master: those fail whole); only
/// the down master's own keys take the fallback. Once it is back, every key and every stack
/// is decided by Redis again, by itself. Counted, not timed: the times printed are for
/// RELIABILITY.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_master_killed_mid_run_fails_only_its_keys_and_comes_back() {
    use tollgate::Check;
    use tollgate::store::resilient::BreakerStatus;
    use tollgate::store::{FailurePolicy, ResilientStore};

    let _serial = SERIAL.lock().await;
    let Some(mut cluster) = cluster() else {
        return;
    };
    let store = connect(&cluster).await.expect("connect");
    let policy = Policy::fixed_window(1_000_000, Duration::from_secs(3600)).unwrap();
    let (users, nodes) = layout(&cluster, &store, &policy, 30, 1);
    let down = 0;
    let tenants = [1, 2].map(|n| key_on(&cluster, &store, &policy, "tenant:", 1, |m| m == n));
    let resilient = ResilientStore::builder(store.clone())
        .timeout(TIMEOUT * 2)
        .breaker(3, Duration::from_millis(500))
        .failure_policy(FailurePolicy::LocalFallback)
        .build();
    // One round: every user's key alone, and every user in a stack with a tenant, all at
    // once. Per master (of the user's key): the single checks' and the stacks' outcomes; and
    // the stacks each tenant admitted.
    let round = || async {
        let singles =
            futures_util::future::join_all(users.iter().map(|u| resilient.check(u, &policy, 1)));
        let stacks = futures_util::future::join_all(users.iter().enumerate().map(|(i, u)| {
            let stack = [
                Check::new(u, &policy, 1),
                Check::new(&tenants[i % 2], &policy, 1),
            ];
            resilient.check_all(&stack)
        }));
        let (singles, stacks) = tokio::join!(singles, stacks);
        let mut per_node = [(Outcomes::default(), Outcomes::default()); 3];
        let mut per_tenant = [0u64; 2];
        for (i, (single, stack)) in singles.iter().zip(&stacks).enumerate() {
            per_node[nodes[i]].0.add(single);
            per_node[nodes[i]].1.add(stack);
            if stack.as_ref().is_ok_and(|d| d.allowed()) {
                per_tenant[i % 2] += 1;
            }
        }
        (per_node, per_tenant)
    };
    let charged = |cluster: &RedisCluster| {
        [0, 1].map(|t| count(cluster, t + 1, &store.key_name(&tenants[t], &policy)))
    };
    let (before, _) = round().await;
    for (node, (single, stack)) in before.iter().enumerate() {
        assert_eq!(
            (single.redis, stack.redis),
            (single.all(), stack.all()),
            "master {node}, before"
        );
    }

    cluster.nodes[down].kill();
    let killed = Instant::now();
    // Until the down master's breaker has opened (its keys' calls time out meanwhile).
    loop {
        let (tally, _) = round().await;
        if tally[down].0.policy == tally[down].0.all()
            && resilient.breaker_state() != BreakerStatus::Closed
        {
            break;
        }
        assert!(
            killed.elapsed() < DEADLINE,
            "the breaker never opened: {tally:?}"
        );
    }
    let detected = killed.elapsed();
    // The stacks that failed whole meanwhile have given back what their tenants took: the
    // calls across slots have ended.
    let settled = || async {
        let since = Instant::now();
        while store.cross_slot_calls() > 0 {
            assert!(since.elapsed() < DEADLINE, "calls across slots never ended");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    settled().await;
    // Down: twenty rounds.
    let charged_before = charged(&cluster);
    let opened_before = resilient.stats().breaker_opened;
    let mut during = [(Outcomes::default(), Outcomes::default()); 3];
    let mut admitted = [0u64; 2];
    for _ in 0..20 {
        let (tally, per_tenant) = round().await;
        for node in 0..3 {
            during[node].0.sum(tally[node].0);
            during[node].1.sum(tally[node].1);
        }
        for t in 0..2 {
            admitted[t] += per_tenant[t];
        }
    }
    settled().await;
    let after = charged(&cluster);
    let charged = [0, 1].map(|t| after[t] - charged_before[t]);
    // Each probe of the down master that failed opened its breaker again; a probe that was a
    // stack failed whole, and the fallback decided its tenant too.
    let probes = resilient.stats().breaker_opened - opened_before;
    println!("killed: the breaker opened {detected:?} after the kill; then 20 rounds:");
    for (node, (single, stack)) in during.iter().enumerate() {
        println!("  master {node}: single keys {single:?}; stacks with a live tenant {stack:?}");
    }
    println!(
        "  tenants: stacks admitted {admitted:?}, charged in Redis {charged:?}; failed probes {probes}"
    );
    for node in (0..3).filter(|&n| n != down) {
        let (single, stack) = during[node];
        assert_eq!(single.redis, single.all(), "master {node}: {single:?}");
        assert_eq!(stack.redis, stack.all(), "master {node}: {stack:?}");
    }
    let (single, stack) = during[down];
    assert_eq!(single.policy, single.all(), "{single:?}");
    assert_eq!(stack.policy, stack.all(), "{stack:?}");
    // Every stack a tenant admitted was charged where it lives, but the probes that were
    // stacks (they failed whole, and the fallback decided them whole).
    for t in 0..2 {
        assert!(
            charged[t] <= admitted[t],
            "{admitted:?} admitted, {charged:?} charged"
        );
    }
    let whole = admitted.iter().sum::<u64>() - charged.iter().sum::<u64>();
    assert!(
        whole <= probes,
        "{admitted:?} admitted, {charged:?} charged, {probes} failed probes"
    );

    cluster.nodes[down].restart();
    let back = Instant::now();
    let mut rounds = 0;
    loop {
        rounds += 1;
        let (tally, _) = round().await;
        if tally
            .iter()
            .all(|(s, k)| s.redis == s.all() && k.redis == k.all())
        {
            break;
        }
        assert!(back.elapsed() < DEADLINE, "not back by itself: {tally:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "  back: every key and stack decided by Redis {:?} after the restart ({rounds} rounds)",
        back.elapsed()
    );
}
