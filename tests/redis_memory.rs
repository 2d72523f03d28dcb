//! The Redis store on a Redis that runs out of memory (`maxmemory`): under `noeviction` a key
//! flood gets errors and an exhausted key stays refused; under a policy that evicts, the flood
//! pushes the exhausted key out and its quota is back. What the module docs of
//! `tollgate::store::redis` say, shown on real servers of 2 MB.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use support::RedisServer;
use tokio::task::JoinSet;
use tollgate::store::redis::RedisStore;
use tollgate::{Policy, Rate};

/// Generous: these tests are about what Redis does when full, not speed, and CI machines stall.
const SLOW_MACHINE: Duration = Duration::from_secs(5);
/// New keys checked at once.
const BATCH: u64 = 500;
/// The most new keys a flood tries: a 2 MB Redis is full after a few thousand.
const MOST: u64 = 200_000;

fn login() -> Policy {
    Policy::sliding_log(5, Duration::from_secs(15 * 60)).unwrap()
}

/// 5 per 15 minutes, in every algorithm.
fn logins() -> Vec<Policy> {
    let w = Duration::from_secs(15 * 60);
    let rate = Rate::new(5, w);
    vec![
        Policy::fixed_window(5, w).unwrap(),
        login(),
        Policy::sliding_window(5, w).unwrap(),
        Policy::token_bucket(rate, 5).unwrap(),
        Policy::leaky_bucket(rate, 5).unwrap(),
        Policy::gcra(rate, 5).unwrap(),
    ]
}

async fn store(server: &RedisServer) -> RedisStore {
    RedisStore::builder()
        .timeout(SLOW_MACHINE)
        .url(server.url())
        .prefix("mem:")
        .connect()
        .await
        .unwrap()
}

/// Whether the login key's state is still on the server (SCAN, which leaves LRU times alone).
fn alice_is_kept(server: &RedisServer) -> bool {
    !server
        .cli(&["--scan", "--pattern", "mem:*:login:alice"])
        .trim()
        .is_empty()
}

fn info_stat(server: &RedisServer, name: &str) -> u64 {
    let info = server.cli(&["INFO", "stats"]);
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in INFO stats"))
}

/// Exhausts the login key: five admitted, the sixth refused.
async fn exhaust_alice(store: &RedisStore, login: &Policy) {
    for _ in 0..5 {
        assert!(
            store
                .check("login:alice", login, 1)
                .await
                .unwrap()
                .allowed()
        );
    }
    assert!(
        !store
            .check("login:alice", login, 1)
            .await
            .unwrap()
            .allowed()
    );
}

/// What became of a batch of new keys, one request each.
#[derive(Default)]
struct Batch {
    admitted: u64,
    errors: Vec<String>,
}

async fn flood(store: &RedisStore, policy: &Policy, from: u64) -> Batch {
    let mut set = JoinSet::new();
    for i in from..from + BATCH {
        let (store, policy) = (store.clone(), policy.clone());
        set.spawn(async move { store.check(&format!("ip:{i}"), &policy, 1).await });
    }
    let mut batch = Batch::default();
    while let Some(done) = set.join_next().await {
        match done.unwrap() {
            Ok(d) => batch.admitted += u64::from(d.allowed()),
            Err(e) => batch.errors.push(e.to_string()),
        }
    }
    batch
}

#[tokio::test]
async fn under_noeviction_a_key_flood_gets_errors_and_an_exhausted_key_stays_refused() {
    for login in logins() {
        noeviction(&login).await;
    }
}

async fn noeviction(login: &Policy) {
    let Some(server) =
        RedisServer::start_with(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
    else {
        return;
    };
    let store = store(&server).await;
    exhaust_alice(&store, login).await;
    // Flood until Redis refuses every write of a batch (the first refusals come while the
    // memory used still wavers around the limit with the connections' buffers).
    let (mut from, mut admitted, mut errors) = (0, 0, Vec::new());
    let mut full = false;
    while from < MOST && !full {
        let batch = flood(&store, login, from).await;
        from += BATCH;
        admitted += batch.admitted;
        full = batch.admitted == 0;
        errors.extend(batch.errors);
        // Whatever happens to the flood, the login key is refused (a refusal writes nothing,
        // so Redis answers it even when full).
        let d = store.check("login:alice", login, 1).await.unwrap();
        assert!(
            !d.allowed(),
            "{login:?}: alice admitted after {from} new keys"
        );
    }
    // Every script's first write to a new key is one Redis checks against maxmemory (the
    // sliding log's used to be a DEL, which let it write 10 MB into a 2 MB Redis).
    assert!(full, "{login:?}: Redis never filled up in {from} keys");
    // The new keys that found Redis full got an error (for the failure policy to decide),
    // never a decision: an OOM reply, as a backend error.
    let backend_oom = |e: &String| e.starts_with("the store failed") && e.contains("OOM");
    assert!(errors.iter().all(backend_oom), "{:?}", &errors[..1]);
    assert_eq!(admitted + errors.len() as u64, from, "{login:?}");
    assert_eq!(info_stat(&server, "evicted_keys"), 0);
    assert!(alice_is_kept(&server), "{login:?}");
}

#[tokio::test]
async fn under_an_evicting_policy_a_key_flood_buys_back_an_exhausted_quota() {
    // volatile-ttl evicts what expires soonest, the exhausted key first of all (it was written
    // before the flood, with the same TTL); allkeys-lru evicts what was used least recently.
    // Every tollgate key has a TTL, so every volatile-* policy can pick any of them.
    for policy in ["volatile-ttl", "allkeys-lru"] {
        let Some(server) =
            RedisServer::start_with(&["--maxmemory", "2mb", "--maxmemory-policy", policy])
        else {
            return;
        };
        let store = store(&server).await;
        exhaust_alice(&store, &login()).await;
        let (mut from, mut admitted) = (0, 0);
        while from < MOST && alice_is_kept(&server) {
            let batch = flood(&store, &login(), from).await;
            from += BATCH;
            admitted += batch.admitted;
            // Redis makes room for every write: no error, every new key admitted.
            assert!(
                batch.errors.is_empty(),
                "{policy}: {:?}",
                &batch.errors[..1]
            );
        }
        assert!(
            !alice_is_kept(&server),
            "{policy}: alice kept through {from} keys"
        );
        assert_eq!(admitted, from, "{policy}");
        assert!(info_stat(&server, "evicted_keys") > 0, "{policy}");
        // Its state gone, the exhausted key has its whole quota back.
        let d = store.check("login:alice", &login(), 1).await.unwrap();
        assert!(d.allowed(), "{policy}");
        assert_eq!(d.remaining(), 4, "{policy}");
    }
}
