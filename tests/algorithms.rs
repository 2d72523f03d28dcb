//! The worked examples of the reference documents, one algorithm at a time, through the
//! in-process store and a manual clock.

use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::{Decision, MemoryStore, Policy, Rate, StoreError};

const MS: Duration = Duration::from_millis(1);

fn setup() -> (ManualClock, MemoryStore<ManualClock>) {
    let clock = ManualClock::new();
    (clock.clone(), MemoryStore::with_clock(clock))
}

fn hit(store: &MemoryStore<ManualClock>, policy: &Policy, cost: u64) -> Decision {
    store.check_now("k", policy, cost).unwrap()
}

fn admitted(store: &MemoryStore<ManualClock>, policy: &Policy, n: usize) -> usize {
    (0..n).filter(|_| hit(store, policy, 1).allowed()).count()
}

#[test]
fn fixed_window_allows_a_double_burst_across_a_boundary() {
    // Limit 3 per 10 s: 3 requests at 8-9 s and 3 more at 10-12 s all pass, 6 within 4 s.
    let (clock, store) = setup();
    let p = Policy::fixed_window(3, Duration::from_secs(10)).unwrap();
    clock.set(Duration::from_secs(8));
    assert!(hit(&store, &p, 1).allowed());
    clock.set(Duration::from_secs(9));
    assert!(hit(&store, &p, 1).allowed());
    let third = hit(&store, &p, 1);
    assert!(third.allowed());
    assert_eq!(third.remaining(), 0);
    assert_eq!(third.reset_after(), Duration::from_secs(1));
    let fourth = hit(&store, &p, 1);
    assert!(!fourth.allowed());
    assert_eq!(fourth.retry_after(), Some(Duration::from_secs(1)));
    // An instant exactly at 10 s belongs to the window that starts there.
    clock.set(Duration::from_secs(10));
    assert_eq!(admitted(&store, &p, 1), 1);
    clock.set(Duration::from_secs(11));
    assert_eq!(admitted(&store, &p, 1), 1);
    clock.set(Duration::from_secs(12));
    assert_eq!(admitted(&store, &p, 5), 1);
    let d = hit(&store, &p, 1);
    assert_eq!(d.retry_after(), Some(Duration::from_secs(8)));
}

#[test]
fn sliding_log_window_is_open_at_its_start() {
    // Window (t - W, t]: an entry exactly W old has expired.
    let (clock, store) = setup();
    let p = Policy::sliding_log(2, Duration::from_secs(10)).unwrap();
    assert!(hit(&store, &p, 1).allowed()); // t = 0
    clock.set(Duration::from_secs(4));
    assert!(hit(&store, &p, 1).allowed()); // t = 4
    clock.set(Duration::from_secs(6));
    let d = hit(&store, &p, 1);
    assert!(!d.allowed());
    assert_eq!(
        d.retry_after(),
        Some(Duration::from_secs(4)),
        "the t=0 entry leaves at 10"
    );
    assert_eq!(
        d.reset_after(),
        Duration::from_secs(8),
        "the t=4 entry leaves at 14"
    );
    clock.set(Duration::from_secs(10) - Duration::from_nanos(1));
    assert!(!hit(&store, &p, 1).allowed());
    clock.set(Duration::from_secs(10));
    let d = hit(&store, &p, 1);
    assert!(d.allowed());
    assert_eq!(d.remaining(), 0);
    // Rejected requests are not logged: they never push the wait further away.
    clock.set(Duration::from_secs(11));
    for _ in 0..5 {
        assert_eq!(
            hit(&store, &p, 1).retry_after(),
            Some(Duration::from_secs(3))
        );
    }
}

