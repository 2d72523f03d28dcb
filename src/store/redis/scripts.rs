//! The Lua scripts the store runs, and how it runs them (`EVALSHA`, then `EVAL` after a
//! `NOSCRIPT`).

use std::sync::Arc;

use fred::bytes_utils::Str;
use fred::clients::{Client, Pool};
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::{ClientLike, LuaInterface};
use fred::types::scripts::Script;
use fred::types::{Key, MultipleKeys, Value};

use super::{Item, cluster};

/// The check script for calls whose checks all run one algorithm: only that algorithm's code,
/// so that each call defines as few Lua functions as it can.
macro_rules! check_script {
    ($($file:literal),*) => {
        concat!(include_str!("common.lua"), $(include_str!($file),)* include_str!("check.lua"))
    };
}

const GCRA_LUA: &str = check_script!("gcra.lua");
const TOKEN_BUCKET_LUA: &str = check_script!("token_bucket.lua");
const LEAKY_BUCKET_LUA: &str = check_script!("leaky_bucket.lua");
const FIXED_WINDOW_LUA: &str = check_script!("arith.lua", "fixed_window.lua");
const SLIDING_WINDOW_LUA: &str = check_script!("arith.lua", "sliding_window.lua");
const SLIDING_LOG_LUA: &str = check_script!("sliding_log.lua");
/// Every algorithm, for stacked checks that mix them.
const MIXED_LUA: &str = check_script!(
    "arith.lua",
    "gcra.lua",
    "token_bucket.lua",
    "leaky_bucket.lua",
    "fixed_window.lua",
    "sliding_window.lua",
    "sliding_log.lua"
);

const REFUND_LUA: &str = concat!(
    include_str!("common.lua"),
    include_str!("gcra.lua"),
    include_str!("token_bucket.lua"),
    include_str!("leaky_bucket.lua"),
    include_str!("fixed_window.lua"),
    include_str!("sliding_window.lua"),
    include_str!("sliding_log.lua"),
    include_str!("refund.lua"),
);

const LEASE_LUA: &str = concat!(include_str!("common.lua"), include_str!("lease.lua"));

/// check.lua's sibling for calls that take quota leases (see [`LeasedStore`]).
const TAKE_LUA: &str = concat!(
    include_str!("common.lua"),
    include_str!("arith.lua"),
    include_str!("gcra.lua"),
    include_str!("token_bucket.lua"),
    include_str!("leaky_bucket.lua"),
    include_str!("fixed_window.lua"),
    include_str!("sliding_window.lua"),
    include_str!("sliding_log.lua"),
    include_str!("take.lua"),
);

/// A script and its SHA-1.
#[derive(Clone, Debug)]
pub(super) struct Lua {
    pub(super) text: &'static str,
    pub(super) sha: String,
}

impl Lua {
    fn new(text: &'static str) -> Self {
        Self {
            text,
            sha: Script::from_lua(text).sha1().to_string(),
        }
    }
}

/// Every script the store runs.
#[derive(Debug)]
pub(super) struct Scripts {
    /// Indexed by [`algorithm_slot`].
    pub(super) single: [Lua; 6],
    mixed: Lua,
    pub(super) refund: Lua,
    pub(super) lease: Lua,
    pub(super) take: Lua,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            single: [
                Lua::new(FIXED_WINDOW_LUA),
                Lua::new(SLIDING_LOG_LUA),
                Lua::new(SLIDING_WINDOW_LUA),
                Lua::new(TOKEN_BUCKET_LUA),
                Lua::new(LEAKY_BUCKET_LUA),
                Lua::new(GCRA_LUA),
            ],
            mixed: Lua::new(MIXED_LUA),
            refund: Lua::new(REFUND_LUA),
            lease: Lua::new(LEASE_LUA),
            take: Lua::new(TAKE_LUA),
        }
    }

    pub(super) fn all(&self) -> impl Iterator<Item = &Lua> {
        self.single
            .iter()
            .chain([&self.mixed, &self.refund, &self.lease, &self.take])
    }

    /// The script for a call on these items.
    pub(super) fn check(&self, items: &[&Item]) -> &Lua {
        match items.split_first() {
            Some((first, rest)) if rest.iter().all(|it| it.algorithm == first.algorithm) => {
                &self.single[algorithm_slot(first.algorithm)]
            }
            _ => &self.mixed,
        }
    }
}

pub(super) fn algorithm_slot(name: &str) -> usize {
    match name {
        "fixed_window" => 0,
        "sliding_log" => 1,
        "sliding_window" => 2,
        "token_bucket" => 3,
        "leaky_bucket" => 4,
        _ => 5,
    }
}

/// A constant argument, without copying it.
pub(super) fn static_str(s: &'static str) -> Value {
    Value::String(Str::from_static(s))
}

