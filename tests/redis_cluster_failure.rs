//! One master of a three-master Redis Cluster failing under load.
//!
//! Hung (SIGSTOP, its connections open and silent): with a circuit breaker per master, the
//! other masters' keys are decided by Redis throughout and only the hung master's keys take
//! the failure policy; with one breaker for the whole store, the hung master's timeouts open
//! it for every key.
//!
//! Killed (its connections refused): the same, since the store routes to a pool per master
//! (fred's own Cluster client reconnects as a whole, and stalled every key); and once the
//! master is back, every key is decided again.
//!
//! Real servers on the real clock (a Cluster's node timeout cannot run on a paused one),
//! bounded: three runs of about 4 s. `--nocapture` prints the figures RELIABILITY.md quotes.
#![cfg(feature = "redis")]
// The real clock: a Cluster's node timeout and fred's reconnections run on it.
#![allow(clippy::disallowed_methods)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tollgate::store::redis::RedisStore;
use tollgate::store::{FailurePolicy, ResilientStore, StoreError};
use tollgate::{Check, Policy, Rate, Store};

use support::RedisCluster;

/// The Redis store with its partitions hidden: one breaker for every key, as before.
#[derive(Clone)]
struct Whole(RedisStore);

impl Store for Whole {
    type Future = <RedisStore as Store>::Future;

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        self.0.check_all(checks)
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    decided: u64,
    timeouts: u64,
    short_circuited: u64,
    other_errors: u64,
    slowest: Duration,
}

