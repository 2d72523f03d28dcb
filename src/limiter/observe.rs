//! After the store answered: which policy decided, the status, the metrics and the shadow
//! rules' rejections.

use std::sync::Arc;

use super::build::Limiter;
use super::compiled::{CompiledRule, PolicySet};
use super::plan::{Applied, Costly, NoKey};
use crate::answer::StatusField;
use crate::store::Store;
use crate::telemetry::{DecisionSpan, METRICS};
use crate::{Decision, Policy, StoreError};

impl<St: Store> Limiter<St> {
    /// [`Limiter::observe`] for the one policy of a `single` limiter.
    #[inline(always)]
    pub(crate) fn observe_single(
        &self,
        applied: &Applied,
        result: &Result<Decision, StoreError>,
        span: &DecisionSpan,
    ) {
        if !METRICS && !span.enabled() {
            return;
        }
        let Some((rule, set, policy)) = self.single() else {
            return;
        };
        let Some(metrics) = set.metrics.first() else {
            return;
        };
        match result {
            Ok(d) if d.allowed() && d.is_failure_policy() => {
                // Admitted by the failure policy: nothing was consumed from the store.
                rule.failure_policy.increment(1);
                span.record("failure_policy", Some(&rule.name), None, None);
                return;
            }
            Ok(d) if d.allowed() => {
                rule.admitted.increment(1);
                #[cfg(feature = "metrics")]
                metrics.cost.increment(applied.cost.min(policy.limit()));
            }
            Ok(_) => metrics.limited.increment(1),
            Err(_) => rule.store_error.increment(1),
        }
        #[cfg(not(feature = "metrics"))]
        let _ = (applied, policy);
        match result {
            Ok(d) => {
                let outcome = if d.allowed() { "admitted" } else { "limited" };
                let name = set.names.first().map(|n| &**n);
                span.record(outcome, Some(&rule.name), name, Some(d.remaining()));
            }
            Err(_) => span.record("store_error", Some(&rule.name), None, None),
        }
    }

    #[inline]
    pub(crate) fn set(&self, rule: u16, set: u16) -> &PolicySet {
        let rule = &self.rules[usize::from(rule).min(self.rules.len() - 1)];
        &rule.sets[usize::from(set).min(rule.sets.len() - 1)]
    }

    /// The policy of check `index` of a stack of `applied` rules, and its `RateLimit` values.
    #[inline]
    pub(crate) fn status(
        &self,
        applied: &[Applied],
        mut index: usize,
    ) -> Option<(&Policy, &StatusField)> {
        for a in applied {
            let set = self.set(a.rule, a.set);
            if let (Some(policy), Some(status)) = (set.policies.get(index), set.statuses.get(index))
            {
                return Some((policy, status));
            }
            index -= set.policies.len();
        }
        None
    }

    /// The rule and policy name behind check `index` of a stack of `applied` rules.
    pub(crate) fn locate(&self, applied: &[Applied], index: usize) -> Option<(&str, &Arc<str>)> {
        self.locate_policy(applied, index)
            .map(|(rule, name, _)| (rule, name))
    }

    /// The rule, policy name and policy behind check `index` of a stack of `applied` rules.
    pub(crate) fn locate_policy(
        &self,
        applied: &[Applied],
        mut index: usize,
    ) -> Option<(&str, &Arc<str>, &Policy)> {
        for a in applied {
            let set = self.set(a.rule, a.set);
            if index < set.names.len() {
                let rule = &self.rules[usize::from(a.rule)];
                return Some((&rule.name, &set.names[index], &set.policies[index]));
            }
            index -= set.names.len();
        }
        None
    }

    /// The rule, policy set and index in it of check `index` of a stack of `applied` rules.
    #[inline]
    fn locate_set(
        &self,
        applied: &[Applied],
        mut index: usize,
    ) -> Option<(&CompiledRule, &PolicySet, usize)> {
        for a in applied {
            let set = self.set(a.rule, a.set);
            if index < set.policies.len() {
                return Some((self.rules.get(usize::from(a.rule))?, set, index));
            }
            index -= set.policies.len();
        }
        None
    }

    /// Counts an admission by each of the `applied` rules, and what each of their policies
    /// consumed.
    #[inline]
    fn count_admitted(&self, applied: &[Applied]) {
        #[cfg(feature = "metrics")]
        for a in applied {
            if let Some(rule) = self.rules.get(usize::from(a.rule)) {
                rule.admitted.increment(1);
            }
            let set = self.set(a.rule, a.set);
            for (policy, metrics) in set.policies.iter().zip(set.metrics.iter()) {
                metrics.cost.increment(a.cost.min(policy.limit()));
            }
        }
        #[cfg(not(feature = "metrics"))]
        let _ = applied;
    }

