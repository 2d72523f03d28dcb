//! The `[keys]` section and a rule's key: extractors by kind, composed keys, and the bounds on
//! their nesting.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::HeaderName;

use super::Builder;
use super::bindings::SharedKey;
use crate::config::Problems;
use crate::config::schema::*;
use crate::key::{Forwarded, Global, Header, KeyExtractor, PeerIp};

/// The most nested `any_of` / `all_of` keys.
pub(super) const MAX_KEY_DEPTH: usize = 8;

/// The most keys one `any_of` / `all_of` combines.
pub(super) const MAX_KEY_PARTS: usize = 16;

/// The most extractors one key runs in all, repeats counted: each request runs every one
/// of them (`any_of` until one finds a key, `all_of` all of them, joined).
pub(super) const MAX_KEY_LEAVES: usize = 32;

/// How many extractors the key named `name` runs in all, repeats counted (saturating; a
/// cycle counts as too many).
pub(super) fn leaves<'a>(
    config: &'a Config,
    name: &'a str,
    depth: usize,
    memo: &mut BTreeMap<&'a str, usize>,
) -> usize {
    if let Some(&n) = memo.get(name) {
        return n;
    }
    let Some(spec) = config.keys.get(name) else {
        return 1;
    };
    let n = if !matches!(spec.kind, KeyKind::AnyOf | KeyKind::AllOf) {
        1
    } else if depth >= MAX_KEY_DEPTH {
        usize::MAX
    } else {
        spec.of.iter().fold(0usize, |sum, part| {
            sum.saturating_add(leaves(config, part, depth + 1, memo))
        })
    };
    memo.insert(name, n);
    n
}

impl<'a> Builder<'a> {
    /// The key extractor named `name` in `[keys]`, built once.
    pub(super) fn named_key(&mut self, name: &'a str, depth: usize) -> Option<SharedKey> {
        if let Some(built) = self.keys.get(name) {
            return built.clone();
        }
        let path = format!("keys.{name}");
        if !crate::limiter::valid_name(name) {
            self.problems.add(
                &path,
                "a key's name is 1 to 64 of a-z A-Z 0-9 - _ . : (it is referred to by name)",
            );
        }
        let spec = self.config.keys.get(name)?;
        let built = self.key(spec, &path, depth);
        self.keys.insert(name, built.clone());
        built
    }

