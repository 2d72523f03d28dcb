//! The shaper's configuration, and the state every clone of it shares.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Response, StatusCode};
use tower_layer::Layer;

use super::service::Shape;
use crate::answer::{DefaultResponder, Rejection, RejectionKind, Responder};
use crate::limiter::{Matcher, Rule, valid_name};
use crate::telemetry::{Counter, Histogram};
use crate::{Decision, Policy, PolicyError, Rate, Store, StoreError};

/// The default name of a [`ShapeLayer`] in metrics and logs.
pub const DEFAULT_SHAPE_LAYER_NAME: &str = "shape";

/// Delays requests so that they leave at a constant rate per key (the leaky bucket as a
/// queue): see the [module docs](super).
pub struct ShapeLayer<St> {
    pub(crate) shared: Arc<Shared<St>>,
}

impl<St> Clone for ShapeLayer<St> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<St: Store> ShapeLayer<St> {
    /// A builder over `store` (a [`MemoryStore`](crate::MemoryStore) in process, a
    /// `RedisStore` to shape several instances to one rate).
    pub fn builder(store: St) -> ShapeLayerBuilder<St> {
        ShapeLayerBuilder {
            store,
            rules: Vec::new(),
            responder: Box::new(DefaultResponder),
            unavailable_retry_after: Duration::from_secs(1),
            name: DEFAULT_SHAPE_LAYER_NAME.to_owned(),
        }
    }

    /// The layer's name in metrics and logs (see [`ShapeLayerBuilder::name`]).
    pub fn name(&self) -> &str {
        &self.shared.name
    }
}

impl<S, St> Layer<S> for ShapeLayer<St> {
    type Service = Shape<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Shape::new(inner, self.shared.clone())
    }
}

impl<St> fmt::Debug for ShapeLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShapeLayer")
            .field("name", &self.shared.name)
            .field(
                "rules",
                &self
                    .shared
                    .rules
                    .iter()
                    .map(|r| (&*r.matcher.name, &r.policy))
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

/// Builds a [`ShapeLayer`]; validated by [`ShapeLayerBuilder::build`].
pub struct ShapeLayerBuilder<St> {
    store: St,
    rules: Vec<(Rule, Rate, u64)>,
    responder: Box<dyn Responder>,
    unavailable_retry_after: Duration,
    name: String,
}

impl<St: Store> ShapeLayerBuilder<St> {
    /// Requests that `rule` matches (its methods, path or route, key, cost, and what to do
    /// without a key; no policies) leave at `rate` per key; at most `queue` units of cost wait
    /// at once, so a request waits at most `queue` intervals of the rate, and one that would
    /// wait longer is refused at once. The first rule that matches a request shapes it.
    ///
    /// A request whose cost is above `queue` can never fit: it is refused at once (`429`,
    /// without `Retry-After`, counted as limited), so that the service never sees more than
    /// the rate.
    pub fn rule(mut self, rule: Rule, rate: Rate, queue: u64) -> Self {
        self.rules.push((rule, rate, queue));
        self
    }

    /// How refusals are answered ([`DefaultResponder`] unless set).
    pub fn responder(mut self, responder: impl Responder) -> Self {
        self.responder = Box::new(responder);
        self
    }

    /// The layer's name in metrics (the `layer` label) and logs ([`DEFAULT_SHAPE_LAYER_NAME`]
    /// unless set): give each shaper of a process its own.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Validates the rules and builds the layer, and registers its metrics (feature
    /// `metrics`: install the recorder first).
    pub fn build(self) -> Result<ShapeLayer<St>, ShapeError> {
        if self.rules.is_empty() {
            return Err(ShapeError::NoRule);
        }
        let mut rules: Vec<ShapedRule> = Vec::with_capacity(self.rules.len());
        for (rule, rate, queue) in self.rules {
            let name = rule.name.clone();
            if !valid_name(&name) {
                return Err(ShapeError::InvalidRuleName(name.chars().take(80).collect()));
            }
            if rules.iter().any(|r| *r.matcher.name == *name) {
                return Err(ShapeError::DuplicateRule(name));
            }
            if !rule.policies.is_empty() || rule.tiers.is_some() || rule.shadow {
                return Err(ShapeError::NotAShapingRule(name));
            }
            // The queue is GCRA read the other way: the departure of an admitted request is
            // its new theoretical arrival time, so its wait is the decision's `reset_after`.
            let policy = Policy::gcra(rate, queue)
                .and_then(|p| p.named(&name))
                .map_err(|source| ShapeError::Policy {
                    rule: name.clone(),
                    source,
                })?;
            let matcher = Matcher::new(rule);
            let refused = |reason| {
                Counter::new(
                    crate::metrics::SHAPE_REFUSED_TOTAL,
                    &[("layer", &self.name), ("rule", &name), ("reason", reason)],
                )
            };
            let refused = [
                refused("limited"),
                if matcher.refuses_without_key() {
                    refused("no_key")
                } else {
                    Counter::noop()
                },
                refused("store_error"),
            ];
            rules.push(ShapedRule {
                matcher,
                policy,
                refused,
            });
        }
        if let Some(max) = self.store.max_key_len() {
            if max < crate::key::MAX_KEY_LEN {
                return Err(ShapeError::StoreKeyTooShort { max });
            }
        }
        Ok(ShapeLayer {
            shared: Arc::new(Shared {
                queue: Histogram::new(
                    crate::metrics::QUEUE_DURATION_SECONDS,
                    &[("layer", &self.name)],
                ),
                name: self.name.into(),
                store: self.store,
                rules: rules.into(),
                responder: self.responder,
                unavailable_retry_after: self.unavailable_retry_after,
            }),
        })
    }
}

impl<St> fmt::Debug for ShapeLayerBuilder<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShapeLayerBuilder")
            .field("rules", &self.rules)
            .finish_non_exhaustive()
    }
}

