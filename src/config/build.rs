//! From a [`Config`] to layers: every value checked, every problem reported with its path.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};

use super::schema::*;
use super::{ConfigErrors, Problems};
use crate::answer::{HeaderProfile, ResetFormat, Responder};
use crate::key::{Forwarded, Global, Header, Key, KeyExtractor, PeerIp};
use crate::limiter::{MissingKey, Resolving, Rule, TierResolver, Tiers, boxed};
use crate::shed::{ByHeader, Criticality, Limit};
use crate::{
    ConcurrencyLimitLayer, LoadShedLayer, Policy, Rate, RateLimitLayer, Store,
    http::RateLimitLayerBuilder,
};

/// A resolver bound in code.
type BoundResolver = Arc<dyn Fn(&str) -> Resolving + Send + Sync>;

/// What a configuration file cannot say, given in code by name: key extractors (a tenant an
/// authentication layer put in the extensions), tier resolvers (a database lookup), and the
/// responder of refusals. The file refers to them (`kind = "custom"`, `binding = "tenant"`;
/// `resolver = "plans"`), and building fails, naming the field, if a name is not bound.
///
/// ```
/// use tollgate::config::{Bindings, Config};
/// use tollgate::key::Extension;
///
/// # #[derive(Clone)] struct Tenant(String);
/// # impl std::fmt::Display for Tenant {
/// #     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str(&self.0) }
/// # }
/// let bindings = Bindings::new()
///     .key("tenant", Extension::<Tenant>::new())
///     .resolver("plans", |key: String| async move { key.starts_with("pro-").then(|| "pro".to_owned()) });
/// let config = Config::from_toml(r#"
///     keys.tenant = { kind = "custom", binding = "tenant" }
///     [[rules]]
///     name = "per-tenant"
///     key = "tenant"
///     tiers.resolver = "plans"
///     tiers.plans = [
///       { name = "free", policies = [{ algorithm = "gcra", rate = "1/s" }] },
///       { name = "pro", policies = [{ algorithm = "gcra", rate = "100/s" }] },
///     ]
/// "#)?;
/// let layer = config.rate_limit_layer(tollgate::MemoryStore::new(), &bindings)?;
/// # let _ = layer;
/// let unbound = config.rate_limit_layer(tollgate::MemoryStore::new(), &Bindings::new()).unwrap_err();
/// assert_eq!(unbound.paths(), ["keys.tenant.binding", "rules[0].tiers.resolver"]);
/// # Ok::<(), tollgate::config::ConfigErrors>(())
/// ```
#[derive(Clone, Default)]
pub struct Bindings {
    keys: BTreeMap<String, Arc<dyn KeyExtractor>>,
    resolvers: BTreeMap<String, BoundResolver>,
    pub(crate) responder: Option<Arc<dyn Responder>>,
}

impl Bindings {
    /// No bindings.
    pub fn new() -> Self {
        Self::default()
    }

    /// A key extractor, for `kind = "custom"` keys with `binding = name`.
    pub fn key(mut self, name: impl Into<String>, extractor: impl KeyExtractor) -> Self {
        self.keys.insert(name.into(), Arc::new(extractor));
        self
    }

    /// A tier resolver, for tiers with `resolver = name`.
    pub fn resolver(mut self, name: impl Into<String>, resolver: impl TierResolver) -> Self {
        let resolver = Arc::new(resolver);
        self.resolvers.insert(
            name.into(),
            Arc::new(move |key: &str| -> Resolving { boxed(&*resolver, key) }),
        );
        self
    }

    /// The responder of the rate-limit layer's refusals (the default one unless set).
    pub fn responder(mut self, responder: impl Responder) -> Self {
        self.responder = Some(Arc::new(responder));
        self
    }
}

impl fmt::Debug for Bindings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bindings")
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("resolvers", &self.resolvers.keys().collect::<Vec<_>>())
            .field("responder", &self.responder.is_some())
            .finish()
    }
}

/// A key extractor made from the file, or bound in code.
#[derive(Clone)]
struct SharedKey(Arc<dyn KeyExtractor>);

impl KeyExtractor for SharedKey {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        self.0.extract(parts)
    }

    fn extract_into(&self, parts: &Parts, out: &mut Key) -> bool {
        self.0.extract_into(parts, out)
    }
}

/// The tiers listed in the file, then the resolver bound in code.
struct ListedThenResolved {
    listed: BTreeMap<String, String>,
    resolver: Option<BoundResolver>,
}

impl TierResolver for ListedThenResolved {
    type Future = Resolving;

    fn resolve(&self, key: &str) -> Resolving {
        if let Some(tier) = self.listed.get(key) {
            let tier = tier.clone();
            return Box::pin(async move { Ok(Some(tier)) });
        }
        match &self.resolver {
            Some(resolver) => resolver(key),
            None => Box::pin(std::future::ready(Ok(None))),
        }
    }
}

