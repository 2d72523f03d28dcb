//! Answers: the rate-limit fields, and the responses to refused requests (HTTP and gRPC), one
//! path that every layer of the crate answers through, so that a client sees one protocol
//! whichever layer refused it.
//!
//! - [`Rejection`] is everything a refusal's answer needs (why, status, decision, rule and
//!   policy, retry time); [`Responder`] turns it into a response, [`DefaultResponder`] the
//!   usual way: `429` or `503` with `Retry-After`, `Cache-Control: no-store` and an RFC 9457
//!   problem body, or for gRPC HTTP 200 with `grpc-status` and `grpc-retry-pushback-ms`.
//! - [`HeaderProfile`] and [`ResetFormat`] choose the rate-limit fields of a response.
//! - [`RefusalBody`] lets a layer answer in the inner service's own body type.
//!
//! The names are also exported from [`http`](crate::http), where they first lived.
//!
//! ```
//! use std::time::Duration;
//! use http::StatusCode;
//! use tollgate::answer::{DefaultResponder, Responder};
//!
//! // What the rate-limit layer sends a client it refuses (see `tollgate::http` for the layer).
//! # let _ = (DefaultResponder, Duration::ZERO, StatusCode::OK);
//! assert_eq!(tollgate::answer::RATELIMIT.as_str(), "ratelimit");
//! assert_eq!(tollgate::answer::GRPC_RETRY_PUSHBACK_MS.as_str(), "grpc-retry-pushback-ms");
//! ```

mod body;

pub use body::{RefusalBody, ResponseBody};

use std::fmt::{self, Write as _};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Response, StatusCode};

use http::HeaderName;

use crate::{Algorithm, Decision, Policy, StoreError};

/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers): the policy closest to exhaustion.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers): the policies that applied.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `X-RateLimit-Limit` (legacy profile).
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining` (legacy profile).
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset` (legacy profile).
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// `grpc-status`.
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// `grpc-message`.
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// `grpc-retry-pushback-ms`: how long a gRPC client should wait before retrying.
pub const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// The problem type of a refused request (RFC 9457), registered by the IETF RateLimit fields
/// draft.
pub const QUOTA_EXCEEDED_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// The problem type of a request refused because its key has too many requests in flight
/// ([`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer)). No such type is registered, so
/// this one points at its documentation.
pub const TOO_MANY_IN_FLIGHT_TYPE: &str =
    "https://docs.rs/tollgate/latest/tollgate/concurrency/index.html#too-many-requests-in-flight";

const QUOTA_EXCEEDED_TITLE: &str =
    "Request cannot be satisfied as assigned quota has been exceeded";

