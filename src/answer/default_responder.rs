//! The default answers to refused requests: an RFC 9457 problem, or a gRPC status.

use std::fmt::{self, Write as _};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::request::Parts;
use http::{HeaderValue, Response, StatusCode};

use super::{
    GRPC_MESSAGE, GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS, QUOTA_EXCEEDED_TITLE, QUOTA_EXCEEDED_TYPE,
    Rejection, RejectionKind, Responder, TOO_MANY_IN_FLIGHT_TYPE,
};

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

pub(super) fn problem_response(r: &Rejection<'_>) -> Response<Bytes> {
    let mut body = String::with_capacity(320);
    let status = r.status;
    let reason = status.canonical_reason().unwrap_or("Error");
    match r.kind {
        RejectionKind::Limited => {
            let policy = r.policy.unwrap_or("");
            let wait = r.retry_after_secs();
            let secs = wait.unwrap_or(0);
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
                // No decision and no wait: it can never be admitted (a shaper's cost above its
                // queue), so there is no time to come back at.
                (None, _) if wait.is_none() => format!(
                    "Policy \"{policy}\" refused this request: it can never be admitted, however long it waits."
                ),
                _ => format!("Policy \"{policy}\" refused this request. Retry in {secs} s."),
            };
            json_string(&mut body, &detail);
            body.push_str(",\"violated-policies\":[");
            json_string(&mut body, policy);
            match wait {
                Some(secs) => {
                    let _ = write!(body, "],\"retry-after\":{secs}}}");
                }
                None if r.decision.is_none() => body.push_str("]}"),
                None => {
                    let _ = write!(body, "],\"retry-after\":{secs}}}");
                }
            }
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
        } else if nanos >= 1_000_000 {
            ("ms", 1_000_000)
        } else if nanos >= 1_000 {
            ("µs", 1_000)
        } else {
            ("ns", 1)
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
        // The interval of n a second is 1 s / n rounded up to whole nanoseconds: a whole rate
        // a second is one whose interval is that rounding of it; any other is stated by its
        // interval (`100 per minute` is `1 per 600 ms`, not a rounded `2 per second`).
        let per_second = (1_000_000_000 + nanos / 2) / nanos;
        if per_second > 0 && 1_000_000_000_u128.div_ceil(per_second) == nanos {
            write!(f, "{per_second} per second")
        } else {
            write!(f, "1 per {}", HumanDuration(self.0))
        }
    }
}

pub(super) fn grpc_response(r: &Rejection<'_>) -> Response<Bytes> {
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
pub(super) fn grpc_code_for(status: StatusCode) -> u8 {
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
pub(super) fn percent_encode(s: &str) -> String {
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
pub(super) fn json_string(out: &mut String, s: &str) {
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
mod text_tests {
    use super::*;

    #[test]
    fn durations_and_rates_are_stated_exactly() {
        let d = |nanos: u64| HumanDuration(Duration::from_nanos(nanos)).to_string();
        assert_eq!(d(3_000_000_000), "3 s");
        assert_eq!(d(1_500_000_000), "1.5 s");
        assert_eq!(d(200_000_000), "200 ms");
        assert_eq!(d(250_000), "250 µs");
        assert_eq!(d(100), "100 ns");
        // A policy's interval, as the refusal's text gets it.
        let r = |rate: crate::Rate| {
            let policy = crate::Policy::gcra(rate, 1).unwrap();
            HumanRate(policy.interval()).to_string()
        };
        assert_eq!(r(crate::Rate::per_second(10)), "10 per second");
        assert_eq!(r(crate::Rate::per_second(3)), "3 per second");
        assert_eq!(
            r(crate::Rate::per_second(10_000_000)),
            "10000000 per second"
        );
        // Not a whole number a second: stated by the interval.
        assert_eq!(r(crate::Rate::per_minute(100)), "1 per 600 ms");
        assert_eq!(
            r(crate::Rate::new(3, Duration::from_secs(2))),
            "1 per 666.666 ms"
        );
        assert_eq!(r(crate::Rate::per_minute(1)), "1 per 60 s");
    }
}
