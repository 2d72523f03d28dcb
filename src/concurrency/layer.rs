//! The layer's configuration, and the state every clone of it shares.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Response, StatusCode};
use smallvec::SmallVec;
use tower_layer::Layer;

use super::service::ConcurrencyLimit;
use super::table::InFlight;
use crate::answer::{DefaultResponder, Rejection, RejectionKind, Responder};
use crate::clock::{Clock, SystemClock};
use crate::key::{Key, MAX_KEY_LEN};
use crate::limiter::{Matcher, Rule, valid_name};

/// At most so many requests in flight per key, and optionally in all: see the
/// [module docs](super).
#[derive(Clone)]
pub struct ConcurrencyLimitLayer {
    pub(crate) shared: Arc<Shared>,
}

impl ConcurrencyLimitLayer {
    /// A builder with no rules yet.
    pub fn builder() -> ConcurrencyLimitLayerBuilder {
        ConcurrencyLimitLayerBuilder {
            rules: Vec::new(),
            total: None,
            responder: Box::new(DefaultResponder),
            clock: Arc::new(SystemClock::new()),
        }
    }

    /// Requests in flight for `key` under the rule named `rule` (0 for an unknown rule).
    pub fn in_flight(&self, rule: &str, key: &str) -> u32 {
        let mut store_key = Key::from(key);
        store_key.push_raw("@");
        store_key.push_raw(rule);
        self.shared.in_flight.count(bounded(store_key).as_str())
    }

    /// Requests in flight under the total cap (or over all rules' keys when there is none).
    pub fn total_in_flight(&self) -> u64 {
        match &self.shared.total {
            Some(total) => u64::from(total.count.load(Ordering::Acquire)),
            None => self.shared.in_flight.total(),
        }
    }

    /// Keys with requests in flight: each key's entry is removed when its count returns to
    /// zero, so this is bounded by the requests in flight.
    pub fn tracked_keys(&self) -> usize {
        self.shared.in_flight.keys()
    }
}

impl<S> Layer<S> for ConcurrencyLimitLayer {
    type Service = ConcurrencyLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ConcurrencyLimit::new(inner, self.shared.clone())
    }
}

impl fmt::Debug for ConcurrencyLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLimitLayer")
            .field(
                "rules",
                &self
                    .shared
                    .rules
                    .iter()
                    .map(|r| (&*r.matcher.name, r.max))
                    .collect::<Vec<_>>(),
            )
            .field("total", &self.shared.total.as_ref().map(|t| t.max))
            .finish_non_exhaustive()
    }
}

/// Builds a [`ConcurrencyLimitLayer`]; everything is validated by
/// [`ConcurrencyLimitLayerBuilder::build`].
pub struct ConcurrencyLimitLayerBuilder {
    rules: Vec<(Rule, u32)>,
    total: Option<u32>,
    responder: Box<dyn Responder>,
    clock: Arc<dyn Clock>,
}

impl ConcurrencyLimitLayerBuilder {
    /// At most `max_in_flight` requests in flight per key of `rule`, for the requests it
    /// matches (its methods, path or route, key, and what to do without a key, as for rate
    /// limits; the rule takes no policies here). Every rule that matches a request applies,
    /// all or nothing.
    pub fn rule(mut self, rule: Rule, max_in_flight: u32) -> Self {
        self.rules.push((rule, max_in_flight));
        self
    }

    /// At most `max_in_flight` requests in flight in all, whatever their keys: past it, `503`.
    pub fn total(mut self, max_in_flight: u32) -> Self {
        self.total = Some(max_in_flight);
        self
    }

    /// How refusals are answered ([`DefaultResponder`] unless set).
    pub fn responder(mut self, responder: impl Responder) -> Self {
        self.responder = Box::new(responder);
        self
    }

