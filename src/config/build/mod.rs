//! From a [`Config`] to layers: every value checked, every problem reported with its path.

mod bindings;
mod concurrency;
mod keys;
mod policy;
mod rules;
mod shed;
mod store;

pub use bindings::Bindings;
#[cfg(feature = "redis")]
pub(crate) use store::{failure_policy, node_of};

use std::collections::{BTreeMap, BTreeSet};

use self::bindings::SharedKey;
use super::schema::*;
// Named by concurrency.rs as `super::HumanDuration`.
#[cfg(feature = "redis")]
use super::HumanDuration;
use super::{ConfigErrors, Problems};
use crate::answer::{HeaderProfile, ResetFormat};
use crate::{
    ConcurrencyLimitLayer, LoadShedLayer, RateLimitLayer, Store, http::RateLimitLayerBuilder,
};

/// Builds the parts of a configuration, noting every problem. Without bindings (a check of
/// the file alone) names of bindings are not looked up.
pub(crate) struct Builder<'a> {
    config: &'a Config,
    bindings: Option<&'a Bindings>,
    pub(crate) problems: Problems,
    keys: BTreeMap<&'a str, Option<SharedKey>>,
    /// The Redis store a distributed concurrency limit counts on.
    #[cfg(feature = "redis")]
    redis: Option<crate::RedisStore>,
}

impl<'a> Builder<'a> {
    pub(crate) fn new(config: &'a Config, bindings: Option<&'a Bindings>) -> Self {
        let mut builder = Builder {
            config,
            bindings,
            problems: Problems::default(),
            keys: BTreeMap::new(),
            #[cfg(feature = "redis")]
            redis: None,
        };
        for name in config.keys.keys() {
            let key = builder.named_key(name, 0);
            builder.keys.insert(name, key);
        }
        builder
    }

    /// The rate-limit layer's builder over `store`, or `None` after a problem.
    pub(crate) fn rate_limit<St: Store>(&mut self, store: St) -> Option<RateLimitLayerBuilder<St>> {
        let config = self.config;
        let answers = &config.answers;
        let mut builder = RateLimitLayer::builder(store)
            .headers(match answers.headers {
                HeadersConfig::Ietf => HeaderProfile::Ietf,
                HeadersConfig::Legacy => HeaderProfile::Legacy,
                HeadersConfig::Both => HeaderProfile::Both,
                HeadersConfig::Off => HeaderProfile::Off,
            })
            .decision_extension(answers.decision_extension);
        if let Some(reset) = answers.legacy_reset {
            builder = builder.legacy_reset(match reset {
                ResetConfig::DeltaSeconds => ResetFormat::DeltaSeconds,
                ResetConfig::UnixSeconds => ResetFormat::UnixSeconds,
            });
        }
        if let Some(after) = answers.unavailable_retry_after {
            builder = builder.unavailable_retry_after(after.get());
        }
        if let Some(trace) = config.trace_keys {
            builder = builder.trace_keys(match trace {
                KeyTraceConfig::None => crate::telemetry::KeyTrace::None,
                KeyTraceConfig::Hashed => crate::telemetry::KeyTrace::Hashed,
                KeyTraceConfig::Plain => crate::telemetry::KeyTrace::Plain,
            });
        }
        if let Some(responder) = self.bindings.and_then(|b| b.responder.clone()) {
            builder = builder.shared_responder(responder);
        }
        let mut names = BTreeSet::new();
        let mut ok = true;
        for (i, spec) in config.rules.iter().enumerate() {
            if !spec.name.is_empty() && !names.insert(spec.name.as_str()) {
                self.problems.add(
                    format!("rules[{i}].name"),
                    format!("two rules are named {:?}", spec.name),
                );
            }
            match self.rule(i, spec) {
                Some(rule) => builder = builder.rule(rule),
                None => ok = false,
            }
        }
        (ok && self.problems.is_empty()).then_some(builder)
    }
}

/// A metric label's value: a name, not free text.
fn label_ok(name: &str, path: &str, p: &mut Problems) {
    if !crate::limiter::valid_name(name) {
        p.add(
            path,
            format!("{name:?}: use 1 to 64 of a-z A-Z 0-9 - _ . :"),
        );
    }
}

fn queue_ok(queue: &QueueConfig, path: &str, p: &mut Problems) {
    if queue.max_waiting == 0 {
        p.add(format!("{path}.max_waiting"), "must be at least 1");
    }
    if queue.max_wait.get().is_zero() {
        p.add(format!("{path}.max_wait"), "must be above zero");
    }
}

impl Config {
    /// Everything that needs no code bindings and no connection.
    /// Registers no metric series (nothing it builds runs).
    pub(crate) fn check(&self) -> Result<(), ConfigErrors> {
        super::reload::quietly(|| {
            let mut builder = Builder::new(self, None);
            builder.store();
            let _ = builder.rate_limit(crate::MemoryStore::new());
            let _ = builder.concurrency();
            let _ = builder.shed();
            builder.problems.or(())
        })
    }

    /// The rate-limit layer over `store`, with the keys, resolvers and responder of
    /// `bindings`. The `store` section is not read here: see [`Config::store`].
    pub fn rate_limit_layer<St: Store>(
        &self,
        store: St,
        bindings: &Bindings,
    ) -> Result<RateLimitLayer<St>, ConfigErrors> {
        let mut builder = Builder::new(self, Some(bindings));
        let layer = builder.rate_limit(store);
        let problems = builder.problems;
        let layer = problems.or(layer)?;
        let Some(layer) = layer else {
            return Err(ConfigErrors::one("rules", "could not be built"));
        };
        layer.build().map_err(|e| ConfigErrors::one("rules", e))
    }

    /// The concurrency layer of the `[concurrency]` section, if there is one (in process; a
    /// `distributed` one is made by [`ConfiguredStore::concurrency_layer`](super::ConfiguredStore::concurrency_layer)).
    pub fn concurrency_layer(
        &self,
        bindings: &Bindings,
    ) -> Result<Option<ConcurrencyLimitLayer>, ConfigErrors> {
        if self.concurrency.as_ref().is_some_and(|c| c.distributed) {
            return Err(ConfigErrors::one(
                "concurrency.distributed",
                "a distributed limit needs the Redis store: build it with \
                 ConfiguredStore::concurrency_layer",
            ));
        }
        let mut builder = Builder::new(self, Some(bindings));
        let layer = builder.concurrency();
        builder.problems.or(layer)
    }

    /// The same, counting places on `redis` when the section says `distributed = true`.
    #[cfg(feature = "redis")]
    pub(crate) fn distributed_concurrency_layer(
        &self,
        bindings: &Bindings,
        redis: Option<&crate::RedisStore>,
    ) -> Result<Option<ConcurrencyLimitLayer>, ConfigErrors> {
        let mut builder = Builder::new(self, Some(bindings));
        builder.redis = redis.cloned();
        let layer = builder.concurrency();
        builder.problems.or(layer)
    }

    /// The load shedder of the `[shed]` section, if there is one.
    pub fn shed_layer(&self, bindings: &Bindings) -> Result<Option<LoadShedLayer>, ConfigErrors> {
        let mut builder = Builder::new(self, Some(bindings));
        let layer = builder.shed();
        builder.problems.or(layer)
    }
}
