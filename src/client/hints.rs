//! What a response says about when to call again: `Retry-After` (both forms),
//! `grpc-retry-pushback-ms`, the IETF `RateLimit` and `RateLimit-Policy` fields, and the legacy
//! `X-RateLimit-*` trio. Malformed values are ignored, never an error: a hint is advice.
//!
//! - `RateLimit` and `RateLimit-Policy` are Structured Fields Lists, which may be split over
//!   several field lines: the lines are joined (with `, `) before they are parsed. A member
//!   without both `r` and `t` as non-negative Integers is skipped (a quota that says nothing
//!   about when it resets is no hint; `r=0` with a bad `t` is not "retry now").
//! - A `grpc-retry-pushback-ms` that is not a non-negative integer (negative, empty, or not a
//!   number) means "do not retry", as gRPC's retry design reads it; a number too large to
//!   hold is a very long wait.
//! - Times far in the future (an `X-RateLimit-Reset` Unix time past what `SystemTime` can
//!   hold, digits past `u64`) are read as the longest hint, [`MAX_HINT`]; nothing a server
//!   sends makes reading its headers panic (`fuzz/checks/hints.rs` holds it so).

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use http::HeaderMap;
use smallvec::SmallVec;

use crate::answer::{
    GRPC_RETRY_PUSHBACK_MS, RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING,
    X_RATELIMIT_RESET,
};

/// The longest wait a hint is believed for; longer ones are read as this.
pub const MAX_HINT: Duration = Duration::from_secs(24 * 3600);

/// The largest count a hint is believed for (what a Structured Fields Integer can hold).
const MAX_COUNT: u64 = 999_999_999_999_999;

/// `X-RateLimit-Reset` values from this on are read as Unix times (as GitHub sends them), below
/// it as seconds from now (as the IETF drafts and tollgate send them).
const UNIX_TIME_FROM: u64 = 1_000_000_000;

/// What the server said about calling again, read from a response's headers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerHints {
    /// `Retry-After`, in delay-seconds or as an HTTP date (then from the time of reading; a
    /// date in the past is zero).
    pub retry_after: Option<Duration>,
    /// `grpc-retry-pushback-ms`.
    pub pushback: Option<Pushback>,
    /// The quotas of the `RateLimit` field (joined with `RateLimit-Policy` by name), or else
    /// of the `X-RateLimit-*` fields.
    pub quotas: SmallVec<[Quota; 1]>,
}

/// gRPC's pushback (`grpc-retry-pushback-ms`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pushback {
    /// Retry after this long.
    After(Duration),
    /// A negative or malformed value: do not retry.
    Stop,
}

/// One quota the server reported.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Quota {
    /// The policy's name (`None` for the legacy fields).
    pub policy: Option<String>,
    /// Units left.
    pub remaining: u64,
    /// Time until the quota is restored.
    pub reset: Duration,
    /// The quota (`q` of `RateLimit-Policy`, or `X-RateLimit-Limit`), when sent.
    pub limit: Option<u64>,
    /// The window the quota applies to (`w` of `RateLimit-Policy`), when sent.
    pub window: Option<Duration>,
}

/// When the server says to try again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryHint {
    /// The server said nothing about it.
    None,
    /// After this long.
    After(Duration),
    /// Not at all (a negative or malformed gRPC pushback).
    Stop,
}

impl ServerHints {
    /// Reads the hints of a response received now.
    // An HTTP date is a wall-clock time: it is read against the wall clock, not a `Clock`.
    #[allow(clippy::disallowed_methods)]
    pub fn read(headers: &HeaderMap) -> Self {
        Self::read_at(headers, SystemTime::now())
    }

    /// Reads the hints of a response received at `now` (which dates are counted from).
    pub fn read_at(headers: &HeaderMap, now: SystemTime) -> Self {
        let text = |name| headers.get(name).and_then(|v| v.to_str().ok());
        let policy = list(headers, RATELIMIT_POLICY);
        Self {
            retry_after: text(http::header::RETRY_AFTER).and_then(|v| retry_after(v, now)),
            pushback: headers.get(GRPC_RETRY_PUSHBACK_MS).map(pushback),
            quotas: list(headers, RATELIMIT)
                .map(|v| ratelimit(&v, policy.as_deref()))
                .filter(|q| !q.is_empty())
                .or_else(|| legacy(headers, now).map(|q| SmallVec::from_iter([q])))
                .unwrap_or_default(),
        }
    }

