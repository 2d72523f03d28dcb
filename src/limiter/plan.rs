//! The built limiter: rules compiled once, and the plan of checks for one request.

use std::fmt::Write as _;

use http::StatusCode;
use http::request::Parts;
use smallvec::SmallVec;

use super::build::Limiter;
use super::compiled::{CompiledRule, PolicySet};
use super::path::RequestPath;
use super::rule::MissingKey;
use crate::key::{Key, MAX_KEY_LEN};
use crate::store::{Check, Store};
use crate::telemetry::DecisionSpan;
use crate::{Decision, Policy};

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
    /// Whether an enforced rule waits for its tier (a shadow rule never holds a request: see
    /// [`Limiter::check_shadow`]).
    unresolved: bool,
}

/// A check whose cost is above its policy's limit: no wait would ever admit it, so the request
/// is refused as over that limit (429, with no time to come back at), without asking the
/// store, and consumes nothing.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Costly {
    /// The check's index in the stack of the rules that applied.
    pub(crate) index: usize,
    /// The policy's limit.
    pub(crate) limit: u64,
}

impl Costly {
    /// The decision of such a check: refused, nothing remaining, and a wait that never ends
    /// (`u64::MAX` ns); for the shadow rules' reports. An enforced refusal sends no wait.
    pub(crate) fn decision(self) -> Decision {
        Decision::rejected(
            self.limit,
            0,
            std::time::Duration::ZERO,
            std::time::Duration::MAX,
        )
        .with_index(self.index)
    }
}

/// What the shadow rules make of a request the enforced ones admitted.
pub(crate) enum ShadowCheck<F> {
    /// None of them applies (or their tiers are being looked up).
    Nothing,
    /// The store was asked.
    Checking(F, SmallVec<[Applied; 4]>),
    /// One of them could never admit it.
    Costly(Costly, SmallVec<[Applied; 4]>),
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
    /// The request costs more than the policy's limit.
    Costly { costly: Costly, applied: Applied },
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
    /// An enforced rule's tier must be looked up first (one lookup per key at a time: this
    /// request's, or another's that it waits for).
    Resolving {
        plan: Box<Plan>,
        at: usize,
        answer: super::tier::TierOf,
    },
    /// A rule found no key and refuses the request.
    NoKey(NoKey),
    /// An enforced check costs more than its policy's limit.
    Costly {
        costly: Costly,
        applied: SmallVec<[Applied; 4]>,
    },
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

impl Plan {
    /// Records the tier found for the enforced rule planned at `i`.
    pub(crate) fn resolved(&mut self, i: usize, tier: u16) {
        if let Some(planned) = self.enforced.get_mut(i) {
            planned.set = Some(tier);
            planned.raw = None;
        }
    }
}

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
            Single::Costly { costly, applied } => {
                let mut list = SmallVec::new();
                list.push(applied);
                Start::Costly {
                    costly,
                    applied: list,
                }
            }
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
        if !rule.matches(parts, &RequestPath::of(parts)) {
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
        let applied = Applied {
            rule: 0,
            set: 0,
            #[cfg(feature = "metrics")]
            cost,
        };
        if cost > policy.limit() {
            return Single::Costly {
                costly: Costly {
                    index: 0,
                    limit: policy.limit(),
                },
                applied,
            };
        }
        Single::Checked {
            check: self.store.check(key.as_str(), policy, cost),
            applied,
        }
    }

    /// The one policy of a `single` limiter, its set and its rule.
    #[inline(always)]
    pub(crate) fn single(&self) -> Option<(&CompiledRule, &PolicySet, &Policy)> {
        let rule = self.rules.first()?;
        let set = rule.sets.first()?;
        Some((rule, set, set.policies.first()?))
    }

    /// Goes on with a plan whose tier was just resolved.
    pub(crate) fn resume(&self, mut plan: Box<Plan>, span: &DecisionSpan) -> Start<St::Future> {
        self.proceed(&mut plan, span)
    }

