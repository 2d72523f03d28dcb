//! Deciding a stack with leases: which checks spend from the ledger, wait for a lease call or
//! take a lease, and how Redis' answer is folded in.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hashbrown::HashTable;
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::give_back::Back;
use super::ledger::{AsOf, Entry, Lease};
use super::policy::{Kind, kind, sketch_add};
use super::{MAX_LEASED_KEY_LEN, SHARDS, SKETCH_SLOTS, Shared};
use crate::Decision;
use crate::store::redis::{Taken, TakenItem, Wanted, supports};
use crate::store::{Check, StoreError};

/// How a key's lease call ended, for the checks that waited for it.
#[derive(Clone, Debug, Default)]
pub(super) enum Ended {
    /// In flight (the channel's first value), answered, or never made: decide again.
    #[default]
    Answered,
    /// Redis did not answer in time: the waiters fail alike, rather than each waiting for a
    /// timeout of its own.
    TimedOut(Duration),
    /// Redis failed (the error's text).
    Failed(String),
}

impl Ended {
    /// How a lease call that failed with `e` ended, for its key's waiters: `alone`, whether
    /// the call was about the leased keys alone. A failure of another check of its stack (its
    /// slot down, its key invalid) says nothing about this key: its waiters decide again.
    fn of(e: &StoreError, alone: bool) -> Self {
        match e {
            StoreError::Timeout(after) if alone => Ended::TimedOut(*after),
            StoreError::Backend(_) | StoreError::CircuitOpen if alone => {
                Ended::Failed(e.to_string())
            }
            _ => Ended::Answered,
        }
    }
}

/// What a check_all does.
pub(super) enum Plan {
    /// A check waits for its key's lease call in flight; then the stack is decided again.
    Wait(tokio::sync::watch::Receiver<Ended>),
    /// Nothing leased is involved: the Redis store's own path.
    Direct,
    /// Every check answered from leases.
    Local(Decision),
    /// Redis decides the rest.
    Ask(Box<Ask>),
}

pub(super) struct Ask {
    pub(super) future: super::TakeFuture,
    /// Redis is asked about the fetches' keys alone.
    pub(super) alone: bool,
    /// Checks answered from leases, pending Redis' verdict on the others.
    pub(super) locals: SmallVec<[Local; 2]>,
    /// Checks whose call takes a lease.
    pub(super) fetches: SmallVec<[Fetch; 2]>,
}

/// A call with leased parts until [`Shared::finish`] runs. If its future is dropped first
/// (the caller went away without a runtime to finish it, or the runtime shut down), the
/// units taken from leases go back and its lease calls end, so that no check waits for them
/// forever. (What Redis consumed for such a call, if it ran, stays consumed.)
pub(super) struct Unfinished {
    pub(super) shared: Arc<Shared>,
    pub(super) locals: SmallVec<[Local; 2]>,
    pub(super) fetches: SmallVec<[Fetch; 2]>,
    /// The call asks Redis about its lease calls' keys alone.
    pub(super) alone: bool,
}

impl Unfinished {
    pub(super) fn finish(
        mut self,
        taken: Result<Taken, StoreError>,
    ) -> Result<Decision, StoreError> {
        let locals = std::mem::take(&mut self.locals);
        let fetches = std::mem::take(&mut self.fetches);
        self.shared.finish(taken, locals, fetches, self.alone)
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        self.shared.put_back(&self.locals);
        for f in &self.fetches {
            self.shared.install(f, None, 0, Ended::Answered);
        }
    }
}

/// `d`, marked as coming from the backend (a decision folded from local answers and Redis'
/// answer reached Redis).
pub(super) fn reached_backend(d: Decision) -> Decision {
    if d.reached_backend() {
        return d;
    }
    let nanos = |t: Duration| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX);
    Decision::from_nanos(
        d.allowed(),
        d.limit(),
        d.remaining(),
        nanos(d.reset_after()),
        d.retry_after().map_or(0, nanos),
    )
    .with_index(d.index())
}

/// Units taken from leases: (lease id, units).
pub(super) type Parts = SmallVec<[(u64, u64); 2]>;

