//! The configuration file: the store, the keys, the rules, the answers and the overload
//! layers in one file (TOML, or any serde format), validated in full before anything runs,
//! and reloaded while the service runs.
//!
//! ```
//! use tollgate::config::{Bindings, Config};
//! use tollgate::MemoryStore;
//!
//! let config = Config::from_toml(r#"
//!     [keys.client]
//!     kind = "forwarded"               # the client's address, as the load balancer reports it
//!     trusted = ["10.0.0.0/8"]
//!
//!     [[rules]]
//!     name = "per-client"
//!     key = "client"
//!     policies = [{ algorithm = "gcra", rate = "10/s", burst = 20 }]
//!
//!     [[rules]]
//!     name = "login"
//!     methods = ["POST"]
//!     path = "/login"
//!     key = "client"
//!     policies = [{ algorithm = "sliding_log", rate = "5 per 15m" }]
//! "#)?;
//! let layer = config.rate_limit_layer(MemoryStore::new(), &Bindings::new())?;
//! assert_eq!(layer.limiter().rule_names().collect::<Vec<_>>(), ["per-client", "login"]);
//! # Ok::<(), tollgate::config::ConfigErrors>(())
//! ```
//!
//! # The file
//!
//! Every section is optional; what a file leaves out keeps its default. This file sets every
//! option there is (a test keeps it so); the lines commented out are options that cannot be
//! set together with the ones above them.
//!
//! ```toml
//! trace_keys = "hashed"             # keys in the DEBUG decision span: "none" (default), "hashed", "plain"
//!
//! [store]
//! kind = "redis"                    # "memory" (the default) or "redis" (feature `redis`)
//! name = "shared"                   # the `store` label of its metrics
//! url = "redis://127.0.0.1:6379"    # rediss:// for TLS
//! # cluster = ["10.0.0.1:6379", "10.0.0.2:6379"]   # Redis Cluster's seed nodes, instead of url
//! prefix = "rl:"                    # of every key name in Redis
//! pool_size = 4                     # connections
//! timeout = "50ms"                  # a slower answer is a failure
//! on_failure = "local"              # "closed" (503, the default), "open" or "local"
//! instances = 4                     # "local" divides each limit among this many instances
//! breaker = { failures = 5, open_for = "2s" }      # stop waiting on a dead Redis
//! deny_cache = 10000                # refused keys answered in process until their reset (0: off)
//! max_cross_slot_calls = 4096       # Cluster: stacks across masters in flight at once, past it refused
//! max_key_len = 256                 # longer keys are hashed (both kinds)
//! # max_keys = 100000               # kind = "memory" only: the (key, policy) pairs kept
//! # shards = 64                     # kind = "memory" only: a power of two
//!
//! [keys.client]                     # a named key extractor, for rules to use
//! kind = "forwarded"                # global, peer_ip, forwarded, header, any_of, all_of, custom
//! trusted = ["10.0.0.0/8", "fd00::/8"]             # the proxies believed
//! rfc7239 = false                   # true reads `Forwarded` instead of `X-Forwarded-For`
//! ipv4_prefix = 32                  # peer_ip, forwarded: one key per address (24: per /24)
//! ipv6_prefix = 64                  # one key per /64 (the default)
//!
//! [keys.api_key]
//! kind = "header"
//! header = "x-api-key"
//!
//! [keys.caller]
//! kind = "any_of"                   # the API key, else the client's address (all_of: both)
//! of = ["api_key", "client"]
//!
//! [keys.tenant]
//! kind = "custom"                   # found in code: Bindings::key
//! binding = "tenant"
//!
//! [answers]
//! headers = "ietf"                  # "ietf" (the default), "legacy", "both" or "off"
//! legacy_reset = "delta_seconds"    # legacy X-RateLimit-Reset: or "unix_seconds"
//! unavailable_retry_after = "2s"    # the Retry-After of a 503 when the store fails
//! decision_extension = false        # true: an admitted request's decision in its extensions
//!
//! [[rules]]
//! name = "search"
//! methods = ["GET"]                 # GET covers HEAD too...
//! exact_methods = false             # ...unless the methods are to be taken exactly
//! path_prefix = "/search"           # by whole segments; or path, or route (below)
//! key = "caller"                    # a name from [keys], or "global" (the default), "peer_ip"
//! cost = 5                          # units per request (1 unless set)
//! on_missing_key = "skip"           # or a status: 401 (500 unless set)
//! shadow = false                    # true: decide and report, never refuse
//! policies = [
//!   { algorithm = "token_bucket", rate = "100/minute", burst = 50 },
//!   { algorithm = "fixed_window", limit = 10000, window = "1d", name = "daily" },
//! ]
//!
//! [[rules]]
//! name = "login"
//! methods = ["POST"]
//! path = "/login"                   # this exact path
//! key = "client"
//! policies = [{ algorithm = "sliding_log", rate = "5 per 15m" }]
//!
//! [[rules]]
//! name = "documents"
//! route = "/documents/{id}"         # an axum route template (feature `axum`)
//! key = "tenant"
//! policies = [
//!   { algorithm = "sliding_window", limit = 600, window = "1m" },
//!   { algorithm = "leaky_bucket", rate = "20/s", burst = 40 },
//! ]
//!
//! [[rules]]
//! name = "plan"
//! key = "api_key"
//! on_missing_key = 401
//! [rules.tiers]                     # policies by the key's tier, instead of `policies`
//! resolver = "plans"                # registered in code: Bindings::resolver
//! keys = { "k-internal" = "pro" }   # or listed here, as requests carry them (asked first)
//! default = "free"                  # for keys placed nowhere (the first plan unless set)
//! cache_for = "5m"                  # how long an answer is remembered
//! cache_capacity = 100000           # how many keys' answers
//! timeout = "1s"                    # a slower resolver: the default tier, this request only
//! plans = [
//!   { name = "free", policies = [{ algorithm = "gcra", rate = "60/minute", burst = 10 }] },
//!   { name = "pro", policies = [{ algorithm = "gcra", rate = "600/minute", burst = 100 }] },
//! ]
//!
//! [concurrency]
//! name = "in-flight"                # the `layer` label of its metrics
//! total = 512                       # in flight in all (503 past it)
//! queue = { max_waiting = 64, max_wait = "100ms" } # a bounded wait for a place
//! distributed = true                # places counted on the Redis store, across instances
//! lease_time = "30s"                # a place not renewed for this long is freed
//! on_store_error = "local"          # Redis failing: "local" (the default), "open" or "closed"
//! rules = [                         # matched and keyed as rate-limit rules are
//!   { name = "exports", methods = ["GET"], path_prefix = "/export", key = "api_key", on_missing_key = "skip", max_in_flight = 2 },
//!   { name = "uploads", path = "/upload", key = "tenant", max_in_flight = 4 },
//!   { name = "reports", route = "/reports/{id}", max_in_flight = 8 },
//! ]
//!
//! [shed]
//! name = "front"                    # the `layer` label of its metrics
//! limit = "vegas"                   # "fixed", "vegas" (adaptive, the usual choice) or "aimd"
//! initial = 100                     # fixed: the limit; adaptive: where it starts
//! min = 10                          # adaptive: the bounds (1 and 1000 unless set)
//! max = 1000
//! # latency = "250ms"               # limit = "aimd" only: the latency above which it shrinks
//! class_header = "x-criticality"    # critical_plus, critical, sheddable_plus, sheddable
//! shares = { sheddable = 0.6, sheddable_plus = 0.75 }   # each class shed from this share of capacity
//! fair_by = "tenant"                # fair shares among the tenants of this key...
//! fair_from = 0.8                   # ...from this share of capacity
//! fair_cap = 0.5                    # no tenant holds more than this share, whatever the load
//! queue = { max_waiting = 100, max_wait = "50ms" }
//! deadline_header = "grpc-timeout"  # clients' declared timeouts, never waited past (with a queue)
//! ```
//!
//! Durations are written with units and may be summed: `"500ms"`, `"15m"`, `"1h30m"`,
//! `"1 day"` ([`HumanDuration`]). Rates are a count per span: `"100/minute"`, `"10/s"`,
//! `"5 per 15m"` ([`HumanRate`]). A window policy takes `limit` and `window`, or a `rate`
//! that says both; a bucket takes a `rate` and a `burst` (the rate's count unless set).
//!
//! # Errors
//!
//! A file is checked whole before anything is built, and every problem is reported at once,
//! each with the path of its field: `rules[2].policies[0].window: must be above zero`,
//! `keys.client.trusted[1]: not a network: "10.0.0.0/33"`, `rules[0].polices: unknown field`.
//! Unknown fields are errors everywhere (a misspelt option never silently does nothing). A
//! file that is not TOML at all reports its syntax error with the line.
//!
//! A text is at most [`MAX_FILE_LEN`] bytes (1 MiB) and nests at most [`MAX_NESTING`] levels
//! (32): tables, the parts of dotted keys (a table header's parts count twice, each may be an
//! array of tables and its element), inline tables and arrays, all counted together. A
//! deeper text is refused, with the line at which it goes too deep, by a scan that reads
//! strings and comments as such, before the text is parsed: parsing, and every step after
//! it, recurses once per level, and toml's own bounds count inline tables and dotted keys
//! apart, so that a few kilobytes of text could nest thousands of levels and overflow the
//! stack of the thread reading it.
//!
//! The check has two phases, and the report lists the problems of the first, then those of
//! the second:
//!
//! 1. **Reading**: every unknown field and every value of the wrong type (each is set aside
//!    and the rest of its rule, key or section read again, so one does not hide the next).
//! 2. **Values**: what was read is checked whole (limits, names, networks, routes, keys named
//!    but not declared, the overload layers' bounds). After reading problems, this still runs
//!    on the rest of the file, but leaves out the parts a value set aside could have changed,
//!    whose problems would only echo it: the rule (`rules[1]`), the key (`keys.client`) or the
//!    section (`[shed]`, `[answers]`, ...) that held it. A reading problem in `[store]` also
//!    leaves out the rules and `[concurrency]` (the store decides what runs on Redis), and
//!    one that sets aside a whole key, or `[keys]`, leaves out every value check (keys are
//!    named from every section). Those parts are checked once their reading problem is fixed.
//!
//! # From code, and back
//!
//! [`Config`] is plain data with public fields: build one in code and [`Config::to_toml`]
//! writes the file that [`Config::from_toml`] reads back to the same value; the layers built
//! from either are the same. What a file cannot say (a key found by an authentication layer,
//! a tier resolver that asks a database, a custom answer) is given in code, by name, through
//! [`Bindings`], and the file refers to it.
//!
//! # Reload
//!
//! [`Config::reloadable_rate_limit_layer`] returns the layer and a [`Reloader`]. A reload
//! builds and checks the new configuration whole, then swaps it in with one atomic store: a
//! request sees either the old configuration or the new one, never a mix, and requests in
//! flight finish on the one they started with. A configuration with any error is refused with
//! its errors and the old one keeps running.
//!
//! State lives in the store, by key, rule and policy, so a reload keeps what every client has
//! consumed under every (rule, policy) pair it leaves as it was. A policy whose algorithm,
//! limit, window, rate or name changes is new state, and starts fresh: its clients get its
//! whole allowance once (a tightened limit is not charged with what was consumed under the old
//! one). Renaming a rule starts its state fresh too. Rules left as they were keep their
//! tiers' cached answers, so a reload asks no resolver again for them, and a file that
//! changed nothing swaps nothing. The `store`, `concurrency` and `shed` sections (and the keys
//! those two use) are read when the service starts: a reload that changes them is refused
//! (restart to apply them), so what runs is always what the file says.

