//! Swapping a running rate-limit layer's configuration.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use super::build::Builder;
use super::schema::Config;
use super::{Bindings, ConfigErrors};
use crate::http::layer::Shared;
use crate::{RateLimitLayer, Store};

/// Swaps the configuration of a running [`RateLimitLayer`] (made by
/// [`Config::reloadable_rate_limit_layer`]); see the [module docs](super#reload) for what a
/// reload keeps. Cloning shares the layer: a signal handler and a file watcher may each hold
/// one. Reloads are serialized: two at once apply one after the other.
pub struct Reloader<St> {
    inner: Arc<Inner<St>>,
}

struct Inner<St> {
    cell: Arc<ArcSwap<Shared<St>>>,
    store: St,
    bindings: Bindings,
    /// The configuration running now (also the lock that serializes reloads).
    current: Mutex<Config>,
}

impl<St> Clone for Reloader<St> {
    fn clone(&self) -> Self {
        Reloader {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<St> fmt::Debug for Reloader<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reloader")
            .field("bindings", &self.inner.bindings)
            .finish_non_exhaustive()
    }
}

/// What a reload changed, by rule name (for the log line that reports it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReloadSummary {
    /// Rules that are new.
    pub added: Vec<String>,
    /// Rules that are gone.
    pub removed: Vec<String>,
    /// Rules whose settings changed (their unchanged policies keep their state).
    pub changed: Vec<String>,
    /// Whether the answers' options changed.
    pub answers_changed: bool,
}

impl ReloadSummary {
    /// Whether the reload changed nothing.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.removed.is_empty()
            && self.changed.is_empty()
            && !self.answers_changed
    }
}

impl fmt::Display for ReloadSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("no change");
        }
        let mut first = true;
        for (what, names) in [
            ("added", &self.added),
            ("removed", &self.removed),
            ("changed", &self.changed),
        ] {
            if !names.is_empty() {
                if !first {
                    f.write_str("; ")?;
                }
                write!(f, "{what}: {}", names.join(", "))?;
                first = false;
            }
        }
        if self.answers_changed {
            if !first {
                f.write_str("; ")?;
            }
            f.write_str("answers changed")?;
        }
        Ok(())
    }
}

impl Config {
    /// The rate-limit layer over `store`, as [`Config::rate_limit_layer`], with a
    /// [`Reloader`] that swaps its configuration while it runs. The store is kept (a reload
    /// builds the new rules over a clone of it, which shares its state).
    pub fn reloadable_rate_limit_layer<St: Store + Clone>(
        &self,
        store: St,
        bindings: Bindings,
    ) -> Result<(RateLimitLayer<St>, Reloader<St>), ConfigErrors> {
        let shared = build_shared(self, store.clone(), &bindings)?;
        let (layer, cell) = RateLimitLayer::live(shared);
        let reloader = Reloader {
            inner: Arc::new(Inner {
                cell,
                store,
                bindings,
                current: Mutex::new(self.clone()),
            }),
        };
        Ok((layer, reloader))
    }
}

/// Runs `f` with a recorder that keeps nothing (feature `metrics`): a configuration checked
/// but not run registers no series.
pub(crate) fn quietly<T>(f: impl FnOnce() -> T) -> T {
    #[cfg(feature = "metrics")]
    {
        metrics::with_local_recorder(&metrics::NoopRecorder, f)
    }
    #[cfg(not(feature = "metrics"))]
    {
        f()
    }
}

fn build_shared<St: Store>(
    config: &Config,
    store: St,
    bindings: &Bindings,
) -> Result<Shared<St>, ConfigErrors> {
    config.check()?;
    let mut builder = Builder::new(config, Some(bindings));
    let layer = builder.rate_limit(store);
    let layer = builder.problems.or(layer)?;
    let Some(layer) = layer else {
        return Err(ConfigErrors::one("rules", "could not be built"));
    };
    layer
        .build_shared()
        .map_err(|e| ConfigErrors::one("rules", e))
}

