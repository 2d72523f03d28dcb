//! `ShouldRateLimit` on any [`Store`].

use std::collections::HashSet;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tonic::{Request, Response, Status};

use super::config::{Config, ConfigError, Limit, LimitKind, Unit};
use super::metrics::{Hits, Outcome, ServiceMetrics};
use super::proto::rate_limit_descriptor::RateLimitOverride;
use super::proto::rate_limit_response::{Code, DescriptorStatus, RateLimit, rate_limit};
use super::proto::rate_limit_service_server::RateLimitServiceServer;
use super::proto::{
    HeaderValue, RateLimitDescriptor, RateLimitRequest, RateLimitResponse, RateLimitUnit,
};
use crate::answer::{self, HeaderProfile};
use crate::telemetry::METRICS;
use crate::{Check, Decision, Policy, Store};

/// The most descriptors one call may carry, unless set with
/// [`RateLimitService::max_descriptors`].
pub const DEFAULT_MAX_DESCRIPTORS: usize = 64;

/// The most entries one descriptor may carry (deeper than any configuration's tree: Envoy's
/// actions make a handful).
pub const MAX_DESCRIPTOR_ENTRIES: usize = 64;

/// The longest descriptor label a call's limit override makes (`override:` and its keys);
/// a longer one is labelled by a hash of its keys.
const MAX_OVERRIDE_LABEL: usize = 256;

/// The longest key or value of a descriptor entry, in bytes, unless set with
/// [`RateLimitService::max_entry_len`].
pub const DEFAULT_MAX_ENTRY_LEN: usize = 1024;

/// The most descriptor labels a service's metrics take from requests (`detailed_metric`,
/// limits sent by Envoy), unless set with [`RateLimitService::max_metric_descriptors`].
pub const DEFAULT_MAX_METRIC_DESCRIPTORS: usize = 1000;

/// Keys longer than this are replaced by their SHA-256 (below every store's bound).
const MAX_PLAIN_KEY_LEN: usize = 256;

/// Envoy's rate limit service on a tollgate [`Store`]: implements the generated
/// `RateLimitService` trait, so [`RateLimitService::into_server`] is a tonic service to add
/// to a `tonic::transport::Server`. Cloning is cheap and shares the store and the
/// configuration.
pub struct RateLimitService<S> {
    inner: Arc<Inner<S>>,
    options: Options,
}

/// What the clones of a service share: the store, the configuration and the metrics.
struct Inner<S> {
    store: S,
    config: ArcSwap<Config>,
    metrics: ServiceMetrics,
}

/// What each clone carries.
#[derive(Clone, Copy, Debug)]
struct Options {
    headers: HeaderProfile,
    max_descriptors: usize,
    max_entry_len: usize,
    max_metric_descriptors: usize,
}

impl<S> Clone for RateLimitService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            options: self.options,
        }
    }
}

