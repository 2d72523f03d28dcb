//! Routing on a Redis Cluster: a connection pool per master, chosen by the slot of a call's
//! keys, so that one master down fails only the keys it holds.
//!
//! fred's own Cluster client keeps one connection to every master and, when one of them
//! cannot be reached, reconnects as a whole: a killed master stalls every key until it is
//! back or replaced. Here each master is a single-node client of its own, and the store reads
//! the Cluster's map (`CLUSTER SLOTS`) itself: at connect, again in the background after a
//! redirection or a failed call (at most once every [`REFRESH_EVERY`]), and a `MOVED` answer
//! is followed at once to the master it names (the script did not run, so sending it again
//! is safe). An `ASK` (a slot half-way through a migration) is an error for that call.
//! Masters are named by a hash of their address, so each keeps its circuit breaker
//! ([`Store::partition`](crate::Store::partition)) across re-reads of the map.
//!
//! A master's pool reconnects by itself whatever happened at its first contact (down at
//! start, or where a `MOVED` pointed to a node not up yet), and is dropped when its address
//! leaves the map; a read of the map asks the masters connected now first.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use fred::clients::Pool;
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::{ClientLike, ClusterInterface};
use fred::types::config::{Config, Server as Address, ServerConfig};
use fred::types::{Builder, Value};
use parking_lot::Mutex;

use crate::clock::Clock;

/// The least time between two reads of the Cluster's map (ns).
const REFRESH_EVERY: u64 = 500_000_000;

/// One master: the hash of its address and its pool.
#[derive(Clone)]
struct Master {
    id: u32,
    pool: Pool,
}

/// Which master holds each slot: ranges sorted by their first slot.
#[derive(Default)]
struct SlotMap {
    ranges: Vec<(u16, u16, Master)>,
}

impl SlotMap {
    fn get(&self, slot: u16) -> Option<&Master> {
        let i = self.ranges.partition_point(|(_, end, _)| *end < slot);
        self.ranges
            .get(i)
            .filter(|(start, _, _)| *start <= slot)
            .map(|(_, _, m)| m)
    }
}

/// The masters of a Cluster, each with its pool, and the map of their slots.
pub(super) struct Masters {
    /// Each master's client is built from this, with the master's address.
    builder: Builder,
    pool_size: usize,
    /// Whether pools connect before they are used (else in the background, failing fast).
    wait: bool,
    connect_timeout: Duration,
    seeds: Vec<Address>,
    /// The first seed's pool, for calls made before the map is known (a `MOVED` then points
    /// the way).
    seed: Pool,
    map: ArcSwap<SlotMap>,
    /// Every master seen, by address: a master that comes back keeps its pool.
    pools: Mutex<HashMap<(String, u16), Master>>,
    refreshing: AtomicBool,
    refreshed_at: AtomicU64,
    local: Arc<dyn Clock>,
}

impl std::fmt::Debug for Masters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Masters")
            .field("masters", &self.pools.lock().len())
            .field("ranges", &self.map.load().ranges.len())
            .finish_non_exhaustive()
    }
}

/// The hash that names a master.
fn master_id(host: &str, port: u16) -> u32 {
    let mut hasher = DefaultHasher::new();
    host.hash(&mut hasher);
    port.hash(&mut hasher);
    // The low half of a 64-bit hash: two of a handful of masters clash about once in 10^8.
    hasher.finish() as u32
}

/// The slot ranges of a `CLUSTER SLOTS` answer with their masters' addresses; an empty or
/// unknown host (`""`, `"?"`) is the node that answered.
fn parse_slots(answer: Value, asked: &Address) -> Vec<(u16, u16, String, u16)> {
    let Value::Array(entries) = answer else {
        return Vec::new();
    };
    let int = |v: &Value| match v {
        Value::Integer(i) => u16::try_from(*i).ok(),
        other => other.as_str().and_then(|s| s.parse().ok()),
    };
    let mut ranges = Vec::new();
    for entry in entries {
        let Value::Array(parts) = entry else { continue };
        let (Some(start), Some(end), Some(Value::Array(master))) = (
            parts.first().and_then(int),
            parts.get(1).and_then(int),
            parts.get(2),
        ) else {
            continue;
        };
        let (Some(host), Some(port)) = (
            master
                .first()
                .and_then(|h| h.as_str().map(|s| s.to_string())),
            master.get(1).and_then(int),
        ) else {
            continue;
        };
        let host = if host.is_empty() || host == "?" {
            asked.host.to_string()
        } else {
            host
        };
        if start <= end {
            ranges.push((start, end, host, port));
        }
    }
    ranges.sort_by_key(|r| r.0);
    ranges
}

