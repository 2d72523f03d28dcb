//! Leased quota on real Redis: two `LeasedStore` instances share one hot key under concurrent
//! load. Time is one `ManualClock`, injected into both stores and their scripts, and frozen
//! while a tick's requests run concurrently, so every admission has an exact time and the
//! bounds are checked against exact counts:
//!
//! - fixed window: never more than the limit in a window, and what the window's count holds
//!   beyond the admissions is the leases' unspent units (the under-admission bound);
//! - token bucket, GCRA, leaky bucket: in every span T, at most B + floor((T + L) / I);
//! - leases go back on idle, expiry, flush, shutdown and drop; a crashed instance's leases
//!   strand their units until they expire (windows: until the window ends);
//! - stacked checks with a leased key stay all or nothing;
//! - the same trace leased and unleased admits the same totals within the bound;
//! - faults and edges: a lease call dropped unfinished, waiters of a call that times out
//!   (Redis paused), local refusals' `Retry-After`, a store built outside a runtime,
//!   shutdown with a call in flight;
//! - and, on Redis' own clock with the sweep running, the stats' accounting and Redis' agree.
#![cfg(feature = "redis")]

mod support;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::store::redis::{LeasedStore, LeasedStoreBuilder, RedisStore};
use tollgate::{Check, Decision, Policy, Rate, Store};

use support::vectors::T0;

const MS: u64 = 1_000_000;
const US: u64 = 1_000;

async fn redis(url: &str, clock: &ManualClock, prefix: &str) -> RedisStore {
    RedisStore::builder()
        .url(url)
        .prefix(prefix)
        .timeout(Duration::from_secs(10))
        .injected_clock(clock.clone())
        .connect()
        .await
        .expect("connect")
}

/// A leased store on `prefix`, swept by the test only.
async fn leased(
    url: &str,
    clock: &ManualClock,
    prefix: &str,
    tweak: impl Fn(LeasedStoreBuilder) -> LeasedStoreBuilder,
) -> LeasedStore {
    let r = redis(url, clock, prefix).await;
    tweak(LeasedStore::builder(r).sweep_every(None)).build()
}

fn at(clock: &ManualClock, ns: u64) {
    clock.set(Duration::from_nanos(ns));
}

/// `n` concurrent requests of cost 1 on `key`, spread over the stores: the units admitted.
async fn wave<S: Store + Clone>(stores: &[S], key: &str, policy: &Arc<Policy>, n: usize) -> u64 {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let store = stores[i % stores.len()].clone();
            let (key, policy) = (key.to_owned(), Arc::clone(policy));
            tokio::spawn(async move { store.check(&key, &policy, 1).await.expect("check") })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        if t.await.expect("task").allowed() {
            admitted += 1;
        }
    }
    admitted
}

/// Script calls (EVALSHA and EVAL) the server has run so far.
fn script_calls(server: &support::RedisServer) -> u64 {
    server
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// A field of a Redis hash, as a number (0 when absent).
fn hget(server: &support::RedisServer, key: &str, field: &str) -> i64 {
    server
        .cli(&["HGET", key, field])
        .trim()
        .parse()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_window_admits_at_most_the_limit_in_every_window() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0);
    let a = leased(&server.url(), &clock, "fw:", |b| b).await;
    let b = leased(&server.url(), &clock, "fw:", |b| b).await;
    let stores = [a.clone(), b.clone()];
    let limit = 500;
    let window = 10 * MS;
    let policy = Arc::new(Policy::fixed_window(limit, Duration::from_nanos(window)).unwrap());
    let name = a.redis().key_name("hot", &policy);
    let tick = 250 * US;
    let mut local = 0;
    for w in 0..8 {
        let start = T0 + w * window;
        let mut admitted = 0;
        for t in 0..window / tick {
            at(&clock, start + t * tick);
            if t == 0 {
                // What the last window's leases held expired with it.
                a.sweep().await.unwrap();
                b.sweep().await.unwrap();
            }
            // Demand: 40 requests per tick, 1600 per window, against a limit of 500.
            admitted += wave(&stores, "hot", &policy, 40).await;
        }
        quiet(&[&a, &b]).await;
        let (sa, sb) = (a.stats(), b.stats());
        let outstanding = sa.outstanding + sb.outstanding;
        let count = hget(&server, &name, "count") as u64;
        assert!(admitted <= limit, "window {w}: {admitted} admitted");
        // Everything the window counted was admitted or is held in a lease, unspent.
        assert_eq!(
            admitted + outstanding,
            count,
            "window {w}: {admitted} admitted, {outstanding} held, {count} counted"
        );
        assert_eq!(count, limit, "window {w}: the demand used the whole window");
        assert_eq!(sa.units_dropped + sb.units_dropped, 0);
        local = sa.local_decisions + sb.local_decisions;
    }
    assert!(local > 1000, "only {local} decisions came from leases");
}

/// Bucket policies: rate 20 per ms (interval 50 µs), burst 200.
fn buckets() -> Vec<Policy> {
    let rate = Rate::new(20, Duration::from_millis(1));
    vec![
        Policy::gcra(rate, 200).unwrap(),
        Policy::token_bucket(rate, 200).unwrap(),
        Policy::leaky_bucket(rate, 200).unwrap(),
    ]
}

