//! Durations and rates as people write them: `"15m"`, `"1h30m"`, `"100/minute"`, `"5 per 15m"`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::Rate;

/// The units a duration may be written in, longest spelling first, with their nanoseconds.
const UNITS: [(&str, u64); 23] = [
    ("nanoseconds", 1),
    ("nanosecond", 1),
    ("ns", 1),
    ("microseconds", 1_000),
    ("microsecond", 1_000),
    ("us", 1_000),
    ("milliseconds", 1_000_000),
    ("millisecond", 1_000_000),
    ("ms", 1_000_000),
    ("seconds", NANOS_PER_SECOND),
    ("second", NANOS_PER_SECOND),
    ("sec", NANOS_PER_SECOND),
    ("s", NANOS_PER_SECOND),
    ("minutes", 60 * NANOS_PER_SECOND),
    ("minute", 60 * NANOS_PER_SECOND),
    ("min", 60 * NANOS_PER_SECOND),
    ("m", 60 * NANOS_PER_SECOND),
    ("hours", 3_600 * NANOS_PER_SECOND),
    ("hour", 3_600 * NANOS_PER_SECOND),
    ("h", 3_600 * NANOS_PER_SECOND),
    ("days", 86_400 * NANOS_PER_SECOND),
    ("day", 86_400 * NANOS_PER_SECOND),
    ("d", 86_400 * NANOS_PER_SECOND),
];

const NANOS_PER_SECOND: u64 = 1_000_000_000;

/// The longest text of a duration or a rate read (a longer one is refused unread).
const MAX_TEXT: usize = 64;

/// A span of time written for people: a sum of whole numbers with units, `"15m"`,
/// `"1h30m"`, `"500ms"`, `"1 day"` (units `ns`, `us`, `ms`, `s`, `m`, `h`, `d` and their
/// English names, singular or plural). It is written back in its shortest exact form
/// (`"90s"` becomes `"1m30s"`), and up to `u64::MAX` nanoseconds (about 584 years).
///
/// ```
/// use std::time::Duration;
/// use tollgate::config::HumanDuration;
///
/// let d: HumanDuration = "1h30m".parse()?;
/// assert_eq!(d.get(), Duration::from_secs(5400));
/// assert_eq!(d.to_string(), "1h30m");
/// assert_eq!("250 ms".parse::<HumanDuration>()?.get(), Duration::from_millis(250));
/// assert!("15".parse::<HumanDuration>().is_err()); // a unit is required
/// # Ok::<(), tollgate::config::HumanError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HumanDuration(Duration);

impl HumanDuration {
    /// The duration.
    pub const fn get(self) -> Duration {
        self.0
    }
}

impl From<Duration> for HumanDuration {
    fn from(d: Duration) -> Self {
        HumanDuration(d)
    }
}

/// Why a duration or a rate could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HumanError(String);

impl fmt::Display for HumanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for HumanError {}

fn error(text: &str, why: &str) -> HumanError {
    // Only the start of a long text is repeated in the message.
    let shown: String = text.chars().take(MAX_TEXT).collect();
    HumanError(format!("{shown:?}: {why}"))
}

impl FromStr for HumanDuration {
    type Err = HumanError;

    fn from_str(text: &str) -> Result<Self, HumanError> {
        parse_duration(text).map(HumanDuration)
    }
}

fn parse_duration(text: &str) -> Result<Duration, HumanError> {
    const EXPECTED: &str = "expected a duration such as \"500ms\", \"15m\" or \"1h30m\"";
    if text.len() > MAX_TEXT {
        return Err(error(text, "too long for a duration"));
    }
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(error(text, EXPECTED));
    }
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(error(text, EXPECTED));
        }
        let number: u64 = rest[..digits]
            .parse()
            .map_err(|_| error(text, "number too large"))?;
        rest = rest[digits..].trim_start();
        let letters = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit = &rest[..letters];
        let Some(&(_, scale)) = UNITS
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(unit))
        else {
            return Err(error(
                text,
                if unit.is_empty() {
                    "a number needs a unit (ms, s, m, h, d)"
                } else {
                    "unknown unit (ns, us, ms, s, m, h, d)"
                },
            ));
        };
        total = number
            .checked_mul(scale)
            .and_then(|n| total.checked_add(n))
            .ok_or_else(|| error(text, "longer than about 584 years"))?;
        rest = rest[letters..].trim_start();
    }
    Ok(Duration::from_nanos(total))
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_duration(self.0, f)
    }
}

/// Writes `d` as a sum of units, largest first (`1h30m`, `1s500ms`, `0s`).
fn write_duration(d: Duration, f: &mut impl fmt::Write) -> fmt::Result {
    const WRITTEN: [(&str, u128); 7] = [
        ("d", 86_400_000_000_000),
        ("h", 3_600_000_000_000),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
        ("ms", 1_000_000),
        ("us", 1_000),
        ("ns", 1),
    ];
    let mut left = d.as_nanos();
    if left == 0 {
        return f.write_str("0s");
    }
    for (unit, scale) in WRITTEN {
        if left >= scale {
            write!(f, "{}{unit}", left / scale)?;
            left %= scale;
        }
    }
    Ok(())
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_str(Text::<HumanDuration>::new("a duration such as \"15m\""))
    }
}

/// A rate written for people: a count per span, `"100/minute"`, `"10/s"`, `"5 per 15m"`,
/// `"1000 per 1h"`. The span after `/` may omit its number (`"10/s"` is ten per second).
///
/// ```
/// use std::time::Duration;
/// use tollgate::config::HumanRate;
///
/// let r: HumanRate = "5 per 15m".parse()?;
/// assert_eq!((r.get().count(), r.get().per()), (5, Duration::from_secs(900)));
/// assert_eq!("100/minute".parse::<HumanRate>()?.get(), tollgate::Rate::per_minute(100));
/// assert_eq!(r.to_string(), "5/15m");
/// # Ok::<(), tollgate::config::HumanError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HumanRate(Rate);