/// A check answered from its key's leases.
#[derive(Clone)]
pub(super) struct Local {
    pub(super) hash: u64,
    pub(super) parts: Parts,
    pub(super) units: u64,
    pub(super) decision: Decision,
}

/// A lease call: its key's entry (hash, id), the check's index and cost.
#[derive(Clone, Copy)]
pub(super) struct Fetch {
    pub(super) hash: u64,
    pub(super) entry: u64,
    pub(super) index: usize,
    pub(super) cost: u64,
    /// What the lease call asks for (at least the cost).
    pub(super) want: u64,
}

/// What deciding a stack leaves to do once the locks are released.
pub(super) struct Effects<'c> {
    /// Leases expired or emptied, to give back.
    returns: Vec<Back>,
    /// Lease calls to make in the background: (the check, its fetch, what to ask for).
    prefetch: SmallVec<[(Check<'c>, Fetch, u64); 1]>,
}

/// What one check of a stack does.
pub(super) enum Step {
    /// Waits for the lease call in flight.
    Wait(tokio::sync::watch::Receiver<Ended>),
    /// Spent from leases.
    Local(Local),
    /// Refused here: the key is short.
    Refuse(Decision),
    /// Asks Redis, taking a lease.
    Fetch(Fetch),
    /// Asks Redis, as without leases.
    Direct,
}

impl Shared {
    fn hash(&self, check: &Check<'_>) -> u64 {
        self.hasher
            .hash_one((check.key(), check.placement().len(), check.policy().id()))
    }

    pub(super) fn shard(&self, hash: u64) -> &Mutex<HashTable<Entry>> {
        &self.shards[(hash >> 40) as usize % SHARDS]
    }

    /// Counts demand for a key that is not hot: its slot's units in the current span.
    fn bump(&self, hash: u64, span: u64, cost: u64) -> u64 {
        sketch_add(
            &self.sketch[(hash >> 20) as usize % SKETCH_SLOTS],
            span,
            cost,
        )
    }

    /// What to do with a stack. Checks are validated where a key becomes hot (so a hot key's
    /// checks are valid but for their cost, which a lease never covers beyond the limit);
    /// others are the Redis store's to refuse.
    pub(super) fn plan(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        may_wait: bool,
    ) -> Result<Plan, StoreError> {
        // The same (key, policy) twice in one stack is one check of the summed cost, as the
        // Redis store merges it.
        let mut merged: SmallVec<[(Check<'_>, usize); 4]> = SmallVec::new();
        for (index, check) in checks.iter().enumerate() {
            match merged
                .iter_mut()
                .find(|(c, _)| c.policy().id() == check.policy().id() && c.key() == check.key())
            {
                Some((c, _)) => {
                    let cost = c
                        .cost()
                        .checked_add(check.cost())
                        .filter(|&s| s <= c.policy().limit())
                        .ok_or(StoreError::CostExceedsLimit {
                            index,
                            cost: c.cost().saturating_add(check.cost()),
                            limit: c.policy().limit(),
                        })?;
                    *c = c.with_cost(cost);
                }
                None => merged.push((*check, index)),
            }
        }
        let mut steps: SmallVec<[Step; 4]> = SmallVec::new();
        let mut effects = Effects {
            returns: Vec::new(),
            prefetch: SmallVec::new(),
        };
        for &(check, index) in &merged {
            let step = match kind(check.policy().algorithm()) {
                // (A cost above the limit is the Redis store's error to report, short or not.)
                Some(kind) if check.cost() > 0 && check.cost() <= check.policy().limit() => {
                    self.step(check, index, kind, may_wait, &mut effects)
                }
                _ => Step::Direct,
            };
            steps.push(step);
        }
        if !effects.prefetch.is_empty() {
            self.start_sweeper();
        }
        for (check, fetch, want) in effects.prefetch {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                // Nowhere to take it in the background: the next check that runs dry will.
                self.install(&fetch, None, 0, Ended::Answered);
                continue;
            };
            let future = self.redis.take(
                &[Wanted {
                    check: check.with_cost(0),
                    index: 0,
                    want,
                }],
                &self.in_doubt,
            );
            let unfinished = Unfinished {
                shared: Arc::clone(self),
                locals: SmallVec::new(),
                fetches: [fetch].into_iter().collect(),
                alone: true,
            };
            runtime.spawn(async move {
                let taken = future.await;
                unfinished.finish(taken)
            });
        }
        let refused = steps.iter().filter_map(|s| match s {
            Step::Refuse(d) => Some(*d),
            _ => None,
        });
        let refusal = refused.reduce(Decision::most_restrictive);
        let wait = steps.iter().find_map(|s| match s {
            Step::Wait(done) => Some(done.clone()),
            _ => None,
        });
        let early = match (refusal, wait) {
            (Some(refusal), _) => {
                self.counters.local_refusals.fetch_add(1, Ordering::Relaxed);
                Some(Plan::Local(refusal))
            }
            (None, Some(done)) => Some(Plan::Wait(done)),
            (None, None) => None,
        };
        if let Some(plan) = early {
            // Nothing is consumed anywhere: units taken from leases go back, calls are not made.
            let mut locals: SmallVec<[Local; 2]> = SmallVec::new();
            for s in steps {
                match s {
                    Step::Local(l) => locals.push(l),
                    Step::Fetch(f) => self.install(&f, None, 0, Ended::Answered),
                    _ => {}
                }
            }
            // Before the leases emptied here are published for a sweep to give back: their
            // units go back with them.
            self.put_back_with(&locals, &mut effects.returns);
            self.publish(&mut effects.returns);
            return Ok(plan);
        }
        self.publish(&mut effects.returns);
        if steps.iter().all(|s| matches!(s, Step::Local(_))) {
            let mut decision: Option<(Decision, u64)> = None;
            for s in &steps {
                if let Step::Local(l) = s {
                    self.counted_local(l);
                    let this = (l.decision, l.units);
                    decision = Some(decision.map_or(this, |d| crate::decision::tighter(d, this)));
                }
            }
            return Ok(Plan::Local(
                decision.map_or(super::NOTHING_TO_CHECK, |(d, _)| d),
            ));
        }
        if steps.iter().all(|s| matches!(s, Step::Direct)) {
            return Ok(Plan::Direct);
        }
        // A lease is being taken: someone must give it back.
        self.start_sweeper();
        let mut wanted: SmallVec<[Wanted<'_>; 4]> = SmallVec::new();
        let mut locals = SmallVec::new();
        let mut fetches = SmallVec::new();
        for ((check, index), step) in merged.iter().zip(steps) {
            match step {
                Step::Local(l) => locals.push(l),
                Step::Fetch(f) => {
                    fetches.push(f);
                    wanted.push(Wanted {
                        check: *check,
                        index: *index,
                        want: f.want,
                    });
                }
                Step::Refuse(_) | Step::Wait(_) => {}
                Step::Direct => wanted.push(Wanted {
                    check: *check,
                    index: *index,
                    want: check.cost(),
                }),
            }
        }
        Ok(Plan::Ask(Box::new(Ask {
            alone: wanted.len() == fetches.len(),
            future: self.redis.take(&wanted, &self.in_doubt),
            locals,
            fetches,
        })))
    }

    /// What one leasable check does: spend from a lease, take one, or go to Redis alone.
    fn step<'c>(
        &self,
        check: Check<'c>,
        index: usize,
        kind: Kind,
        may_wait: bool,
        effects: &mut Effects<'c>,
    ) -> Step {
        let (returns, prefetch) = (&mut effects.returns, &mut effects.prefetch);
        let config = &self.config;
        let hash = self.hash(&check);
        let cost = check.cost();
        let mut table = self.shard(hash).lock();
        // Closing: no lease call starts after shutdown has looked at this shard.
        if self.closed.load(Ordering::Acquire) {
            return Step::Direct;
        }
        // Read once the shard is ours, so that no wait for the lock makes it stale: a lease
        // is never spent after it expired.
        let now = self.clock.now();
        if let Some(e) = table.find_mut(hash, |e| e.hash == hash && e.matches(&check)) {
            e.note(now, cost, config.span);
            e.expire(now, returns);
            let granted = e.leases.last().map_or(0, |l| l.granted);
            if let Some(parts) = e.spend(cost, returns) {
                let decision = e.decision(now, index, None);
                if !e.fetching && e.low(granted.max(cost)) {
                    let want = e.want(now, 0, config);
                    if want > 0 {
                        e.fetching = true;
                        e.fetch_sent = now;
                        let fetch = Fetch {
                            hash,
                            entry: e.id,
                            index: 0,
                            cost: 0,
                            want,
                        };
                        prefetch.push((check, fetch, want));
                    }
                }
                return Step::Local(Local {
                    hash,
                    parts,
                    units: cost,
                    decision,
                });
            }
            if now < e.short_until {
                let retry = e.retry(now, cost, e.short_until - now);
                return Step::Refuse(e.decision(now, index, Some(retry)));
            }
            if e.fetching {
                if e.short_until > 0 && now < e.fetch_sent.saturating_add(e.hold) {
                    // Short, and the next lease call is out (for less than a hold): refused
                    // here too.
                    let retry = e.retry(now, cost, e.hold.max(1));
                    return Step::Refuse(e.decision(now, index, Some(retry)));
                }
                if may_wait {
                    return Step::Wait(e.done.subscribe());
                }
                return Step::Direct;
            }
            e.fetching = true;
            e.fetch_sent = now;
            let want = e.want(now, cost, config);
            return Step::Fetch(Fetch {
                hash,
                entry: e.id,
                index,
                cost,
                want,
            });
        }
        let span = now / config.span.max(1);
        let demand = self.bump(hash, span, cost);
        if demand < config.hot || table.len() >= config.per_shard {
            return Step::Direct;
        }
        // A check Redis would refuse (a key too long, a policy out of its bounds) stays cold.
        let valid = check.key().len() <= MAX_LEASED_KEY_LEN
            && check.validate(index, self.redis.inner.max_key_len).is_ok()
            && supports(check.policy(), index).is_ok();
        if !valid {
            return Step::Direct;
        }
        let entry = Entry {
            hash,
            id: self.ids.fetch_add(1, Ordering::Relaxed),
            key: check.key().into(),
            placement_len: check.placement().len(),
            policy: check.policy().clone(),
            kind,
            leases: SmallVec::new(),
            fetching: true,
            fetch_sent: now,
            done: tokio::sync::watch::Sender::new(Ended::Answered),
            span,
            demand,
            last_demand: 0,
            used_at: now,
            as_of: None,
            short_until: 0,
            hold: 0,
        };
        let want = entry.want(now, cost, config);
        let fetch = Fetch {
            hash,
            entry: entry.id,
            index,
            cost,
            want,
        };
        table.insert_unique(hash, entry, |e| e.hash);
        Step::Fetch(fetch)
    }

    fn counted_local(&self, l: &Local) {
        let c = &self.counters;
        c.local_decisions.fetch_add(1, Ordering::Relaxed);
        c.units_spent.fetch_add(l.units, Ordering::Relaxed);
    }

    /// After Redis answered a call with leased parts: installs the leases taken, puts local
    /// units back if the call was refused or failed, and folds the decisions.
    fn finish(
        &self,
        taken: Result<Taken, StoreError>,
        locals: SmallVec<[Local; 2]>,
        fetches: SmallVec<[Fetch; 2]>,
        alone: bool,
    ) -> Result<Decision, StoreError> {
        let taken = match taken {
            Ok(t) => t,
            Err(e) => {
                self.put_back(&locals);
                let ended = Ended::of(&e, alone);
                for f in &fetches {
                    self.install(f, None, 0, ended.clone());
                }
                return Err(e);
            }
        };
        let admitted = taken.decision.allowed();
        if !admitted {
            self.put_back(&locals);
        }
        let mut decisions: SmallVec<[(Decision, u64); 4]> = SmallVec::new();
        for l in &locals {
            if admitted {
                self.counted_local(l);
            }
            decisions.push((l.decision, l.units));
        }
        let mut answered: SmallVec<[usize; 2]> = SmallVec::new();
        for item in taken.items {
            let mut d = item.decision;
            if let Some(f) = fetches.iter().find(|f| f.index == item.index) {
                answered.push(f.index);
                let extra = item.granted.saturating_sub(f.cost);
                if admitted && extra > 0 {
                    // The request's own view: what is left besides its cost.
                    d = Decision::from_nanos(
                        true,
                        d.limit(),
                        d.remaining().saturating_add(extra).min(d.limit()),
                        u64::try_from(d.reset_after().as_nanos()).unwrap_or(u64::MAX),
                        0,
                    )
                    .with_index(d.index());
                }
                self.install(
                    f,
                    Some((&item, taken.sent, admitted)),
                    extra,
                    Ended::Answered,
                );
            }
            decisions.push((d, item.cost));
        }
        // A fetch without an answer (the deny cache answered) takes nothing.
        for f in fetches.iter().filter(|f| !answered.contains(&f.index)) {
            self.install(f, None, 0, Ended::Answered);
        }
        if !admitted {
            return Ok(taken.decision);
        }
        // In the order of the checks, folded as the other stores fold them.
        decisions.sort_by_key(|(d, _)| d.index());
        let decision = decisions
            .into_iter()
            .reduce(crate::decision::tighter)
            .map_or(taken.decision, |(d, _)| d);
        // The call reached Redis and got its answer: a sign of its health whichever check
        // turned out the tighter (a local one is marked as answered without the backend).
        Ok(if taken.decision.reached_backend() {
            reached_backend(decision)
        } else {
            decision
        })
    }

    /// Ends a fetch: installs `extra` units of `answer`'s lease (its item, when its call was
    /// sent, whether the call was admitted), or only clears the fetch when there is no answer.
    fn install(
        &self,
        f: &Fetch,
        answer: Option<(&TakenItem, u64, bool)>,
        extra: u64,
        ended: Ended,
    ) {
        if answer.is_some() && extra > 0 {
            // Taken out of Redis: spent, given back or dropped from here on.
            self.counters.leases.fetch_add(1, Ordering::Relaxed);
            self.counters
                .units_leased
                .fetch_add(extra, Ordering::Relaxed);
        }
        let mut table = self.shard(f.hash).lock();
        let entry = table.find_mut(f.hash, |e| e.id == f.entry);
        let Some(e) = entry else {
            drop(table);
            if let Some((item, _, _)) = answer {
                if let Some(ticket) = &item.ticket {
                    // The key is no longer tracked: give it all back.
                    self.returns.lock().push(Back {
                        id: 0,
                        ticket: ticket.clone(),
                        units: extra,
                    });
                }
            }
            return;
        };
        e.fetching = false;
        e.done.send_replace(ended);
        let Some((item, sent, admitted)) = answer else {
            return;
        };
        let d = item.decision;
        // A key admitted while another check of its stack was refused is not short, and its
        // answer counted a consumption that was refunded: it says nothing new.
        if admitted || !d.allowed() {
            e.as_of = Some(AsOf {
                remaining: d.remaining(),
                sent,
                reset_after: u64::try_from(d.reset_after().as_nanos()).unwrap_or(u64::MAX),
            });
            e.hold = e.shortage(&d, f.want, item.granted, &self.config);
            e.short_until = if e.hold > 0 {
                sent.saturating_add(e.hold)
            } else {
                0
            };
        }
        let Some(ticket) = item.ticket.clone() else {
            return;
        };
        // A window's count lands in a later window than the script's time only when the time
        // went backwards (an injected clock, a stepped Redis clock): then its reset is longer
        // than a window, and spending it now would admit in one window what another counted.
        let later_window = e.kind == Kind::Window && d.reset_after() > e.policy.window();
        if extra == 0 || later_window || self.closed.load(Ordering::Acquire) {
            // Under the shard's lock (shard, then returns, as everywhere): a flush that
            // locks this shard after the call ended finds the units in the returns.
            self.returns.lock().push(Back {
                id: 0,
                ticket,
                units: extra,
            });
            return;
        }
        let expires = match e.kind {
            Kind::Window => sent.saturating_add(e.as_of.map_or(0, |a| a.reset_after)),
            Kind::Bucket => sent.saturating_add(self.config.lifetime),
        };
        e.leases.push(Lease {
            id: self.ids.fetch_add(1, Ordering::Relaxed),
            units: extra,
            granted: extra,
            expires,
            ticket,
        });
    }
}
