//! One policy of the file, checked value by value.

use crate::config::Problems;
use crate::config::schema::*;
use crate::{Policy, Rate};

/// One policy, or `None` after noting its problems.
pub(crate) fn policy(spec: &PolicyConfig, path: &str, p: &mut Problems) -> Option<Policy> {
    use AlgorithmConfig as A;
    let window = matches!(
        spec.algorithm,
        A::FixedWindow | A::SlidingLog | A::SlidingWindow
    );
    let (limit, span, rate) = if window {
        if spec.burst.is_some() {
            p.add(
                format!("{path}.burst"),
                "only for buckets; a window takes limit and window",
            );
        }
        match (spec.rate, spec.limit, spec.window) {
            (Some(rate), None, None) => (rate.get().count(), rate.get().per(), None),
            (Some(_), _, _) => {
                p.add(
                    format!("{path}.rate"),
                    "give rate, or limit and window, not both",
                );
                return None;
            }
            (None, limit, window) => {
                if limit.is_none() {
                    p.add(
                        format!("{path}.limit"),
                        "missing (or give a rate: \"100/minute\")",
                    );
                }
                if window.is_none() {
                    p.add(
                        format!("{path}.window"),
                        "missing (or give a rate: \"100/minute\")",
                    );
                }
                (limit?, window?.get(), None)
            }
        }
    } else {
        for (field, set) in [
            ("limit", spec.limit.is_some()),
            ("window", spec.window.is_some()),
        ] {
            if set {
                p.add(
                    format!("{path}.{field}"),
                    "only for windows; a bucket takes rate and burst",
                );
            }
        }
        let Some(rate) = spec.rate else {
            p.add(
                format!("{path}.rate"),
                "missing: a bucket's rate, such as \"10/s\"",
            );
            return None;
        };
        let rate: Rate = rate.get();
        (spec.burst.unwrap_or(rate.count()), rate.per(), Some(rate))
    };
    let built = match (spec.algorithm, rate) {
        (A::FixedWindow, _) => Policy::fixed_window(limit, span),
        (A::SlidingLog, _) => Policy::sliding_log(limit, span),
        (A::SlidingWindow, _) => Policy::sliding_window(limit, span),
        (A::TokenBucket, Some(rate)) => Policy::token_bucket(rate, limit),
        (A::LeakyBucket, Some(rate)) => Policy::leaky_bucket(rate, limit),
        (A::Gcra, Some(rate)) => Policy::gcra(rate, limit),
        (_, None) => return None,
    };
    let field = |e: &crate::PolicyError| -> &'static str {
        use crate::PolicyError as E;
        let limit_field = if window { "limit" } else { "burst" };
        let given = |field: &'static str| {
            let set = match field {
                "limit" => spec.limit.is_some(),
                "burst" => spec.burst.is_some(),
                _ => spec.window.is_some(),
            };
            if set { field } else { "rate" }
        };
        match e {
            E::ZeroLimit => given(limit_field),
            E::ZeroWindow => given("window"),
            E::InvalidName(_) => "name",
            E::TooLarge { what, .. } if what.contains("limit") => given(limit_field),
            E::TooLarge { what, .. } if what.starts_with("burst") => given("burst"),
            E::TooLarge { what, .. } if *what == "window" => given("window"),
            _ => "rate",
        }
    };
    let built = match built {
        Ok(policy) => policy,
        Err(e) => {
            p.add(format!("{path}.{}", field(&e)), e);
            return None;
        }
    };
    match &spec.name {
        Some(name) => match built.named(name) {
            Ok(named) => Some(named),
            Err(e) => {
                p.add(format!("{path}.name"), e);
                None
            }
        },
        None => Some(built),
    }
}