impl<S> std::fmt::Debug for RateLimitService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitService")
            .field("domains", &self.inner.config.load().domains().count())
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<S: Store> RateLimitService<S> {
    /// The service for `config` on `store`; no response headers. With the `metrics` feature
    /// it records the `tollgate_envoy_*` metrics of [`tollgate::metrics`](crate::metrics) in
    /// the recorder installed now (install it first).
    pub fn new(store: S, config: Config) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                config: ArcSwap::from_pointee(config),
                metrics: ServiceMetrics::new(),
            }),
            options: Options {
                headers: HeaderProfile::Off,
                max_descriptors: DEFAULT_MAX_DESCRIPTORS,
                max_entry_len: DEFAULT_MAX_ENTRY_LEN,
                max_metric_descriptors: DEFAULT_MAX_METRIC_DESCRIPTORS,
            },
        }
    }

    /// Which headers Envoy is asked to add to its responses (`response_headers_to_add`),
    /// for the descriptor that runs out first: [`HeaderProfile::Ietf`] for `RateLimit` and
    /// `RateLimit-Policy`, [`HeaderProfile::Legacy`] for the `X-RateLimit-Limit`,
    /// `-Remaining` and `-Reset` trio envoyproxy/ratelimit sends, `Both`, or `Off` (the
    /// default).
    pub fn headers(mut self, profile: HeaderProfile) -> Self {
        self.options.headers = profile;
        self
    }

    /// The most descriptors one call may carry (default [`DEFAULT_MAX_DESCRIPTORS`]); more is
    /// `INVALID_ARGUMENT`.
    pub fn max_descriptors(mut self, max: usize) -> Self {
        self.options.max_descriptors = max;
        self
    }

    /// The longest entry key or value, in bytes (default [`DEFAULT_MAX_ENTRY_LEN`]); longer is
    /// `INVALID_ARGUMENT`.
    pub fn max_entry_len(mut self, max: usize) -> Self {
        self.options.max_entry_len = max;
        self
    }

    /// The most `descriptor` labels the metrics take from requests (default
    /// [`DEFAULT_MAX_METRIC_DESCRIPTORS`]), for every clone of this service: the request's
    /// values of a `detailed_metric: true` descriptor, and the keys of a limit Envoy sent.
    /// Past it, a new detailed label counts under the configured path, a new override under
    /// `_other`. 0 turns both off.
    pub fn max_metric_descriptors(mut self, max: usize) -> Self {
        self.options.max_metric_descriptors = max;
        self
    }

    /// Replaces the configuration, for every clone of this service, for the calls that start
    /// from now on (hot reload). Counters live in the store under the descriptor's entries and
    /// the limit's parameters, so a limit that the new configuration keeps unchanged keeps its
    /// counts, and a changed one starts afresh. Counted as a `success` in
    /// `tollgate_envoy_config_reloads_total`.
    pub fn set_config(&self, config: Config) {
        self.inner.config.store(Arc::new(config));
        self.inner.metrics.reloaded.increment(1);
    }

    /// Reads the configuration at `path` ([`Config::from_path`]: a file, or a folder's YAML
    /// files) and puts it in place, as [`set_config`](Self::set_config) does. A configuration
    /// with problems is returned as the error, and the running one stays (counted as an
    /// `error` in `tollgate_envoy_config_reloads_total`).
    pub fn reload_from(&self, path: impl AsRef<std::path::Path>) -> Result<(), ConfigError> {
        match Config::from_path(path) {
            Ok(config) => {
                self.set_config(config);
                Ok(())
            }
            Err(e) => {
                self.inner.metrics.reload_refused.increment(1);
                Err(e)
            }
        }
    }

    /// The tonic service, to add to a `tonic::transport::Server`.
    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self)
    }

    /// Decides one request, as `ShouldRateLimit` does (without gRPC around it).
    ///
    /// Errors: `INVALID_ARGUMENT` for an empty domain, no descriptors, too many descriptors,
    /// a descriptor without entries, an empty key, a key or value too long, a limit override
    /// without a unit, or `is_negative_hits`; `UNAVAILABLE` when the store fails. Nothing is
    /// counted for a call that ends in an error or in `OVER_LIMIT`.
    pub async fn decide(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        let inner = &*self.inner;
        let options = self.options;
        if let Err(status) = validate(request, options.max_descriptors, options.max_entry_len) {
            inner.metrics.no_domain.invalid.increment(1);
            return Err(status);
        }
        let config = inner.config.load();
        let calls = config.calls(&request.domain).map(Arc::clone);
        let Some(calls) = calls else {
            inner.metrics.no_domain.unknown_domain.increment(1);
            return Ok(unknown_domain(request.descriptors.len()));
        };

        // What each descriptor is held to, and what it costs.
        let mut slots: Vec<Slot> = Vec::with_capacity(request.descriptors.len());
        for descriptor in &request.descriptors {
            let cost = descriptor
                .hits_addend
                .unwrap_or(u64::from(request.hits_addend.max(1)));
            let (limit, shared) = match &descriptor.limit {
                Some(o) => match override_limit(o) {
                    Ok(limit) => (Some(Arc::new(limit)), Vec::new()),
                    Err(status) => {
                        inner.metrics.no_domain.invalid.increment(1);
                        return Err(status);
                    }
                },
                None => match config.lookup(
                    &request.domain,
                    descriptor
                        .entries
                        .iter()
                        .map(|e| (e.key.as_str(), e.value.as_str())),
                ) {
                    Some(m) => (
                        Some(Arc::clone(m.limit)),
                        m.shared.iter().map(|s| s.map(str::to_owned)).collect(),
                    ),
                    None => (None, Vec::new()),
                },
            };
            let key = limit
                .as_ref()
                .map(|_| counter_key(&request.domain, descriptor, &shared))
                .unwrap_or_default();
            slots.push(Slot {
                limit,
                cost,
                key,
                shared,
                label: None,
            });
        }
        // The slots hold what they need: no configuration is held across the store's calls.
        drop(config);

        // `replaces`: a named limit gives way to another limit of the same call naming it.
        let replaced: HashSet<Arc<str>> = slots
            .iter()
            .filter_map(|s| s.limit.as_deref())
            .flat_map(|l| l.replaces.iter().cloned())
            .collect();
        if !replaced.is_empty() {
            for slot in &mut slots {
                let gone = slot
                    .limit
                    .as_ref()
                    .and_then(|l| l.name.as_deref())
                    .is_some_and(|n| replaced.contains(n));
                if gone {
                    slot.limit = None;
                }
            }
        }
        // The metrics' labels that come from the request, for the limits that stay.
        if METRICS {
            for (slot, descriptor) in slots.iter_mut().zip(&request.descriptors) {
                if let Some(limit) = &slot.limit {
                    slot.label = self.label(&request.domain, descriptor, limit, &slot.shared);
                }
            }
        }

        let mut statuses: Vec<DescriptorStatus> = slots.iter().map(Slot::unchecked).collect();
        // What became of each descriptor's hits, for the metrics.
        let mut outcomes: Vec<Option<Outcome>> = vec![None; slots.len()];
        let mut overall = Code::Ok;
        let mut binding: Option<(usize, Decision)> = None;

        // The enforced limits: one store call, all or nothing.
        let enforced: Vec<usize> = (0..slots.len())
            .filter(|&i| slots[i].counted(false).is_some())
            .collect();
        let mut refused_up_front = false;
        for (i, slot) in slots.iter().enumerate() {
            if slot.never_admitted(false) {
                refused_up_front = true;
                statuses[i].code = Code::OverLimit as i32;
            }
        }
        if refused_up_front {
            overall = Code::OverLimit;
            for (i, slot) in slots.iter().enumerate() {
                if slot.never_admitted(false) {
                    outcomes[i] = Some(Outcome::Over);
                } else if slot.counted(false).is_some() {
                    outcomes[i] = Some(Outcome::NotCounted);
                }
            }
        } else if !enforced.is_empty() {
            let checks: Vec<Check<'_>> = enforced
                .iter()
                .filter_map(|&i| {
                    let s = &slots[i];
                    Some(Check::new(&s.key, s.counted(false)?, s.cost))
                })
                .collect();
            let decision = match inner.store.check_all(&checks).await {
                Ok(decision) => decision,
                Err(e) => {
                    calls.store_error.increment(1);
                    calls.store_failed_enforced.increment(1);
                    return Err(Status::unavailable(format!(
                        "the rate limit store failed: {e}"
                    )));
                }
            };
            let at = enforced.get(decision.index()).copied().unwrap_or(0);
            fill(&mut statuses, &slots, &enforced, at, &decision);
            if !decision.allowed() {
                overall = Code::OverLimit;
            }
            outcomes_of(&mut outcomes, &slots, &enforced, at, &decision, false);
            binding = Some((at, decision));
        }

        // Shadow limits: counted only for a call the enforced limits admitted, in a call of
        // their own, and always OK.
        // A shadow limit that no state could admit is not asked about: it would have refused.
        let shadows: Vec<usize> = (0..slots.len())
            .filter(|&i| slots[i].counted(true).is_some() && !slots[i].never_admitted(true))
            .collect();
        for (i, slot) in slots.iter().enumerate() {
            if slot.never_admitted(true) {
                outcomes[i] = Some(if overall == Code::Ok {
                    Outcome::Shadow
                } else {
                    Outcome::NotCounted
                });
            }
        }
        if overall != Code::Ok {
            for &i in &shadows {
                outcomes[i] = Some(Outcome::NotCounted);
            }
        } else if !shadows.is_empty() {
            let checks: Vec<Check<'_>> = shadows
                .iter()
                .filter_map(|&i| {
                    let s = &slots[i];
                    Some(Check::new(&s.key, s.counted(true)?, s.cost))
                })
                .collect();
            match inner.store.check_all(&checks).await {
                Ok(decision) => {
                    let at = shadows.get(decision.index()).copied().unwrap_or(0);
                    fill(&mut statuses, &slots, &shadows, at, &decision);
                    outcomes_of(&mut outcomes, &slots, &shadows, at, &decision, true);
                    for &i in &shadows {
                        statuses[i].code = Code::Ok as i32;
                    }
                }
                Err(_) => calls.store_failed_shadow.increment(1),
            }
        }

        if METRICS {
            match overall {
                Code::Ok => calls.ok.increment(1),
                _ => calls.over_limit.increment(1),
            }
            for (slot, outcome) in slots.iter().zip(&outcomes) {
                if let (Some(outcome), Some(limit)) = (outcome, &slot.limit) {
                    let hits = match &slot.label {
                        Some(made) => made,
                        None => limit.hits(&request.domain),
                    };
                    hits.record(*outcome, slot.cost);
                }
            }
        }

        let mut response = RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            ..Default::default()
        };
        if let Some((at, decision)) = binding {
            if let Some(limit) = slots[at].limit.as_deref() {
                response.response_headers_to_add =
                    headers(options.headers, limit, slots[at].counted(false), &decision);
            }
        }
        Ok(response)
    }
}