    /// The clock that times requests for `Retry-After` (the system's monotonic clock unless
    /// set; a [`ManualClock`](crate::clock::ManualClock) in tests).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Validates the rules and builds the layer.
    pub fn build(self) -> Result<ConcurrencyLimitLayer, ConcurrencyError> {
        if self.rules.is_empty() && self.total.is_none() {
            return Err(ConcurrencyError::NothingToLimit);
        }
        if self.total == Some(0) {
            return Err(ConcurrencyError::ZeroLimit("total".into()));
        }
        if self.rules.len() > usize::from(u16::MAX) {
            return Err(ConcurrencyError::TooManyRules(self.rules.len()));
        }
        let mut rules: Vec<KeyedRule> = Vec::with_capacity(self.rules.len());
        for (rule, max) in self.rules {
            let name = rule.name.clone();
            if !valid_name(&name) {
                return Err(ConcurrencyError::InvalidRuleName(
                    name.chars().take(80).collect(),
                ));
            }
            if rules.iter().any(|r| *r.matcher.name == *name) {
                return Err(ConcurrencyError::DuplicateRule(name));
            }
            if !rule.policies.is_empty() || rule.tiers.is_some() || rule.shadow {
                return Err(ConcurrencyError::NotAConcurrencyRule(name));
            }
            if max == 0 {
                return Err(ConcurrencyError::ZeroLimit(name));
            }
            rules.push(KeyedRule {
                matcher: Matcher::new(rule),
                max,
                latency: Latency::default(),
            });
        }
        Ok(ConcurrencyLimitLayer {
            shared: Arc::new(Shared {
                rules: rules.into(),
                in_flight: InFlight::new(),
                total: self.total.map(|max| Total {
                    max,
                    count: AtomicU32::new(0),
                }),
                latency: Latency::default(),
                responder: self.responder,
                clock: self.clock,
            }),
        })
    }
}

impl fmt::Debug for ConcurrencyLimitLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLimitLayerBuilder")
            .field("rules", &self.rules)
            .field("total", &self.total)
            .finish_non_exhaustive()
    }
}

/// Why a [`ConcurrencyLimitLayer`] could not be built.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConcurrencyError {
    /// Neither a rule nor a total cap.
    NothingToLimit,
    /// A limit of zero would refuse every request (the rule's name, or `total`).
    ZeroLimit(String),
    /// A rule name that is empty, too long, or has characters outside `a-z A-Z 0-9 - _ . :`.
    InvalidRuleName(String),
    /// Two rules with one name.
    DuplicateRule(String),
    /// A rule with policies, tiers or shadow mode, which limit rates, not requests in flight.
    NotAConcurrencyRule(String),
    /// More rules than 65 535.
    TooManyRules(usize),
}

impl fmt::Display for ConcurrencyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConcurrencyError::NothingToLimit => {
                f.write_str("no rule and no total cap: add .rule(..) or .total(..)")
            }
            ConcurrencyError::ZeroLimit(name) => {
                write!(f, "{name:?}: a limit of 0 in flight refuses every request")
            }
            ConcurrencyError::InvalidRuleName(name) => write!(
                f,
                "invalid rule name {name:?}: use 1 to {} of a-z A-Z 0-9 - _ . :",
                crate::MAX_NAME_LEN
            ),
            ConcurrencyError::DuplicateRule(name) => write!(f, "two rules are named {name:?}"),
            ConcurrencyError::NotAConcurrencyRule(name) => write!(
                f,
                "rule {name:?} has policies, tiers or shadow mode: a concurrency rule takes \
                 only its matching and key, and its limit from .rule(rule, max_in_flight)"
            ),
            ConcurrencyError::TooManyRules(n) => write!(f, "{n} rules: at most 65535"),
        }
    }
}

impl std::error::Error for ConcurrencyError {}

/// What every clone of the layer and its services shares.
pub(crate) struct Shared {
    rules: Box<[KeyedRule]>,
    pub(crate) in_flight: InFlight,
    total: Option<Total>,
    /// How long requests stayed in flight, over all rules.
    latency: Latency,
    responder: Box<dyn Responder>,
    clock: Arc<dyn Clock>,
}

/// A rule: which requests, which key, how many in flight per key.
struct KeyedRule {
    matcher: Matcher,
    max: u32,
    /// How long this rule's requests stayed in flight.
    latency: Latency,
}

struct Total {
    max: u32,
    count: AtomicU32,
}

/// A moving average of the time requests stay in flight, in nanoseconds (each new sample
/// weighs one eighth); 0 before the first.
#[derive(Default)]
struct Latency(AtomicU64);

impl Latency {
    fn record(&self, nanos: u64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |avg| {
                Some(if avg == 0 {
                    nanos.max(1)
                } else {
                    avg - avg / 8 + nanos / 8
                })
            });
    }

    /// The average, as a `Retry-After`: at least 1 s, at most [`MAX_RETRY_AFTER`] (a rule over
    /// long downloads or streams would otherwise send clients away for hours).
    fn retry_after(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
            .clamp(Duration::from_secs(1), MAX_RETRY_AFTER)
    }
}