/// Which rate-limit header fields responses carry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderProfile {
    /// `RateLimit-Policy` and `RateLimit` as in draft-ietf-httpapi-ratelimit-headers:
    /// `RateLimit-Policy: "per-minute";q=100;w=60` lists every policy that applied (`q` the
    /// limit, `w` the window in seconds, for a bucket the time an empty burst takes to refill)
    /// and `RateLimit: "per-minute";r=42;t=18` reports the policy that runs out first for
    /// requests like this one (the fewest further requests at their cost): `r` what remains,
    /// `t` the seconds until more quota is made available (per algorithm: see
    /// [the layer's docs](crate::http#what-the-fields-say)); on a refusal, the seconds until
    /// the request may be retried, the same number as `Retry-After`.
    #[default]
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` for the policy
    /// that runs out first: widely deployed, never standardised. Reset is the time until the
    /// policy has fully recovered (on a refusal, until the retry), in delta seconds unless
    /// [`ResetFormat::UnixSeconds`] is chosen.
    Legacy,
    /// Both of the above.
    Both,
    /// No rate-limit fields (`Retry-After` is still sent on refusals).
    Off,
}

impl HeaderProfile {
    fn ietf(self) -> bool {
        matches!(self, HeaderProfile::Ietf | HeaderProfile::Both)
    }

    fn legacy(self) -> bool {
        matches!(self, HeaderProfile::Legacy | HeaderProfile::Both)
    }
}

/// How `X-RateLimit-Reset` tells the time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResetFormat {
    /// Seconds from now, rounded up (the default; needs no synchronised clocks).
    #[default]
    DeltaSeconds,
    /// The Unix time, in seconds, at which the limit will have reset (GitHub's convention; it
    /// reads the system's wall clock).
    UnixSeconds,
}

/// The field values of one response, computed when the decision is known.
#[derive(Debug, Default)]
pub(crate) struct FieldValues {
    policy: Option<HeaderValue>,
    status: Option<HeaderValue>,
    legacy: Option<Box<[HeaderValue; 3]>>,
}

impl FieldValues {
    /// The fields for `decision`, made by `policy`, whose `RateLimit` values `status` makes,
    /// with the `RateLimit-Policy` value of the policies that applied.
    #[inline]
    pub(crate) fn new(
        profile: HeaderProfile,
        reset: ResetFormat,
        decision: &Decision,
        policy: &Policy,
        status: &StatusField,
        policy_field: impl FnOnce() -> Option<HeaderValue>,
    ) -> Self {
        let mut values = FieldValues::default();
        if profile.ietf() {
            values.policy = policy_field();
            values.status = status.value(decision.remaining(), t_secs(decision, policy));
        }
        if profile.legacy() {
            values.legacy = Some(Box::new(legacy_values(reset, decision)));
        }
        values
    }

    /// Writes the fields into a response's headers.
    #[inline(always)]
    pub(crate) fn apply(self, headers: &mut HeaderMap) {
        if let Some(v) = self.policy {
            headers.insert(RATELIMIT_POLICY, v);
        }
        if let Some(v) = self.status {
            headers.insert(RATELIMIT, v);
        }
        if let Some(legacy) = self.legacy {
            let [limit, remaining, reset] = *legacy;
            headers.insert(X_RATELIMIT_LIMIT, limit);
            headers.insert(X_RATELIMIT_REMAINING, remaining);
            headers.insert(X_RATELIMIT_RESET, reset);
        }
    }
}

/// The wall clock in Unix seconds: only for the `X-RateLimit-Reset` variant that asks for it.
/// Limits themselves never read wall time.
#[allow(clippy::disallowed_methods)]
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The legacy trio: the limit, what remains, and the reset (seconds until full recovery, or
/// until the retry when refused; or that moment as a Unix time).
#[cold]
fn legacy_values(reset: ResetFormat, decision: &Decision) -> [HeaderValue; 3] {
    let secs = decision
        .retry_after_secs()
        .unwrap_or_else(|| decision.reset_after_secs());
    let reset = match reset {
        ResetFormat::DeltaSeconds => secs,
        ResetFormat::UnixSeconds => unix_now().saturating_add(secs),
    };
    [
        HeaderValue::from(decision.limit()),
        HeaderValue::from(decision.remaining()),
        HeaderValue::from(reset),
    ]
}

/// `RateLimit`'s `t` for `decision`, made by `policy`: the seconds until more quota is made
/// available (draft-ietf-httpapi-ratelimit-headers), rounded up; on a refusal, the seconds
/// until this request may be retried (the same number as `Retry-After`, never less).
///
/// - **Buckets** (token bucket, leaky bucket, GCRA): until the next unit refills, i.e.
///   [`Decision::reset_after`] modulo the interval (a whole interval when it divides
///   exactly; 0 when the bucket is full).
/// - **Fixed window**: until the window ends ([`Decision::reset_after`]).
/// - **Sliding log**: until the log has fully recovered ([`Decision::reset_after`], at most
///   the window): the oldest entry may leave sooner, so clients wait a little more than they
///   must, never less.
/// - **Sliding window counter**: until the current window ends (the counts of the current
///   window stop counting fully then), so never more than the window.
pub(crate) fn t_secs(decision: &Decision, policy: &Policy) -> u64 {
    if let Some(retry) = decision.retry_after_secs() {
        return retry;
    }
    let reset = saturating_nanos(decision.reset_after());
    let period = policy.period_nanos();
    let nanos = match policy.algorithm() {
        Algorithm::Gcra | Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            match reset.checked_rem(period) {
                _ if reset == 0 => 0,
                Some(0) | None => period,
                Some(part) => part,
            }
        }
        Algorithm::FixedWindow | Algorithm::SlidingLog => reset,
        Algorithm::SlidingWindow if reset > period => reset - period,
        Algorithm::SlidingWindow => reset,
    };
    nanos.div_ceil(1_000_000_000)
}

fn saturating_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The `RateLimit` values of one policy: `"name";r=R;t=T`, made once per `(r, t)` and shared.
///
/// A policy sends few distinct pairs (`r` is at most its limit, `t` at most its window), so
/// each pair's value is made the first time it is sent and kept in one of at most
/// [`STATUS_SLOTS`] slots of this policy (indexed by the pair when all its pairs fit, else by
/// a hash of it, the first pair to come keeping a slot). A kept value is static (its text is
/// kept for the life of the process, once per distinct text, at most [`STATUS_TEXTS`] texts
/// and [`STATUS_TEXT_BYTES`] bytes of text in all), so that sending it writes no reference count: the cores serving
/// requests would otherwise all write one shared counter per response. A pair that finds its
/// slot taken by another, or comes after the texts' bound is reached, gets a value of its own,
/// as every response once did. The slots are allocated the first time the policy sends a
/// value, and freed with the layer.
pub(crate) struct StatusField {
    /// `"name";r=`.
    item: Box<str>,
    /// `t` of the last pair indexed directly; past it, or past `r` = `direct_r`, hashed.
    direct_t: u64,
    direct_r: u64,
    /// Whether every pair of the policy has a slot of its own.
    direct: bool,
    slots: OnceLock<Box<[OnceLock<Made>]>>,
}

/// A `RateLimit` value made for one `(r, t)`.
struct Made {
    r: u64,
    t: u64,
    value: HeaderValue,
}

/// The most slots one policy keeps `RateLimit` values in.
pub(crate) const STATUS_SLOTS: usize = 1024;

/// The most `RateLimit` texts kept for the life of the process, over all policies.
pub(crate) const STATUS_TEXTS: usize = 6 * 1024;

/// The most bytes of `RateLimit` texts kept for the life of the process, over all policies.
pub(crate) const STATUS_TEXT_BYTES: usize = 1 << 20;

impl StatusField {
    /// The values of a policy called `name`.
    pub(crate) fn new(name: &str, policy: &Policy) -> Self {
        use crate::limiter::SF_INTEGER_MAX;
        let window = policy.window().as_nanos().div_ceil(1_000_000_000);
        let direct_t = u64::try_from(window)
            .unwrap_or(u64::MAX)
            .min(SF_INTEGER_MAX);
        let direct_r = policy.limit().min(SF_INTEGER_MAX);
        let pairs = (u128::from(direct_r) + 1) * (u128::from(direct_t) + 1);
        StatusField {
            item: format!("\"{name}\";r=").into(),
            direct_t,
            direct_r,
            direct: pairs <= STATUS_SLOTS as u128,
            slots: OnceLock::new(),
        }
    }

    /// The slot of `(r, t)`: none for a pair outside the policy's own (a refusal's `t`
    /// past the window) when every pair of the policy has a slot of its own.
    #[inline(always)]
    fn slot(&self, r: u64, t: u64) -> Option<usize> {
        if !self.direct {
            let mixed = (r ^ t.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            return Some((mixed >> (64 - STATUS_SLOTS.trailing_zeros())) as usize);
        }
        // Then (direct_r + 1) * (direct_t + 1) <= STATUS_SLOTS: no overflow.
        (r <= self.direct_r && t <= self.direct_t).then(|| (r * (self.direct_t + 1) + t) as usize)
    }

    /// `"name";r=R;t=T`.
    #[inline]
    pub(crate) fn value(&self, r: u64, t: u64) -> Option<HeaderValue> {
        use crate::limiter::SF_INTEGER_MAX;
        let (r, t) = (r.min(SF_INTEGER_MAX), t.min(SF_INTEGER_MAX));
        let slots = self.slots.get_or_init(|| {
            let n = if self.direct {
                ((self.direct_r + 1) * (self.direct_t + 1)) as usize
            } else {
                STATUS_SLOTS
            };
            (0..n).map(|_| OnceLock::new()).collect()
        });
        let Some(slot) = self.slot(r, t).and_then(|i| slots.get(i)) else {
            return self.make(r, t);
        };
        match slot.get() {
            Some(made) if made.r == r && made.t == t => Some(made.value.clone()),
            Some(_) => self.make(r, t),
            None => self.keep(slot, r, t),
        }
    }

    /// A value of its own, as every response once had.
    #[cold]
    fn make(&self, r: u64, t: u64) -> Option<HeaderValue> {
        HeaderValue::from_maybe_shared(Bytes::from(self.text(r, t))).ok()
    }

    /// Makes the value of `(r, t)`, static if the texts' bound allows, and keeps it in `slot`.
    #[cold]
    fn keep(&self, slot: &OnceLock<Made>, r: u64, t: u64) -> Option<HeaderValue> {
        let text = self.text(r, t);
        let Some(text) = keep_text(text) else {
            return self.make(r, t);
        };
        let made = slot.get_or_init(|| Made {
            r,
            t,
            value: HeaderValue::from_static(text),
        });
        if made.r == r && made.t == t {
            Some(made.value.clone())
        } else {
            self.make(r, t)
        }
    }

    fn text(&self, r: u64, t: u64) -> Vec<u8> {
        let mut r_digits = itoa::Buffer::new();
        let r = r_digits.format(r).as_bytes();
        let mut t_digits = itoa::Buffer::new();
        let t = t_digits.format(t).as_bytes();
        let mut text = Vec::with_capacity(self.item.len() + r.len() + 3 + t.len());
        text.extend_from_slice(self.item.as_bytes());
        text.extend_from_slice(r);
        text.extend_from_slice(b";t=");
        text.extend_from_slice(t);
        text
    }
}

impl fmt::Debug for StatusField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatusField")
            .field("item", &self.item)
            .finish_non_exhaustive()
    }
}

/// `text` kept for the life of the process (once per distinct text), if it is visible ASCII
/// (what `HeaderValue::from_static` takes) and the bounds on kept texts allow.
///
/// The set of kept texts is made at its full size the first time, so that keeping a text
/// never grows it: a request allocates as much whether its text was kept before or not (its
/// text is made either way, then kept or dropped).
fn keep_text(text: Vec<u8>) -> Option<&'static str> {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{LazyLock, Mutex};
    type Kept = (HashSet<&'static str>, usize);
    static KEPT: LazyLock<Mutex<Kept>> =
        LazyLock::new(|| Mutex::new((HashSet::with_capacity(STATUS_TEXTS), 0)));
    // Set once a bound is reached: no lock is taken after that.
    static FULL: AtomicBool = AtomicBool::new(false);
    if FULL.load(Ordering::Relaxed) || !text.iter().all(|b| (b' '..=b'~').contains(b)) {
        return None;
    }
    let text = String::from_utf8(text).ok()?;
    let mut kept = KEPT.lock().ok()?;
    let (set, bytes) = &mut *kept;
    if let Some(&text) = set.get(text.as_str()) {
        return Some(text);
    }
    if set.len() >= STATUS_TEXTS || *bytes + text.len() > STATUS_TEXT_BYTES {
        FULL.store(true, Ordering::Relaxed);
        return None;
    }
    *bytes += text.len();
    let text: &'static str = Box::leak(text.into_boxed_str());
    set.insert(text);
    Some(text)
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectionKind {
    /// A policy refused it: 429 (gRPC `RESOURCE_EXHAUSTED`).
    Limited,
    /// The store could not decide (and its failure policy did not decide for it): 503 (gRPC
    /// `UNAVAILABLE`). The problem is the server's, not the client's.
    Unavailable,
    /// A rule found no key for it and is configured to refuse such requests
    /// ([`MissingKey::Reject`](crate::limiter::MissingKey::Reject)).
    NoKey,
    /// Its key already had as many requests in flight as its rule allows: 429 (gRPC
    /// `RESOURCE_EXHAUSTED`), the client's own doing.
    TooManyInFlight,
    /// The service as a whole had no capacity left (a total in-flight cap, load shedding): 503
    /// (gRPC `UNAVAILABLE`), not the client's doing.
    Overloaded,
}

/// Everything a [`Responder`] needs to answer a refused request.
#[derive(Debug)]
pub struct Rejection<'a> {
    pub(crate) kind: RejectionKind,
    pub(crate) parts: &'a Parts,
    pub(crate) status: StatusCode,
    pub(crate) decision: Option<Decision>,
    pub(crate) rule: Option<&'a str>,
    pub(crate) policy: Option<&'a str>,
    pub(crate) window: Option<PolicySpan>,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) error: Option<&'a StoreError>,
}

/// What a refusal's text says of the refusing policy: the span its limit is about, and for a
/// bucket (token or leaky bucket, GCRA, a shaper's queue) its emission interval, so that the
/// rate is stated as a rate and the limit as a burst.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PolicySpan {
    window: Duration,
    interval: Option<Duration>,
}

impl From<&Policy> for PolicySpan {
    fn from(policy: &Policy) -> Self {
        PolicySpan {
            window: policy.window(),
            interval: (!policy.algorithm().is_window()).then(|| policy.interval()),
        }
    }
}

impl<'a> Rejection<'a> {
    /// Why.
    pub fn kind(&self) -> RejectionKind {
        self.kind
    }

    /// The status the default answer uses: 429, 503, or the rule's status for a missing key.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The refused request's head.
    pub fn request(&self) -> &'a Parts {
        self.parts
    }

    /// Whether the request is gRPC (`content-type: application/grpc...`), which must be
    /// answered with HTTP 200 and a `grpc-status`.
    pub fn is_grpc(&self) -> bool {
        is_grpc(self.parts)
    }

    /// The refusing decision, for [`RejectionKind::Limited`].
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    /// The rule that refused (or found no key).
    pub fn rule(&self) -> Option<&'a str> {
        self.rule
    }

    /// The name of the policy that refused, as the `RateLimit` fields show it.
    pub fn policy(&self) -> Option<&'a str> {
        self.policy
    }

    /// The span the refusing policy's limit is about (its window, or for a bucket the time
    /// an empty burst takes to refill), as in `RateLimit-Policy`'s `w`.
    pub fn policy_window(&self) -> Option<Duration> {
        self.window.map(|span| span.window)
    }

    /// How long the client should wait: the exact time for a limit, the configured time for an
    /// unavailable store, `None` for a missing key.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// [`Rejection::retry_after`] in whole seconds, rounded up, as `Retry-After` carries it.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(|d| {
            d.as_nanos()
                .div_ceil(1_000_000_000)
                .try_into()
                .unwrap_or(u64::MAX)
        })
    }

    /// The store's error, for [`RejectionKind::Unavailable`].
    pub fn store_error(&self) -> Option<&'a StoreError> {
        self.error
    }
}

/// Put into the extensions of every response a tollgate layer made to refuse a request (429,
/// 503, a missing key's status, their gRPC forms), whatever the [`Responder`]: outer layers
/// and your metrics can tell tollgate's refusals from the service's own answers. The
/// [`LoadShedLayer`](crate::LoadShedLayer) does not learn latency from them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Refused {
    /// Why.
    pub kind: RejectionKind,
}

/// The responder's answer to `rejection`, marked [`Refused`]: every layer answers through this.
pub(crate) fn refuse(responder: &dyn Responder, rejection: &Rejection<'_>) -> Response<Bytes> {
    let mut response = responder.respond(rejection);
    response.extensions_mut().insert(Refused {
        kind: rejection.kind,
    });
    response
}

/// Answers refused requests. The layer adds the rate-limit fields of its
/// [`HeaderProfile`] to whatever this returns.
///
/// Any `Fn(&Rejection<'_>) -> Response<Bytes>` is a responder; [`DefaultResponder`] is the
/// default and can be called from your own:
///
/// ```
/// use bytes::Bytes;
/// use http::Response;
/// use tollgate::answer::{DefaultResponder, Rejection, RejectionKind, Responder};
///
/// let plain_text = |rejection: &Rejection<'_>| {
///     if rejection.is_grpc() || rejection.kind() != RejectionKind::Limited {
///         return DefaultResponder.respond(rejection);
///     }
///     let mut response = DefaultResponder.respond(rejection); // status, Retry-After, no-store
///     response.headers_mut().insert("content-type", "text/plain".parse().unwrap());
///     *response.body_mut() = Bytes::from_static(b"slow down\n");
///     response
/// };
/// # fn takes(_: impl Responder) {}
/// takes(plain_text);
/// ```
pub trait Responder: Send + Sync + 'static {
    /// The response to a refused request.
    fn respond(&self, rejection: &Rejection<'_>) -> Response<Bytes>;
}

impl<F> Responder for F
where
    F: Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync + 'static,
{
    fn respond(&self, rejection: &Rejection<'_>) -> Response<Bytes> {
        self(rejection)
    }
}

/// The default answers.
///
/// - **Limited**: `429 Too Many Requests`, `Retry-After` (whole seconds, rounded up),
///   `Cache-Control: no-store`, and an `application/problem+json` body (RFC 9457) of type
///   [`QUOTA_EXCEEDED_TYPE`] with `title`, `status`, `detail`, `violated-policies` (the policy
///   that refused) and `retry-after` (seconds).
/// - **Unavailable**: `503 Service Unavailable` with `Retry-After`, `no-store` and a problem
///   body; never 429, since the client did nothing wrong.
/// - **No key**: the rule's status with `no-store` and a problem body naming the rule.
/// - **gRPC** (`content-type: application/grpc*`): HTTP 200 with no body and `grpc-status` 8
///   (`RESOURCE_EXHAUSTED`) for a limit, 14 (`UNAVAILABLE`) for the store, and the code closest
///   to the status for a missing key; `grpc-message`, and `grpc-retry-pushback-ms` when there
///   is a delay to wait, so gRPC clients see a proper status and back off.
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultResponder;

impl Responder for DefaultResponder {
    fn respond(&self, rejection: &Rejection<'_>) -> Response<Bytes> {
        if rejection.is_grpc() {
            grpc_response(rejection)
        } else {
            problem_response(rejection)
        }
    }
}

fn problem_response(r: &Rejection<'_>) -> Response<Bytes> {
    let mut body = String::with_capacity(320);
    let status = r.status;
    let reason = status.canonical_reason().unwrap_or("Error");
    match r.kind {
        RejectionKind::Limited => {
            let policy = r.policy.unwrap_or("");
            let secs = r.retry_after_secs().unwrap_or(0);
            body.push_str("{\"type\":");
            json_string(&mut body, QUOTA_EXCEEDED_TYPE);
            body.push_str(",\"title\":");
            json_string(&mut body, QUOTA_EXCEEDED_TITLE);
            let _ = write!(body, ",\"status\":{},\"detail\":", status.as_u16());
            let detail = match (r.decision, r.window) {
                (Some(d), Some(span)) => match span.interval {
                    Some(interval) => format!(
                        "Policy \"{policy}\" allows {} per {} ({}, in bursts of up to {}); this request would exceed it. Retry in {secs} s.",
                        d.limit(),
                        HumanDuration(span.window),
                        HumanRate(interval),
                        d.limit(),
                    ),
                    None => format!(
                        "Policy \"{policy}\" allows {} per {}; this request would exceed it. Retry in {secs} s.",
                        d.limit(),
                        HumanDuration(span.window),
                    ),
                },
                _ => format!("Policy \"{policy}\" refused this request. Retry in {secs} s."),
            };
            json_string(&mut body, &detail);
            body.push_str(",\"violated-policies\":[");
            json_string(&mut body, policy);
            let _ = write!(body, "],\"retry-after\":{secs}}}");
        }
        RejectionKind::Unavailable => {
            let secs = r.retry_after_secs().unwrap_or(1);
            let _ = write!(
                body,
                "{{\"type\":\"about:blank\",\"title\":\"{reason}\",\"status\":{},\"detail\":\"The rate limiter cannot decide right now; retry in {secs} s.\",\"retry-after\":{secs}}}",
                status.as_u16()
            );
        }
        RejectionKind::TooManyInFlight => {
            let secs = r.retry_after_secs().unwrap_or(1);
            body.push_str("{\"type\":");
            json_string(&mut body, TOO_MANY_IN_FLIGHT_TYPE);
            body.push_str(",\"title\":\"Too many requests in flight\"");
            let _ = write!(body, ",\"status\":{},\"detail\":", status.as_u16());
            let detail = format!(
                "Rule \"{}\" allows no more requests in flight for this client; retry in {secs} s.",
                r.rule.unwrap_or("")
            );
            json_string(&mut body, &detail);
            let _ = write!(body, ",\"retry-after\":{secs}}}");
        }
        RejectionKind::Overloaded => {
            let secs = r.retry_after_secs().unwrap_or(1);
            let _ = write!(
                body,
                "{{\"type\":\"about:blank\",\"title\":\"{reason}\",\"status\":{},\"detail\":\"The service is at capacity; retry in {secs} s.\",\"retry-after\":{secs}}}",
                status.as_u16()
            );
        }
        RejectionKind::NoKey => {
            let _ = write!(
                body,
                "{{\"type\":\"about:blank\",\"title\":\"{reason}\",\"status\":{},\"detail\":",
                status.as_u16()
            );
            let detail = format!(
                "Rule \"{}\" found no key for this request.",
                r.rule.unwrap_or("")
            );
            json_string(&mut body, &detail);
            body.push('}');
        }
    }
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(secs) = r.retry_after_secs() {
        headers.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

/// Seconds as "60 s".
/// A duration as a refusal's text states it, exactly: `3 s`, `1.5 s`, `200 ms`, `0.25 ms`.
struct HumanDuration(Duration);

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nanos = self.0.as_nanos();
        let (unit, scale) = if nanos >= 1_000_000_000 {
            ("s", 1_000_000_000)
        } else {
            ("ms", 1_000_000)
        };
        let whole = nanos / scale;
        // Three decimals at most, trailing zeros dropped.
        let frac = (nanos % scale) * 1_000 / scale;
        if frac == 0 {
            write!(f, "{whole} {unit}")
        } else {
            let frac = format!("{frac:03}");
            write!(f, "{whole}.{} {unit}", frac.trim_end_matches('0'))
        }
    }
}

/// A bucket's rate from its emission interval: `10 per second`, or `1 per 1.5 s` below one a
/// second.
struct HumanRate(Duration);

impl fmt::Display for HumanRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nanos = self.0.as_nanos().max(1);
        if nanos <= 1_000_000_000 {
            // The interval is rounded up to whole nanoseconds: round the rate to the nearest.
            let per_second = (1_000_000_000 + nanos / 2) / nanos;
            write!(f, "{per_second} per second")
        } else {
            write!(f, "1 per {}", HumanDuration(self.0))
        }
    }
}

