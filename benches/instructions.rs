//! The figures CI guards: instructions per operation on the hot paths, counted by valgrind's
//! callgrind (`bash scripts/instruction-budgets`), against the budgets in
//! `benches/instructions.budgets`. A count does not depend on the machine's load, so a change
//! that makes a hot path cost more fails CI however busy its machine is, which a timed
//! benchmark cannot promise.
//!
//! ```sh
//! bash scripts/instruction-budgets            # count every row, compare with the budgets
//! bash scripts/instruction-budgets update     # write the counts as the new budgets
//! cargo bench --bench instructions            # the rows, and one untimed run of each
//! ```
//!
//! Each row is one operation: an in-process check (`MemoryStore::check_now`, GCRA, the monotonic
//! system clock) on one hot key admitted, on one hot key refused, round-robin over 100,000 keys,
//! and a stacked check of three policies (in a store of one shard); a request through
//! `RateLimitLayer` (an in-process store, a key from a header, a limit nobody reaches, the
//! RateLimit fields on the response) and through each overload layer (`ConcurrencyLimitLayer` with
//! a total cap and with a cap per key, `LoadShedLayer` with a fixed limit and fair by tenant,
//! `ShapeLayer` at a rate nobody reaches), each around a service that answers at once; and that
//! service alone (`bare`), the part of every request row that is not a layer's. A request row makes
//! the request, calls a fresh clone of the service (as hyper does per request), and drops the
//! response (and so its body, which holds an in-flight layer's place).
//!
//! `INSTRUCTIONS_ROW=<name> INSTRUCTIONS_N=<n>` runs one row: a warm-up (the clock's
//! calibration, first allocations, every key inserted), then `n` operations inside the one
//! function that callgrind counts (`--toggle-collect=*measured*`). Nothing else runs: no
//! thread is started and no future waits (a future that is not ready at once is a failure).
#![allow(missing_docs)]
#![allow(clippy::expect_used)] // a benchmark set-up that fails should stop loudly

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tollgate::key::Header;
use tollgate::limiter::Rule;
use tollgate::shed::Limit;
use tollgate::{
    Check, ConcurrencyLimitLayer, LoadShedLayer, MemoryStore, Policy, Rate, RateLimitLayer,
    ShapeLayer,
};
use tower::{Layer, Service, ServiceExt};

/// One row: `run(n)` does `n` operations.
trait Row {
    /// Everything before the count: the store's keys, the layers' tables, first allocations.
    fn warm(&self);
    fn run(&self, n: u64);
}

/// Polls a future that must be ready at once (everything in process here is).
fn now<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("a future of an instruction row waited"),
    }
}

/// Checks on a `MemoryStore`, round-robin over `keys`, each of `checks` (one check, or a stack).
struct Checks {
    store: MemoryStore,
    keys: Vec<String>,
    policies: Vec<Policy>,
    admitted: bool,
}

impl Checks {
    /// A store of `shards` shards (1 for a stack: its three pairs in one shard whatever the
    /// per-process hash seed, so that it locks one shard on every run).
    fn new(keys: usize, policies: Vec<Policy>, admitted: bool, shards: usize) -> Self {
        let keys = if keys == 1 {
            vec!["user:hot".to_owned()]
        } else {
            (0..keys).map(|i| format!("user:{i}")).collect()
        };
        Checks {
            store: MemoryStore::builder().shards(shards).build(),
            keys,
            policies,
            admitted,
        }
    }

    fn check(&self, key: &str) -> bool {
        let allowed = match &self.policies[..] {
            [one] => self.store.check_now(key, one, 1),
            [a, b, c] => {
                let stack = [a, b, c].map(|p| Check::new(key, p, 1));
                self.store.check_all_now(&stack)
            }
            _ => panic!("one policy or three"),
        };
        allowed.expect("a valid check").allowed()
    }
}

impl Row for Checks {
    fn warm(&self) {
        // Every key tracked; on one key, enough to reach the row's steady state (refused).
        for key in &self.keys {
            self.check(key);
        }
        for _ in 0..100 {
            self.check(&self.keys[0]);
        }
        assert_eq!(self.check(&self.keys[0]), self.admitted);
    }

    fn run(&self, n: u64) {
        let mut i = 0;
        for _ in 0..n {
            black_box(self.check(black_box(&self.keys[i])));
            i += 1;
            if i == self.keys.len() {
                i = 0;
            }
        }
    }
}

type Bare = tower::util::ServiceFn<
    fn(Request<()>) -> std::future::Ready<Result<Response<String>, Infallible>>,
>;

