//! The in-process store: exact under concurrency, all-or-nothing stacks, bounded memory, and
//! clear errors for bad input.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::{Check, Decision, MemoryStore, Policy, Rate, Store, StoreError};

fn every_algorithm(limit: u64) -> Vec<Policy> {
    let w = Duration::from_secs(60);
    let rate = Rate::per_hour(1);
    vec![
        Policy::fixed_window(limit, w).unwrap(),
        Policy::sliding_log(limit, w).unwrap(),
        Policy::sliding_window(limit, w).unwrap(),
        Policy::token_bucket(rate, limit).unwrap(),
        Policy::leaky_bucket(rate, limit).unwrap(),
        Policy::gcra(rate, limit).unwrap(),
    ]
}

#[test]
fn threads_hammering_one_key_never_admit_more_than_the_limit() {
    let clock = ManualClock::new();
    let store = MemoryStore::with_clock(clock.clone());
    for policy in every_algorithm(500) {
        let admitted = AtomicU64::new(0);
        thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for i in 0..400 {
                        // Some weighted requests too; the clock creeps forward meanwhile.
                        let cost = if i % 10 == 0 { 3 } else { 1 };
                        if store.check_now("hot", &policy, cost).unwrap().allowed() {
                            admitted.fetch_add(cost, Ordering::Relaxed);
                        }
                        clock.advance(Duration::from_nanos(1));
                    }
                });
            }
        });
        let admitted = admitted.into_inner();
        // 8 * 400 requests for 500 units, within 3.2 us of a 60 s / 1 per hour policy: the
        // limit is reached and never passed (a unit of refill takes far longer).
        assert!((498..=500).contains(&admitted), "{policy:?}: {admitted}");
        assert_eq!(
            store.check_now("hot", &policy, 1).unwrap().remaining(),
            500 - admitted
        );
    }
}

