//! The fair queue: requests waiting for a place, kept per flow and served in fair-queuing
//! order.
//!
//! - A **flow** is the key of the first rule that applies to a request (requests no rule
//!   applies to make one flow). A flow exists only while one of its requests waits, so the
//!   queue's memory follows its length (at most `max_waiting` waiters, hence flows), not the
//!   number of keys.
//! - **Order**: when places come back, the flows are tried in the order of the fewest places
//!   their key holds, then the flow served least recently (a flow new to the queue counts as
//!   never served), then the flow's age in the queue; in the first that has a waiter whose
//!   places are all free, its oldest such waiter is served, and again while someone can be.
//!   (With several rules, an older waiter of a flow may lack another rule's place that a
//!   younger one has.)
//! - **Hand-over**: a place given back while anyone waits is handed to the waiter it fits (the
//!   releaser serves the queue, [`Shared::serve`]), and a newcomer that finds anyone waiting
//!   queues behind them rather than taking a place first, so no newcomer overtakes a waiter
//!   that a place would fit. A newcomer is admitted at once only for a place that no waiter
//!   can use.
//! - **Shares**: a flow holds at most `max_waiting / flows waiting` places of the queue (at
//!   least one); a full queue makes room for a flow under its share by pushing out the
//!   newest waiter of the longest flow, which is refused as if the queue had been full.
//! - **Leaving**: a waiter whose future is dropped leaves and takes nothing; a permit handed
//!   to it just before is dropped, which gives its places back and serves the queue again.
//!
//! The wait is timed on the layer's [`Clock`](crate::clock::Clock): a waiter sleeps on
//! tokio's timer until its deadline as the clock reads it, and reads the clock again when it
//! wakes.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use smallvec::SmallVec;
use tokio::sync::oneshot;

use super::admission::{Permit, Places, Refusal};
use super::shared::{Queue, Shared};
use crate::key::Key;

/// The waiters, by flow.
#[derive(Default)]
pub(super) struct Fair {
    /// The flows with at least one waiter.
    flows: Vec<Flow>,
    /// Waiters over all flows.
    queued: usize,
    next_id: u64,
    /// Counts the waiters served: the time line of "least recently served".
    served: u64,
}

/// What names a flow: the first rule that applies and its key (`None`: no rule applies).
type FlowId = Option<(u16, u64, Key)>;

struct Flow {
    id: FlowId,
    waiters: VecDeque<Waiter>,
    /// When the flow was last served (0: not since it entered the queue).
    last_served: u64,
    /// When the flow entered the queue (ties broken by age).
    since: u64,
}

struct Waiter {
    id: u64,
    places: Places,
    /// Its permit once served, with its places (their keys, for leases).
    permit: oneshot::Sender<(Permit, Places)>,
}

/// How a request that found no place fares at the queue.
pub(super) enum Entered {
    /// A place no waiter could use was free: the request has it (and its places back).
    Now(Permit, Places),
    /// It waits.
    Waiting(Ticket),
    /// No room for it (the queue, its flow's share, or its key's waiters are full).
    Refused,
}

/// A request waiting in the queue; dropping it leaves the queue.
pub(super) struct Ticket {
    shared: Arc<Shared>,
    id: u64,
    flow: FlowId,
    /// The keys whose waiting counts it holds ([`InFlight::enter_queue`](super::table::InFlight::enter_queue)).
    keys: SmallVec<[(u64, Key); 2]>,
    permit: oneshot::Receiver<(Permit, Places)>,
    /// Its deadline on the layer's clock (`None`: it waits as long as it takes).
    deadline: Option<u64>,
}

impl Flow {
    /// The places its key holds (a flow of no key holds none).
    fn held(&self, shared: &Shared) -> u32 {
        match &self.id {
            Some((_, hash, key)) => shared.in_flight.count_of(*hash, key),
            None => 0,
        }
    }
}

impl Fair {
    fn position(&self, flow: &FlowId) -> Option<usize> {
        self.flows.iter().position(|f| f.id == *flow)
    }

    /// Removes waiter `id` of `flow`, if it is still there; whether it was.
    fn remove(&mut self, queue: &Queue, flow: &FlowId, id: u64) -> bool {
        let Some(i) = self.position(flow) else {
            return false;
        };
        let Some(at) = self.flows[i].waiters.iter().position(|w| w.id == id) else {
            return false;
        };
        self.flows[i].waiters.remove(at);
        self.left(queue, i);
        true
    }

