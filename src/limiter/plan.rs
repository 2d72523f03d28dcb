//! The built limiter: rules compiled once, and the plan of checks for one request.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use http::request::Parts;
use http::{HeaderValue, Method, StatusCode};
use smallvec::SmallVec;

use super::rule::{Cost, MissingKey, Route, Rule};
use super::tier::TierLookup;
use crate::answer::StatusField;
use crate::key::{Key, KeyExtractor, MAX_KEY_LEN};
use crate::store::{Check, Store};
use crate::telemetry::{Counter, DecisionSpan, KeyTrace, METRICS};
use crate::{Decision, MAX_NAME_LEN, Policy, StoreError};

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
    single: bool,
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
            let Some(tiers) = &mut rule.tiers else {
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

/// A rule ready to run.
pub(crate) struct CompiledRule {
    pub(crate) name: Arc<str>,
    /// `@name`, the end of every store key of the rule.
    suffix: Box<str>,
    methods: SmallVec<[Method; 2]>,
    route: Route,
    key: Box<dyn KeyExtractor>,
    cost: Cost,
    missing: MissingKey,
    pub(crate) shadow: bool,
    /// One set of policies, or one per tier.
    pub(crate) sets: Box<[PolicySet]>,
    tiers: Option<TierLookup>,
    /// `tollgate_decisions_total` for the requests the rule admitted (for a shadow rule: would
    /// have), refused without a key, and could not decide.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    admitted: Counter,
    /// Admissions by the store's failure policy (fail open, or the local fallback): the
    /// store did not decide.
    failure_policy: Counter,
    no_key: Counter,
    store_error: Counter,
}

/// A `RateLimit-Policy` value, made when a layer is built and sent on every response.
///
/// Its text is kept for the life of the process (once per distinct text, up to
/// [`MAX_INTERNED`] texts of at most [`MAX_INTERNED_LEN`] bytes), so that the value on each
/// response is a static one: cloning and dropping it touch no reference count, which the
/// cores serving requests would otherwise all write on every response. Building a layer again
/// with the same policies reuses the texts; past the bounds, values are reference-counted.
pub(crate) fn field_value(text: &str) -> Option<HeaderValue> {
    use std::collections::HashSet;
    use std::sync::{LazyLock, Mutex};
    static INTERNED: LazyLock<Mutex<HashSet<&'static str>>> = LazyLock::new(Mutex::default);
    let checked = HeaderValue::from_str(text).ok()?;
    // `from_static` below takes visible ASCII only (and panics on anything else).
    let visible = text
        .bytes()
        .all(|b| b == b'\t' || (b' '..=b'~').contains(&b));
    if !visible || text.len() > MAX_INTERNED_LEN {
        return Some(checked);
    }
    let Ok(mut interned) = INTERNED.lock() else {
        return Some(checked);
    };
    let text = match interned.get(text) {
        Some(&text) => text,
        None if interned.len() < MAX_INTERNED => {
            let text: &'static str = Box::leak(text.into());
            interned.insert(text);
            text
        }
        None => return Some(checked),
    };
    Some(HeaderValue::from_static(text))
}

/// How many distinct `RateLimit-Policy` texts are kept for the life of the process.
pub(crate) const MAX_INTERNED: usize = 4096;

/// The longest `RateLimit-Policy` text kept for the life of the process.
pub(crate) const MAX_INTERNED_LEN: usize = 1024;

/// The largest integer a Structured Field may carry (15 digits, RFC 8941): a `q`, `w`, `r`
/// or `t` above it is sent as this value, so that strict parsers accept the fields of an
/// "unlimited" policy (`Policy::fixed_window(u64::MAX, ..)`).
pub(crate) const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

/// The policies a rule applies (for one tier), with the names clients see.
pub(crate) struct PolicySet {
    pub(crate) policies: Box<[Policy]>,
    /// The name of each policy in the `RateLimit` fields and problem details.
    pub(crate) names: Box<[Arc<str>]>,
    /// Each policy's `RateLimit` values (`"name";r=R;t=T`).
    pub(crate) statuses: Box<[StatusField]>,
    /// This set's members of the `RateLimit-Policy` field, as text and as a header value.
    pub(crate) field: Box<str>,
    pub(crate) field_value: HeaderValue,
    /// Each policy's counters.
    pub(crate) metrics: Box<[PolicyMetrics]>,
}

/// The counters of one policy of one rule, registered when the limiter is built (those its
/// rule can never use count nothing).
pub(crate) struct PolicyMetrics {
    limited: Counter,
    shadow_limited: Counter,
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    cost: Counter,
}

impl PolicyMetrics {
    fn new(rule: &str, policy: &str, shadow: bool) -> Self {
        use crate::metrics::{COST_CONSUMED_TOTAL, DECISIONS_TOTAL};
        let decisions = |outcome| {
            Counter::new(
                DECISIONS_TOTAL,
                &[("rule", rule), ("policy", policy), ("outcome", outcome)],
            )
        };
        let (limited, shadow_limited) = if shadow {
            (Counter::noop(), decisions("shadow_limited"))
        } else {
            (decisions("limited"), Counter::noop())
        };
        PolicyMetrics {
            limited,
            shadow_limited,
            cost: Counter::new(COST_CONSUMED_TOTAL, &[("rule", rule), ("policy", policy)]),
        }
    }
}

impl CompiledRule {
    fn compile(rule: Rule) -> Result<Self, LimiterError> {
        let name: Arc<str> = rule.name.as_str().into();
        let (sets, tiers) = match (rule.policies.is_empty(), rule.tiers) {
            (true, None) => return Err(LimiterError::NoPolicy(rule.name)),
            (false, Some(_)) => return Err(LimiterError::PoliciesAndTiers(rule.name)),
            (false, None) => (
                vec![PolicySet::new(&name, None, rule.policies, rule.shadow)?],
                None,
            ),
            (true, Some(tiers)) => {
                let invalid = |reason: String| LimiterError::InvalidTiers {
                    rule: rule.name.clone(),
                    reason,
                };
                if tiers.tiers.is_empty() {
                    return Err(invalid("no tier declared".into()));
                }
                if tiers.tiers.len() > usize::from(u16::MAX) {
                    return Err(invalid("more than 65535 tiers".into()));
                }
                let mut sets = Vec::with_capacity(tiers.tiers.len());
                for (i, (tier, policies)) in tiers.tiers.iter().enumerate() {
                    if !valid_name(tier) {
                        return Err(invalid(format!(
                            "tier name {tier:?}: use 1 to {MAX_NAME_LEN} of a-z A-Z 0-9 - _ . :"
                        )));
                    }
                    if tiers.tiers[..i].iter().any(|(t, _)| t == tier) {
                        return Err(invalid(format!("tier {tier:?} is declared twice")));
                    }
                    if policies.is_empty() {
                        return Err(invalid(format!("tier {tier:?} has no policy")));
                    }
                    sets.push(PolicySet::new(
                        &name,
                        Some(tier),
                        policies.clone(),
                        rule.shadow,
                    )?);
                }
                let default = match &tiers.default {
                    None => 0,
                    Some(d) => tiers
                        .tiers
                        .iter()
                        .position(|(t, _)| t == d)
                        .ok_or_else(|| {
                            invalid(format!("the default tier {d:?} is not declared"))
                        })?,
                };
                let default = u16::try_from(default).unwrap_or(0);
                (sets, Some(tiers.into_resolved(&name, default)))
            }
        };
        let methods = super::rule::effective_methods(rule.methods, rule.exact_methods);
        let decisions = |outcome| {
            Counter::new(
                crate::metrics::DECISIONS_TOTAL,
                &[("rule", &name), ("policy", ""), ("outcome", outcome)],
            )
        };
        let (no_key, store_error) = match (rule.shadow, rule.missing) {
            (true, _) => (Counter::noop(), Counter::noop()),
            (false, MissingKey::Reject(_)) => (decisions("no_key"), decisions("store_error")),
            (false, MissingKey::Skip) => (Counter::noop(), decisions("store_error")),
        };
        let failure_policy = if rule.shadow {
            Counter::noop()
        } else {
            decisions("failure_policy")
        };
        Ok(CompiledRule {
            admitted: decisions("admitted"),
            failure_policy,
            no_key,
            store_error,
            suffix: format!("@{name}").into(),
            name,
            methods,
            route: rule.route,
            key: rule.key,
            cost: rule.cost,
            missing: rule.missing,
            shadow: rule.shadow,
            sets: sets.into(),
            tiers,
        })
    }

    /// Whether the rule applies to a request: by method (a rule on `GET` also applies to
    /// `HEAD`, which axum's `get` serves with the same handler, unless the rule asks for exact
    /// methods) and by route.
    #[inline(always)]
    fn matches(&self, parts: &Parts) -> bool {
        (self.methods.is_empty() || self.methods.contains(&parts.method))
            && self.route.matches(parts)
    }
}

impl fmt::Debug for CompiledRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("name", &self.name)
            .field("shadow", &self.shadow)
            .field(
                "policies",
                &self.sets.iter().map(|s| &*s.field).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl PolicySet {
    fn new(
        rule: &str,
        tier: Option<&str>,
        policies: Vec<Policy>,
        shadow: bool,
    ) -> Result<Self, LimiterError> {
        let single = policies.len() == 1;
        let names: Box<[Arc<str>]> = policies
            .iter()
            .enumerate()
            .map(|(i, p)| -> Arc<str> {
                match (p.name(), tier, single) {
                    (Some(n), _, _) => n.into(),
                    (None, None, true) => rule.into(),
                    (None, None, false) => format!("{rule}.{i}").into(),
                    (None, Some(t), true) => format!("{rule}.{t}").into(),
                    (None, Some(t), false) => format!("{rule}.{t}.{i}").into(),
                }
            })
            .collect();
        let mut field = String::new();
        for (name, policy) in names.iter().zip(&policies) {
            if !field.is_empty() {
                field.push_str(", ");
            }
            let window = policy.window().as_nanos().div_ceil(1_000_000_000).max(1);
            let quota = policy.limit().min(SF_INTEGER_MAX);
            let window = u64::try_from(window).map_or(SF_INTEGER_MAX, |w| w.min(SF_INTEGER_MAX));
            let _ = write!(field, "\"{name}\";q={quota};w={window}");
        }
        let field_value = field_value(&field)
            .ok_or_else(|| LimiterError::InvalidRuleName(rule.chars().take(80).collect()))?;
        let statuses = names
            .iter()
            .zip(&policies)
            .map(|(n, p)| StatusField::new(n, p))
            .collect();
        let metrics = names
            .iter()
            .map(|n| PolicyMetrics::new(rule, n, shadow))
            .collect();
        Ok(PolicySet {
            metrics,
            policies: policies.into(),
            statuses,
            names,
            field: field.into(),
            field_value,
        })
    }
}

/// A rule that applies to a request: which rule, which of its policy sets (`None`: a tier
/// not resolved yet), the cost, and the store key.
pub(crate) struct Planned {
    pub(crate) rule: u16,
    pub(crate) set: Option<u16>,
    pub(crate) cost: u64,
    pub(crate) key: Key,
    /// The extracted key, kept for the tier resolver while `set` is `None`.
    pub(crate) raw: Option<Box<str>>,
}

/// The rules that apply to one request, enforced and shadow.
#[derive(Default)]
pub(crate) struct Plan {
    pub(crate) enforced: SmallVec<[Planned; 4]>,
    pub(crate) shadow: Vec<Planned>,
    /// Whether a planned rule waits for its tier.
    unresolved: bool,
}

/// Which rule and policy set an enforced check came from (and, for the metrics, its cost
/// before each policy's limit clamps it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Applied {
    pub(crate) rule: u16,
    pub(crate) set: u16,
    #[cfg(feature = "metrics")]
    pub(crate) cost: u64,
}

/// Shadow rules waiting for the enforced decision.
pub(crate) type ShadowPlan = Vec<Planned>;

/// Where the one rule of a `single` limiter leaves a request.
pub(crate) enum Single<F> {
    /// The rule does not apply (or has no key and skips such requests).
    Skip,
    /// The rule found no key and refuses the request.
    NoKey(NoKey),
    /// The store was asked.
    Checked { check: F, applied: Applied },
}

/// Where a request stands after `call()`.
pub(crate) enum Start<F> {
    /// The store was asked about the enforced rules.
    Checking {
        check: F,
        applied: SmallVec<[Applied; 4]>,
        shadow: Option<ShadowPlan>,
    },
    /// No enforced rule applies.
    Unchecked { shadow: Option<ShadowPlan> },
    /// A tier must be resolved first.
    Resolving {
        plan: Box<Plan>,
        at: (bool, usize),
        answer: super::tier::Guarded,
    },
    /// A rule found no key and refuses the request.
    NoKey(NoKey),
}

#[inline]
fn applied(planned: &[Planned]) -> SmallVec<[Applied; 4]> {
    // Plain pushes: for the usual one or two rules, cheaper than `collect`'s generic extend.
    let mut out = SmallVec::new();
    for p in planned {
        out.push(Applied {
            rule: p.rule,
            set: p.set.unwrap_or(0),
            #[cfg(feature = "metrics")]
            cost: p.cost,
        });
    }
    out
}

/// A request that a rule found no key for, and refuses.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NoKey {
    pub(crate) rule: u16,
    pub(crate) status: StatusCode,
}

