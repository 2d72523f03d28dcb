//! The [`Limiter`]: its rules over one store, how it is built, and what building it refuses.

use std::fmt;
use std::sync::Arc;

use super::compiled::CompiledRule;
use super::observe::ShadowRejection;
use super::rule::Rule;
use crate::MAX_NAME_LEN;
use crate::key::MAX_KEY_LEN;
use crate::store::Store;
use crate::telemetry::KeyTrace;

/// The rules of a service over one store, built once and shared (in an `Arc`) by every clone
/// of the layer that uses it.
///
/// For each request it finds the rules that apply, their keys, tiers and costs, and asks the
/// store about all of their policies in one [`Store::check_all`] call: the request is admitted
/// only if every policy of every enforced rule admits it, and consumes from none of them
/// otherwise. Shadow rules are then checked the same way, in a second call, and never refuse.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{MemoryStore, Policy, Rate};
/// use tollgate::key::{Global, PeerIp};
/// use tollgate::limiter::{Limiter, Rule};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let limiter = Limiter::builder(MemoryStore::new())
///     .rule(Rule::new("per-ip").key(PeerIp::new()).policies([
///         Policy::gcra(Rate::per_second(10), 20)?.named("per-second")?,
///         Policy::sliding_window(1_000, Duration::from_secs(3600))?.named("per-hour")?,
///     ]))
///     .rule(Rule::new("global").key(Global).policy(Policy::gcra(Rate::per_second(5_000), 5_000)?))
///     .build()?;
/// assert_eq!(limiter.rule_names().collect::<Vec<_>>(), ["per-ip", "global"]);
/// # Ok(())
/// # }
/// ```
pub struct Limiter<St> {
    pub(crate) store: St,
    pub(crate) rules: Box<[CompiledRule]>,
    pub(crate) observer: Option<Observer>,
    /// One rule with one policy, no tiers and no shadow mode: planned without a [`Plan`].
    pub(super) single: bool,
    /// How the decision span shows keys.
    pub(crate) key_trace: KeyTrace,
}

pub(crate) type Observer = Arc<dyn Fn(&ShadowRejection) + Send + Sync>;

impl<St: Store> Limiter<St> {
    /// A builder of rules over `store`.
    pub fn builder(store: St) -> LimiterBuilder<St> {
        LimiterBuilder {
            store,
            rules: Vec::new(),
            observer: None,
        }
    }
}

impl<St> Limiter<St> {
    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }

    /// The names of the rules, in order.
    pub fn rule_names(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().map(|r| &*r.name)
    }

    /// Takes over the tier caches of `old`'s rules of the same name for which `unchanged`
    /// says so (a reload that left them as they were asks their resolvers nothing).
    #[cfg_attr(not(feature = "serde"), allow(dead_code))]
    pub(crate) fn adopt_tier_caches(
        &mut self,
        old: &Limiter<St>,
        unchanged: impl Fn(&str) -> bool,
    ) {
        for rule in self.rules.iter_mut() {
            // A limiter not serving yet: no request holds its lookups.
            let Some(tiers) = rule.tiers.as_mut().and_then(Arc::get_mut) else {
                continue;
            };
            if !unchanged(&rule.name) {
                continue;
            }
            let before = old.rules.iter().find(|r| r.name == rule.name);
            if let Some(before) = before.and_then(|r| r.tiers.as_ref()) {
                tiers.adopt(before);
            }
        }
    }
}