    /// A waiter of flow `i` left the queue (served, gone or pushed out).
    fn left(&mut self, queue: &Queue, i: usize) {
        self.queued -= 1;
        queue.waiting.fetch_sub(1, Ordering::SeqCst);
        if self.flows[i].waiters.is_empty() {
            self.flows.swap_remove(i);
        }
    }
}

impl Shared {
    /// A request that found no place (or found others waiting) comes to the queue: it gets a
    /// place no waiter can use, or waits for one, or is refused; `refusal` keeps the last
    /// reason it met.
    pub(super) fn enter(
        self: &Arc<Self>,
        queue: &Queue,
        places: Places,
        refusal: &mut Refusal,
    ) -> Entered {
        let mut gone = SmallVec::<[(Permit, Places); 1]>::new();
        let entered = {
            let mut fair = queue.fair.lock();
            // Counted before it tries: a place given back after its try sees it waiting and
            // serves the queue (which waits for this lock).
            queue.waiting.fetch_add(1, Ordering::SeqCst);
            // Those already waiting first: what is free now goes to them in their order.
            self.serve_locked(queue, &mut fair, &mut gone);
            match self.take(&places) {
                Ok(permit) => {
                    queue.waiting.fetch_sub(1, Ordering::SeqCst);
                    Entered::Now(permit, places)
                }
                Err(again) => {
                    *refusal = again;
                    self.join(queue, &mut fair, places)
                }
            }
        };
        // Permits handed to waiters that had left: their places go on to the next.
        drop(gone);
        entered
    }

    /// Puts a request in its flow, if there is room; the caller counted it in
    /// `queue.waiting`, which is given back if not.
    fn join(self: &Arc<Self>, queue: &Queue, fair: &mut Fair, places: Places) -> Entered {
        let refused = |keys: &[(u64, Key)]| {
            for (hash, key) in keys {
                self.in_flight.leave_queue(*hash, key);
            }
            queue.waiting.fetch_sub(1, Ordering::SeqCst);
            Entered::Refused
        };
        // At most as many wait for a key as it has places, whatever refused the request.
        let mut keys = SmallVec::<[(u64, Key); 2]>::new();
        for place in &places {
            if !self
                .in_flight
                .enter_queue(place.hash, &place.key, place.max)
            {
                return refused(&keys);
            }
            keys.push((place.hash, place.key.clone()));
        }
        let flow: FlowId = places.first().map(|p| (p.rule, p.hash, p.key.clone()));
        let index = fair.position(&flow);
        let flows = fair.flows.len() + usize::from(index.is_none());
        let share = (queue.max / flows).max(1);
        let mine = index.map_or(0, |i| fair.flows[i].waiters.len());
        if mine >= share {
            return refused(&keys);
        }
        if fair.queued >= queue.max {
            // Full: room for a flow under its share is made at the expense of the longest
            // flow, if it is over its share (its newest waiter is refused).
            let longest = fair
                .flows
                .iter()
                .enumerate()
                .max_by_key(|(_, f)| f.waiters.len())
                .map(|(i, f)| (i, f.waiters.len()));
            match longest {
                Some((i, len)) if len > share => {
                    // Dropping its sender tells the waiter it was pushed out.
                    fair.flows[i].waiters.pop_back();
                    fair.left(queue, i);
                }
                _ => return refused(&keys),
            }
        }
        fair.next_id += 1;
        let id = fair.next_id;
        let (sender, receiver) = oneshot::channel();
        let waiter = Waiter {
            id,
            places,
            permit: sender,
        };
        match fair.position(&flow) {
            Some(i) => fair.flows[i].waiters.push_back(waiter),
            None => {
                let since = fair.next_id;
                fair.flows.push(Flow {
                    id: flow.clone(),
                    waiters: VecDeque::from([waiter]),
                    last_served: 0,
                    since,
                });
            }
        }
        fair.queued += 1;
        let deadline = u64::try_from(queue.max_wait.as_nanos())
            .ok()
            .and_then(|wait| self.clock.now().checked_add(wait));
        Entered::Waiting(Ticket {
            shared: Arc::clone(self),
            id,
            flow,
            keys,
            permit: receiver,
            deadline,
        })
    }

    /// Places came back: hands them to the waiters they fit, in fair-queuing order.
    pub(super) fn serve(self: &Arc<Self>, queue: &Queue) {
        let mut gone = SmallVec::<[(Permit, Places); 1]>::new();
        {
            let mut fair = queue.fair.lock();
            self.serve_locked(queue, &mut fair, &mut gone);
        }
        drop(gone);
    }