pub(crate) type Checks<'a> = SmallVec<[Check<'a>; 8]>;

impl<St: Store> Limiter<St> {
    /// Plans the request and asks the store about its enforced rules: the decision is made
    /// here (for the in-process store, the future is ready).
    #[inline(always)]
    pub(crate) fn start(&self, parts: &Parts, span: &DecisionSpan) -> Start<St::Future> {
        if self.single {
            return self.start_single(parts, span);
        }
        let mut plan = Plan::default();
        if let Err(no_key) = self.fill(parts, &mut plan) {
            return Start::NoKey(no_key);
        }
        self.proceed(&mut plan, span)
    }

    /// [`Limiter::start`] for the one simple rule of a `single` limiter: the same answers,
    /// without building a plan.
    #[inline(always)]
    fn start_single(&self, parts: &Parts, span: &DecisionSpan) -> Start<St::Future> {
        match self.check_single(parts, span) {
            Single::Skip => Start::Unchecked { shadow: None },
            Single::NoKey(no_key) => Start::NoKey(no_key),
            Single::Checked { check, applied } => {
                let mut list = SmallVec::new();
                list.push(applied);
                Start::Checking {
                    check,
                    applied: list,
                    shadow: None,
                }
            }
        }
    }

    /// Whether the limiter is one rule with one policy, no tiers and no shadow mode (see
    /// [`Limiter::check_single`]).
    #[inline(always)]
    pub(crate) fn is_single(&self) -> bool {
        self.single
    }

