//! The client's header parsing, [`ServerHints::read`] and [`ServerHints::read_at`], on header
//! maps of the fuzzer's choosing (any bytes a header value may hold, on any number of lines,
//! read at any time): never a panic, and nothing read past what a hint may say (waits at most
//! [`MAX_HINT`], counts at most what a Structured Fields Integer holds), and `retry()` as its
//! docs say: the pushback first, then `Retry-After`, then the longest reset of the exhausted
//! quotas.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue};
use tollgate::client::{MAX_HINT, Pushback, RetryHint, ServerHints};

use crate::input::Input;

/// The largest Structured Fields Integer.
const SF_MAX: u64 = 999_999_999_999_999;

/// The fields read, and one that is not.
const NAMES: &[&str] = &[
    "retry-after",
    "grpc-retry-pushback-ms",
    "ratelimit",
    "ratelimit-policy",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "x-other",
];

/// Quota names, valid as a Token or a String and not.
const POLICIES: &[&str] = &[
    "\"daily\"",
    "burst",
    "\"a b\"",
    "\"\"",
    "\"x\\\"y\"",
    "1bad",
    "*",
];

/// HTTP dates, valid and not.
const DATES: &[&str] = &[
    "Wed, 21 Oct 2015 07:28:00 GMT",
    "Fri, 31 Dec 9999 23:59:59 GMT",
    "Thu, 01 Jan 1970 00:00:00 GMT",
    "Sunday, 06-Nov-94 08:49:37 GMT",
    "Sun Nov  6 08:49:37 1994",
    "Wed, 99 Oct 2015 07:28:00 GMT",
];

pub(crate) fn check(data: &[u8]) {
    let mut input = Input::new(data);
    let now = SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(input.edgy_u64()));
    let mut headers = HeaderMap::new();
    for _ in 0..64 {
        if input.is_empty() {
            break;
        }
        let name: &&str = input.pick(NAMES);
        let name = HeaderName::from_static(name);
        let value = match input.u8() % 4 {
            0 => input.until(b'\n').to_vec(),
            1 => number(&mut input).into_bytes(),
            2 => members(&mut input).into_bytes(),
            _ => input.pick(DATES).as_bytes().to_vec(),
        };
        if let Ok(value) = HeaderValue::from_bytes(&value) {
            headers.append(name, value);
        }
    }
    holds(&ServerHints::read(&headers));
    if let Some(now) = now {
        holds(&ServerHints::read_at(&headers, now));
    }
}

/// What every reading holds.
fn holds(hints: &ServerHints) {
    assert!(hints.retry_after.is_none_or(|d| d <= MAX_HINT), "{hints:?}");
    if let Some(Pushback::After(d)) = hints.pushback {
        assert!(d <= MAX_HINT, "{hints:?}");
    }
    for quota in &hints.quotas {
        assert!(quota.reset <= MAX_HINT, "{hints:?}");
        assert!(quota.window.is_none_or(|w| w <= MAX_HINT), "{hints:?}");
        assert!(quota.remaining <= SF_MAX, "{hints:?}");
        assert!(quota.limit.is_none_or(|q| q <= SF_MAX), "{hints:?}");
    }
    let exhausted = hints
        .quotas
        .iter()
        .filter(|q| q.remaining == 0)
        .map(|q| q.reset)
        .max();
    let expected = match (hints.pushback, hints.retry_after, exhausted) {
        (Some(Pushback::Stop), _, _) => RetryHint::Stop,
        (Some(Pushback::After(d)), _, _) | (None, Some(d), _) | (None, None, Some(d)) => {
            RetryHint::After(d)
        }
        (None, None, None) => RetryHint::None,
    };
    assert_eq!(hints.retry(), expected, "{hints:?}");
}

/// A number as a server might send it: signed or not, fractional or not, padded or not.
fn number(input: &mut Input<'_>) -> String {
    let n = input.edgy_u64();
    let shape = input.u8();
    let mut text = match shape % 4 {
        0 => n.to_string(),
        1 => format!("-{n}"),
        2 => format!("{n}.{}", input.u8()),
        _ => format!("{n}{n}"),
    };
    if shape & 4 != 0 {
        text = format!(" {text} ");
    }
    text
}

/// A `RateLimit` or `RateLimit-Policy` list of one to four members, each with some of `r`,
/// `t`, `q`, `w`, valid or not.
fn members(input: &mut Input<'_>) -> String {
    let count = 1 + input.below(4);
    let mut list = Vec::with_capacity(count);
    for _ in 0..count {
        let mut member = input.pick(POLICIES).to_string();
        for param in ["r", "t", "q", "w"] {
            let value = match input.u8() % 6 {
                0 => continue,
                1 => "\"3\"".to_owned(),
                2 => "?1".to_owned(),
                _ => number(input).trim().to_owned(),
            };
            member.push_str(&format!(";{param}={value}"));
        }
        list.push(member);
    }
    list.join(", ")
}
