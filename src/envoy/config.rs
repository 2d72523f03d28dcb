//! envoyproxy/ratelimit's YAML configuration files, read as they are, with tollgate's two
//! additions (`algorithm` and `burst` in a `rate_limit` map), and the tree a request's
//! descriptors are matched against.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde_norway::Value;

use super::metrics::{Calls, Hits};
use super::problems::Problems;
pub use super::problems::{ConfigError, Problem};
use super::reader::Reader;
use crate::Policy;

/// The unit of a limit, as envoyproxy/ratelimit counts it (a month is 30 days, a year 365).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Unit {
    /// A second.
    Second,
    /// A minute.
    Minute,
    /// An hour.
    Hour,
    /// A day.
    Day,
    /// Seven days.
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// The unit named `name` (any case), as the YAML files spell it.
    pub fn parse(name: &str) -> Option<Unit> {
        Some(match name.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    /// Its length.
    pub const fn duration(self) -> Duration {
        Duration::from_secs(match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        })
    }
}

/// What a matched limit does.
#[derive(Clone, Debug)]
pub(crate) enum LimitKind {
    /// `unlimited: true`: always OK, never counted.
    Unlimited,
    /// `requests_per_unit: 0`: always over the limit, never counted.
    DenyAll,
    /// Counted under this policy.
    Counted(Policy),
}

/// One configured (or overriding) limit.
#[derive(Clone, Debug)]
pub(crate) struct Limit {
    pub(crate) kind: LimitKind,
    pub(crate) requests_per_unit: u32,
    pub(crate) unit: Option<Unit>,
    pub(crate) name: Option<Arc<str>>,
    pub(crate) replaces: Box<[Arc<str>]>,
    pub(crate) shadow_mode: bool,
    /// Its descriptor's path in the configuration, as envoyproxy/ratelimit names its
    /// statistics: each level `key` or `key_value`, joined by `.` (empty for an override).
    pub(crate) path: Arc<str>,
    /// `detailed_metric: true`: its metrics are labelled by the request's values.
    pub(crate) detailed_metric: bool,
    /// Its metrics, registered at the first call that counts it.
    pub(crate) hits: OnceLock<Hits>,
}

impl Limit {
    /// A limit Envoy sends in the descriptor: a fixed window, never in shadow mode (as
    /// envoyproxy/ratelimit treats it).
    pub(crate) fn from_override(requests_per_unit: u32, unit: Unit) -> Self {
        let kind = match Policy::fixed_window(u64::from(requests_per_unit), unit.duration()) {
            Ok(policy) => LimitKind::Counted(policy),
            Err(_) => LimitKind::DenyAll,
        };
        Limit {
            kind,
            requests_per_unit,
            unit: Some(unit),
            name: None,
            replaces: Box::new([]),
            shadow_mode: false,
            path: Arc::from(""),
            detailed_metric: false,
            hits: OnceLock::new(),
        }
    }

    /// Its metrics, labelled `domain` and its path.
    pub(crate) fn hits(&self, domain: &str) -> &Hits {
        self.hits.get_or_init(|| Hits::new(domain, &self.path))
    }
}

/// The children of a node that share one key.
#[derive(Debug, Default)]
pub(super) struct Children {
    /// `key` + `value`: an exact value.
    pub(super) by_value: HashMap<String, Node>,
    /// `key` + a value with `*`: the pattern split on `*`, in the file's order.
    pub(super) wildcards: Vec<(Box<[String]>, Node)>,
    /// `key` alone: any value.
    pub(super) any: Option<Box<Node>>,
}

/// One configured descriptor: its limit and the descriptors nested in it.
#[derive(Debug, Default)]
pub(super) struct Node {
    pub(super) limit: Option<Arc<Limit>>,
    /// `share_threshold: true` on a wildcard: the pattern that all its values count under.
    pub(super) shared_as: Option<Arc<str>>,
    pub(super) children: HashMap<String, Children>,
    /// At a domain's root: the domain's call metrics, registered at its first call.
    pub(super) calls: OnceLock<Arc<Calls>>,
}

impl Node {
    fn has_children(&self) -> bool {
        !self.children.is_empty()
    }
}

/// A limit matched by a request's descriptor, and the value each entry counts under.
#[derive(Debug)]
pub(crate) struct Matched<'a> {
    pub(crate) limit: &'a Arc<Limit>,
    /// Per entry: the wildcard pattern to count under instead of the value (share_threshold).
    pub(crate) shared: Vec<Option<&'a str>>,
}

