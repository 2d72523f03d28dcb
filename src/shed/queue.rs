//! The shedder's queue: a request the limit would shed waits for a place given back, served in
//! the [`Discipline`]'s order, each at most its own longest wait; CoDel says when the queue
//! stands and waits are cut to its target.
//!
//! Every change to the queue happens under one lock: a request joining it, a place given back
//! while anyone waits (handed to a waiter there, so that a newcomer cannot take it first), a
//! waiter leaving (served, timed out, or gone). A place given back while nobody waits takes no
//! lock.

use std::cmp::Reverse;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use http::HeaderName;
use http::request::Parts;
use tokio::sync::oneshot;

use super::classify::Criticality;
use super::deadline::{Route, parse_timeout};
use super::fair::Table;
use super::layer::{NoPlace, Place, Reason, Shared, Shed};
use super::shared::Fair;
use crate::inflight::{Admitted, Held, Refuse};
use crate::sync::{AtomicU64, AtomicUsize, Mutex};

/// How often the queue is served again while the count in flight keeps moving under it,
/// before giving up until the next place given back.
const SERVE_TRIES: usize = 16;

/// CoDel's default target: a queue whose delay stays at or above it for an interval stands.
pub const DEFAULT_CODEL_TARGET: Duration = Duration::from_millis(5);
/// CoDel's default interval: how long the delay must stay at the target for the queue to stand.
pub const DEFAULT_CODEL_INTERVAL: Duration = Duration::from_millis(100);

/// The order in which waiting requests get the places given back (among those whose class may
/// use the place).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Discipline {
    /// Oldest first: fair in order of arrival, but under overload every request waits about
    /// the longest wait, and the oldest are the likeliest to have been given up by their
    /// clients.
    Fifo,
    /// Newest first: under overload the requests served are fresh (their clients are still
    /// there) and the oldest are the ones shed, but in calm times a request may be overtaken
    /// again and again.
    Lifo,
    /// Oldest first while the queue is healthy, newest first while it is overloaded (it
    /// stands, by CoDel, or it is more than half full): Facebook's adaptive LIFO. The default.
    #[default]
    AdaptiveLifo,
}

/// The queue's settings and its waiters.
pub(super) struct Queue {
    max: usize,
    /// The longest wait, in nanoseconds.
    max_wait: u64,
    discipline: Discipline,
    /// CoDel's target, in nanoseconds: the longest wait while the queue stands.
    target: u64,
    /// The header in which clients declare their timeout.
    deadline: Option<HeaderName>,
    /// The waiters, readable without the lock.
    len: AtomicUsize,
    state: Mutex<State>,
    /// Requests shed from the queue because their wait ran out, per class.
    pub(super) timed_out: [AtomicU64; 4],
}

impl Queue {
    pub(super) fn new(
        max: usize,
        max_wait: Duration,
        discipline: Discipline,
        (target, interval): (Duration, Duration),
        deadline: Option<HeaderName>,
    ) -> Self {
        let target = nanos(target);
        Queue {
            max,
            max_wait: nanos(max_wait),
            discipline,
            target,
            deadline,
            len: AtomicUsize::new(0),
            state: Mutex::new(State {
                waiters: VecDeque::new(),
                next_id: 0,
                codel: Codel::new(target, nanos(interval)),
            }),
            timed_out: Default::default(),
        }
    }

    /// Requests waiting now.
    pub(super) fn len(&self) -> usize {
        self.len.load(Ordering::SeqCst)
    }

    /// Whether clients declare deadlines (so the time the service takes to answer matters).
    pub(super) fn has_deadlines(&self) -> bool {
        self.deadline.is_some()
    }

    /// Whether the queue stood when it was last looked at.
    pub(super) fn standing(&self) -> bool {
        self.state.lock().codel.standing
    }

    fn push(&self, state: &mut State, waiter: Waiter) {
        state.waiters.push_back(waiter);
        self.len.store(state.waiters.len(), Ordering::SeqCst);
    }

