//! How a request is admitted: its permit and places, taking them or waiting for them, and
//! the answer to a refusal.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
#[cfg(feature = "redis")]
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Response, StatusCode};
use smallvec::SmallVec;

use super::fair::{Entered, Ticket};
#[cfg(feature = "redis")]
use super::leases::{Denied, Lease};
use super::shared::Shared;
use super::table::Slot;
use crate::answer::{Rejection, RejectionKind};
use crate::inflight::{Admitted, Held, Refuse};
use crate::key::{Key, MAX_KEY_LEN};

/// The places one request holds; dropping it gives them back and times the request.
pub(crate) struct Permit {
    shared: Arc<Shared>,
    /// Its places of keys, by slot: it moves with the request's future and response, so it
    /// holds no copy of a key.
    held: SmallVec<[Taken; 2]>,
    started: u64,
    /// Whether the request got every place: a permit dropped while being refused gives back
    /// what it took but teaches nothing about how long requests stay.
    granted: bool,
    #[cfg(feature = "redis")]
    leases: SmallVec<[Lease; 1]>,
}

/// The limit of a place whose key's tier is not known yet.
const UNRESOLVED: u32 = 0;

/// The keys a request takes a place of, one per rule that applies.
pub(super) type Places = SmallVec<[Place; 2]>;

/// A place of a key that a permit holds: its rule, and its entry in the table.
struct Taken {
    rule: u16,
    slot: Slot,
}

pub(super) struct Place {
    pub(super) rule: u16,
    pub(super) max: u32,
    /// The key as the extractor found it, while its tier is being resolved.
    raw: Option<Box<str>>,
    pub(super) hash: u64,
    pub(super) key: Key,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let shared = &self.shared;
        #[cfg(feature = "redis")]
        if let Some(leases) = &shared.leases {
            leases.release(self.leases.drain(..));
        }
        shared.release(&self.held);
        if self.granted {
            shared.telemetry.in_flight.decrement();
            let elapsed = shared.clock.now().saturating_sub(self.started);
            for place in &self.held {
                if let Some(rule) = shared.rules.get(usize::from(place.rule)) {
                    rule.latency.record(elapsed);
                }
            }
            shared.latency.record(elapsed);
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("keys", &self.held.len())
            .finish_non_exhaustive()
    }
}

impl Permit {
    /// The request got every place: it is timed from now on.
    fn grant(mut self) -> Held {
        self.granted = true;
        self.shared.telemetry.in_flight.increment();
        self.started = self.shared.clock.now();
        Held::Concurrency(self)
    }
}

/// Why a request gets no permit.
pub(crate) enum Refusal {
    /// The store that counts the places failed and the policy is to refuse.
    #[cfg(feature = "redis")]
    StoreDown,
    /// Rule `rule`'s key is at its limit.
    Busy { rule: u16 },
    /// The total cap is reached.
    Full,
    /// Rule `rule` found no key and refuses such requests with `status`.
    NoKey { rule: u16, status: StatusCode },
}

impl Shared {
    /// Takes the places of every rule that applies and of the total cap, all or none; or,
    /// with a queue that has room, waits for them.
    pub(crate) fn admit(self: &Arc<Self>, parts: &Parts) -> Result<Admitted, Refusal> {
        // Filled in place, and moved only into a wait: a request that does not wait copies no
        // key around.
        let mut places = Places::new();
        self.places(parts, &mut places)?;
        if places.iter().any(|p| p.max == UNRESOLVED) {
            return Ok(Admitted::Later(Box::pin(Arc::clone(self).resolve(places))));
        }
        self.admit_places(&mut places)
    }

    /// Takes the places (and leases), or waits for them in the queue.
    fn admit_places(self: &Arc<Self>, places: &mut Places) -> Result<Admitted, Refusal> {
        let mut refusal = match &self.queue {
            // Others wait: the request comes to the queue, which serves them first (it tries
            // the places there, and this refusal is replaced by the one it meets).
            Some(queue) if queue.waiting.load(Ordering::Relaxed) > 0 => Refusal::Full,
            _ => match self.take(places) {
                Ok(permit) => return self.admitted(permit, places),
                Err(refusal) => refusal,
            },
        };
        let Some(queue) = &self.queue else {
            return Err(refusal);
        };
        match self.enter(queue, std::mem::take(places), &mut refusal) {
            Entered::Now(permit, mut places) => self.admitted(permit, &mut places),
            Entered::Waiting(ticket) => Ok(Admitted::Later(Box::pin(
                Arc::clone(self).wait(ticket, refusal),
            ))),
            Entered::Refused => Err(refusal),
        }
    }

