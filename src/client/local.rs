//! What the client layers share: which server a request goes to, what a response says about
//! the server, and the local answers (made through the crate's one answer path, so a caller
//! sees a local refusal in the same protocol as the server's own).

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Request, Response, StatusCode};

use crate::answer::{GRPC_STATUS, Refused, Rejection, RejectionKind, Responder};

/// gRPC's `RESOURCE_EXHAUSTED`.
pub(crate) const GRPC_RESOURCE_EXHAUSTED: u16 = 8;
/// gRPC's `UNAVAILABLE`.
pub(crate) const GRPC_UNAVAILABLE: u16 = 14;

/// The `grpc-status` a response carries in its headers (a trailers-only answer, as servers,
/// proxies and limiters send an immediate error). A status sent in trailers, after the body,
/// is not seen here.
pub(crate) fn grpc_status(headers: &HeaderMap) -> Option<u16> {
    headers
        .get(GRPC_STATUS)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

/// Whether the server refused the request for lack of capacity or quota: 429 or 503, or the
/// gRPC statuses `RESOURCE_EXHAUSTED` (8) and `UNAVAILABLE` (14).
pub(crate) fn refused_by_server(status: StatusCode, headers: &HeaderMap) -> bool {
    matches!(
        status,
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
    ) || matches!(
        grpc_status(headers),
        Some(GRPC_RESOURCE_EXHAUSTED | GRPC_UNAVAILABLE)
    )
}

/// Whether a tollgate layer in this process made the response (it never reached the server).
pub(crate) fn made_locally<B>(response: &Response<B>) -> bool {
    response.extensions().get::<Refused>().is_some()
}

/// The server a request goes to: the URI's authority, else the `Host` header, else `""`
/// (requests with neither all go to one unnamed server), as a hash under `hasher`.
pub(crate) fn server_key<B>(request: &Request<B>, hasher: &impl BuildHasher) -> u64 {
    let authority = request
        .uri()
        .authority()
        .map(|a| a.as_str())
        .or_else(|| {
            request
                .headers()
                .get(http::header::HOST)
                .and_then(|v| v.to_str().ok())
        })
        .unwrap_or("");
    authority_key(authority, hasher)
}

/// An authority's hash under `hasher`, whatever its case (host names are case-insensitive).
pub(crate) fn authority_key(authority: &str, hasher: &impl BuildHasher) -> u64 {
    let mut h = hasher.build_hasher();
    for b in authority.bytes() {
        h.write_u8(b.to_ascii_lowercase());
    }
    h.finish()
}

/// A refusal made here, answered by `responder` (and marked [`Refused`]).
pub(crate) fn answer(
    responder: &dyn Responder,
    parts: &Parts,
    kind: RejectionKind,
    policy: Option<&str>,
    retry_after: Option<Duration>,
) -> Response<Bytes> {
    let status = match kind {
        RejectionKind::Limited | RejectionKind::TooManyInFlight => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    crate::answer::refuse(
        responder,
        &Rejection {
            kind,
            parts,
            status,
            decision: None,
            rule: None,
            policy,
            window: None,
            retry_after,
            error: None,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn what_a_response_says() {
        let mut headers = HeaderMap::new();
        assert!(refused_by_server(StatusCode::TOO_MANY_REQUESTS, &headers));
        assert!(refused_by_server(StatusCode::SERVICE_UNAVAILABLE, &headers));
        assert!(!refused_by_server(
            StatusCode::INTERNAL_SERVER_ERROR,
            &headers
        ));
        assert!(!refused_by_server(StatusCode::OK, &headers));
        for (code, refused) in [("8", true), (" 14", true), ("13", false), ("x", false)] {
            headers.insert(GRPC_STATUS, HeaderValue::from_static(code));
            assert_eq!(
                refused_by_server(StatusCode::OK, &headers),
                refused,
                "{code}"
            );
        }
    }

    #[test]
    fn the_server_is_the_authority_or_the_host() {
        let hasher = foldhash::fast::FixedState::with_seed(1);
        let key = |uri: &str, host: Option<&str>| {
            let mut r = Request::get(uri);
            if let Some(h) = host {
                r = r.header("host", h);
            }
            server_key(&r.body(()).unwrap(), &hasher)
        };
        assert_eq!(
            key("http://A.example:80/x", None),
            key("/y", Some("a.example:80"))
        );
        assert_ne!(
            key("http://a.example/", None),
            key("http://b.example/", None)
        );
        assert_eq!(key("/", None), authority_key("", &hasher));
        assert_eq!(key("/", Some("B:1")), authority_key("b:1", &hasher));
    }
}