    /// Asks the store about the one rule of a `single` limiter.
    #[inline(always)]
    pub(crate) fn check_single(&self, parts: &Parts, span: &DecisionSpan) -> Single<St::Future> {
        let Some(rule) = self.rules.first() else {
            return Single::Skip;
        };
        if !rule.matches(parts) {
            return Single::Skip;
        }
        let key = match rule_key(rule, 0, parts) {
            Err(no_key) => return Single::NoKey(no_key),
            Ok(None) => return Single::Skip,
            Ok(Some(key)) => bounded(rule, key),
        };
        let Some(policy) = rule.sets.first().and_then(|set| set.policies.first()) else {
            return Single::Skip;
        };
        let cost = rule.cost.of(parts);
        span.record_keys(self.key_trace, std::iter::once(key.as_str()));
        Single::Checked {
            check: self
                .store
                .check(key.as_str(), policy, cost.min(policy.limit())),
            applied: Applied {
                rule: 0,
                set: 0,
                #[cfg(feature = "metrics")]
                cost,
            },
        }
    }

    /// The one policy of a `single` limiter, its set and its rule.
    #[inline(always)]
    pub(crate) fn single(&self) -> Option<(&CompiledRule, &PolicySet, &Policy)> {
        let rule = self.rules.first()?;
        let set = rule.sets.first()?;
        Some((rule, set, set.policies.first()?))
    }

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

