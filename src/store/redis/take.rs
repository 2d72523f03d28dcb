//! Quota leases on the store's side: calls that consume more than their cost, and the
//! give-back of what a lease did not spend.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use fred::types::{Key, Value};
use smallvec::SmallVec;

use super::cross_slot::answer_within;
use super::scripts::eval;
use super::{Call, Inner, Prepared, RedisStore, Ticket, backend_error};
use crate::Decision;
use crate::clock::Clock;
use crate::store::{Check, StoreError};

/// Quota leases (see [`LeasedStore`]): calls that consume more than their cost, and the refund
/// of what a lease did not spend.
impl RedisStore {
    /// The clock this store times its calls with (the injected one in tests).
    pub(crate) fn local_clock(&self) -> &Arc<dyn Clock> {
        &self.inner.local
    }

    /// Decides `wanted` all or nothing, as [`RedisStore::check_all`] decides their checks,
    /// consuming for each up to its `want` where there is room for more than its cost (see
    /// take.lua). The future owns what it needs.
    ///
    /// The call runs in a task of its own (inside a runtime), so that its timeout stops the
    /// wait, not the call: what it took after its caller stopped waiting goes back, and a
    /// call whose answer never came is followed by a refund of its tokens on the same
    /// connection (it runs after the call if the call ran). What may stay consumed for lack
    /// of an answer is added to `in_doubt`.
    pub(crate) fn take(&self, wanted: &[Wanted<'_>], in_doubt: &Arc<AtomicU64>) -> TakeFuture {
        let prepared = self
            .inner
            .prepare_wanted(wanted.iter().copied(), Some(Arc::clone(in_doubt)));
        match prepared {
            Err(e) => Box::pin(std::future::ready(Err(e))),
            Ok(Prepared::Done(decision)) => {
                let sent = self.inner.local.now();
                Box::pin(std::future::ready(Ok(Taken {
                    decision,
                    sent,
                    items: SmallVec::new(),
                })))
            }
            Ok(Prepared::Ask(call)) => {
                let inner = Arc::clone(&self.inner);
                let first_slot = call.items[0].slot;
                let across = call.items.iter().any(|it| it.slot != first_slot);
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    // No runtime to finish it in the background: the caller's future is the
                    // call (dropped early, what Redis took for it stays consumed).
                    return Box::pin(async move { inner.take(&call, &|| false).await });
                };
                let in_doubt = Arc::clone(in_doubt);
                Box::pin(async move {
                    // Across slots, one of the bounded places (see `max_cross_slot_calls`).
                    let permit = if across {
                        Some(inner.cross_slot_permit()?)
                    } else {
                        None
                    };
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    let worker = RedisStore {
                        inner: Arc::clone(&inner),
                    };
                    runtime.spawn(async move {
                        let _permit = permit;
                        let r = worker.inner.take(&call, &|| tx.is_closed()).await;
                        if let Err(Ok(taken)) = tx.send(r) {
                            // The caller stopped waiting (across slots: in the last instant):
                            // its leases' units go back (the other checks' stay consumed).
                            let back: Vec<(Ticket, u64)> = taken
                                .items
                                .into_iter()
                                .filter_map(|it| Some((it.ticket?, it.granted)))
                                .collect();
                            if let Err((units, _)) = worker.give_back(back).await {
                                in_doubt.fetch_add(units, Ordering::Relaxed);
                            }
                        }
                    });
                    answer_within(inner.timeout, rx).await
                })
            }
        }
    }