fn grpc_response(r: &Rejection<'_>) -> Response<Bytes> {
    let (code, message): (u8, String) = match r.kind {
        RejectionKind::Limited => (
            8,
            format!(
                "rate limit exceeded (policy \"{}\"); retry in {} s",
                r.policy.unwrap_or(""),
                r.retry_after_secs().unwrap_or(0)
            ),
        ),
        RejectionKind::Unavailable => (14, "the rate limiter cannot decide right now".into()),
        RejectionKind::TooManyInFlight => (
            8,
            format!(
                "too many requests in flight (rule \"{}\"); retry in {} s",
                r.rule.unwrap_or(""),
                r.retry_after_secs().unwrap_or(1)
            ),
        ),
        RejectionKind::Overloaded => (14, "the service is at capacity".into()),
        RejectionKind::NoKey => (
            grpc_code_for(r.status),
            format!(
                "rule \"{}\" found no key for this request",
                r.rule.unwrap_or("")
            ),
        ),
    };
    let mut response = Response::new(Bytes::new());
    let headers = response.headers_mut();
    // gRPC-Web clients expect their own content type back (`application/grpc-web`,
    // `application/grpc-web-text`, with any `+proto` suffix).
    let content_type = match r.parts.headers.get(CONTENT_TYPE) {
        Some(v) if starts_with_ignore_case(v.as_bytes(), b"application/grpc-web") => v.clone(),
        _ => HeaderValue::from_static("application/grpc"),
    };
    headers.insert(CONTENT_TYPE, content_type);
    headers.insert(GRPC_STATUS, HeaderValue::from(u16::from(code)));
    if let Ok(v) = HeaderValue::from_str(&percent_encode(&message)) {
        headers.insert(GRPC_MESSAGE, v);
    }
    if let Some(wait) = r.retry_after {
        let ms = wait.as_nanos().div_ceil(1_000_000);
        headers.insert(
            GRPC_RETRY_PUSHBACK_MS,
            HeaderValue::from(u64::try_from(ms).unwrap_or(u64::MAX)),
        );
    }
    response
}