    /// Serves waiters while one can take its places. Permits for waiters that left meanwhile
    /// end up in `gone`, to drop once the lock is given back (their places then go on).
    fn serve_locked(
        self: &Arc<Self>,
        queue: &Queue,
        fair: &mut Fair,
        gone: &mut SmallVec<[(Permit, Places); 1]>,
    ) {
        loop {
            // The flows in fair-queuing order: fewest places held, least recently served, oldest.
            let mut order: SmallVec<[(u32, u64, u64, usize); 16]> = fair
                .flows
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    let held = if fair.flows.len() > 1 {
                        f.held(self)
                    } else {
                        0
                    };
                    (held, f.last_served, f.since, i)
                })
                .collect();
            order.sort_unstable();
            let mut served = None;
            'flows: for &(.., i) in &order {
                // Its oldest waiter that fits: with several rules, an older waiter may lack
                // another rule's place (another key's) that a younger one has.
                for (at, waiter) in fair.flows[i].waiters.iter().enumerate() {
                    if waiter.permit.is_closed() {
                        // Left (its ticket is on its way to remove it): skip it this time.
                        continue;
                    }
                    if let Ok(permit) = self.take(&waiter.places) {
                        served = Some((i, at, permit));
                        break 'flows;
                    }
                }
            }
            let Some((i, at, permit)) = served else {
                return;
            };
            fair.served += 1;
            let flow = &mut fair.flows[i];
            flow.last_served = fair.served;
            let Some(waiter) = flow.waiters.remove(at) else {
                return;
            };
            fair.left(queue, i);
            if let Err(given) = waiter.permit.send((permit, waiter.places)) {
                gone.push(given);
            }
        }
    }
}

impl Ticket {
    /// Waits for a permit until the deadline (on the layer's clock); `None` when the deadline
    /// passes or the request is pushed out of a full queue.
    pub(super) async fn wait(mut self) -> Option<(Permit, Places)> {
        loop {
            let Some(deadline) = self.deadline else {
                return (&mut self.permit).await.ok();
            };
            let now = self.shared.clock.now();
            if now >= deadline {
                break;
            }
            let mut sleep = pin!(tokio::time::sleep(Duration::from_nanos(deadline - now)));
            let outcome = poll_fn(|cx| match Pin::new(&mut self.permit).poll(cx) {
                Poll::Ready(outcome) => Poll::Ready(Some(outcome)),
                Poll::Pending => sleep.as_mut().poll(cx).map(|()| None),
            })
            .await;
            match outcome {
                Some(outcome) => return outcome.ok(),
                // Woken by the timer: the clock says whether the deadline has passed.
                None => continue,
            }
        }
        // Out of time: it leaves, unless it was served at the last moment.
        self.leave();
        self.permit.try_recv().ok()
    }