    /// Goes on with a plan whose tier was just resolved.
    pub(crate) fn resume(&self, mut plan: Box<Plan>, span: &DecisionSpan) -> Start<St::Future> {
        self.proceed(&mut plan, span)
    }

    #[inline]
    fn proceed(&self, plan: &mut Plan, span: &DecisionSpan) -> Start<St::Future> {
        if plan.unresolved {
            if let Some((shadow, i, answer)) = self.next_unresolved(plan) {
                return Start::Resolving {
                    plan: Box::new(std::mem::take(plan)),
                    at: (shadow, i),
                    answer,
                };
            }
            plan.unresolved = false;
        }
        let shadow = if plan.shadow.is_empty() {
            None
        } else {
            Some(std::mem::take(&mut plan.shadow))
        };
        span.record_keys(self.key_trace, plan.enforced.iter().map(|p| p.key.as_str()));
        let applied = applied(&plan.enforced);
        let check = match plan.enforced.as_slice() {
            [] => return Start::Unchecked { shadow },
            // One rule with one policy: no stack to build.
            [one] if self.set(one.rule, one.set.unwrap_or(0)).policies.len() == 1 => {
                let policy = &self.set(one.rule, one.set.unwrap_or(0)).policies[0];
                self.store
                    .check(one.key.as_str(), policy, one.cost.min(policy.limit()))
            }
            enforced => self.store.check_all(&self.checks(enforced)),
        };
        Start::Checking {
            check,
            applied,
            shadow,
        }
    }

    /// Asks the store about the shadow rules.
    pub(crate) fn check_shadow(&self, shadow: &[Planned]) -> (St::Future, SmallVec<[Applied; 4]>) {
        (self.store.check_all(&self.checks(shadow)), applied(shadow))
    }

    /// The rules that apply to this request, with keys, costs and (cached) tiers.
    #[inline]
    fn fill(&self, parts: &Parts, plan: &mut Plan) -> Result<(), NoKey> {
        for (index, rule) in self.rules.iter().enumerate() {
            if !rule.matches(parts) {
                continue;
            }
            let index = u16::try_from(index).unwrap_or(u16::MAX);
            let Some(key) = rule_key(rule, index, parts)? else {
                continue;
            };
            let mut raw = None;
            if rule.tiers.is_some() {
                raw = key
                    .as_str()
                    .get(..key.len() - rule.suffix.len())
                    .map(Box::<str>::from);
            }
            let key = bounded(rule, key);
            let set = match &rule.tiers {
                None => Some(0),
                Some(tiers) => match tiers.cached(key.as_str()) {
                    Some(tier) => {
                        raw = None;
                        Some(tier)
                    }
                    None => {
                        plan.unresolved = true;
                        None
                    }
                },
            };
            let planned = Planned {
                rule: index,
                set,
                cost: rule.cost.of(parts),
                key,
                raw,
            };
            if rule.shadow {
                plan.shadow.push(planned);
            } else {
                plan.enforced.push(planned);
            }
        }
        Ok(())
    }