/// The gRPC code that means what an HTTP status a rule refuses with means. This is not gRPC's
/// HTTP-to-gRPC table (`http-grpc-status-mapping.md`), which tells a client what to make of an
/// HTTP error from a proxy that sent no gRPC status, and maps 404 to `UNIMPLEMENTED` and 429 to
/// `UNAVAILABLE`: here the server chose the status on purpose, and the code says the same.
fn grpc_code_for(status: StatusCode) -> u8 {
    match status.as_u16() {
        400 => 3,        // INVALID_ARGUMENT
        401 => 16,       // UNAUTHENTICATED
        403 => 7,        // PERMISSION_DENIED
        404 => 5,        // NOT_FOUND
        409 => 10,       // ABORTED
        412 => 9,        // FAILED_PRECONDITION
        429 => 8,        // RESOURCE_EXHAUSTED
        499 => 1,        // CANCELLED
        501 => 12,       // UNIMPLEMENTED
        502 | 503 => 14, // UNAVAILABLE
        504 => 4,        // DEADLINE_EXCEEDED
        _ => 13,         // INTERNAL
    }
}

fn starts_with_ignore_case(bytes: &[u8], prefix: &[u8]) -> bool {
    bytes
        .get(..prefix.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
}

/// `grpc-message` is percent-encoded UTF-8.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Appends `s` as a JSON string.
fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Whether a request is gRPC or gRPC-Web (`application/grpc...`; media types are
/// case-insensitive).
#[inline]
pub(crate) fn is_grpc(parts: &Parts) -> bool {
    parts
        .headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| starts_with_ignore_case(v.as_bytes(), b"application/grpc"))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::Rate;

    #[test]
    fn encoders() {
        assert_eq!(percent_encode("a b%c\né"), "a b%25c%0A%C3%A9");
        let mut s = String::new();
        json_string(&mut s, "a\"b\\c\u{1}");
        assert_eq!(s, r#""a\"b\\c\u0001""#);
        assert_eq!(grpc_code_for(StatusCode::UNAUTHORIZED), 16);
        assert_eq!(grpc_code_for(StatusCode::INTERNAL_SERVER_ERROR), 13);
        assert_eq!(grpc_code_for(StatusCode::NOT_FOUND), 5);
        assert_eq!(grpc_code_for(StatusCode::GATEWAY_TIMEOUT), 4);
        assert_eq!(grpc_code_for(StatusCode::SERVICE_UNAVAILABLE), 14);
        assert_eq!(grpc_code_for(StatusCode::NOT_IMPLEMENTED), 12);
    }

    /// Integers past Structured Fields' 15 digits are sent as the largest one.
    #[test]
    fn field_integers_fit_structured_fields() {
        let policy = Policy::fixed_window(u64::MAX, Duration::from_secs(60)).unwrap();
        let field = StatusField::new("p", &policy);
        let value = field.value(u64::MAX, u64::MAX).unwrap();
        assert_eq!(value, "\"p\";r=999999999999999;t=999999999999999");
        let value = field.value(999_999_999_999_999, 7).unwrap();
        assert_eq!(value, "\"p\";r=999999999999999;t=7");
    }

    /// Each `(r, t)` pair's value is made once and then shared, static; pairs that find their
    /// slot taken get values of their own; every value says what it should.
    #[test]
    fn status_values_are_made_once_per_pair() {
        let same =
            |a: &HeaderValue, b: &HeaderValue| a.as_bytes().as_ptr() == b.as_bytes().as_ptr();
        // 11 x 61 pairs: a slot each.
        let small = StatusField::new(
            "small",
            &Policy::fixed_window(10, Duration::from_secs(60)).unwrap(),
        );
        assert!(small.direct);
        let mut seen = HashMap::new();
        for round in 0..2 {
            for r in 0..=10 {
                for t in 0..=60 {
                    let value = small.value(r, t).unwrap();
                    assert_eq!(value, format!("\"small\";r={r};t={t}").as_str());
                    match round {
                        0 => assert!(seen.insert((r, t), value).is_none()),
                        _ => assert!(same(&seen[&(r, t)], &value), "{r} {t}"),
                    }
                }
            }
        }
        // A refusal's t past the window: right, though not kept.
        assert_eq!(small.value(0, 3600).unwrap(), "\"small\";r=0;t=3600");
        // Too many pairs for a slot each: hashed, the first pair keeps a slot.
        let large = StatusField::new(
            "large",
            &Policy::gcra(Rate::per_second(1_000_000_000), 1_000_000_000).unwrap(),
        );
        assert!(!large.direct);
        let a = large.value(999_999_999, 1).unwrap();
        assert!(same(&a, &large.value(999_999_999, 1).unwrap()));
        let mut distinct = 0;
        for r in 0..5_000 {
            let value = large.value(r, 1).unwrap();
            assert_eq!(value, format!("\"large\";r={r};t=1").as_str());
            distinct += usize::from(!same(&value, &large.value(r, 1).unwrap()));
        }
        // Some pairs found their slot taken: values of their own.
        assert!(distinct > 0 && distinct < 5_000, "{distinct}");
    }

    /// `t`: the seconds until more quota is available, per algorithm; on a refusal, the
    /// retry (never less than `Retry-After`); never more than the window when admitted.
    #[test]
    fn t_is_the_time_until_more_quota() {
        let secs = Duration::from_secs;
        let ms = Duration::from_millis;
        let admitted = |reset| Decision::admitted(10, 3, reset);
        // GCRA, 2 per second: an interval of 500 ms.
        let gcra = Policy::gcra(Rate::per_second(2), 10).unwrap();
        assert_eq!(t_secs(&admitted(ms(3_200)), &gcra), 1); // 200 ms to the next unit
        assert_eq!(t_secs(&admitted(ms(3_000)), &gcra), 1); // exactly 6 intervals: 500 ms
        assert_eq!(t_secs(&admitted(Duration::ZERO), &gcra), 0);
        // A token bucket of one per 90 s: 30 s left of the interval.
        let slow = Policy::token_bucket(Rate::new(1, secs(90)), 3).unwrap();
        assert_eq!(t_secs(&admitted(secs(120)), &slow), 30);
        let leaky = Policy::leaky_bucket(Rate::new(1, secs(90)), 3).unwrap();
        assert_eq!(t_secs(&admitted(secs(180)), &leaky), 90);
        // Windows: the end of the window; the sliding log's full recovery.
        let fixed = Policy::fixed_window(10, secs(60)).unwrap();
        assert_eq!(t_secs(&admitted(ms(18_001)), &fixed), 19);
        let log = Policy::sliding_log(10, secs(60)).unwrap();
        assert_eq!(t_secs(&admitted(secs(59)), &log), 59);
        // The sliding window counter: the current window's end, never past the window.
        let sliding = Policy::sliding_window(10, secs(60)).unwrap();
        assert_eq!(t_secs(&admitted(secs(111)), &sliding), 51);
        assert_eq!(t_secs(&admitted(secs(40)), &sliding), 40);
        // A refusal: the retry, whatever the algorithm.
        let refused = Decision::rejected(10, 0, secs(111), ms(2_500));
        for policy in [&gcra, &slow, &leaky, &fixed, &log, &sliding] {
            assert_eq!(t_secs(&refused, policy), 3);
        }
    }

    /// gRPC and gRPC-Web are recognised whatever the case of the media type, and a gRPC-Web
    /// request is answered in its own content type.
    #[test]
    fn grpc_web_is_answered_in_its_own_content_type() {
        let answer = |content_type: &str| {
            let parts = http::Request::post("/svc/Method")
                .header(CONTENT_TYPE, content_type)
                .body(())
                .unwrap()
                .into_parts()
                .0;
            let rejection = Rejection {
                kind: RejectionKind::Unavailable,
                parts: &parts,
                status: StatusCode::SERVICE_UNAVAILABLE,
                decision: None,
                rule: None,
                policy: None,
                window: None,
                retry_after: None,
                error: None,
            };
            assert!(rejection.is_grpc(), "{content_type}");
            let response = grpc_response(&rejection);
            response.headers()[CONTENT_TYPE]
                .to_str()
                .unwrap()
                .to_owned()
        };
        assert_eq!(answer("application/grpc"), "application/grpc");
        assert_eq!(answer("Application/GRPC+proto"), "application/grpc");
        assert_eq!(
            answer("application/grpc-web+proto"),
            "application/grpc-web+proto"
        );
        assert_eq!(
            answer("Application/gRPC-Web-Text"),
            "Application/gRPC-Web-Text"
        );
    }

    #[test]
    fn fields_follow_the_profile() {
        let d = Decision::rejected(10, 0, Duration::from_secs(60), Duration::from_millis(2500));
        let policy = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
        let status = StatusField::new("p", &policy);
        let mut headers = HeaderMap::new();
        FieldValues::new(
            HeaderProfile::Both,
            ResetFormat::DeltaSeconds,
            &d,
            &policy,
            &status,
            || Some(HeaderValue::from_static("\"p\";q=10;w=60")),
        )
        .apply(&mut headers);
        assert_eq!(headers[RATELIMIT], "\"p\";r=0;t=3");
        assert_eq!(headers[RATELIMIT_POLICY], "\"p\";q=10;w=60");
        assert_eq!(headers[X_RATELIMIT_RESET], "3");
        assert_eq!(headers[X_RATELIMIT_LIMIT], "10");
        let mut headers = HeaderMap::new();
        FieldValues::new(
            HeaderProfile::Off,
            ResetFormat::UnixSeconds,
            &d,
            &policy,
            &status,
            || None,
        )
        .apply(&mut headers);
        assert!(headers.is_empty());
        let mut headers = HeaderMap::new();
        FieldValues::new(
            HeaderProfile::Legacy,
            ResetFormat::UnixSeconds,
            &d,
            &policy,
            &status,
            || None,
        )
        .apply(&mut headers);
        let reset: u64 = headers[X_RATELIMIT_RESET]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(reset > 1_600_000_000);
        assert!(!headers.contains_key(RATELIMIT));
    }

    /// The problem body states a policy's limit over its exact window, and a bucket's rate
    /// and burst, for windows and intervals that are not whole seconds (it used to round the
    /// window up to whole seconds: a bucket of 10 per second and a burst of 2 "allowed 2 per
    /// 1 s").
    #[test]
    fn the_detail_states_windows_and_rates_exactly() {
        let secs = Duration::from_secs;
        let ms = Duration::from_millis;
        let detail = |policy: Policy| {
            let parts = http::Request::new(()).into_parts().0;
            let decision = Decision::from_nanos(false, policy.limit(), 0, 0, 1_000_000_000);
            let rejection = Rejection {
                kind: RejectionKind::Limited,
                parts: &parts,
                status: StatusCode::TOO_MANY_REQUESTS,
                decision: Some(decision),
                rule: Some("r"),
                policy: Some("p"),
                window: Some((&policy).into()),
                retry_after: Some(secs(1)),
                error: None,
            };
            let body = problem_response(&rejection).into_body();
            let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
            problem["detail"].as_str().unwrap().to_owned()
        };
        let said = |policy| {
            let d = detail(policy);
            d[..d.find(';').unwrap()].to_owned()
        };
        assert_eq!(
            said(Policy::token_bucket(Rate::per_second(10), 2).unwrap()),
            "Policy \"p\" allows 2 per 200 ms (10 per second, in bursts of up to 2)"
        );
        assert_eq!(
            said(Policy::gcra(Rate::per_second(3), 1).unwrap()),
            "Policy \"p\" allows 1 per 333.333 ms (3 per second, in bursts of up to 1)"
        );
        assert_eq!(
            said(Policy::leaky_bucket(Rate::new(2, secs(5)), 3).unwrap()),
            "Policy \"p\" allows 3 per 7.5 s (1 per 2.5 s, in bursts of up to 3)"
        );
        assert_eq!(
            said(Policy::gcra(Rate::per_second(1), 3).unwrap()),
            "Policy \"p\" allows 3 per 3 s (1 per second, in bursts of up to 3)"
        );
        assert_eq!(
            said(Policy::fixed_window(5, ms(1_500)).unwrap()),
            "Policy \"p\" allows 5 per 1.5 s"
        );
        assert_eq!(
            said(Policy::sliding_window(100, secs(60)).unwrap()),
            "Policy \"p\" allows 100 per 60 s"
        );
    }
}