/// The most admitted in any span of ticks, against B + floor((T + L) / I).
fn assert_bucket_bound(policy: &Policy, admissions: &[(u64, u64)], lifetime: u64) {
    let interval = policy.interval().as_nanos() as u64;
    let burst = policy.limit();
    // The span that came closest: (bound - admitted, admitted, span).
    let mut tightest = (u64::MAX, 0, 0);
    for i in 0..admissions.len() {
        let mut sum = 0;
        for j in i..admissions.len() {
            sum += admissions[j].1;
            let span = admissions[j].0 - admissions[i].0;
            let bound = burst + (span + lifetime) / interval;
            assert!(
                sum <= bound,
                "{policy:?}: {sum} admitted in {span} ns, bound {bound}"
            );
            tightest = tightest.min((bound - sum, sum, span));
        }
    }
    println!(
        "{}: tightest span {} ns: {} admitted, {} under the bound",
        policy.algorithm(),
        tightest.2,
        tightest.1,
        tightest.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buckets_admit_at_most_b_plus_r_t_plus_l_in_every_span() {
    let server = redis_or_skip!();
    let lifetime = 5 * MS;
    for (n, policy) in buckets().into_iter().enumerate() {
        let clock = ManualClock::new();
        at(&clock, T0);
        let prefix = format!("bucket{n}:");
        let a = leased(&server.url(), &clock, &prefix, |b| b).await;
        let b = leased(&server.url(), &clock, &prefix, |b| b).await;
        let stores = [a.clone(), b.clone()];
        let policy = Arc::new(policy);
        let calls_before = script_calls(&server);
        let mut requests = 0;
        let tick = 250 * US;
        let mut admissions = Vec::new();
        let mut total = 0;
        for t in 0..600u64 {
            let now = T0 + t * tick;
            at(&clock, now);
            if t % 8 == 0 {
                a.sweep().await.unwrap();
                b.sweep().await.unwrap();
            }
            // Bursts of demand and quiet stretches: 4 to 60 requests a tick (refill: 5).
            let demand = if (t / 40) % 3 == 2 { 4 } else { 60 };
            let admitted = wave(&stores, "hot", &policy, demand).await;
            requests += demand as u64;
            total += admitted;
            admissions.push((now, admitted));
        }
        assert_bucket_bound(&policy, &admissions, lifetime);
        let (sa, sb) = (a.stats(), b.stats());
        println!(
            "{}: {total} admitted, {} from leases ({} leases)",
            policy.algorithm(),
            sa.local_decisions + sb.local_decisions,
            sa.leases + sb.leases
        );
        assert!(sa.local_decisions + sb.local_decisions > 500);
        assert!(sa.leases > 0 && sb.leases > 0, "both instances leased");
        // Over its limit most of the time, the key is short: refusals are answered here.
        let calls = script_calls(&server) - calls_before;
        println!(
            "{}: {requests} requests, {calls} script calls, {} refused here",
            policy.algorithm(),
            sa.local_refusals + sb.local_refusals
        );
        assert!(
            calls < requests / 2,
            "{calls} calls for {requests} requests"
        );
    }
}

/// The decisions of one request on `store` at the clock's time.
async fn one(store: &LeasedStore, key: &str, policy: &Policy) -> Decision {
    store.check(key, policy, 1).await.expect("check")
}

/// Waits until no lease call of `stores` is in flight (they run in tasks of their own).
async fn quiet(stores: &[&LeasedStore]) {
    for _ in 0..2_000 {
        if stores.iter().all(|s| s.stats().fetching == 0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("a lease call never came back");
}

/// Makes `key` hot on `store` and takes a lease: `n` sequential requests at the current time.
async fn heat(store: &LeasedStore, key: &str, policy: &Policy, n: u64) -> u64 {
    let mut admitted = 0;
    for _ in 0..n {
        if one(store, key, policy).await.allowed() {
            admitted += 1;
        }
    }
    quiet(&[store]).await;
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_go_back_on_idle_flush_and_shutdown() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0 + 1_000 * MS);
    let a = leased(&server.url(), &clock, "back:", |b| b).await;
    let policy = Policy::fixed_window(1_000, Duration::from_secs(3600)).unwrap();
    let name = a.redis().key_name("k", &policy);

    // Idle: a lease held, then no check for idle_after: the sweep gives it back.
    let admitted = heat(&a, "k", &policy, 30).await;
    assert_eq!(admitted, 30);
    let held = a.stats().outstanding;
    assert!(held > 0, "a lease was taken");
    assert_eq!(hget(&server, &name, "count") as u64, admitted + held);
    clock.advance(Duration::from_millis(5));
    a.sweep().await.unwrap();
    assert_eq!(a.stats().outstanding, held, "not idle yet");
    clock.advance(Duration::from_millis(20));
    a.sweep().await.unwrap();
    assert_eq!(a.stats().outstanding, 0);
    assert_eq!(a.stats().hot_keys, 0);
    assert_eq!(hget(&server, &name, "count") as u64, admitted);

    // Flush: everything back at once, and the key leases again when hot.
    let admitted = admitted + heat(&a, "k", &policy, 30).await;
    assert!(a.stats().outstanding > 0);
    a.flush().await.unwrap();
    assert_eq!(a.stats().outstanding, 0);
    assert_eq!(hget(&server, &name, "count") as u64, admitted);

    // Shutdown: back, and no more leases.
    let admitted = admitted + heat(&a, "k", &policy, 30).await;
    a.shutdown().await.unwrap();
    assert_eq!(hget(&server, &name, "count") as u64, admitted);
    let admitted = admitted + heat(&a, "k", &policy, 30).await;
    assert_eq!(a.stats().outstanding, 0);
    assert_eq!(hget(&server, &name, "count") as u64, admitted);
    let s = a.stats();
    assert_eq!(s.units_leased, s.units_spent + s.units_returned);

    // A bucket: its lease expires after L and the sweep gives back the unspent units, as if
    // they had never been consumed.
    let gcra = Policy::gcra(Rate::per_second(1), 1_000).unwrap();
    let b = leased(&server.url(), &clock, "back:", |b| b).await;
    let admitted = heat(&b, "g", &gcra, 30).await;
    let held = b.stats().outstanding;
    assert!(held > 0);
    clock.advance(Duration::from_millis(5));
    b.sweep().await.unwrap();
    assert_eq!(b.stats().outstanding, 0);
    let d = b.redis().check("g", &gcra, 0).await.unwrap();
    assert_eq!(d.remaining(), 1_000 - admitted);

    // Drop: the last clone gives back in the background.
    let admitted = admitted + heat(&b, "g", &gcra, 30).await;
    assert!(b.stats().outstanding > 0);
    let plain = b.redis().clone();
    drop(b);
    let mut remaining = 0;
    for _ in 0..200 {
        remaining = plain.check("g", &gcra, 0).await.unwrap().remaining();
        if remaining == 1_000 - admitted {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(remaining, 1_000 - admitted);
}

/// Checks on `store` at the current time until refused with no lease call in flight: the
/// units admitted.
async fn drain(store: &LeasedStore, key: &str, policy: &Policy) -> u64 {
    let mut admitted = 0;
    for _ in 0..1_000_000 {
        if one(store, key, policy).await.allowed() {
            admitted += 1;
            continue;
        }
        // A lease call in flight may bring units: refused for good only once it is back.
        quiet(&[store]).await;
        if one(store, key, policy).await.allowed() {
            admitted += 1;
        } else if store.stats().outstanding == 0 {
            return admitted;
        }
    }
    panic!("{key} never ran dry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_instance_strands_its_leases_until_they_expire() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    let window = Duration::from_secs(1);
    at(&clock, T0 + 100 * MS);
    let a = leased(&server.url(), &clock, "crash:", |b| b).await;
    let b = leased(&server.url(), &clock, "crash:", |b| b).await;

    // A fixed window: A's lease stays counted until the window ends, then B has it all.
    let policy = Policy::fixed_window(1_000, window).unwrap();
    let spent = heat(&a, "w", &policy, 50).await;
    let stranded = a.stats().outstanding;
    assert!(stranded > 0);
    a.crash();
    let admitted = drain(&b, "w", &policy).await;
    assert_eq!(admitted, 1_000 - spent - stranded);
    at(&clock, T0 + 1_000 * MS);
    b.sweep().await.unwrap();
    quiet(&[&b]).await;
    let admitted = drain(&b, "w", &policy).await;
    assert_eq!(admitted, 1_000, "the next window is whole");

    // A bucket: the units stay consumed, and the bucket refills as usual.
    let a = leased(&server.url(), &clock, "crash:", |b| b).await;
    let gcra = Policy::gcra(Rate::per_second(1_000), 1_000).unwrap();
    let spent = heat(&a, "g", &gcra, 50).await;
    let stranded = a.stats().outstanding;
    assert!(stranded > 0);
    a.crash();
    let d = b.redis().check("g", &gcra, 0).await.unwrap();
    assert_eq!(d.remaining(), 1_000 - spent - stranded);
    clock.advance(Duration::from_millis(10));
    let d = b.redis().check("g", &gcra, 0).await.unwrap();
    assert_eq!(d.remaining(), 1_000 - spent - stranded + 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stacked_checks_with_a_leased_key_stay_all_or_nothing() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0 + 100 * MS);
    let a = leased(&server.url(), &clock, "stack:", |b| b).await;
    let global = Policy::fixed_window(100_000, Duration::from_secs(60)).unwrap();
    let per_user = Policy::fixed_window(2, Duration::from_secs(60)).unwrap();
    let name = a.redis().key_name("global", &global);
    // The global key is hot and leased.
    let warm = heat(&a, "global", &global, 20).await;
    assert!(a.stats().outstanding > 0);
    let mut admitted = 0;
    for u in 0..50 {
        let user = format!("user:{}", u % 10);
        let checks = [
            Check::new("global", &global, 1),
            Check::new(&user, &per_user, 1),
        ];
        let d = a.check_all(&checks).await.unwrap();
        if d.allowed() {
            admitted += 1;
        } else {
            assert_eq!(d.index(), 1, "the user's limit refused");
        }
    }
    // Each of the ten users twice; the refused ones took nothing from the global lease.
    assert_eq!(admitted, 20);
    a.flush().await.unwrap();
    assert_eq!(hget(&server, &name, "count") as u64, warm + admitted);
    let s = a.stats();
    assert_eq!(s.units_dropped, 0);
    assert!(s.local_decisions > 0);

    // Stacked on two leased keys, one of them a bucket.
    // (One unit a minute refills: nothing that shows during the test.)
    let bucket = Policy::token_bucket(Rate::per_minute(1), 1_000).unwrap();
    let warm = heat(&a, "b", &bucket, 20).await;
    let _ = heat(&a, "global", &global, 20).await;
    let mut admitted = 0;
    for i in 0..1_000 {
        if i % 50 == 0 {
            // Past a short key's hold now and then (a lease lifetime), and the sweep that
            // gives back the expired leases.
            clock.advance(Duration::from_millis(5));
            quiet(&[&a]).await;
            a.sweep().await.unwrap();
        }
        let checks = [
            Check::new("global", &global, 1),
            Check::new("b", &bucket, 2),
        ];
        if a.check_all(&checks).await.unwrap().allowed() {
            admitted += 1;
        }
    }
    quiet(&[&a]).await;
    a.flush().await.unwrap();
    // The burst went in pairs, and what is left is less than a pair.
    let d = a.redis().check("b", &bucket, 0).await.unwrap();
    assert_eq!(d.remaining(), 1_000 - warm - 2 * admitted);
    assert!(d.remaining() < 2, "{} left", d.remaining());
    assert_eq!(a.stats().units_dropped, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_from_a_lease_report_the_state_as_of_the_lease() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0 + 100 * MS);
    let a = leased(&server.url(), &clock, "report:", |b| b).await;
    let b = leased(&server.url(), &clock, "report:", |b| b).await;
    let policy = Policy::fixed_window(1_000, Duration::from_secs(1)).unwrap();
    let mut spent = 0;
    let mut local = None;
    for _ in 0..40 {
        let d = one(&a, "r", &policy).await;
        assert!(d.allowed());
        spent += 1;
        if !d.reached_backend() {
            local = Some(d);
            break;
        }
    }
    let d = local.expect("a decision from a lease");
    // As of the lease: what Redis left, plus what this instance still holds.
    assert_eq!(d.remaining(), 1_000 - spent);
    assert_eq!(d.reset_after(), Duration::from_millis(900));
    // B consumes; A's leased decisions do not see it until A's next lease.
    for _ in 0..100 {
        assert!(b.redis().check("r", &policy, 1).await.unwrap().allowed());
    }
    clock.advance(Duration::from_millis(100));
    let d = one(&a, "r", &policy).await;
    assert!(!d.reached_backend());
    spent += 1;
    assert_eq!(d.remaining(), 1_000 - spent, "stale by B's 100");
    assert_eq!(d.reset_after(), Duration::from_millis(800));
}

/// One deterministic trace: (instance, time offset, cost), costs 1 to 3. Demand is far above
/// the limits (a request every 20 µs on average); with `phased`, stretches of 20 ms of that
/// alternate with stretches of demand below them (every 200 µs).
fn trace(seed: u64, steps: usize, phased: bool) -> Vec<(usize, u64, u64)> {
    let mut x = seed;
    let mut t = 0;
    (0..steps)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let quiet = phased && (t / (20 * MS)) % 2 == 1;
            t += (x >> 8) % if quiet { 400 * US } else { 40 * US };
            ((x % 2) as usize, t, 1 + (x >> 40) % 3)
        })
        .collect()
}

/// Runs the trace on two stores (time injected): the units admitted at each step. `sweep`
/// runs every millisecond, as the background sweep would.
async fn run<S: Store, F: Future<Output = ()>>(
    stores: &[S; 2],
    clock: &ManualClock,
    policy: &Policy,
    tr: &[(usize, u64, u64)],
    sweep: impl Fn() -> F,
) -> Vec<u64> {
    let mut admitted = Vec::with_capacity(tr.len());
    let mut swept = 0;
    for &(i, t, cost) in tr {
        at(clock, T0 + t);
        if t >= swept + MS {
            sweep().await;
            swept = t;
        }
        let d = stores[i].check("d", policy, cost).await.unwrap();
        admitted.push(if d.allowed() { cost } else { 0 });
    }
    admitted
}

/// The bucket bound over every span of up to 3000 steps of the trace: at most
/// B + floor((T + L) / I) units.
fn assert_trace_bound(policy: &Policy, tr: &[(usize, u64, u64)], admitted: &[u64], lifetime: u64) {
    let interval = policy.interval().as_nanos() as u64;
    for i in 0..tr.len() {
        let mut sum = 0;
        for j in i..tr.len().min(i + 3000) {
            sum += admitted[j];
            let span = tr[j].1 - tr[i].1;
            let bound = policy.limit() + (span + lifetime) / interval;
            assert!(
                sum <= bound,
                "{policy:?}: {sum} in {span} ns from step {i}, bound {bound}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_trace_leased_and_unleased_admits_alike_within_the_bound() {
    let server = redis_or_skip!();
    let rate = Rate::new(20, Duration::from_millis(1));
    let window = 10 * MS;
    let policies = [
        Policy::fixed_window(300, Duration::from_nanos(window)).unwrap(),
        Policy::gcra(rate, 200).unwrap(),
        Policy::token_bucket(rate, 200).unwrap(),
        Policy::leaky_bucket(rate, 200).unwrap(),
    ];
    let lifetime = 5 * MS;
    let mut n = 0;
    for phased in [false, true] {
        let tr = trace(0x1ea5e, 6_000, phased);
        let duration = tr.last().unwrap().1;
        for policy in &policies {
            n += 1;
            let clock = ManualClock::new();
            let plain = [
                redis(&server.url(), &clock, &format!("plain{n}:")).await,
                redis(&server.url(), &clock, &format!("plain{n}:")).await,
            ];
            let unleased = run(&plain, &clock, policy, &tr, || async {}).await;
            let clock = ManualClock::new();
            let prefix = format!("leased{n}:");
            let stores = [
                leased(&server.url(), &clock, &prefix, |b| b).await,
                leased(&server.url(), &clock, &prefix, |b| b).await,
            ];
            let sweep = || async {
                stores[0].sweep().await.unwrap();
                stores[1].sweep().await.unwrap();
            };
            let leased = run(&stores, &clock, policy, &tr, sweep).await;
            quiet(&[&stores[0], &stores[1]]).await;
            let (sa, sb) = (stores[0].stats(), stores[1].stats());
            let (total, reference) = (leased.iter().sum::<u64>(), unleased.iter().sum::<u64>());
            let from_leases = sa.units_spent + sb.units_spent;
            println!(
                "{}{}: unleased {reference}, leased {total} ({from_leases} from leases, {} leases)",
                policy.algorithm(),
                if phased { ", phased" } else { "" },
                sa.leases + sb.leases,
            );
            assert_eq!(sa.units_dropped + sb.units_dropped, 0);
            if phased || policy.algorithm().is_window() {
                // (A bucket refused most of the time leases only what refills between two
                // calls: most of its admissions go to Redis, as without leases.)
                assert!(from_leases > total / 10, "the leases did some of the work");
            }
            // The most held at once by both instances: two leases each (the next is taken
            // when half of one is spent) of at most 10 % of the limit.
            let most_held = 4 * (policy.limit() / 10);
            if policy.algorithm().is_window() {
                // Every window: at most the limit; short of the unleased run by at most what
                // the leases held at its end.
                let windows = (duration / window + 1) as usize;
                let (mut per, mut per_ref) = (vec![0; windows], vec![0; windows]);
                for (k, &(_, t, _)) in tr.iter().enumerate() {
                    per[((T0 + t) / window - T0 / window) as usize] += leased[k];
                    per_ref[((T0 + t) / window - T0 / window) as usize] += unleased[k];
                }
                for (w, (&l, &u)) in per.iter().zip(&per_ref).enumerate() {
                    assert!(l <= policy.limit(), "window {w}: {l}");
                    assert!(l + most_held >= u, "window {w}: leased {l}, unleased {u}");
                }
            } else {
                assert_trace_bound(policy, &tr, &leased, lifetime);
                // The checker itself: the unleased run holds the bound without L.
                assert_trace_bound(policy, &tr, &unleased, 0);
                if !phased {
                    // Demand above the rate all along: both runs use the whole refill, and
                    // differ by at most L's worth of it, or what the leases held.
                    let over = lifetime / policy.interval().as_nanos() as u64;
                    assert!(
                        total <= reference + over,
                        "{policy:?}: {total} > {reference} + {over}"
                    );
                }
                // Short by at most what the leases hold at a time.
                assert!(
                    total + most_held >= reference,
                    "{policy:?}: {total} < {reference}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_algorithms_never_lease() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0);
    let a = leased(&server.url(), &clock, "never:", |b| b).await;
    for policy in [
        Policy::sliding_log(1_000, Duration::from_secs(1)).unwrap(),
        Policy::sliding_window(1_000, Duration::from_secs(1)).unwrap(),
    ] {
        for _ in 0..100 {
            assert!(one(&a, "s", &policy).await.reached_backend());
        }
    }
    assert_eq!(a.stats(), tollgate::store::redis::LeaseStats::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_keys_go_to_redis_and_errors_stay_errors() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0);
    let a = leased(&server.url(), &clock, "cold:", |b| b).await;
    let policy = Policy::gcra(Rate::per_second(100), 100).unwrap();
    // Below the hot threshold in every span: no lease.
    for i in 0..100 {
        clock.advance(Duration::from_millis(5));
        assert!(
            one(&a, &format!("k{}", i % 7), &policy)
                .await
                .reached_backend()
        );
    }
    assert_eq!(a.stats().leases, 0);
    assert_eq!(a.stats().hot_keys, 0);
    // Invalid checks are refused as the Redis store refuses them, leased or not.
    let _ = heat(&a, "hot", &policy, 30).await;
    assert!(a.stats().leases > 0);
    let err = a.check("hot", &policy, 101).await.unwrap_err();
    assert!(matches!(err, tollgate::StoreError::CostExceedsLimit { .. }));
    let long = "x".repeat(70_000);
    let err = a.check(&long, &policy, 1).await.unwrap_err();
    assert!(matches!(err, tollgate::StoreError::KeyTooLong { .. }));
    // A key longer than MAX_LEASED_KEY_LEN, however hot, never leases.
    let leases = a.stats().leases;
    let long = "y".repeat(tollgate::store::redis::MAX_LEASED_KEY_LEN + 1);
    assert_eq!(heat(&a, &long, &policy, 30).await, 30);
    assert_eq!(a.stats().leases, leases);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_stacks_across_slots_stay_exact() {
    let Some(cluster) = support::RedisCluster::start() else {
        return;
    };
    let connect = || async {
        let redis = RedisStore::builder()
            .cluster(cluster.nodes())
            .timeout(Duration::from_secs(10))
            .connect()
            .await
            .expect("connect to the cluster");
        LeasedStore::new(redis)
    };
    let (a, b) = (connect().await, connect().await);
    // A global quota (one unit a minute refills: at most one during the test) and per-user
    // limits, on other slots: every stack is consume-then-refund across slots.
    let global = Arc::new(Policy::gcra(Rate::per_minute(1), 10_000).unwrap());
    let per_user = Arc::new(Policy::fixed_window(3, Duration::from_secs(86_400)).unwrap());
    let mut admitted = 0;
    // 100 at once: a bucket keeps the newest 256 pending refunds; the oldest are those of
    // admitted calls whose settle (fire and forget) is late on a loaded machine.
    for round in 0..6 {
        let tasks: Vec<_> = (0..100)
            .map(|i| {
                let store = if i % 2 == 0 { a.clone() } else { b.clone() };
                let (global, per_user) = (Arc::clone(&global), Arc::clone(&per_user));
                tokio::spawn(async move {
                    let user = format!("user:{round}:{}", i % 25);
                    let checks = [
                        Check::new("global", &global, 1),
                        Check::new(&user, &per_user, 1),
                    ];
                    store.check_all(&checks).await.expect("check").allowed()
                })
            })
            .collect();
        for t in tasks {
            if t.await.unwrap() {
                admitted += 1;
            }
        }
    }
    // Three per user, 25 users a round (each asks four times).
    assert_eq!(admitted, 3 * 150);
    let (sa, sb) = (a.stats(), b.stats());
    assert!(sa.leases + sb.leases > 0, "the global key leased");
    quiet(&[&a, &b]).await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    let d = a.redis().check("global", &global, 0).await.unwrap();
    // Units a refused stack puts back after their lease expired and went back are dropped,
    // and counted (an under-admission): Redis holds exactly the admitted and the dropped.
    let dropped = i128::from(a.stats().units_dropped + b.stats().units_dropped);
    let left = i128::from(d.remaining()) - (10_000 - i128::from(admitted)) + dropped;
    assert!(
        (0..=1).contains(&left),
        "refunds gave back exactly the rest ({left} more; {:?}, {:?})",
        a.stats(),
        b.stats()
    );
}

/// A lease call whose future is dropped before it ends (made outside a runtime, where nothing
/// finishes it in the background) ends its fetch: the next check on the key takes a lease
/// instead of waiting forever for one that will never come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_call_dropped_unfinished_leaves_no_one_waiting() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0 + 1_000 * MS);
    let a = leased(&server.url(), &clock, "drop:", |b| b).await;
    let policy = Policy::fixed_window(1_000, Duration::from_secs(3600)).unwrap();
    // Seven units of demand in this span: the eighth check makes the key hot and takes a
    // lease.
    for _ in 0..7 {
        assert!(one(&a, "k", &policy).await.allowed());
    }
    assert_eq!(a.stats().hot_keys, 0);
    let (store, p) = (a.clone(), policy.clone());
    std::thread::spawn(move || {
        let call = store.check("k", &p, 1);
        assert_eq!(store.stats().fetching, 1, "the call takes a lease");
        drop(call);
    })
    .join()
    .unwrap();
    assert_eq!(a.stats().fetching, 0, "the dropped call ended its fetch");
    let next = tokio::time::timeout(Duration::from_secs(10), one(&a, "k", &policy))
        .await
        .expect("the next check does not wait for the dropped call");
    assert!(next.allowed());
    quiet(&[&a]).await;
    assert!(a.stats().leases > 0);
}

/// Checks that wait for a key's lease call share its fate: when it times out they fail too,
/// at once, instead of each sending a call of its own that could wait for another timeout.
/// Redis is stopped (SIGSTOP) until they have failed; once it resumes, it runs the lease call
/// and the refund that followed it, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_fail_with_the_lease_call_they_waited_for() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0 + 1_000 * MS);
    let r = RedisStore::builder()
        .url(server.url())
        .prefix("pause:")
        .timeout(Duration::from_millis(300))
        .injected_clock(clock.clone())
        .connect()
        .await
        .expect("connect");
    let a = LeasedStore::builder(r).sweep_every(None).build();
    let policy = Policy::fixed_window(1_000, Duration::from_secs(3600)).unwrap();
    for _ in 0..7 {
        assert!(one(&a, "k", &policy).await.allowed());
    }
    let before = script_calls(&server);
    server.signal("STOP");
    let fetch = a.check("k", &policy, 1);
    assert_eq!(a.stats().fetching, 1);
    let waiter = a.check("k", &policy, 1);
    let (fetch, waiter) = tokio::join!(fetch, waiter);
    assert!(
        matches!(fetch, Err(tollgate::StoreError::Timeout(_))),
        "{fetch:?}"
    );
    assert!(
        matches!(waiter, Err(tollgate::StoreError::Timeout(_))),
        "{waiter:?}"
    );
    server.signal("CONT");
    // Once the server runs again: the lease call runs, and after it the refund of its token
    // (it got no answer); no waiter sent a call of its own.
    let name = a.redis().key_name("k", &policy);
    assert!(
        eventually(|| script_calls(&server) == before + 2).await,
        "the lease call and its refund ran, and nothing else: {} calls",
        script_calls(&server) - before
    );
    assert_eq!(
        hget(&server, &name, "count"),
        7,
        "what the call took came back"
    );
}

/// Polls `done` every 10 ms for up to 20 s (real time): whether it came true.
async fn eventually(mut done: impl FnMut() -> bool) -> bool {
    for _ in 0..2_000 {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    done()
}

/// A lease call that Redis runs after its caller stopped waiting (the server stopped with
/// SIGSTOP while the call is out, resumed once the caller has its timeout) leaves nothing
/// consumed: the refund of its token, sent after it on the same connection, runs after it.
/// The request that took the lease and the background prefetch of a key whose lease runs
/// low, both. (Before: the single-slot call kept what it took, up to a tenth of the limit per
/// call, counted nowhere: Redis held 8 units for none admitted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_call_that_times_out_after_redis_ran_it_strands_nothing() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0 + 1_000 * MS);
    let r = RedisStore::builder()
        .url(server.url())
        .prefix("late:")
        .timeout(Duration::from_millis(300))
        .injected_clock(clock.clone())
        .connect()
        .await
        .expect("connect");
    let a = LeasedStore::builder(r).sweep_every(None).build();
    let policy = Policy::fixed_window(1_000, Duration::from_secs(3600)).unwrap();
    let name = a.redis().key_name("k", &policy);
    let count = || hget(&server, &name, "count") as u64;

    // The request that takes the lease: seven units of demand, then the eighth.
    for _ in 0..7 {
        assert!(one(&a, "k", &policy).await.allowed());
    }
    let before = script_calls(&server);
    server.signal("STOP");
    let fetch = a.check("k", &policy, 1).await;
    assert!(
        matches!(fetch, Err(tollgate::StoreError::Timeout(_))),
        "{fetch:?}"
    );
    server.signal("CONT");
    assert!(
        eventually(|| script_calls(&server) > before).await,
        "the lease call ran"
    );
    let s = a.stats();
    assert!(
        eventually(|| count() == 7).await,
        "a lease taken after its caller left stays consumed: Redis counts {} for 7 admitted; \
         held {}, dropped {}, returned {}, in doubt {}",
        count(),
        s.outstanding,
        s.units_dropped,
        s.units_returned,
        s.units_in_doubt,
    );

    // A prefetch: the key is hot with a lease; spending it past half starts the next lease
    // call in the background, which times out while the server is stopped.
    let mut admitted = 7 + heat(&a, "k", &policy, 30).await;
    assert!(a.stats().outstanding > 0, "a lease is held");
    let calls = script_calls(&server);
    server.signal("STOP");
    let mut prefetching = false;
    for _ in 0..1_000 {
        let d = a.check("k", &policy, 1).await.expect("from the lease");
        assert!(d.allowed() && !d.reached_backend());
        admitted += 1;
        if a.stats().fetching > 0 {
            prefetching = true;
            break;
        }
    }
    assert!(prefetching, "a prefetch started");
    // It times out (the key's entry says so), and Redis runs it once resumed.
    quiet(&[&a]).await;
    server.signal("CONT");
    assert!(
        eventually(|| script_calls(&server) > calls).await,
        "the prefetch ran"
    );
    let held = a.stats().outstanding;
    let s = a.stats();
    assert!(
        eventually(|| count() == admitted + held).await,
        "a prefetch that timed out stays consumed: Redis counts {} for {admitted} admitted and \
         {held} held; dropped {}, returned {}, in doubt {}",
        count(),
        s.units_dropped,
        s.units_returned,
        s.units_in_doubt,
    );
    a.flush().await.unwrap();
    assert_eq!(count(), admitted, "every lease back");
}

/// A stack answered partly from a lease and partly by Redis reached Redis: its decision says
/// so even when the leased check is the tighter one, so that a breaker counts it as the
/// success it is. (It used to be marked as answered without the backend: two failures around
/// an answered stack opened a breaker of two consecutive failures, and probes Redis answered
/// left the breaker half-open.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_partly_answered_from_a_lease_counts_as_reaching_redis() {
    use tollgate::store::resilient::BreakerStatus;
    use tollgate::store::{ResilientStore, StoreError};
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0 + 1_000 * MS);
    let a = leased(&server.url(), &clock, "mixed:", |b| b).await;
    // The global key leases and is the tighter (fewer left); the user's goes to Redis.
    let global = Policy::fixed_window(100, Duration::from_secs(3600)).unwrap();
    let per_user = Policy::fixed_window(10_000, Duration::from_secs(3600)).unwrap();
    heat(&a, "global", &global, 10).await;
    assert!(a.stats().outstanding > 0, "the global key holds a lease");
    // A key whose every check fails in Redis (not a hash: WRONGTYPE), a store failure.
    let broken = a.redis().key_name("broken", &per_user);
    server.cli(&["SET", &broken, "not a hash"]);
    assert!(matches!(
        a.check("broken", &per_user, 1).await,
        Err(StoreError::Backend(_))
    ));
    let stack = [
        Check::new("global", &global, 1),
        Check::new("user", &per_user, 1),
    ];
    let local_before = a.stats().local_decisions;
    let d = a.check_all(&stack).await.unwrap();
    assert!(d.allowed());
    assert_eq!(d.index(), 0, "the leased check is the tighter");
    assert_eq!(
        a.stats().local_decisions,
        local_before + 1,
        "from the lease"
    );
    assert!(d.reached_backend(), "Redis decided the user's check");

    // Failure, answered stack, failure: not two consecutive failures.
    let open_for = Duration::from_millis(100);
    let r = ResilientStore::builder(a.clone())
        .timeout(Duration::from_secs(10))
        .breaker(2, open_for)
        .build();
    assert!(r.check("broken", &per_user, 1).await.is_err());
    assert!(r.check_all(&stack).await.unwrap().allowed());
    assert!(r.check("broken", &per_user, 1).await.is_err());
    assert_eq!(r.breaker_state(), BreakerStatus::Closed);

    // Two in a row open it; the first probe after `open_for`, a stack Redis answers, closes
    // it.
    assert!(r.check("broken", &per_user, 1).await.is_err());
    assert_eq!(r.breaker_state(), BreakerStatus::Open);
    let mut probed = None;
    for _ in 0..2_000 {
        match r.check_all(&stack).await {
            Err(StoreError::CircuitOpen) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            other => {
                probed = Some(other);
                break;
            }
        }
    }
    let probe = probed.expect("a probe went after open_for").unwrap();
    assert!(probe.allowed() && probe.reached_backend());
    assert_eq!(
        r.breaker_state(),
        BreakerStatus::Closed,
        "the probe closed it"
    );
}

/// A check refused here because its key is short reports the wait Redis gave (the window's
/// end, or the bucket's refill for that cost), not only the few milliseconds until the next
/// lease call: a client told to come back in 10 ms would only be refused again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_refusals_report_the_wait_redis_gave() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0 + 1_000 * MS);
    let policies = [
        Policy::fixed_window(20, Duration::from_secs(3600)).unwrap(),
        Policy::gcra(Rate::per_minute(1), 20).unwrap(),
        Policy::token_bucket(Rate::per_minute(1), 20).unwrap(),
        Policy::leaky_bucket(Rate::per_minute(1), 20).unwrap(),
    ];
    for (n, policy) in policies.iter().enumerate() {
        let a = leased(&server.url(), &clock, &format!("short{n}:"), |b| b).await;
        let mut local_refusals = Vec::new();
        for _ in 0..60 {
            let d = one(&a, "k", policy).await;
            if !d.allowed() && !d.reached_backend() {
                local_refusals.push(d);
            }
            quiet(&[&a]).await;
        }
        assert!(!local_refusals.is_empty(), "{policy:?}: the key went short");
        // Short or not, a cost the policy can never admit is an error, not a refusal.
        let err = a.check("k", policy, 21).await.unwrap_err();
        assert!(
            matches!(err, tollgate::StoreError::CostExceedsLimit { .. }),
            "{err:?}"
        );
        let redis = a.redis().check("k", policy, 1).await.unwrap();
        assert!(!redis.allowed());
        let wait = redis.retry_after().unwrap();
        assert!(wait >= Duration::from_secs(1), "{wait:?}");
        for d in local_refusals {
            assert_eq!(d.retry_after(), Some(wait), "{policy:?}");
        }
    }
}

/// A store built outside a runtime starts its sweep when a key first takes a lease inside
/// one, so that expired and idle leases still go back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_built_outside_a_runtime_still_sweeps() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0 + 1_000 * MS);
    let r = redis(&server.url(), &clock, "outside:").await;
    let a = std::thread::spawn(move || {
        LeasedStore::builder(r)
            .sweep_every(Some(Duration::from_millis(1)))
            .build()
    })
    .join()
    .unwrap();
    let policy = Policy::fixed_window(1_000, Duration::from_secs(3600)).unwrap();
    let name = a.redis().key_name("k", &policy);
    let admitted = heat(&a, "k", &policy, 30).await;
    assert!(a.stats().outstanding > 0, "a lease was taken");
    // Idle from now on: the sweep gives the lease back.
    clock.advance(Duration::from_secs(1));
    for _ in 0..5_000 {
        if a.stats().outstanding == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(a.stats().outstanding, 0, "the sweep ran");
    assert_eq!(hget(&server, &name, "count") as u64, admitted);
}

/// Shutdown waits for the lease calls in flight, and gives back what they took too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_lease_calls_in_flight() {
    let server = redis_or_skip!();
    let clock = ManualClock::new();
    at(&clock, T0 + 1_000 * MS);
    let a = leased(&server.url(), &clock, "shut:", |b| b).await;
    let policy = Policy::fixed_window(1_000, Duration::from_secs(3600)).unwrap();
    let name = a.redis().key_name("k", &policy);
    for _ in 0..7 {
        assert!(one(&a, "k", &policy).await.allowed());
    }
    server.cli(&["CLIENT", "PAUSE", "300", "ALL"]);
    let fetch = a.check("k", &policy, 1);
    assert_eq!(a.stats().fetching, 1);
    let (fetch, shutdown) = tokio::join!(fetch, a.shutdown());
    assert!(fetch.unwrap().allowed());
    shutdown.unwrap();
    let s = a.stats();
    assert!(s.leases > 0, "the call in flight took a lease");
    assert_eq!((s.outstanding, s.fetching), (0, 0));
    assert_eq!(hget(&server, &name, "count"), 8, "what it took came back");
}

/// On Redis' own clock (TIME) with the background sweep running, as in production: two
/// instances, 1,000 concurrent requests on one bucket of 300: never more than 300 admitted,
/// and once both have shut down, Redis holds exactly what was admitted and what the stats
/// count as dropped (the stats' accounting and Redis' agree).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_real_clock_with_the_sweep_running_accounts_stay_exact() {
    let server = redis_or_skip!();
    for (n, policy) in [
        Policy::gcra(Rate::per_hour(1), 300).unwrap(),
        Policy::token_bucket(Rate::per_hour(1), 300).unwrap(),
    ]
    .into_iter()
    .enumerate()
    {
        let connect = || async {
            let r = RedisStore::builder()
                .url(server.url())
                .prefix(format!("real{n}:"))
                .timeout(Duration::from_secs(10))
                .connect()
                .await
                .expect("connect");
            LeasedStore::new(r)
        };
        let (a, b) = (connect().await, connect().await);
        let policy = Arc::new(policy);
        let mut admitted = 0;
        for _ in 0..4 {
            admitted += wave(&[a.clone(), b.clone()], "k", &policy, 250).await;
        }
        assert!(admitted <= 300, "{policy:?}: {admitted}");
        let (sa, sb) = (a.stats(), b.stats());
        assert!(sa.leases + sb.leases > 0, "{policy:?}: the key leased");
        quiet(&[&a, &b]).await;
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
        let mut dropped = 0;
        for s in [a.stats(), b.stats()] {
            assert_eq!(s.outstanding, 0);
            assert_eq!(
                s.units_leased,
                s.units_spent + s.units_returned + s.units_dropped,
                "{s:?}"
            );
            dropped += s.units_dropped;
        }
        // (Dropped: units a refused stack put back after their lease had gone back; none
        // here, where every check is alone, but counted if any.)
        let left = a.redis().check("k", &policy, 0).await.unwrap().remaining();
        assert_eq!(left, 300 - admitted - dropped, "{policy:?}");
    }
}

/// A stack across slots whose other slot does not answer in time fails with a timeout, and
/// what its hot key's slot consumed meanwhile (the request's cost and the lease it asked for)
/// goes back, whether the slot's answer comes before the call's timeout or after it (cut off
/// between consuming and refunding, it used to stay consumed: up to a tenth of the limit per
/// lease call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_timed_out_across_slots_takes_back_what_it_consumed() {
    let Some(cluster) = support::RedisCluster::start() else {
        return;
    };
    let r = RedisStore::builder()
        .cluster(cluster.nodes())
        .timeout(Duration::from_millis(300))
        .connect()
        .await
        .expect("connect to the cluster");
    let a = LeasedStore::new(r);
    // One unit a minute refills: at most one during the test.
    let policy = Policy::gcra(Rate::per_minute(1), 1_000).unwrap();
    let node_of = |key: &str| {
        let name = a.redis().key_name(key, &policy);
        cluster
            .nodes
            .iter()
            .position(|n| n.cli(&["EXISTS", &name]).trim() == "1")
            .expect("the key exists on a node")
    };
    assert!(
        a.redis()
            .check("global", &policy, 1)
            .await
            .unwrap()
            .allowed()
    );
    let g = node_of("global");
    let mut other = None;
    for i in 0..64 {
        let user = format!("user{i}");
        assert!(a.redis().check(&user, &policy, 1).await.unwrap().allowed());
        if node_of(&user) != g {
            other = Some((user, node_of(&format!("user{i}"))));
            break;
        }
    }
    let (user, u) = other.expect("a user key on another node");
    let mut admitted = 1;
    for attempt in 0..6 {
        // Seven units of demand, then the stack whose global check takes a lease.
        for _ in 0..7 {
            assert!(one(&a, "global", &policy).await.allowed());
            admitted += 1;
        }
        cluster.nodes[u].signal("STOP");
        let stack = [
            Check::new("global", &policy, 1),
            Check::new(&user, &policy, 1),
        ];
        let r = a.check_all(&stack).await;
        cluster.nodes[u].signal("CONT");
        // Answers once it has run what was sent to it meanwhile.
        cluster.nodes[u].cli(&["PING"]);
        match r {
            Err(tollgate::StoreError::Timeout(_)) => {}
            other => panic!("attempt {attempt}: {other:?}"),
        }
        quiet(&[&a]).await;
        a.flush().await.unwrap();
    }
    a.shutdown().await.unwrap();
    // What is left: all but what was admitted, whatever the timeouts cut (the give-backs of
    // calls nobody waited for run in the background).
    let expected = 1_000 - admitted;
    let mut left = 0;
    for _ in 0..200 {
        left = a
            .redis()
            .check("global", &policy, 0)
            .await
            .unwrap()
            .remaining();
        if left >= expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        (expected..=expected + 1).contains(&left),
        "the timed-out stacks' leases came back: {left} left, {expected} expected"
    );
}