impl<St: Store + Clone> Reloader<St> {
    /// Checks `config` whole and, if it has no problem, swaps it in at once; otherwise
    /// returns every problem and the running configuration stays.
    ///
    /// A changed `store`, `concurrency` or `shed` section is refused (those are read when the
    /// service starts). State is kept for every (rule, key, policy) that stays as it was.
    pub fn reload(&self, config: Config) -> Result<ReloadSummary, ConfigErrors> {
        let mut current = self.inner.current.lock();
        if config == *current {
            // Nothing to swap: the tier caches stay warm.
            return Ok(ReloadSummary::default());
        }
        let mut refused = Vec::new();
        if config.store != current.store {
            refused.push("store");
        }
        if config.concurrency != current.concurrency
            || keys_changed(&current, &config, concurrency_keys(&current))
        {
            refused.push("concurrency");
        }
        if config.shed != current.shed || keys_changed(&current, &config, shed_keys(&current)) {
            refused.push("shed");
        }
        if !refused.is_empty() {
            // Checked first, so that a refused file registers nothing (no metric series for
            // rules that never ran); its other problems are reported too.
            let mut errors = config.check().err().map_or(Vec::new(), |e| e.0);
            for section in refused {
                errors.push(super::ConfigError::new(
                    section,
                    "changed (or a key it uses changed): this section is read when the \
                     service starts; restart to apply it",
                ));
            }
            return Err(ConfigErrors(errors));
        }
        config.check()?;
        let mut shared = build_shared(&config, self.inner.store.clone(), &self.inner.bindings)?;
        let summary = summarize(&current, &config);
        // Rules left as they were keep their tiers' cached answers.
        let running = self.inner.cell.load();
        shared.limiter.adopt_tier_caches(&running.limiter, |name| {
            current.rules.iter().any(|r| r.name == name)
                && !summary.changed.iter().any(|c| c == name)
        });
        drop(running);
        self.inner.cell.store(Arc::new(shared));
        *current = config;
        Ok(summary)
    }

    /// [`Reloader::reload`] from TOML text.
    pub fn reload_toml(&self, text: &str) -> Result<ReloadSummary, ConfigErrors> {
        self.reload(Config::from_toml(text)?)
    }

    /// [`Reloader::reload`] from a TOML file.
    pub fn reload_file(&self, path: impl AsRef<Path>) -> Result<ReloadSummary, ConfigErrors> {
        self.reload(Config::from_toml_file(path)?)
    }

    /// The configuration running now.
    pub fn current(&self) -> Config {
        self.inner.current.lock().clone()
    }
}

fn summarize(old: &Config, new: &Config) -> ReloadSummary {
    let mut summary = ReloadSummary {
        answers_changed: old.answers != new.answers || old.trace_keys != new.trace_keys,
        ..ReloadSummary::default()
    };
    for rule in &new.rules {
        match old.rules.iter().find(|r| r.name == rule.name) {
            None => summary.added.push(rule.name.clone()),
            Some(before) if before != rule || keys_changed(old, new, rule.key.iter().cloned()) => {
                summary.changed.push(rule.name.clone());
            }
            Some(_) => {}
        }
    }
    for rule in &old.rules {
        if !new.rules.iter().any(|r| r.name == rule.name) {
            summary.removed.push(rule.name.clone());
        }
    }
    summary
}

/// The keys the concurrency rules use, by name.
fn concurrency_keys(config: &Config) -> Vec<String> {
    config
        .concurrency
        .iter()
        .flat_map(|c| c.rules.iter().filter_map(|r| r.key.clone()))
        .collect()
}

/// The key the shedder's fairness uses.
fn shed_keys(config: &Config) -> Vec<String> {
    config
        .shed
        .iter()
        .filter_map(|s| s.fair_by.clone())
        .collect()
}

/// Whether any of the keys `names` (or the keys they combine, at any depth) is defined
/// differently in `new` than in `old`.
fn keys_changed(old: &Config, new: &Config, names: impl IntoIterator<Item = String>) -> bool {
    let mut todo: Vec<String> = names.into_iter().collect();
    let mut seen = std::collections::BTreeSet::new();
    while let Some(name) = todo.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        let (a, b) = (old.keys.get(&name), new.keys.get(&name));
        if a != b {
            return true;
        }
        if let Some(spec) = a {
            todo.extend(spec.of.iter().cloned());
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(added: &[&str], removed: &[&str], changed: &[&str], answers: bool) -> ReloadSummary {
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect();
        ReloadSummary {
            added: names(added),
            removed: names(removed),
            changed: names(changed),
            answers_changed: answers,
        }
    }

    /// The summary logged after a reload: each part only when it has something, in order.
    #[test]
    fn a_summary_says_what_changed() {
        assert!(summary(&[], &[], &[], false).is_empty());
        for (s, text) in [
            (summary(&["a"], &[], &[], false), "added: a"),
            (summary(&[], &["b"], &[], false), "removed: b"),
            (summary(&[], &[], &["c", "d"], false), "changed: c, d"),
            (summary(&[], &[], &[], true), "answers changed"),
            (
                summary(&["a"], &["b"], &["c"], true),
                "added: a; removed: b; changed: c; answers changed",
            ),
            (
                summary(&[], &["b"], &[], true),
                "removed: b; answers changed",
            ),
        ] {
            assert!(!s.is_empty(), "{text}");
            assert_eq!(s.to_string(), text);
        }
        assert_eq!(summary(&[], &[], &[], false).to_string(), "no change");
    }

    #[test]
    fn a_reloader_shows_its_bindings() {
        let (_, reloader) = Config::default()
            .reloadable_rate_limit_layer(crate::MemoryStore::new(), Bindings::new())
            .unwrap();
        let shown = format!("{reloader:?}");
        assert!(
            shown.starts_with("Reloader { bindings: Bindings"),
            "{shown}"
        );
    }
}