impl<St> fmt::Debug for Limiter<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter")
            .field("rules", &self.rules)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Limiter`]; every rule is validated by [`LimiterBuilder::build`].
pub struct LimiterBuilder<St> {
    store: St,
    rules: Vec<Rule>,
    observer: Option<Observer>,
}

impl<St: Store> LimiterBuilder<St> {
    /// Adds a rule.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Calls `observer` whenever a shadow rule would have refused a request (for metrics or
    /// logs). It runs on the request's task: keep it quick.
    pub fn on_shadow_rejection<F>(mut self, observer: F) -> Self
    where
        F: Fn(&ShadowRejection) + Send + Sync + 'static,
    {
        self.observer = Some(Arc::new(observer));
        self
    }

    /// Validates the rules and builds the limiter.
    pub fn build(self) -> Result<Limiter<St>, LimiterError> {
        if self.rules.len() > usize::from(u16::MAX) {
            return Err(LimiterError::TooManyRules(self.rules.len()));
        }
        let mut compiled: Vec<CompiledRule> = Vec::with_capacity(self.rules.len());
        for rule in self.rules {
            if !valid_name(&rule.name) {
                return Err(LimiterError::InvalidRuleName(
                    rule.name.chars().take(80).collect(),
                ));
            }
            if compiled.iter().any(|r| *r.name == *rule.name) {
                return Err(LimiterError::DuplicateRule(rule.name));
            }
            compiled.push(CompiledRule::compile(rule)?);
        }
        if let Some(max) = self.store.max_key_len() {
            let longest = MAX_KEY_LEN;
            if max < longest {
                return Err(LimiterError::StoreKeyTooShort { max, longest });
            }
        }
        let single = matches!(&compiled[..], [rule] if rule.tiers.is_none()
            && !rule.shadow
            && rule.sets.len() == 1
            && rule.sets[0].policies.len() == 1);
        Ok(Limiter {
            store: self.store,
            rules: compiled.into(),
            observer: self.observer,
            single,
            key_trace: KeyTrace::None,
        })
    }
}

impl<St> fmt::Debug for LimiterBuilder<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimiterBuilder")
            .field("rules", &self.rules)
            .finish_non_exhaustive()
    }
}

pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}

/// Why a limiter could not be built.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimiterError {
    /// A rule name that is empty, too long, or has characters outside `a-z A-Z 0-9 - _ . :`.
    InvalidRuleName(String),
    /// Two rules with one name.
    DuplicateRule(String),
    /// A rule with neither policies nor tiers.
    NoPolicy(String),
    /// A rule with both policies and tiers.
    PoliciesAndTiers(String),
    /// A rule's tiers: none declared, a tier without policies, a name used twice or not
    /// usable in a header, or a default tier that is not declared.
    InvalidTiers {
        /// The rule.
        rule: String,
        /// What is wrong.
        reason: String,
    },
    /// A rule (or one of its tiers) lists the same policy twice: one state in the store,
    /// which each request would be counted against twice.
    DuplicatePolicy {
        /// The rule.
        rule: String,
        /// The tier, for a rule with tiers.
        tier: Option<String>,
        /// Where the policy is listed first (from 0).
        first: usize,
        /// Where it is listed again.
        again: usize,
    },
    /// A rule on a route template in axum 0.7's syntax (`/users/:id`), which axum 0.8 never
    /// matches.
    OldRouteSyntax {
        /// The rule.
        rule: String,
        /// The template given.
        route: String,
        /// The same template in axum 0.8's syntax (`/users/{id}`).
        suggested: String,
    },
    /// More rules than 65 535.
    TooManyRules(usize),
    /// The store refuses keys longer than `max` bytes, and the limiter makes keys of up to
    /// `longest` bytes ([`MAX_KEY_LEN`]): some requests would be answered 503.
    StoreKeyTooShort {
        /// The store's bound.
        max: usize,
        /// The longest key the limiter makes.
        longest: usize,
    },
}

impl fmt::Display for LimiterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimiterError::InvalidRuleName(name) => write!(
                f,
                "invalid rule name {name:?}: use 1 to {MAX_NAME_LEN} of a-z A-Z 0-9 - _ . :"
            ),
            LimiterError::DuplicateRule(name) => write!(f, "two rules are named {name:?}"),
            LimiterError::NoPolicy(name) => {
                write!(
                    f,
                    "rule {name:?} has no policy: add one with .policy() or .tiers()"
                )
            }
            LimiterError::PoliciesAndTiers(name) => write!(
                f,
                "rule {name:?} has both policies and tiers: give it one or the other"
            ),
            LimiterError::InvalidTiers { rule, reason } => {
                write!(f, "the tiers of rule {rule:?}: {reason}")
            }
            LimiterError::DuplicatePolicy {
                rule,
                tier,
                first,
                again,
            } => {
                write!(f, "rule {rule:?}")?;
                if let Some(tier) = tier {
                    write!(f, ", tier {tier:?},")?;
                }
                write!(
                    f,
                    " lists the same policy twice (policies {first} and {again}): every request \
                     would count twice against it; list it once, or name the two apart"
                )
            }
            LimiterError::OldRouteSyntax {
                rule,
                route,
                suggested,
            } => write!(
                f,
                "rule {rule:?}: the route {route:?} is written in axum 0.7's syntax, which axum \
                 0.8 never matches: write {suggested:?}"
            ),
            LimiterError::TooManyRules(n) => write!(f, "{n} rules: at most 65535"),
            LimiterError::StoreKeyTooShort { max, longest } => write!(
                f,
                "the store takes keys of at most {max} bytes, and the limiter makes keys of up to \
                 {longest} bytes: raise the store's max_key_len to at least {longest}"
            ),
        }
    }
}

impl std::error::Error for LimiterError {}