    /// When to try again, by the server's word: the gRPC pushback first, then `Retry-After`,
    /// then the longest `reset` of the quotas that have nothing left.
    pub fn retry(&self) -> RetryHint {
        match self.pushback {
            Some(Pushback::Stop) => return RetryHint::Stop,
            Some(Pushback::After(d)) => return RetryHint::After(d),
            None => {}
        }
        if let Some(d) = self.retry_after {
            return RetryHint::After(d);
        }
        self.quotas
            .iter()
            .filter(|q| q.remaining == 0)
            .map(|q| q.reset)
            .max()
            .map_or(RetryHint::None, RetryHint::After)
    }
}

/// A list field's lines joined into one value (RFC 9110, 5.3), borrowed when there is one
/// line. `None` when the field is absent, or a line of it is not visible ASCII (then the list
/// cannot be read).
fn list(headers: &HeaderMap, name: http::HeaderName) -> Option<Cow<'_, str>> {
    let mut lines = headers.get_all(name).iter();
    let first = lines.next()?.to_str().ok()?;
    let mut joined = Cow::Borrowed(first);
    for line in lines {
        let line = line.to_str().ok()?;
        let all = joined.to_mut();
        all.push_str(", ");
        all.push_str(line);
    }
    Some(joined)
}

fn seconds(n: u64) -> Duration {
    Duration::from_secs(n).min(MAX_HINT)
}

/// Delay-seconds (digits only) or an HTTP date.
fn retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Digits that overflow a u64 are still "a very long time".
        return Some(value.parse().map_or(MAX_HINT, seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(now)
            .unwrap_or(Duration::ZERO)
            .min(MAX_HINT),
    )
}

/// Milliseconds, or anything else (a negative number, an empty or malformed value): do not
/// retry, as gRPC's retry design (A6) reads it.
fn pushback(value: &http::HeaderValue) -> Pushback {
    let value = value.as_bytes().trim_ascii();
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return Pushback::Stop;
    }
    // All digits: only an overflow fails, and that is "a very long time".
    let ms = std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX);
    Pushback::After(Duration::from_millis(ms).min(MAX_HINT))
}

/// The Integer parameters of a Structured Fields member.
type Params = SmallVec<[(String, i64); 4]>;

/// The members of a Structured Fields List, each a String or Token with Integer parameters:
/// (name, [(parameter, value)]). Members of other shapes are skipped.
/// The most members of a `RateLimit` or `RateLimit-Policy` list that are read: a server that
/// sends thousands would otherwise cost a match of each against each (quadratic) on every
/// response. The rest are ignored.
const MAX_MEMBERS: usize = 64;

fn sf_members(value: &str) -> Vec<(String, Params)> {
    let Ok(list) = sfv::Parser::new(value).parse::<sfv::List>() else {
        return Vec::new();
    };
    list.into_iter()
        .filter_map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = match &item.bare_item {
                    sfv::BareItem::String(s) => s.as_str().to_owned(),
                    sfv::BareItem::Token(t) => t.as_str().to_owned(),
                    _ => return None,
                };
                let params = item
                    .params
                    .iter()
                    .filter_map(|(k, v)| Some((k.as_str().to_owned(), i64::from(v.as_integer()?))))
                    .collect();
                Some((name, params))
            }
            sfv::ListEntry::InnerList(_) => None,
        })
        .take(MAX_MEMBERS)
        .collect()
}

fn param(params: &[(String, i64)], name: &str) -> Option<u64> {
    params
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| u64::try_from(*v).ok())
}

/// `RateLimit: "name";r=0;t=3, ...` joined with `RateLimit-Policy: "name";q=10;w=60, ...`.
fn ratelimit(value: &str, policy: Option<&str>) -> SmallVec<[Quota; 1]> {
    let policies = policy.map(sf_members).unwrap_or_default();
    sf_members(value)
        .into_iter()
        .filter_map(|(name, params)| {
            let remaining = param(&params, "r")?;
            let reset = seconds(param(&params, "t")?);
            let declared = policies.iter().find(|(n, _)| *n == name);
            Some(Quota {
                limit: declared.and_then(|(_, p)| param(p, "q")),
                window: declared.and_then(|(_, p)| param(p, "w")).map(seconds),
                policy: Some(name),
                remaining,
                reset,
            })
        })
        .collect()
}

