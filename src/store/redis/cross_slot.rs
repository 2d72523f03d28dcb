//! Stacked checks across Cluster slots: one script call per slot at once, then refunds on the
//! slots that consumed when another rejected (or settles when all admitted).

use std::sync::atomic::Ordering;
use std::time::Duration;

use fred::types::Value;
use smallvec::SmallVec;

use super::refund::refund_of;
use super::scripts::eval;
use super::{Answer, Call, Group, Inner, Item};
use crate::store::StoreError;

/// The answer of a call that runs in a task of its own, if it comes within `timeout`. Past
/// it, the channel is closed first: an answer sent in the same instant is taken rather than
/// dropped unseen, and any later one fails to send, so the task knows nobody took it (and
/// gives back what it consumed).
pub(super) async fn answer_within<T>(
    timeout: Duration,
    mut rx: tokio::sync::oneshot::Receiver<Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(timeout, &mut rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(StoreError::Backend(
            "the call's task ended without an answer".into(),
        )),
        Err(_) => {
            rx.close();
            rx.try_recv().unwrap_or(Err(StoreError::Timeout(timeout)))
        }
    }
}

impl Inner {
    /// The items grouped by slot, in the order `consume_across_slots` answers them (one group
    /// when all share a slot).
    fn slot_groups(call: &Call) -> Vec<SmallVec<[&Item; 4]>> {
        let mut slots: SmallVec<[u16; 4]> = call.items.iter().map(|it| it.slot).collect();
        slots.sort_unstable();
        slots.dedup();
        slots
            .iter()
            .map(|&s| call.items.iter().filter(|it| it.slot == s).collect())
            .collect()
    }

    pub(super) async fn consume_across_slots<'c>(
        &self,
        call: &'c Call,
        gone: &(dyn Fn() -> bool + Sync),
    ) -> Result<Vec<(Group<'c>, Answer)>, StoreError> {
        let groups: Vec<Group<'_>> = Self::slot_groups(call)
            .into_iter()
            .map(|items| Group {
                tokens: self.tokens(&items, true),
                items,
            })
            .collect();
        let results =
            futures_util::future::join_all(groups.iter().map(|g| self.consume(call, g))).await;
        let all_admitted = results.iter().all(|r| matches!(r, Ok(a) if a.admitted));
        let gone = all_admitted && gone();
        if all_admitted && !gone {
            // Nothing to take back: let the buckets forget the pending refunds, off the
            // caller's path (but not those of leases: their unspent part comes back later).
            for (g, r) in groups.iter().zip(&results) {
                if let Ok(a) = r {
                    let settled = g
                        .items
                        .iter()
                        .zip(&g.tokens)
                        .zip(&a.decisions)
                        .filter(|((it, t), _)| !t.is_empty() && !it.leasing());
                    let (keys, args) = self.refund_args(
                        self.time_args(call),
                        settled.map(|((it, t), a)| (refund_of(it, t, a), a.granted)),
                        "settle",
                    );
                    if !keys.is_empty() {
                        let (backend, lua) = (self.backend.clone(), self.scripts.refund.clone());
                        tokio::spawn(async move {
                            let build = || (keys.clone(), args.clone());
                            let _ = eval::<Value>(&backend, &lua, build).await;
                        });
                    }
                }
            }
        } else {
            // Take back what the slots that admitted consumed.
            let refunds = groups.iter().zip(&results).filter_map(|(g, r)| match r {
                Ok(a) if a.admitted => Some(async move {
                    let refund = eval::<Value>(&self.backend, &self.scripts.refund, || {
                        let consumed = g.items.iter().zip(&g.tokens).zip(&a.decisions);
                        self.refund_args(
                            self.time_args(call),
                            consumed.map(|((it, t), a)| (refund_of(it, t, a), a.granted)),
                            "refund",
                        )
                    });
                    if refund.await.is_err() {
                        // What this slot's leases took stays consumed: counted.
                        if let Some(in_doubt) = &call.in_doubt {
                            let leased: u64 = g
                                .items
                                .iter()
                                .zip(&a.decisions)
                                .filter(|(it, _)| it.leasing())
                                .map(|(_, a)| a.granted)
                                .sum();
                            in_doubt.fetch_add(leased, Ordering::Relaxed);
                        }
                    }
                }),
                _ => None,
            });
            futures_util::future::join_all(refunds).await;
            if gone {
                // Admitted everywhere, but nobody waits for it any more: all went back.
                return Err(StoreError::Timeout(self.timeout));
            }
        }
        groups
            .into_iter()
            .zip(results)
            .map(|(g, r)| r.map(|a| (g, a)))
            .collect()
    }
}