impl<S> RateLimitService<S> {
    /// The metrics of a descriptor whose label comes from the request, when it has one: a
    /// limit Envoy sent (`override:` and its keys), or a `detailed_metric` limit (its entries'
    /// `key_value`, a shared wildcard's pattern in place of the value). `None`: the limit's
    /// own, labelled by its configured path.
    fn label(
        &self,
        domain: &str,
        descriptor: &RateLimitDescriptor,
        limit: &Limit,
        shared: &[Option<String>],
    ) -> Option<Arc<Hits>> {
        let metrics = &self.inner.metrics;
        let max = self.options.max_metric_descriptors;
        if descriptor.limit.is_some() {
            let mut label = String::from("override:");
            for (i, e) in descriptor.entries.iter().enumerate() {
                if i > 0 {
                    label.push('.');
                }
                label.push_str(&e.key);
            }
            if label.len() > MAX_OVERRIDE_LABEL {
                use std::hash::{Hash, Hasher};
                // A fixed hasher: the same keys get the same label in every process.
                let mut hasher = std::hash::DefaultHasher::new();
                label.hash(&mut hasher);
                label = format!("override:#{:016x}", hasher.finish());
            }
            return Some(
                metrics
                    .made(domain, &label, max)
                    .unwrap_or_else(|| metrics.other(domain)),
            );
        }
        if !limit.detailed_metric {
            return None;
        }
        let mut label = String::new();
        for (i, e) in descriptor.entries.iter().enumerate() {
            if i > 0 {
                label.push('.');
            }
            label.push_str(&e.key);
            let value = shared
                .get(i)
                .and_then(Option::as_deref)
                .unwrap_or(e.value.as_str());
            if !value.is_empty() {
                label.push('_');
                label.push_str(value);
            }
        }
        metrics.made(domain, &label, max)
    }
}