/// `X-RateLimit-Remaining` and `X-RateLimit-Reset` (seconds from now, or a Unix time), with
/// `X-RateLimit-Limit` when sent.
fn legacy(headers: &HeaderMap, now: SystemTime) -> Option<Quota> {
    let number = |name| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let remaining = number(X_RATELIMIT_REMAINING)?.min(MAX_COUNT);
    let reset = number(X_RATELIMIT_RESET)?;
    let reset = if reset >= UNIX_TIME_FROM {
        // A time past what `SystemTime` holds is as far as a hint goes.
        SystemTime::UNIX_EPOCH
            .checked_add(Duration::from_secs(reset))
            .map_or(MAX_HINT, |at| {
                at.duration_since(now)
                    .unwrap_or(Duration::ZERO)
                    .min(MAX_HINT)
            })
    } else {
        seconds(reset)
    };
    Some(Quota {
        policy: None,
        remaining,
        reset,
        limit: number(X_RATELIMIT_LIMIT).map(|n| n.min(MAX_COUNT)),
        window: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn retry_after_in_both_forms() {
        let now = at(1_445_412_480); // Wed, 21 Oct 2015 07:28:00 GMT
        let read = |v: &str| ServerHints::read_at(&headers(&[("retry-after", v)]), now);
        assert_eq!(read("120").retry_after, Some(Duration::from_secs(120)));
        assert_eq!(
            read(" 7 ").retry(),
            RetryHint::After(Duration::from_secs(7))
        );
        let date = read("Wed, 21 Oct 2015 07:28:30 GMT");
        assert_eq!(date.retry_after, Some(Duration::from_secs(30)));
        let past = read("Wed, 21 Oct 2015 07:27:00 GMT");
        assert_eq!(past.retry_after, Some(Duration::ZERO));
        assert_eq!(read("99999999999999999999999").retry_after, Some(MAX_HINT));
        for bad in ["", "-5", "1.5", "soon", "0x10", "Wed, 99 Oct 2015"] {
            assert_eq!(read(bad).retry_after, None, "{bad:?}");
        }
    }

    #[test]
    fn pushback_wins_and_a_negative_one_stops() {
        let h = headers(&[("grpc-retry-pushback-ms", "250"), ("retry-after", "9")]);
        assert_eq!(
            ServerHints::read(&h).retry(),
            RetryHint::After(Duration::from_millis(250))
        );
        let h = headers(&[("grpc-retry-pushback-ms", "-1"), ("retry-after", "9")]);
        assert_eq!(ServerHints::read(&h).retry(), RetryHint::Stop);
        let h = headers(&[("grpc-retry-pushback-ms", " 99999999999999999999999 ")]);
        assert_eq!(ServerHints::read(&h).retry(), RetryHint::After(MAX_HINT));
        assert_eq!(ServerHints::read(&HeaderMap::new()).pushback, None);
    }

    /// gRPC's retry design (A6): a pushback that is not a non-negative integer means "do not
    /// retry" (it was ignored, and the retry layer retried after its own backoff).
    #[test]
    fn a_malformed_pushback_stops() {
        for bad in ["", "-", "1e3", "ten", "--1", "1.5", "+5"] {
            let h = headers(&[("grpc-retry-pushback-ms", bad), ("retry-after", "1")]);
            let hints = ServerHints::read(&h);
            assert_eq!(hints.pushback, Some(Pushback::Stop), "{bad:?}");
            assert_eq!(hints.retry(), RetryHint::Stop, "{bad:?}");
        }
        let mut h = HeaderMap::new();
        h.insert(
            "grpc-retry-pushback-ms",
            HeaderValue::from_bytes(b"\xff12").unwrap(),
        );
        assert_eq!(ServerHints::read(&h).pushback, Some(Pushback::Stop));
    }

    /// Issue 24, 1: `X-RateLimit-Reset` past what `SystemTime` holds panicked ("overflow when
    /// adding duration to instant"); it is the longest hint.
    #[test]
    fn a_reset_past_the_end_of_time_is_the_longest_hint() {
        for reset in [
            "9223372036854775808",
            "18446744073709551615",
            "9223372036854775807",
        ] {
            let h = headers(&[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", reset)]);
            let hints = ServerHints::read(&h);
            assert_eq!(hints.retry(), RetryHint::After(MAX_HINT), "{reset}");
            assert_eq!(hints.quotas[0].reset, MAX_HINT, "{reset}");
        }
    }

    /// Issue 24, 5: the fields are lists, which may come on several lines; only the first
    /// line was read.
    #[test]
    fn at_most_sixty_four_members_are_read() {
        let mut h = HeaderMap::new();
        let many: Vec<String> = (0..1_000).map(|i| format!("\"p{i}\";r=5;t=9")).collect();
        h.insert("ratelimit", many.join(", ").parse().unwrap());
        assert_eq!(ServerHints::read(&h).quotas.len(), MAX_MEMBERS);
    }

    #[test]
    fn list_fields_on_several_lines_are_joined() {
        let h = headers(&[
            ("ratelimit", "\"burst\";r=5;t=1"),
            ("ratelimit-policy", "\"burst\";q=10;w=1"),
            ("ratelimit", "\"daily\";r=0;t=4000"),
            ("ratelimit-policy", "\"daily\";q=100;w=86400"),
        ]);
        let hints = ServerHints::read(&h);
        assert_eq!(hints.quotas.len(), 2);
        assert_eq!(hints.quotas[1].policy.as_deref(), Some("daily"));
        assert_eq!(hints.quotas[1].limit, Some(100));
        assert_eq!(hints.retry(), RetryHint::After(Duration::from_secs(4000)));
        // A line that is not text makes the list unreadable (the legacy fields are read).
        let mut h = headers(&[("ratelimit", "\"a\";r=0;t=5")]);
        h.append(
            "ratelimit",
            HeaderValue::from_bytes(b"\"b\";r=0;t=\xff").unwrap(),
        );
        assert!(ServerHints::read(&h).quotas.is_empty());
    }

    /// Issue 24, 7: `r=0` with a missing or malformed `t` was `After(0)`, "retry now".
    #[test]
    fn a_member_without_a_valid_t_is_no_hint() {
        for bad in [
            "\"a\";r=0",
            "\"a\";r=0;t=-1",
            "\"a\";r=0;t=1.5",
            "\"a\";r=0;t=\"3\"",
            "\"a\";r=0;t=?1",
        ] {
            let hints = ServerHints::read(&headers(&[("ratelimit", bad)]));
            assert!(hints.quotas.is_empty(), "{bad}");
            assert_eq!(hints.retry(), RetryHint::None, "{bad}");
        }
        // The valid members of the same field are still read.
        let h = headers(&[("ratelimit", "\"a\";r=0, \"b\";r=0;t=7")]);
        assert_eq!(
            ServerHints::read(&h).retry(),
            RetryHint::After(Duration::from_secs(7))
        );
    }

    #[test]
    fn the_ratelimit_fields_are_structured_fields() {
        let h = headers(&[
            ("ratelimit", "\"burst\";r=0;t=3, \"daily\";r=70;t=4000"),
            (
                "ratelimit-policy",
                "\"daily\";q=100;w=86400, \"burst\";q=10;w=1",
            ),
        ]);
        let hints = ServerHints::read(&h);
        assert_eq!(hints.quotas.len(), 2);
        assert_eq!(
            hints.quotas[0],
            Quota {
                policy: Some("burst".into()),
                remaining: 0,
                reset: Duration::from_secs(3),
                limit: Some(10),
                window: Some(Duration::from_secs(1)),
            }
        );
        assert_eq!(hints.quotas[1].limit, Some(100));
        // Only exhausted quotas say when to come back.
        assert_eq!(hints.retry(), RetryHint::After(Duration::from_secs(3)));
        let h = headers(&[("ratelimit", "\"a\";r=5;t=3")]);
        assert_eq!(ServerHints::read(&h).retry(), RetryHint::None);
        // Malformed: ignored, and the legacy fields are read instead.
        let h = headers(&[
            ("ratelimit", "\"a\";r=0;t=3,,"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "12"),
            ("x-ratelimit-limit", "60"),
        ]);
        let hints = ServerHints::read(&h);
        assert_eq!(hints.quotas[0].policy, None);
        assert_eq!(hints.quotas[0].limit, Some(60));
        assert_eq!(hints.retry(), RetryHint::After(Duration::from_secs(12)));
        // A member without `r`, or with a negative one, is skipped.
        let h = headers(&[("ratelimit", "\"a\";t=3, \"b\";r=-1;t=2, c;r=0;t=1")]);
        let hints = ServerHints::read(&h);
        assert_eq!(hints.quotas.len(), 1);
        assert_eq!(hints.quotas[0].policy.as_deref(), Some("c"));
    }

    #[test]
    fn a_legacy_reset_may_be_a_unix_time() {
        let now = at(1_700_000_000);
        let h = headers(&[
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "1700000042"),
        ]);
        let hints = ServerHints::read_at(&h, now);
        assert_eq!(hints.retry(), RetryHint::After(Duration::from_secs(42)));
        let h = headers(&[
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "1600000000"),
        ]);
        assert_eq!(
            ServerHints::read_at(&h, now).retry(),
            RetryHint::After(Duration::ZERO)
        );
        // Counts beyond what the fields can say are read as the most they can.
        let h = headers(&[
            ("x-ratelimit-remaining", "18446744073709551615"),
            ("x-ratelimit-reset", "5"),
            ("x-ratelimit-limit", "18446744073709551615"),
        ]);
        let quota = &ServerHints::read_at(&h, now).quotas[0];
        assert_eq!((quota.remaining, quota.limit), (MAX_COUNT, Some(MAX_COUNT)));
    }
}
