//! The lease policy: which algorithms lease, when a key is hot (the demand sketch), how large
//! its next lease is, and how long a short key refuses locally.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::ledger::Entry;
use super::{SKETCH_COUNT_BITS, SKETCH_COUNT_MAX};
use crate::{Algorithm, Decision};

/// How an algorithm leases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// Spent inside the window it came from.
    Window,
    /// Spent within the lease lifetime L.
    Bucket,
}

pub(super) fn kind(algorithm: Algorithm) -> Option<Kind> {
    match algorithm {
        Algorithm::FixedWindow => Some(Kind::Window),
        Algorithm::TokenBucket | Algorithm::LeakyBucket | Algorithm::Gcra => Some(Kind::Bucket),
        _ => None,
    }
}

/// Adds `cost` to a demand counter for `span` (a counter of an older span starts over): the
/// count in this span. The span's low 40 bits tag the count.
pub(super) fn sketch_add(slot: &AtomicU64, span: u64, cost: u64) -> u64 {
    let tag = span & ((1 << (64 - SKETCH_COUNT_BITS)) - 1);
    let mut count = 0;
    let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        let before = if v >> SKETCH_COUNT_BITS == tag {
            v & SKETCH_COUNT_MAX
        } else {
            0
        };
        count = before.saturating_add(cost).min(SKETCH_COUNT_MAX);
        Some((tag << SKETCH_COUNT_BITS) | count)
    });
    count
}

pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The configuration, in nanoseconds.
#[derive(Clone, Copy, Debug)]
pub(super) struct Config {
    pub(super) span: u64,
    pub(super) lifetime: u64,
    pub(super) share_percent: u64,
    pub(super) hot: u64,
    pub(super) idle: u64,
    pub(super) per_shard: usize,
}

impl Entry {
    /// The wait a local refusal of `cost` at `now` reports: at least `hold`, and at least
    /// until `cost` fits by what Redis said last, so that a client comes back when Redis
    /// would admit it (not merely when the next lease call may go out).
    pub(super) fn retry(&self, now: u64, cost: u64, hold: u64) -> u64 {
        hold.max(self.fits_at(cost).saturating_sub(now))
    }

    /// When a check of `cost` fits by Redis' answer to the last lease call (local ns; 0: it
    /// fitted then). A window: when it ends, if fewer than `cost` units were left. A bucket:
    /// its `reset_after` is the time until it is full, so `cost` fits once all but
    /// `limit - cost` units have come back (the same wait the Redis store reports).
    fn fits_at(&self, cost: u64) -> u64 {
        let Some(a) = self.as_of else {
            return 0;
        };
        if a.remaining >= cost {
            return 0;
        }
        let full = a.sent.saturating_add(a.reset_after);
        match self.kind {
            Kind::Window => full,
            Kind::Bucket => {
                let spare = u128::from(self.policy.limit().saturating_sub(cost))
                    * u128::from(self.policy.period_nanos());
                full.saturating_sub(u64::try_from(spare).unwrap_or(u64::MAX))
            }
        }
    }

    /// After a lease call that asked for `want` and consumed `granted` (its decision `d`):
    /// whether the key is short, and for how long to refuse locally what leases do not cover.
    pub(super) fn shortage(&self, d: &Decision, want: u64, granted: u64, config: &Config) -> u64 {
        let ns = |t: Duration| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX);
        let hold = match (self.kind, d.retry_after()) {
            // Refused: nothing of this cost fits before its retry time.
            (_, Some(retry)) => ns(retry),
            // A window with nothing left: until it ends.
            (Kind::Window, None) if d.remaining() == 0 => ns(d.reset_after()),
            (Kind::Window, None) => 0,
            // A bucket that had less than asked for: until the missing part has refilled, at
            // most a lease lifetime.
            (Kind::Bucket, None) => want
                .saturating_sub(granted)
                .saturating_mul(self.policy.period_nanos())
                .min(config.lifetime),
        };
        hold.min(config.span.max(config.lifetime))
    }

    /// The size of the next lease for a request of `cost` at `now` (`cost` itself: no lease).
    pub(super) fn want(&self, now: u64, cost: u64, config: &Config) -> u64 {
        let limit = self.policy.limit();
        let demand = u128::from(self.demand.max(self.last_demand).max(cost));
        let horizon = match self.kind {
            Kind::Window => config.span,
            Kind::Bucket => config.lifetime / 2,
        };
        let by_demand = (demand * u128::from(horizon)).div_ceil(u128::from(config.span.max(1)));
        let by_share = (u128::from(limit) * u128::from(config.share_percent) / 100).max(1);
        let left = match self.as_of {
            None => u128::from(limit),
            Some(a) => match self.kind {
                Kind::Window if now >= a.sent.saturating_add(a.reset_after) => u128::from(limit),
                Kind::Window => u128::from(a.remaining),
                Kind::Bucket => {
                    let refilled = now.saturating_sub(a.sent) / self.policy.period_nanos().max(1);
                    u128::from(a.remaining.saturating_add(refilled).min(limit))
                }
            },
        };
        let by_left = (left / 2).max(1);
        let k = by_demand.min(by_share).min(by_left);
        u64::try_from(k).unwrap_or(u64::MAX).max(cost)
    }

    /// Whether to take the next lease now: half of what is held is spent.
    pub(super) fn low(&self, granted: u64) -> bool {
        self.held() <= granted / 2
    }
}