#[test]
fn sliding_log_weighted_retry_waits_for_enough_entries() {
    let (clock, store) = setup();
    let p = Policy::sliding_log(10, Duration::from_secs(60)).unwrap();
    assert!(hit(&store, &p, 3).allowed()); // t = 0
    clock.set(Duration::from_secs(10));
    assert!(hit(&store, &p, 3).allowed()); // t = 10
    clock.set(Duration::from_secs(20));
    assert!(hit(&store, &p, 4).allowed()); // t = 20, full
    clock.set(Duration::from_secs(30));
    // A cost of 5 needs the entries of t = 0 and t = 10 (3 + 3 >= 5) gone: at 70 s.
    let d = hit(&store, &p, 5);
    assert_eq!((d.allowed(), d.remaining()), (false, 0));
    assert_eq!(d.retry_after(), Some(Duration::from_secs(40)));
    // A cost of 3 needs only the first: at 60 s.
    assert_eq!(
        hit(&store, &p, 3).retry_after(),
        Some(Duration::from_secs(30))
    );
    clock.set(Duration::from_secs(60));
    let d = hit(&store, &p, 3);
    assert_eq!((d.allowed(), d.remaining()), (true, 0));
}

#[test]
fn sliding_window_counter_reference_example() {
    // Limit 100, W = 60 s, prev = 80, cur = 30, at 15 s into the window: 80 * 0.75 + 30 = 90.
    let (clock, store) = setup();
    let p = Policy::sliding_window(100, Duration::from_secs(60)).unwrap();
    clock.set(Duration::from_secs(10));
    assert!(hit(&store, &p, 80).allowed());
    // At 65 s the estimate is 80 * 55/60 = 73.3: a cost of 30 does not fit (73.3 + 29 >= 100)
    // and only 27 unit requests would. At 70 s it is 66.7 and 30 fit.
    clock.set(Duration::from_secs(65));
    assert!(!hit(&store, &p, 30).allowed());
    assert_eq!(hit(&store, &p, 0).remaining(), 27);
    clock.set(Duration::from_secs(70));
    assert!(hit(&store, &p, 30).allowed());
    clock.set(Duration::from_secs(75));
    let d = hit(&store, &p, 1);
    assert!(d.allowed(), "estimate 90 < 100");
    // After counting it: 60 + 31 = 91, so 9 more unit requests fit (91 + 8 < 100).
    assert_eq!(d.remaining(), 9);
    assert_eq!(admitted(&store, &p, 20), 9);
    let d = hit(&store, &p, 1);
    assert!(!d.allowed());
    // Now 60 + 40 = 100. The estimate drops below 100 when prev's weight loses 1/80 of a
    // request: 80 * d / 60 s > 0 for d > 0, i.e. at once (1 ns later); that is the exact answer.
    assert_eq!(d.retry_after(), Some(Duration::from_nanos(1)));
    // With a cost of 5 the estimate must reach 95 - ... : 80 * (45 s - d) / 60 s + 40 + 4 < 100
    // <=> 80 * (45 - d) < 3360 <=> d > 3 s.
    let d = hit(&store, &p, 5);
    assert_eq!(
        d.retry_after(),
        Some(Duration::from_secs(3) + Duration::from_nanos(1))
    );
}

#[test]
fn sliding_window_counter_forgets_a_window_that_is_not_adjacent() {
    let (clock, store) = setup();
    let p = Policy::sliding_window(10, Duration::from_secs(1)).unwrap();
    assert_eq!(admitted(&store, &p, 15), 10);
    // 0.5 s into the next window, half of the previous one still counts: 5 more.
    clock.set(Duration::from_millis(1500));
    assert_eq!(admitted(&store, &p, 15), 5);
    // Two windows later nothing counts any more.
    clock.set(Duration::from_millis(3000));
    assert_eq!(admitted(&store, &p, 15), 10);
}

#[test]
fn token_bucket_burst_of_twelve_then_one_more() {
    // B = 10, r = 5/s: a burst of 12 admits 10; 200 ms later one token is back.
    let (clock, store) = setup();
    let p = Policy::token_bucket(Rate::per_second(5), 10).unwrap();
    let burst: Vec<Decision> = (0..12).map(|_| hit(&store, &p, 1)).collect();
    assert_eq!(burst.iter().filter(|d| d.allowed()).count(), 10);
    let last = burst[11];
    assert_eq!(last.retry_after(), Some(200 * MS));
    assert_eq!(last.reset_after(), Duration::from_secs(2));
    assert_eq!(last.remaining(), 0);
    clock.advance(199 * MS);
    assert!(!hit(&store, &p, 1).allowed());
    clock.advance(MS);
    let d = hit(&store, &p, 1);
    assert!(d.allowed());
    assert_eq!(d.remaining(), 0);
    assert!(!hit(&store, &p, 1).allowed());
}

