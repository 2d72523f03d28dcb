//! The give-back path: leases expired, emptied or idle go back to Redis (sweeps, flush, drop),
//! and units of a refused stack are put back into their leases.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::decide::Local;
use super::ledger::Lease;
use super::{LeasedStore, Shared};
use crate::store::StoreError;
use crate::store::redis::Ticket;

/// A lease (or what is left of it) on its way back to Redis.
pub(super) struct Back {
    /// The lease's id: units put back after it left its entry still find it here.
    pub(super) id: u64,
    pub(super) ticket: Ticket,
    pub(super) units: u64,
}

impl From<Lease> for Back {
    fn from(l: Lease) -> Self {
        Back {
            id: l.id,
            ticket: l.ticket,
            units: l.units,
        }
    }
}

/// Gives back expired and idle leases every `every` (twenty times less often while no key
/// is hot), until the store is dropped.
pub(super) async fn sweeper(store: Weak<Shared>, every: Duration) {
    let mut pause = every;
    loop {
        tokio::time::sleep(pause).await;
        let Some(shared) = store.upgrade() else {
            return;
        };
        // One lock at a time: elsewhere a shard is locked before the returns (put_back).
        let nothing_back = shared.returns.lock().is_empty();
        let idle = nothing_back && shared.shards.iter().all(|s| s.lock().is_empty());
        pause = if idle {
            every.saturating_mul(20)
        } else {
            every
        };
        let _ = LeasedStore { shared }.sweep().await;
    }
}

impl Shared {
    /// Starts the background sweep, if there is one, it has not started yet, and this runs
    /// inside a tokio runtime.
    pub(super) fn start_sweeper(self: &Arc<Self>) {
        let Some(every) = self.sweep_every else {
            return;
        };
        if self.sweeper_started.load(Ordering::Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !self.sweeper_started.swap(true, Ordering::AcqRel) {
            runtime.spawn(sweeper(Arc::downgrade(self), every));
        }
    }

    /// Leases expired or emptied, for the next sweep to give back.
    pub(super) fn publish(&self, returns: &mut Vec<Back>) {
        if !returns.is_empty() {
            self.returns.lock().append(returns);
        }
    }

    /// Puts units taken from leases back (their call was refused or failed).
    pub(super) fn put_back(&self, locals: &[Local]) {
        self.put_back_with(locals, &mut Vec::new());
    }

    /// [`Shared::put_back`], looking for leases that left their entry in `unpublished` (not
    /// yet among the returns) first.
    pub(super) fn put_back_with(&self, locals: &[Local], unpublished: &mut [Back]) {
        for l in locals {
            let mut table = self.shard(l.hash).lock();
            for &(id, units) in &l.parts {
                let lease = table
                    .find_mut(l.hash, |e| e.leases.iter().any(|x| x.id == id))
                    .and_then(|e| e.leases.iter_mut().find(|x| x.id == id));
                match lease {
                    Some(lease) => lease.units = lease.units.saturating_add(units),
                    None => {
                        // Its lease left the entry (spent to the last unit, or expired): if it
                        // has not gone back yet, the units go back with it.
                        if let Some(b) = unpublished.iter_mut().find(|b| b.id == id) {
                            b.units = b.units.saturating_add(units);
                            continue;
                        }
                        let mut returns = self.returns.lock();
                        match returns.iter_mut().find(|b| b.id == id) {
                            Some(b) => b.units = b.units.saturating_add(units),
                            None => {
                                self.counters
                                    .units_dropped
                                    .fetch_add(units, Ordering::Relaxed);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The leases to give back: expired ones and those of idle keys, or all with `all`.
    pub(super) fn collect(&self, all: bool) -> Vec<Back> {
        let now = self.clock.now();
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let mut table = shard.lock();
            table.retain(|e| {
                let idle = now.saturating_sub(e.used_at) >= self.config.idle;
                if all || idle {
                    out.extend(e.leases.drain(..).map(Back::from));
                } else {
                    e.expire(now, &mut out);
                }
                // An entry with a call in flight stays, so that its lease finds it.
                e.fetching || !(all || idle)
            });
        }
        // Last: what a lease call that ended while the shards were read left here.
        out.append(&mut self.returns.lock());
        out
    }

    pub(super) async fn give_back(&self, returns: Vec<Back>) -> Result<(), StoreError> {
        if returns.is_empty() {
            return Ok(());
        }
        let units: u64 = returns.iter().map(|b| b.units).sum();
        let r = self
            .redis
            .give_back(returns.into_iter().map(|b| (b.ticket, b.units)).collect())
            .await;
        let (failed, r) = match r {
            Ok(()) => (0, Ok(())),
            Err((failed, e)) => (failed.min(units), Err(e)),
        };
        let c = &self.counters;
        c.units_returned
            .fetch_add(units - failed, Ordering::Relaxed);
        c.units_dropped.fetch_add(failed, Ordering::Relaxed);
        r
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The last clone is gone: give back what the leases hold, in the background, if there
        // is still a runtime to do it on.
        let mut out = std::mem::take(&mut *self.returns.lock());
        for shard in self.shards.iter() {
            for e in shard.lock().iter_mut() {
                out.extend(e.leases.drain(..).map(Back::from));
            }
        }
        if out.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let redis = self.redis.clone();
            let out = out.into_iter().map(|b| (b.ticket, b.units)).collect();
            runtime.spawn(async move {
                let _ = redis.give_back(out).await;
            });
        }
    }
}