/// The answer for a domain that is not configured: OK for every descriptor, as
/// envoyproxy/ratelimit answers.
fn unknown_domain(descriptors: usize) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: Code::Ok as i32,
        statuses: vec![
            DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            };
            descriptors
        ],
        ..Default::default()
    }
}

/// What became of the hits of the descriptors `checked` in one store call whose decision came
/// from `at`: on a refusal, over the limit there (in `shadow` mode: a shadow refusal) and not
/// counted elsewhere. On an admission, near or within the limit at `at`, by what it has left;
/// within for the others, whose remainder the decision does not tell (only a lower bound).
fn outcomes_of(
    outcomes: &mut [Option<Outcome>],
    slots: &[Slot],
    checked: &[usize],
    at: usize,
    decision: &Decision,
    shadow: bool,
) {
    for &i in checked {
        outcomes[i] = Some(if decision.allowed() {
            if i == at {
                let limit = slots[i].counted(shadow).map_or(0, Policy::limit);
                Outcome::admitted(decision.remaining(), limit)
            } else {
                Outcome::Within
            }
        } else if i == at {
            if shadow {
                Outcome::Shadow
            } else {
                Outcome::Over
            }
        } else {
            Outcome::NotCounted
        });
    }
}

#[tonic::async_trait]
impl<S: Store> super::proto::rate_limit_service_server::RateLimitService for RateLimitService<S> {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.decide(request.get_ref()).await.map(Response::new)
    }
}

/// One descriptor of a call: its limit (none when nothing matched or it was replaced), its
/// cost, its counter's key, the wildcard pattern each entry counts under (share_threshold),
/// and its metrics when a label of its own was made for it.
struct Slot {
    limit: Option<Arc<Limit>>,
    cost: u64,
    key: String,
    shared: Vec<Option<String>>,
    label: Option<Arc<Hits>>,
}

