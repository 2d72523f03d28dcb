//! Where limiter state lives: the [`Store`] trait and the in-process [`MemoryStore`].
//!
//! A store answers one question: given some (key, policy, cost) checks, are they all admitted
//! right now? It decides all of them atomically: a request that one check rejects consumes
//! from none of them. Layers are generic over the store, so the in-process store's ready
//! future is never boxed.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Check, MemoryStore, Policy, Rate};
//! use tollgate::clock::ManualClock;
//!
//! # tokio_test_block_on(async {
//! let per_user = Policy::token_bucket(Rate::per_second(1), 2)?;
//! let per_tenant = Policy::fixed_window(3, Duration::from_secs(60))?;
//! let store = MemoryStore::with_clock(ManualClock::new());
//!
//! let request = |user| [Check::new(user, &per_user, 1), Check::new("tenant:7", &per_tenant, 1)];
//! assert!(store.check_all(&request("user:1")).await?.allowed());
//! assert!(store.check_all(&request("user:1")).await?.allowed());
//! assert!(!store.check_all(&request("user:1")).await?.allowed()); // user:1 is out of tokens
//! assert!(store.check_all(&request("user:2")).await?.allowed()); // and the tenant paid nothing
//! let d = store.check_all(&request("user:3")).await?;
//! assert!(!d.allowed() && d.index() == 1); // now the tenant is the one saying no
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
//! # }
//! ```

mod memory;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
pub mod resilient;

pub use memory::{
    DEFAULT_MAX_KEY_LEN, DEFAULT_MAX_KEYS, DEFAULT_MEMORY_STORE_NAME, DEFAULT_SHARDS, MemoryStore,
    MemoryStoreBuilder,
};
pub use resilient::{FailurePolicy, ResilientStore};

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::{Decision, Policy};

/// One check of a request: a key, the policy it is counted under, and what the request costs.
#[derive(Clone, Copy, Debug)]
pub struct Check<'a> {
    key: &'a str,
    policy: &'a Policy,
    cost: u64,
    /// How many bytes at the start of the key place it; the whole key unless set.
    placed_by: usize,
}

impl<'a> Check<'a> {
    /// Checks `cost` units against `policy` for `key`.
    pub const fn new(key: &'a str, policy: &'a Policy, cost: u64) -> Self {
        Self {
            key,
            policy,
            cost,
            placed_by: usize::MAX,
        }
    }

    /// Only the first `len` bytes of the key decide where a store that places keys by their
    /// text puts it (the Redis store under
    /// [`KeySlots::UntilDelimiter`](crate::store::redis::KeySlots)); the rest tells keys apart
    /// without moving them. The [`Limiter`](crate::limiter::Limiter) marks this way the key its
    /// extractor found, before the rule's name (`acme/42@per-user` is placed by `acme/42`).
    pub const fn placed_by(mut self, len: usize) -> Self {
        self.placed_by = len;
        self
    }

    /// The same check at another cost.
    #[cfg(feature = "redis")]
    pub(crate) const fn with_cost(mut self, cost: u64) -> Self {
        self.cost = cost;
        self
    }

    /// The key.
    pub const fn key(&self) -> &'a str {
        self.key
    }

    /// The part of the key that places it (see [`Check::placed_by`]): the whole key unless
    /// set, or if `len` is past its end or inside a character.
    pub fn placement(&self) -> &'a str {
        self.key.get(..self.placed_by).unwrap_or(self.key)
    }

    /// The policy.
    pub const fn policy(&self) -> &'a Policy {
        self.policy
    }

    /// The cost.
    pub const fn cost(&self) -> u64 {
        self.cost
    }

    /// The error for a cost that the policy can never admit, if this is one.
    pub(crate) fn validate(&self, index: usize, max_key_len: usize) -> Result<(), StoreError> {
        if self.cost > self.policy.limit() {
            return Err(StoreError::CostExceedsLimit {
                index,
                cost: self.cost,
                limit: self.policy.limit(),
            });
        }
        if self.key.len() > max_key_len {
            return Err(StoreError::KeyTooLong {
                index,
                len: self.key.len(),
                max: max_key_len,
            });
        }
        Ok(())
    }
}