/// Rate limit configuration in envoyproxy/ratelimit's format: one or more YAML files, each a
/// `domain` and its tree of `descriptors`.
///
/// Everything envoyproxy/ratelimit documents is read: `key`, `value` (exact, or with `*`
/// wildcards), nested `descriptors`, `rate_limit` with `unit` (second, minute, hour, day, week,
/// month, year; any case), `requests_per_unit`, `unlimited`, `name` and `replaces`, and
/// `shadow_mode`, `share_threshold`, and `detailed_metric` (the metrics of that limit are
/// labelled by the request's values, within a bound: see the [module docs](super#metrics)).
/// `value_to_metric` and `metadata` are accepted and change nothing. `quota_mode:
/// true` is refused: tollgate does not implement quota mode. tollgate adds two keys to
/// `rate_limit`: `algorithm` (`fixed_window`, the default and envoyproxy/ratelimit's only one;
/// `sliding_window`, `sliding_log`, `token_bucket`, `leaky_bucket`, `gcra`), with the rate
/// `requests_per_unit` per `unit`, and `burst` for the three buckets (default:
/// `requests_per_unit`).
///
/// ```
/// use tollgate::envoy::Config;
///
/// let config = Config::from_yaml(
///     "domain: messaging
/// descriptors:
///   - key: to_number
///     rate_limit: { unit: day, requests_per_unit: 100, algorithm: sliding_window }
/// ",
/// )?;
/// assert_eq!(config.domains().collect::<Vec<_>>(), ["messaging"]);
///
/// let err = Config::from_yaml("domain: x\ndescriptors:\n  - key: a\n    rate_limit: { unit: fortnight }\n  - value: b\n")
///     .unwrap_err();
/// assert_eq!(err.problems().len(), 2); // every problem at once, each with its path
/// assert_eq!(err.problems()[0].path(), "descriptors[0].rate_limit.unit");
/// # Ok::<(), tollgate::envoy::ConfigError>(())
/// ```
#[derive(Debug, Default)]
pub struct Config {
    domains: HashMap<String, Node>,
}

impl Config {
    /// Reads one YAML file.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        Config::from_files([("", text)])
    }

    /// Reads several YAML files, each `(name, text)`: the name prefixes the paths of its
    /// problems. Two files may not configure the same domain (as envoyproxy/ratelimit without
    /// `MERGE_DOMAIN_CONFIG`).
    pub fn from_files<'a>(
        files: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Config, ConfigError> {
        let mut problems = Problems::default();
        let mut config = Config::default();
        for (name, text) in files {
            let prefix = if name.is_empty() {
                String::new()
            } else {
                format!("{name}: ")
            };
            // Merge keys (`<<: *anchor`) are applied, as envoyproxy/ratelimit's YAML reader does.
            let value = serde_norway::from_str::<Value>(text).and_then(|mut v| {
                v.apply_merge()?;
                Ok(v)
            });
            let value = match value {
                Ok(v) => v,
                Err(e) => {
                    problems.push(format!("{prefix}(file)"), format!("not YAML: {e}"));
                    continue;
                }
            };
            let mut reader = Reader {
                problems: &mut problems,
                prefix: &prefix,
            };
            if let Some((domain, node)) = reader.root(&value) {
                match config.domains.entry(domain) {
                    std::collections::hash_map::Entry::Occupied(e) => {
                        reader.problem("domain", format!("duplicate domain '{}'", e.key()));
                    }
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(node);
                    }
                }
            }
        }
        problems.finish()?;
        Ok(config)
    }

    /// The configured domains.
    pub fn domains(&self) -> impl Iterator<Item = &str> {
        self.domains.keys().map(String::as_str)
    }

    /// Whether `domain` is configured.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The call metrics of `domain`, if it is configured.
    pub(crate) fn calls(&self, domain: &str) -> Option<&Arc<Calls>> {
        let (name, root) = self.domains.get_key_value(domain)?;
        Some(root.calls.get_or_init(|| Arc::new(Calls::new(name))))
    }

    /// Reads one YAML file, or every `*.yaml` and `*.yml` file of a folder (in name order,
    /// not its subfolders), as envoyproxy/ratelimit reads its runtime folder. A file that
    /// cannot be read, or a folder without such a file, is a problem (an empty configuration
    /// would let every call through).
    pub fn from_path(path: impl AsRef<Path>) -> Result<Config, ConfigError> {
        let path = path.as_ref();
        let mut problems = Problems::default();
        let files: Vec<std::path::PathBuf> = if path.is_dir() {
            match std::fs::read_dir(path) {
                Ok(entries) => {
                    let mut files: Vec<_> = entries
                        .filter_map(|e| e.ok().map(|e| e.path()))
                        .filter(|p| {
                            p.is_file() && p.extension().is_some_and(|x| x == "yaml" || x == "yml")
                        })
                        .collect();
                    files.sort();
                    if files.is_empty() {
                        problems.push(
                            path.display().to_string(),
                            "no *.yaml or *.yml file in this folder".into(),
                        );
                    }
                    files
                }
                Err(e) => {
                    problems.push(path.display().to_string(), format!("cannot read: {e}"));
                    Vec::new()
                }
            }
        } else {
            vec![path.to_owned()]
        };
        let mut texts = Vec::with_capacity(files.len());
        for file in &files {
            match std::fs::read_to_string(file) {
                Ok(text) => texts.push((file.display().to_string(), text)),
                Err(e) => problems.push(file.display().to_string(), format!("cannot read: {e}")),
            }
        }
        problems.finish()?;
        Config::from_files(texts.iter().map(|(n, t)| (n.as_str(), t.as_str())))
    }

    /// The limit of one descriptor, matched as envoyproxy/ratelimit matches it: level by level,
    /// an entry's exact value first, then a wildcard value, then the key alone; the limit of
    /// the node the last entry reaches, if it has one. A request with more entries than the
    /// tree has levels, or that leaves the tree, matches nothing.
    pub(crate) fn lookup<'a, 'e>(
        &'a self,
        domain: &str,
        entries: impl ExactSizeIterator<Item = (&'e str, &'e str)>,
    ) -> Option<Matched<'a>> {
        let mut node = self.domains.get(domain)?;
        let last = entries.len().checked_sub(1)?;
        let mut shared = Vec::new();
        for (i, (key, value)) in entries.enumerate() {
            let children = node.children.get(key)?;
            let next = children
                .by_value
                .get(value)
                .or_else(|| {
                    children
                        .wildcards
                        .iter()
                        .find(|(parts, _)| wildcard_match(parts, value))
                        .map(|(_, n)| n)
                })
                .or(children.any.as_deref())?;
            shared.push(next.shared_as.as_deref());
            if i == last {
                return next.limit.as_ref().map(|limit| Matched { limit, shared });
            }
            if !next.has_children() {
                return None;
            }
            node = next;
        }
        None
    }
}

