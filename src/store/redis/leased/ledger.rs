//! The local ledger: a hot key's entry, the leases it holds, its demand, and spending from
//! them.

use smallvec::SmallVec;

use super::decide::{Ended, Parts};
use super::give_back::Back;
use super::policy::Kind;
use crate::Decision;
use crate::Policy;
use crate::store::Check;
use crate::store::redis::Ticket;

/// Redis' view of the key as of this instance's newest call on it.
#[derive(Clone, Copy, Debug)]
pub(super) struct AsOf {
    /// What was left after that call.
    pub(super) remaining: u64,
    /// When the call was sent (local ns).
    pub(super) sent: u64,
    /// Time from the script's run until the key's state fully recovers (ns); a window's end.
    pub(super) reset_after: u64,
}

pub(super) struct Lease {
    pub(super) id: u64,
    /// Units left to spend.
    pub(super) units: u64,
    /// Units it came with.
    pub(super) granted: u64,
    /// Local time (ns) from which it may no longer be spent.
    pub(super) expires: u64,
    pub(super) ticket: Ticket,
}

/// A hot (key, policy) of this instance.
pub(super) struct Entry {
    pub(super) hash: u64,
    pub(super) id: u64,
    pub(super) key: Box<str>,
    pub(super) placement_len: usize,
    pub(super) policy: Policy,
    pub(super) kind: Kind,
    /// Oldest first (the first to expire).
    pub(super) leases: SmallVec<[Lease; 2]>,
    /// A lease call is in flight, sent at `fetch_sent` (local ns); `done` is told when it ends.
    pub(super) fetching: bool,
    pub(super) fetch_sent: u64,
    pub(super) done: tokio::sync::watch::Sender<Ended>,
    /// The span being counted, its demand so far, and the previous span's.
    pub(super) span: u64,
    pub(super) demand: u64,
    pub(super) last_demand: u64,
    /// When a check last asked for this key.
    pub(super) used_at: u64,
    pub(super) as_of: Option<AsOf>,
    /// The key is short (its last lease call got less than it asked for): until this local
    /// time, checks the leases cannot cover are refused here (0: not short).
    pub(super) short_until: u64,
    /// How long that refusal was (the wait a refusal reports while the next call is out).
    pub(super) hold: u64,
}

impl Entry {
    pub(super) fn matches(&self, check: &Check<'_>) -> bool {
        self.policy.id() == check.policy().id()
            && self.placement_len == check.placement().len()
            && *self.key == *check.key()
    }

    /// Counts `cost` units of demand at `now`.
    pub(super) fn note(&mut self, now: u64, cost: u64, span_ns: u64) {
        let span = now / span_ns;
        if span != self.span {
            self.last_demand = if span == self.span.wrapping_add(1) {
                self.demand
            } else {
                0
            };
            self.span = span;
            self.demand = 0;
        }
        self.demand = self.demand.saturating_add(cost);
        self.used_at = now;
    }

    /// Units held, unspent.
    pub(super) fn held(&self) -> u64 {
        self.leases.iter().map(|l| l.units).sum()
    }

    /// Moves the leases expired at `now` to `out`.
    pub(super) fn expire(&mut self, now: u64, out: &mut Vec<Back>) {
        let mut i = 0;
        while i < self.leases.len() {
            if now >= self.leases[i].expires {
                let l = self.leases.remove(i);
                out.push(Back::from(l));
            } else {
                i += 1;
            }
        }
    }

    /// Spends `cost` from the live leases, oldest first, if they hold it: the units taken
    /// from each (lease id, units). A lease emptied goes to `out` (a bucket still has to
    /// forget its pending refund).
    pub(super) fn spend(&mut self, cost: u64, out: &mut Vec<Back>) -> Option<Parts> {
        if self.held() < cost {
            return None;
        }
        let mut parts = Parts::new();
        let mut left = cost;
        for lease in &mut self.leases {
            let take = lease.units.min(left);
            if take > 0 {
                lease.units -= take;
                left -= take;
                parts.push((lease.id, take));
            }
            if left == 0 {
                break;
            }
        }
        let mut i = 0;
        while i < self.leases.len() {
            if self.leases[i].units == 0 {
                out.push(Back::from(self.leases.remove(i)));
            } else {
                i += 1;
            }
        }
        Some(parts)
    }

    /// A decision from the leases, for the check at `index`: admitted, or refused with
    /// `retry` (ns).
    pub(super) fn decision(&self, now: u64, index: usize, retry: Option<u64>) -> Decision {
        let limit = self.policy.limit();
        let (remaining, reset) = match self.as_of {
            Some(a) => (
                a.remaining.saturating_add(self.held()).min(limit),
                a.reset_after.saturating_sub(now.saturating_sub(a.sent)),
            ),
            None => (self.held().min(limit), 0),
        };
        Decision::from_nanos(retry.is_none(), limit, remaining, reset, retry.unwrap_or(0))
            .with_index(index)
            .without_backend()
    }
}