mod build;
mod depth;
mod human;
mod reload;
mod schema;
mod store;

use std::fmt;
use std::path::Path;

pub use build::Bindings;
pub use depth::MAX_NESTING;
pub use human::{HumanDuration, HumanError, HumanRate};
pub use reload::{ReloadSummary, Reloader};
pub use schema::{
    AlgorithmConfig, AnswersConfig, BreakerConfig, ConcurrencyConfig, ConcurrencyRuleConfig,
    Config, FailureConfig, HeadersConfig, KeyConfig, KeyKind, KeyTraceConfig, MissingKeyConfig,
    PlanConfig, PolicyConfig, QueueConfig, ResetConfig, RuleConfig, ShedConfig, ShedLimitKind,
    Skip, StoreConfig, StoreKind, TiersConfig,
};
pub(crate) use store::ConfiguredFuture;
pub use store::ConfiguredStore;

/// The most problems one report lists (the rest are counted).
const MAX_REPORTED: usize = 100;

/// The longest configuration read (1 MiB): far more than any set of limits needs, and a bound
/// on what checking a file costs.
pub const MAX_FILE_LEN: usize = 1 << 20;

/// One problem of a configuration: where, and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    path: String,
    message: String,
}

impl ConfigError {
    pub(crate) fn new(path: impl Into<String>, message: impl fmt::Display) -> Self {
        ConfigError {
            path: path.into(),
            message: message.to_string(),
        }
    }