/// The service every layer wraps: answers at once, allocates nothing.
fn bare() -> Bare {
    fn answer(_: Request<()>) -> std::future::Ready<Result<Response<String>, Infallible>> {
        std::future::ready(Ok(Response::new(String::new())))
    }
    tower::service_fn(answer as fn(_) -> _)
}

/// Requests through a service, each a fresh clone of it; the response dropped at once.
struct Requests<S>(S);

fn request() -> Request<()> {
    let mut request = Request::get("/").body(()).expect("a request");
    request
        .headers_mut()
        .insert("x-user", http::HeaderValue::from_static("user-42"));
    request
}

impl<S, B, E> Row for Requests<S>
where
    S: Service<Request<()>, Response = Response<B>, Error = E> + Clone,
    E: std::fmt::Debug,
{
    fn warm(&self) {
        self.run(100);
    }

    fn run(&self, n: u64) {
        for _ in 0..n {
            let response = now(self.0.clone().oneshot(request()));
            let status = response.map_or(StatusCode::IM_A_TEAPOT, |r| r.status());
            assert_eq!(black_box(status), StatusCode::OK);
        }
    }
}

fn through<L, B>(layer: L) -> Box<dyn Row>
where
    L: Layer<Bare>,
    L::Service: Service<Request<()>, Response = Response<B>> + Clone + 'static,
    <L::Service as Service<Request<()>>>::Error: std::fmt::Debug,
{
    Box::new(Requests(layer.layer(bare())))
}

/// A layer that must build (a benchmark has no use for a bad configuration).
fn built<T, E: std::fmt::Display>(result: Result<T, E>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

/// Makes a row.
type Make = fn() -> Box<dyn Row>;

/// The rows, by name: `scripts/instruction-budgets` runs each of these.
fn rows() -> Vec<(&'static str, Make)> {
    fn nobody_reaches() -> Policy {
        // A bucket interval of 1 ns: every check finds room.
        built(Policy::gcra(
            Rate::new(1_000_000, Duration::from_millis(1)),
            1_000_000,
        ))
    }
    fn per_user() -> Rule {
        Rule::new("per-user").key(Header::from_static("x-user"))
    }
    vec![
        ("memory/hot/admitted", || {
            Box::new(Checks::new(1, vec![nobody_reaches()], true, 64))
        }),
        ("memory/hot/refused", || {
            let ten = built(Policy::gcra(Rate::per_second(10), 10));
            Box::new(Checks::new(1, vec![ten], false, 64))
        }),
        ("memory/100k-keys", || {
            Box::new(Checks::new(100_000, vec![nobody_reaches()], true, 64))
        }),
        ("memory/hot/stacked-3", || {
            let stack = (0..3)
                .map(|i| built(nobody_reaches().named(format!("p{i}"))))
                .collect();
            Box::new(Checks::new(1, stack, true, 1))
        }),
        ("bare", || Box::new(Requests(bare()))),
        ("rate-limit", || {
            let rule = per_user().policy(nobody_reaches());
            through(built(
                RateLimitLayer::builder(MemoryStore::new())
                    .rule(rule)
                    .build(),
            ))
        }),
        ("concurrency/total", || {
            through(built(
                ConcurrencyLimitLayer::builder().total(1_000_000).build(),
            ))
        }),
        ("concurrency/key", || {
            through(built(
                ConcurrencyLimitLayer::builder()
                    .rule(per_user(), 1_000_000)
                    .build(),
            ))
        }),
        ("shed/fixed", || {
            through(built(
                LoadShedLayer::builder(Limit::fixed(1_000_000)).build(),
            ))
        }),
        ("shed/fair", || {
            through(built(
                LoadShedLayer::builder(Limit::fixed(1_000_000))
                    .fair_by(Header::from_static("x-user"))
                    .build(),
            ))
        }),
        ("shape", || {
            let rate = Rate::per_second(1_000_000_000);
            through(built(
                ShapeLayer::builder(MemoryStore::new())
                    .rule(per_user(), rate, 1_000_000_000)
                    .build(),
            ))
        }),
    ]
}

/// `n` operations of `row`: all that callgrind counts (`--toggle-collect=*measured*`).
#[inline(never)]
fn measured(row: &dyn Row, n: u64) {
    row.run(n);
}

fn main() {
    let only = std::env::var("INSTRUCTIONS_ROW").ok();
    let n = std::env::var("INSTRUCTIONS_N")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000);
    // `cargo bench` passes `--bench`, `cargo test --benches` passes nothing: either way, one
    // short run of every row (or of the one asked for), to show that each still works.
    for (name, make) in rows() {
        if only.as_deref().is_some_and(|only| only != name) {
            continue;
        }
        let row = make();
        row.warm();
        measured(&*row, n);
        println!("{name}: {n} operations");
    }
}
