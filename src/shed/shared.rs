//! The state every clone of the shedder shares: admission, places in flight and their guards.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Response, StatusCode};

use super::classify::{Classifier, Criticality};
use super::deadline::{Route, Typical};
use super::fair::{Table, Tenant, Tenants};
use super::limit::{Controller, Sample};
use super::queue::Queue;
use super::telemetry::{Reason, Shed, Telemetry};
use crate::answer::{Rejection, RejectionKind, Responder};
use crate::clock::Clock;
use crate::inflight::{Admitted, Answer, Held};
use crate::key::{Key, KeyExtractor};
use crate::sync::{AtomicU32, AtomicU64, Mutex};

/// What every clone of the layer shares.
pub(crate) struct Shared {
    /// The layer's name in metrics and logs.
    pub(super) name: Arc<str>,
    pub(super) telemetry: Telemetry,
    /// The controller's limit, read on every request without its lock.
    pub(super) limit: AtomicU32,
    pub(super) controller: Mutex<Controller>,
    /// Whether requests are timed: for an adaptive limit, or for the clients' deadlines (the
    /// time the service typically takes). A fixed limit without deadlines reads no clock and
    /// takes no lock per request.
    pub(super) learns: bool,
    pub(super) in_flight: AtomicU32,
    /// Each class's share of capacity, in thousandths.
    pub(super) shares: [u16; 4],
    /// The class with the largest share.
    pub(super) widest: Criticality,
    pub(super) classifier: Box<dyn Classifier>,
    pub(super) utilization: Option<Box<dyn Fn() -> f64 + Send + Sync>>,
    pub(super) fair: Option<Fair>,
    /// The least `Retry-After` and its spread, in whole seconds.
    pub(super) retry_after: u64,
    pub(super) jitter: u64,
    pub(super) draws: AtomicU64,
    pub(super) hasher: foldhash::fast::RandomState,
    pub(super) admitted: [AtomicU64; 4],
    pub(super) shed: [AtomicU64; 4],
    pub(super) responder: Box<dyn Responder>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) queue: Option<Queue>,
    /// The time the service takes to answer, per route: what a client's deadline must leave
    /// for it.
    pub(super) typical: Typical,
}

pub(super) struct Fair {
    pub(super) key: Box<dyn KeyExtractor>,
    pub(super) tenants: Tenants,
    /// The share of capacity past which fairness applies, in thousandths.
    pub(super) from: u64,
    /// The most of the limit one tenant may hold, in thousandths (1000: no cap).
    pub(super) cap: u64,
}

impl Fair {
    /// A tenant's fair share of `limit` among `recent` tenants: the limit divided among them,
    /// rounded up (so that the shares cover the limit), within the cap.
    pub(super) fn share(&self, limit: u64, recent: u32) -> u32 {
        let share = limit.div_ceil(u64::from(recent.max(1))).max(1);
        u32::try_from(share.min(self.cap_places(limit))).unwrap_or(u32::MAX)
    }

    /// The most places one tenant may hold under `limit`.
    pub(super) fn cap_places(&self, limit: u64) -> u64 {
        (limit * self.cap / 1000).max(1)
    }

    /// Whether `tenant` may take one more place of a class whose room is `room` places, when
    /// `before` are in flight under `limit`: always below its fair share (and the cap); at or
    /// above it, never past `fair_from`, and below it only while that leaves free, within the
    /// class's room, the fair share of each recent tenant that holds none (at most half the
    /// limit).
    pub(super) fn allows(
        &self,
        (before, room): (u32, u32),
        limit: u64,
        tenant: &Tenant,
        table: &Table,
    ) -> bool {
        let held = u64::from(tenant.held);
        if held >= self.cap_places(limit) {
            return false;
        }
        if tenant.held < self.share(limit, table.recent()) {
            return true;
        }
        if u64::from(before) * 1000 >= limit * self.from {
            return false;
        }
        let free_after = u64::from(room).saturating_sub(u64::from(before) + 1);
        let reserve = u64::from(table.empty()) * u64::from(self.share(limit, table.recent()));
        free_after >= reserve.min(limit / 2)
    }
}

/// A place in flight, and its tenant's place with fairness; dropping it gives both back, the
/// place to a waiter first.
pub(crate) struct Place {
    shared: Arc<Shared>,
    tenant: Option<u64>,
    /// False once given back by hand.
    armed: bool,
}

