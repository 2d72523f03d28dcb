//! `ShouldRateLimit` on any [`Store`].

use std::collections::HashSet;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tonic::{Request, Response, Status};

use super::config::{Config, Limit, LimitKind, Unit};
use super::proto::rate_limit_descriptor::RateLimitOverride;
use super::proto::rate_limit_response::{Code, DescriptorStatus, RateLimit, rate_limit};
use super::proto::rate_limit_service_server::RateLimitServiceServer;
use super::proto::{
    HeaderValue, RateLimitDescriptor, RateLimitRequest, RateLimitResponse, RateLimitUnit,
};
use crate::answer::{self, HeaderProfile};
use crate::{Check, Decision, Policy, Store};

/// The most descriptors one call may carry, unless set with
/// [`RateLimitService::max_descriptors`].
pub const DEFAULT_MAX_DESCRIPTORS: usize = 64;

/// The longest key or value of a descriptor entry, in bytes, unless set with
/// [`RateLimitService::max_entry_len`].
pub const DEFAULT_MAX_ENTRY_LEN: usize = 1024;

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

/// What the clones of a service share: the store and the configuration.
struct Inner<S> {
    store: S,
    config: ArcSwap<Config>,
}

/// What each clone carries.
#[derive(Clone, Copy, Debug)]
struct Options {
    headers: HeaderProfile,
    max_descriptors: usize,
    max_entry_len: usize,
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
    /// The service for `config` on `store`; no response headers.
    pub fn new(store: S, config: Config) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                config: ArcSwap::from_pointee(config),
            }),
            options: Options {
                headers: HeaderProfile::Off,
                max_descriptors: DEFAULT_MAX_DESCRIPTORS,
                max_entry_len: DEFAULT_MAX_ENTRY_LEN,
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

    /// Replaces the configuration, for every clone of this service, for the calls that start
    /// from now on (hot reload). Counters live in the store under the descriptor's entries and
    /// the limit's parameters, so a limit that the new configuration keeps unchanged keeps its
    /// counts, and a changed one starts afresh.
    pub fn set_config(&self, config: Config) {
        self.inner.config.store(Arc::new(config));
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
        validate(request, options.max_descriptors, options.max_entry_len)?;
        let config = inner.config.load();
        let known = config.has_domain(&request.domain);

        // What each descriptor is held to, and what it costs.
        let mut slots: Vec<Slot> = Vec::with_capacity(request.descriptors.len());
        for descriptor in &request.descriptors {
            let cost = descriptor
                .hits_addend
                .unwrap_or(u64::from(request.hits_addend.max(1)));
            let (limit, shared) = match (&descriptor.limit, known) {
                (_, false) => (None, Vec::new()),
                (Some(o), true) => (Some(Arc::new(override_limit(o)?)), Vec::new()),
                (None, true) => match config.lookup(
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
            slots.push(Slot { limit, cost, key });
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

        let mut statuses: Vec<DescriptorStatus> = slots.iter().map(Slot::unchecked).collect();
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
        } else if !enforced.is_empty() {
            let checks: Vec<Check<'_>> = enforced
                .iter()
                .filter_map(|&i| {
                    let s = &slots[i];
                    Some(Check::new(&s.key, s.counted(false)?, s.cost))
                })
                .collect();
            let decision =
                inner.store.check_all(&checks).await.map_err(|e| {
                    Status::unavailable(format!("the rate limit store failed: {e}"))
                })?;
            let at = enforced.get(decision.index()).copied().unwrap_or(0);
            fill(&mut statuses, &slots, &enforced, at, &decision);
            if !decision.allowed() {
                overall = Code::OverLimit;
            }
            binding = Some((at, decision));
        }

        // Shadow limits: counted only for a call the enforced limits admitted, in a call of
        // their own, and always OK.
        let shadows: Vec<usize> = (0..slots.len())
            .filter(|&i| slots[i].counted(true).is_some())
            .collect();
        if overall == Code::Ok && !shadows.is_empty() {
            let checks: Vec<Check<'_>> = shadows
                .iter()
                .filter_map(|&i| {
                    let s = &slots[i];
                    Some(Check::new(&s.key, s.counted(true)?, s.cost))
                })
                .collect();
            if let Ok(decision) = inner.store.check_all(&checks).await {
                let at = shadows.get(decision.index()).copied().unwrap_or(0);
                fill(&mut statuses, &slots, &shadows, at, &decision);
                for &i in &shadows {
                    statuses[i].code = Code::Ok as i32;
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
/// cost and its counter's key.
struct Slot {
    limit: Option<Arc<Limit>>,
    cost: u64,
    key: String,
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