#[test]
fn stacked_checks_from_many_threads_are_all_or_nothing() {
    let clock = ManualClock::new();
    let store = MemoryStore::with_clock(clock);
    let per_user = Policy::fixed_window(30, Duration::from_secs(60)).unwrap();
    let per_tenant = Policy::gcra(Rate::per_hour(1), 100).unwrap();
    let global = Policy::sliding_log(1000, Duration::from_secs(60)).unwrap();
    let users = ["u1", "u2", "u3", "u4", "u5", "u6"];
    let admitted: Vec<AtomicU64> = users.iter().map(|_| AtomicU64::new(0)).collect();
    thread::scope(|s| {
        for t in 0..6 {
            let (store, admitted) = (&store, &admitted);
            let (per_user, per_tenant, global) = (&per_user, &per_tenant, &global);
            s.spawn(move || {
                for i in 0..200 {
                    // Opposite orders on purpose: locking must not deadlock.
                    let u = (t + i) % users.len();
                    let mut checks = vec![
                        Check::new(users[u], per_user, 1),
                        Check::new("tenant", per_tenant, 1),
                        Check::new("global", global, 1),
                    ];
                    if t % 2 == 1 {
                        checks.reverse();
                    }
                    if store.check_all_now(&checks).unwrap().allowed() {
                        admitted[u].fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let per_user_counts: Vec<u64> = admitted.iter().map(|a| a.load(Ordering::Relaxed)).collect();
    let total: u64 = per_user_counts.iter().sum();
    assert_eq!(total, 100, "the tenant's limit binds: {per_user_counts:?}");
    assert!(per_user_counts.iter().all(|&n| n <= 30));
    // Every admission consumed from all three, and no rejection consumed anything.
    assert_eq!(
        store
            .check_now("tenant", &per_tenant, 0)
            .unwrap()
            .remaining(),
        0
    );
    assert_eq!(
        store.check_now("global", &global, 0).unwrap().remaining(),
        900
    );
    for (u, n) in users.iter().zip(&per_user_counts) {
        assert_eq!(
            store.check_now(u, &per_user, 0).unwrap().remaining(),
            30 - n
        );
    }
}

#[test]
fn a_rejected_stack_consumes_from_none_and_reports_the_longest_wait() {
    let clock = ManualClock::new();
    let store = MemoryStore::with_clock(clock.clone());
    let per_second = Policy::fixed_window(5, Duration::from_secs(1)).unwrap();
    let per_minute = Policy::fixed_window(8, Duration::from_secs(60)).unwrap();
    let per_day = Policy::fixed_window(1000, Duration::from_secs(86_400)).unwrap();
    let stack = [
        Check::new("user:42", &per_second, 1),
        Check::new("user:42", &per_minute, 1),
        Check::new("user:42", &per_day, 1),
    ];
    let mut last = Decision::admitted(0, 0, Duration::ZERO);
    for _ in 0..7 {
        last = store.check_all_now(&stack).unwrap();
    }
    // 5 admitted in the first second; the per-second limit rejects the other 2.
    assert!(!last.allowed());
    assert_eq!(last.index(), 0);
    assert_eq!(last.retry_after(), Some(Duration::from_secs(1)));
    assert_eq!(
        store
            .check_now("user:42", &per_minute, 0)
            .unwrap()
            .remaining(),
        3
    );
    assert_eq!(
        store.check_now("user:42", &per_day, 0).unwrap().remaining(),
        995
    );
    clock.advance(Duration::from_secs(1));
    let admitted = (0..5)
        .filter(|_| store.check_all_now(&stack).unwrap().allowed())
        .count();
    assert_eq!(admitted, 3, "now the minute binds");
    let d = store.check_all_now(&stack).unwrap();
    assert_eq!((d.allowed(), d.index()), (false, 1));
    assert_eq!(d.retry_after(), Some(Duration::from_secs(59)));
    assert_eq!(
        store.check_now("user:42", &per_day, 0).unwrap().remaining(),
        992
    );
}

#[test]
fn an_admitted_stack_reports_the_policy_closest_to_exhaustion() {
    let store = MemoryStore::with_clock(ManualClock::new());
    let wide = Policy::fixed_window(100, Duration::from_secs(60)).unwrap();
    let narrow = Policy::token_bucket(Rate::per_second(1), 3).unwrap();
    let d = store
        .check_all_now(&[Check::new("a", &wide, 1), Check::new("b", &narrow, 1)])
        .unwrap();
    assert!(d.allowed());
    assert_eq!((d.index(), d.limit(), d.remaining()), (1, 3, 2));
}

#[test]
fn the_same_key_and_policy_twice_in_a_stack_counts_twice() {
    let store = MemoryStore::with_clock(ManualClock::new());
    let p = Policy::fixed_window(3, Duration::from_secs(60)).unwrap();
    let twice = [Check::new("k", &p, 1), Check::new("k", &p, 1)];
    assert!(store.check_all_now(&twice).unwrap().allowed());
    let d = store.check_all_now(&twice).unwrap();
    assert!(!d.allowed(), "2 + 2 > 3");
    assert_eq!(d.remaining(), 1);
    // Summed costs beyond the limit can never pass: an error, not a silent rejection.
    let err = store
        .check_all_now(&[Check::new("k", &p, 2), Check::new("k", &p, 2)])
        .unwrap_err();
    assert!(matches!(
        err,
        StoreError::CostExceedsLimit {
            index: 1,
            cost: 4,
            limit: 3
        }
    ));
}

#[test]
fn one_key_keeps_separate_state_per_policy() {
    let store = MemoryStore::with_clock(ManualClock::new());
    let a = Policy::fixed_window(1, Duration::from_secs(1)).unwrap();
    let b = Policy::fixed_window(1, Duration::from_secs(1))
        .unwrap()
        .named("other")
        .unwrap();
    assert!(store.check_now("k", &a, 1).unwrap().allowed());
    assert!(store.check_now("k", &b, 1).unwrap().allowed());
    assert!(!store.check_now("k", &a, 1).unwrap().allowed());
    // An identical policy built again is the same limit.
    let a2 = Policy::fixed_window(1, Duration::from_secs(1)).unwrap();
    assert!(!store.check_now("k", &a2, 1).unwrap().allowed());
}

#[test]
fn clones_share_one_state() {
    let store = MemoryStore::with_clock(ManualClock::new());
    let clone = store.clone();
    let p = Policy::gcra(Rate::per_minute(1), 2).unwrap();
    assert!(store.check_now("k", &p, 2).unwrap().allowed());
    assert!(!clone.check_now("k", &p, 1).unwrap().allowed());
}

#[test]
fn memory_is_bounded_and_recovered_state_is_forgotten_for_free() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(1024)
        .shards(4)
        .build();
    let p = Policy::token_bucket(Rate::per_second(1000), 10).unwrap();
    // A flood of fresh keys, one every 10 us, each recovering 1 ms after its request: about
    // 100 are live at any moment.
    for i in 0..50_000u64 {
        assert!(
            store
                .check_now(&format!("ip:{i}"), &p, 1)
                .unwrap()
                .allowed()
        );
        clock.advance(Duration::from_micros(10));
    }
    assert!(store.len() <= 1024, "{}", store.len());
    // Only keys that had recovered were dropped: no live state was lost.
    assert_eq!(store.evicted(), 0);
    // A live key is still limited after the flood, as long as it is not the oldest.
    store.check_now("victim", &p, 10).unwrap();
    assert!(!store.check_now("victim", &p, 1).unwrap().allowed());
    clock.advance(Duration::from_secs(2));
    assert!(store.sweep() > 0);
    assert_eq!(store.len(), 0, "every key has recovered");
}

#[test]
fn a_flood_of_live_keys_cannot_grow_memory() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder()
        .clock(clock)
        .max_keys(256)
        .shards(1)
        .build();
    let p = Policy::sliding_log(5, Duration::from_secs(3600)).unwrap();
    for i in 0..10_000u64 {
        store.check_now(&format!("k{i}"), &p, 1).unwrap();
    }
    assert!(store.len() <= 256);
    assert!(store.evicted() >= 10_000 - 256);
}

#[test]
fn huge_and_odd_keys_are_handled() {
    let store = MemoryStore::builder()
        .clock(ManualClock::new())
        .max_key_len(64)
        .build();
    let p = Policy::fixed_window(1, Duration::from_secs(1)).unwrap();
    let err = store.check_now(&"x".repeat(20_000), &p, 1).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::KeyTooLong {
                len: 20_000,
                max: 64,
                ..
            }
        ),
        "{err}"
    );
    for key in ["", "{slot}", "a\nb", "ключ", "\0"] {
        assert!(store.check_now(key, &p, 1).unwrap().allowed(), "{key:?}");
        assert!(!store.check_now(key, &p, 1).unwrap().allowed(), "{key:?}");
    }
}

#[tokio::test]
async fn the_store_trait_serves_generic_code() {
    async fn admit_all<S: Store>(store: &S, policy: &Policy, n: usize) -> usize {
        let mut admitted = 0;
        for _ in 0..n {
            if store.check("k", policy, 1).await.unwrap().allowed() {
                admitted += 1;
            }
        }
        admitted
    }
    let store = Arc::new(MemoryStore::with_clock(ManualClock::new()));
    let p = Policy::sliding_window(7, Duration::from_secs(1)).unwrap();
    assert_eq!(admit_all(&store, &p, 10).await, 7);
    let empty = store.check_all(&[]).await.unwrap();
    assert!(empty.allowed());
}

/// One policy per algorithm, limit 3, with the instant at which a key exhausted at 1 s has
/// fully recovered, worked out by hand.
fn exhausted_at_one_second() -> Vec<(Policy, Duration)> {
    let w = Duration::from_secs(10);
    let rate = Rate::per_second(1);
    let s = Duration::from_secs;
    vec![
        // The count of window [0, 10 s) is gone when the window ends.
        (Policy::fixed_window(3, w).unwrap(), s(10)),
        // The entries logged at 1 s leave the window (t - 10 s, t] at 11 s.
        (Policy::sliding_log(3, w).unwrap(), s(11)),
        // The count of window 0 still weighs on window 1, until it ends.
        (Policy::sliding_window(3, w).unwrap(), s(20)),
        // Three tokens, or three units of level or of TAT, at one a second.
        (Policy::token_bucket(rate, 3).unwrap(), s(4)),
        (Policy::leaky_bucket(rate, 3).unwrap(), s(4)),
        (Policy::gcra(rate, 3).unwrap(), s(4)),
    ]
}

/// Uses up `key`'s whole limit at the clock's current time; returns the last admission.
fn exhaust(store: &MemoryStore<ManualClock>, key: &str, policy: &Policy) -> Decision {
    let d = store.check_now(key, policy, policy.limit()).unwrap();
    assert!(d.allowed(), "{policy:?}");
    assert_eq!(d.remaining(), 0, "{policy:?}");
    d
}

#[test]
fn sweeping_forgets_only_recovered_state() {
    const NS: Duration = Duration::from_nanos(1);
    for (policy, recovered) in exhausted_at_one_second() {
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(clock.clone());
        // A zero cost peeks without writing, so "never-seen" stays a fresh key throughout.
        let peek = |key: &str| store.check_now(key, &policy, 0).unwrap();
        clock.set(Duration::from_secs(1));
        let d = exhaust(&store, "k", &policy);
        assert_eq!(
            d.reset_after(),
            recovered - Duration::from_secs(1),
            "{policy:?}"
        );

        // Exhausted: a sweep forgets nothing and the next request is still refused.
        assert_eq!(store.sweep(), 0, "{policy:?}");
        assert!(
            !store.check_now("k", &policy, 1).unwrap().allowed(),
            "{policy:?}"
        );

        // One nanosecond before recovery the state still tells from a fresh one.
        clock.set(recovered - NS);
        assert_ne!(peek("k"), peek("never-seen"), "{policy:?}");
        assert_eq!(store.sweep(), 0, "{policy:?}: live state swept");
        assert_eq!(store.len(), 1, "{policy:?}");

        // At the instant of recovery it decides like a fresh key, and a sweep forgets it.
        clock.set(recovered);
        assert_eq!(peek("k"), peek("never-seen"), "{policy:?}");
        assert_eq!(store.sweep(), 1, "{policy:?}: recovered state kept");
        assert!(store.is_empty());
        assert_eq!(
            exhaust(&store, "k", &policy),
            exhaust(&store, "twin", &policy),
            "{policy:?}"
        );
    }
}

#[test]
fn a_full_store_makes_room_from_recovered_state_and_counts_live_state_it_forgets() {
    const NS: Duration = Duration::from_nanos(1);
    // The same algorithms over 60 s or at one an hour: live for the whole test.
    let long = every_algorithm(3);
    for ((policy, recovered), long) in exhausted_at_one_second().into_iter().zip(&long) {
        assert_eq!(policy.algorithm(), long.algorithm());
        for (at, recovered_by_then) in [(recovered - NS, false), (recovered, true)] {
            let clock = ManualClock::new();
            // One shard of four keys: "old", exhausted at 1 s, and three long-lived ones.
            let store = MemoryStore::builder()
                .clock(clock.clone())
                .shards(1)
                .max_keys(4)
                .build();
            clock.set(Duration::from_secs(1));
            exhaust(&store, "old", &policy);
            for key in ["a", "b", "c"] {
                exhaust(&store, key, long);
            }
            // A new key needs room.
            clock.set(at);
            exhaust(&store, "new", long);
            assert!(store.len() <= 4, "{policy:?}");
            if recovered_by_then {
                // Only the recovered key could go, and forgetting it is not an eviction.
                assert_eq!(store.evicted(), 0, "{policy:?} at {at:?}");
                for key in ["a", "b", "c", "new"] {
                    let d = store.check_now(key, long, 1).unwrap();
                    assert!(!d.allowed(), "{policy:?}: {key} forgotten at {at:?}");
                }
            } else {
                // Every key is live: whatever went is counted.
                assert!(store.evicted() > 0, "{policy:?} at {at:?}");
            }
        }
    }
}

/// One policy per algorithm at 5 per 15 minutes (a login limit), and one per algorithm whose
/// state lives longer: one request an hour.
fn login_and_hourly() -> Vec<(Policy, Policy)> {
    let w = Duration::from_secs(15 * 60);
    let h = Duration::from_secs(3600);
    let login = Rate::new(5, w);
    let hourly = Rate::per_hour(1);
    vec![
        (
            Policy::fixed_window(5, w).unwrap(),
            Policy::fixed_window(1, h).unwrap(),
        ),
        (
            Policy::sliding_log(5, w).unwrap(),
            Policy::sliding_log(1, h).unwrap(),
        ),
        (
            Policy::sliding_window(5, w).unwrap(),
            Policy::sliding_window(1, h).unwrap(),
        ),
        (
            Policy::token_bucket(login, 5).unwrap(),
            Policy::token_bucket(hourly, 1).unwrap(),
        ),
        (
            Policy::leaky_bucket(login, 5).unwrap(),
            Policy::leaky_bucket(hourly, 1).unwrap(),
        ),
        (
            Policy::gcra(login, 5).unwrap(),
            Policy::gcra(hourly, 1).unwrap(),
        ),
    ]
}

#[test]
fn a_flood_of_barely_used_keys_cannot_buy_back_an_exhausted_quota() {
    // Issue #14: a login key exhausted at 5 per 15 minutes, then, a second later, 100,000 new
    // keys that make one request each: under the same policy, and under one whose state lives
    // longer than the login key's (which a store that forgets what recovers soonest would
    // sacrifice the login key to).
    for (login, hourly) in login_and_hourly() {
        for flood in [&login, &hourly] {
            let clock = ManualClock::new();
            let store = MemoryStore::builder()
                .clock(clock.clone())
                .max_keys(1024)
                .shards(4)
                .build();
            for _ in 0..5 {
                assert!(store.check_now("login:alice", &login, 1).unwrap().allowed());
            }
            clock.advance(Duration::from_secs(1));
            for i in 0..100_000u64 {
                let key = format!("ip:{i}");
                assert!(
                    store.check_now(&key, flood, 1).unwrap().allowed(),
                    "{flood:?}"
                );
                clock.advance(Duration::from_micros(100));
                if i % 10_000 == 0 {
                    assert!(store.len() <= 1024, "{flood:?}: {}", store.len());
                }
            }
            assert!(store.len() <= 1024, "{flood:?}: {}", store.len());
            // Nothing recovered during the flood: all but the room the store has was evicted.
            assert!(store.evicted() >= 100_000 - 1024, "{flood:?}");
            let d = store.check_now("login:alice", &login, 1).unwrap();
            assert!(!d.allowed(), "{login:?}: forgotten in a flood of {flood:?}");
            assert_eq!(d.remaining(), 0, "{login:?}");
        }
    }
}

#[test]
fn a_flood_evicts_the_least_consumed_first_and_recovered_state_before_any() {
    for (login, hourly) in login_and_hourly() {
        let clock = ManualClock::new();
        // One shard of 64 pairs; a scan that must forget live state forgets 4.
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(64)
            .shards(1)
            .build();
        // "done" recovers at 15 minutes (sliding window: 30), "used:i" has used i + 1 units of
        // the login limit, and 59 long-lived keys one unit of an hourly one.
        let short = Policy::fixed_window(5, Duration::from_secs(60)).unwrap();
        store.check_now("done", &short, 5).unwrap();
        for i in 0..4 {
            store
                .check_now(&format!("used:{i}"), &login, i + 2)
                .unwrap();
        }
        for i in 0..59 {
            store.check_now(&format!("old:{i}"), &hourly, 1).unwrap();
        }
        assert_eq!(store.len(), 64);
        // "done" has recovered: it makes room, for free, however little the others consumed.
        clock.set(Duration::from_secs(60));
        store.check_now("new:0", &hourly, 1).unwrap();
        assert_eq!((store.len(), store.evicted()), (64, 0), "{login:?}");
        let refused =
            |key: &str, p: &Policy| !store.check_now(key, p, p.limit()).unwrap().allowed();
        assert!(
            (0..59).all(|i| refused(&format!("old:{i}"), &hourly)),
            "{login:?}"
        );
        // Full of live state: each new key now costs the least consumed, a sixteenth at a
        // time; 60 new keys push out every one-unit key, never a key that used more.
        for i in 1..=60 {
            store.check_now(&format!("new:{i}"), &hourly, 1).unwrap();
            assert!(store.len() <= 64);
        }
        assert_eq!(store.evicted(), 60, "{login:?}");
        for i in 0..4 {
            let d = store.check_now(&format!("used:{i}"), &login, 0).unwrap();
            assert_eq!(
                d.remaining(),
                5 - (i + 2),
                "{login:?}: used:{i} was forgotten"
            );
        }
    }
}
