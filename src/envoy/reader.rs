//! Reading a YAML file's descriptors into the tree, every problem reported with its path.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde_norway::Value;

use super::config::{Limit, LimitKind, Node, Unit};
use super::problems::Problems;
use crate::{Policy, Rate};

/// The keys envoyproxy/ratelimit knows, and tollgate's two (`algorithm`, `burst`).
const KNOWN_KEYS: &[&str] = &[
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "quota_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
    "algorithm",
    "burst",
];

pub(super) struct Reader<'p> {
    pub(super) problems: &'p mut Problems,
    pub(super) prefix: &'p str,
}

impl Reader<'_> {
    pub(super) fn problem(&mut self, path: &str, message: impl Into<String>) {
        self.problems
            .push(format!("{}{path}", self.prefix), message.into());
    }

    /// A mapping's entries with string keys, reporting unknown keys and non-string keys.
    fn mapping<'v>(&mut self, path: &str, value: &'v Value) -> Option<HashMap<&'v str, &'v Value>> {
        let Value::Mapping(map) = value else {
            self.problem(path, format!("expected a map, found {}", kind(value)));
            return None;
        };
        let mut out = HashMap::new();
        for (k, v) in map {
            match k.as_str() {
                Some(name) if KNOWN_KEYS.contains(&name) => {
                    out.insert(name, v);
                }
                Some(name) => self.problem(&join(path, name), "unknown key"),
                None => self.problem(path, format!("a key is not a string: {}", kind(k))),
            }
        }
        Some(out)
    }

    pub(super) fn root(&mut self, value: &Value) -> Option<(String, Node)> {
        let map = self.mapping("", value)?;
        let domain = match map.get("domain") {
            None => {
                self.problem("domain", "missing");
                None
            }
            Some(v) => match self.string("domain", v) {
                Some(d) if d.is_empty() => {
                    self.problem("domain", "empty");
                    None
                }
                other => other,
            },
        };
        for key in map.keys() {
            if !matches!(*key, "domain" | "descriptors") {
                self.problem(key, "not allowed at the top level");
            }
        }
        let mut root = Node::default();
        if let Some(list) = map.get("descriptors") {
            self.descriptors("descriptors", list, &mut root, "");
        }
        Some((domain?, root))
    }

    /// The descriptors of `list` into `parent`, whose path is `stat` (as envoyproxy/ratelimit
    /// names its statistics: `key` or `key_value` per level, joined by `.`).
    fn descriptors(&mut self, path: &str, list: &Value, parent: &mut Node, stat: &str) {
        let items = match list {
            Value::Sequence(items) => items,
            Value::Null => return,
            other => {
                self.problem(path, format!("expected a list, found {}", kind(other)));
                return;
            }
        };
        let mut seen = HashSet::new();
        for (i, item) in items.iter().enumerate() {
            let here = format!("{path}[{i}]");
            let Some(map) = self.mapping(&here, item) else {
                continue;
            };
            let key = match map.get("key") {
                None => {
                    self.problem(&join(&here, "key"), "missing");
                    None
                }
                Some(v) => match self.scalar(&join(&here, "key"), v) {
                    Some(k) if k.is_empty() => {
                        self.problem(&join(&here, "key"), "empty");
                        None
                    }
                    other => other,
                },
            };
            let value = match map.get("value") {
                None | Some(Value::Null) => String::new(),
                Some(v) => self.scalar(&join(&here, "value"), v).unwrap_or_default(),
            };
            let flag = |reader: &mut Self, name: &str| match map.get(name) {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => {
                    reader.problem(
                        &join(&here, name),
                        format!("expected true or false, found {}", kind(other)),
                    );
                    false
                }
            };
            let shadow_mode = flag(self, "shadow_mode");
            let share_threshold = flag(self, "share_threshold");
            let detailed_metric = flag(self, "detailed_metric");
            flag(self, "value_to_metric");
            if flag(self, "quota_mode") {
                self.problem(
                    &join(&here, "quota_mode"),
                    "quota mode is not supported by tollgate",
                );
            }
            for name in [
                "domain",
                "unit",
                "requests_per_unit",
                "unlimited",
                "name",
                "replaces",
                "algorithm",
                "burst",
            ] {
                if map.contains_key(name) {
                    self.problem(
                        &join(&here, name),
                        "belongs in rate_limit (or at the top level)",
                    );
                }
            }
            if share_threshold && !value.contains('*') {
                self.problem(
                    &join(&here, "share_threshold"),
                    "only a wildcard value (with '*') can share its threshold",
                );
            }
            let level = match (&key, value.is_empty()) {
                (Some(k), true) => k.clone(),
                (Some(k), false) => format!("{k}_{value}"),
                (None, _) => String::new(),
            };
            let stat_here = if stat.is_empty() {
                level
            } else {
                format!("{stat}.{level}")
            };
            let mut node = Node::default();
            if let Some(rl) = map.get("rate_limit") {
                node.limit = self
                    .rate_limit(&join(&here, "rate_limit"), rl, shadow_mode)
                    .map(|limit| {
                        Arc::new(Limit {
                            path: Arc::from(stat_here.as_str()),
                            detailed_metric,
                            ..limit
                        })
                    });
            }
            if share_threshold && value.contains('*') {
                node.shared_as = Some(Arc::from(value.as_str()));
            }
            if let Some(list) = map.get("descriptors") {
                self.descriptors(&join(&here, "descriptors"), list, &mut node, &stat_here);
            }
            let Some(key) = key else { continue };
            if !seen.insert((key.clone(), value.clone())) {
                let shown = if value.is_empty() {
                    key.clone()
                } else {
                    format!("{key}_{value}")
                };
                self.problem(&here, format!("duplicate descriptor '{shown}'"));
                continue;
            }
            let children = parent.children.entry(key).or_default();
            if value.is_empty() {
                children.any = Some(Box::new(node));
            } else if value.contains('*') {
                let parts = value.split('*').map(str::to_owned).collect();
                children.wildcards.push((parts, node));
            } else {
                children.by_value.insert(value, node);
            }
        }
    }

    fn rate_limit(&mut self, path: &str, value: &Value, shadow_mode: bool) -> Option<Limit> {
        let map = self.mapping(path, value)?;
        let mut ok = true;
        for key in map.keys() {
            if !matches!(
                *key,
                "unit"
                    | "requests_per_unit"
                    | "unlimited"
                    | "name"
                    | "replaces"
                    | "algorithm"
                    | "burst"
            ) {
                self.problem(&join(path, key), "not allowed in rate_limit");
                ok = false;
            }
        }
        let unlimited = match map.get("unlimited") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                self.problem(
                    &join(path, "unlimited"),
                    format!("expected true or false, found {}", kind(other)),
                );
                return None;
            }
        };
        let unit = match map.get("unit") {
            None | Some(Value::Null) => None,
            Some(v) => {
                let text = self.string(&join(path, "unit"), v)?;
                match Unit::parse(&text) {
                    Some(u) => Some(u),
                    None => {
                        self.problem(
                            &join(path, "unit"),
                            format!(
                                "invalid rate limit unit '{text}' (second, minute, hour, day, week, month or year)"
                            ),
                        );
                        return None;
                    }
                }
            }
        };
        let requests_per_unit = match map.get("requests_per_unit") {
            None | Some(Value::Null) => 0,
            Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
                Some(n) => n,
                None => {
                    self.problem(
                        &join(path, "requests_per_unit"),
                        format!("expected a whole number from 0 to {}", u32::MAX),
                    );
                    return None;
                }
            },
        };
        let name = match map.get("name") {
            None | Some(Value::Null) => None,
            Some(v) => Some(self.string(&join(path, "name"), v)?),
        };
        let mut replaces = Vec::new();
        match map.get("replaces") {
            None | Some(Value::Null) => {}
            Some(Value::Sequence(items)) => {
                for (i, item) in items.iter().enumerate() {
                    let here = format!("{path}.replaces[{i}]");
                    let replaced = match item {
                        Value::Mapping(m) => {
                            if let Some(k) = m.keys().find(|k| k.as_str() != Some("name")) {
                                self.problem(&here, format!("unknown key {}", shown(k)));
                            }
                            m.get("name").and_then(Value::as_str).unwrap_or_default()
                        }
                        other => {
                            self.problem(&here, format!("expected a map, found {}", kind(other)));
                            ok = false;
                            continue;
                        }
                    };
                    if replaced.is_empty() {
                        self.problem(&here, "should not have an empty replaces entry");
                        ok = false;
                    } else if name.as_deref() == Some(replaced) {
                        self.problem(
                            &here,
                            "replaces should not contain the name of its own limit",
                        );
                        ok = false;
                    } else {
                        replaces.push(Arc::from(replaced));
                    }
                }
            }
            Some(other) => {
                self.problem(
                    &join(path, "replaces"),
                    format!("expected a list, found {}", kind(other)),
                );
                ok = false;
            }
        }
        let algorithm = match map.get("algorithm") {
            None | Some(Value::Null) => "fixed_window".to_owned(),
            Some(v) => self.string(&join(path, "algorithm"), v)?,
        };
        let burst = match map.get("burst") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64().filter(|&b| b > 0) {
                Some(b) => Some(b),
                None => {
                    self.problem(&join(path, "burst"), "expected a whole number above 0");
                    return None;
                }
            },
        };
        let kind = if unlimited {
            if unit.is_some() {
                self.problem(
                    &join(path, "unit"),
                    "should not specify rate limit unit when unlimited",
                );
                return None;
            }
            LimitKind::Unlimited
        } else {
            let Some(unit) = unit else {
                self.problem(&join(path, "unit"), "missing (or set unlimited: true)");
                return None;
            };
            self.policy(
                path,
                &algorithm,
                requests_per_unit,
                unit,
                burst,
                name.as_deref(),
            )?
        };
        ok.then(|| Limit {
            kind,
            requests_per_unit,
            unit,
            name: name.map(Arc::from),
            replaces: replaces.into(),
            shadow_mode,
            path: Arc::from(""),
            detailed_metric: false,
            hits: std::sync::OnceLock::new(),
        })
    }

    fn policy(
        &mut self,
        path: &str,
        algorithm: &str,
        requests_per_unit: u32,
        unit: Unit,
        burst: Option<u64>,
        name: Option<&str>,
    ) -> Option<LimitKind> {
        let n = u64::from(requests_per_unit);
        let window = unit.duration();
        let rate = Rate::new(n, window);
        let bucket = matches!(algorithm, "token_bucket" | "leaky_bucket" | "gcra");
        if burst.is_some() && !bucket {
            self.problem(
                &join(path, "burst"),
                format!("only token_bucket, leaky_bucket and gcra take a burst, not {algorithm}"),
            );
            return None;
        }
        if n == 0 {
            return Some(LimitKind::DenyAll);
        }
        let burst = burst.unwrap_or(n);
        let policy = match algorithm {
            "fixed_window" => Policy::fixed_window(n, window),
            "sliding_window" => Policy::sliding_window(n, window),
            "sliding_log" => Policy::sliding_log(n, window),
            "token_bucket" => Policy::token_bucket(rate, burst),
            "leaky_bucket" => Policy::leaky_bucket(rate, burst),
            "gcra" => Policy::gcra(rate, burst),
            other => {
                self.problem(
                    &join(path, "algorithm"),
                    format!(
                        "unknown algorithm '{other}' (fixed_window, sliding_window, sliding_log, token_bucket, leaky_bucket or gcra)"
                    ),
                );
                return None;
            }
        };
        // A name that a policy can carry is shown in the RateLimit fields; any other name
        // still works for `replaces`.
        let policy = policy.map(|p| match name {
            Some(name) => p.clone().named(name).unwrap_or(p),
            None => p,
        });
        match policy {
            Ok(p) => Some(LimitKind::Counted(p)),
            Err(e) => {
                self.problem(path, e.to_string());
                None
            }
        }
    }

    fn string(&mut self, path: &str, value: &Value) -> Option<String> {
        match value {
            Value::String(s) => Some(s.clone()),
            other => {
                self.problem(path, format!("expected a string, found {}", kind(other)));
                None
            }
        }
    }

    /// A string, or a number or boolean as written (as envoyproxy/ratelimit's YAML reader
    /// takes `value: 500`).
    fn scalar(&mut self, path: &str, value: &Value) -> Option<String> {
        match value {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            Value::Bool(b) => Some(b.to_string()),
            other => {
                self.problem(path, format!("expected a string, found {}", kind(other)));
                None
            }
        }
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a map",
        Value::Tagged(_) => "a tagged value",
    }
}

fn shown(value: &Value) -> String {
    value
        .as_str()
        .map_or_else(|| kind(value).to_owned(), |s| format!("'{s}'"))
}