impl Slot {
    /// Its policy, if it is counted in the pass for shadow limits (`shadow`) or the other.
    fn counted(&self, shadow: bool) -> Option<&Policy> {
        let limit = self.limit.as_deref()?;
        match &limit.kind {
            LimitKind::Counted(p) if limit.shadow_mode == shadow => Some(p),
            _ => None,
        }
    }

    /// Whether no state could ever admit it: a limit of 0, or a cost above the limit.
    fn never_admitted(&self, shadow: bool) -> bool {
        let Some(limit) = self.limit.as_deref() else {
            return false;
        };
        if limit.shadow_mode != shadow {
            return false;
        }
        match &limit.kind {
            LimitKind::DenyAll => self.cost > 0,
            LimitKind::Counted(p) => self.cost > p.limit(),
            LimitKind::Unlimited => false,
        }
    }

    /// Its status before any store call.
    fn unchecked(&self) -> DescriptorStatus {
        match self.limit.as_deref() {
            None => DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            },
            Some(l) if matches!(l.kind, LimitKind::Unlimited) => DescriptorStatus {
                code: Code::Ok as i32,
                limit_remaining: u32::MAX,
                ..Default::default()
            },
            Some(l) => DescriptorStatus {
                code: Code::Ok as i32,
                current_limit: Some(current_limit(l)),
                limit_remaining: 0,
                duration_until_reset: None,
            },
        }
    }
}

/// The statuses of the descriptors `checked` after one store call whose decision came from
/// `at`: that one exactly; for the others, which ran out no sooner for a call of their cost,
/// a lower bound on what remains.
fn fill(
    statuses: &mut [DescriptorStatus],
    slots: &[Slot],
    checked: &[usize],
    at: usize,
    decision: &Decision,
) {
    let cost_at = slots[at].cost;
    for &i in checked {
        let status = &mut statuses[i];
        let remaining = match decision.remaining().checked_div(cost_at) {
            Some(calls) if i != at => calls.saturating_mul(slots[i].cost),
            _ => decision.remaining(),
        };
        status.limit_remaining = u32::try_from(remaining).unwrap_or(u32::MAX);
        if i == at {
            let until = decision.retry_after().unwrap_or(decision.reset_after());
            status.duration_until_reset = Some(duration(until));
            if !decision.allowed() {
                status.code = Code::OverLimit as i32;
            }
        }
    }
}

fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

fn current_limit(limit: &Limit) -> RateLimit {
    RateLimit {
        name: limit.name.as_deref().unwrap_or_default().to_owned(),
        requests_per_unit: limit.requests_per_unit,
        unit: limit.unit.map_or(rate_limit::Unit::Unknown, |u| match u {
            Unit::Second => rate_limit::Unit::Second,
            Unit::Minute => rate_limit::Unit::Minute,
            Unit::Hour => rate_limit::Unit::Hour,
            Unit::Day => rate_limit::Unit::Day,
            Unit::Week => rate_limit::Unit::Week,
            Unit::Month => rate_limit::Unit::Month,
            Unit::Year => rate_limit::Unit::Year,
        }) as i32,
    }
}

fn override_limit(o: &RateLimitOverride) -> Result<Limit, Status> {
    let unit = match RateLimitUnit::try_from(o.unit) {
        Ok(RateLimitUnit::Second) => Unit::Second,
        Ok(RateLimitUnit::Minute) => Unit::Minute,
        Ok(RateLimitUnit::Hour) => Unit::Hour,
        Ok(RateLimitUnit::Day) => Unit::Day,
        Ok(RateLimitUnit::Month) => Unit::Month,
        Ok(RateLimitUnit::Year) => Unit::Year,
        // A week, as envoyproxy/ratelimit reads it: it takes the number as the response's
        // unit, where 7 is WEEK (newer Envoys send it).
        Err(_) if o.unit == rate_limit::Unit::Week as i32 => Unit::Week,
        Ok(RateLimitUnit::Unknown) | Err(_) => {
            return Err(Status::invalid_argument(
                "a descriptor's limit override has no valid unit",
            ));
        }
    };
    Ok(Limit::from_override(o.requests_per_unit, unit))
}

