//! Property tests on random bursty traces: the bounds each algorithm promises, the agreement of
//! the three bucket algorithms, and the exactness of `remaining`, `retry_after` and
//! `reset_after`.

use std::time::Duration;

use proptest::prelude::*;
use tollgate::algorithm::{FixedWindow, Gcra, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket};
use tollgate::clock::ManualClock;
use tollgate::{Algorithm, Decision, MemoryStore, Policy, Rate};

/// Any algorithm's state, driven through the pure functions.
#[derive(Clone, Debug)]
enum Machine {
    Fixed(FixedWindow),
    Log(SlidingLog),
    Sliding(SlidingWindow),
    Token(TokenBucket),
    Leaky(LeakyBucket),
    Gcra(Gcra),
}

impl Machine {
    fn new(algorithm: Algorithm, limit: u64, period: u64) -> Self {
        match algorithm {
            Algorithm::FixedWindow => Machine::Fixed(FixedWindow::default()),
            Algorithm::SlidingLog => Machine::Log(SlidingLog::default()),
            Algorithm::SlidingWindow => Machine::Sliding(SlidingWindow::default()),
            Algorithm::TokenBucket => Machine::Token(TokenBucket::full(limit, period)),
            Algorithm::LeakyBucket => Machine::Leaky(LeakyBucket::default()),
            _ => Machine::Gcra(Gcra::default()),
        }
    }

    /// Decides without changing the state.
    fn peek(&self, limit: u64, period: u64, now: u64, cost: u64) -> Decision {
        self.clone().check(limit, period, now, cost)
    }

    /// Decides and, like the store, writes the state back for an admission of a non-zero
    /// cost (a zero cost is a peek).
    fn check(&mut self, limit: u64, period: u64, now: u64, cost: u64) -> Decision {
        let write = cost > 0;
        match self {
            Machine::Fixed(s) => apply(s, write, |s| s.check(limit, period, now, cost)),
            Machine::Sliding(s) => apply(s, write, |s| s.check(limit, period, now, cost)),
            Machine::Token(s) => apply(s, write, |s| s.check(limit, period, now, cost)),
            Machine::Leaky(s) => apply(s, write, |s| s.check(limit, period, now, cost)),
            Machine::Gcra(s) => apply(s, write, |s| s.check(limit, period, now, cost)),
            Machine::Log(log) => {
                let d = log.check(limit, period, now, cost);
                if d.allowed() {
                    log.record(period, now, cost);
                }
                d
            }
        }
    }
}

impl Machine {
    /// When the state will be indistinguishable from a fresh one, by the algorithm's own
    /// account (what the store sweeps and evicts by).
    fn recovered_at(&self, limit: u64, period: u64) -> u64 {
        match self {
            Machine::Fixed(s) => s.recovered_at(period),
            Machine::Log(log) => log.recovered_at(period),
            Machine::Sliding(s) => s.recovered_at(period),
            Machine::Token(s) => s.recovered_at(limit, period),
            Machine::Leaky(s) => s.recovered_at(),
            Machine::Gcra(s) => s.recovered_at(),
        }
    }
}

fn apply<S: Copy + PartialEq + std::fmt::Debug>(
    s: &mut S,
    write: bool,
    f: impl Fn(S) -> (S, Decision),
) -> Decision {
    let (next, d) = f(*s);
    if d.allowed() {
        if write {
            *s = next;
        }
    } else {
        assert_eq!(next, *s, "a rejection must not change the state");
    }
    d
}

const ALL: [Algorithm; 6] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingLog,
    Algorithm::SlidingWindow,
    Algorithm::TokenBucket,
    Algorithm::LeakyBucket,
    Algorithm::Gcra,
];

/// A bursty trace: (gap before the request in ns, cost). Gaps are mostly zero or small, with
/// occasional long pauses, around a period of 1 ms to 1 s.
fn trace(max_cost: u64) -> impl Strategy<Value = Vec<(u64, u64)>> {
    let gap = prop_oneof![
        4 => Just(0u64),
        4 => 0u64..5_000_000,
        2 => 0u64..500_000_000,
        1 => 0u64..5_000_000_000,
    ];
    prop::collection::vec((gap, 0..=max_cost), 1..160)
}

/// Times along a trace.
fn times(trace: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut t = 0u64;
    trace
        .iter()
        .map(|&(gap, cost)| {
            t += gap;
            (t, cost)
        })
        .collect()
}