#[test]
fn weighted_costs_pay_in_full_or_not_at_all() {
    let (clock, store) = setup();
    for p in [
        Policy::token_bucket(Rate::per_second(10), 30).unwrap(),
        Policy::leaky_bucket(Rate::per_second(10), 30).unwrap(),
        Policy::gcra(Rate::per_second(10), 30).unwrap(),
    ] {
        let key = format!("{:?}", p.algorithm());
        let check = |cost| store.check_now(&key, &p, cost).unwrap();
        assert!(check(25).allowed()); // an export
        let d = check(25);
        assert!(!d.allowed(), "{p:?}: only 5 left");
        assert_eq!(d.remaining(), 5);
        assert_eq!(
            d.retry_after(),
            Some(Duration::from_secs(2)),
            "{p:?}: 20 tokens at 10/s"
        );
        assert!(check(1).allowed(), "{p:?}: cheap calls keep passing");
        clock.advance(Duration::from_secs(3));
        assert!(check(25).allowed(), "{p:?}");
        clock.set(Duration::ZERO);
    }
}

#[test]
fn leaky_meter_and_gcra_match_the_token_bucket() {
    let (clock, store) = setup();
    let rate = Rate::per_second(2);
    let policies = [
        Policy::token_bucket(rate, 4).unwrap(),
        Policy::leaky_bucket(rate, 4).unwrap(),
        Policy::gcra(rate, 4).unwrap(),
    ];
    for step in 0..40u64 {
        clock.set(Duration::from_millis(step * 130));
        let cost = step % 3;
        let decisions: Vec<Decision> = policies
            .iter()
            .map(|p| store.check_now(p.algorithm().as_str(), p, cost).unwrap())
            .collect();
        assert_eq!(decisions[0], decisions[1], "step {step}");
        assert_eq!(decisions[0], decisions[2], "step {step}");
    }
}

#[test]
fn a_cost_above_the_limit_is_an_error_not_a_hang() {
    let (_, store) = setup();
    for p in [
        Policy::fixed_window(5, Duration::from_secs(1)).unwrap(),
        Policy::sliding_log(5, Duration::from_secs(1)).unwrap(),
        Policy::sliding_window(5, Duration::from_secs(1)).unwrap(),
        Policy::token_bucket(Rate::per_second(1), 5).unwrap(),
        Policy::leaky_bucket(Rate::per_second(1), 5).unwrap(),
        Policy::gcra(Rate::per_second(1), 5).unwrap(),
    ] {
        let err = store.check_now("k", &p, 6).unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::CostExceedsLimit {
                    cost: 6,
                    limit: 5,
                    ..
                }
            ),
            "{p:?}: {err}"
        );
        let err = store.check_now("k", &p, u64::MAX).unwrap_err();
        assert!(err.to_string().contains("could never be admitted"));
        // The full limit itself is fine on a fresh key.
        assert!(store.check_now("fresh", &p, 5).unwrap().allowed(), "{p:?}");
    }
}

#[test]
fn a_zero_cost_peeks_without_consuming() {
    let (_, store) = setup();
    let p = Policy::fixed_window(2, Duration::from_secs(1)).unwrap();
    assert_eq!(hit(&store, &p, 0).remaining(), 2);
    assert!(hit(&store, &p, 2).allowed());
    let peek = hit(&store, &p, 0);
    assert!(peek.allowed());
    assert_eq!(peek.remaining(), 0);
    assert!(!hit(&store, &p, 1).allowed());
}

#[test]
fn time_never_runs_backwards_inside_a_state() {
    let (clock, store) = setup();
    let p = Policy::token_bucket(Rate::per_second(1), 1).unwrap();
    clock.set(Duration::from_secs(100));
    assert!(hit(&store, &p, 1).allowed());
    // The clock jumps back: no token is minted by going back and forth.
    clock.set(Duration::from_secs(50));
    assert!(!hit(&store, &p, 1).allowed());
    clock.set(Duration::from_secs(100));
    assert!(!hit(&store, &p, 1).allowed());
    clock.set(Duration::from_secs(101));
    assert!(hit(&store, &p, 1).allowed());
}