fn validate(
    request: &RateLimitRequest,
    max_descriptors: usize,
    max_len: usize,
) -> Result<(), Status> {
    if request.domain.is_empty() {
        return Err(Status::invalid_argument(
            "rate limit domain must not be empty",
        ));
    }
    if request.descriptors.is_empty() {
        return Err(Status::invalid_argument(
            "rate limit descriptor list must not be empty",
        ));
    }
    if request.descriptors.len() > max_descriptors {
        return Err(Status::invalid_argument(format!(
            "{} descriptors, more than the {max_descriptors} this service takes",
            request.descriptors.len()
        )));
    }
    if request.domain.len() > max_len {
        return Err(Status::invalid_argument(format!(
            "the domain is longer than {max_len} bytes"
        )));
    }
    for (i, d) in request.descriptors.iter().enumerate() {
        if d.entries.is_empty() {
            return Err(Status::invalid_argument(format!(
                "descriptor {i} has no entries"
            )));
        }
        if d.entries.len() > MAX_DESCRIPTOR_ENTRIES {
            return Err(Status::invalid_argument(format!(
                "descriptor {i} has {} entries, more than {MAX_DESCRIPTOR_ENTRIES}",
                d.entries.len()
            )));
        }
        if d.is_negative_hits {
            return Err(Status::invalid_argument(format!(
                "descriptor {i}: negative hits are not supported"
            )));
        }
        for (j, e) in d.entries.iter().enumerate() {
            if e.key.is_empty() {
                return Err(Status::invalid_argument(format!(
                    "descriptor {i}, entry {j}: empty key"
                )));
            }
            if e.key.len() > max_len || e.value.len() > max_len {
                return Err(Status::invalid_argument(format!(
                    "descriptor {i}, entry {j}: a key or value is longer than {max_len} bytes"
                )));
            }
        }
    }
    Ok(())
}

/// The counter of a descriptor: the domain and every entry, each length-prefixed so that no
/// two descriptors share one; a value matched by a shared wildcard counts under the pattern.
/// Long keys become their SHA-256.
fn counter_key(
    domain: &str,
    descriptor: &RateLimitDescriptor,
    shared: &[Option<String>],
) -> String {
    let mut key = String::with_capacity(64);
    let _ = write!(key, "envoy/{}:{domain}", domain.len());
    for (i, e) in descriptor.entries.iter().enumerate() {
        let value = shared
            .get(i)
            .and_then(Option::as_deref)
            .unwrap_or(e.value.as_str());
        let _ = write!(key, "/{}:{}={}:{value}", e.key.len(), e.key, value.len());
    }
    if key.len() <= MAX_PLAIN_KEY_LEN {
        return key;
    }
    use sha2::{Digest, Sha256};
    let mut hashed = String::from("envoy#");
    for b in Sha256::digest(key.as_bytes()) {
        let _ = write!(hashed, "{b:02x}");
    }
    hashed
}

/// The response headers for the descriptor that decided, as the profile asks.
fn headers(
    profile: HeaderProfile,
    limit: &Limit,
    policy: Option<&Policy>,
    decision: &Decision,
) -> Vec<HeaderValue> {
    let Some(policy) = policy else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let name = limit.name.as_deref().unwrap_or("envoy");
    let t = answer::t_secs(decision, policy);
    let ietf = matches!(profile, HeaderProfile::Ietf | HeaderProfile::Both);
    let legacy = matches!(profile, HeaderProfile::Legacy | HeaderProfile::Both);
    if ietf {
        let w = policy.window().as_secs().max(1);
        out.push(HeaderValue {
            key: answer::RATELIMIT_POLICY.as_str().to_owned(),
            value: format!("\"{name}\";q={};w={w}", policy.limit()),
        });
        out.push(HeaderValue {
            key: answer::RATELIMIT.as_str().to_owned(),
            value: format!("\"{name}\";r={};t={t}", decision.remaining()),
        });
    }
    if legacy {
        let reset = decision
            .retry_after_secs()
            .unwrap_or_else(|| decision.reset_after_secs());
        out.push(HeaderValue {
            key: answer::X_RATELIMIT_LIMIT.as_str().to_owned(),
            value: limit.requests_per_unit.to_string(),
        });
        out.push(HeaderValue {
            key: answer::X_RATELIMIT_REMAINING.as_str().to_owned(),
            value: decision.remaining().to_string(),
        });
        out.push(HeaderValue {
            key: answer::X_RATELIMIT_RESET.as_str().to_owned(),
            value: reset.to_string(),
        });
    }
    out
}