impl Place {
    pub(super) fn new(shared: &Arc<Shared>, tenant: Option<u64>) -> Self {
        shared.telemetry.in_flight.increment();
        Place {
            shared: Arc::clone(shared),
            tenant,
            armed: true,
        }
    }

    /// Gives the place back under the queue's lock: its count and its tenant's, and nothing
    /// to the waiters (the caller is serving them).
    pub(super) fn give_back_locked(mut self) {
        self.armed = false;
        self.shared.release_tenant(self.tenant);
        self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.shared.telemetry.in_flight.decrement();
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.armed {
            self.shared.release_tenant(self.tenant);
            self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            self.shared.telemetry.in_flight.decrement();
            self.shared.serve_waiters();
        }
    }
}

/// The place of a request admitted by the shedder; dropping it gives the place back.
pub(crate) struct Guard {
    place: Place,
    started: u64,
    /// Requests in flight when it was admitted, itself included.
    in_flight: u32,
    /// Its route, whose typical answer time its own teaches.
    route: Route,
    answered: bool,
}

impl Guard {
    /// Whether the service's answers teach the shedder anything (see [`Shared::learns`]).
    pub(crate) fn learns(&self) -> bool {
        self.place.shared.learns
    }

    /// The inner service answered: the adaptive limit learns how long it took, unless a
    /// tollgate layer inside refused the request.
    pub(crate) fn answered(&mut self, answer: Answer) {
        if std::mem::replace(&mut self.answered, true) || !self.place.shared.learns {
            return;
        }
        if let Answer::Served { failed } = answer {
            let nanos = self.sample(failed, false);
            let shared = &self.place.shared;
            if shared.queue.as_ref().is_some_and(Queue::has_deadlines) {
                shared.typical.record(self.route, nanos);
            }
        }
    }

    /// Teaches the controller the request's time in flight so far (returned, in nanoseconds);
    /// if the limit grows, the waiters get the new room there and then.
    fn sample(&self, failed: bool, abandoned: bool) -> u64 {
        let shared = &self.place.shared;
        let now = shared.clock.now();
        let nanos = now.saturating_sub(self.started).max(1);
        let mut controller = shared.controller.lock();
        let before = controller.limit();
        controller.sample(Sample {
            at: now,
            nanos,
            in_flight: self.in_flight,
            failed,
            abandoned,
        });
        let after = controller.limit();
        shared.limit.store(after, Ordering::Relaxed);
        drop(controller);
        if after != before {
            shared.telemetry.limit.set(f64::from(after));
            crate::telemetry::event!(
                debug,
                name: "tollgate.shed.limit",
                layer = &*shared.name,
                from = before,
                to = after,
                "the shedder's limit moved"
            );
        }
        if after > before {
            shared.serve_waiters();
        }
        nanos
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        // Dropped before the service answered (the client went away, a timeout fired): its
        // time so far is a sample too, or a service that hangs would teach nothing. The place
        // is given back after this, as the field is dropped.
        if !self.answered && self.place.shared.learns {
            self.sample(false, true);
        }
    }
}

/// Why [`Shared::take`] took no place.
pub(super) enum NoPlace {
    /// The class has no room.
    Full,
    /// The tenant has its fair share in flight.
    Unfair,
    /// The count in flight is no longer the one expected (a place came back meanwhile).
    Moved,
}

impl Shared {
    /// Admits a request (at once, or after a wait in the queue), or sheds it (the class it was
    /// shed as).
    pub(crate) fn admit(self: &Arc<Self>, parts: &Parts) -> Result<Admitted, Shed> {
        let class = self.classifier.classify(parts);
        let share = u64::from(self.shares[class.index()]);
        if let Some(signal) = &self.utilization {
            let busy = signal();
            if busy * 1000.0 >= share as f64 {
                return Err(Shed {
                    class,
                    reason: Reason::Utilization,
                });
            }
        }
        let tenant = self.tenant(parts);
        let queue = self.queue.as_ref();
        if let Some(queue) = queue.filter(|q| q.len() > 0) {
            // Requests wait: the queue decides, so that this one cannot overtake them.
            return self.enqueue(queue, parts, class, tenant);
        }
        match self.take(class, tenant, None) {
            Ok(in_flight) => {
                let place = Place::new(self, tenant);
                let guard = self.guard(class, place, in_flight, self.route(parts));
                Ok(Admitted::Now(Held::Shed(guard)))
            }
            Err(NoPlace::Full | NoPlace::Moved) => match queue {
                Some(queue) => self.enqueue(queue, parts, class, tenant),
                None => Err(Shed {
                    class,
                    reason: Reason::Capacity,
                }),
            },
            Err(NoPlace::Unfair) => {
                // Its place went back: a request that joined the queue meanwhile may use it.
                self.serve_waiters();
                Err(Shed {
                    class,
                    reason: Reason::Unfair,
                })
            }
        }
    }

