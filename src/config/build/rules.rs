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
        let tiers = spec
            .tiers
            .as_ref()
            .map(|t| self.tiers(t, &format!("{path}.tiers"), spec.cost.unwrap_or(1)));
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

    fn tiers(&mut self, spec: &TiersConfig, path: &str, cost: u64) -> Option<Tiers> {
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
        let mut tiers = Tiers::new(ListedThenResolved {
            listed: spec.keys.clone(),
            resolver,
        });
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