impl Masters {
    /// Reads the Cluster's map from the first seed that answers and makes a pool for each
    /// master (connected before this returns with `wait`, else in the background).
    pub(super) async fn connect(
        builder: Builder,
        pool_size: usize,
        wait: bool,
        connect_timeout: Duration,
        local: Arc<dyn Clock>,
    ) -> Result<Arc<Self>, FredError> {
        let seeds = builder
            .get_config()
            .map(|c| c.server.hosts())
            .unwrap_or_default();
        let first = seeds.first().ok_or_else(|| {
            FredError::new(ErrorKind::Config, "a Cluster needs a node to start from")
        })?;
        let seed = Self::build(&builder, pool_size, &first.host, first.port)?;
        let masters = Arc::new(Self {
            builder,
            pool_size,
            wait,
            connect_timeout,
            seeds,
            seed,
            map: ArcSwap::from_pointee(SlotMap::default()),
            pools: Mutex::new(HashMap::new()),
            refreshing: AtomicBool::new(false),
            refreshed_at: AtomicU64::new(0),
            local,
        });
        match masters.refresh().await {
            Ok(()) => Ok(masters),
            Err(e) if !wait => {
                // Connecting in the background: the map is read again on the first calls.
                masters.refresh_soon();
                let _ = e;
                Ok(masters)
            }
            Err(e) => Err(e),
        }
    }

    /// The pool and the master's name for `slot` (none before the map is known).
    pub(super) fn pool_for(&self, slot: u16) -> Option<(u32, Pool)> {
        self.map.load().get(slot).map(|m| (m.id, m.pool.clone()))
    }

    /// The name of the master of `slot`.
    pub(super) fn master_of(&self, slot: u16) -> Option<u32> {
        self.map.load().get(slot).map(|m| m.id)
    }

    /// The pools of the masters in the map.
    pub(super) fn master_pools(&self) -> Vec<Pool> {
        self.map
            .load()
            .ranges
            .iter()
            .fold(Vec::new(), |mut pools: Vec<(u32, Pool)>, (_, _, m)| {
                if !pools.iter().any(|(id, _)| *id == m.id) {
                    pools.push((m.id, m.pool.clone()));
                }
                pools
            })
            .into_iter()
            .map(|(_, pool)| pool)
            .collect()
    }

    /// Every master's pool, and the first seed's.
    pub(super) fn pools(&self) -> Vec<Pool> {
        let mut pools: Vec<Pool> = self.pools.lock().values().map(|m| m.pool.clone()).collect();
        pools.push(self.seed.clone());
        pools
    }

    /// The first seed's pool: for a call made before the map is known.
    pub(super) fn seed(&self) -> Pool {
        self.seed.clone()
    }

    /// A pool of `pool_size` connections to `host:port`, connecting in the background and
    /// reconnecting by itself, whatever its first attempt gives: until it is connected its
    /// calls wait within their timeout.
    ///
    /// Never `fail_fast`: with it, a client whose first connection fails ends its connection
    /// task for good, so a master down when the store first routes to it (at start, or where
    /// a `MOVED` points to a node not up yet) would never be reached, even once it is back.
    fn build(
        builder: &Builder,
        pool_size: usize,
        host: &str,
        port: u16,
    ) -> Result<Pool, FredError> {
        let mut builder = builder.clone();
        let config = builder.get_config().cloned().unwrap_or_default();
        builder.set_config(Config {
            server: ServerConfig::new_centralized(host, port),
            fail_fast: false,
            ..config
        });
        let pool = builder.build_pool(pool_size)?;
        let _handles = pool.connect_pool();
        Ok(pool)
    }

