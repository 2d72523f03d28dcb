//! [`RedisStoreBuilder`]: which server (URL, Cluster, Sentinel), the pool, timeouts, deny cache
//! and key layout; connecting loads the scripts.

use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use fred::bytes_utils::Str;
use fred::interfaces::{ClientLike, LuaInterface};
use fred::types::config::{Config, ReconnectPolicy, ServerConfig};
use fred::types::{Builder, Value};

use super::cluster;
use super::deny::DenyCache;
use super::keys::{KeyNames, KeySlots};
use super::scripts::{Backend, Scripts};
use super::{
    DEFAULT_MAX_CROSS_SLOT_CALLS, DEFAULT_MAX_KEY_LEN, DEFAULT_POOL_SIZE, DEFAULT_TIMEOUT, Inner,
    RedisError, RedisStore, backend_error,
};
use crate::clock::{Clock, SystemClock};
use crate::store::StoreError;

#[derive(Clone, Debug)]
enum Server {
    Url(String),
    Cluster(Vec<(String, u16)>),
    Sentinel {
        hosts: Vec<(String, u16)>,
        service: String,
    },
}

/// Configures a [`RedisStore`]; made by [`RedisStore::builder`].
#[derive(Clone)]
pub struct RedisStoreBuilder {
    server: Server,
    prefix: String,
    slots: KeySlots,
    pool_size: usize,
    timeout: Duration,
    connect_timeout: Duration,
    deny_cache: usize,
    deny_max_age: Duration,
    max_key_len: usize,
    ttl_slack: Duration,
    wait: bool,
    injected: Option<Arc<dyn Clock>>,
    max_cross_slot: usize,
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        Self {
            server: Server::Url("redis://127.0.0.1:6379".into()),
            prefix: "tollgate:".into(),
            slots: KeySlots::PerKey,
            pool_size: DEFAULT_POOL_SIZE,
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: Duration::from_secs(1),
            deny_cache: 0,
            deny_max_age: Duration::from_secs(1),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            ttl_slack: Duration::from_secs(1),
            wait: true,
            injected: None,
            max_cross_slot: DEFAULT_MAX_CROSS_SLOT_CALLS,
        }
    }
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let server = match &self.server {
            // The URL may hold a password.
            Server::Url(_) => "url".to_owned(),
            Server::Cluster(nodes) => format!("cluster {nodes:?}"),
            Server::Sentinel { hosts, service } => format!("sentinel {service} {hosts:?}"),
        };
        f.debug_struct("RedisStoreBuilder")
            .field("server", &server)
            .field("prefix", &self.prefix)
            .field("slots", &self.slots)
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("deny_cache", &self.deny_cache)
            .field("deny_max_age", &self.deny_max_age)
            .field("max_key_len", &self.max_key_len)
            .field("ttl_slack", &self.ttl_slack)
            .field("wait_for_redis", &self.wait)
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    /// The server, as a URL (see [`RedisStore::connect`]). Default `redis://127.0.0.1:6379`.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.server = Server::Url(url.into());
        self
    }

    /// A Redis Cluster, found from any of these `(host, port)` nodes. The store reads the
    /// Cluster's map itself and keeps a connection pool per master, so that one master down
    /// (hung or killed) fails only the keys it holds, each master with its own circuit breaker
    /// under a [`ResilientStore`](crate::store::ResilientStore); a `MOVED` answer is followed
    /// at once and the map read again, and an `ASK` (a slot in mid-migration) fails that call.
    pub fn cluster<H: Into<String>>(mut self, nodes: impl IntoIterator<Item = (H, u16)>) -> Self {
        self.server = Server::Cluster(nodes.into_iter().map(|(h, p)| (h.into(), p)).collect());
        self
    }

    /// A primary found through Sentinel: the sentinels' `(host, port)` and the service name.
    pub fn sentinel<H: Into<String>>(
        mut self,
        sentinels: impl IntoIterator<Item = (H, u16)>,
        service_name: impl Into<String>,
    ) -> Self {
        self.server = Server::Sentinel {
            hosts: sentinels.into_iter().map(|(h, p)| (h.into(), p)).collect(),
            service: service_name.into(),
        };
        self
    }

    /// The prefix of every key name (default `tollgate:`). It may not contain `{` or `}`
    /// (the store chooses the hash tag).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How keys are placed on Cluster slots (default [`KeySlots::PerKey`]).
    pub fn key_slots(mut self, slots: KeySlots) -> Self {
        self.slots = slots;
        self
    }

    /// How many connections to pipeline over (default 4, at least 1).
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.clamp(1, 256);
        self
    }

    /// The most a call may take before it fails with [`StoreError::Timeout`] (default
    /// 250 ms).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The most connecting (and each reconnection attempt) may take (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The most calls across slots in flight at once (default
    /// [`DEFAULT_MAX_CROSS_SLOT_CALLS`], at least 1). Each runs in a task of its own, which
    /// lasts until its refunds are done even after its caller stopped waiting: while a master
    /// hangs, a flood of stacks across slots would otherwise hold about rate x 3 timeouts of
    /// tasks. Past the bound a call across slots fails at once with [`StoreError::Busy`],
    /// consuming nothing; a [`ResilientStore`](crate::store::ResilientStore) answers it with
    /// its failure policy, and no breaker counts it (it says nothing of Redis's health).
    pub fn max_cross_slot_calls(mut self, max: usize) -> Self {
        self.max_cross_slot = max.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        self
    }

    /// Remember up to `capacity` rejections locally and answer them without Redis until their
    /// retry time (default 0: off). See the module docs.
    pub fn deny_cache(mut self, capacity: usize) -> Self {
        self.deny_cache = capacity;
        self
    }

    /// The longest a remembered rejection is answered locally before Redis is asked again,
    /// even if its retry time is later (default 1 s).
    pub fn deny_cache_max_age(mut self, max_age: Duration) -> Self {
        self.deny_max_age = max_age;
        self
    }

    /// The longest key accepted, in bytes (default 64 KiB); a longer one is a
    /// [`StoreError::KeyTooLong`]. Keys longer than 128 bytes once escaped are stored under
    /// their SHA-256.
    pub fn max_key_len(mut self, max_key_len: usize) -> Self {
        self.max_key_len = max_key_len;
        self
    }

    /// Added to every key's expiry beyond the moment its state has fully recovered (default
    /// 1 s).
    pub fn ttl_slack(mut self, slack: Duration) -> Self {
        self.ttl_slack = slack;
        self
    }

    /// Whether [`connect`](Self::connect) waits for Redis (default `true`: it fails if Redis
    /// cannot be reached within the connect timeout). With `false` it returns at once and
    /// connects in the background, retrying with backoff: a service can start while Redis is
    /// down (its checks fail, promptly, until Redis answers; wrap the store in a
    /// [`ResilientStore`](crate::store::ResilientStore) to decide what that means).
    ///
    /// On a Cluster, waiting means: the Cluster's map read from the first seed node that
    /// answers (`connect` fails only if none does), then up to the connect timeout plus one
    /// call timeout for the masters' connections, all at once, and their scripts loaded. A master that does not
    /// answer by then does not fail `connect`: its keys fail until it is back, and its pool
    /// keeps reconnecting, so that a service restarted during a one-master outage limits
    /// every other key from the start.
    pub fn wait_for_redis(mut self, wait: bool) -> Self {
        self.wait = wait;
        self
    }

    /// Testing only: the scripts take the time from `clock` (nanoseconds since the Unix
    /// epoch, or any origin) instead of Redis `TIME`, and keys expire an hour after they
    /// recover, so that a test can drive this store and a `MemoryStore` with one
    /// `ManualClock`. Never use it in production: instances would not share a clock.
    #[doc(hidden)]
    pub fn injected_clock(mut self, clock: impl Clock) -> Self {
        self.injected = Some(Arc::new(clock));
        self.ttl_slack = Duration::from_secs(3600);
        self
    }

    /// Connects and loads the scripts.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        let config_error = |message: String| StoreError::Backend(Box::new(RedisError { message }));
        if self.prefix.contains(['{', '}']) {
            return Err(config_error(format!(
                "the key prefix {:?} may not contain braces",
                self.prefix
            )));
        }
        let mut config = match &self.server {
            Server::Url(url) => {
                Config::from_url(url).map_err(|e| config_error(e.details().into()))?
            }
            Server::Cluster(nodes) => Config {
                server: ServerConfig::new_clustered(nodes.clone()),
                ..Config::default()
            },
            Server::Sentinel { hosts, service } => Config {
                server: ServerConfig::new_sentinel(hosts.clone(), service.clone()),
                ..Config::default()
            },
        };
        config.fail_fast = self.wait;
        let clustered = config.server.is_clustered();
        let mut builder = Builder::from_config(config);
        let (timeout, connect_timeout) = (self.timeout, self.connect_timeout);
        builder
            .with_connection_config(|c| {
                c.connection_timeout = connect_timeout;
                c.internal_command_timeout = connect_timeout;
                // A script is not idempotent: never send it twice on our behalf.
                c.max_command_attempts = 1;
            })
            .with_performance_config(|p| {
                p.default_command_timeout = timeout;
            })
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 1000, 2));
        let local: Arc<dyn Clock> = match &self.injected {
            Some(c) => Arc::clone(c),
            None => Arc::new(SystemClock::new()),
        };
        let scripts = Scripts::new();
        let backend = if clustered {
            // A pool per master, routed by the store (see cluster.rs).
            let masters = cluster::Masters::connect(
                builder,
                self.pool_size,
                self.wait,
                connect_timeout + timeout,
                Arc::clone(&local),
            )
            .await
            .map_err(|e| backend_error(&e, connect_timeout))?;
            Backend::Cluster(masters)
        } else {
            let pool = builder
                .build_pool(self.pool_size)
                .map_err(|e| config_error(e.details().into()))?;
            if !self.wait {
                // Connect in the background; until then calls fail fast, and the first one
                // after sends its script with EVAL.
                let _handles = pool.connect_pool();
            } else {
                match tokio::time::timeout(connect_timeout + timeout, pool.init()).await {
                    Ok(Ok(_handle)) => {}
                    Ok(Err(e)) => return Err(backend_error(&e, connect_timeout)),
                    Err(_) => {
                        let _ = pool.quit().await;
                        return Err(StoreError::Timeout(connect_timeout));
                    }
                }
            }
            Backend::One(pool)
        };
        match &backend {
            Backend::One(pool) if self.wait => {
                for lua in scripts.all() {
                    pool.next()
                        .script_load::<Value, _>(lua.text)
                        .await
                        .map_err(|e| backend_error(&e, timeout))?;
                }
            }
            Backend::Cluster(masters) if self.wait => {
                // Every master that answers, at once. One that does not (down, or not yet
                // up) fails only its own keys; its first script there goes whole with EVAL
                // once it is back (the NOSCRIPT path).
                let loads = masters.master_pools().into_iter().map(|pool| {
                    let scripts = &scripts;
                    async move {
                        if !pool.is_connected() {
                            return;
                        }
                        for lua in scripts.all() {
                            let load = pool.next().script_load::<Value, _>(lua.text);
                            if load.await.is_err() {
                                return;
                            }
                        }
                    }
                });
                futures_util::future::join_all(loads).await;
            }
            _ => {}
        }
        let hasher = foldhash::fast::RandomState::default();
        let instance = hasher.hash_one((std::process::id(), local.now()));
        Ok(RedisStore {
            inner: Arc::new(Inner {
                backend,
                clustered,
                names: KeyNames {
                    prefix: self.prefix,
                    slots: self.slots,
                },
                max_key_len: self.max_key_len,
                timeout,
                slack_arg: Str::from(
                    self.ttl_slack
                        .as_millis()
                        .min(u128::from(u64::MAX))
                        .to_string(),
                ),
                injected: self.injected,
                local,
                deny: (self.deny_cache > 0).then(|| {
                    let max_age = u64::try_from(self.deny_max_age.as_nanos()).unwrap_or(u64::MAX);
                    DenyCache::new(self.deny_cache, max_age)
                }),
                deny_hasher: hasher,
                scripts,
                instance,
                tokens: AtomicU64::new(0),
                cross_slot: Arc::new(tokio::sync::Semaphore::new(self.max_cross_slot)),
                max_cross_slot: self.max_cross_slot,
            }),
        })
    }
}