/// The longest `Retry-After` a concurrency refusal sends.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// The places one request holds; dropping it gives them back (and, for a request that got
/// every place, times it).
pub(crate) struct Permit {
    shared: Arc<Shared>,
    held: SmallVec<[Held; 2]>,
    total: bool,
    started: u64,
    /// Whether the request got every place: a permit dropped while being refused gives back
    /// what it took but teaches nothing about how long requests stay.
    granted: bool,
}

struct Held {
    rule: u16,
    hash: u64,
    key: Key,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let shared = &self.shared;
        let elapsed = self
            .granted
            .then(|| shared.clock.now().saturating_sub(self.started));
        for held in &self.held {
            shared.in_flight.release(held.hash, &held.key);
            if let (Some(rule), Some(elapsed)) = (shared.rules.get(usize::from(held.rule)), elapsed)
            {
                rule.latency.record(elapsed);
            }
        }
        if self.total {
            if let Some(total) = &shared.total {
                total.count.fetch_sub(1, Ordering::AcqRel);
            }
        }
        if let Some(elapsed) = elapsed {
            shared.latency.record(elapsed);
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field(
                "keys",
                &self.held.iter().map(|h| &h.key).collect::<Vec<_>>(),
            )
            .field("total", &self.total)
            .finish()
    }
}

/// Why a request gets no permit.
pub(crate) enum Refusal {
    /// Rule `rule`'s key is at its limit.
    Busy { rule: u16 },
    /// The total cap is reached.
    Full,
    /// Rule `rule` found no key and refuses such requests with `status`.
    NoKey { rule: u16, status: StatusCode },
}

impl Shared {
    /// Takes the places of every rule that applies and of the total cap, all or none.
    pub(crate) fn admit(self: &Arc<Self>, parts: &Parts) -> Result<Permit, Refusal> {
        let mut permit = Permit {
            shared: Arc::clone(self),
            held: SmallVec::new(),
            total: false,
            started: self.clock.now(),
            granted: false,
        };
        for (index, rule) in self.rules.iter().enumerate() {
            if !rule.matcher.matches(parts) {
                continue;
            }
            let index = u16::try_from(index).unwrap_or(u16::MAX);
            let key = match rule.matcher.key(parts) {
                Ok(Some(key)) => key,
                Ok(None) => continue,
                Err(status) => {
                    return Err(Refusal::NoKey {
                        rule: index,
                        status,
                    });
                }
            };
            let hash = self.in_flight.hash(key.as_str());
            if !self.in_flight.acquire(hash, &key, rule.max) {
                // The places already taken go back with `permit`.
                return Err(Refusal::Busy { rule: index });
            }
            permit.held.push(Held {
                rule: index,
                hash,
                key,
            });
        }
        if let Some(total) = &self.total {
            let taken = total
                .count
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < total.max).then_some(n + 1)
                });
            if taken.is_err() {
                return Err(Refusal::Full);
            }
            permit.total = true;
        }
        permit.granted = true;
        Ok(permit)
    }

    /// The answer to a refused request.
    pub(crate) fn answer(&self, parts: &Parts, refusal: Refusal) -> Response<Bytes> {
        let rule = |index: u16| self.rules.get(usize::from(index));
        let (kind, status, rule, retry_after) = match refusal {
            Refusal::Busy { rule: index } => (
                RejectionKind::TooManyInFlight,
                StatusCode::TOO_MANY_REQUESTS,
                rule(index),
                rule(index).map(|r| r.latency.retry_after()),
            ),
            Refusal::Full => (
                RejectionKind::Overloaded,
                StatusCode::SERVICE_UNAVAILABLE,
                None,
                Some(self.latency.retry_after()),
            ),
            Refusal::NoKey {
                rule: index,
                status,
            } => (RejectionKind::NoKey, status, rule(index), None),
        };
        crate::answer::refuse(
            &*self.responder,
            &Rejection {
                kind,
                parts,
                status,
                decision: None,
                rule: rule.map(|r| &*r.matcher.name),
                policy: None,
                window: None,
                retry_after,
                error: None,
            },
        )
    }
}

/// A key as the table holds it: hashed past [`MAX_KEY_LEN`], as the limiter's are.
pub(crate) fn bounded(key: Key) -> Key {
    if key.len() <= MAX_KEY_LEN {
        return key;
    }
    let text = key.as_str();
    let at = text.rfind('@').unwrap_or(text.len());
    crate::limiter::hashed_key(&text[..at], &text[at..])
}