    /// The tenant of a request, with fairness: the hash its places are counted under. It is
    /// counted among the recent tenants from now on.
    fn tenant(&self, parts: &Parts) -> Option<u64> {
        let fair = self.fair.as_ref()?;
        let mut key = Key::new();
        if !fair.key.extract_into(parts, &mut key) {
            return None;
        }
        key.push_raw("@tenant");
        let key = crate::concurrency::bounded(key);
        let hash = self.hasher.hash_one(key.as_str());
        Some(fair.tenants.see(hash, self.clock.now()))
    }

    /// Takes a place in flight for a request of `class` if its class has room, and its
    /// tenant's if the tenant is within its fair share (or neither): the requests in flight
    /// with it. With `at`, only if the count in flight is still `at`. Nothing is handed to
    /// waiters here.
    pub(super) fn take(
        &self,
        class: Criticality,
        tenant: Option<u64>,
        at: Option<u32>,
    ) -> Result<u32, NoPlace> {
        let limit = u64::from(self.limit.load(Ordering::Relaxed));
        let threshold = self.threshold(class, limit);
        let before = match at {
            None => self
                .in_flight
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < threshold).then_some(n + 1)
                })
                .map_err(|_| NoPlace::Full)?,
            Some(at) if at >= threshold => return Err(NoPlace::Full),
            Some(at) => self
                .in_flight
                .compare_exchange(at, at + 1, Ordering::SeqCst, Ordering::SeqCst)
                .map_err(|_| NoPlace::Moved)?,
        };
        if let (Some(fair), Some(hash)) = (&self.fair, tenant) {
            let now = self.clock.now();
            if !fair.tenants.acquire(hash, now, |t, table| {
                fair.allows((before, threshold), limit, t, table)
            }) {
                self.in_flight.fetch_sub(1, Ordering::SeqCst);
                return Err(NoPlace::Unfair);
            }
        }
        Ok(before + 1)
    }

    /// The requests in flight from which `class` is shed, under `limit`.
    pub(super) fn threshold(&self, class: Criticality, limit: u64) -> u32 {
        let share = u64::from(self.shares[class.index()]);
        u32::try_from((limit * share / 1000).max(1)).unwrap_or(u32::MAX)
    }

    fn release_tenant(&self, tenant: Option<u64>) {
        if let (Some(hash), Some(fair)) = (tenant, &self.fair) {
            fair.tenants.release(hash, self.clock.now());
        }
    }

    /// The guard of a request of `class` to `route` admitted with `place`, `in_flight` with it.
    pub(super) fn guard(
        &self,
        class: Criticality,
        place: Place,
        in_flight: u32,
        route: Route,
    ) -> Guard {
        self.admitted[class.index()].fetch_add(1, Ordering::Relaxed);
        Guard {
            place,
            started: if self.learns { self.clock.now() } else { 0 },
            in_flight,
            route,
            answered: false,
        }
    }

    /// The route whose answer times a request's deadline must leave for: only needed (and
    /// only looked up) when clients declare deadlines.
    pub(super) fn route(&self, parts: &Parts) -> Route {
        match &self.queue {
            Some(queue) if queue.has_deadlines() => self.typical.route(&self.hasher, parts),
            _ => Route::SHARED,
        }
    }

    /// The answer to a request shed.
    pub(crate) fn refuse(&self, parts: &Parts, shed: Shed) -> Response<Bytes> {
        let Shed { class, reason } = shed;
        self.shed[class.index()].fetch_add(1, Ordering::Relaxed);
        self.telemetry.shed[class.index()][reason as usize].increment(1);
        crate::telemetry::event!(
            debug,
            name: "tollgate.shed",
            layer = &*self.name,
            class = class.as_str(),
            reason = reason.as_str(),
            "the shedder shed a request"
        );
        // A draw spread evenly over 0..=jitter.
        let draw = self
            .hasher
            .hash_one(self.draws.fetch_add(1, Ordering::Relaxed));
        let secs = self.retry_after + draw % self.jitter.saturating_add(1);
        crate::answer::refuse(
            &*self.responder,
            &Rejection {
                kind: RejectionKind::Overloaded,
                parts,
                status: StatusCode::SERVICE_UNAVAILABLE,
                decision: None,
                rule: None,
                policy: None,
                window: None,
                retry_after: Some(Duration::from_secs(secs)),
                error: None,
            },
        )
    }
}

