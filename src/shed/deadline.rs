//! A client's declared timeout, read from a request header.

use std::time::Duration;

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

#[cfg(test)]
mod tests {
    use super::*;

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
