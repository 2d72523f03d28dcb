//! The `[[rules]]` section: each rule's matching part (methods, route, key), its policies, and
//! its tiers.

use std::collections::BTreeSet;
use std::sync::Arc;

use http::{Method, StatusCode};

use super::Builder;
use super::bindings::ListedThenResolved;
use super::policy::policy;
use crate::Policy;
use crate::config::Problems;
use crate::config::schema::*;
use crate::limiter::{MissingKey, Rule, Tiers};

impl<'a> Builder<'a> {
    /// The matching part of a rule: name, methods, route, key and missing-key answer.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matching(
        &mut self,
        path: &str,
        name: &str,
        methods: &[String],
        exact: bool,
        routes: [(&str, Option<&String>); 3],
        key: Option<&'a String>,
        missing: Option<MissingKeyConfig>,
    ) -> Option<Rule> {
        let mut rule = Rule::new(name);
        if !crate::limiter::valid_name(name) {
            self.problems.add(
                format!("{path}.name"),
                if name.is_empty() {
                    "missing: every rule has a name".to_owned()
                } else {
                    format!("{name:?}: use 1 to 64 of a-z A-Z 0-9 - _ . :")
                },
            );
        }
        for (i, method) in methods.iter().enumerate() {
            match Method::from_bytes(method.to_ascii_uppercase().as_bytes()) {
                Ok(m) => rule = rule.method(m),
                Err(_) => self.problems.add(
                    format!("{path}.methods[{i}]"),
                    format!("not a method: {method:?}"),
                ),
            }
        }
        if exact {
            rule = rule.exact_methods();
        }
        let set: Vec<_> = routes.iter().filter(|(_, v)| v.is_some()).collect();
        if set.len() > 1 {
            self.problems.add(
                format!("{path}.{}", set[1].0),
                format!(
                    "give one of path, path_prefix and route, not {} too",
                    set[0].0
                ),
            );
        }
        for (field, value) in routes {
            let Some(value) = value else { continue };
            if !value.starts_with('/') {
                self.problems.add(
                    format!("{path}.{field}"),
                    format!("{value:?}: a path starts with /"),
                );
                continue;
            }
            rule = match field {
                "path" => rule.path(value.as_str()),
                "path_prefix" => rule.path_prefix(value.as_str()),
                _ => route(rule, value, path, &mut self.problems),
            };
        }
        let key = self.rule_key(key, &format!("{path}.key"));
        if let Some(missing) = missing {
            rule = rule.on_missing_key(match missing {
                MissingKeyConfig::Skip(_) => MissingKey::Skip,
                MissingKeyConfig::Reject(status) => match StatusCode::from_u16(status) {
                    Ok(status) if status.is_client_error() || status.is_server_error() => {
                        MissingKey::Reject(status)
                    }
                    _ => {
                        self.problems.add(
                            format!("{path}.on_missing_key"),
                            format!("{status}: give \"skip\" or a status from 400 to 599"),
                        );
                        MissingKey::default()
                    }
                },
            });
        }
        Some(rule.key(key?))
    }

    /// A rate-limit rule.
    pub(super) fn rule(&mut self, i: usize, spec: &'a RuleConfig) -> Option<Rule> {
        let path = format!("rules[{i}]");
        let rule = self.matching(
            &path,
            &spec.name,
            &spec.methods,
            spec.exact_methods,
            [
                ("path", spec.path.as_ref()),
                ("path_prefix", spec.path_prefix.as_ref()),
                ("route", spec.route.as_ref()),
            ],
            spec.key.as_ref(),
            spec.on_missing_key,
        );
        let policies = policies(
            &spec.policies,
            &format!("{path}.policies"),
            &mut self.problems,
        );
        let tiers = spec.tiers.as_ref().map(|t| {
            let key = spec.key.as_deref();
            self.tiers(t, &format!("{path}.tiers"), spec.cost.unwrap_or(1), key)
        });
        match (&spec.tiers, spec.policies.is_empty()) {
            (None, true) => self.problems.add(
                format!("{path}.policies"),
                "missing: give policies or tiers",
            ),
            (Some(_), false) => self
                .problems
                .add(format!("{path}.tiers"), "give policies or tiers, not both"),
            _ => {}
        }
        let cost = spec.cost.unwrap_or(1);
        duplicates(&policies, &format!("{path}.policies"), &mut self.problems);
        for (j, p) in policies.iter().enumerate() {
            if let Some(p) = p {
                self.redis_runs(p, &format!("{path}.policies[{j}]"));
                if cost > p.limit() {
                    self.problems.add(
                        format!("{path}.cost"),
                        format!(
                            "{cost} is more than the limit of policies[{j}] ({}), which would \
                             refuse every request",
                            p.limit()
                        ),
                    );
                }
            }
        }
        let mut rule = rule?.cost(cost);
        for policy in policies {
            rule = rule.policy(policy?);
        }
        if let Some(tiers) = tiers {
            rule = rule.tiers(tiers?);
        }
        if spec.shadow {
            rule = rule.shadow();
        }
        Some(rule)
    }

    /// Whether the Redis store, when the file names it, can run `policy` exactly (its
    /// arithmetic bounds the limits and spans); a problem at `path` if not.
    fn redis_runs(&mut self, policy: &Policy, path: &str) {
        #[cfg(feature = "redis")]
        if self.config.store.kind == StoreKind::Redis {
            if let Err(e) = crate::RedisStore::supports(policy) {
                self.problems
                    .add(path, format!("the Redis store cannot run it: {e}"));
            }
        }
        #[cfg(not(feature = "redis"))]
        let _ = (policy, path);
    }

    fn tiers(
        &mut self,
        spec: &TiersConfig,
        path: &str,
        cost: u64,
        key: Option<&str>,
    ) -> Option<Tiers> {
        let resolver = match (&spec.resolver, self.bindings) {
            (Some(name), Some(bindings)) => match bindings.resolvers.get(name) {
                Some(resolver) => Some(Arc::clone(resolver)),
                None => {
                    self.problems.add(
                        format!("{path}.resolver"),
                        format!("no tier resolver is bound to {name:?} in code"),
                    );
                    None
                }
            },
            _ => None,
        };
        if spec.resolver.is_none() && spec.keys.is_empty() {
            self.problems.add(
                format!("{path}.resolver"),
                "missing: name a resolver bound in code, or list keys",
            );
        }
        if spec.plans.is_empty() {
            self.problems.add(
                format!("{path}.plans"),
                "missing: declare at least one tier",
            );
        }
        let names: BTreeSet<&str> = spec.plans.iter().map(|p| p.name.as_str()).collect();
        // The keys themselves (API keys, often) stay out of the report, which gets logged.
        for (i, (_, tier)) in spec.keys.iter().enumerate() {
            if !names.contains(tier.as_str()) {
                self.problems.add(
                    format!("{path}.keys"),
                    format!(
                        "entry {} (in key order) names {tier:?}, which is not among the plans",
                        i + 1
                    ),
                );
            }
        }
        if let Some(default) = &spec.default {
            if !names.contains(default.as_str()) {
                self.problems.add(
                    format!("{path}.default"),
                    format!("no tier named {default:?} among the plans"),
                );
            }
        }
        // Each listed key as the rule's extractor writes it (the resolver's text), so that a
        // key listed as requests carry it (`k%1`, an `any_of` fallback's address) matches.
        let mut listed = std::collections::BTreeMap::new();
        for (i, (written, tier)) in spec.keys.iter().enumerate() {
            match listed_key_text(&self.config.keys, key, written, 0) {
                Ok(text) => {
                    listed.insert(text, tier.clone());
                }
                Err(why) => self.problems.add(
                    format!("{path}.keys"),
                    format!("entry {} (in key order): {why}", i + 1),
                ),
            }
        }
        let mut tiers = Tiers::new(ListedThenResolved { listed, resolver });
        let mut seen = BTreeSet::new();
        for (i, plan) in spec.plans.iter().enumerate() {
            let plan_path = format!("{path}.plans[{i}]");
            if !crate::limiter::valid_name(&plan.name) {
                self.problems.add(
                    format!("{plan_path}.name"),
                    format!("{:?}: use 1 to 64 of a-z A-Z 0-9 - _ . :", plan.name),
                );
            } else if !seen.insert(plan.name.as_str()) {
                self.problems.add(
                    format!("{plan_path}.name"),
                    format!("two tiers are named {:?}", plan.name),
                );
            }
            if plan.policies.is_empty() {
                self.problems.add(
                    format!("{plan_path}.policies"),
                    "missing: a tier needs a policy",
                );
            }
            let policies = policies(
                &plan.policies,
                &format!("{plan_path}.policies"),
                &mut self.problems,
            );
            duplicates(
                &policies,
                &format!("{plan_path}.policies"),
                &mut self.problems,
            );
            for (j, p) in policies.iter().enumerate() {
                if let Some(p) = p {
                    self.redis_runs(p, &format!("{plan_path}.policies[{j}]"));
                    if cost > p.limit() {
                        self.problems.add(
                            format!("{plan_path}.policies[{j}]"),
                            format!(
                                "its limit ({}) is below the rule's cost ({cost}), which would \
                                 refuse every request of the tier",
                                p.limit()
                            ),
                        );
                    }
                }
            }
            tiers = tiers.tier(plan.name.as_str(), policies.into_iter().flatten());
        }
        if let Some(default) = &spec.default {
            tiers = tiers.default_tier(default.as_str());
        }
        if let Some(ttl) = spec.cache_for {
            tiers = tiers.cache_for(ttl.get());
        }
        if let Some(timeout) = spec.timeout {
            tiers = tiers.timeout(timeout.get());
        }
        if let Some(capacity) = spec.cache_capacity {
            if capacity == 0 {
                self.problems
                    .add(format!("{path}.cache_capacity"), "must be at least 1");
            }
            tiers = tiers.cache_capacity(capacity);
        }
        Some(tiers)
    }
}