/// The admitted (time, cost) pairs of a run.
fn run(algorithm: Algorithm, limit: u64, period: u64, trace: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut m = Machine::new(algorithm, limit, period);
    times(trace)
        .into_iter()
        .filter(|&(t, c)| m.check(limit, period, t, c).allowed())
        .collect()
}

/// The most admitted cost in any interval `[t, t + span)` (or `(t - span, t]` when
/// `closed_end`), starting or ending at an admitted request.
fn max_in_span(admitted: &[(u64, u64)], span: u64) -> u64 {
    let mut best = 0;
    for (i, &(start, _)) in admitted.iter().enumerate() {
        let sum: u64 = admitted[i..]
            .iter()
            .take_while(|&&(t, _)| t < start + span)
            .map(|&(_, c)| c)
            .sum();
        best = best.max(sum);
    }
    best
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn sliding_log_never_admits_more_than_the_limit_in_any_window(
        limit in 1u64..20, window_ms in 1u64..2_000, trace in trace(5)
    ) {
        let w = window_ms * 1_000_000;
        let admitted = run(Algorithm::SlidingLog, limit, w, &trace);
        // Windows (t - W, t]: any W consecutive nanoseconds.
        prop_assert!(max_in_span(&admitted, w) <= limit);
    }

    #[test]
    fn fixed_window_admits_at_most_the_limit_per_window_and_twice_across(
        limit in 1u64..20, window_ms in 1u64..2_000, trace in trace(5)
    ) {
        let w = window_ms * 1_000_000;
        let admitted = run(Algorithm::FixedWindow, limit, w, &trace);
        prop_assert!(max_in_span(&admitted, w) <= 2 * limit);
        let mut per_window = std::collections::BTreeMap::new();
        for (t, c) in &admitted {
            *per_window.entry(t / w).or_insert(0) += c;
        }
        prop_assert!(per_window.values().all(|&n| n <= limit));
    }

    #[test]
    fn sliding_window_counter_admits_at_most_the_limit_per_aligned_window(
        limit in 1u64..20, window_ms in 1u64..2_000, trace in trace(5)
    ) {
        let w = window_ms * 1_000_000;
        let admitted = run(Algorithm::SlidingWindow, limit, w, &trace);
        let mut per_window = std::collections::BTreeMap::new();
        for (t, c) in &admitted {
            *per_window.entry(t / w).or_insert(0) += c;
        }
        prop_assert!(per_window.values().all(|&n| n <= limit));
        prop_assert!(max_in_span(&admitted, w) <= 2 * limit);
    }

    #[test]
    fn buckets_never_admit_more_than_burst_plus_rate_times_span(
        burst in 1u64..20, per_ms in 1u64..1_000, trace in trace(5)
    ) {
        let interval = per_ms * 1_000_000;
        for algorithm in [Algorithm::TokenBucket, Algorithm::LeakyBucket, Algorithm::Gcra] {
            let admitted = run(algorithm, burst, interval, &trace);
            for (i, &(a, _)) in admitted.iter().enumerate() {
                let mut sum = 0;
                for &(b, c) in &admitted[i..] {
                    sum += c;
                    // In [a, b]: at most B + (b - a) / interval.
                    prop_assert!(sum <= burst + (b - a) / interval, "{algorithm}: {sum} in [{a}, {b}]");
                }
            }
        }
    }

    #[test]
    fn the_three_buckets_agree_exactly(
        burst in 1u64..20, count in 1u64..50, per_ms in 1u64..3_000, trace in trace(6)
    ) {
        let rate = Rate::new(count, Duration::from_millis(per_ms));
        let policies: Vec<Policy> = [Policy::token_bucket, Policy::leaky_bucket, Policy::gcra]
            .iter()
            .map(|make| make(rate, burst).unwrap())
            .collect();
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(clock.clone());
        for (t, cost) in times(&trace) {
            clock.set(Duration::from_nanos(t));
            let d: Vec<_> = policies
                .iter()
                .map(|p| store.check_now("k", p, cost.min(burst)).unwrap())
                .collect();
            prop_assert_eq!(d[0], d[1]);
            prop_assert_eq!(d[0], d[2]);
        }
    }

    #[test]
    fn remaining_retry_after_and_reset_after_are_exact(
        alg in 0usize..6, limit in 1u64..12, period_ms in 1u64..1_500, trace in trace(4)
    ) {
        let algorithm = ALL[alg];
        let period = period_ms * 1_000_000;
        let mut m = Machine::new(algorithm, limit, period);
        for (t, cost) in times(&trace) {
            let cost = cost.min(limit);
            let d = m.check(limit, period, t, cost);
            // `remaining` is the largest cost admitted right now.
            prop_assert!(m.peek(limit, period, t, d.remaining()).allowed(), "{algorithm} {d:?}");
            if d.remaining() < limit {
                prop_assert!(!m.peek(limit, period, t, d.remaining() + 1).allowed(), "{algorithm} {d:?}");
            }
            // `retry_after` is the first instant at which the same request is admitted.
            if let Some(wait) = d.retry_after() {
                let wait = wait.as_nanos() as u64;
                prop_assert!(m.peek(limit, period, t + wait, cost).allowed(), "{algorithm} at +{wait}: {d:?}");
                prop_assert!(!m.peek(limit, period, t + wait - 1, cost).allowed(), "{algorithm} at +{wait}-1: {d:?}");
            }
            // After `reset_after` the state is as good as new: it ends exactly when the state
            // has recovered (the property below pins `recovered_at` itself).
            let reset = d.reset_after().as_nanos() as u64;
            let later = m.peek(limit, period, t + reset, 0);
            prop_assert_eq!(later.remaining(), limit, "{} {:?}", algorithm, d);
            prop_assert_eq!(t + reset, m.recovered_at(limit, period).max(t), "{} {:?}", algorithm, d);
        }
    }

    #[test]
    fn recovered_at_is_the_first_instant_from_which_a_fresh_state_decides_the_same(
        alg in 0usize..6, limit in 1u64..12, period_ms in 1u64..1_500, trace in trace(4),
        then in trace(4)
    ) {
        let algorithm = ALL[alg];
        let period = period_ms * 1_000_000;
        let fresh = Machine::new(algorithm, limit, period);
        let mut kept = fresh.clone();
        let mut written = false;
        for (t, cost) in times(&trace) {
            let cost = cost.min(limit);
            written |= kept.check(limit, period, t, cost).allowed() && cost > 0;
        }
        let at = kept.recovered_at(limit, period);
        let same = |now: u64| {
            (0..=limit).all(|c| kept.peek(limit, period, now, c) == fresh.peek(limit, period, now, c))
        };
        // A state that anything was written to is not forgotten a nanosecond early...
        if written {
            prop_assert!(at > 0 && !same(at - 1), "{algorithm} at {at} - 1: {kept:?}");
        }
        // ...and forgetting it at `at`, or any time later, changes no decision.
        prop_assert!(same(at), "{algorithm} at {at}: {kept:?}");
        prop_assert!(same(at + 1), "{algorithm} at {at} + 1: {kept:?}");
        let mut forgotten = fresh.clone();
        for (t, cost) in times(&then) {
            let cost = cost.min(limit);
            let a = kept.check(limit, period, at + t, cost);
            let b = forgotten.check(limit, period, at + t, cost);
            prop_assert_eq!(a, b, "{} at {} + {}", algorithm, at, t);
        }
    }

    #[test]
    fn time_running_backwards_never_mints_capacity(
        alg in 0usize..6, limit in 1u64..12, period_ms in 1u64..1_000,
        steps in prop::collection::vec((0u64..3_000_000_000, 0u64..4), 1..120)
    ) {
        // Arbitrary (not monotonic) times: the bounds still hold on the time line of the
        // latest instant the state has recorded (only admissions record anything).
        let algorithm = ALL[alg];
        let period = period_ms * 1_000_000;
        let mut m = Machine::new(algorithm, limit, period);
        let mut seen = 0;
        let mut admitted = Vec::new();
        for (t, cost) in steps {
            let cost = cost.min(limit);
            if m.check(limit, period, t, cost).allowed() && cost > 0 {
                seen = u64::max(seen, t);
                admitted.push((seen, cost));
            }
        }
        let bound = match algorithm {
            Algorithm::SlidingLog => limit,
            _ if algorithm.is_window() => 2 * limit,
            _ => limit + 1,
        };
        prop_assert!(max_in_span(&admitted, period) <= bound, "{algorithm}: {admitted:?}");
    }
}

/// Any u64, with the edges and small values well represented.
fn edgy(min: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        min..=u64::MAX,
        min..min + 1000,
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(min)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn no_input_makes_an_algorithm_panic(
        alg in 0usize..6, limit in edgy(1), period in edgy(1),
        steps in prop::collection::vec((edgy(0), edgy(0)), 1..20)
    ) {
        let algorithm = ALL[alg];
        let mut m = Machine::new(algorithm, limit, period);
        for (now, cost) in steps {
            let d = m.check(limit, period, now, cost);
            prop_assert!(d.allowed() || d.retry_after().is_some());
        }
    }
}
