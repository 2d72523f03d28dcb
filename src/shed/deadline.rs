//! A client's declared timeout, read from a request header; the time the service takes to
//! answer, per route, which that timeout must leave it.

use std::hash::BuildHasher;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::request::Parts;

use crate::sync::AtomicU64;

/// How many routes get an average answer time of their own: the first this many axum route
/// templates the layer sees. Every other request shares one more.
pub(super) const ROUTES: usize = 64;

/// The most digits a timeout may have: gRPC's own bound (`TimeoutValue` is "at most 8 digits").
const MAX_DIGITS: usize = 8;

/// The timeout a header value declares, in one of two forms (white space around it ignored):
///
/// - gRPC's `grpc-timeout`: 1 to 8 ASCII digits and a unit, `H` (hours), `M` (minutes), `S`
///   (seconds), `m` (milliseconds), `u` (microseconds) or `n` (nanoseconds): `250m`, `2S`;
/// - plain milliseconds, as Envoy's `x-envoy-expected-rq-timeout-ms` or an
///   `x-request-timeout`: 1 to 8 ASCII digits, `250`.
///
/// Anything else (a sign, a fraction, a space or another character inside, an unknown or
/// lower-case unit such as `s` or `ms`, more than 8 digits, bytes that are not ASCII) declares
/// nothing: `None`.
pub(super) fn parse_timeout(value: &[u8]) -> Option<Duration> {
    let value = value.trim_ascii();
    let (digits, unit) = match value.split_last()? {
        (last, _) if last.is_ascii_digit() => (value, b'm'),
        (&unit, digits) => (digits, unit),
    };
    if digits.is_empty() || digits.len() > MAX_DIGITS || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    // At most 99,999,999: no overflow below, even in hours.
    let n = digits
        .iter()
        .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The time the service takes to answer, per route: for each of the first [`ROUTES`] axum
/// route templates (`MatchedPath`, present when the layer is inside the router) a moving
/// average of its answers, in nanoseconds (each answer weighs an eighth; 0 before the first);
/// one more average for every other request (no template: the layer wraps the whole router,
/// or is not under axum; or the table is full). A route is known by a 64-bit hash of its
/// template, seeded per layer: two templates share an average only if their hashes are equal.
/// Slots are claimed once and never given back, which is what bounds the table: templates are
/// the application's, not the clients'.
pub(super) struct Typical {
    /// Each slot's route: its template's hash (0: free). Only axum names routes.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    routes: [AtomicU64; ROUTES],
    /// Each slot's average; the last one is the shared average.
    averages: [AtomicU64; ROUTES + 1],
}

/// Which of [`Typical`]'s averages a request's answer belongs to (a byte, so that it fits
/// in the padding of the guard that carries it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Route(u8);

// Every slot, and the shared one after them, is numbered by a byte.
const _: () = assert!(ROUTES < u8::MAX as usize);

impl Route {
    /// The average shared by every request without a slot of its own.
    pub(super) const SHARED: Route = Route(ROUTES as u8);

    fn index(self) -> usize {
        usize::from(self.0)
    }
}

impl Typical {
    pub(super) fn new() -> Self {
        Typical {
            routes: std::array::from_fn(|_| AtomicU64::new(0)),
            averages: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// The route of a request: its axum route template's slot, or the shared one.
    pub(super) fn route(&self, hasher: &impl BuildHasher, parts: &Parts) -> Route {
        #[cfg(feature = "axum")]
        if let Some(template) = parts.extensions.get::<axum::extract::MatchedPath>() {
            return self.slot(hasher.hash_one(template.as_str()));
        }
        let _ = (hasher, parts);
        Route::SHARED
    }

    /// The slot of the route whose template hashes to `hash`, claimed if it has none and one
    /// is free (open addressing, probing from `hash`); the shared one when all are taken.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(super) fn slot(&self, hash: u64) -> Route {
        let hash = hash.max(1);
        let start = (hash % ROUTES as u64) as usize;
        for i in 0..ROUTES {
            let index = (start + i) % ROUTES;
            let route = &self.routes[index];
            let found = match route.load(Ordering::Relaxed) {
                0 => match route.compare_exchange(0, hash, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => hash,
                    Err(other) => other,
                },
                other => other,
            };
            if found == hash {
                return Route(index as u8);
            }
        }
        Route::SHARED
    }

    /// The typical answer time of `route`, in nanoseconds (0 before its first answer).
    pub(super) fn get(&self, route: Route) -> u64 {
        self.averages[route.index()].load(Ordering::Relaxed)
    }

    /// An answer of `route` took `nanos`.
    pub(super) fn record(&self, route: Route, nanos: u64) {
        let _ = self.averages[route.index()].fetch_update(
            Ordering::Relaxed,
            Ordering::Relaxed,
            |avg| {
                Some(if avg == 0 {
                    nanos
                } else {
                    avg - avg / 8 + nanos / 8
                })
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each route's answers move its own average only; the first takes it whole, each later
    /// one weighs an eighth.
    #[test]
    fn each_route_has_its_own_average() {
        let typical = Typical::new();
        let (slow, fast) = (typical.slot(11), typical.slot(22));
        assert_ne!(slow, fast);
        assert_eq!(typical.slot(11), slow, "a route keeps its slot");
        typical.record(slow, 100_000_000);
        typical.record(fast, 1_000_000);
        typical.record(fast, 9_000_000);
        assert_eq!(typical.get(slow), 100_000_000);
        assert_eq!(typical.get(fast), 2_000_000);
        assert_eq!(typical.get(Route::SHARED), 0, "untouched");
        assert_eq!(
            typical.get(typical.slot(33)),
            0,
            "a new route starts at nothing"
        );
    }

    /// A full table: the first `ROUTES` routes keep their slots (hashes that start from one
    /// slot probe on to the next free one), every other route shares the last average.
    #[test]
    fn routes_past_the_table_share_one_average() {
        let typical = Typical::new();
        // Every hash a multiple of ROUTES: all start from slot 0, so each probes further.
        let hash = |i: u64| (i + 1) * ROUTES as u64;
        let slots: Vec<Route> = (0..ROUTES as u64).map(|i| typical.slot(hash(i))).collect();
        assert_eq!(slots, (0..ROUTES as u8).map(Route).collect::<Vec<_>>());
        for (i, slot) in slots.iter().enumerate() {
            assert_eq!(typical.slot(hash(i as u64)), *slot);
        }
        assert_eq!(typical.slot(hash(ROUTES as u64)), Route::SHARED);
        assert_eq!(typical.slot(7), Route::SHARED);
        // A hash of 0 (the mark of a free slot) is a route like any other.
        let typical = Typical::new();
        assert_eq!(typical.slot(0), typical.slot(0));
        assert_ne!(typical.slot(0), Route::SHARED);
    }

    #[test]
    fn grpc_units_and_plain_milliseconds() {
        let ms = Duration::from_millis;
        for (text, expected) in [
            ("50m", ms(50)),
            ("50", ms(50)),
            (" 50 ", ms(50)),
            ("0", ms(0)),
            ("2S", Duration::from_secs(2)),
            ("3M", Duration::from_secs(180)),
            ("1H", Duration::from_secs(3600)),
            ("1500u", Duration::from_micros(1500)),
            ("7n", Duration::from_nanos(7)),
            ("00000012", ms(12)),
            ("99999999", ms(99_999_999)),
            ("99999999H", Duration::from_secs(99_999_999 * 3600)),
        ] {
            assert_eq!(parse_timeout(text.as_bytes()), Some(expected), "{text:?}");
        }
    }

    #[test]
    fn anything_else_declares_nothing() {
        for text in [
            "",
            " ",
            "m",
            "S",
            "-5m",
            "+5m",
            "-5",
            "5s",
            "5ms",
            "5 m",
            "5x",
            "1.5S",
            "0x10m",
            "123456789",
            "123456789m",
            "99999999999999999999999999",
            "5mm",
            "m5",
        ] {
            assert_eq!(parse_timeout(text.as_bytes()), None, "{text:?}");
        }
        // Bytes that are not ASCII: a full-width digit, Latin-1, a lone UTF-8 lead byte.
        for bytes in [
            "５m".as_bytes(),
            "５".as_bytes(),
            b"5\xb5",
            b"\xff",
            b"5\xc3",
        ] {
            assert_eq!(parse_timeout(bytes), None, "{bytes:?}");
        }
    }
}