/// Limiter state, in process or shared.
///
/// `check_all` decides every check atomically and returns the decision a client must obey,
/// whose [`Decision::index`] says which check it came from: a rejection (the longest wait)
/// over any admission, and among admissions the check that runs out first for requests of
/// their costs (the fewest further requests; then the smallest remainder, then the latest
/// reset).
/// When any check rejects, nothing is consumed from any of them. An empty slice is admitted
/// with `limit` and `remaining` of `u64::MAX`.
///
/// The future is named so that the in-process store returns a ready future and nothing is
/// boxed; a network store boxes. It is `'static`: the store copies what it needs from the
/// checks before returning it.
pub trait Store: Send + Sync + 'static {
    /// The future of a check.
    type Future: Future<Output = Result<Decision, StoreError>> + Send + 'static;

    /// Decides all `checks` at once: all admitted, or none consumed.
    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future;

    /// Decides one check.
    fn check(&self, key: &str, policy: &Policy, cost: u64) -> Self::Future {
        self.check_all(&[Check::new(key, policy, cost)])
    }

    /// The longest key this store decides, if it has a bound (longer keys get
    /// [`StoreError::KeyTooLong`]). A [`Limiter`](crate::limiter::Limiter) refuses to be built
    /// over a store whose bound is below the keys it makes.
    fn max_key_len(&self) -> Option<usize> {
        None
    }

    /// Which part of the backend decides `check`, for a store whose parts fail apart (a Redis
    /// Cluster's masters): [`ResilientStore`] keeps a circuit breaker per part, so that one
    /// part down fails only the checks it decides. `None` (the default): the store is one
    /// whole. Called once per check of every call through a `ResilientStore`: keep it cheap.
    fn partition(&self, check: &Check<'_>) -> Option<u32> {
        let _ = check;
        None
    }
}

impl<S: Store> Store for Arc<S> {
    type Future = S::Future;

    fn max_key_len(&self) -> Option<usize> {
        (**self).max_key_len()
    }

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        (**self).check_all(checks)
    }

    fn partition(&self, check: &Check<'_>) -> Option<u32> {
        (**self).partition(check)
    }

    fn check(&self, key: &str, policy: &Policy, cost: u64) -> Self::Future {
        (**self).check(key, policy, cost)
    }
}

/// The decision for an empty stack of checks.
pub(crate) const NOTHING_TO_CHECK: Decision =
    Decision::admitted(u64::MAX, u64::MAX, Duration::ZERO);

/// A boxed error from a store's backend.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a store could not decide. Never a rejection: a rejection is an `Ok(Decision)`.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The check at `index` costs more than its policy can ever admit.
    CostExceedsLimit {
        /// Which check of the call.
        index: usize,
        /// Its cost.
        cost: u64,
        /// The policy's limit (or burst).
        limit: u64,
    },
    /// The key of the check at `index` is longer than the store accepts.
    KeyTooLong {
        /// Which check of the call.
        index: usize,
        /// The key's length in bytes.
        len: usize,
        /// The most the store accepts.
        max: usize,
    },
    /// The store cannot run the policy of the check at `index` exactly (a bound of its
    /// arithmetic; see `RedisStore::supports`). A configuration error, not a store failure.
    Unsupported {
        /// Which check of the call.
        index: usize,
        /// Why, naming the value and the bound.
        reason: String,
    },
    /// The backend did not answer within the configured time.
    Timeout(Duration),
    /// The backend is considered down (a circuit breaker is open); it was not asked.
    CircuitOpen,
    /// The backend failed.
    Backend(BoxError),
    /// The store refused the call before asking its backend, for lack of room of its own
    /// (the Redis store's bound on calls across slots in flight): not a sign of the backend's
    /// health, so no circuit breaker counts it; the failure policy answers.
    Busy(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::CostExceedsLimit { index, cost, limit } => write!(
                f,
                "check {index} costs {cost}, more than its policy's limit of {limit}: it could never be admitted"
            ),
            StoreError::KeyTooLong { index, len, max } => write!(
                f,
                "the key of check {index} is {len} bytes long, more than the {max} the store accepts"
            ),
            StoreError::Unsupported { index, reason } => {
                write!(f, "the policy of check {index} is not supported: {reason}")
            }
            StoreError::Timeout(after) => write!(f, "the store did not answer within {after:?}"),
            StoreError::CircuitOpen => f.write_str("the store is considered down (circuit open)"),
            StoreError::Backend(e) => write!(f, "the store failed: {e}"),
            StoreError::Busy(why) => write!(f, "the store is busy: {why}"),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Backend(e) => Some(&**e),
            _ => None,
        }
    }
}