/// Model checks (`bash scripts/model-check`, under `--cfg tollgate_shuttle`): shuttle runs the
/// threads below in many interleavings of the shedder's locks and atomics (its PCT scheduler). A
/// request left waiting in the queue while a place is free (a place handed to nobody) fails
/// them, as does any place not given back in the end.
#[cfg(all(test, tollgate_shuttle))]
mod model_checks {
    use std::time::Duration;

    use super::*;
    use crate::clock::ManualClock;
    use crate::inflight::Pending;
    use crate::shed::{Limit, LoadShedLayer};

    fn layer(limit: Limit) -> Arc<Shared> {
        let clock = ManualClock::new();
        clock.advance(Duration::from_secs(1));
        // Every request is `critical`; at a share of 1 its class may use the whole limit.
        let layer = LoadShedLayer::builder(limit)
            .share(Criticality::Critical, 1.0)
            .queue(4, Duration::from_secs(60))
            .clock(clock)
            .build()
            .unwrap();
        layer.shared
    }

    /// Admits a request: served at once (and answered, and gone), or its wait in the queue.
    /// With room in the queue for every arrival, none is shed.
    fn arrive(shared: &Arc<Shared>) -> Option<Pending> {
        let parts = http::Request::new(()).into_parts().0;
        match shared.admit(&parts) {
            Ok(Admitted::Now(mut held)) => {
                held.answered(Answer::Served { failed: false });
                None
            }
            Ok(Admitted::Later(wait)) => Some(wait),
            Err(shed) => panic!("shed ({}) with room in the queue", shed.reason.as_str()),
        }
    }

    /// Nobody waits while a place is free: the places in flight are those of the waiters
    /// served (their places wait in their channels), and the rest wait only if it is full.
    fn settled(shared: &Shared, waits: &[Pending]) {
        let queue = shared.queue.as_ref().unwrap();
        let in_flight = shared.in_flight.load(Ordering::SeqCst);
        let limit = u64::from(shared.limit.load(Ordering::SeqCst));
        let limit = shared.threshold(Criticality::Critical, limit);
        assert_eq!(
            in_flight as usize,
            waits.len() - queue.len(),
            "each place in flight is a waiter's"
        );
        assert!(
            queue.len() == 0 || in_flight >= limit,
            "{} wait while {in_flight} of {limit} are in flight",
            queue.len()
        );
    }

    fn run(shared: Arc<Shared>, held: Option<Guard>, arrivals: usize) {
        let threads: Vec<_> = (0..arrivals)
            .map(|_| {
                let shared = Arc::clone(&shared);
                shuttle::thread::spawn(move || arrive(&shared))
            })
            .collect();
        // A request in flight from the start ends while the others arrive.
        drop(held);
        let waits: Vec<Pending> = threads
            .into_iter()
            .filter_map(|t| t.join().unwrap())
            .collect();
        settled(&shared, &waits);
        // The waiters leave (their clients went away) at once, each on its own thread: a place
        // handed to one that is leaving goes on to the next, and in the end every place is back.
        let leaving: Vec<_> = waits
            .into_iter()
            .map(|wait| shuttle::thread::spawn(move || drop(wait)))
            .collect();
        for thread in leaving {
            thread.join().unwrap();
        }
        let queue = shared.queue.as_ref().unwrap();
        assert_eq!(
            (shared.in_flight.load(Ordering::SeqCst), queue.len()),
            (0, 0)
        );
    }

    fn held(shared: &Arc<Shared>) -> Guard {
        let parts = http::Request::new(()).into_parts().0;
        match shared.admit(&parts) {
            Ok(Admitted::Now(Held::Shed(guard))) => guard,
            _ => panic!("the first request is admitted"),
        }
    }

    #[test]
    fn places_given_back_go_to_the_waiters() {
        shuttle::check_pct(
            || {
                let shared = layer(Limit::fixed(1));
                let first = held(&shared);
                run(shared, Some(first), 3);
            },
            crate::sync::pct_runs(),
            3,
        );
    }

