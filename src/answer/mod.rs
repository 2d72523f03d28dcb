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
mod default_responder;
mod fields;

pub use body::{RefusalBody, ResponseBody};
pub use default_responder::DefaultResponder;
pub(crate) use default_responder::is_grpc;
#[cfg(any(feature = "envoy", test))]
pub(crate) use fields::t_secs;
pub(crate) use fields::{FieldValues, StatusField};

use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Response, StatusCode};

use http::HeaderName;

use crate::{Decision, Policy, StoreError};

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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use http::header::CONTENT_TYPE;
    use http::{HeaderMap, HeaderValue};

    use super::default_responder::{
        grpc_code_for, grpc_response, json_string, percent_encode, problem_response,
    };
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
        // Nothing left: the window's end weighs the current count whole, a nanosecond later
        // it is free.
        let spent = |reset| Decision::admitted(10, 0, reset);
        assert_eq!(t_secs(&spent(secs(111)), &sliding), 52);
        assert_eq!(t_secs(&spent(ms(110_500)), &sliding), 51);
        assert_eq!(t_secs(&spent(secs(40)), &sliding), 40);
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
