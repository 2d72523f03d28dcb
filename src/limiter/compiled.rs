//! A rule compiled once: its matcher, policy sets, metrics and interned RateLimit field values.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use http::request::Parts;
use http::{HeaderValue, Method};
use smallvec::SmallVec;

use super::build::{LimiterError, valid_name};
use super::path::RequestPath;
use super::rule::{Cost, MissingKey, Route, Rule};
use super::tier::TierLookup;
use crate::answer::StatusField;
use crate::key::KeyExtractor;
use crate::telemetry::Counter;
use crate::{MAX_NAME_LEN, Policy};

/// A rule ready to run.
pub(crate) struct CompiledRule {
    pub(crate) name: Arc<str>,
    /// `@name`, the end of every store key of the rule.
    pub(super) suffix: Box<str>,
    methods: SmallVec<[Method; 2]>,
    route: Route,
    pub(super) key: Box<dyn KeyExtractor>,
    pub(super) cost: Cost,
    pub(super) missing: MissingKey,
    pub(crate) shadow: bool,
    /// One set of policies, or one per tier.
    pub(crate) sets: Box<[PolicySet]>,
    /// Behind an `Arc`: a request whose tier is being looked up holds it (the lookup's
    /// future outlives `call()`).
    pub(super) tiers: Option<Arc<TierLookup>>,
    /// `tollgate_decisions_total` for the requests the rule admitted (for a shadow rule: would
    /// have), refused without a key, and could not decide.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(super) admitted: Counter,
    /// Admissions by the store's failure policy (fail open, or the local fallback): the
    /// store did not decide.
    pub(super) failure_policy: Counter,
    pub(super) no_key: Counter,
    pub(super) store_error: Counter,
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
    pub(super) limited: Counter,
    pub(super) shadow_limited: Counter,
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(super) cost: Counter,
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
    pub(super) fn compile(rule: Rule) -> Result<Self, LimiterError> {
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
                (sets, Some(Arc::new(tiers.into_resolved(&name, default))))
            }
        };
        #[cfg(feature = "axum")]
        if let Route::Template(template) = &rule.route {
            if let Some(suggested) = super::rule::old_route_syntax(template) {
                return Err(LimiterError::OldRouteSyntax {
                    rule: rule.name,
                    route: template.to_string(),
                    suggested,
                });
            }
        }
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
    pub(super) fn matches(&self, parts: &Parts, path: &RequestPath<'_>) -> bool {
        (self.methods.is_empty() || self.methods.contains(&parts.method))
            && self.route.matches(parts, path)
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
        // The same policy twice is one state in the store, counted twice per request: half
        // the limit, and a cost above half of it never admitted.
        for (j, policy) in policies.iter().enumerate() {
            if let Some(i) = policies[..j].iter().position(|p| p.id() == policy.id()) {
                return Err(LimiterError::DuplicatePolicy {
                    rule: rule.to_owned(),
                    tier: tier.map(str::to_owned),
                    first: i,
                    again: j,
                });
            }
        }
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