    /// Takes the request out of the queue, if it is still there.
    fn leave(&mut self) {
        if let Some(queue) = &self.shared.queue {
            queue.fair.lock().remove(queue, &self.flow, self.id);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.leave();
        for (hash, key) in &self.keys {
            self.shared.in_flight.leave_queue(*hash, key);
        }
        // A permit sent to it and not received is dropped with the receiver, after this:
        // its places go on to the next waiter.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Flows compare by rule and key; no rule, one flow.
    #[test]
    fn flows_are_found_by_rule_and_key() {
        let mut fair = Fair::default();
        let key = Key::from("k");
        for id in [Some((0, 1, key.clone())), None] {
            fair.flows.push(Flow {
                id,
                waiters: VecDeque::new(),
                last_served: 0,
                since: 0,
            });
        }
        assert_eq!(fair.position(&Some((0, 1, key.clone()))), Some(0));
        assert_eq!(fair.position(&None), Some(1));
        assert_eq!(fair.position(&Some((1, 1, key))), None);
    }
}

/// Model checks (`bash scripts/model-check fair::model_checks`, under
/// `--cfg tollgate_shuttle`): shuttle runs the threads below in many interleavings of the
/// table's and the queue's locks and atomics (its PCT scheduler). A place given back that no
/// waiter gets (a lost hand-over) leaves a waiter blocked for ever, which shuttle reports as
/// a deadlock; a place handed to two, a count above the limit.
#[cfg(all(test, tollgate_shuttle))]
mod model_checks {
    use std::sync::Arc;
    use std::time::Duration;

    use http::Request;

    use crate::ConcurrencyLimitLayer;
    use crate::concurrency::shared::Shared;
    use crate::inflight::{Admitted, Held};
    use crate::key::Header;
    use crate::limiter::Rule;
    use crate::sync::AtomicU32;

    use super::*;

    fn layer(max: u32, total: Option<u32>) -> Arc<Shared> {
        let mut builder = ConcurrencyLimitLayer::builder()
            .rule(Rule::new("r").key(Header::from_static("x-user")), max)
            .queue(4, Duration::MAX);
        if let Some(total) = total {
            builder = builder.total(total);
        }
        builder.build().unwrap().shared
    }

    /// Admits a request of `user`, waiting in the queue if it must (no deadline: it waits
    /// until it has a place).
    fn admit(shared: &Arc<Shared>, user: &str) -> Held {
        let (parts, ()) = Request::get("/")
            .header("x-user", user)
            .body(())
            .unwrap()
            .into_parts();
        match shared.admit(&parts) {
            Ok(Admitted::Now(held)) => held,
            Ok(Admitted::Later(pending)) => match shuttle::future::block_on(pending) {
                Ok(held) => held,
                Err(_) => panic!("refused with no deadline"),
            },
            Err(_) => panic!("refused with room in the queue"),
        }
    }

    /// The holder of the only place (key `k` has `max`, the total cap `total`) gives it back
    /// while `waiters` others of `k` admit, queue or wait: each gets it in turn, never two at
    /// once. (As many may wait for a key as it has places: several waiters of one key need
    /// the total cap to be the only place.)
    fn hand_over(waiters: usize, max: u32, total: Option<u32>) {
        let shared = layer(max, total);
        let peak = Arc::new(AtomicU32::new(0));
        let held = admit(&shared, "k");
        let threads: Vec<_> = (0..waiters)
            .map(|_| {
                let (shared, peak) = (Arc::clone(&shared), Arc::clone(&peak));
                shuttle::thread::spawn(move || {
                    let held = admit(&shared, "k");
                    // The places granted (the key's count also counts a try under way).
                    let granted = shared.total.as_ref().map_or_else(
                        || shared.in_flight.count("k"),
                        |total| total.count.load(Ordering::SeqCst),
                    );
                    peak.fetch_max(granted, Ordering::SeqCst);
                    drop(held);
                })
            })
            .collect();
        drop(held);
        for thread in threads {
            thread.join().unwrap();
        }
        assert!(peak.load(Ordering::SeqCst) <= 1);
        let queue = shared.queue.as_ref().unwrap();
        assert_eq!(queue.waiting.load(Ordering::SeqCst), 0);
        assert_eq!((shared.in_flight.keys(), shared.in_flight.total()), (0, 0));
    }

    #[test]
    fn a_place_given_back_is_handed_to_the_waiter() {
        shuttle::check_pct(|| hand_over(1, 1, None), crate::sync::pct_runs(), 3);
    }

    #[test]
    fn places_are_handed_to_every_waiter_in_turn() {
        shuttle::check_pct(|| hand_over(3, 4, Some(1)), crate::sync::pct_runs(), 3);
    }

    /// Two keys under a total cap of one: the place under the cap goes round.
    #[test]
    fn a_place_under_the_total_cap_is_handed_over() {
        shuttle::check_pct(
            || {
                let shared = layer(1, Some(1));
                let held = admit(&shared, "a");
                let other = {
                    let shared = Arc::clone(&shared);
                    shuttle::thread::spawn(move || drop(admit(&shared, "b")))
                };
                let again = {
                    let shared = Arc::clone(&shared);
                    shuttle::thread::spawn(move || drop(admit(&shared, "a")))
                };
                drop(held);
                other.join().unwrap();
                again.join().unwrap();
                assert_eq!((shared.in_flight.keys(), shared.in_flight.total()), (0, 0));
            },
            crate::sync::pct_runs(),
            3,
        );
    }

    /// A waiter that leaves (its future dropped) as the place is handed to it: the place goes
    /// on to the next waiter, or back, never lost.
    #[test]
    fn a_place_handed_to_a_leaver_goes_on() {
        shuttle::check_pct(
            || {
                // Two may wait for `k`; the total cap is the only place.
                let shared = layer(2, Some(1));
                let held = admit(&shared, "k");
                let (parts, ()) = Request::get("/")
                    .header("x-user", "k")
                    .body(())
                    .unwrap()
                    .into_parts();
                let leaver = match shared.admit(&parts) {
                    Ok(Admitted::Later(pending)) => pending,
                    _ => panic!("the cap is full: it waits"),
                };
                let next = {
                    let shared = Arc::clone(&shared);
                    shuttle::thread::spawn(move || drop(admit(&shared, "k")))
                };
                let gone = shuttle::thread::spawn(move || drop(leaver));
                drop(held);
                gone.join().unwrap();
                next.join().unwrap();
                assert_eq!((shared.in_flight.keys(), shared.in_flight.total()), (0, 0));
            },
            crate::sync::pct_runs(),
            3,
        );
    }
}
