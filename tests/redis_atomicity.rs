//! The two-instance atomicity test: two stores on one Redis, 400 concurrent requests, limit
//! 50: exactly 50 admitted, five rounds in a row, for every algorithm.
#![cfg(feature = "redis")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate::store::redis::RedisStore;
use tollgate::{Policy, Rate};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_admit_exactly_the_limit() {
    let server = redis_or_skip!();
    let connect = || {
        RedisStore::builder()
            .url(server.url())
            .timeout(Duration::from_secs(10))
            .connect()
    };
    let (a, b) = (connect().await.unwrap(), connect().await.unwrap());
    let day = Duration::from_secs(86_400);
    let policies = [
        Policy::fixed_window(50, day).unwrap(),
        Policy::sliding_window(50, day).unwrap(),
        Policy::sliding_log(50, day).unwrap(),
        Policy::token_bucket(Rate::per_hour(1), 50).unwrap(),
        Policy::leaky_bucket(Rate::per_hour(1), 50).unwrap(),
        Policy::gcra(Rate::per_hour(1), 50).unwrap(),
    ];
    for policy in policies {
        let policy = Arc::new(policy);
        for round in 0..5 {
            let key = format!("atomic:{round}");
            let admitted = Arc::new(AtomicU64::new(0));
            let tasks: Vec<_> = (0..400)
                .map(|i| {
                    let store = if i % 2 == 0 { a.clone() } else { b.clone() };
                    let (policy, key, admitted) = (policy.clone(), key.clone(), admitted.clone());
                    tokio::spawn(async move {
                        if store.check(&key, &policy, 1).await.unwrap().allowed() {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            assert_eq!(
                admitted.load(Ordering::Relaxed),
                50,
                "{policy:?} round {round}"
            );
        }
    }
}
