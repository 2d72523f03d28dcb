//! The store a configuration names, as one type for the layers.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::schema::{Config, StoreKind};
use super::{Bindings, ConfigErrors};
use crate::store::Check;
use crate::{ConcurrencyLimitLayer, Decision, MemoryStore, Store, StoreError};

/// The store of a configuration's `[store]` section ([`Config::store`]): the in-process
/// [`MemoryStore`], or (feature `redis`) a [`RedisStore`](crate::RedisStore) behind a
/// [`ResilientStore`](crate::store::ResilientStore) with the section's timeout, failure
/// policy and breaker. Cloning shares the state. The in-process store decides without a
/// future to wait for, as it does unwrapped.
#[derive(Clone)]
pub struct ConfiguredStore {
    inner: Inner,
}

#[derive(Clone)]
enum Inner {
    Memory(MemoryStore),
    #[cfg(feature = "redis")]
    Redis {
        resilient: crate::store::ResilientStore<crate::RedisStore>,
        redis: crate::RedisStore,
    },
}

impl fmt::Debug for ConfiguredStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Inner::Memory(store) => f.debug_tuple("ConfiguredStore").field(store).finish(),
            #[cfg(feature = "redis")]
            Inner::Redis { resilient, .. } => {
                f.debug_tuple("ConfiguredStore").field(resilient).finish()
            }
        }
    }
}

impl ConfiguredStore {
    /// The in-process store, if that is the one.
    pub fn memory(&self) -> Option<&MemoryStore> {
        match &self.inner {
            Inner::Memory(store) => Some(store),
            #[cfg(feature = "redis")]
            Inner::Redis { .. } => None,
        }
    }

    /// The Redis store and its failure handling, if that is the one.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn redis(&self) -> Option<&crate::store::ResilientStore<crate::RedisStore>> {
        match &self.inner {
            Inner::Redis { resilient, .. } => Some(resilient),
            Inner::Memory(_) => None,
        }
    }

    /// The concurrency layer of `config`'s `[concurrency]` section, if it has one; with
    /// `distributed = true`, counting places on this Redis store.
    pub fn concurrency_layer(
        &self,
        config: &Config,
        bindings: &Bindings,
    ) -> Result<Option<ConcurrencyLimitLayer>, ConfigErrors> {
        match &self.inner {
            #[cfg(feature = "redis")]
            Inner::Redis { redis, .. } => {
                config.distributed_concurrency_layer(bindings, Some(redis))
            }
            Inner::Memory(_) => config.concurrency_layer(bindings),
        }
    }
}

impl Config {
    /// The store of the `[store]` section, connected (for Redis, this waits for the
    /// connection, up to its connect timeout).
    pub async fn store(&self) -> Result<ConfiguredStore, ConfigErrors> {
        let mut builder = super::build::Builder::new(self, None);
        builder.store();
        builder.problems.or(())?;
        let s = &self.store;
        match s.kind {
            StoreKind::Memory => {
                let mut b = MemoryStore::builder();
                if let Some(name) = &s.name {
                    b = b.name(name.as_str());
                }
                if let Some(n) = s.max_keys {
                    b = b.max_keys(n);
                }
                if let Some(n) = s.shards {
                    b = b.shards(n);
                }
                if let Some(n) = s.max_key_len {
                    b = b.max_key_len(n);
                }
                Ok(ConfiguredStore {
                    inner: Inner::Memory(b.build()),
                })
            }
            #[cfg(feature = "redis")]
            StoreKind::Redis => redis(self).await,
            #[cfg(not(feature = "redis"))]
            StoreKind::Redis => Err(ConfigErrors::one(
                "store.kind",
                "the Redis store needs tollgate's feature `redis`",
            )),
        }
    }
}

#[cfg(feature = "redis")]
async fn redis(config: &Config) -> Result<ConfiguredStore, ConfigErrors> {
    use crate::RedisStore;
    use crate::store::ResilientStore;

    let s = &config.store;
    let mut b = RedisStore::builder();
    if let Some(url) = &s.url {
        b = b.url(url.as_str());
    }
    if !s.cluster.is_empty() {
        b = b.cluster(s.cluster.iter().filter_map(|n| super::build::node_of(n)));
    }
    if let Some(prefix) = &s.prefix {
        b = b.prefix(prefix.as_str());
    }
    if let Some(n) = s.pool_size {
        b = b.pool_size(n);
    }
    if let Some(t) = s.timeout {
        b = b.timeout(t.get());
    }
    if let Some(n) = s.deny_cache {
        b = b.deny_cache(n);
    }
    if let Some(n) = s.max_cross_slot_calls {
        b = b.max_cross_slot_calls(n);
    }
    if let Some(n) = s.max_key_len {
        b = b.max_key_len(n);
    }
    let redis = b
        .connect()
        .await
        .map_err(|e| ConfigErrors::one("store", format!("could not connect: {e}")))?;
    let mut r = ResilientStore::builder(redis.clone());
    if let Some(name) = &s.name {
        r = r.name(name.as_str());
    }
    if let Some(t) = s.timeout {
        r = r.timeout(t.get());
    }
    if let Some(policy) = s.on_failure {
        r = r.failure_policy(super::build::failure_policy(policy));
    }
    if let Some(b) = &s.breaker {
        r = r.breaker(b.failures, b.open_for.get());
    }
    if let Some(n) = s.instances {
        r = r.fallback_instances(n);
    }
    Ok(ConfiguredStore {
        inner: Inner::Redis {
            resilient: r.build(),
            redis,
        },
    })
}

impl Store for ConfiguredStore {
    type Future = ConfiguredFuture;

    fn check_all(&self, checks: &[Check<'_>]) -> ConfiguredFuture {
        ConfiguredFuture(match &self.inner {
            Inner::Memory(store) => Answer::Ready(Some(store.check_all_now(checks))),
            #[cfg(feature = "redis")]
            Inner::Redis { resilient, .. } => Answer::Later(resilient.check_all(checks)),
        })
    }

    fn max_key_len(&self) -> Option<usize> {
        match &self.inner {
            Inner::Memory(store) => Store::max_key_len(store),
            #[cfg(feature = "redis")]
            Inner::Redis { resilient, .. } => Store::max_key_len(resilient),
        }
    }
}

/// The future of a [`ConfiguredStore`] check.
#[must_use = "futures do nothing unless polled"]
pub struct ConfiguredFuture(Answer);

enum Answer {
    Ready(Option<Result<Decision, StoreError>>),
    #[cfg(feature = "redis")]
    Later(crate::store::resilient::ResilientFuture),
}

impl ConfiguredFuture {
    /// The answer, if the store gave it at once (the in-process store always does).
    pub(crate) fn now(&mut self) -> Option<Result<Decision, StoreError>> {
        match &mut self.0 {
            Answer::Ready(answer) => answer.take(),
            #[cfg(feature = "redis")]
            Answer::Later(_) => None,
        }
    }
}

impl Future for ConfiguredFuture {
    type Output = Result<Decision, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        #[cfg(not(feature = "redis"))]
        let _ = cx;
        match &mut self.0 {
            Answer::Ready(answer) => match answer.take() {
                Some(answer) => Poll::Ready(answer),
                None => Poll::Ready(Err(StoreError::Backend("polled after completion".into()))),
            },
            #[cfg(feature = "redis")]
            Answer::Later(future) => Pin::new(future).poll(cx),
        }
    }
}

impl fmt::Debug for ConfiguredFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConfiguredFuture").finish_non_exhaustive()
    }
}