/// Why a [`ShapeLayer`] could not be built.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShapeError {
    /// No rule.
    NoRule,
    /// A rule name that is empty, too long, or has characters outside `a-z A-Z 0-9 - _ . :`.
    InvalidRuleName(String),
    /// Two rules with one name.
    DuplicateRule(String),
    /// A rule with policies, tiers or shadow mode: a shaping rule takes its rate and queue
    /// from [`ShapeLayerBuilder::rule`].
    NotAShapingRule(String),
    /// A rate or queue that makes no policy (a zero rate or queue, say).
    Policy {
        /// The rule.
        rule: String,
        /// Why.
        source: PolicyError,
    },
    /// The store refuses keys as long as the layer makes ([`MAX_KEY_LEN`](crate::key::MAX_KEY_LEN)).
    StoreKeyTooShort {
        /// The store's bound.
        max: usize,
    },
}

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShapeError::NoRule => f.write_str("no rule: add one with .rule(rule, rate, queue)"),
            ShapeError::InvalidRuleName(name) => write!(
                f,
                "invalid rule name {name:?}: use 1 to {} of a-z A-Z 0-9 - _ . :",
                crate::MAX_NAME_LEN
            ),
            ShapeError::DuplicateRule(name) => write!(f, "two rules are named {name:?}"),
            ShapeError::NotAShapingRule(name) => write!(
                f,
                "rule {name:?} has policies, tiers or shadow mode: a shaping rule takes its \
                 rate and queue from .rule(rule, rate, queue)"
            ),
            ShapeError::Policy { rule, source } => write!(f, "rule {rule:?}: {source}"),
            ShapeError::StoreKeyTooShort { max } => write!(
                f,
                "the store takes keys of at most {max} bytes; the shaper makes keys of up to {}",
                crate::key::MAX_KEY_LEN
            ),
        }
    }
}

impl std::error::Error for ShapeError {}

pub(crate) struct Shared<St> {
    pub(crate) store: St,
    rules: Box<[ShapedRule]>,
    responder: Box<dyn Responder>,
    unavailable_retry_after: Duration,
    /// The layer's name in metrics and logs.
    name: Arc<str>,
    /// `tollgate_queue_duration_seconds`: the wait of each request admitted.
    queue: Histogram,
}

struct ShapedRule {
    matcher: Matcher,
    policy: Policy,
    /// `tollgate_shape_refused_total`, by reason: limited, no key, store error.
    refused: [Counter; 3],
}

