//! A call's checks: validated, merged and named (`prepare`), decided by one script call per
//! hash slot (check.lua, or take.lua for leases), and folded into one verdict.

use std::fmt::Write as _;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use fred::bytes::Bytes;
use fred::clients::Client;
use fred::types::{Key, Value};
use smallvec::SmallVec;

use super::cross_slot::answer_within;
use super::refund::blind_refund_of;
use super::scripts::{eval_on, eval_traced, may_have_run, static_str};
use super::{
    Answer, Answered, Call, Group, Inner, Item, Prepared, RedisError, Wanted, backend_error,
    horizon, supports,
};
use crate::Decision;
use crate::store::{Check, NOTHING_TO_CHECK, StoreError};

impl Inner {
    pub(super) fn prepare(&self, checks: &[Check<'_>]) -> Result<Prepared, StoreError> {
        self.prepare_wanted(
            checks.iter().enumerate().map(|(index, check)| Wanted {
                check: *check,
                index,
                want: check.cost(),
            }),
            None,
        )
    }

    /// The call of `checks`: a lease-taking one (take.lua) with `in_doubt`, where it counts
    /// the units Redis may hold for it unknown to its caller.
    pub(super) fn prepare_wanted<'c>(
        &self,
        checks: impl ExactSizeIterator<Item = Wanted<'c>>,
        in_doubt: Option<Arc<AtomicU64>>,
    ) -> Result<Prepared, StoreError> {
        let take = in_doubt.is_some();
        if checks.len() == 0 {
            return Ok(Prepared::Done(NOTHING_TO_CHECK.without_backend()));
        }
        let mut merged: SmallVec<[(Check<'_>, usize, u64); 4]> = SmallVec::new();
        for Wanted { check, index, want } in checks {
            check.validate(index, self.max_key_len)?;
            supports(check.policy(), index).map_err(|e| StoreError::Unsupported {
                index,
                reason: e.to_string(),
            })?;
            // The same (key, policy) twice in one stack is one check of the summed cost.
            match merged
                .iter_mut()
                .find(|(c, _, _)| c.policy().id() == check.policy().id() && c.key() == check.key())
            {
                Some((c, _, w)) => {
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
                    *w = w.saturating_add(want);
                }
                None => merged.push((check, index, want)),
            }
        }
        let local_now = self.local.now();
        let mut items = SmallVec::new();
        for (check, index, want) in merged {
            let key = self
                .names
                .placed_name(check.key(), check.placement(), check.policy());
            let deny_hash = match &self.deny {
                Some(_) => self.deny_hasher.hash_one(&key),
                None => 0,
            };
            if let Some(deny) = &self.deny {
                if let Some(d) = deny.get(deny_hash, check.cost(), local_now) {
                    return Ok(Prepared::Done(d.with_index(index)));
                }
            }
            let policy = check.policy();
            items.push(Item {
                slot: if self.clustered {
                    fred::util::redis_keyslot(key.as_bytes())
                } else {
                    0
                },
                key: Key::from(key),
                algorithm: policy.algorithm().as_str(),
                limit: policy.limit(),
                period: policy.period_nanos(),
                cost: check.cost(),
                want: want.clamp(check.cost(), policy.limit()),
                // Bounded by MAX_HORIZON, checked above.
                horizon: u64::try_from(horizon(policy)).unwrap_or(u64::MAX),
                index,
                deny_hash,
            });
        }
        let time = self.injected.as_ref().map(|c| {
            let now = c.now();
            (now / 1_000_000_000, now % 1_000_000_000)
        });
        Ok(Prepared::Ask(Box::new(Call {
            items,
            time,
            sent: local_now,
            take,
            in_doubt,
        })))
    }

    pub(super) async fn run(self: Arc<Self>, call: Box<Call>) -> Result<Decision, StoreError> {
        let first_slot = call.items[0].slot;
        if call.items.iter().all(|it| it.slot == first_slot) {
            // One command: the client's own command timeout (set to ours) bounds it, and
            // drops the command if it is still queued (while reconnecting, say).
            return self.decide(&call).await;
        }
        // Across slots: the call runs in a task of its own, so that a timeout stops the wait,
        // not the call: its refunds still run when a slot fails, and if it was admitted after
        // its caller stopped waiting, what it consumed goes back.
        let permit = self.cross_slot_permit()?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let inner = Arc::clone(&self);
        tokio::spawn(async move {
            let _permit = permit;
            let r = async {
                let answers = inner.answers(&call, &|| tx.is_closed()).await?;
                Ok(inner.verdict(&call, answers.iter().map(|(g, a)| (a, g.items.clone()))))
            }
            .await;
            let _ = tx.send(r);
        });
        answer_within(self.timeout, rx).await
    }

    /// A place for one more call across slots, or the error of a call past the bound.
    pub(super) fn cross_slot_permit(
        &self,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, StoreError> {
        Arc::clone(&self.cross_slot)
            .try_acquire_owned()
            .map_err(|_| {
                StoreError::Busy(format!(
                    "too many calls across slots in flight (at most {})",
                    self.max_cross_slot
                ))
            })
    }

    /// The first three script arguments of a call made now.
    pub(super) fn now_args(&self) -> [Value; 3] {
        let time = self.injected.as_ref().map(|c| {
            let now = c.now();
            (now / 1_000_000_000, now % 1_000_000_000)
        });
        self.time_args_at(time)
    }

    /// The first three script arguments: the time (injected, or empty for Redis `TIME`) and
    /// the TTL slack.
    pub(super) fn time_args(&self, call: &Call) -> [Value; 3] {
        self.time_args_at(call.time)
    }

    fn time_args_at(&self, time: Option<(u64, u64)>) -> [Value; 3] {
        let slack = Value::String(self.slack_arg.clone());
        match time {
            Some((s, n)) => [
                Value::from(s.to_string()),
                Value::from(n.to_string()),
                slack,
            ],
            None => [static_str(""), static_str("0"), slack],
        }
    }

    async fn decide(&self, call: &Call) -> Result<Decision, StoreError> {
        let answers = self.answers(call, &|| false).await?;
        Ok(self.verdict(call, answers.iter().map(|(g, a)| (a, g.items.clone()))))
    }

    /// Runs the call's scripts: one per slot, and the cross-slot protocol when there are
    /// several. The groups come in the order of [`Inner::slot_groups`].
    /// `gone`: whether the caller stopped waiting (across slots, a call admitted everywhere
    /// is then taken back).
    pub(super) async fn answers<'c>(
        &self,
        call: &'c Call,
        gone: &(dyn Fn() -> bool + Sync),
    ) -> Result<Vec<(Group<'c>, Answer)>, StoreError> {
        let first_slot = call.items[0].slot;
        if call.items.iter().all(|it| it.slot == first_slot) {
            let items: SmallVec<[&Item; 4]> = call.items.iter().collect();
            let group = Group {
                tokens: self.tokens(&items, false),
                items,
            };
            let answer = self.consume(call, &group).await?;
            return Ok(vec![(group, answer)]);
        }
        self.consume_across_slots(call, gone).await
    }

    /// The refund tokens of a group's items, for calls across slots or taking leases: every
    /// algorithm but the sliding log needs one to be refunded (a lease's unspent part, or a
    /// slot's consumption when another slot rejects), and the refund takes back only what the
    /// token's own consumption recorded. An admitted call then settles its tokens, one
    /// fire-and-forget script call (for a fixed window too, which used to need none).
    pub(super) fn tokens(&self, items: &[&Item], across_slots: bool) -> SmallVec<[String; 4]> {
        items
            .iter()
            .map(|it| match it.algorithm {
                "token_bucket" | "leaky_bucket" | "gcra" | "fixed_window" | "sliding_window"
                    if across_slots || it.leasing() =>
                {
                    format!(
                        "{:x}.{:x}",
                        self.instance,
                        self.tokens.fetch_add(1, Ordering::Relaxed)
                    )
                }
                _ => String::new(),
            })
            .collect()
    }

    /// The most restrictive decision of all the answers; rejections go to the deny cache.
    pub(super) fn verdict<'a, 'b>(
        &self,
        call: &Call,
        answers: impl IntoIterator<Item = (&'b Answer, SmallVec<[&'a Item; 4]>)>,
    ) -> Decision {
        let now = self.local.now();
        let mut decisions: SmallVec<[(Decision, u64); 4]> = SmallVec::new();
        for (answer, items) in answers {
            for (a, item) in answer.decisions.iter().zip(items) {
                let d = a.decision;
                if !d.allowed() {
                    if let Some(deny) = &self.deny {
                        deny.insert(item.deny_hash, item.cost, call.sent, now, d);
                    }
                }
                decisions.push((d, item.cost));
            }
        }
        // In the order of the checks, as the in-process store folds them (ties keep the first).
        decisions.sort_by_key(|(d, _)| d.index());
        decisions
            .into_iter()
            .reduce(crate::decision::tighter)
            .map_or(NOTHING_TO_CHECK, |(d, _)| d)
    }

    /// After a call on `group` that may have run without its answer coming back: takes back
    /// by token whatever it consumed, on the connection it went to (so that the refund runs
    /// after the call if the call ran at all, and finds nothing to take if it did not), in
    /// the background: the refunds of the call's other slots do not wait for it. Only items
    /// with a refund token can be taken back (across slots, or leasing; a sliding log's never
    /// leases). If the refund fails too, a lease-taking call counts what its leases asked for
    /// as in doubt.
    fn refund_in_doubt(&self, call: &Call, group: &Group<'_>, client: Client) {
        let tokened = || {
            group
                .items
                .iter()
                .zip(&group.tokens)
                .filter(|(_, token)| !token.is_empty())
        };
        if tokened().next().is_none() {
            return;
        }
        let (keys, args) = self.refund_args(
            self.now_args(),
            tokened().map(|(it, token)| (blind_refund_of(it, token), it.want)),
            "refund",
        );
        let leased: u64 = tokened()
            .filter(|(it, _)| it.leasing())
            .map(|(it, _)| it.want)
            .sum();
        let in_doubt = call.in_doubt.clone();
        let lua = self.scripts.refund.clone();
        let refund = async move {
            let build = || (keys.clone(), args.clone());
            if eval_on::<Value, _>(&client, &lua, build).await.is_err() {
                if let Some(in_doubt) = in_doubt {
                    in_doubt.fetch_add(leased, Ordering::Relaxed);
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(refund);
            }
            Err(_) => {
                // Nowhere to send it: counted.
                if let Some(in_doubt) = &call.in_doubt {
                    in_doubt.fetch_add(leased, Ordering::Relaxed);
                }
            }
        }
    }

    pub(super) async fn consume(
        &self,
        call: &Call,
        group: &Group<'_>,
    ) -> Result<Answer, StoreError> {
        // take.lua has one more argument per check (want), and one more value per answer.
        let (stride, lua) = if call.take {
            (7, &self.scripts.take)
        } else {
            (6, self.scripts.check(&group.items))
        };
        // The numbers of every check in one buffer, handed out as slices of it.
        let mut digits = String::with_capacity(64 * group.items.len());
        let mut ends: SmallVec<[usize; 20]> = SmallVec::new();
        let per_item = if call.take { 5 } else { 4 };
        for it in &group.items {
            for n in [it.limit, it.period, it.cost, it.horizon, it.want]
                .into_iter()
                .take(per_item)
            {
                let _ = write!(digits, "{n}");
                ends.push(digits.len());
            }
        }
        let digits = Bytes::from(digits);
        let build = || {
            let keys: Vec<Key> = group.items.iter().map(|it| it.key.clone()).collect();
            let mut args: Vec<Value> = Vec::with_capacity(3 + stride * group.items.len());
            args.extend(self.time_args(call));
            for (i, (it, token)) in group.items.iter().zip(&group.tokens).enumerate() {
                let number = |k: usize| {
                    let at = per_item * i + k;
                    let start = if at == 0 { 0 } else { ends[at - 1] };
                    Value::Bytes(digits.slice(start..ends[at]))
                };
                args.push(static_str(it.algorithm));
                for k in 0..4 {
                    args.push(number(k));
                }
                args.push(if token.is_empty() {
                    static_str("")
                } else {
                    Value::from(token.as_str())
                });
                if call.take {
                    args.push(number(4));
                }
            }
            (keys, args)
        };
        let out = match eval_traced::<Vec<i64>>(&self.backend, lua, build).await {
            (Ok(out), _) => out,
            (Err(e), client) => {
                if let (true, Some(client)) = (may_have_run(&e), client) {
                    self.refund_in_doubt(call, group, client);
                }
                return Err(backend_error(&e, self.timeout));
            }
        };
        if out.len() != 1 + stride * group.items.len() {
            return Err(StoreError::Backend(Box::new(RedisError {
                message: format!("unexpected script answer of {} values", out.len()),
            })));
        }
        let decisions = group
            .items
            .iter()
            .zip(out[1..].chunks_exact(stride))
            .map(|(it, v)| {
                let n = |x: i64| u64::try_from(x).unwrap_or(0);
                let decision = Decision::from_nanos(v[0] == 1, it.limit, n(v[1]), n(v[2]), n(v[3]))
                    .with_index(it.index);
                Answered {
                    decision,
                    ref_b: v[4],
                    ref_t: v[5],
                    granted: if call.take { n(v[6]) } else { it.cost },
                }
            })
            .collect();
        Ok(Answer {
            admitted: out[0] == 1,
            decisions,
        })
    }
}