    /// Counts, and records in the decision's span, the enforced rules' decision on a request.
    #[inline]
    pub(crate) fn observe(
        &self,
        applied: &[Applied],
        result: &Result<Decision, StoreError>,
        span: &DecisionSpan,
    ) {
        if !METRICS && !span.enabled() {
            return;
        }
        match result {
            Ok(d) if d.allowed() && d.is_failure_policy() => {
                // Admitted by the failure policy: nothing was consumed from the store.
                for a in applied {
                    if let Some(rule) = self.rules.get(usize::from(a.rule)) {
                        rule.failure_policy.increment(1);
                    }
                }
                let first = applied
                    .first()
                    .and_then(|a| self.rules.get(usize::from(a.rule)));
                span.record("failure_policy", first.map(|r| &*r.name), None, None);
            }
            Ok(d) => {
                let located = self.locate_set(applied, d.index());
                if d.allowed() {
                    self.count_admitted(applied);
                } else if let Some((_, set, i)) = located {
                    set.metrics[i].limited.increment(1);
                }
                if let Some((rule, set, i)) = located {
                    let outcome = if d.allowed() { "admitted" } else { "limited" };
                    span.record(
                        outcome,
                        Some(&rule.name),
                        Some(&set.names[i]),
                        Some(d.remaining()),
                    );
                }
            }
            Err(_) => {
                for a in applied {
                    if let Some(rule) = self.rules.get(usize::from(a.rule)) {
                        rule.store_error.increment(1);
                    }
                }
                let first = applied
                    .first()
                    .and_then(|a| self.rules.get(usize::from(a.rule)));
                span.record("store_error", first.map(|r| &*r.name), None, None);
            }
        }
    }

    /// Counts, and records in the decision's span, the shadow rules' decision on a request
    /// the enforced ones admitted.
    pub(crate) fn observe_shadow(
        &self,
        applied: &[Applied],
        result: &Result<Decision, StoreError>,
        span: &DecisionSpan,
    ) {
        match result {
            Ok(d) if d.allowed() => self.count_admitted(applied),
            Ok(d) => {
                if let Some((rule, set, i)) = self.locate_set(applied, d.index()) {
                    set.metrics[i].shadow_limited.increment(1);
                    let _ = (rule, span);
                    span.in_scope(|| {
                        crate::telemetry::event!(
                            debug,
                            name: "tollgate.shadow_limited",
                            rule = &*rule.name,
                            policy = &*set.names[i],
                            remaining = d.remaining(),
                            "a shadow rule would have refused the request"
                        );
                    });
                }
            }
            Err(_) => {}
        }
    }

    /// Counts, and records in the decision's span, a refusal of a cost above a policy's limit.
    pub(crate) fn observe_costly(&self, applied: &[Applied], costly: Costly, span: &DecisionSpan) {
        if let Some((rule, set, i)) = self.locate_set(applied, costly.index) {
            set.metrics[i].limited.increment(1);
            span.record("limited", Some(&rule.name), Some(&set.names[i]), Some(0));
        }
    }

    /// Counts, and records in the decision's span, a refusal for want of a key.
    pub(crate) fn observe_no_key(&self, no_key: NoKey, span: &DecisionSpan) {
        let rule = self.rules.get(usize::from(no_key.rule));
        if let Some(rule) = rule {
            rule.no_key.increment(1);
        }
        span.record("no_key", rule.map(|r| &*r.name), None, None);
    }

    /// Records a shadow rule's refusal: the observer, and the value for the request
    /// extensions.
    pub(crate) fn shadow_rejected(
        &self,
        applied: &[Applied],
        decision: Decision,
    ) -> ShadowRejection {
        let (rule, policy) = self
            .locate(applied, decision.index())
            .map(|(r, p)| (Arc::<str>::from(r), p.clone()))
            .unwrap_or_else(|| (Arc::from(""), Arc::from("")));
        let rejection = ShadowRejection {
            rule,
            policy,
            decision,
        };
        if let Some(observer) = &self.observer {
            observer(&rejection);
        }
        rejection
    }
}

/// What a shadow rule would have done to a request it let through: put into the request's
/// extensions and given to the limiter's observer.
#[derive(Clone, Debug)]
pub struct ShadowRejection {
    rule: Arc<str>,
    policy: Arc<str>,
    decision: Decision,
}

impl ShadowRejection {
    /// The shadow rule.
    pub fn rule(&self) -> &str {
        &self.rule
    }

    /// The policy that would have refused.
    pub fn policy(&self) -> &str {
        &self.policy
    }

    /// The decision (a rejection) that was not enforced.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }
}
