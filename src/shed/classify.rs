//! How important a request is: the criticality classes of Google's SRE practice.

use std::fmt;
use std::str::FromStr;

use http::HeaderName;
use http::request::Parts;

/// How much a request matters when the service must shed load, least important first. The
/// names are those of Google's SRE practice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Criticality {
    /// Batch and background work: shed first (by default from 70 % of capacity).
    Sheddable,
    /// Work whose loss is tolerable for a while (from 80 %).
    SheddablePlus,
    /// Ordinary interactive traffic, the default class (from 90 %).
    Critical,
    /// The traffic that must get through (only at 100 %).
    CriticalPlus,
}

impl Criticality {
    /// Every class, least important first.
    pub const ALL: [Criticality; 4] = [
        Criticality::Sheddable,
        Criticality::SheddablePlus,
        Criticality::Critical,
        Criticality::CriticalPlus,
    ];

    /// The class's name: `sheddable`, `sheddable_plus`, `critical`, `critical_plus`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Criticality::Sheddable => "sheddable",
            Criticality::SheddablePlus => "sheddable_plus",
            Criticality::Critical => "critical",
            Criticality::CriticalPlus => "critical_plus",
        }
    }

    /// The share of capacity (in thousandths) from which the class is shed by default.
    pub(crate) const fn default_share(self) -> u16 {
        match self {
            Criticality::Sheddable => 700,
            Criticality::SheddablePlus => 800,
            Criticality::Critical => 900,
            Criticality::CriticalPlus => 1_000,
        }
    }

    pub(crate) const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Criticality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Criticality {
    type Err = UnknownCriticality;

    /// A class by its name (`critical_plus`, or `CRITICAL_PLUS`, `critical-plus`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Criticality::ALL
            .into_iter()
            .find(|c| {
                s.len() == c.as_str().len()
                    && s.bytes()
                        .zip(c.as_str().bytes())
                        .all(|(a, b)| a.eq_ignore_ascii_case(&b) || (a == b'-' && b == b'_'))
            })
            .ok_or(UnknownCriticality)
    }
}

/// A text that names no [`Criticality`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnknownCriticality;

impl fmt::Display for UnknownCriticality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not a criticality: use critical_plus, critical, sheddable_plus or sheddable")
    }
}

impl std::error::Error for UnknownCriticality {}

/// Puts each request in a [`Criticality`] class, from its head (method, path, headers,
/// extensions). Any `Fn(&Parts) -> Criticality` is a classifier:
///
/// ```
/// use http::request::Parts;
/// use tollgate::shed::{Classifier, Criticality};
///
/// let by_route = |parts: &Parts| match parts.uri.path() {
///     p if p.starts_with("/checkout") => Criticality::CriticalPlus,
///     p if p.starts_with("/reports") => Criticality::Sheddable,
///     _ => Criticality::Critical,
/// };
/// let (parts, _) = http::Request::get("/reports/q3").body(()).unwrap().into_parts();
/// assert_eq!(by_route.classify(&parts), Criticality::Sheddable);
/// ```
pub trait Classifier: Send + Sync + 'static {
    /// The class of a request.
    fn classify(&self, parts: &Parts) -> Criticality;
}

impl<F> Classifier for F
where
    F: Fn(&Parts) -> Criticality + Send + Sync + 'static,
{
    fn classify(&self, parts: &Parts) -> Criticality {
        self(parts)
    }
}

/// The class a header names (`x-criticality: sheddable`), or a default when it names none.
///
/// Read it only from a header your own edge sets (or strips from clients): a client that may
/// write it may call every request `critical_plus`.
#[derive(Clone, Debug)]
pub struct ByHeader {
    name: HeaderName,
    default: Criticality,
}

impl ByHeader {
    /// The header `name`, `critical` when it is absent or names no class.
    pub fn new(name: HeaderName) -> Self {
        ByHeader {
            name,
            default: Criticality::Critical,
        }
    }

    /// The header `name` (lowercase; panics on an invalid name, like
    /// [`HeaderName::from_static`]), `critical` when it is absent or names no class.
    pub const fn from_static(name: &'static str) -> Self {
        ByHeader {
            name: HeaderName::from_static(name),
            default: Criticality::Critical,
        }
    }

    /// The class of requests whose header names none.
    pub const fn default_class(mut self, class: Criticality) -> Self {
        self.default = class;
        self
    }
}

impl Classifier for ByHeader {
    fn classify(&self, parts: &Parts) -> Criticality {
        parts
            .headers
            .get(&self.name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(self.default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_both_ways() {
        for c in Criticality::ALL {
            assert_eq!(c.as_str().parse::<Criticality>(), Ok(c));
            assert_eq!(c.to_string().to_uppercase().parse::<Criticality>(), Ok(c));
        }
        assert_eq!("critical-plus".parse(), Ok(Criticality::CriticalPlus));
        assert!("critical+".parse::<Criticality>().is_err());
        assert!("".parse::<Criticality>().is_err());
        let header = ByHeader::from_static("x-criticality").default_class(Criticality::Sheddable);
        let parts = |v: &str| {
            http::Request::get("/")
                .header("x-criticality", v)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        assert_eq!(
            header.classify(&parts(" sheddable_plus ")),
            Criticality::SheddablePlus
        );
        assert_eq!(header.classify(&parts("bogus")), Criticality::Sheddable);
        assert!(Criticality::Sheddable < Criticality::CriticalPlus);
    }
}
