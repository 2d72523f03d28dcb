//! Internals the fuzz targets (`fuzz/`) and their replay test (`tests/fuzz_replay.rs`) reach.
//! Not part of the API: hidden from the docs, and free to change in any release.

use crate::Policy;
use crate::store::redis::KeySlots;
use crate::store::redis::keys::{KeyNames, MAX_ESCAPED_LEN};

/// The longest escaped key kept as text in a Redis key name; longer ones are hashed.
pub const REDIS_MAX_ESCAPED_LEN: usize = MAX_ESCAPED_LEN;

/// The Redis key name of `key`'s state under `policy`, placed by `placement` (see
/// [`KeySlots`]), as [`RedisStore`](crate::RedisStore) writes it.
pub fn redis_key_name(
    prefix: &str,
    slots: KeySlots,
    key: &str,
    placement: &str,
    policy: &Policy,
) -> String {
    KeyNames {
        prefix: prefix.into(),
        slots,
    }
    .placed_name(key, placement, policy)
}

/// The Redis key name of `key`'s concurrency leases, placed by `placement`.
pub fn redis_lease_name(prefix: &str, slots: KeySlots, key: &str, placement: &str) -> String {
    KeyNames {
        prefix: prefix.into(),
        slots,
    }
    .lease_name(key, placement)
}
