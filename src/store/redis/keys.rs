//! Redis key names: a prefix, a hash tag we choose, the policy's namespace, the escaped key.

use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use crate::{Algorithm, Policy};

/// Escaped keys longer than this are replaced by a digest of the raw key.
pub(crate) const MAX_ESCAPED_LEN: usize = 128;

/// Which Redis Cluster hash slot a key's state goes to, decided from the key text. Checks whose
/// keys share a slot are decided by one atomic script; keys in different slots take the
/// consume-then-refund path (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySlots {
    /// Each key its own slot (spread evenly); all the policies of one key share it, so
    /// stacking per-second, per-minute and per-day limits on one key is one atomic step.
    #[default]
    PerKey,
    /// The key up to the first occurrence of the delimiter (or the whole key) picks the slot:
    /// with `'|'`, `acme|user:42` and `acme|tenant` share one slot. Through a
    /// [`Limiter`](crate::limiter::Limiter), the key is the one the rule's extractor found
    /// (the rule's name the limiter adds does not count, see
    /// [`Check::placed_by`](crate::Check::placed_by)): with `'/'`, a per-user rule keyed by
    /// `Extension::<Tenant>::new().and(Extension::<User>::new())` (`acme/42`) and a per-tenant
    /// rule keyed by `Extension::<Tenant>::new()` (`acme`) share one slot, and their stack is
    /// decided by one script. A key the limiter hashed (longer than
    /// [`MAX_KEY_LEN`](crate::key::MAX_KEY_LEN)) is placed by its hash.
    UntilDelimiter(char),
    /// Every key in one slot: every stacked check is atomic, and one Cluster node carries all
    /// the load.
    Single,
}

/// The short name of each algorithm in key names; it names the state's layout too (`sl2`: the
/// sliding log's running sums, whose keys never meet the `sl` lists of older versions).
pub(crate) fn algorithm_code(a: Algorithm) -> &'static str {
    match a {
        Algorithm::FixedWindow => "fw",
        Algorithm::SlidingLog => "sl2",
        Algorithm::SlidingWindow => "sw",
        Algorithm::TokenBucket => "tb",
        Algorithm::LeakyBucket => "lb",
        Algorithm::Gcra => "gcra",
    }
}

/// FNV-1a, 64 bits: stable across versions and platforms (key names must not change when the
/// crate or the machine does).
pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // A separator byte that cannot be confused with data of another split.
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A stable fingerprint of a policy: algorithm, limit, period and name.
pub(crate) fn policy_fingerprint(policy: &Policy) -> u64 {
    fnv1a(&[
        policy.algorithm().as_str().as_bytes(),
        &policy.limit().to_le_bytes(),
        &policy.period_nanos().to_le_bytes(),
        policy.name().unwrap_or("").as_bytes(),
    ])
}

/// Builds Redis key names.
#[derive(Clone, Debug)]
pub(crate) struct KeyNames {
    pub(crate) prefix: String,
    pub(crate) slots: KeySlots,
}

impl KeyNames {
    /// `{prefix}{tag}:{algorithm}:{fingerprint}:{key}` where `tag` is a digest of the part of
    /// the key that picks the slot, and `key` is the user's key escaped (bytes outside
    /// printable ASCII, and `{ } % #`, as `%XX`) or, when that is longer than
    /// [`MAX_ESCAPED_LEN`], `#` and the SHA-256 of the raw key.
    pub(crate) fn name(&self, key: &str, policy: &Policy) -> String {
        self.placed_name(key, key, policy)
    }

    /// [`KeyNames::name`], with the slot picked from `placement` (the start of `key` that
    /// places it) under [`KeySlots::UntilDelimiter`].
    pub(crate) fn placed_name(&self, key: &str, placement: &str, policy: &Policy) -> String {
        let mut out = self.start(key, placement);
        let _ = write!(
            out,
            "{}:{:016x}:",
            algorithm_code(policy.algorithm()),
            policy_fingerprint(policy)
        );
        escape_into(&mut out, key);
        out
    }

    /// The sorted set of a concurrency limit's leases for `key`:
    /// `{prefix}{tag}:cc:{key}`, placed as [`KeyNames::placed_name`] places it.
    pub(crate) fn lease_name(&self, key: &str, placement: &str) -> String {
        let mut out = self.start(key, placement);
        out.push_str("cc:");
        escape_into(&mut out, key);
        out
    }

    /// `{prefix}{tag}:`, the tag picked from the key as the slot strategy says.
    fn start(&self, key: &str, placement: &str) -> String {
        let tag_text = match &self.slots {
            KeySlots::PerKey => key,
            KeySlots::UntilDelimiter(c) => {
                let placement = without_or_tags(placement);
                placement.split(*c).next().unwrap_or(placement)
            }
            KeySlots::Single => "",
        };
        let tag = fnv1a(&[tag_text.as_bytes()]);
        let mut out = String::with_capacity(self.prefix.len() + 48 + key.len().min(160));
        let _ = write!(out, "{}{{{:016x}}}:", self.prefix, tag);
        out
    }
}