impl Tally {
    fn add(&mut self, answer: &Result<tollgate::Decision, StoreError>, took: Duration) {
        match answer {
            Ok(_) => self.decided += 1,
            Err(StoreError::Timeout(_)) => self.timeouts += 1,
            Err(StoreError::CircuitOpen) => self.short_circuited += 1,
            Err(_) => self.other_errors += 1,
        }
        self.slowest = self.slowest.max(took);
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    Hang,
    Kill,
}

/// (keys of the live masters, of the failed master) when one master fails under load:
/// tallies from the fault on.
async fn fail_one_master_under_load<S: Store + Clone>(
    cluster: &mut RedisCluster,
    store: &RedisStore,
    wrap: impl FnOnce(RedisStore) -> S,
    fault: Fault,
) -> (Tally, Tally) {
    let policy = Policy::gcra(Rate::per_second(1_000_000), 1_000_000).unwrap();
    let keys: Vec<String> = (0..60).map(|i| format!("user:{i}")).collect();
    // Which master holds each key: the one that has it after a first check.
    for key in &keys {
        assert!(store.check(key, &policy, 1).await.unwrap().allowed());
    }
    let victim = &cluster.nodes[0];
    let on_victim: Vec<bool> = keys
        .iter()
        .map(|k| victim.cli(&["EXISTS", &store.key_name(k, &policy)]).trim() == "1")
        .collect();
    let dead = on_victim.iter().filter(|d| **d).count();
    assert!(
        dead > 5 && dead < 55,
        "{dead} of 60 keys on the first master"
    );

    let resilient = ResilientStore::builder(wrap(store.clone()))
        .timeout(Duration::from_millis(600))
        .breaker(3, Duration::from_millis(500))
        .failure_policy(FailurePolicy::Closed)
        .build();
    let killed = Arc::new(AtomicBool::new(false));
    let tallies = Arc::new(Mutex::new((Tally::default(), Tally::default())));
    let stop = Instant::now() + Duration::from_secs(4);
    let mut tasks = Vec::new();
    for worker in 0..8 {
        let (resilient, policy, keys, on_victim) = (
            resilient.clone(),
            policy.clone(),
            keys.clone(),
            on_victim.clone(),
        );
        let (killed, tallies) = (Arc::clone(&killed), Arc::clone(&tallies));
        tasks.push(tokio::spawn(async move {
            let mut i = worker;
            while Instant::now() < stop {
                let k = i % keys.len();
                i += 7;
                let started = Instant::now();
                let answer = resilient.check(&keys[k], &policy, 1).await;
                let took = started.elapsed();
                // A call still out when the master failed counts with those after.
                if killed.load(Ordering::SeqCst) {
                    let mut t = tallies.lock();
                    if on_victim[k] { &mut t.1 } else { &mut t.0 }.add(&answer, took);
                } else {
                    assert!(answer.is_ok(), "before the kill: {answer:?}");
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Marked first: a call answered while the signal lands counts with those after.
    killed.store(true, Ordering::SeqCst);
    match fault {
        Fault::Hang => cluster.nodes[0].signal("STOP"),
        Fault::Kill => cluster.nodes[0].kill(),
    }
    for task in tasks {
        task.await.unwrap();
    }
    if fault == Fault::Hang {
        cluster.nodes[0].signal("CONT");
    }
    *tallies.lock()
}

/// The tests run one at a time: each loads the machine, and the others' load would show as
/// their latency.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn start() -> Option<(RedisCluster, RedisStore)> {
    // Without full coverage, the live masters keep serving their slots after the node timeout
    // (with Redis's default, `yes`, the whole Cluster refuses every key from then on).
    let cluster = RedisCluster::start_with(&["--cluster-require-full-coverage", "no"])?;
    // Timeouts well above what a loaded two-core machine can make a live master take.
    let store = RedisStore::builder()
        .cluster(cluster.nodes())
        .timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    Some((cluster, store))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_master_fails_only_its_own_keys() {
    let _serial = SERIAL.lock().await;
    let Some((mut cluster, store)) = start().await else {
        return;
    };
    let (live, hung) = fail_one_master_under_load(&mut cluster, &store, |s| s, Fault::Hang).await;
    println!(
        "hung, a breaker per master: live masters' keys {live:?}; hung master's keys {hung:?}"
    );
    assert!(live.decided > 500, "{live:?}");
    assert_eq!(
        (live.timeouts, live.short_circuited, live.other_errors),
        (0, 0, 0),
        "the live masters' keys are decided by Redis throughout: {live:?}"
    );
    // Only calls already on their way when it stopped (one per caller at most).
    assert!(hung.decided <= 8, "{hung:?}");
    assert!(
        hung.short_circuited > 10 * (hung.timeouts + hung.other_errors),
        "{hung:?}"
    );

    // The same with one breaker for the whole store: the figure the fix is measured against.
    let Some((mut cluster, store)) = start().await else {
        return;
    };
    let (live, hung) = fail_one_master_under_load(&mut cluster, &store, Whole, Fault::Hang).await;
    println!(
        "hung, one breaker for the store: live masters' keys {live:?}; hung master's keys {hung:?}"
    );
    assert!(live.short_circuited > live.decided, "{live:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_fails_only_its_own_keys_until_it_is_back() {
    let _serial = SERIAL.lock().await;
    let Some((mut cluster, store)) = start().await else {
        return;
    };
    let (live, dead) = fail_one_master_under_load(&mut cluster, &store, |s| s, Fault::Kill).await;
    println!(
        "killed, a breaker per master: live masters' keys {live:?}; dead master's keys {dead:?}"
    );
    assert!(live.decided > 500, "{live:?}");
    assert_eq!(
        (live.timeouts, live.short_circuited, live.other_errors),
        (0, 0, 0),
        "the live masters' keys are decided by Redis throughout: {live:?}"
    );
    assert!(dead.decided <= 8, "{dead:?}");
    // Back, empty, with its slots (its nodes.conf kept them): every key is decided again.
    cluster.nodes[0].restart();
    let policy = Policy::gcra(Rate::per_second(1_000_000), 1_000_000).unwrap();
    let back = Instant::now();
    let deadline = back + Duration::from_secs(15);
    let mut pending: Vec<String> = (0..60).map(|i| format!("user:{i}")).collect();
    while !pending.is_empty() {
        assert!(
            Instant::now() < deadline,
            "still failing 15 s after the master is back: {pending:?}"
        );
        let mut still = Vec::new();
        for key in pending {
            if store.check(&key, &policy, 1).await.is_err() {
                still.push(key);
            }
        }
        pending = still;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "killed: every key decided again {:?} after the master was back",
        back.elapsed()
    );
}

/// While a master hangs, calls across slots that touch it wait for their timeout in tasks of
/// their own; past `max_cross_slot_calls` of them, a call across slots fails at once, consuming
/// nothing, and once the master answers again the tasks end and the places come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_across_slots_in_flight_are_bounded() {
    let _serial = SERIAL.lock().await;
    let Some(cluster) = RedisCluster::start_with(&["--cluster-require-full-coverage", "no"]) else {
        return;
    };
    // Long enough that the four calls with a place are certainly seen waiting, however
    // loaded the machine: the test counts them, it does not time them.
    let timeout = Duration::from_secs(3);
    let store = RedisStore::builder()
        .cluster(cluster.nodes())
        .timeout(timeout)
        .max_cross_slot_calls(4)
        .connect()
        .await
        .unwrap();
    let policy = Policy::fixed_window(1_000, Duration::from_secs(3_600)).unwrap();
    // A key on the master that will hang and one on another master.
    let mut on = [None, None];
    for i in 0..200 {
        let key = format!("user:{i}");
        assert!(store.check(&key, &policy, 1).await.unwrap().allowed());
        let name = store.key_name(&key, &policy);
        let node = cluster
            .nodes
            .iter()
            .position(|n| n.cli(&["EXISTS", &name]).trim() == "1")
            .unwrap();
        match node {
            0 if on[0].is_none() => on[0] = Some(key),
            1 if on[1].is_none() => on[1] = Some(key),
            _ => {}
        }
    }
    let (hung, live) = (on[0].clone().unwrap(), on[1].clone().unwrap());
    let stack = |store: RedisStore, policy: Policy, hung: String, live: String| async move {
        let started = Instant::now();
        let checks = [Check::new(&hung, &policy, 1), Check::new(&live, &policy, 1)];
        let answer = store.check_all(&checks).await;
        (answer, started.elapsed())
    };
    cluster.nodes[0].signal("STOP");
    let calls: Vec<_> = (0..10)
        .map(|_| {
            tokio::spawn(stack(
                store.clone(),
                policy.clone(),
                hung.clone(),
                live.clone(),
            ))
        })
        .collect();
    // The four with a place wait in their tasks for the hung master.
    let started = Instant::now();
    while store.cross_slot_calls() < 4 {
        assert!(
            started.elapsed() < timeout,
            "{} in flight",
            store.cross_slot_calls()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(store.cross_slot_calls(), 4);
    let mut refused_at_once = 0;
    let mut timed_out = 0;
    for call in calls {
        match call.await.unwrap() {
            (Err(StoreError::Busy(why)), took) => {
                assert!(why.contains("across slots"), "{why}");
                // At once: not after waiting for the hung master's timeout.
                assert!(took < timeout, "{took:?}");
                refused_at_once += 1;
            }
            (Err(StoreError::Timeout(_)), _) => timed_out += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        (refused_at_once, timed_out),
        (6, 4),
        "refused at once, timed out"
    );
    cluster.nodes[0].signal("CONT");
    // The tasks end (their refunds run), the places come back, and stacks go through again.
    let back = Instant::now();
    while store.cross_slot_calls() > 0 {
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "the tasks never ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (answer, _) = stack(store.clone(), policy.clone(), hung.clone(), live.clone()).await;
    assert!(answer.unwrap().allowed());
    // Nothing the refused or timed-out stacks consumed stays: the live key holds its first
    // check and the last stack's.
    assert_eq!(
        store.check(&live, &policy, 0).await.unwrap().remaining(),
        1_000 - 2
    );
}