/// The most nested `any_of` / `all_of` keys.
const MAX_KEY_DEPTH: usize = 8;

/// The most keys one `any_of` / `all_of` combines.
const MAX_KEY_PARTS: usize = 16;

/// The most extractors one key runs in all, repeats counted: each request runs every one
/// of them (`any_of` until one finds a key, `all_of` all of them, joined).
const MAX_KEY_LEAVES: usize = 32;

/// How many extractors the key named `name` runs in all, repeats counted (saturating; a
/// cycle counts as too many).
fn leaves<'a>(
    config: &'a Config,
    name: &'a str,
    depth: usize,
    memo: &mut BTreeMap<&'a str, usize>,
) -> usize {
    if let Some(&n) = memo.get(name) {
        return n;
    }
    let Some(spec) = config.keys.get(name) else {
        return 1;
    };
    let n = if !matches!(spec.kind, KeyKind::AnyOf | KeyKind::AllOf) {
        1
    } else if depth >= MAX_KEY_DEPTH {
        usize::MAX
    } else {
        spec.of.iter().fold(0usize, |sum, part| {
            sum.saturating_add(leaves(config, part, depth + 1, memo))
        })
    };
    memo.insert(name, n);
    n
}

/// Builds the parts of a configuration, noting every problem. Without bindings (a check of
/// the file alone) names of bindings are not looked up.
pub(crate) struct Builder<'a> {
    config: &'a Config,
    bindings: Option<&'a Bindings>,
    pub(crate) problems: Problems,
    keys: BTreeMap<&'a str, Option<SharedKey>>,
    /// The Redis store a distributed concurrency limit counts on.
    #[cfg(feature = "redis")]
    redis: Option<crate::RedisStore>,
}

impl<'a> Builder<'a> {
    pub(crate) fn new(config: &'a Config, bindings: Option<&'a Bindings>) -> Self {
        let mut builder = Builder {
            config,
            bindings,
            problems: Problems::default(),
            keys: BTreeMap::new(),
            #[cfg(feature = "redis")]
            redis: None,
        };
        for name in config.keys.keys() {
            let key = builder.named_key(name, 0);
            builder.keys.insert(name, key);
        }
        builder
    }

    /// The key extractor named `name` in `[keys]`, built once.
    fn named_key(&mut self, name: &'a str, depth: usize) -> Option<SharedKey> {
        if let Some(built) = self.keys.get(name) {
            return built.clone();
        }
        let path = format!("keys.{name}");
        if !crate::limiter::valid_name(name) {
            self.problems.add(
                &path,
                "a key's name is 1 to 64 of a-z A-Z 0-9 - _ . : (it is referred to by name)",
            );
        }
        let spec = self.config.keys.get(name)?;
        let built = self.key(spec, &path, depth);
        self.keys.insert(name, built.clone());
        built
    }

