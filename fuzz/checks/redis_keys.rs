//! Redis key names: distinct keys never share a name (the escaped text decodes back to the
//! key; a hashed key carries the SHA-256 of the whole key), names stay short, and no key picks
//! its Cluster slot (the name's hash tag is always the one tollgate wrote, from the part of the
//! key the slot strategy names).

use sha2::{Digest, Sha256};
use tollgate::__fuzz::{REDIS_MAX_ESCAPED_LEN, redis_key_name, redis_lease_name};
use tollgate::store::redis::KeySlots;
use tollgate::{Check, Policy, Rate};

use crate::input::Input;

pub(crate) fn check(data: &[u8]) {
    let mut input = Input::new(data);
    let prefix = *input.pick(&["tollgate:", "", "app:v2:"]);
    let slots = match input.u8() % 4 {
        0 => KeySlots::PerKey,
        1 => KeySlots::Single,
        2 => KeySlots::UntilDelimiter(*input.pick(&['|', '/', '@', ':', '{', 'é'])),
        _ => KeySlots::UntilDelimiter(char::from_u32(input.u32() % 0x11_0000).unwrap_or('|')),
    };
    let policy = *input.pick(&[0usize, 1, 2]);
    let policy = [
        Policy::fixed_window(10, std::time::Duration::from_secs(1)).unwrap(),
        Policy::gcra(Rate::per_second(5), 10).unwrap(),
        Policy::sliding_log(3, std::time::Duration::from_secs(60))
            .unwrap()
            .named("login")
            .unwrap(),
    ][policy]
        .clone();
    let placed_by = input.below(200);
    let bytes = input.until(0xff);
    let other = input.rest();
    let a = String::from_utf8_lossy(bytes).into_owned();
    let b = String::from_utf8_lossy(other).into_owned();

    let name_a = one_key(prefix, &slots, &a, placed_by, &policy);
    let name_b = one_key(prefix, &slots, &b, placed_by, &policy);
    if a != b {
        assert_ne!(name_a, name_b, "{a:?} and {b:?} share a name");
    }
    let lease = redis_lease_name(prefix, slots.clone(), &a, &a);
    assert_ne!(lease, name_a, "a lease set never shares a state's name");
    assert_eq!(
        hash_tag(&lease),
        hash_tag(&redis_key_name(prefix, slots, &a, &a, &policy))
    );
    let user = user_part(&lease, prefix)
        .strip_prefix("cc:")
        .unwrap_or_else(|| panic!("{lease:?}"));
    holds(user, &a, &lease);
}

/// The checks on the name of one key; returns the name.
fn one_key(prefix: &str, slots: &KeySlots, key: &str, placed_by: usize, policy: &Policy) -> String {
    let placement = Check::new(key, policy, 0).placed_by(placed_by).placement();
    let name = redis_key_name(prefix, slots.clone(), key, placement, policy);
    // Short whatever the key: prefix, tag, algorithm, fingerprint, and at most 128 bytes or a
    // 65-byte digest.
    assert!(
        name.len() <= prefix.len() + 20 + 5 + 17 + REDIS_MAX_ESCAPED_LEN,
        "{} bytes: {name:?}",
        name.len()
    );
    // Printable ASCII without white space: safe in any Redis command or log line.
    assert!(name.bytes().all(|b| b.is_ascii_graphic()), "{name:?}");
    // The hash tag Redis Cluster reads (the first `{...}` with something inside) is ours.
    let tag = hash_tag(&name).unwrap_or_else(|| panic!("no hash tag in {name:?}"));
    assert_eq!(name.find('{'), Some(prefix.len()), "{name:?}");
    let tagged = match slots {
        KeySlots::PerKey => key,
        KeySlots::Single => "",
        KeySlots::UntilDelimiter(c) => {
            let mut placement = placement;
            while let Some(rest) = placement
                .strip_prefix("%|0|")
                .or_else(|| placement.strip_prefix("%|1|"))
            {
                placement = rest;
            }
            placement.split(*c).next().unwrap_or(placement)
        }
        _ => unreachable!(),
    };
    assert_eq!(
        tag,
        format!("{:016x}", fnv1a(tagged.as_bytes())),
        "{name:?}"
    );
    // The key decodes back from the name, or the name carries the digest of the whole key.
    let user = user_part(&name, prefix);
    let user = user
        .splitn(3, ':')
        .nth(2)
        .unwrap_or_else(|| panic!("no algorithm and fingerprint in {name:?}"));
    holds(user, key, &name);
    name
}

/// Whether the end of a name stands for `key`: it decodes back to the key, or it is `#` and
/// the SHA-256 of the whole key.
fn holds(user: &str, key: &str, name: &str) {
    if escaped_len(key) <= REDIS_MAX_ESCAPED_LEN {
        assert_eq!(decode(user).as_deref(), Some(key), "{name:?}");
    } else {
        let digest: String = Sha256::digest(key.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(user, format!("#{digest}"), "{name:?}");
    }
}

/// What follows `{prefix}{tag}:`.
fn user_part<'n>(name: &'n str, prefix: &str) -> &'n str {
    let rest = name.strip_prefix(prefix).expect("the prefix comes first");
    rest.get(19..)
        .expect("a 16-digit tag in braces and a colon")
}

/// The hash tag Redis Cluster computes a slot from: the text between the first `{` and the
/// first `}` after it, if not empty.
fn hash_tag(name: &str) -> Option<&str> {
    let open = name.find('{')?;
    let close = name[open + 1..].find('}')? + open + 1;
    (close > open + 1).then(|| &name[open + 1..close])
}

/// Undoes the escaping: `%XX` is a byte, other characters stand for themselves; `None` for a
/// name that escaping could not have written.
fn decode(text: &str) -> Option<String> {
    let mut out = Vec::new();
    let mut bytes = text.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hex = [bytes.next()?, bytes.next()?];
                let byte = u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?;
                if kept(byte) || hex.iter().any(u8::is_ascii_lowercase) {
                    return None;
                }
                out.push(byte);
            }
            b if kept(b) => out.push(b),
            _ => return None,
        }
    }
    String::from_utf8(out).ok()
}

fn kept(b: u8) -> bool {
    b.is_ascii_graphic() && !b"{}%#".contains(&b)
}

fn escaped_len(key: &str) -> usize {
    key.bytes().map(|b| if kept(b) { 1 } else { 3 }).sum()
}

/// FNV-1a 64 of one part, as the key names use it (a 0xff separator after the part).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes.iter().chain(&[0xff]) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
