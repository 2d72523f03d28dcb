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
        let mut refused = Vec::new();
        if config.store != current.store {
            refused.push("store");
        }
        if config.concurrency != current.concurrency {
            refused.push("concurrency");
        }
        if config.shed != current.shed {
            refused.push("shed");
        }
        let built = build_shared(&config, self.inner.store.clone(), &self.inner.bindings);
        let mut errors = match built {
            Ok(shared) if refused.is_empty() => {
                let summary = summarize(&current, &config);
                self.inner.cell.store(Arc::new(shared));
                *current = config;
                return Ok(summary);
            }
            Ok(_) => Vec::new(),
            Err(errors) => errors.0,
        };
        for section in refused {
            errors.push(super::ConfigError::new(
                section,
                "changed: this section is read when the service starts; restart to apply it",
            ));
        }
        Err(ConfigErrors(errors))
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
        answers_changed: old.answers != new.answers,
        ..ReloadSummary::default()
    };
    for rule in &new.rules {
        match old.rules.iter().find(|r| r.name == rule.name) {
            None => summary.added.push(rule.name.clone()),
            Some(before) if before != rule || keys_changed(old, new, rule.key.as_deref()) => {
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

/// Whether the key a rule names is defined differently (by name; combined keys shallowly).
fn keys_changed(old: &Config, new: &Config, key: Option<&str>) -> bool {
    let Some(key) = key else { return false };
    let (a, b) = (old.keys.get(key), new.keys.get(key));
    a != b
        || a.is_some_and(|spec| {
            spec.of
                .iter()
                .any(|part| old.keys.get(part) != new.keys.get(part))
        })
}