    fn key(&mut self, spec: &'a KeyConfig, path: &str, depth: usize) -> Option<SharedKey> {
        let p = &mut self.problems;
        let unused = |p: &mut Problems, field: &str, set: bool| {
            if set {
                p.add(
                    format!("{path}.{field}"),
                    format!("not used by a key of kind {}", kind_name(spec.kind)),
                );
            }
        };
        let kind = spec.kind;
        let ip = matches!(kind, KeyKind::PeerIp | KeyKind::Forwarded);
        unused(
            p,
            "header",
            spec.header.is_some() && kind != KeyKind::Header,
        );
        unused(
            p,
            "trusted",
            !spec.trusted.is_empty() && kind != KeyKind::Forwarded,
        );
        unused(p, "rfc7239", spec.rfc7239 && kind != KeyKind::Forwarded);
        unused(p, "ipv4_prefix", spec.ipv4_prefix.is_some() && !ip);
        unused(p, "ipv6_prefix", spec.ipv6_prefix.is_some() && !ip);
        let combines = matches!(kind, KeyKind::AnyOf | KeyKind::AllOf);
        unused(p, "of", !spec.of.is_empty() && !combines);
        unused(
            p,
            "binding",
            spec.binding.is_some() && kind != KeyKind::Custom,
        );
        if let Some(bits) = spec.ipv4_prefix.filter(|b| *b > 32) {
            p.add(
                format!("{path}.ipv4_prefix"),
                format!("{bits} bits: at most 32"),
            );
        }
        if let Some(bits) = spec.ipv6_prefix.filter(|b| *b > 128) {
            p.add(
                format!("{path}.ipv6_prefix"),
                format!("{bits} bits: at most 128"),
            );
        }
        let key: Arc<dyn KeyExtractor> = match kind {
            KeyKind::Global => Arc::new(Global),
            KeyKind::PeerIp => {
                let mut key = PeerIp::new();
                if let Some(bits) = spec.ipv4_prefix {
                    key = key.ipv4_prefix(bits);
                }
                if let Some(bits) = spec.ipv6_prefix {
                    key = key.ipv6_prefix(bits);
                }
                Arc::new(key)
            }
            KeyKind::Forwarded => {
                if spec.trusted.is_empty() {
                    p.add(
                        format!("{path}.trusted"),
                        "name the proxies' networks (with none, use kind = \"peer_ip\")",
                    );
                }
                let mut bad = false;
                for (i, network) in spec.trusted.iter().enumerate() {
                    if let Err(e) = Forwarded::trusting([network]) {
                        p.add(format!("{path}.trusted[{i}]"), e);
                        bad = true;
                    }
                }
                if bad {
                    return None;
                }
                let mut key = Forwarded::trusting(&spec.trusted).ok()?;
                if spec.rfc7239 {
                    key = key.rfc7239();
                }
                if let Some(bits) = spec.ipv4_prefix {
                    key = key.ipv4_prefix(bits);
                }
                if let Some(bits) = spec.ipv6_prefix {
                    key = key.ipv6_prefix(bits);
                }
                Arc::new(key)
            }
            KeyKind::Header => {
                let Some(name) = &spec.header else {
                    p.add(format!("{path}.header"), "missing: the header's name");
                    return None;
                };
                match HeaderName::from_bytes(name.as_bytes()) {
                    Ok(name) => Arc::new(Header(name)),
                    Err(_) => {
                        p.add(
                            format!("{path}.header"),
                            format!("not a header name: {name:?}"),
                        );
                        return None;
                    }
                }
            }
            KeyKind::Custom => {
                let Some(name) = &spec.binding else {
                    p.add(format!("{path}.binding"), "missing: the name bound in code");
                    return None;
                };
                match self.bindings {
                    Some(bindings) => match bindings.keys.get(name) {
                        Some(key) => Arc::clone(key),
                        None => {
                            p.add(
                                format!("{path}.binding"),
                                format!("no key extractor is bound to {name:?} in code"),
                            );
                            return None;
                        }
                    },
                    // Checked without bindings: stands in for the bound one.
                    None => Arc::new(Global),
                }
            }
            KeyKind::AnyOf | KeyKind::AllOf => {
                if spec.of.len() < 2 || spec.of.len() > MAX_KEY_PARTS {
                    p.add(
                        format!("{path}.of"),
                        format!("name 2 to {MAX_KEY_PARTS} keys, not {}", spec.of.len()),
                    );
                    return None;
                }
                if depth >= MAX_KEY_DEPTH {
                    p.add(
                        format!("{path}.of"),
                        format!("keys nested more than {MAX_KEY_DEPTH} deep (a cycle?)"),
                    );
                    return None;
                }
                if let Some(twice) = spec
                    .of
                    .iter()
                    .enumerate()
                    .find(|(i, name)| spec.of[..*i].contains(name))
                {
                    p.add(
                        format!("{path}.of[{}]", twice.0),
                        format!("{:?} is named twice", twice.1),
                    );
                    return None;
                }
                let mut memo = BTreeMap::new();
                let total = spec.of.iter().fold(0usize, |sum, part| {
                    sum.saturating_add(leaves(self.config, part, depth + 1, &mut memo))
                });
                if total > MAX_KEY_LEAVES && depth == 0 {
                    p.add(
                        format!("{path}.of"),
                        if total == usize::MAX {
                            format!("keys nested more than {MAX_KEY_DEPTH} deep (a cycle?)")
                        } else {
                            format!(
                                "runs more than {MAX_KEY_LEAVES} extractors per request in all \
                                 (nested keys counted each time they appear)"
                            )
                        },
                    );
                    return None;
                }
                let mut parts = Vec::new();
                for (i, name) in spec.of.iter().enumerate() {
                    if !self.config.keys.contains_key(name) {
                        self.problems.add(
                            format!("{path}.of[{i}]"),
                            format!("no key named {name:?} in [keys]"),
                        );
                        return None;
                    }
                    parts.push(self.named_key(name, depth + 1)?);
                }
                let mut parts = parts.into_iter().rev();
                let mut combined = parts.next()?;
                for part in parts {
                    combined = if kind == KeyKind::AnyOf {
                        SharedKey(Arc::new(part.or(combined)))
                    } else {
                        SharedKey(Arc::new(part.and(combined)))
                    };
                }
                combined.0
            }
        };
        Some(SharedKey(key))
    }