    fn remove(
        &self,
        state: &mut State,
        index: usize,
        fair: Option<&Fair>,
        now: u64,
    ) -> Option<Waiter> {
        let waiter = state.waiters.remove(index)?;
        self.removed(state, &waiter, fair, now);
        Some(waiter)
    }

    /// Counts `waiter`, taken out of `state.waiters` at `now`, as gone.
    fn removed(&self, state: &mut State, waiter: &Waiter, fair: Option<&Fair>, now: u64) {
        self.len.store(state.waiters.len(), Ordering::SeqCst);
        if let (Some(hash), Some(fair)) = (waiter.tenant, fair) {
            fair.tenants.leave_queue(hash, now);
        }
    }

    /// The most waiters one tenant may have among `recent` tenants: its share of the queue's
    /// places (at least one).
    fn share(&self, recent: u32) -> u32 {
        u32::try_from((self.max / recent.max(1) as usize).max(1)).unwrap_or(u32::MAX)
    }

    /// Whether the next place goes to the newest waiter.
    fn newest_first(&self, state: &State) -> bool {
        match self.discipline {
            Discipline::Fifo => false,
            Discipline::Lifo => true,
            Discipline::AdaptiveLifo => {
                state.codel.standing || state.waiters.len().saturating_mul(2) > self.max
            }
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A waiter's rank for a place (the highest first): its class, then its tenant's places held
/// (fewest first), then when its tenant was last given a place (longest ago first).
type Rank = (Criticality, Reverse<u32>, Reverse<u64>);

/// What the queue's lock guards.
struct State {
    /// In order of arrival: ids and arrival times only grow from front to back.
    waiters: VecDeque<Waiter>,
    next_id: u64,
    codel: Codel,
}

impl State {
    /// The queue's delay: how long its oldest waiter has waited (`None` when it is empty).
    fn delay(&self, now: u64) -> Option<u64> {
        self.waiters.front().map(|w| now.saturating_sub(w.since))
    }

    fn position(&self, id: u64) -> Option<usize> {
        self.waiters.binary_search_by_key(&id, |w| w.id).ok()
    }
}

struct Waiter {
    id: u64,
    class: Criticality,
    /// When it joined the queue, on the layer's clock.
    since: u64,
    tenant: Option<u64>,
    outcome: oneshot::Sender<Outcome>,
}

/// How a waiter leaves the queue when someone else decides it.
pub(super) enum Outcome {
    /// A place, handed over; `in_flight` is the count with it.
    Admitted { place: Place, in_flight: u32 },
    /// Shed: it had waited the target already when the queue turned standing.
    Shed,
    /// Shed: the queue was full, and a request of a higher class (or of a tenant below its
    /// share of the queue) took its place.
    Displaced,
}

/// CoDel's judgement of a queue (Kathleen Nichols and Van Jacobson's controlled delay, as
/// Facebook applies it to request queues). The queue's delay is the wait of its oldest
/// request (nothing when it is empty). The queue *stands* from the end of an interval through
/// which that delay never fell below `target`; it is healthy again from the end of an
/// interval in which it fell below half the target (or the queue emptied). A standing queue
/// sheds waiters at `target`, so that while it stands the delay keeps under the target: the
/// half is the hysteresis that keeps it standing while its waiters time out (leaving it at a
/// target and a little less), and lets it go once the queue drains. Pure: the caller says what
/// time it is.
#[derive(Clone, Debug)]
pub(super) struct Codel {
    target: u64,
    interval: u64,
    /// When the interval under way ends.
    ends: u64,
    /// The least delay seen in it.
    least: u64,
    /// The last look: when, and the delay then (`None`: the queue was empty).
    last: Option<(u64, u64)>,
    pub(super) standing: bool,
}

impl Codel {
    pub(super) fn new(target: u64, interval: u64) -> Self {
        Codel {
            target,
            interval: interval.max(1),
            ends: 0,
            least: 0,
            last: None,
            standing: false,
        }
    }

    /// The queue's delay is `delay` at `now` (just after it changed, or when anyone looks):
    /// judges the interval under way if it is over. Whether the queue has just turned
    /// standing.
    pub(super) fn observe(&mut self, now: u64, delay: Option<u64>) -> bool {
        let was = self.standing;
        if now >= self.ends {
            self.judge();
            if now - self.ends >= self.interval {
                // Whole intervals passed without a look. The delay only grows between looks
                // (while anyone waits), so their least was the delay at their start.
                self.least = self
                    .last
                    .map_or(0, |(at, d)| d.saturating_add(self.ends.saturating_sub(at)));
                self.judge();
            }
            self.ends = now.saturating_add(self.interval);
            self.least = u64::MAX;
        }
        self.least = self.least.min(delay.unwrap_or(0));
        self.last = delay.map(|d| (now, d));
        self.standing && !was
    }

    fn judge(&mut self) {
        self.standing = if self.standing {
            self.least.saturating_mul(2) >= self.target
        } else {
            self.least >= self.target
        };
    }
}

/// A request's place in the queue; dropping it (its client went away) leaves the queue, and a
/// place handed to it meanwhile goes on to the next waiter.
struct Ticket {
    shared: Arc<Shared>,
    id: u64,
    outcome: oneshot::Receiver<Outcome>,
    /// Still in the queue, as far as it knows.
    queued: bool,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.queued {
            return;
        }
        let Some(queue) = &self.shared.queue else {
            return;
        };
        let mut state = queue.state.lock();
        if let Some(index) = state.position(self.id) {
            let now = self.shared.clock.now();
            queue.remove(&mut state, index, self.shared.fair.as_ref(), now);
            self.shared.look(queue, &mut state, now);
            // Its tenant may have been forgotten with it, which raises the others' shares: a
            // waiter may fit now.
            self.shared.serve(queue, &mut state, now);
        }
        // The lock is released before the receiver is dropped: a place in it is given back
        // (to the next waiter) through the lock again.
    }
}

impl Shared {
    /// A request of `class` found no place: it waits in the queue if it can (the queue has
    /// room, its deadline leaves time to wait, its tenant is within its fair share), or is
    /// shed at once. The waiters that fit are served first, so that it cannot overtake them.
    pub(super) fn enqueue(
        self: &Arc<Self>,
        queue: &Queue,
        parts: &Parts,
        class: Criticality,
        tenant: Option<u64>,
    ) -> Result<Admitted, Shed> {
        let shed = |reason| Shed { class, reason };
        let route = self.route(parts);
        let budget = self.budget(queue, parts, route);
        let mut state = queue.state.lock();
        let now = self.clock.now();
        self.look(queue, &mut state, now);
        // The waiters that fit are served first. Then this request may take a place, but only
        // at the count at which nobody waiting fits: a place given back meanwhile (releases do
        // not wait for the lock) goes to the waiters, so the queue is served again.
        let mut taken = Err(NoPlace::Full);
        for _ in 0..SERVE_TRIES {
            let Some(at) = self.serve(queue, &mut state, now) else {
                break;
            };
            taken = self.take(class, tenant, Some(at));
            if !matches!(taken, Err(NoPlace::Moved)) {
                break;
            }
        }
        match taken {
            Ok(in_flight) => {
                drop(state);
                let guard = self.guard(class, Place::new(self, tenant), in_flight, route);
                return Ok(Admitted::Now(Held::Shed(guard)));
            }
            Err(NoPlace::Unfair) => {
                self.serve(queue, &mut state, now);
                return Err(shed(Reason::Unfair));
            }
            // No room, or the count kept moving: it waits, and is served as places come back.
            Err(NoPlace::Full | NoPlace::Moved) => {}
        }
        if budget == 0 {
            return Err(shed(Reason::Deadline));
        }
        if let (Some(fair), Some(hash)) = (&self.fair, tenant) {
            // A tenant may have its share of the queue's places waiting, no more; near
            // capacity, its fair share in flight and waiting: a noisy tenant cannot fill the
            // queue.
            let limit = u64::from(self.limit.load(Ordering::Relaxed));
            let in_flight = self.in_flight.load(Ordering::SeqCst);
            let over = fair.tenants.with(|table| {
                let t = table.get(hash);
                t.waiting >= queue.share(table.recent())
                    || (u64::from(in_flight) * 1000 >= limit * fair.from
                        && t.held.saturating_add(t.waiting) >= fair.share(limit, table.recent()))
            });
            if over {
                return Err(shed(Reason::Unfair));
            }
        }
        if state.waiters.len() >= queue.max {
            // Full: a waiter of a lower class (or of a tenant over its share of the queue)
            // gives way, or this request is shed.
            let Some(index) = self.displaced(queue, &state, class, tenant) else {
                return Err(shed(Reason::QueueFull));
            };
            if let Some(waiter) = queue.remove(&mut state, index, self.fair.as_ref(), now) {
                // A waiter gone meanwhile needs no answer.
                let _ = waiter.outcome.send(Outcome::Displaced);
            }
        }
        if let (Some(fair), Some(hash)) = (&self.fair, tenant) {
            fair.tenants.enter_queue(hash, |_, _| true);
        }
        let (sender, receiver) = oneshot::channel();
        let id = state.next_id;
        state.next_id += 1;
        queue.push(
            &mut state,
            Waiter {
                id,
                class,
                since: now,
                tenant,
                outcome: sender,
            },
        );
        // A place given back since `take` found none (by a request that saw nobody waiting)
        // would be lost to it: serve the queue, now that it is in.
        self.serve(queue, &mut state, now);
        self.look(queue, &mut state, now);
        drop(state);
        let ticket = Ticket {
            shared: Arc::clone(self),
            id,
            outcome: receiver,
            queued: true,
        };
        Ok(Admitted::Later(Box::pin(wait(
            ticket,
            class,
            route,
            now,
            now.saturating_add(budget),
        ))))
    }

    /// The waiter a request of `class` (of `tenant`) displaces from a full queue: the newest
    /// of the lowest class below its own; with none, and fairness, if its tenant is below
    /// its share of the queue's places, the newest of its class from the tenant with the most
    /// waiters over that share. `None`: nobody gives way.
    fn displaced(
        &self,
        queue: &Queue,
        state: &State,
        class: Criticality,
        tenant: Option<u64>,
    ) -> Option<usize> {
        let lowest = state.waiters.iter().map(|w| w.class).min()?;
        if lowest < class {
            return state.waiters.iter().rposition(|w| w.class == lowest);
        }
        let (fair, hash) = (self.fair.as_ref()?, tenant?);
        fair.tenants.with(|table| {
            let share = queue.share(table.recent());
            if table.get(hash).waiting >= share {
                return None;
            }
            let mut most: Option<(usize, u32)> = None;
            for (i, w) in state.waiters.iter().enumerate() {
                let Some(other) = w.tenant.filter(|_| w.class == class) else {
                    continue;
                };
                let waiting = table.get(other).waiting;
                // The newest of the tenant with the most waiters.
                if waiting > share && most.is_none_or(|(_, m)| waiting >= m) {
                    most = Some((i, waiting));
                }
            }
            most.map(|(i, _)| i)
        })
    }

    /// How long a request to `route` may wait, in nanoseconds: the queue's longest wait, or
    /// less when its client declared a timeout (less the time the service takes to answer on
    /// that route, so that it is not served after its client gave up).
    fn budget(&self, queue: &Queue, parts: &Parts, route: Route) -> u64 {
        let declared = queue
            .deadline
            .as_ref()
            .and_then(|name| parts.headers.get(name))
            .and_then(|value| parse_timeout(value.as_bytes()));
        match declared {
            Some(declared) => queue
                .max_wait
                .min(nanos(declared).saturating_sub(self.typical.get(route))),
            None => queue.max_wait,
        }
    }

    /// A place was given back while requests wait: serves them.
    pub(super) fn serve_waiters(self: &Arc<Self>) {
        if let Some(queue) = &self.queue {
            if queue.len() > 0 {
                let mut state = queue.state.lock();
                let now = self.clock.now();
                self.look(queue, &mut state, now);
                self.serve(queue, &mut state, now);
            }
        }
    }

    /// Hands places to waiters while any may take one: each time to the first, in the
    /// discipline's order, whose class has room (and whose tenant is within its fair share).
    /// The count in flight at which no waiter fits, or `None` if it kept moving.
    fn serve(self: &Arc<Self>, queue: &Queue, state: &mut State, now: u64) -> Option<u32> {
        for _ in 0..SERVE_TRIES {
            let limit = u64::from(self.limit.load(Ordering::Relaxed));
            let in_flight = self.in_flight.load(Ordering::SeqCst);
            if state.waiters.is_empty() || in_flight >= self.threshold(self.widest, limit) {
                return Some(in_flight);
            }
            let fits = |w: &Waiter, table: Option<&Table>| {
                in_flight < self.threshold(w.class, limit)
                    && match (&self.fair, w.tenant, table) {
                        (Some(fair), Some(hash), Some(table)) => {
                            let room = self.threshold(w.class, limit);
                            fair.allows((in_flight, room), limit, &table.get(hash), table)
                        }
                        _ => true,
                    }
            };
            // The highest class that may use the place; in it, the tenant holding fewest places
            // (then the one given a place longest ago); among its waiters, the discipline's.
            let newest_first = queue.newest_first(state);
            let find = |table: Option<&Table>| {
                let mut best: Option<(usize, Rank)> = None;
                for (i, w) in state.waiters.iter().enumerate() {
                    if !fits(w, table) {
                        continue;
                    }
                    let (held, served) = match (w.tenant, table) {
                        (Some(hash), Some(table)) => {
                            let t = table.get(hash);
                            (t.held, t.served)
                        }
                        _ => (0, 0),
                    };
                    let rank = (w.class, Reverse(held), Reverse(served));
                    if best
                        .as_ref()
                        .is_none_or(|(_, b)| rank > *b || (rank == *b && newest_first))
                    {
                        best = Some((i, rank));
                    }
                }
                best.map(|(i, _)| i)
            };
            let found = match &self.fair {
                Some(fair) => fair.tenants.with(|table| find(Some(table))),
                None => find(None),
            };
            // Out of the queue while it takes its place, but still counted as waiting (so that
            // a newcomer does not take the place on the way that skips the queue).
            let Some((index, waiter)) = found.and_then(|i| Some((i, state.waiters.remove(i)?)))
            else {
                return Some(in_flight);
            };
            let in_flight = match self.take(waiter.class, waiter.tenant, Some(in_flight)) {
                Ok(in_flight) => in_flight,
                Err(_) => {
                    // The count moved since it was read (a place came back, or a request that
                    // found nobody waiting took one): back in its place, and look again.
                    state.waiters.insert(index, waiter);
                    continue;
                }
            };
            queue.removed(state, &waiter, self.fair.as_ref(), now);
            let place = Place::new(self, waiter.tenant);
            if let Err(Outcome::Admitted { place, .. }) =
                waiter.outcome.send(Outcome::Admitted { place, in_flight })
            {
                // The waiter is gone (it cannot be: a waiter leaves the queue before it lets
                // go of its receiver). Given back here, under the lock.
                place.give_back_locked();
            }
            self.look(queue, state, now);
        }
        None
    }

    /// Looks at the queue at `now`: CoDel judges it; if it has just turned standing, the
    /// waiters that have waited the target already are shed.
    fn look(&self, queue: &Queue, state: &mut State, now: u64) {
        let delay = state.delay(now);
        if !state.codel.observe(now, delay) {
            return;
        }
        while state
            .waiters
            .front()
            .is_some_and(|w| now.saturating_sub(w.since) >= queue.target)
        {
            if let Some(waiter) = queue.remove(state, 0, self.fair.as_ref(), now) {
                // A waiter gone meanwhile needs no answer.
                let _ = waiter.outcome.send(Outcome::Shed);
            }
        }
        let delay = state.delay(now);
        state.codel.observe(now, delay);
    }
}

/// A request's wait in the queue: a place handed over, or its wait ran out (its longest wait
/// or its deadline, or the target while the queue stands) and it is shed.
async fn wait(
    mut ticket: Ticket,
    class: Criticality,
    route: Route,
    since: u64,
    deadline: u64,
) -> Result<Held, Refuse> {
    let shared = Arc::clone(&ticket.shared);
    let refuse = |reason| {
        let shared = Arc::clone(&shared);
        let shed = Shed { class, reason };
        Box::new(move |parts: &Parts| shared.refuse(parts, shed)) as Refuse
    };
    let Some(queue) = &shared.queue else {
        return Err(refuse(Reason::TimedOut));
    };
    // The time it waited, however its wait ends.
    let record_wait = |now: u64| {
        shared
            .telemetry
            .queue
            .record_nanos(now.saturating_sub(since))
    };
    loop {
        // Look again at the deadline, or once the request has waited the target (if that is
        // sooner), in case the queue stands then.
        let now = shared.clock.now();
        let at_target = since.saturating_add(queue.target);
        let look_at = if now < at_target {
            at_target.min(deadline)
        } else {
            deadline
        };
        // On the layer's clock: its own wait, or tokio's timer for one that keeps its pace.
        let mut own = shared.clock.sleep_until(look_at);
        let mut timer =
            pin!(own.is_none().then(|| {
                tokio::time::sleep(Duration::from_nanos(look_at.saturating_sub(now)))
            }));
        let outcome = poll_fn(|cx| match Pin::new(&mut ticket.outcome).poll(cx) {
            Poll::Ready(outcome) => Poll::Ready(Some(outcome)),
            Poll::Pending => match (own.as_mut(), timer.as_mut().as_pin_mut()) {
                (Some(own), _) => own.as_mut().poll(cx).map(|()| None),
                (None, Some(timer)) => timer.poll(cx).map(|()| None),
                (None, None) => Poll::Ready(None),
            },
        })
        .await;
        match outcome {
            Some(Ok(Outcome::Admitted { place, in_flight })) => {
                ticket.queued = false;
                record_wait(shared.clock.now());
                return Ok(Held::Shed(shared.guard(class, place, in_flight, route)));
            }
            Some(Ok(Outcome::Displaced)) => {
                ticket.queued = false;
                record_wait(shared.clock.now());
                return Err(refuse(Reason::QueueFull));
            }
            // Shed as the queue turned standing (or the queue let go of it: cannot happen).
            Some(_) => {
                ticket.queued = false;
                record_wait(shared.clock.now());
                queue.timed_out[class.index()].fetch_add(1, Ordering::Relaxed);
                return Err(refuse(Reason::TimedOut));
            }
            None => {
                let mut state = queue.state.lock();
                let now = shared.clock.now();
                shared.look(queue, &mut state, now);
                let Some(index) = state.position(ticket.id) else {
                    // Served or shed meanwhile: the outcome is in the channel.
                    continue;
                };
                let waited = now.saturating_sub(since);
                if now >= deadline || (state.codel.standing && waited >= queue.target) {
                    queue.remove(&mut state, index, shared.fair.as_ref(), now);
                    shared.look(queue, &mut state, now);
                    // As when a waiter goes away: the others' shares may have grown.
                    shared.serve(queue, &mut state, now);
                    ticket.queued = false;
                    record_wait(now);
                    queue.timed_out[class.index()].fetch_add(1, Ordering::Relaxed);
                    return Err(refuse(Reason::TimedOut));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// A queue stands once its delay stayed at the target through an interval, and not before.
    #[test]
    fn codel_stands_after_an_interval_at_the_target() {
        let mut c = Codel::new(5 * MS, 100 * MS);
        // An empty queue, then a waiter from 10 ms on: the first interval saw an empty queue.
        assert!(!c.observe(0, None));
        assert!(!c.observe(10 * MS, Some(0)));
        assert!(!c.observe(60 * MS, Some(50 * MS)));
        assert!(
            !c.observe(100 * MS, Some(90 * MS)),
            "the first interval saw 0"
        );
        assert!(!c.standing);
        // Through [100, 200) the delay was 90 ms or more.
        assert!(!c.observe(150 * MS, Some(140 * MS)));
        assert!(c.observe(200 * MS, Some(190 * MS)));
        assert!(c.standing);
        // Already standing: not turning again.
        assert!(!c.observe(300 * MS, Some(4 * MS)));
        assert!(c.standing);
    }

    /// At exactly the target the queue stands (CoDel's "not below target"); a hair under, not.
    #[test]
    fn codel_target_is_inclusive() {
        let mut c = Codel::new(5 * MS, 100 * MS);
        c.observe(0, Some(5 * MS));
        c.observe(100 * MS, Some(5 * MS));
        assert!(c.standing);
        let mut c = Codel::new(5 * MS, 100 * MS);
        c.observe(0, Some(5 * MS - 1));
        c.observe(100 * MS, Some(5 * MS));
        assert!(!c.standing);
    }

    /// A standing queue whose waiters time out at the target keeps standing while its delay
    /// stays at half the target or more, and is healthy after an interval below that, or
    /// one in which it emptied.
    #[test]
    fn codel_hysteresis_and_recovery() {
        let standing = || {
            let mut c = Codel::new(10 * MS, 100 * MS);
            c.observe(0, Some(20 * MS));
            c.observe(100 * MS, Some(20 * MS));
            assert!(c.standing);
            c
        };
        // The delay at 5 ms (half the target) through an interval: still standing.
        let mut c = standing();
        c.observe(150 * MS, Some(5 * MS));
        c.observe(200 * MS, Some(9 * MS));
        assert!(c.standing);
        // A hair under half: healthy.
        let mut c = standing();
        c.observe(150 * MS, Some(5 * MS - 1));
        c.observe(200 * MS, Some(9 * MS));
        assert!(!c.standing);
        // Emptied once: healthy.
        let mut c = standing();
        c.observe(150 * MS, None);
        c.observe(151 * MS, Some(0));
        c.observe(200 * MS, Some(49 * MS));
        assert!(!c.standing);
        // Healthy again, it needs a whole interval at the target to stand.
        c.observe(250 * MS, Some(99 * MS));
        assert!(!c.standing);
        assert!(c.observe(300 * MS, Some(149 * MS)));
    }

    /// Whole intervals without a look: the delay grew through them while anyone waited (the
    /// queue stands) and stayed nothing while nobody did (it is healthy).
    #[test]
    fn codel_judges_intervals_without_looks() {
        // One waiter from 0, nobody looks until 1 s.
        let mut c = Codel::new(5 * MS, 100 * MS);
        c.observe(0, Some(0));
        assert!(c.observe(1_000 * MS, Some(1_000 * MS)));
        // A waiter 2 ms old when the interval under way ends at 100: 2 ms at its start, under
        // the target.
        let mut c = Codel::new(5 * MS, 100 * MS);
        c.observe(0, None);
        c.observe(98 * MS, Some(0));
        assert!(!c.observe(200 * MS, Some(102 * MS)));
        // ... 5 ms old: at the target.
        let mut c = Codel::new(5 * MS, 100 * MS);
        c.observe(0, None);
        c.observe(95 * MS, Some(0));
        assert!(c.observe(200 * MS, Some(105 * MS)));
        // A standing queue left empty is healthy at the next look, however late.
        let mut c = Codel::new(5 * MS, 100 * MS);
        c.observe(0, Some(50 * MS));
        c.observe(100 * MS, Some(50 * MS));
        assert!(c.standing);
        c.observe(120 * MS, None);
        c.observe(10_000 * MS, Some(0));
        assert!(!c.standing);
    }
}