/// What the shaper does with a request.
pub(crate) enum Plan<F> {
    /// No rule applies: straight through.
    Pass,
    /// The store reserves its departure.
    Check { check: F, rule: u16 },
    /// A rule found no key, or the request costs more than its queue holds: refused.
    Refuse(Response<Bytes>),
}

impl<St> Shared<St> {
    /// A request admitted, to leave after `wait`.
    pub(crate) fn admitted(&self, wait: Duration) {
        self.queue
            .record_nanos(u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Counts a refusal by rule `index` (reason 0: limited, 1: no key, 2: store error), and
    /// logs it at DEBUG.
    fn count_refusal(&self, index: usize, reason: usize) {
        let Some(rule) = self.rules.get(index) else {
            return;
        };
        if let Some(counter) = rule.refused.get(reason) {
            counter.increment(1);
        }
        let _ = &rule.matcher;
        crate::telemetry::event!(
            debug,
            name: "tollgate.shape.refused",
            layer = &*self.name,
            rule = &*rule.matcher.name,
            reason = ["limited", "no_key", "store_error"][reason.min(2)],
            "the shaper refused a request"
        );
    }
}

impl<St: Store> Shared<St> {
    /// The first rule that applies, and the store's reservation for it.
    pub(crate) fn plan(&self, parts: &Parts) -> Plan<St::Future> {
        for (index, rule) in self.rules.iter().enumerate() {
            if !rule.matcher.matches(parts) {
                continue;
            }
            let key = match rule.matcher.key(parts) {
                Ok(Some(key)) => key,
                Ok(None) => continue,
                Err(status) => {
                    self.count_refusal(index, 1);
                    return Plan::Refuse(self.answer(
                        parts,
                        RejectionKind::NoKey,
                        status,
                        index,
                        None,
                        None,
                    ));
                }
            };
            let cost = rule.matcher.cost(parts);
            if cost > rule.policy.limit() {
                // It could never fit in the queue: letting it through at the queue's size
                // would let more than the rate leave.
                self.count_refusal(index, 0);
                return Plan::Refuse(self.answer(
                    parts,
                    RejectionKind::Limited,
                    StatusCode::TOO_MANY_REQUESTS,
                    index,
                    None,
                    None,
                ));
            }
            return Plan::Check {
                check: self.store.check(key.as_str(), &rule.policy, cost),
                rule: u16::try_from(index).unwrap_or(u16::MAX),
            };
        }
        Plan::Pass
    }

    /// The answer to a request the store refused (its wait would pass the queue) or could not
    /// decide.
    pub(crate) fn refused(
        &self,
        parts: &Parts,
        rule: u16,
        outcome: Result<Decision, StoreError>,
    ) -> Response<Bytes> {
        let index = usize::from(rule);
        self.count_refusal(index, if outcome.is_ok() { 0 } else { 2 });
        match outcome {
            Ok(decision) => self.answer(
                parts,
                RejectionKind::Limited,
                StatusCode::TOO_MANY_REQUESTS,
                index,
                Some(decision),
                None,
            ),
            Err(error) => self.answer(
                parts,
                RejectionKind::Unavailable,
                StatusCode::SERVICE_UNAVAILABLE,
                index,
                None,
                Some(&error),
            ),
        }
    }

    fn answer(
        &self,
        parts: &Parts,
        kind: RejectionKind,
        status: StatusCode,
        index: usize,
        decision: Option<Decision>,
        error: Option<&StoreError>,
    ) -> Response<Bytes> {
        let rule = self.rules.get(index);
        let retry_after = match kind {
            RejectionKind::Limited => decision.and_then(|d| d.retry_after()),
            RejectionKind::Unavailable => Some(self.unavailable_retry_after),
            _ => None,
        };
        crate::answer::refuse(
            &*self.responder,
            &Rejection {
                kind,
                parts,
                status,
                decision,
                rule: rule.map(|r| &*r.matcher.name),
                policy: rule.map(|r| &*r.matcher.name),
                window: rule.map(|r| (&r.policy).into()),
                retry_after,
                error,
            },
        )
    }
}