    /// Gives back `unspent` units of each lease (0: a bucket only forgets its pending refund),
    /// one refund.lua call per key, all at once. On failure: the units of the keys whose call
    /// failed, and the first error.
    pub(crate) async fn give_back(
        &self,
        leases: Vec<(Ticket, u64)>,
    ) -> Result<(), (u64, StoreError)> {
        let inner = &self.inner;
        // Grouped by key in a map: a sweep can return thousands of leases at once.
        let mut by_key: std::collections::HashMap<Key, Vec<(Ticket, u64)>> =
            std::collections::HashMap::new();
        for (ticket, unspent) in leases {
            if unspent == 0 && !ticket.needs_settling() {
                continue;
            }
            by_key
                .entry(ticket.key.clone())
                .or_default()
                .push((ticket, unspent));
        }
        let calls = by_key.into_values().map(|group| async move {
            let build = || inner.refund_args(inner.now_args(), group.iter().cloned(), "refund");
            let units: u64 = group.iter().map(|(_, u)| *u).sum();
            eval::<Value>(&inner.backend, &inner.scripts.refund, build)
                .await
                .map_err(|e| (units, backend_error(&e, inner.timeout)))
        });
        let mut failed: Option<(u64, StoreError)> = None;
        for r in futures_util::future::join_all(calls).await {
            if let Err((units, e)) = r {
                failed = Some(match failed {
                    None => (units, e),
                    Some((n, first)) => (n.saturating_add(units), first),
                });
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

/// The future of [`RedisStore::take`].
pub(crate) type TakeFuture =
    Pin<Box<dyn Future<Output = Result<Taken, StoreError>> + Send + 'static>>;

/// One check of a call that may take a quota lease: the check, its index in the caller's
/// stack, and how much to consume if there is room (at least its cost; more to take a lease).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Wanted<'a> {
    pub(crate) check: Check<'a>,
    pub(crate) index: usize,
    pub(crate) want: u64,
}

/// What a lease-taking call answered.
#[derive(Debug)]
pub(crate) struct Taken {
    /// The verdict, as [`RedisStore::check_all`] would have answered it.
    pub(crate) decision: Decision,
    /// The local time at which the call was sent: the script ran no earlier.
    pub(crate) sent: u64,
    /// Each check's own answer, in the order asked (none when the deny cache answered).
    pub(crate) items: SmallVec<[TakenItem; 4]>,
}

/// One check's answer in a [`Taken`].
#[derive(Debug)]
pub(crate) struct TakenItem {
    pub(crate) index: usize,
    /// The check's cost.
    pub(crate) cost: u64,
    /// Its decision, for what it consumed (`granted` when admitted).
    pub(crate) decision: Decision,
    /// What it consumed: 0 unless the whole call was admitted.
    pub(crate) granted: u64,
    /// How to give back what a lease does not spend (a lease item that consumed something).
    pub(crate) ticket: Option<Ticket>,
}

impl Inner {
    /// A lease-taking call: the verdict, and each check's own answer with what it consumed
    /// and how to give a lease's unspent part back.
    async fn take(
        &self,
        call: &Call,
        gone: &(dyn Fn() -> bool + Sync),
    ) -> Result<Taken, StoreError> {
        let answers = self.answers(call, gone).await?;
        let decision = self.verdict(call, answers.iter().map(|(g, a)| (a, g.items.clone())));
        let mut items: SmallVec<[TakenItem; 4]> = SmallVec::new();
        for (group, answer) in &answers {
            for ((it, token), a) in group.items.iter().zip(&group.tokens).zip(&answer.decisions) {
                let consumed = answer.admitted && a.granted > 0;
                let ticket = (it.leasing() && consumed).then(|| Ticket {
                    key: it.key.clone(),
                    algorithm: it.algorithm,
                    limit: it.limit,
                    period: it.period,
                    horizon: it.horizon,
                    token: token.clone(),
                    ref_b: a.ref_b,
                    ref_t: a.ref_t,
                });
                items.push(TakenItem {
                    index: it.index,
                    cost: it.cost,
                    decision: a.decision,
                    granted: if answer.admitted { a.granted } else { 0 },
                    ticket,
                });
            }
        }
        // Cross-slot: one slot may have admitted while another rejected; what it consumed
        // was refunded, so nothing was granted anywhere.
        if !decision.allowed() {
            for item in &mut items {
                item.granted = 0;
                item.ticket = None;
            }
        }
        Ok(Taken {
            decision,
            sent: call.sent,
            items,
        })
    }
}