    /// A rule's key: a name from `[keys]`, or `global` / `peer_ip`.
    fn rule_key(&mut self, name: Option<&'a String>, path: &str) -> Option<SharedKey> {
        match name.map(String::as_str) {
            None => Some(SharedKey(Arc::new(Global))),
            Some(name) => match self.keys.get(name) {
                Some(key) => key.clone(),
                None if name == "global" => Some(SharedKey(Arc::new(Global))),
                None if name == "peer_ip" => Some(SharedKey(Arc::new(PeerIp::new()))),
                None => {
                    self.problems.add(
                        path,
                        format!("no key named {name:?} in [keys] (nor global or peer_ip)"),
                    );
                    None
                }
            },
        }
    }

    /// The matching part of a rule: name, methods, route, key and missing-key answer.
    #[allow(clippy::too_many_arguments)]
    fn matching(
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
    fn rule(&mut self, i: usize, spec: &'a RuleConfig) -> Option<Rule> {
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
        for (j, p) in policies.iter().enumerate() {
            if let Some(p) = p {
                self.redis_runs(p, &format!("{path}.policies[{j}]"));
                if cost > p.limit() {
                    self.problems.add(
                        format!("{path}.cost"),
                        format!(
                            "{cost} is more than the limit of policies[{j}] ({}), which counts \
                             such a request as its whole limit",
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
            for (j, p) in policies.iter().enumerate() {
                if let Some(p) = p {
                    self.redis_runs(p, &format!("{plan_path}.policies[{j}]"));
                    if cost > p.limit() {
                        self.problems.add(
                            format!("{plan_path}.policies[{j}]"),
                            format!(
                                "its limit ({}) is below the rule's cost ({cost}), which would \
                                 count such a request as its whole limit",
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

    /// The rate-limit layer's builder over `store`, or `None` after a problem.
    pub(crate) fn rate_limit<St: Store>(&mut self, store: St) -> Option<RateLimitLayerBuilder<St>> {
        let config = self.config;
        let answers = &config.answers;
        let mut builder = RateLimitLayer::builder(store)
            .headers(match answers.headers {
                HeadersConfig::Ietf => HeaderProfile::Ietf,
                HeadersConfig::Legacy => HeaderProfile::Legacy,
                HeadersConfig::Both => HeaderProfile::Both,
                HeadersConfig::Off => HeaderProfile::Off,
            })
            .decision_extension(answers.decision_extension);
        if let Some(reset) = answers.legacy_reset {
            builder = builder.legacy_reset(match reset {
                ResetConfig::DeltaSeconds => ResetFormat::DeltaSeconds,
                ResetConfig::UnixSeconds => ResetFormat::UnixSeconds,
            });
        }
        if let Some(after) = answers.unavailable_retry_after {
            builder = builder.unavailable_retry_after(after.get());
        }
        if let Some(trace) = config.trace_keys {
            builder = builder.trace_keys(match trace {
                KeyTraceConfig::None => crate::telemetry::KeyTrace::None,
                KeyTraceConfig::Hashed => crate::telemetry::KeyTrace::Hashed,
                KeyTraceConfig::Plain => crate::telemetry::KeyTrace::Plain,
            });
        }
        if let Some(responder) = self.bindings.and_then(|b| b.responder.clone()) {
            builder = builder.shared_responder(responder);
        }
        let mut names = BTreeSet::new();
        let mut ok = true;
        for (i, spec) in config.rules.iter().enumerate() {
            if !spec.name.is_empty() && !names.insert(spec.name.as_str()) {
                self.problems.add(
                    format!("rules[{i}].name"),
                    format!("two rules are named {:?}", spec.name),
                );
            }
            match self.rule(i, spec) {
                Some(rule) => builder = builder.rule(rule),
                None => ok = false,
            }
        }
        (ok && self.problems.is_empty()).then_some(builder)
    }

    /// The concurrency layer, if the file has one.
    pub(crate) fn concurrency(&mut self) -> Option<ConcurrencyLimitLayer> {
        let spec = self.config.concurrency.as_ref()?;
        let mut builder = ConcurrencyLimitLayer::builder();
        if let Some(name) = &spec.name {
            label_ok(name, "concurrency.name", &mut self.problems);
            builder = builder.name(name.as_str());
        }
        let mut names = BTreeSet::new();
        for (i, r) in spec.rules.iter().enumerate() {
            let path = format!("concurrency.rules[{i}]");
            if !r.name.is_empty() && !names.insert(r.name.as_str()) {
                self.problems.add(
                    format!("{path}.name"),
                    format!("two rules are named {:?}", r.name),
                );
            }
            if r.max_in_flight == 0 {
                self.problems.add(
                    format!("{path}.max_in_flight"),
                    "must be at least 1 (0 refuses every request)",
                );
            }
            let rule = self.matching(
                &path,
                &r.name,
                &r.methods,
                false,
                [
                    ("path", r.path.as_ref()),
                    ("path_prefix", r.path_prefix.as_ref()),
                    ("route", r.route.as_ref()),
                ],
                r.key.as_ref(),
                r.on_missing_key,
            );
            if let Some(rule) = rule {
                builder = builder.rule(rule, r.max_in_flight);
            }
        }
        if let Some(total) = spec.total {
            if total == 0 {
                self.problems.add(
                    "concurrency.total",
                    "must be at least 1 (0 refuses every request)",
                );
            }
            builder = builder.total(total);
        }
        if spec.rules.is_empty() && spec.total.is_none() {
            self.problems.add(
                "concurrency",
                "give rules or a total (or leave the section out)",
            );
        }
        if let Some(queue) = &spec.queue {
            queue_ok(queue, "concurrency.queue", &mut self.problems);
            builder = builder.queue(queue.max_waiting, queue.max_wait.get());
        }
        #[cfg(feature = "redis")]
        if let (true, Some(lease)) = (spec.distributed, spec.lease_time) {
            let timeout = self
                .config
                .store
                .timeout
                .map_or(crate::store::redis::DEFAULT_TIMEOUT, |t| t.get());
            let (min, max) = (
                crate::concurrency::MIN_LEASE_TIME,
                crate::concurrency::MAX_LEASE_TIME,
            );
            if !(min..=max).contains(&lease.get()) || lease.get() < timeout.saturating_mul(3) {
                self.problems.add(
                    "concurrency.lease_time",
                    format!(
                        "{lease}: give {} to {}, and at least three times store.timeout ({})",
                        super::HumanDuration::from(min),
                        super::HumanDuration::from(max),
                        super::HumanDuration::from(timeout)
                    ),
                );
            }
        }
        #[cfg(feature = "redis")]
        if let (true, Some(redis)) = (spec.distributed, self.redis.clone()) {
            builder = builder.redis(redis);
            if let Some(lease) = spec.lease_time {
                builder = builder.lease_time(lease.get());
            }
            if let Some(policy) = spec.on_store_error {
                builder = builder.on_store_error(failure_policy(policy));
            }
        }
        if !spec.distributed {
            if spec.lease_time.is_some() {
                self.problems
                    .add("concurrency.lease_time", "only with distributed = true");
            }
            if spec.on_store_error.is_some() {
                self.problems
                    .add("concurrency.on_store_error", "only with distributed = true");
            }
        } else if self.config.store.kind != StoreKind::Redis {
            self.problems
                .add("concurrency.distributed", "needs store.kind = \"redis\"");
        }
        if !self.problems.is_empty() {
            return None;
        }
        match builder.build() {
            Ok(layer) => Some(layer),
            Err(e) => {
                self.problems.add("concurrency", e);
                None
            }
        }
    }

    /// The load shedder, if the file has one.
    pub(crate) fn shed(&mut self) -> Option<LoadShedLayer> {
        let spec = self.config.shed.as_ref()?;
        let p = &mut self.problems;
        let adaptive = spec.limit != ShedLimitKind::Fixed;
        if spec.initial == 0 {
            p.add("shed.initial", "must be at least 1");
        }
        if !adaptive {
            for (field, set) in [("min", spec.min.is_some()), ("max", spec.max.is_some())] {
                if set {
                    p.add(format!("shed.{field}"), "only for an adaptive limit");
                }
            }
        }
        if adaptive {
            let (min, max) = (spec.min.unwrap_or(1), spec.max.unwrap_or(1_000));
            if spec.min == Some(0) {
                p.add("shed.min", "must be at least 1");
            }
            if min > max {
                p.add("shed.min", format!("{min} is above max ({max})"));
            } else if !(min..=max).contains(&spec.initial) && spec.initial > 0 {
                p.add(
                    "shed.initial",
                    format!(
                        "{}: give a value within min ({min}) and max ({max})",
                        spec.initial
                    ),
                );
            }
        }
        let mut limit = match spec.limit {
            ShedLimitKind::Fixed => Limit::fixed(spec.initial),
            ShedLimitKind::Vegas => Limit::vegas(spec.initial),
            ShedLimitKind::Aimd => match spec.latency {
                Some(latency) if !latency.get().is_zero() => {
                    Limit::aimd(spec.initial, latency.get())
                }
                Some(_) => {
                    p.add("shed.latency", "must be above zero");
                    return None;
                }
                None => {
                    p.add("shed.latency", "missing: the AIMD limit's latency target");
                    return None;
                }
            },
        };
        if spec.latency.is_some() && spec.limit != ShedLimitKind::Aimd {
            p.add("shed.latency", "only for limit = \"aimd\"");
        }
        if adaptive {
            limit = limit.bounds(spec.min.unwrap_or(1), spec.max.unwrap_or(1_000));
        }
        let mut builder = LoadShedLayer::builder(limit);
        if let Some(name) = &spec.name {
            label_ok(name, "shed.name", p);
            builder = builder.name(name.as_str());
        }
        if let Some(name) = &spec.class_header {
            match HeaderName::from_bytes(name.as_bytes()) {
                Ok(name) => builder = builder.classify(ByHeader::new(name)),
                Err(_) => p.add("shed.class_header", format!("not a header name: {name:?}")),
            }
        }
        for (class, share) in &spec.shares {
            match class.parse::<Criticality>() {
                Ok(c) if share.is_finite() && (0.001..=1.0).contains(share) => {
                    builder = builder.share(c, *share);
                }
                Ok(_) => p.add(
                    format!("shed.shares.{class}"),
                    format!("{share}: give 0.001 to 1"),
                ),
                Err(_) => p.add(
                    format!("shed.shares.{class}"),
                    "not a class (critical_plus, critical, sheddable_plus, sheddable)",
                ),
            }
        }
        if let Some(from) = spec.fair_from {
            if !(from.is_finite() && from > 0.0 && from <= 1.0) {
                p.add("shed.fair_from", format!("{from}: give a number in (0, 1]"));
            }
            builder = builder.fair_from(from);
        }
        if let Some(queue) = &spec.queue {
            queue_ok(queue, "shed.queue", p);
            builder = builder.queue(queue.max_waiting, queue.max_wait.get());
        }
        if let Some(name) = &spec.deadline_header {
            if spec.queue.is_none() {
                p.add("shed.deadline_header", "only with a queue");
            }
            match HeaderName::from_bytes(name.as_bytes()) {
                Ok(name) => builder = builder.deadline_header(name),
                Err(_) => p.add(
                    "shed.deadline_header",
                    format!("not a header name: {name:?}"),
                ),
            }
        }
        if let Some(name) = &spec.fair_by {
            if let Some(key) = self.rule_key(Some(name), "shed.fair_by") {
                builder = builder.fair_by(key);
            }
        }
        if !self.problems.is_empty() {
            return None;
        }
        match builder.build() {
            Ok(layer) => Some(layer),
            Err(e) => {
                self.problems.add("shed", e);
                None
            }
        }
    }

    /// The store section's problems that need no connection.
    pub(crate) fn store(&mut self) {
        let s = &self.config.store;
        let p = &mut self.problems;
        let memory = s.kind == StoreKind::Memory;
        let only = |p: &mut Problems, field: &str, set: bool, kind: &str| {
            if set {
                p.add(
                    format!("store.{field}"),
                    format!("only for kind = \"{kind}\""),
                );
            }
        };
        only(p, "max_keys", s.max_keys.is_some() && !memory, "memory");
        only(p, "shards", s.shards.is_some() && !memory, "memory");
        for (field, set) in [
            ("url", s.url.is_some()),
            ("cluster", !s.cluster.is_empty()),
            ("prefix", s.prefix.is_some()),
            ("pool_size", s.pool_size.is_some()),
            ("timeout", s.timeout.is_some()),
            ("deny_cache", s.deny_cache.is_some()),
            ("on_failure", s.on_failure.is_some()),
            ("instances", s.instances.is_some()),
            ("breaker", s.breaker.is_some()),
        ] {
            only(p, field, set && memory, "redis");
        }
        if let Some(name) = &s.name {
            label_ok(name, "store.name", p);
        }
        if s.max_keys == Some(0) {
            p.add("store.max_keys", "must be at least 1");
        }
        if let Some(shards) = s.shards {
            if shards == 0 || !shards.is_power_of_two() || shards > 1 << 16 {
                p.add(
                    "store.shards",
                    format!("{shards}: give a power of two up to 65536"),
                );
            }
        }
        if s.max_key_len == Some(0) {
            p.add("store.max_key_len", "must be at least 1");
        }
        if !memory {
            #[cfg(not(feature = "redis"))]
            p.add(
                "store.kind",
                "the Redis store needs tollgate's feature `redis`",
            );
            match (&s.url, s.cluster.is_empty()) {
                (None, true) => p.add("store.url", "missing: the Redis URL (or cluster)"),
                (Some(_), false) => p.add("store.cluster", "give url or cluster, not both"),
                _ => {}
            }
            for (i, node) in s.cluster.iter().enumerate() {
                if node_of(node).is_none() {
                    p.add(
                        format!("store.cluster[{i}]"),
                        format!("{node:?}: give host:port"),
                    );
                }
            }
            if let Some(t) = s.timeout {
                if t.get().is_zero() {
                    p.add("store.timeout", "must be above zero");
                }
            }
            if let Some(n) = s.pool_size.filter(|n| !(1..=256).contains(n)) {
                p.add("store.pool_size", format!("{n}: give 1 to 256"));
            }
            if s.instances == Some(0) {
                p.add("store.instances", "must be at least 1");
            }
            if s.instances.is_some() && s.on_failure != Some(FailureConfig::Local) {
                p.add("store.instances", "only with on_failure = \"local\"");
            }
            if let Some(b) = &s.breaker {
                if b.failures == 0 {
                    p.add("store.breaker.failures", "must be at least 1");
                }
                if b.open_for.get().is_zero() {
                    p.add("store.breaker.open_for", "must be above zero");
                }
            }
        }
    }
}

/// The store's failure policy.
#[cfg(feature = "redis")]
pub(crate) fn failure_policy(policy: FailureConfig) -> crate::store::FailurePolicy {
    use crate::store::FailurePolicy;
    match policy {
        FailureConfig::Open => FailurePolicy::Open,
        FailureConfig::Closed => FailurePolicy::Closed,
        FailureConfig::Local => FailurePolicy::LocalFallback,
    }
}

/// `host:port`, split.
pub(crate) fn node_of(node: &str) -> Option<(String, u16)> {
    let (host, port) = node.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty())
        .then(|| Some((host.to_owned(), port.parse().ok()?)))
        .flatten()
}

/// A metric label's value: a name, not free text.
fn label_ok(name: &str, path: &str, p: &mut Problems) {
    if !crate::limiter::valid_name(name) {
        p.add(
            path,
            format!("{name:?}: use 1 to 64 of a-z A-Z 0-9 - _ . :"),
        );
    }
}

fn queue_ok(queue: &QueueConfig, path: &str, p: &mut Problems) {
    if queue.max_waiting == 0 {
        p.add(format!("{path}.max_waiting"), "must be at least 1");
    }
    if queue.max_wait.get().is_zero() {
        p.add(format!("{path}.max_wait"), "must be above zero");
    }
}

#[cfg(feature = "axum")]
fn route(rule: Rule, template: &str, _: &str, _: &mut Problems) -> Rule {
    rule.route(template)
}

#[cfg(not(feature = "axum"))]
fn route(rule: Rule, _: &str, path: &str, p: &mut Problems) -> Rule {
    p.add(
        format!("{path}.route"),
        "route templates need tollgate's feature `axum`; use path or path_prefix",
    );
    rule
}

fn kind_name(kind: KeyKind) -> &'static str {
    match kind {
        KeyKind::Global => "global",
        KeyKind::PeerIp => "peer_ip",
        KeyKind::Forwarded => "forwarded",
        KeyKind::Header => "header",
        KeyKind::AnyOf => "any_of",
        KeyKind::AllOf => "all_of",
        KeyKind::Custom => "custom",
    }
}

/// The policies of a list, each `None` after a problem.
fn policies(specs: &[PolicyConfig], path: &str, p: &mut Problems) -> Vec<Option<Policy>> {
    specs
        .iter()
        .enumerate()
        .map(|(i, spec)| policy(spec, &format!("{path}[{i}]"), p))
        .collect()
}

/// One policy, or `None` after noting its problems.
pub(crate) fn policy(spec: &PolicyConfig, path: &str, p: &mut Problems) -> Option<Policy> {
    use AlgorithmConfig as A;
    let window = matches!(
        spec.algorithm,
        A::FixedWindow | A::SlidingLog | A::SlidingWindow
    );
    let (limit, span, rate) = if window {
        if spec.burst.is_some() {
            p.add(
                format!("{path}.burst"),
                "only for buckets; a window takes limit and window",
            );
        }
        match (spec.rate, spec.limit, spec.window) {
            (Some(rate), None, None) => (rate.get().count(), rate.get().per(), None),
            (Some(_), _, _) => {
                p.add(
                    format!("{path}.rate"),
                    "give rate, or limit and window, not both",
                );
                return None;
            }
            (None, limit, window) => {
                if limit.is_none() {
                    p.add(
                        format!("{path}.limit"),
                        "missing (or give a rate: \"100/minute\")",
                    );
                }
                if window.is_none() {
                    p.add(
                        format!("{path}.window"),
                        "missing (or give a rate: \"100/minute\")",
                    );
                }
                (limit?, window?.get(), None)
            }
        }
    } else {
        for (field, set) in [
            ("limit", spec.limit.is_some()),
            ("window", spec.window.is_some()),
        ] {
            if set {
                p.add(
                    format!("{path}.{field}"),
                    "only for windows; a bucket takes rate and burst",
                );
            }
        }
        let Some(rate) = spec.rate else {
            p.add(
                format!("{path}.rate"),
                "missing: a bucket's rate, such as \"10/s\"",
            );
            return None;
        };
        let rate: Rate = rate.get();
        (spec.burst.unwrap_or(rate.count()), rate.per(), Some(rate))
    };
    let built = match (spec.algorithm, rate) {
        (A::FixedWindow, _) => Policy::fixed_window(limit, span),
        (A::SlidingLog, _) => Policy::sliding_log(limit, span),
        (A::SlidingWindow, _) => Policy::sliding_window(limit, span),
        (A::TokenBucket, Some(rate)) => Policy::token_bucket(rate, limit),
        (A::LeakyBucket, Some(rate)) => Policy::leaky_bucket(rate, limit),
        (A::Gcra, Some(rate)) => Policy::gcra(rate, limit),
        (_, None) => return None,
    };
    let field = |e: &crate::PolicyError| -> &'static str {
        use crate::PolicyError as E;
        let limit_field = if window { "limit" } else { "burst" };
        let given = |field: &'static str| {
            let set = match field {
                "limit" => spec.limit.is_some(),
                "burst" => spec.burst.is_some(),
                _ => spec.window.is_some(),
            };
            if set { field } else { "rate" }
        };
        match e {
            E::ZeroLimit => given(limit_field),
            E::ZeroWindow => given("window"),
            E::InvalidName(_) => "name",
            E::TooLarge { what, .. } if what.contains("limit") => given(limit_field),
            E::TooLarge { what, .. } if what.starts_with("burst") => given("burst"),
            E::TooLarge { what, .. } if *what == "window" => given("window"),
            _ => "rate",
        }
    };
    let built = match built {
        Ok(policy) => policy,
        Err(e) => {
            p.add(format!("{path}.{}", field(&e)), e);
            return None;
        }
    };
    match &spec.name {
        Some(name) => match built.named(name) {
            Ok(named) => Some(named),
            Err(e) => {
                p.add(format!("{path}.name"), e);
                None
            }
        },
        None => Some(built),
    }
}

impl Config {
    /// Everything that needs no code bindings and no connection.
    /// Registers no metric series (nothing it builds runs).
    pub(crate) fn check(&self) -> Result<(), ConfigErrors> {
        super::reload::quietly(|| {
            let mut builder = Builder::new(self, None);
            builder.store();
            let _ = builder.rate_limit(crate::MemoryStore::new());
            let _ = builder.concurrency();
            let _ = builder.shed();
            builder.problems.or(())
        })
    }

    /// The rate-limit layer over `store`, with the keys, resolvers and responder of
    /// `bindings`. The `store` section is not read here: see [`Config::store`].
    pub fn rate_limit_layer<St: Store>(
        &self,
        store: St,
        bindings: &Bindings,
    ) -> Result<RateLimitLayer<St>, ConfigErrors> {
        let mut builder = Builder::new(self, Some(bindings));
        let layer = builder.rate_limit(store);
        let problems = builder.problems;
        let layer = problems.or(layer)?;
        let Some(layer) = layer else {
            return Err(ConfigErrors::one("rules", "could not be built"));
        };
        layer.build().map_err(|e| ConfigErrors::one("rules", e))
    }

    /// The concurrency layer of the `[concurrency]` section, if there is one (in process; a
    /// `distributed` one is made by [`ConfiguredStore::concurrency_layer`](super::ConfiguredStore::concurrency_layer)).
    pub fn concurrency_layer(
        &self,
        bindings: &Bindings,
    ) -> Result<Option<ConcurrencyLimitLayer>, ConfigErrors> {
        if self.concurrency.as_ref().is_some_and(|c| c.distributed) {
            return Err(ConfigErrors::one(
                "concurrency.distributed",
                "a distributed limit needs the Redis store: build it with \
                 ConfiguredStore::concurrency_layer",
            ));
        }
        let mut builder = Builder::new(self, Some(bindings));
        let layer = builder.concurrency();
        builder.problems.or(layer)
    }

    /// The same, counting places on `redis` when the section says `distributed = true`.
    #[cfg(feature = "redis")]
    pub(crate) fn distributed_concurrency_layer(
        &self,
        bindings: &Bindings,
        redis: Option<&crate::RedisStore>,
    ) -> Result<Option<ConcurrencyLimitLayer>, ConfigErrors> {
        let mut builder = Builder::new(self, Some(bindings));
        builder.redis = redis.cloned();
        let layer = builder.concurrency();
        builder.problems.or(layer)
    }

    /// The load shedder of the `[shed]` section, if there is one.
    pub fn shed_layer(&self, bindings: &Bindings) -> Result<Option<LoadShedLayer>, ConfigErrors> {
        let mut builder = Builder::new(self, Some(bindings));
        let layer = builder.shed();
        builder.problems.or(layer)
    }
}