/// A key without the tags that [`KeyExtractor::or`](crate::key::KeyExtractor::or) puts in
/// front (`%|0|`, `%|1|`): they would place every key of a branch in one slot.
fn without_or_tags(mut key: &str) -> &str {
    while let Some(rest) = key
        .strip_prefix("%|0|")
        .or_else(|| key.strip_prefix("%|1|"))
    {
        key = rest;
    }
    key
}

fn escape_into(out: &mut String, key: &str) {
    let escaped_len: usize = key.bytes().map(|b| if keeps(b) { 1 } else { 3 }).sum();
    if escaped_len > MAX_ESCAPED_LEN {
        out.push('#');
        for b in Sha256::digest(key.as_bytes()) {
            let _ = write!(out, "{b:02x}");
        }
        return;
    }
    for b in key.bytes() {
        if keeps(b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

fn keeps(b: u8) -> bool {
    (0x21..=0x7e).contains(&b) && !matches!(b, b'{' | b'}' | b'%' | b'#')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn names() -> KeyNames {
        KeyNames {
            prefix: "t:".into(),
            slots: KeySlots::PerKey,
        }
    }

    #[test]
    fn user_text_never_reaches_redis_raw() {
        let p = Policy::fixed_window(10, Duration::from_secs(1)).unwrap();
        let k = names().name("{evil}\n key%#", &p);
        let user = k.rsplit(':').next().unwrap();
        assert_eq!(user, "%7Bevil%7D%0A%20key%25%23");
        // Exactly one brace pair: ours.
        assert_eq!(k.matches('{').count(), 1);
        assert_eq!(k.matches('}').count(), 1);
        assert!(k.starts_with("t:{"));
    }

    #[test]
    fn long_keys_are_hashed_and_bounded() {
        let p = Policy::gcra(crate::Rate::per_second(1), 1).unwrap();
        let a = names().name(&"x".repeat(20_000), &p);
        let b = names().name(&"x".repeat(20_001), &p);
        assert!(a.len() < 120 && b.len() < 120, "{a}");
        assert_ne!(a, b);
        // A short key cannot imitate a hashed one: `#` is escaped.
        let hashed = a.rsplit(':').next().unwrap();
        assert!(!names().name(hashed, &p).ends_with(hashed));
    }

    #[test]
    fn lease_sets_are_placed_like_the_key_and_apart_from_policies() {
        let n = KeyNames {
            prefix: "t:".into(),
            slots: KeySlots::UntilDelimiter('@'),
        };
        let p = Policy::gcra(crate::Rate::per_second(1), 1).unwrap();
        let lease = n.lease_name("u1@per-user", "u1");
        let state = n.placed_name("u1@per-user", "u1", &p);
        assert_eq!(lease[..20], state[..20], "one slot: {lease} {state}");
        assert!(lease.ends_with(":cc:u1@per-user"), "{lease}");
        assert_ne!(lease, n.lease_name("u2@per-user", "u2"));
        assert_eq!(n.lease_name("{x}", "{x}").matches('{').count(), 1);
    }

    #[test]
    fn or_tags_do_not_pick_the_slot() {
        let n = KeyNames {
            prefix: "t:".into(),
            slots: KeySlots::UntilDelimiter('|'),
        };
        let p = crate::Policy::gcra(crate::Rate::per_second(1), 1).unwrap();
        let tag = |key: &str| n.placed_name(key, key, &p)[..20].to_owned();
        assert_eq!(tag("%|1|acme|u1"), tag("acme|u2"));
        assert_eq!(tag("%|0|%|1|acme|u1"), tag("acme"));
        assert_ne!(tag("%|1|203.0.113.9"), tag("%|1|198.51.100.7"));
    }

    #[test]
    fn namespaces_differ_by_policy_and_slots_follow_the_strategy() {
        let p1 = Policy::fixed_window(10, Duration::from_secs(1)).unwrap();
        let p2 = Policy::fixed_window(11, Duration::from_secs(1)).unwrap();
        let p3 = Policy::sliding_window(10, Duration::from_secs(1)).unwrap();
        let n = names();
        let (a, b, c) = (n.name("k", &p1), n.name("k", &p2), n.name("k", &p3));
        assert!(a != b && b != c && a != c);
        let tag = |s: &str| s[s.find('{').unwrap()..=s.find('}').unwrap()].to_owned();
        assert_eq!(tag(&a), tag(&c));
        let n = KeyNames {
            prefix: "t:".into(),
            slots: KeySlots::UntilDelimiter('|'),
        };
        assert_eq!(
            tag(&n.name("acme|u1", &p1)),
            tag(&n.name("acme|tenant", &p2))
        );
        assert_ne!(tag(&n.name("acme|u1", &p1)), tag(&n.name("bcme|u1", &p1)));
    }
}