/// Whether `value` matches a pattern split on `*` (each `*` any run of characters).
fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return false;
    };
    if parts.len() == 1 {
        return first == value;
    }
    let fixed: usize = parts.iter().map(String::len).sum();
    if value.len() < fixed || !value.starts_with(first.as_str()) || !value.ends_with(last.as_str())
    {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part.as_str()) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Algorithm;

    fn limit<'a>(c: &'a Config, domain: &str, entries: &[(&'a str, &'a str)]) -> Option<&'a Limit> {
        c.lookup(domain, entries.iter().copied())
            .map(|m| &**m.limit)
    }

    fn rpu(l: Option<&Limit>) -> Option<u32> {
        l.map(|l| l.requests_per_unit)
    }

    fn problems(text: &str) -> Vec<String> {
        Config::from_yaml(text)
            .unwrap_err()
            .problems()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    const MESSAGING: &str = "
domain: messaging
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
  - key: remote_address
    rate_limit: { unit: second, requests_per_unit: 10 }
  - key: remote_address
    value: 50.0.0.5
    rate_limit: { unit: second, requests_per_unit: 0 }
  - key: ldap
    rate_limit: { unlimited: true }
  - key: path
    value: /api/*/action
    rate_limit: { unit: minute, requests_per_unit: 20 }
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: { unit: hour, requests_per_unit: 10 }
  - key: user
    value: 42
    rate_limit: { unit: MINUTE, requests_per_unit: 7, algorithm: token_bucket, burst: 3 }
";

    #[test]
    fn the_readme_cases_match_as_envoyproxy_ratelimit_does() {
        let c = Config::from_yaml(MESSAGING).unwrap();
        // Nested: the placeholder level has no limit of its own; the key with no value
        // below it matches any number.
        assert_eq!(
            rpu(limit(
                &c,
                "messaging",
                &[("message_type", "marketing"), ("to_number", "2061111111")]
            )),
            Some(5)
        );
        assert_eq!(
            rpu(limit(&c, "messaging", &[("message_type", "marketing")])),
            None
        );
        assert_eq!(
            rpu(limit(
                &c,
                "messaging",
                &[("message_type", "transactional"), ("to_number", "1")]
            )),
            None
        );
        assert_eq!(
            rpu(limit(&c, "messaging", &[("to_number", "2062222222")])),
            Some(100)
        );
        // The most specific match at a level: key + value before the key alone.
        assert_eq!(
            rpu(limit(&c, "messaging", &[("remote_address", "50.0.0.1")])),
            Some(10)
        );
        let black = limit(&c, "messaging", &[("remote_address", "50.0.0.5")]).unwrap();
        assert!(matches!(black.kind, LimitKind::DenyAll));
        // More entries than the tree has levels: no match.
        assert_eq!(
            rpu(limit(&c, "messaging", &[("to_number", "1"), ("x", "y")])),
            None
        );
        // Unlimited.
        assert!(matches!(
            limit(&c, "messaging", &[("ldap", "u")]).unwrap().kind,
            LimitKind::Unlimited
        ));
        // Wildcards anywhere in the value.
        assert_eq!(
            rpu(limit(&c, "messaging", &[("path", "/api/123/action")])),
            Some(20)
        );
        assert_eq!(
            rpu(limit(&c, "messaging", &[("path", "/api/123/other")])),
            None
        );
        // A shared threshold counts every matching value under the pattern.
        let m = c
            .lookup("messaging", [("files", "files/a.pdf")].into_iter())
            .unwrap();
        assert_eq!(m.shared, [Some("files/*")]);
        // Unknown domain or key: nothing.
        assert!(limit(&c, "other", &[("to_number", "1")]).is_none());
        assert!(limit(&c, "messaging", &[("nope", "1")]).is_none());
        assert!(limit(&c, "messaging", &[]).is_none());
        // tollgate's additions; a number as a value; units in any case.
        let user = limit(&c, "messaging", &[("user", "42")]).unwrap();
        let LimitKind::Counted(p) = &user.kind else {
            panic!()
        };
        assert_eq!((p.algorithm(), p.limit()), (Algorithm::TokenBucket, 3));
        assert_eq!(user.unit, Some(Unit::Minute));
    }

    #[test]
    fn a_plain_limit_is_a_fixed_window_of_the_unit() {
        let c = Config::from_yaml("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 3}\n").unwrap();
        let LimitKind::Counted(p) = &limit(&c, "d", &[("k", "v")]).unwrap().kind else {
            panic!()
        };
        assert_eq!(
            p,
            &Policy::fixed_window(3, Duration::from_secs(3600)).unwrap()
        );
    }

    #[test]
    fn every_problem_is_reported_at_once_with_its_path() {
        let got = problems(
            "
domain: ''
descriptors:
  - key: a
    rate_limit: { unit: fortnight, requests_per_unit: 1 }
  - value: b
  - key: c
    rate_limit: { unlimited: true, unit: second }
  - key: d
    rate_limit: { unit: second, requests_per_unit: -1 }
  - key: e
    colour: red
    rate_limit: { unit: second, requests_per_unit: 1, name: n, replaces: [{name: n}, {name: ''}] }
  - key: f
    share_threshold: true
  - key: g
    rate_limit: { unit: second, requests_per_unit: 1, algorithm: fixed_window, burst: 2 }
  - key: h
    rate_limit: { unit: second, requests_per_unit: 1, algorithm: magic }
  - key: a
  - key: a
    descriptors:
      - key: x
        quota_mode: true
",
        );
        assert_eq!(
            got,
            [
                "domain: empty",
                "descriptors[0].rate_limit.unit: invalid rate limit unit 'fortnight' (second, minute, hour, day, week, month or year)",
                "descriptors[1].key: missing",
                "descriptors[2].rate_limit.unit: should not specify rate limit unit when unlimited",
                "descriptors[3].rate_limit.requests_per_unit: expected a whole number from 0 to 4294967295",
                "descriptors[4].colour: unknown key",
                "descriptors[4].rate_limit.replaces[0]: replaces should not contain the name of its own limit",
                "descriptors[4].rate_limit.replaces[1]: should not have an empty replaces entry",
                "descriptors[5].share_threshold: only a wildcard value (with '*') can share its threshold",
                "descriptors[6].rate_limit.burst: only token_bucket, leaky_bucket and gcra take a burst, not fixed_window",
                "descriptors[7].rate_limit.algorithm: unknown algorithm 'magic' (fixed_window, sliding_window, sliding_log, token_bucket, leaky_bucket or gcra)",
                "descriptors[8]: duplicate descriptor 'a'",
                "descriptors[9].descriptors[0].quota_mode: quota mode is not supported by tollgate",
                "descriptors[9]: duplicate descriptor 'a'",
            ]
        );
    }

    #[test]
    fn files_are_named_in_problems_and_a_domain_is_configured_once() {
        let err = Config::from_files([
            ("a.yaml", "domain: d\n"),
            ("b.yaml", "domain: d\n"),
            ("c.yaml", "domain: [\n"),
        ])
        .unwrap_err();
        let got: Vec<_> = err.problems().iter().map(|p| p.path().to_owned()).collect();
        assert_eq!(got, ["b.yaml: domain", "c.yaml: (file)"]);
        assert_eq!(err.problems()[0].message(), "duplicate domain 'd'");
    }

    #[test]
    fn anchors_and_merge_keys_are_read_as_yaml_means_them() {
        let c = Config::from_yaml(
            "
domain: d
descriptors:
  - key: a
    rate_limit: &common { unit: minute, requests_per_unit: 4 }
  - key: b
    rate_limit:
      <<: *common
      requests_per_unit: 9
",
        )
        .unwrap();
        assert_eq!(rpu(limit(&c, "d", &[("a", "x")])), Some(4));
        let b = limit(&c, "d", &[("b", "x")]).unwrap();
        assert_eq!((b.requests_per_unit, b.unit), (9, Some(Unit::Minute)));
    }

    #[test]
    fn wildcards_match_in_order() {
        let parts = |p: &str| p.split('*').map(str::to_owned).collect::<Vec<_>>();
        assert!(wildcard_match(&parts("value*"), "value"));
        assert!(wildcard_match(&parts("value*"), "valueXYZ"));
        assert!(wildcard_match(
            &parts("/api/*/resource/*/action"),
            "/api/v1/resource/9/action"
        ));
        assert!(!wildcard_match(&parts("a*b*c"), "acb"));
        assert!(!wildcard_match(&parts("ab*ba"), "aba"));
    }

    #[test]
    fn each_limit_knows_its_path_as_envoyproxy_ratelimit_names_its_statistics() {
        let c = Config::from_yaml(
            "
domain: d
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        detailed_metric: true
        rate_limit: { unit: day, requests_per_unit: 2 }
  - key: path
    value: /api/*
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: remote_address
    rate_limit: { unit: second, requests_per_unit: 2 }
",
        )
        .unwrap();
        let path = |entries: &[(&str, &str)]| {
            let l = limit(&c, "d", entries).unwrap();
            (l.path.to_string(), l.detailed_metric)
        };
        assert_eq!(
            path(&[("message_type", "marketing"), ("to_number", "555")]),
            ("message_type_marketing.to_number".to_owned(), true)
        );
        assert_eq!(
            path(&[("path", "/api/v1")]),
            ("path_/api/*".to_owned(), false)
        );
        assert_eq!(
            path(&[("remote_address", "10.0.0.1")]),
            ("remote_address".to_owned(), false)
        );
    }

    #[test]
    fn a_folder_is_read_file_by_file_and_an_empty_or_missing_one_is_a_problem() {
        let dir =
            std::env::temp_dir().join(format!("tollgate-envoy-from-path-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("nested")).unwrap();
        let problem = |path: &Path| {
            Config::from_path(path).unwrap_err().problems()[0]
                .message()
                .to_owned()
        };
        assert!(problem(&dir).contains("no *.yaml or *.yml file"));
        assert!(problem(&dir.join("missing.yaml")).contains("cannot read"));
        std::fs::write(dir.join("a.yaml"), "domain: a\n").unwrap();
        std::fs::write(dir.join("b.yml"), "domain: b\n").unwrap();
        std::fs::write(dir.join("c.txt"), "not: read\n").unwrap();
        std::fs::write(dir.join("nested/d.yaml"), "domain: d\n").unwrap();
        let mut domains: Vec<String> = Config::from_path(&dir)
            .unwrap()
            .domains()
            .map(str::to_owned)
            .collect();
        domains.sort();
        assert_eq!(domains, ["a", "b"]);
        std::fs::write(dir.join("b.yml"), "domain: a\n").unwrap();
        let err = Config::from_path(&dir).unwrap_err();
        assert!(err.problems()[0].path().ends_with("b.yml: domain"), "{err}");
        assert_eq!(
            Config::from_path(dir.join("a.yaml"))
                .unwrap()
                .domains()
                .collect::<Vec<_>>(),
            ["a"]
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