    /// A request that has its places: granted now, or once it has its leases.
    fn admitted(
        self: &Arc<Self>,
        permit: Permit,
        places: &mut Places,
    ) -> Result<Admitted, Refusal> {
        #[cfg(feature = "redis")]
        if self.leases.is_some() && !permit.held.is_empty() {
            // The keys go with it to Redis (moved only here: without leases, nothing moves).
            let places = std::mem::take(places);
            return Ok(Admitted::Later(Box::pin(
                Arc::clone(self).lease(permit, places),
            )));
        }
        #[cfg(not(feature = "redis"))]
        let _ = places;
        Ok(Admitted::Now(permit.grant()))
    }

    /// Asks the resolver the tiers not remembered yet, then admits.
    async fn resolve(self: Arc<Self>, mut places: Places) -> Result<Held, Refuse> {
        for place in places.iter_mut().filter(|p| p.max == UNRESOLVED) {
            if let Some(tiers) = self
                .rules
                .get(usize::from(place.rule))
                .and_then(|r| r.tiers.as_ref())
            {
                let raw = place.raw.take();
                // Bounded by the tiers' timeout, one lookup per key at a time.
                let tier = tiers
                    .lookup
                    .tier_of(
                        place.key.as_str(),
                        raw.as_deref().unwrap_or(place.key.as_str()),
                    )
                    .await;
                place.max = tiers.limit(tier);
            }
        }
        match self.admit_places(&mut places) {
            Ok(Admitted::Now(held)) => Ok(held),
            Ok(Admitted::Later(pending)) => pending.await,
            Err(refusal) => Err(Box::new(move |parts: &Parts| self.answer(parts, refusal))),
        }
    }

    /// The keys of the rules that apply to a request, into `places`.
    fn places(&self, parts: &Parts, places: &mut Places) -> Result<(), Refusal> {
        for (index, rule) in self.rules.iter().enumerate() {
            if !rule.matcher.matches(parts) {
                continue;
            }
            let index = u16::try_from(index).unwrap_or(u16::MAX);
            let key = match rule.matcher.key(parts) {
                Ok(Some(key)) => key,
                Ok(None) => continue,
                Err(status) => {
                    return Err(Refusal::NoKey {
                        rule: index,
                        status,
                    });
                }
            };
            let (max, raw) = match &rule.tiers {
                None => (rule.max, None),
                Some(tiers) => match tiers.lookup.cached(key.as_str()) {
                    Some(tier) => (tiers.limit(tier), None),
                    None => (UNRESOLVED, rule.matcher.raw_key(parts)),
                },
            };
            places.push(Place {
                rule: index,
                max,
                raw,
                hash: self.in_flight.hash(key.as_str()),
                key,
            });
        }
        Ok(())
    }

