//! The leases of concurrency limits (lease.lua): places in flight that several instances
//! share.

use std::sync::atomic::Ordering;
use std::time::Duration;

use fred::bytes_utils::Str;
use fred::clients::Client;
use fred::types::{Key, Value};

use super::scripts::{eval, eval_on, static_str};
use super::{RedisError, RedisStore, backend_error};
use crate::store::StoreError;

/// What to do with a lease of a concurrency limit (see `lease.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LeaseOp {
    /// Take a lease if fewer than `max` are live.
    Acquire { max: u32 },
    /// Move a live lease's deadline.
    Renew,
    /// Put a lost lease back (its request still runs).
    Restore,
    /// Give the lease back.
    Release,
}

/// The leases of concurrency limits: places in flight that several instances share, each
/// with a deadline so that an instance that crashes leaks nothing beyond one lease time.
impl RedisStore {
    /// The Redis key of the leases of `key`, whose first `placed_by` bytes place it.
    pub(crate) fn lease_key(&self, key: &str, placed_by: usize) -> Key {
        let placement = key.get(..placed_by).unwrap_or(key);
        Key::from(self.inner.names.lease_name(key, placement))
    }

    /// A lease id no other lease of any instance has.
    pub(crate) fn new_lease_id(&self) -> Str {
        Str::from(format!(
            "{:x}.{:x}",
            self.inner.instance,
            self.inner.tokens.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// One of the pooled connections to the node that holds `key`: calls made on it run in
    /// the order they were made (an acquire, then the release that undoes it).
    pub(crate) fn connection(&self, key: &Key) -> Client {
        self.inner.backend.pool_for(key).next().clone()
    }

    /// The per-call timeout.
    pub(crate) fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Runs `op` on lease `id` of the leases at `key`, each lasting `lease` from now, on
    /// `connection` (or any): whether it did (took, renewed, released), and how many leases
    /// are live.
    pub(crate) async fn lease(
        &self,
        connection: Option<&Client>,
        key: &Key,
        id: &Str,
        op: LeaseOp,
        lease: Duration,
    ) -> Result<(bool, u64), StoreError> {
        let inner = &self.inner;
        let (name, max) = match op {
            LeaseOp::Acquire { max } => ("acquire", max),
            LeaseOp::Renew => ("renew", 0),
            LeaseOp::Restore => ("restore", 0),
            LeaseOp::Release => ("release", 0),
        };
        let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1);
        let build = || {
            let mut args: Vec<Value> = Vec::with_capacity(7);
            args.extend(inner.now_args());
            args.push(static_str(name));
            args.push(Value::String(id.clone()));
            args.push(Value::from(max.to_string()));
            args.push(Value::from(lease_ms.to_string()));
            (vec![key.clone()], args)
        };
        let out = match connection {
            Some(client) => eval_on::<Vec<i64>, _>(client, &inner.scripts.lease, build).await,
            None => eval::<Vec<i64>>(&inner.backend, &inner.scripts.lease, build).await,
        }
        .map_err(|e| backend_error(&e, inner.timeout))?;
        match out[..] {
            [ok, live] => Ok((ok == 1, u64::try_from(live).unwrap_or(0))),
            _ => Err(StoreError::Backend(Box::new(RedisError {
                message: format!("unexpected lease answer of {} values", out.len()),
            }))),
        }
    }
}