    /// The pool of the master at `host:port` (made if it is new): where a `MOVED` points.
    pub(super) fn pool_at(&self, host: &str, port: u16) -> Result<Pool, FredError> {
        self.master(host, port).map(|m| m.pool)
    }

    fn master(&self, host: &str, port: u16) -> Result<Master, FredError> {
        let mut pools = self.pools.lock();
        if let Some(m) = pools.get(&(host.to_owned(), port)) {
            return Ok(m.clone());
        }
        let master = Master {
            id: master_id(host, port),
            pool: Self::build(&self.builder, self.pool_size, host, port)?,
        };
        pools.insert((host.to_owned(), port), master.clone());
        Ok(master)
    }

    /// Reads the map again in the background, unless it was read less than
    /// [`REFRESH_EVERY`] ago or is being read.
    pub(super) fn refresh_soon(self: &Arc<Self>) {
        let now = self.local.now();
        if now.saturating_sub(self.refreshed_at.load(Ordering::Relaxed)) < REFRESH_EVERY {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let masters = Arc::clone(self);
        runtime.spawn(async move {
            let _ = masters.refresh().await;
        });
    }

    /// Reads the map from a master that answers (the known ones first, then the seeds) and
    /// swaps it in. One read at a time; a read asked for during another is that one.
    pub(super) async fn refresh(&self) -> Result<(), FredError> {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let result = self.read_map().await;
        self.refreshed_at
            .store(self.local.now().max(1), Ordering::Relaxed);
        self.refreshing.store(false, Ordering::Release);
        result
    }

    async fn read_map(&self) -> Result<(), FredError> {
        let mut asked: Vec<(Address, Option<Pool>)> = self
            .pools
            .lock()
            .iter()
            .map(|((host, port), m)| (Address::new(host.as_str(), *port), Some(m.pool.clone())))
            .collect();
        // The masters connected now first: one that is down would cost a timeout.
        asked.sort_by_key(|(_, pool)| !pool.as_ref().is_some_and(|p| p.is_connected()));
        asked.extend(self.seeds.iter().cloned().map(|s| (s, None)));
        let mut last = FredError::new(ErrorKind::Cluster, "no node of the Cluster answered");
        for (address, pool) in asked {
            let answer = match pool {
                Some(pool) => {
                    tokio::time::timeout(self.connect_timeout, pool.next().cluster_slots::<Value>())
                        .await
                        .unwrap_or_else(|_| {
                            Err(FredError::new(
                                ErrorKind::Timeout,
                                "CLUSTER SLOTS timed out",
                            ))
                        })
                }
                None => self.ask_seed(&address).await,
            };
            let ranges = match answer {
                Ok(answer) => parse_slots(answer, &address),
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            if ranges.is_empty() {
                continue;
            }
            let mut map = SlotMap::default();
            let mut kept: Vec<(String, u16)> = Vec::new();
            for (start, end, host, port) in ranges {
                map.ranges.push((start, end, self.master(&host, port)?));
                kept.push((host, port));
            }
            self.prune(&kept);
            if self.wait {
                // The new masters' first calls should not pay for their connection; all at
                // once, so that a master down costs one connect timeout, not one each.
                let waits = map.ranges.iter().map(|(_, _, m)| {
                    tokio::time::timeout(self.connect_timeout, m.pool.wait_for_connect())
                });
                futures_util::future::join_all(waits).await;
            }
            self.map.store(Arc::new(map));
            return Ok(());
        }
        Err(last)
    }

    /// Drops the pools of the addresses that are not `kept` (they left the map: a master
    /// replaced in a failover, a node whose slots moved away), so that they do not reconnect
    /// for the life of the process nor get asked at every read of the map. Their
    /// connections close after a connect timeout, so that the calls still on them end first.
    fn prune(&self, kept: &[(String, u16)]) {
        let mut gone: Vec<Pool> = Vec::new();
        self.pools.lock().retain(|address, m| {
            let keep = kept.contains(address);
            if !keep {
                gone.push(m.pool.clone());
            }
            keep
        });
        if gone.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let grace = self.connect_timeout;
        runtime.spawn(async move {
            tokio::time::sleep(grace).await;
            for pool in gone {
                let _ = pool.quit().await;
            }
        });
    }

    /// `CLUSTER SLOTS` from a seed, on a client of its own made for the question.
    async fn ask_seed(&self, seed: &Address) -> Result<Value, FredError> {
        let mut builder = self.builder.clone();
        let config = self.builder.get_config().cloned().unwrap_or_default();
        builder.set_config(Config {
            server: ServerConfig::Centralized {
                server: seed.clone(),
            },
            fail_fast: true,
            ..config
        });
        let client = builder.build()?;
        let answer = tokio::time::timeout(self.connect_timeout, async {
            client.init().await?;
            client.cluster_slots::<Value>().await
        })
        .await
        .unwrap_or_else(|_| {
            Err(FredError::new(
                ErrorKind::Timeout,
                "CLUSTER SLOTS timed out",
            ))
        });
        let _ = client.quit().await;
        answer
    }
}

/// Where a `MOVED` answer points: `MOVED <slot> <host>:<port>`.
pub(super) fn moved_to(e: &FredError) -> Option<(String, u16)> {
    if !e.is_moved() {
        return None;
    }
    let address = e.details().split_whitespace().nth(2)?;
    let (host, port) = address.rsplit_once(':')?;
    Some((host.trim_matches(['[', ']']).to_owned(), port.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(start: i64, end: i64, host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::Integer(start),
            Value::Integer(end),
            Value::Array(vec![
                Value::from(host),
                Value::Integer(port),
                Value::from("id"),
            ]),
        ])
    }

    #[test]
    fn the_map_is_read_sorted_and_odd_entries_are_skipped() {
        let asked = Address::new("10.0.0.9", 7000);
        let answer = Value::Array(vec![
            range(5461, 10922, "10.0.0.2", 7001),
            range(0, 5460, "", 7000),
            Value::from("garbage"),
            range(10923, 16383, "?", 7002),
            range(20, 10, "10.0.0.4", 7003),
            Value::Array(vec![Value::Integer(1)]),
            range(0, 70_000, "10.0.0.5", 7004),
        ]);
        assert_eq!(
            parse_slots(answer, &asked),
            vec![
                (0, 5460, "10.0.0.9".to_owned(), 7000),
                (5461, 10922, "10.0.0.2".to_owned(), 7001),
                (10923, 16383, "10.0.0.9".to_owned(), 7002),
            ]
        );
        assert!(parse_slots(Value::from("no"), &asked).is_empty());
    }

    #[test]
    fn a_moved_answer_names_its_master() {
        let moved = FredError::new(ErrorKind::Cluster, "MOVED 3999 127.0.0.1:6381");
        assert_eq!(moved_to(&moved), Some(("127.0.0.1".to_owned(), 6381)));
        let v6 = FredError::new(ErrorKind::Cluster, "MOVED 1 [::1]:7000");
        assert_eq!(moved_to(&v6), Some(("::1".to_owned(), 7000)));
        for other in [
            FredError::new(ErrorKind::Cluster, "ASK 3999 127.0.0.1:6381"),
            FredError::new(ErrorKind::Cluster, "MOVED 3999"),
            FredError::new(ErrorKind::Cluster, "MOVED 3999 host:port"),
            FredError::new(ErrorKind::IO, "MOVED 3999 127.0.0.1:6381"),
        ] {
            assert_eq!(moved_to(&other), None, "{other:?}");
        }
    }

    #[test]
    fn a_slot_finds_its_range() {
        let builder = Builder::default_centralized();
        let pool = builder.build_pool(1).unwrap();
        let m = |id| Master {
            id,
            pool: pool.clone(),
        };
        let map = SlotMap {
            ranges: vec![(0, 99, m(1)), (100, 199, m(2)), (300, 16383, m(3))],
        };
        let id = |slot| map.get(slot).map(|m| m.id);
        assert_eq!(
            [
                id(0),
                id(99),
                id(100),
                id(199),
                id(200),
                id(299),
                id(300),
                id(16383)
            ],
            [
                Some(1),
                Some(1),
                Some(2),
                Some(2),
                None,
                None,
                Some(3),
                Some(3)
            ]
        );
        assert_eq!(SlotMap::default().get(5).map(|m| m.id), None);
    }
}