    /// The field's path (`rules[2].policies[0].window`; empty for the file as a whole).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// What is wrong with it.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Every problem found in a configuration (at least one), one per line when displayed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigErrors(Vec<ConfigError>);

impl ConfigErrors {
    pub(crate) fn one(path: impl Into<String>, message: impl fmt::Display) -> Self {
        ConfigErrors(vec![ConfigError::new(path, message)])
    }

    /// The problems: those of reading first, then those of the values, section by section.
    pub fn errors(&self) -> &[ConfigError] {
        &self.0
    }

    /// The paths of the problems (handy in tests).
    pub fn paths(&self) -> Vec<&str> {
        self.0.iter().map(ConfigError::path).collect()
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Problems found so far, with their paths.
#[derive(Debug, Default)]
pub(crate) struct Problems(Vec<ConfigError>);

impl Problems {
    pub(crate) fn add(&mut self, path: impl Into<String>, message: impl fmt::Display) {
        if self.0.len() < MAX_REPORTED {
            self.0.push(ConfigError::new(path, message));
        }
    }

    fn push(&mut self, error: ConfigError) {
        if self.0.len() < MAX_REPORTED {
            self.0.push(error);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `Ok(value)` if nothing was found.
    pub(crate) fn or<T>(self, value: T) -> Result<T, ConfigErrors> {
        if self.0.is_empty() {
            Ok(value)
        } else {
            Err(ConfigErrors(self.0))
        }
    }
}

impl Config {
    /// Reads a TOML configuration, reporting every problem with its field's path.
    ///
    /// Type errors and unknown fields are all reported (each field in error is set aside and
    /// the rest of its part read again, up to 100 problems: a file with a problem is read
    /// part by part, each rule, each key and each other section on its own, so that a problem
    /// costs a reading of its part, not of the whole file); the values are then checked (see
    /// [`Config::validate`]), those of the parts of the file that the fields set aside could
    /// have changed excepted (see the [module docs](crate::config#errors)).
    pub fn from_toml(text: &str) -> Result<Config, ConfigErrors> {
        if text.len() > MAX_FILE_LEN {
            return Err(ConfigErrors::one(
                "",
                format!(
                    "{} bytes: a configuration is at most {MAX_FILE_LEN}",
                    text.len()
                ),
            ));
        }
        // Before anything recurses on it (toml's parser, the clone and the reading below).
        if let Some(line) = depth::too_deep(text) {
            return Err(ConfigErrors::one(
                "",
                format!(
                    "line {line}: nests more than {MAX_NESTING} levels deep (tables, dotted \
                     keys, inline tables and arrays together); a configuration needs about 8"
                ),
            ));
        }
        let table: toml::Table = toml::from_str(text)
            .map_err(|e| ConfigErrors::one("", format!("not TOML: {}", e.to_string().trim())))?;
        // Read whole, as most files are; a file with a problem is read again part by part.
        if let Ok(config) =
            <Config as serde::Deserialize>::deserialize(toml::Value::Table(table.clone()))
        {
            #[cfg(test)]
            READS.with(|r| r.set(r.get() + 1));
            config.check()?;
            return Ok(config);
        }
        let mut reading = Reading::default();
        let mut config = Config::default();
        // Part by part (each rule, each key, each other section), in the file's key order: a
        // problem re-reads only its part, never the whole file.
        for (name, value) in table {
            let read = match (name.as_str(), value) {
                ("rules", toml::Value::Array(items)) => {
                    let mut rules = Vec::with_capacity(items.len());
                    let mut whole = true;
                    for (i, item) in items.into_iter().enumerate() {
                        match reading.part::<RuleConfig>(item, &format!("rules[{i}]")) {
                            Part::Read(rule) => rules.push(rule),
                            // A rule that cannot be read at all sets every rule aside, as
                            // reading them together would (their indices would move).
                            Part::Unreadable => whole = false,
                            Part::Stop => return Err(ConfigErrors(reading.problems.0)),
                        }
                    }
                    if whole {
                        config.rules = rules;
                    } else {
                        reading.set_aside(&[Step::Key("rules")], "rules");
                    }
                    true
                }
                ("keys", toml::Value::Table(entries)) => {
                    for (key, entry) in entries {
                        let path = format!("keys.{key}");
                        match reading.part::<KeyConfig>(entry, &path) {
                            Part::Read(spec) => {
                                config.keys.insert(key, spec);
                            }
                            Part::Unreadable => {
                                reading.set_aside(&[Step::Key("keys"), Step::Key(&key)], &path)
                            }
                            Part::Stop => return Err(ConfigErrors(reading.problems.0)),
                        }
                    }
                    true
                }
                (_, value) => {
                    let mut section = toml::Table::new();
                    section.insert(name.clone(), value);
                    match reading.part::<Config>(toml::Value::Table(section), "") {
                        Part::Read(part) => {
                            config.take_section(&name, part);
                            true
                        }
                        Part::Unreadable | Part::Stop => false,
                    }
                }
            };
            if !read || reading.stopped() {
                return Err(ConfigErrors(reading.problems.0));
            }
        }
        let Reading {
            mut problems,
            set_aside,
            ..
        } = reading;
        if problems.is_empty() {
            config.check()?;
            return Ok(config);
        }
        // The rest of the file, read with the bad values set aside, has its values checked
        // too; the problems of the parts a value set aside could have changed are left out
        // (they could be its echo: a rule whose misspelt `polices` was set aside has no
        // policies).
        if let Err(values) = config.check() {
            for error in values.0 {
                if !set_aside.touches(&error.path) {
                    problems.push(error);
                }
            }
        }
        Err(ConfigErrors(problems.0))
    }

    /// Reads a TOML configuration file ([`Config::from_toml`]).
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Config, ConfigErrors> {
        use std::io::Read;
        let path = path.as_ref();
        let unreadable =
            |e: std::io::Error| ConfigErrors::one("", format!("{}: {e}", path.display()));
        let mut text = String::new();
        std::fs::File::open(path)
            .map_err(unreadable)?
            // One byte more than the bound, so that a longer file is seen as such.
            .take(MAX_FILE_LEN as u64 + 1)
            .read_to_string(&mut text)
            .map_err(unreadable)?;
        Config::from_toml(&text)
    }

    /// Reads a configuration in any serde format: the first type error or unknown field
    /// stops the reading (with its path); the values are then checked in full.
    pub fn from_deserializer<'de, D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Config, ConfigErrors> {
        let config: Config = serde_path_to_error::deserialize(deserializer).map_err(|e| {
            let path = e.path().to_string();
            let path = if path == "." { String::new() } else { path };
            ConfigErrors::one(path, e.into_inner())
        })?;
        config.check()?;
        Ok(config)
    }

    /// The configuration as TOML, which [`Config::from_toml`] reads back to the same value.
    pub fn to_toml(&self) -> Result<String, ConfigErrors> {
        toml::to_string(self).map_err(|e| ConfigErrors::one("", e))
    }

    /// Checks every value that needs no code bindings: policies, names, routes, keys,
    /// networks, the overload layers. Building checks the rest (the bindings a file names).
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        self.check()
    }
}

impl Config {
    /// Takes the section `name` of `part` (a configuration read from that section alone).
    fn take_section(&mut self, name: &str, part: Config) {
        match name {
            "store" => self.store = part.store,
            "answers" => self.answers = part.answers,
            "trace_keys" => self.trace_keys = part.trace_keys,
            "concurrency" => self.concurrency = part.concurrency,
            "shed" => self.shed = part.shed,
            "keys" => self.keys = part.keys,
            "rules" => self.rules = part.rules,
            // An unknown section: reported and set aside while it was read.
            _ => {}
        }
    }
}

/// How a part of a file was read.
enum Part<T> {
    /// Read, with the values in error set aside.
    Read(T),
    /// Not readable at all, even with its values set aside.
    Unreadable,
    /// Too many problems: reading stops.
    Stop,
}

/// What reading a file has found: the problems, and what was set aside to read the rest.
#[derive(Default)]
struct Reading {
    problems: Problems,
    /// How often each path failed: a value set aside may leave its parent failing at the
    /// same path (an array item needs fields); then the parent is set aside.
    failed: std::collections::HashMap<String, usize>,
    set_aside: SetAside,
    /// The paths set aside.
    removed: Vec<String>,
}

#[cfg(test)]
thread_local! {
    /// How many times a part of a file was read, on this thread (for the test that bounds it).
    static READS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Reading {
    /// Whether reading stops: too many problems, or too many paths failing.
    fn stopped(&self) -> bool {
        self.problems.0.len() >= MAX_REPORTED || self.failed.len() > 2 * MAX_REPORTED
    }

    /// Notes that the value at `steps` (`path`) was set aside.
    fn set_aside(&mut self, steps: &[Step<'_>], path: &str) {
        self.set_aside.note(steps);
        self.removed.push(path.to_owned());
    }

    /// Reads `value`, the part of the file at `prefix` (`rules[2]`; empty for the whole
    /// file), as a `T`: every unknown field and every value of the wrong type is reported
    /// with its path, and set aside so that the rest is read again (only this part).
    fn part<T: serde::de::DeserializeOwned>(
        &mut self,
        mut value: toml::Value,
        prefix: &str,
    ) -> Part<T> {
        let full = |path: &str| match (prefix.is_empty(), path.is_empty()) {
            (true, _) => path.to_owned(),
            (false, true) => prefix.to_owned(),
            (false, false) => format!("{prefix}.{path}"),
        };
        loop {
            #[cfg(test)]
            READS.with(|r| r.set(r.get() + 1));
            let error = match serde_path_to_error::deserialize::<_, T>(value.clone()) {
                Ok(read) => return Part::Read(read),
                Err(e) => e,
            };
            let path = error.path().to_string();
            let path = if path == "." { String::new() } else { path };
            let message = error.into_inner().to_string();
            // The path is given already; TOML's own suffix repeats it.
            let message = message.split("\nin `").next().unwrap_or_default();
            let path = full(&path);
            // A required field set aside leaves its parent missing it: an echo.
            let echo = message
                .strip_prefix("missing field `")
                .and_then(|rest| rest.split('`').next())
                .is_some_and(|field| {
                    let field = if path.is_empty() {
                        field.to_owned()
                    } else {
                        format!("{path}.{field}")
                    };
                    self.removed.contains(&field)
                });
            let times = self.failed.entry(path.clone()).or_insert(0);
            *times += 1;
            let times = *times;
            if times == 1 && !echo {
                self.problems.add(path.clone(), message.trim());
            }
            let aside = ancestor(&path, times - 1).to_owned();
            // Set the field aside and read the rest, so that every problem shows; stop when
            // nothing can be set aside.
            if self.stopped() {
                return Part::Stop;
            }
            // An item of a list (`rules[2]`) that fails as a whole is read again as an empty
            // table, which keeps the indices of the items after it.
            if !prefix.is_empty() && aside == prefix && prefix.ends_with(']') && times == 1 {
                value = toml::Value::Table(toml::Table::new());
                self.set_aside.note(&split_path(prefix));
                self.removed.push(aside);
                continue;
            }
            // What to set aside, within this part.
            let within = if prefix.is_empty() {
                Some(aside.as_str())
            } else {
                aside
                    .strip_prefix(prefix)
                    .and_then(|rest| rest.strip_prefix('.'))
                    .filter(|rest| !rest.is_empty())
            };
            let Some(within) = within else {
                return Part::Unreadable;
            };
            let toml::Value::Table(table) = &mut value else {
                return Part::Unreadable;
            };
            match remove_at(table, within) {
                Some(steps) => {
                    // The steps from the file's root, for what the set-aside touches.
                    let full_steps = format!(
                        "{}{}{}",
                        prefix,
                        if prefix.is_empty() { "" } else { "." },
                        steps_path(&steps)
                    );
                    self.set_aside.note(&split_path(&full_steps));
                    self.removed.push(aside);
                }
                None if prefix.is_empty() => return Part::Stop,
                None => return Part::Unreadable,
            }
        }
    }
}

/// The path that `steps` spell (`rules[2].window`).
fn steps_path(steps: &[Step<'_>]) -> String {
    let mut path = String::new();
    for step in steps {
        match step {
            Step::Key(key) => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
            }
            Step::Index(i) => {
                let _ = std::fmt::Write::write_fmt(&mut path, format_args!("[{i}]"));
            }
        }
    }
    path
}

/// Removes the value at `path` (`rules[2].policies[0].window`) from `table`, or its
/// innermost existing parent's entry; the steps that lead to what was removed, if anything
/// was.
fn remove_at<'p>(table: &mut toml::Table, path: &'p str) -> Option<Vec<Step<'p>>> {
    let mut steps = split_path(path);
    let removed = remove_steps(table, &steps)?;
    steps.truncate(removed);
    Some(steps)
}

/// `path` less its last `up` steps (`a[1].b` up 1 is `a[1]`, up 2 is `a`).
fn ancestor(path: &str, up: usize) -> &str {
    let mut path = path;
    for _ in 0..up {
        let cut = if path.ends_with(']') {
            path.rfind('[')
        } else {
            path.rfind(['.', '['])
        };
        path = &path[..cut.unwrap_or(0)];
    }
    path
}

#[derive(Debug, PartialEq)]
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

fn split_path(path: &str) -> Vec<Step<'_>> {
    let mut steps = Vec::new();
    for part in path.split('.') {
        let (name, mut rest) = match part.find('[') {
            Some(at) => (&part[..at], &part[at..]),
            None => (part, ""),
        };
        if !name.is_empty() {
            steps.push(Step::Key(name));
        }
        // `[3]` steps; anything else (a key spelt with brackets) ends the walk.
        while let Some(inner) = rest.strip_prefix('[') {
            let Some(end) = inner.find(']') else {
                return steps;
            };
            match inner[..end].parse() {
                Ok(i) => steps.push(Step::Index(i)),
                Err(_) => return steps,
            }
            rest = &inner[end + 1..];
        }
        if !rest.is_empty() {
            return steps;
        }
    }
    steps
}

/// Removes what `steps` lead to in `table` (or the entry in which they stop leading
/// anywhere); how many of the steps lead to what was removed.
fn remove_steps(table: &mut toml::Table, steps: &[Step<'_>]) -> Option<usize> {
    let (Step::Key(first), rest) = steps.split_first()? else {
        return None;
    };
    if rest.is_empty() {
        return table.remove(*first).map(|_| 1);
    }
    let child = table.get_mut(*first)?;
    if let Some(removed) = remove_in(child, rest) {
        return Some(removed + 1);
    }
    // The path ends inside a value that cannot be walked: drop the whole entry.
    table.remove(*first).map(|_| 1)
}

fn remove_in(value: &mut toml::Value, steps: &[Step<'_>]) -> Option<usize> {
    match (value, steps.split_first()) {
        (toml::Value::Table(table), Some((Step::Key(_), _))) => remove_steps(table, steps),
        (toml::Value::Array(items), Some((Step::Index(i), rest))) => {
            let item = items.get_mut(*i)?;
            if rest.is_empty() {
                // Keep the indices of the items after it (their paths stay right).
                *item = toml::Value::Table(toml::Table::new());
                return Some(1);
            }
            remove_in(item, rest).map(|removed| removed + 1)
        }
        _ => None,
    }
}

/// What the values set aside while reading could have changed: the parts of the file whose
/// value problems are then not reported, since they may only echo the reading problem.
#[derive(Debug, Default)]
struct SetAside {
    /// Every part: a whole key or `[keys]` went (keys are named from every section).
    all: bool,
    /// The paths under which nothing is reported.
    parts: Vec<String>,
}

impl SetAside {
    /// Notes that the value `removed` leads to was set aside.
    fn note(&mut self, removed: &[Step<'_>]) {
        match removed {
            [Step::Key("keys"), Step::Key(name), _, ..] => self.parts.push(format!("keys.{name}")),
            [Step::Key("rules"), Step::Index(i), ..] => self.parts.push(format!("rules[{i}]")),
            // The store's kind and timeout shape the checks of the rules' policies (what
            // Redis can run) and of a distributed concurrency limit.
            [Step::Key("store"), ..] => {
                self.parts
                    .extend(["store", "rules", "concurrency"].map(String::from));
            }
            [Step::Key("keys"), ..] | [Step::Index(_), ..] | [] => self.all = true,
            [Step::Key(section), ..] => self.parts.push((*section).to_owned()),
        }
    }

    /// Whether a value problem at `path` may come from what was set aside.
    fn touches(&self, path: &str) -> bool {
        self.all
            || self.parts.iter().any(|part| {
                path.strip_prefix(part.as_str())
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each problem re-reads its own part, never the whole file: a file of 2,000 rules with a
    /// problem in each of 100 of them reads about 2,100 rules, not 200,000 (reading the whole
    /// file again after each problem took 1.77 s for 1 MiB with 100 problems).
    #[test]
    fn problems_reread_only_their_part() {
        let rule = |i: usize, bad: bool| {
            format!(
                "[[rules]]\nname = \"r{i}\"\n{}policies = [{{ algorithm = \"gcra\", rate = \"1/s\" }}]\n",
                if bad { "polices = 1\n" } else { "" }
            )
        };
        let text: String = (0..2_000).map(|i| rule(i, i % 20 == 0)).collect();
        READS.with(|r| r.set(0));
        let errors = Config::from_toml(&text).unwrap_err();
        let reads = READS.with(|r| r.get());
        assert_eq!(errors.errors().len(), 100);
        assert_eq!(errors.paths()[0], "rules[0].polices");
        assert!(reads <= 2_000 + 2 * 100, "{reads} parts read");
        // A clean file: read once, whole.
        let clean: String = (0..2_000).map(|i| rule(i, false)).collect();
        READS.with(|r| r.set(0));
        assert!(Config::from_toml(&clean).is_ok());
        assert_eq!(READS.with(|r| r.get()), 1);
    }

    #[test]
    fn ancestors() {
        assert_eq!(ancestor("a[1].b", 0), "a[1].b");
        assert_eq!(ancestor("a[1].b", 1), "a[1]");
        assert_eq!(ancestor("a[1].b", 2), "a");
        assert_eq!(ancestor("a[1].b", 3), "");
        assert_eq!(ancestor("a", 5), "");
    }

    #[test]
    fn paths_split() {
        assert_eq!(
            split_path("rules[2].policies[0].window"),
            [
                Step::Key("rules"),
                Step::Index(2),
                Step::Key("policies"),
                Step::Index(0),
                Step::Key("window")
            ]
        );
        assert_eq!(split_path("store"), [Step::Key("store")]);
        assert!(split_path("").is_empty());
        // Key names with brackets: no panic, the walk stops where it cannot follow.
        for odd in [
            "keys.x[0]]",
            "a]",
            "a[",
            "a[x]",
            "a[0]b",
            "]]",
            "[[0]",
            "a[99999999999999999999]",
        ] {
            let _ = split_path(odd);
        }
        assert_eq!(
            split_path("keys.x[0]]"),
            [Step::Key("keys"), Step::Key("x"), Step::Index(0)]
        );
    }
}