    #[inline]
    fn proceed(&self, plan: &mut Plan, span: &DecisionSpan) -> Start<St::Future> {
        if plan.unresolved {
            if let Some((i, answer)) = self.next_unresolved(&mut *plan) {
                return Start::Resolving {
                    plan: Box::new(std::mem::take(plan)),
                    at: i,
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
                if one.cost > policy.limit() {
                    let limit = policy.limit();
                    let costly = Costly { index: 0, limit };
                    return Start::Costly { costly, applied };
                }
                self.store.check(one.key.as_str(), policy, one.cost)
            }
            enforced => match self.checks(enforced) {
                Ok(checks) => self.store.check_all(&checks),
                Err(costly) => return Start::Costly { costly, applied },
            },
        };
        Start::Checking {
            check,
            applied,
            shadow,
        }
    }

    /// Asks the store about the shadow rules of a request the enforced ones admitted. A shadow
    /// rule never holds a request up: one whose tier for the key is not known yet skips this
    /// request, and the key's tier is looked up in the background (on the tokio runtime, in
    /// the rule's single flight), for the key's next requests.
    pub(crate) fn check_shadow(&self, shadow: &mut ShadowPlan) -> ShadowCheck<St::Future> {
        shadow.retain_mut(|planned| {
            if planned.set.is_some() {
                return true;
            }
            let tiers = self
                .rules
                .get(usize::from(planned.rule))
                .and_then(|r| r.tiers.as_ref());
            if let Some(tiers) = tiers {
                let raw = planned.raw.take().unwrap_or_default();
                tiers.look_up_in_background(planned.key.as_str(), raw);
            }
            false
        });
        if shadow.is_empty() {
            return ShadowCheck::Nothing;
        }
        let applied = applied(shadow);
        match self.checks(shadow) {
            Ok(checks) => ShadowCheck::Checking(self.store.check_all(&checks), applied),
            Err(costly) => ShadowCheck::Costly(costly, applied),
        }
    }

    /// The rules that apply to this request, with keys, costs and (cached) tiers.
    #[inline]
    fn fill(&self, parts: &Parts, plan: &mut Plan) -> Result<(), NoKey> {
        // Read (and, if it must be, decoded) once, by the first rule on a path.
        let path = RequestPath::of(parts);
        for (index, rule) in self.rules.iter().enumerate() {
            if !rule.matches(parts, &path) {
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
                    // A shadow rule's tier is looked up only once the enforced rules admitted
                    // the request (see `check_shadow`).
                    None => {
                        plan.unresolved |= !rule.shadow;
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

    /// The first enforced rule whose tier is not known yet, and its tier to come: the rule's
    /// lookup of the key, shared with the requests for the same key under way (single flight;
    /// see [`TierLookup::tier_of`](super::TierLookup::tier_of)), which remembers the answer.
    fn next_unresolved(&self, plan: &mut Plan) -> Option<(usize, super::tier::TierOf)> {
        let i = plan.enforced.iter().position(|p| p.set.is_none())?;
        let planned = &mut plan.enforced[i];
        let tiers = self.rules.get(usize::from(planned.rule))?.tiers.as_ref()?;
        let raw = planned.raw.take().unwrap_or_default();
        let answer = tiers.tier_of_owned(planned.key.as_str().into(), raw);
        Some((i, answer))
    }

    /// The store checks of some planned rules (all resolved), in order: each rule's policies
    /// in turn; or the first whose cost is above its policy's limit.
    #[inline]
    pub(crate) fn checks<'a>(&'a self, planned: &'a [Planned]) -> Result<Checks<'a>, Costly> {
        let mut checks = Checks::new();
        for p in planned {
            let set = self.set(p.rule, p.set.unwrap_or(0));
            // The key the extractor found, without the rule's name, places the check.
            let placed_by = self
                .rules
                .get(usize::from(p.rule))
                .map_or(usize::MAX, |r| p.key.len().saturating_sub(r.suffix.len()));
            for policy in set.policies.iter() {
                if p.cost > policy.limit() {
                    let index = checks.len();
                    let limit = policy.limit();
                    return Err(Costly { index, limit });
                }
                checks.push(Check::new(p.key.as_str(), policy, p.cost).placed_by(placed_by));
            }
        }
        Ok(checks)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Decision;
    use crate::MemoryStore;
    use crate::key::Header;
    use crate::limiter::Tiers;
    use crate::limiter::build::LimiterError;
    use crate::limiter::compiled::{MAX_INTERNED_LEN, field_value};
    use crate::limiter::rule::Rule;
    use http::Method;
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
        // The same policy twice in a rule or a tier (not in two tiers, nor under two names).
        let e = err(vec![Rule::new("a").policies([p(5), p(6), p(5)])]);
        assert_eq!(
            e,
            LimiterError::DuplicatePolicy {
                rule: "a".into(),
                tier: None,
                first: 0,
                again: 2
            }
        );
        assert!(e.to_string().contains("policies 0 and 2"), "{e}");
        let e = err(vec![
            Rule::new("a").tiers(tiers().tier("x", [p(1)]).tier("y", [p(2), p(2)])),
        ]);
        assert!(
            matches!(&e, LimiterError::DuplicatePolicy { tier: Some(t), .. } if t == "y"),
            "{e}"
        );
        assert!(
            Limiter::builder(MemoryStore::new())
                .rule(Rule::new("a").tiers(tiers().tier("x", [p(1)]).tier("y", [p(1)])))
                .rule(Rule::new("b").policies([p(1), p(1).named("other").unwrap()]))
                .build()
                .is_ok()
        );
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
                Start::Costly { .. } => "costly".into(),
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
            Start::Costly { costly, .. } => format!("costly {}", costly.index),
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
        // A cost above the limit is never asked of the store.
        let costly = limiter.checks(&plan.shadow).err().unwrap();
        assert_eq!((costly.index, costly.limit), (0, 3));
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