impl HumanRate {
    /// The rate.
    pub const fn get(self) -> Rate {
        self.0
    }
}

impl From<Rate> for HumanRate {
    fn from(rate: Rate) -> Self {
        HumanRate(rate)
    }
}

impl FromStr for HumanRate {
    type Err = HumanError;

    fn from_str(text: &str) -> Result<Self, HumanError> {
        const EXPECTED: &str = "expected a rate such as \"100/minute\", \"10/s\" or \"5 per 15m\"";
        if text.len() > MAX_TEXT {
            return Err(error(text, "too long for a rate"));
        }
        let trimmed = text.trim();
        let (count, per) = match trimmed.split_once('/') {
            Some(split) => split,
            None => {
                let lower = trimmed.to_ascii_lowercase();
                match lower.find(" per ") {
                    Some(at) => (&trimmed[..at], &trimmed[at + 5..]),
                    None => return Err(error(text, EXPECTED)),
                }
            }
        };
        let count = count.trim();
        if count.is_empty() || !count.bytes().all(|b| b.is_ascii_digit()) {
            return Err(error(text, "the count must be a whole number"));
        }
        let count: u64 = count.parse().map_err(|_| error(text, "count too large"))?;
        let per = per.trim();
        // `10/s`, `100/minute`: a unit alone is one of it.
        let per = if per.starts_with(|c: char| c.is_ascii_digit()) {
            parse_duration(per)
        } else {
            parse_duration(&format!("1{per}"))
        }
        .map_err(|e| error(text, &format!("the span: {e}")))?;
        Ok(HumanRate(Rate::new(count, per)))
    }
}

impl fmt::Display for HumanRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/", self.0.count())?;
        let per = self.0.per();
        // `10/s` rather than `10/1s`.
        let mut span = String::new();
        write_duration(per, &mut span)?;
        match span.strip_prefix('1') {
            Some(unit) if unit.bytes().all(|b| b.is_ascii_alphabetic()) => f.write_str(unit),
            _ => f.write_str(&span),
        }
    }
}

impl Serialize for HumanRate {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanRate {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_str(Text::<HumanRate>::new("a rate such as \"100/minute\""))
    }
}

/// Reads a value from its text.
struct Text<T> {
    expecting: &'static str,
    _value: std::marker::PhantomData<T>,
}

impl<T> Text<T> {
    fn new(expecting: &'static str) -> Self {
        Text {
            expecting,
            _value: std::marker::PhantomData,
        }
    }
}

impl<T: FromStr<Err = HumanError>> Visitor<'_> for Text<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<T, E> {
        text.parse().map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(text: &str) -> Result<Duration, HumanError> {
        text.parse::<HumanDuration>().map(HumanDuration::get)
    }

    #[test]
    fn durations() {
        assert_eq!(d("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(d("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(d("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(d(" 2 days "), Ok(Duration::from_secs(172_800)));
        assert_eq!(d("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(d("7us"), Ok(Duration::from_micros(7)));
        assert_eq!(d("9ns"), Ok(Duration::from_nanos(9)));
        assert_eq!(d("1S"), Ok(Duration::from_secs(1)));
        assert_eq!(d("0s"), Ok(Duration::ZERO));
        for bad in [
            "", " ", "15", "m", "1.5s", "-1s", "1x", "1s2", "s1", "1 h ours",
        ] {
            assert!(d(bad).is_err(), "{bad:?}");
        }
        assert!(d("600000d").is_err()); // past u64 nanoseconds
        assert!(d("18446744073709551616ns").is_err());
        assert!(d(&"1".repeat(1000)).is_err());
    }

    #[test]
    fn durations_written_back() {
        for (text, written) in [
            ("90s", "1m30s"),
            ("1500ms", "1s500ms"),
            ("0ms", "0s"),
            ("1d", "1d"),
            ("25h", "1d1h"),
            ("1000001ns", "1ms1ns"),
        ] {
            let parsed: HumanDuration = text.parse().unwrap();
            assert_eq!(parsed.to_string(), written);
            assert_eq!(written.parse::<HumanDuration>().unwrap(), parsed);
        }
    }

    #[test]
    fn rates() {
        let r = |text: &str| text.parse::<HumanRate>().map(HumanRate::get);
        assert_eq!(r("100/minute"), Ok(Rate::per_minute(100)));
        assert_eq!(r("10/s"), Ok(Rate::per_second(10)));
        assert_eq!(r("10 / second"), Ok(Rate::per_second(10)));
        assert_eq!(r("5 per 15m"), Ok(Rate::new(5, Duration::from_secs(900))));
        assert_eq!(r("5 PER 15m"), Ok(Rate::new(5, Duration::from_secs(900))));
        assert_eq!(r("3/2h"), Ok(Rate::new(3, Duration::from_secs(7200))));
        assert_eq!(r("0/s"), Ok(Rate::per_second(0))); // policies refuse it, naming the field
        for bad in [
            "",
            "10",
            "/s",
            "x/s",
            "-1/s",
            "1.5/s",
            "10/",
            "10/parsec",
            "10 per",
            "10 pers",
        ] {
            assert!(r(bad).is_err(), "{bad:?}");
        }
        for (text, written) in [
            ("10/s", "10/s"),
            ("5 per 15m", "5/15m"),
            ("7/90s", "7/1m30s"),
        ] {
            let parsed: HumanRate = text.parse().unwrap();
            assert_eq!(parsed.to_string(), written);
            assert_eq!(written.parse::<HumanRate>().unwrap(), parsed);
        }
    }
}