#[cfg(feature = "axum")]
pub(super) fn route(rule: Rule, template: &str, path: &str, p: &mut Problems) -> Rule {
    if let Some(suggested) = crate::limiter::old_route_syntax(template) {
        p.add(
            format!("{path}.route"),
            format!(
                "{template:?} is axum 0.7's syntax, which axum 0.8 never matches: write \
                 {suggested:?}"
            ),
        );
    }
    rule.route(template)
}

#[cfg(not(feature = "axum"))]
pub(super) fn route(rule: Rule, _: &str, path: &str, p: &mut Problems) -> Rule {
    p.add(
        format!("{path}.route"),
        "route templates need tollgate's feature `axum`; use path or path_prefix",
    );
    rule
}

/// The text the extractor of the key named `key` (`None`: global) writes for the request a
/// tier's listed key describes, as the request carries it: the value (`k%1`); for `all_of`,
/// the values joined by `/` (the last takes the rest); for `any_of`, the first key's value, or
/// another's as `name=value`. `Err` says why the listed key cannot be one of the key's.
fn listed_key_text(
    keys: &std::collections::BTreeMap<String, KeyConfig>,
    key: Option<&str>,
    written: &str,
    depth: usize,
) -> Result<String, String> {
    use crate::key::Key;
    let value = |v: &str| Key::from(v).as_str().to_owned();
    let Some(spec) = key.and_then(|name| keys.get(name)) else {
        return Ok(value(written));
    };
    if depth > 16 {
        return Err("keys nested too deep".into());
    }
    match spec.kind {
        KeyKind::AllOf => {
            let n = spec.of.len();
            let parts: Vec<&str> = written.splitn(n, '/').collect();
            if parts.len() != n {
                return Err(format!(
                    "an all_of key of {n} parts is written as {n} values joined by /"
                ));
            }
            // And(a, And(b, c)): each part but the last with its `%` and `/` escaped.
            let mut text = listed_key_text(keys, Some(&spec.of[n - 1]), parts[n - 1], depth + 1)?;
            for i in (0..n - 1).rev() {
                let first = listed_key_text(keys, Some(&spec.of[i]), parts[i], depth + 1)?;
                let first = if first.contains(['/', '%']) {
                    first.replace('%', "%25").replace('/', "%2F")
                } else {
                    first
                };
                text = format!("{first}/{text}");
            }
            Ok(text)
        }
        KeyKind::AnyOf => {
            let n = spec.of.len();
            let (branch, rest) = match written.split_once('=') {
                Some((name, rest)) if spec.of.iter().any(|k| k == name) => {
                    (spec.of.iter().position(|k| k == name).unwrap_or(0), rest)
                }
                _ => (0, written),
            };
            // Or(a, Or(b, c)): the i-th key's text behind i second-branch tags; a first
            // branch's text that starts as a tag gets the first branch's.
            let mut text = listed_key_text(keys, Some(&spec.of[branch]), rest, depth + 1)?;
            if branch + 1 < n && text.starts_with("%|") {
                text = format!("%|0|{text}");
            }
            let tags = if branch + 1 < n { branch } else { n - 1 };
            Ok(format!("{}{text}", "%|1|".repeat(tags)))
        }
        _ => Ok(value(written)),
    }
}

/// A problem at each policy of a list that repeats an earlier one (the same algorithm,
/// numbers and name): one state in the store, which every request would count twice against.
fn duplicates(policies: &[Option<Policy>], path: &str, p: &mut Problems) {
    for (j, policy) in policies.iter().enumerate() {
        let Some(policy) = policy else { continue };
        let first = policies[..j]
            .iter()
            .position(|other| other.as_ref().is_some_and(|o| o.id() == policy.id()));
        if let Some(i) = first {
            p.add(
                format!("{path}[{j}]"),
                format!(
                    "the same policy as {path}[{i}]: every request would count twice against \
                     it; list it once, or give the two names of their own"
                ),
            );
        }
    }
}

/// The policies of a list, each `None` after a problem.
pub(super) fn policies(
    specs: &[PolicyConfig],
    path: &str,
    p: &mut Problems,
) -> Vec<Option<Policy>> {
    specs
        .iter()
        .enumerate()
        .map(|(i, spec)| policy(spec, &format!("{path}[{i}]"), p))
        .collect()
}