    /// The plan of a request, for tests.
    #[cfg(test)]
    pub(crate) fn plan(&self, parts: &Parts) -> Result<Plan, NoKey> {
        let mut plan = Plan::default();
        self.fill(parts, &mut plan)?;
        Ok(plan)
    }

    /// The first planned rule whose tier is not known yet, and the resolver's answer to come.
    fn next_unresolved(&self, plan: &Plan) -> Option<(bool, usize, super::tier::Guarded)> {
        let find = |list: &[Planned]| list.iter().position(|p| p.set.is_none());
        let (shadow, i) = match find(&plan.enforced) {
            Some(i) => (false, i),
            None => (true, find(&plan.shadow)?),
        };
        let planned = if shadow {
            &plan.shadow[i]
        } else {
            &plan.enforced[i]
        };
        let tiers = self.rules.get(usize::from(planned.rule))?.tiers.as_ref()?;
        let raw = planned.raw.as_deref().unwrap_or_default();
        Some((shadow, i, tiers.resolve(raw)))
    }

    /// Records the resolver's answer (or its failure: the default tier) for a planned rule.
    pub(crate) fn resolved(
        &self,
        plan: &mut Plan,
        shadow: bool,
        i: usize,
        resolution: &super::tier::Resolution,
    ) {
        let planned = if shadow {
            plan.shadow.get_mut(i)
        } else {
            plan.enforced.get_mut(i)
        };
        let Some(planned) = planned else {
            return;
        };
        let tier = match self
            .rules
            .get(usize::from(planned.rule))
            .and_then(|r| r.tiers.as_ref())
        {
            Some(tiers) => tiers.settle(planned.key.as_str(), resolution),
            None => 0,
        };
        planned.set = Some(tier);
        planned.raw = None;
    }