    /// Takes every place of `places` and one under the total cap (the permit holds them), or
    /// none, and says why.
    pub(super) fn take(self: &Arc<Self>, places: &Places) -> Result<Permit, Refusal> {
        let mut held = SmallVec::new();
        for place in places {
            match self.in_flight.take(place.hash, &place.key, place.max) {
                Some(slot) => held.push(Taken {
                    rule: place.rule,
                    slot,
                }),
                None => {
                    self.release_keys(&held);
                    return Err(Refusal::Busy { rule: place.rule });
                }
            }
        }
        if let Some(total) = &self.total {
            let taken = total
                .count
                // SeqCst, as the waiters count: a release must see a waiter that found no place,
                // or the waiter the place given back.
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < total.max).then_some(n + 1)
                });
            if taken.is_err() {
                self.release_keys(&held);
                return Err(Refusal::Full);
            }
        }
        Ok(Permit {
            shared: Arc::clone(self),
            held,
            // Timed from its grant.
            started: 0,
            granted: false,
            #[cfg(feature = "redis")]
            leases: SmallVec::new(),
        })
    }

    fn release_keys(&self, held: &[Taken]) {
        for taken in held {
            self.in_flight.give_back(taken.slot);
        }
    }

    /// Gives back the places of a permit: its keys' and one under the total cap; while
    /// anyone waits, they go to the waiters they fit.
    fn release(self: &Arc<Self>, held: &[Taken]) {
        self.release_keys(held);
        if let Some(total) = &self.total {
            total.count.fetch_sub(1, Ordering::SeqCst);
        }
        if let Some(queue) = &self.queue {
            // SeqCst, as the waiters count: a waiter counted itself before its last try, so
            // either that try saw the place given back, or this sees the waiter.
            if queue.waiting.load(Ordering::SeqCst) > 0 {
                self.serve(queue);
            }
        }
    }

    /// Takes a lease on Redis for each key of `permit` (its `places`; without Redis, nothing
    /// to take).
    async fn lease(self: Arc<Self>, permit: Permit, places: Places) -> Result<Held, Refuse> {
        #[cfg(not(feature = "redis"))]
        let _ = places;
        #[cfg(feature = "redis")]
        let permit = {
            let mut permit = permit;
            if let Some(leases) = self.leases.clone() {
                for place in &places {
                    let rule = place.rule;
                    match leases.acquire(place.key.as_str(), place.max).await {
                        Ok(Some(lease)) => permit.leases.push(lease),
                        Ok(None) => {}
                        Err(denied) => {
                            drop(permit);
                            let refusal = match denied {
                                Denied::Busy => Refusal::Busy { rule },
                                Denied::Unavailable => Refusal::StoreDown,
                            };
                            return Err(Box::new(move |parts: &Parts| self.answer(parts, refusal)));
                        }
                    }
                }
            }
            permit
        };
        Ok(permit.grant())
    }

    /// Waits in the queue for the places, then takes the leases; refused for the last reason
    /// met when the wait runs out or the request is pushed out of a full queue.
    async fn wait(self: Arc<Self>, ticket: Ticket, refusal: Refusal) -> Result<Held, Refuse> {
        let since = self.clock.now();
        let permit = ticket.wait().await;
        self.telemetry
            .queue
            .record_nanos(self.clock.now().saturating_sub(since));
        match permit {
            Some((permit, places)) => self.lease(permit, places).await,
            None => Err(Box::new(move |parts: &Parts| self.answer(parts, refusal))),
        }
    }

    /// The answer to a refused request.
    pub(crate) fn answer(&self, parts: &Parts, refusal: Refusal) -> Response<Bytes> {
        self.telemetry.refused(&self.name, &self.rules, &refusal);
        let rule = |index: u16| self.rules.get(usize::from(index));
        let (kind, status, rule, retry_after) = match refusal {
            Refusal::Busy { rule: index } => (
                RejectionKind::TooManyInFlight,
                StatusCode::TOO_MANY_REQUESTS,
                rule(index),
                rule(index).map(|r| r.latency.retry_after()),
            ),
            #[cfg(feature = "redis")]
            Refusal::StoreDown => (
                RejectionKind::Unavailable,
                StatusCode::SERVICE_UNAVAILABLE,
                None,
                Some(Duration::from_secs(1)),
            ),
            Refusal::Full => (
                RejectionKind::Overloaded,
                StatusCode::SERVICE_UNAVAILABLE,
                None,
                Some(self.latency.retry_after()),
            ),
            Refusal::NoKey {
                rule: index,
                status,
            } => (RejectionKind::NoKey, status, rule(index), None),
        };
        crate::answer::refuse(
            &*self.responder,
            &Rejection {
                kind,
                parts,
                status,
                decision: None,
                rule: rule.map(|r| &*r.matcher.name),
                policy: None,
                window: None,
                retry_after,
                error: None,
            },
        )
    }
}

/// A key as the table holds it: hashed past [`MAX_KEY_LEN`], as the limiter's are.
pub(crate) fn bounded(key: Key) -> Key {
    if key.len() <= MAX_KEY_LEN {
        return key;
    }
    let text = key.as_str();
    let at = text.rfind('@').unwrap_or(text.len());
    crate::limiter::hashed_key(&text[..at], &text[at..])
}