/// EVALSHA, and EVAL of the whole script if the server has lost it (restart, SCRIPT FLUSH, a
/// new Cluster node): EVAL caches it again.
/// `build` makes the keys and arguments (twice after a NOSCRIPT).
/// Where the store's commands go: one pool (a single node, or the primary Sentinel names), or
/// on a Cluster a pool per master, chosen by the slot of a call's keys.
#[derive(Clone)]
pub(super) enum Backend {
    One(Pool),
    Cluster(Arc<cluster::Masters>),
}

impl Backend {
    /// The pool for a call on `key` (on a Cluster before its map is known: any master's, whose
    /// `MOVED` then points the way).
    pub(super) fn pool_for(&self, key: &Key) -> Pool {
        match self {
            Backend::One(pool) => pool.clone(),
            Backend::Cluster(masters) => masters
                .pool_for(key.cluster_hash())
                .map_or_else(|| masters.seed(), |(_, pool)| pool),
        }
    }

    /// Every pool.
    pub(super) fn pools(&self) -> Vec<Pool> {
        match self {
            Backend::One(pool) => vec![pool.clone()],
            Backend::Cluster(masters) => masters.pools(),
        }
    }

    /// The connections of each pool.
    pub(super) fn pool_size(&self) -> usize {
        self.pools().first().map_or(0, Pool::size)
    }
}

/// Runs `lua` with the keys and arguments `build` makes, where its keys are: on a Cluster, on
/// their master, following a `MOVED` once (the script did not run) and reading the map again
/// in the background after a redirection or a failure.
pub(super) async fn eval<R: fred::types::FromValue>(
    backend: &Backend,
    lua: &Lua,
    build: impl Fn() -> (Vec<Key>, Vec<Value>),
) -> Result<R, FredError> {
    eval_traced(backend, lua, build).await.0
}

/// [`eval`], and the connection the script was sent on last: a script sent after it on the
/// same connection runs after it, if it ran at all (see [`may_have_run`]).
pub(super) async fn eval_traced<R: fred::types::FromValue>(
    backend: &Backend,
    lua: &Lua,
    build: impl Fn() -> (Vec<Key>, Vec<Value>),
) -> (Result<R, FredError>, Option<Client>) {
    let masters = match backend {
        Backend::One(pool) => {
            let client = pool.next().clone();
            return (eval_on(&client, lua, build).await, Some(client));
        }
        Backend::Cluster(masters) => masters,
    };
    // Built once for the slot and the call; again only for a redirection or NOSCRIPT.
    let built = build();
    let slot = built.0.first().map_or(0, Key::cluster_hash);
    let pool = masters
        .pool_for(slot)
        .map_or_else(|| masters.seed(), |(_, pool)| pool);
    let client = pool.next().clone();
    match eval_built::<R, _>(&client, lua, built, &build).await {
        Err(e) if e.is_cluster() => {
            masters.refresh_soon();
            match cluster::moved_to(&e) {
                Some((host, port)) => match masters.pool_at(&host, port) {
                    Ok(pool) => {
                        let client = pool.next().clone();
                        (eval_on(&client, lua, build).await, Some(client))
                    }
                    Err(e) => (Err(e), None),
                },
                None => (Err(e), None),
            }
        }
        Err(e) => {
            if *e.kind() != ErrorKind::Timeout || !pool.is_connected() {
                masters.refresh_soon();
            }
            (Err(e), Some(client))
        }
        ok => (ok, Some(client)),
    }
}

/// Whether a script whose call failed with `e` may still have run, or may run later: no
/// answer came (a timeout: the command may have been written, and a paused or slow server
/// runs it when it gets to it) or the connection failed under it. An error Redis answered
/// (`NOSCRIPT`, `MOVED`, `OOM`, a script error) means it ran nothing (our scripts write only
/// once every check has been decided).
pub(super) fn may_have_run(e: &FredError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Timeout | ErrorKind::IO | ErrorKind::Canceled
    )
}

pub(super) async fn eval_on<R: fred::types::FromValue, C: LuaInterface + Sync>(
    pool: &C,
    lua: &Lua,
    build: impl Fn() -> (Vec<Key>, Vec<Value>),
) -> Result<R, FredError> {
    eval_built(pool, lua, build(), build).await
}

/// [`eval_on`] with its keys and arguments built already (`build` makes them again if the
/// script must be sent whole).
async fn eval_built<R: fred::types::FromValue, C: LuaInterface + Sync>(
    pool: &C,
    lua: &Lua,
    (keys, args): (Vec<Key>, Vec<Value>),
    build: impl Fn() -> (Vec<Key>, Vec<Value>),
) -> Result<R, FredError> {
    match pool
        .evalsha::<R, _, _, _>(
            lua.sha.as_str(),
            MultipleKeys::from(keys),
            Value::Array(args),
        )
        .await
    {
        Err(e) if e.details().starts_with("NOSCRIPT") => {
            let (keys, args) = build();
            pool.eval::<R, _, _, _>(lua.text, MultipleKeys::from(keys), Value::Array(args))
                .await
        }
        r => r,
    }
}