    /// The store checks of some planned rules (all resolved), in order: each rule's policies
    /// in turn.
    #[inline]
    pub(crate) fn checks<'a>(&'a self, planned: &'a [Planned]) -> Checks<'a> {
        let mut checks = Checks::new();
        for p in planned {
            let set = self.set(p.rule, p.set.unwrap_or(0));
            // The key the extractor found, without the rule's name, places the check.
            let placed_by = self
                .rules
                .get(usize::from(p.rule))
                .map_or(usize::MAX, |r| p.key.len().saturating_sub(r.suffix.len()));
            for policy in set.policies.iter() {
                checks.push(
                    Check::new(p.key.as_str(), policy, p.cost.min(policy.limit()))
                        .placed_by(placed_by),
                );
            }
        }
        checks
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

/// The store key of rule `index` for a request, `key@rule` (`@rule` is the rule's `suffix`);
/// `None` when the rule has no key for it and skips it.
///
/// The key comes first so that a store that places keys by their start (the Redis store's
/// [`KeySlots::UntilDelimiter`](crate::store::redis::KeySlots)) places the keys of stacked
/// rules together; the rule's name, which holds no `@`, follows the last `@`, so that no two
/// (rule, key) pairs make one store key. A shadow rule never refuses: with no key it is skipped.
#[inline(always)]
fn rule_key(rule: &CompiledRule, index: u16, parts: &Parts) -> Result<Option<Key>, NoKey> {
    let mut key = Key::new();
    if rule.key.extract_into(parts, &mut key) {
        key.push_raw(&rule.suffix);
        return Ok(Some(key));
    }
    match rule.missing {
        _ if rule.shadow => Ok(None),
        MissingKey::Skip => Ok(None),
        MissingKey::Reject(status) => Err(NoKey {
            rule: index,
            status,
        }),
    }
}

/// A rule's store key, hashed when longer than [`MAX_KEY_LEN`].
#[inline(always)]
fn bounded(rule: &CompiledRule, key: Key) -> Key {
    if key.len() <= MAX_KEY_LEN {
        return key;
    }
    let text = key.as_str();
    hashed_key(&text[..text.len() - rule.suffix.len()], &rule.suffix)
}

/// The store key of a rule's key: `key@rule`, or `%#`, a hash of the key and `@rule` when that
/// would be longer than [`MAX_KEY_LEN`].
#[cfg(test)]
pub(crate) fn store_key(rule: &str, key: &Key) -> Key {
    let mut out = key.clone();
    out.push_raw("@");
    out.push_raw(rule);
    if out.len() > MAX_KEY_LEN {
        out = hashed_key(key.as_str(), &format!("@{rule}"));
    }
    out
}

/// `%#`, the first 128 bits of the SHA-256 of `key` in hex, and `suffix`: the same in every
/// process and every build (instances that share a Redis agree on it), and no client can steer
/// two keys into one hash. No key text spells `%#`.
pub(crate) fn hashed_key(key: &str, suffix: &str) -> Key {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(key.as_bytes());
    let mut out = Key::new();
    out.push_raw("%#");
    for b in &digest[..16] {
        let _ = write!(out, "{b:02x}");
    }
    out.push_raw(suffix);
    out
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;
    use crate::key::Header;
    use crate::limiter::Tiers;
    use std::time::Duration;

    fn p(limit: u64) -> Policy {
        Policy::fixed_window(limit, Duration::from_secs(60)).unwrap()
    }

    #[test]
    fn policy_field_values_are_kept_once_and_checked() {
        let text = "\"interned-test\";q=10;w=60";
        let a = field_value(text).unwrap();
        let b = field_value(&String::from(text)).unwrap();
        assert_eq!(a, text);
        // The second value points at the text kept by the first.
        assert_eq!(a.as_bytes().as_ptr(), b.as_bytes().as_ptr());
        // Beyond what is kept: values as usual, each with its own bytes.
        let long = format!("\"{}\";q=1;w=1", "x".repeat(MAX_INTERNED_LEN));
        let (c, d) = (field_value(&long).unwrap(), field_value(&long).unwrap());
        assert_eq!(c, long.as_str());
        assert_ne!(c.as_bytes().as_ptr(), d.as_bytes().as_ptr());
        // Bytes a header may carry but `from_static` refuses: no panic, a value as usual.
        let obs = "\"caf\u{e9}\";q=1;w=1";
        assert_eq!(field_value(obs).unwrap().as_bytes(), obs.as_bytes());
        // Bytes no header may carry: none.
        assert!(field_value("\"a\nb\";q=1;w=1").is_none());
    }

    #[test]
    fn build_validates() {
        let err = |rules: Vec<Rule>| {
            let mut b = Limiter::builder(MemoryStore::new());
            for r in rules {
                b = b.rule(r);
            }
            b.build().unwrap_err()
        };
        assert!(matches!(
            err(vec![Rule::new("a b").policy(p(1))]),
            LimiterError::InvalidRuleName(_)
        ));
        assert!(matches!(
            err(vec![Rule::new("a")]),
            LimiterError::NoPolicy(_)
        ));
        assert!(matches!(
            err(vec![
                Rule::new("a").policy(p(1)),
                Rule::new("a").policy(p(1))
            ]),
            LimiterError::DuplicateRule(_)
        ));
        let tiers = || Tiers::new(|_: String| async { None });
        assert!(matches!(
            err(vec![
                Rule::new("a").policy(p(1)).tiers(tiers().tier("x", [p(1)]))
            ]),
            LimiterError::PoliciesAndTiers(_)
        ));
        for t in [
            tiers(),
            tiers().tier("x", []),
            tiers().tier("x", [p(1)]).tier("x", [p(2)]),
            tiers().tier("x", [p(1)]).default_tier("y"),
            tiers().tier("x y", [p(1)]),
        ] {
            let e = err(vec![Rule::new("a").tiers(t)]);
            assert!(matches!(e, LimiterError::InvalidTiers { .. }), "{e}");
        }
    }

    #[test]
    fn fields_and_names() {
        let limiter = Limiter::builder(MemoryStore::new())
            .rule(Rule::new("one").policy(p(10)))
            .rule(
                Rule::new("two").policies([
                    p(5),
                    Policy::gcra(crate::Rate::per_second(2), 4)
                        .unwrap()
                        .named("burst")
                        .unwrap(),
                ]),
            )
            .build()
            .unwrap();
        assert_eq!(&*limiter.set(0, 0).field, "\"one\";q=10;w=60");
        // An "unlimited" policy: the quota is sent as the largest Structured Field integer.
        let unlimited = Limiter::builder(MemoryStore::new())
            .rule(Rule::new("free").policy(p(u64::MAX)))
            .build()
            .unwrap();
        assert_eq!(
            &*unlimited.set(0, 0).field,
            "\"free\";q=999999999999999;w=60"
        );
        assert_eq!(
            &*limiter.set(1, 0).field,
            "\"two.0\";q=5;w=60, \"burst\";q=4;w=2"
        );
        let applied = [
            Applied {
                rule: 0,
                set: 0,
                #[cfg(feature = "metrics")]
                cost: 1,
            },
            Applied {
                rule: 1,
                set: 0,
                #[cfg(feature = "metrics")]
                cost: 1,
            },
        ];
        assert_eq!(
            limiter.locate(&applied, 2).map(|(r, p)| (r, &**p)),
            Some(("two", "burst"))
        );
        assert!(limiter.locate(&applied, 3).is_none());
    }

    #[test]
    fn long_keys_are_hashed_and_bounded() {
        let long = Key::from("k".repeat(10_000));
        let a = store_key("rule", &long);
        assert!(a.len() <= MAX_KEY_LEN);
        assert!(a.as_str().starts_with("%#"), "{a}");
        assert!(a.as_str().ends_with("@rule"), "{a}");
        assert_eq!(a, store_key("rule", &long));
        assert_ne!(a, store_key("rule", &Key::from("k".repeat(10_001))));
        assert_ne!(a, store_key("rule2", &long));
        // SHA-256, the same in every process and build: instances sharing a Redis agree.
        assert_eq!(
            store_key("r", &Key::from("x".repeat(200))).as_str(),
            "%#aa20c23e3201834050679e1d88941b9a@r"
        );
        assert_eq!(store_key("r", &Key::from("x")).as_str(), "x@r");
        // A client's short key cannot spell a hashed one.
        let spelled = store_key("rule", &Key::from(&a.as_str()[..a.len() - 5]));
        assert_ne!(spelled, a);
    }

    /// The one-rule shortcut of `start` answers as the general plan does: the same refusals
    /// for a missing key, the same skips, and the same store key (also when hashed).
    #[test]
    fn the_single_rule_shortcut_matches_the_plan() {
        let store = MemoryStore::with_clock(crate::clock::ManualClock::new());
        let rule = |missing| {
            Rule::new("k")
                .method(Method::GET)
                .key(Header::from_static("x-a"))
                .on_missing_key(missing)
                .policy(p(1))
        };
        // A second rule that never applies sends the same requests down the general path.
        let build = |missing, general: bool| {
            let mut b = Limiter::builder(store.clone()).rule(rule(missing));
            if general {
                b = b.rule(Rule::new("never").method(Method::PATCH).policy(p(1)));
            }
            let limiter = b.build().unwrap();
            assert_eq!(limiter.single, !general);
            limiter
        };
        let request = |method: Method, key: Option<String>| {
            let mut r = http::Request::builder().method(method).uri("/");
            if let Some(k) = key {
                r = r.header("x-a", k);
            }
            r.body(()).unwrap().into_parts().0
        };
        let outcome =
            |start: Start<std::future::Ready<Result<Decision, crate::StoreError>>>| match start {
                Start::NoKey(n) => format!("no key {}", n.status),
                Start::Unchecked { shadow } => format!("unchecked {}", shadow.is_none()),
                Start::Checking { check, applied, .. } => {
                    let d = check.into_inner().unwrap();
                    format!("{} {:?}", d.allowed(), applied.len())
                }
                Start::Resolving { .. } => "resolving".into(),
            };
        let reject = MissingKey::Reject(StatusCode::UNAUTHORIZED);
        for general in [false, true] {
            let strict = build(reject, general);
            assert_eq!(
                outcome(strict.start(&request(Method::GET, None), &DecisionSpan::new())),
                "no key 401 Unauthorized"
            );
            assert_eq!(
                outcome(strict.start(&request(Method::POST, None), &DecisionSpan::new())),
                "unchecked true"
            );
            let lenient = build(MissingKey::Skip, general);
            assert_eq!(
                outcome(lenient.start(&request(Method::GET, None), &DecisionSpan::new())),
                "unchecked true"
            );
        }
        // Both paths count against one store key, a short one and a hashed long one.
        for key in ["short".to_string(), "x".repeat(500)] {
            let single = build(reject, false);
            let general = build(reject, true);
            let get = || request(Method::GET, Some(key.clone()));
            assert_eq!(
                outcome(single.start(&get(), &DecisionSpan::new())),
                "true 1"
            );
            assert_eq!(
                outcome(general.start(&get(), &DecisionSpan::new())),
                "false 1"
            );
        }
    }

    fn request(method: Method, headers: &[(&str, &str)]) -> Parts {
        let mut r = http::Request::builder().method(method).uri("/");
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.body(()).unwrap().into_parts().0
    }

    fn decide(limiter: &Limiter<MemoryStore<crate::clock::ManualClock>>, parts: &Parts) -> String {
        match limiter.start(parts, &DecisionSpan::new()) {
            Start::NoKey(n) => format!("no key {}", n.status.as_u16()),
            Start::Unchecked { .. } => "unchecked".into(),
            Start::Checking { check, .. } => match check.into_inner() {
                Ok(d) => format!("allowed {}", d.allowed()),
                Err(e) => format!("error {e}"),
            },
            Start::Resolving { .. } => "resolving".into(),
        }
    }

    fn manual_store() -> MemoryStore<crate::clock::ManualClock> {
        MemoryStore::with_clock(crate::clock::ManualClock::new())
    }

    /// A shadow rule never refuses: without a key it is skipped, whatever its `MissingKey`.
    #[test]
    fn a_shadow_rule_without_a_key_is_skipped() {
        let limiter = Limiter::builder(manual_store())
            .rule(Rule::new("global").policy(p(100)))
            .rule(
                Rule::new("candidate")
                    .key(Header::from_static("x-api-key"))
                    .policy(p(1))
                    .shadow(),
            )
            .build()
            .unwrap();
        let parts = request(Method::GET, &[]);
        assert_eq!(decide(&limiter, &parts), "allowed true");
        let plan = limiter.plan(&parts).ok().unwrap();
        assert!(plan.shadow.is_empty());
        // With a key, it is planned as before.
        let keyed = request(Method::GET, &[("x-api-key", "k")]);
        assert_eq!(limiter.plan(&keyed).ok().unwrap().shadow.len(), 1);
    }

    /// A rule on GET applies to HEAD too (axum's `get` serves both), unless it asks for exact
    /// methods.
    #[test]
    fn a_get_rule_counts_head() {
        let build = |exact: bool| {
            let mut rule = Rule::new("export").method(Method::GET).policy(p(1));
            if exact {
                rule = rule.exact_methods();
            }
            Limiter::builder(manual_store()).rule(rule).build().unwrap()
        };
        let limiter = build(false);
        assert_eq!(
            decide(&limiter, &request(Method::HEAD, &[])),
            "allowed true"
        );
        assert_eq!(
            decide(&limiter, &request(Method::HEAD, &[])),
            "allowed false"
        );
        assert_eq!(
            decide(&limiter, &request(Method::GET, &[])),
            "allowed false"
        );
        assert_eq!(decide(&limiter, &request(Method::POST, &[])), "unchecked");
        let exact = build(true);
        assert_eq!(decide(&exact, &request(Method::HEAD, &[])), "unchecked");
        assert_eq!(decide(&exact, &request(Method::GET, &[])), "allowed true");
    }

    /// Rule names may hold `:`, and keys anything: no two (rule, key) pairs share state.
    #[test]
    fn rules_and_keys_never_share_a_store_key() {
        let key = |v: &'static str| move |_: &Parts| Some(v);
        let limiter = Limiter::builder(manual_store())
            .rule(Rule::new("a").key(key("b:c")).policy(p(1)))
            .rule(Rule::new("a:b").key(key("c")).policy(p(1)))
            .rule(Rule::new("x").key(key("y@z")).policy(p(1)))
            .rule(Rule::new("z").key(key("x@y")).policy(p(1)))
            .build()
            .unwrap();
        let parts = request(Method::GET, &[]);
        let plan = limiter.plan(&parts).ok().unwrap();
        let keys: Vec<&str> = plan.enforced.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, ["b:c@a", "c@a:b", "y@z@x", "x@y@z"]);
        // Each rule counts once: one request fits every limit of 1.
        assert_eq!(decide(&limiter, &parts), "allowed true");
        assert_eq!(decide(&limiter, &parts), "allowed false");
    }

    /// A store that refuses keys the limiter makes is refused at build time, not answered 503
    /// per request.
    #[test]
    fn a_store_with_too_short_keys_is_refused_at_build() {
        let short = MemoryStore::builder().max_key_len(MAX_KEY_LEN - 1).build();
        let err = Limiter::builder(short)
            .rule(Rule::new("a").policy(p(1)))
            .build()
            .unwrap_err();
        assert_eq!(
            err,
            LimiterError::StoreKeyTooShort {
                max: MAX_KEY_LEN - 1,
                longest: MAX_KEY_LEN
            }
        );
        assert!(err.to_string().contains("max_key_len"));
        let enough = MemoryStore::builder().max_key_len(MAX_KEY_LEN).build();
        assert!(
            Limiter::builder(enough)
                .rule(Rule::new("a").policy(p(1)))
                .build()
                .is_ok()
        );
    }

    #[test]
    fn plans_skip_reject_and_cost() {
        let limiter = Limiter::builder(MemoryStore::new())
            .rule(
                Rule::new("skip")
                    .key(Header::from_static("x-a"))
                    .on_missing_key(MissingKey::Skip)
                    .policy(p(3)),
            )
            .rule(Rule::new("post").method(Method::POST).policy(p(3)))
            .rule(Rule::new("heavy").cost(100).policy(p(3)).shadow())
            .build()
            .unwrap();
        let parts = http::Request::get("/").body(()).unwrap().into_parts().0;
        let plan = limiter.plan(&parts).ok().unwrap();
        assert!(plan.enforced.is_empty());
        assert_eq!(plan.shadow.len(), 1);
        let checks = limiter.checks(&plan.shadow);
        assert_eq!(checks[0].cost(), 3); // clamped to the limit
        let strict = Limiter::builder(MemoryStore::new())
            .rule(
                Rule::new("key")
                    .key(Header::from_static("x-a"))
                    .policy(p(3)),
            )
            .build()
            .unwrap();
        let no_key = strict.plan(&parts).err().unwrap();
        assert_eq!(no_key.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