    /// With fairness, tenants arriving and leaving on their own threads while a place comes
    /// back: every place and every waiter is counted to its tenant and given back, so the
    /// tenant table ends holding nothing (and its count of tenants holding none is right).
    #[test]
    fn tenants_get_every_place_back() {
        shuttle::check_pct(
            || {
                let clock = ManualClock::new();
                clock.advance(Duration::from_secs(1));
                let layer = LoadShedLayer::builder(Limit::fixed(1))
                    .share(Criticality::Critical, 1.0)
                    .fair_by(crate::key::Header::from_static("x-tenant"))
                    .queue(4, Duration::from_secs(60))
                    .clock(clock)
                    .build()
                    .unwrap();
                let shared = layer.shared;
                let request = |tenant: &str| {
                    http::Request::get("/")
                        .header("x-tenant", tenant)
                        .body(())
                        .unwrap()
                        .into_parts()
                        .0
                };
                let first = match shared.admit(&request("a")) {
                    Ok(Admitted::Now(Held::Shed(guard))) => guard,
                    _ => panic!("the first request is admitted"),
                };
                let threads: Vec<_> = ["a", "b", "c"]
                    .into_iter()
                    .map(|tenant| {
                        let shared = Arc::clone(&shared);
                        let parts = request(tenant);
                        shuttle::thread::spawn(move || match shared.admit(&parts) {
                            Ok(Admitted::Now(mut held)) => {
                                held.answered(Answer::Served { failed: false });
                                None
                            }
                            Ok(Admitted::Later(wait)) => Some(wait),
                            // Its tenant over its share: shed, holding nothing.
                            Err(_) => None,
                        })
                    })
                    .collect();
                drop(first);
                let waits: Vec<Pending> = threads
                    .into_iter()
                    .filter_map(|t| t.join().unwrap())
                    .collect();
                let leaving: Vec<_> = waits
                    .into_iter()
                    .map(|wait| shuttle::thread::spawn(move || drop(wait)))
                    .collect();
                for thread in leaving {
                    thread.join().unwrap();
                }
                let queue = shared.queue.as_ref().unwrap();
                assert_eq!(
                    (shared.in_flight.load(Ordering::SeqCst), queue.len()),
                    (0, 0)
                );
                let fair = shared.fair.as_ref().unwrap();
                let (held, waiting, empty, counted) = fair.tenants.with(|t| t.totals());
                assert_eq!((held, waiting), (0, 0));
                assert_eq!(empty, counted);
            },
            crate::sync::pct_runs(),
            3,
        );
    }

    #[test]
    fn a_limit_that_grows_serves_the_waiters() {
        shuttle::check_pct(
            || {
                // AIMD at 1 in flight, its window one sample short of an increase: the request
                // in flight answers fast (the limit grows to 2) but keeps its place, so only
                // the new room can serve a waiter.
                let shared = layer(Limit::aimd(1, Duration::from_micros(1)).bounds(1, 4));
                {
                    let mut controller = shared.controller.lock();
                    for at in 0..9 {
                        controller.sample(Sample {
                            at: 1_000 + at,
                            nanos: 1,
                            in_flight: 1,
                            failed: false,
                            abandoned: false,
                        });
                    }
                }
                let mut first = held(&shared);
                let answering = shuttle::thread::spawn(move || {
                    first.answered(Answer::Served { failed: false });
                    first
                });
                let threads: Vec<_> = (0..2)
                    .map(|_| {
                        let shared = Arc::clone(&shared);
                        shuttle::thread::spawn(move || arrive(&shared))
                    })
                    .collect();
                let first = answering.join().unwrap();
                let waits: Vec<Pending> = threads
                    .into_iter()
                    .filter_map(|t| t.join().unwrap())
                    .collect();
                assert_eq!(shared.limit.load(Ordering::SeqCst), 2, "the window grew it");
                assert_eq!(shared.controller.lock().limit(), 2);
                // The first still holds one of the two places.
                let queue = shared.queue.as_ref().unwrap();
                let in_flight = shared.in_flight.load(Ordering::SeqCst);
                assert_eq!(in_flight as usize, 1 + waits.len() - queue.len());
                assert!(queue.len() == 0 || in_flight >= 2, "a waiter left behind");
                drop(first);
                drop(waits);
                assert_eq!(
                    (shared.in_flight.load(Ordering::SeqCst), queue.len()),
                    (0, 0)
                );
            },
            crate::sync::pct_runs(),
            3,
        );
    }
}