    fn key(&mut self, spec: &'a KeyConfig, path: &str, depth: usize) -> Option<SharedKey> {
        let p = &mut self.problems;
        let unused = |p: &mut Problems, field: &str, set: bool| {
            if set {
                p.add(
                    format!("{path}.{field}"),
                    format!("not used by a key of kind {}", kind_name(spec.kind)),
                );
            }
        };
        let kind = spec.kind;
        let ip = matches!(kind, KeyKind::PeerIp | KeyKind::Forwarded);
        unused(
            p,
            "header",
            spec.header.is_some() && kind != KeyKind::Header,
        );
        unused(
            p,
            "trusted",
            !spec.trusted.is_empty() && kind != KeyKind::Forwarded,
        );
        unused(p, "rfc7239", spec.rfc7239 && kind != KeyKind::Forwarded);
        unused(p, "ipv4_prefix", spec.ipv4_prefix.is_some() && !ip);
        unused(p, "ipv6_prefix", spec.ipv6_prefix.is_some() && !ip);
        let combines = matches!(kind, KeyKind::AnyOf | KeyKind::AllOf);
        unused(p, "of", !spec.of.is_empty() && !combines);
        unused(
            p,
            "binding",
            spec.binding.is_some() && kind != KeyKind::Custom,
        );
        if let Some(bits) = spec.ipv4_prefix.filter(|b| *b > 32) {
            p.add(
                format!("{path}.ipv4_prefix"),
                format!("{bits} bits: at most 32"),
            );
        }
        if let Some(bits) = spec.ipv6_prefix.filter(|b| *b > 128) {
            p.add(
                format!("{path}.ipv6_prefix"),
                format!("{bits} bits: at most 128"),
            );
        }
        let key: Arc<dyn KeyExtractor> = match kind {
            KeyKind::Global => Arc::new(Global),
            KeyKind::PeerIp => {
                let mut key = PeerIp::new();
                if let Some(bits) = spec.ipv4_prefix {
                    key = key.ipv4_prefix(bits);
                }
                if let Some(bits) = spec.ipv6_prefix {
                    key = key.ipv6_prefix(bits);
                }
                Arc::new(key)
            }
            KeyKind::Forwarded => {
                if spec.trusted.is_empty() {
                    p.add(
                        format!("{path}.trusted"),
                        "name the proxies' networks (with none, use kind = \"peer_ip\")",
                    );
                }
                let mut bad = false;
                for (i, network) in spec.trusted.iter().enumerate() {
                    if let Err(e) = Forwarded::trusting([network]) {
                        p.add(format!("{path}.trusted[{i}]"), e);
                        bad = true;
                    }
                }
                if bad {
                    return None;
                }
                let mut key = Forwarded::trusting(&spec.trusted).ok()?;
                if spec.rfc7239 {
                    key = key.rfc7239();
                }
                if let Some(bits) = spec.ipv4_prefix {
                    key = key.ipv4_prefix(bits);
                }
                if let Some(bits) = spec.ipv6_prefix {
                    key = key.ipv6_prefix(bits);
                }
                Arc::new(key)
            }
            KeyKind::Header => {
                let Some(name) = &spec.header else {
                    p.add(format!("{path}.header"), "missing: the header's name");
                    return None;
                };
                match HeaderName::from_bytes(name.as_bytes()) {
                    Ok(name) => Arc::new(Header(name)),
                    Err(_) => {
                        p.add(
                            format!("{path}.header"),
                            format!("not a header name: {name:?}"),
                        );
                        return None;
                    }
                }
            }
            KeyKind::Custom => {
                let Some(name) = &spec.binding else {
                    p.add(format!("{path}.binding"), "missing: the name bound in code");
                    return None;
                };
                match self.bindings {
                    Some(bindings) => match bindings.keys.get(name) {
                        Some(key) => Arc::clone(key),
                        None => {
                            p.add(
                                format!("{path}.binding"),
                                format!("no key extractor is bound to {name:?} in code"),
                            );
                            return None;
                        }
                    },
                    // Checked without bindings: stands in for the bound one.
                    None => Arc::new(Global),
                }
            }
            KeyKind::AnyOf | KeyKind::AllOf => {
                if spec.of.len() < 2 || spec.of.len() > MAX_KEY_PARTS {
                    p.add(
                        format!("{path}.of"),
                        format!("name 2 to {MAX_KEY_PARTS} keys, not {}", spec.of.len()),
                    );
                    return None;
                }
                if depth >= MAX_KEY_DEPTH {
                    p.add(
                        format!("{path}.of"),
                        format!("keys nested more than {MAX_KEY_DEPTH} deep (a cycle?)"),
                    );
                    return None;
                }
                if let Some(twice) = spec
                    .of
                    .iter()
                    .enumerate()
                    .find(|(i, name)| spec.of[..*i].contains(name))
                {
                    p.add(
                        format!("{path}.of[{}]", twice.0),
                        format!("{:?} is named twice", twice.1),
                    );
                    return None;
                }
                let mut memo = BTreeMap::new();
                let total = spec.of.iter().fold(0usize, |sum, part| {
                    sum.saturating_add(leaves(self.config, part, depth + 1, &mut memo))
                });
                if total > MAX_KEY_LEAVES && depth == 0 {
                    p.add(
                        format!("{path}.of"),
                        if total == usize::MAX {
                            format!("keys nested more than {MAX_KEY_DEPTH} deep (a cycle?)")
                        } else {
                            format!(
                                "runs more than {MAX_KEY_LEAVES} extractors per request in all \
                                 (nested keys counted each time they appear)"
                            )
                        },
                    );
                    return None;
                }
                let mut parts = Vec::new();
                for (i, name) in spec.of.iter().enumerate() {
                    if !self.config.keys.contains_key(name) {
                        self.problems.add(
                            format!("{path}.of[{i}]"),
                            format!("no key named {name:?} in [keys]"),
                        );
                        return None;
                    }
                    parts.push(self.named_key(name, depth + 1)?);
                }
                let mut parts = parts.into_iter().rev();
                let mut combined = parts.next()?;
                for part in parts {
                    combined = if kind == KeyKind::AnyOf {
                        SharedKey(Arc::new(part.or(combined)))
                    } else {
                        SharedKey(Arc::new(part.and(combined)))
                    };
                }
                combined.0
            }
        };
        Some(SharedKey(key))
    }

    /// A rule's key: a name from `[keys]`, or `global` / `peer_ip`.
    pub(super) fn rule_key(&mut self, name: Option<&'a String>, path: &str) -> Option<SharedKey> {
        match name.map(String::as_str) {
            None => Some(SharedKey(Arc::new(Global))),
            Some(name) => match self.keys.get(name) {
                Some(key) => key.clone(),
                None if name == "global" => Some(SharedKey(Arc::new(Global))),
                None if name == "peer_ip" => Some(SharedKey(Arc::new(PeerIp::new()))),
                None => {
                    self.problems.add(
                        path,
                        format!("no key named {name:?} in [keys] (nor global or peer_ip)"),
                    );
                    None
                }
            },
        }
    }
}

pub(super) fn kind_name(kind: KeyKind) -> &'static str {
    match kind {
        KeyKind::Global => "global",
        KeyKind::PeerIp => "peer_ip",
        KeyKind::Forwarded => "forwarded",
        KeyKind::Header => "header",
        KeyKind::AnyOf => "any_of",
        KeyKind::AllOf => "all_of",
        KeyKind::Custom => "custom",
    }
}
