//! The trusted-network parser (`Forwarded::trusting`): it accepts exactly the networks of the
//! reference grammar, and trusts exactly the addresses inside them (seen through
//! `X-Forwarded-For`: a trusted peer's header is believed, an untrusted peer's is not).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tollgate::key::Forwarded;

use crate::forwarded::{request, same_prefix};
use crate::input::Input;

/// Networks written the usual ways, for the fuzzer to start from.
const SEEDS: &[&str] = &[
    "10.0.0.0/8",
    "192.168.1.1",
    "fd00::/8",
    "::ffff:10.0.0.0/104",
    "::/0",
];

pub(crate) fn check(data: &[u8]) {
    let mut input = Input::new(data);
    let text: String = match input.u8() % 4 {
        0 => input.pick(SEEDS).to_string(),
        _ => String::from_utf8_lossy(input.until(0)).into_owned(),
    };
    let parsed = Forwarded::trusting([text.as_str()]);
    let model = reference_network(&text);
    assert_eq!(
        parsed.is_ok(),
        model.is_some(),
        "{text:?}: parsed {parsed:?}, the reference says {model:?}"
    );
    let (Ok(forwarded), Some((net, bits))) = (parsed, model) else {
        return;
    };
    let forwarded = forwarded.ipv4_prefix(32).ipv6_prefix(128);
    // A peer near the network's address (some low bits flipped), or anywhere.
    let peer = match input.u8() % 3 {
        0 => flip(net, input.u64(), input.u8()),
        1 => IpAddr::V4(Ipv4Addr::from(input.u32())),
        _ => IpAddr::V6(Ipv6Addr::from_bits(
            u128::from(input.u64()) << 64 | u128::from(input.u64()),
        )),
    };
    let header = if peer.to_canonical() == IpAddr::from([192, 0, 2, 255]) {
        "198.51.100.1"
    } else {
        "192.0.2.255"
    };
    let parts = request(
        SocketAddr::new(peer, 1),
        [("x-forwarded-for", header.as_bytes())].into_iter(),
    );
    let trusted = same_prefix(net, peer.to_canonical(), bits);
    let key = forwarded.client_addr(&parts).expect("a key");
    let want = if trusted {
        header.parse().unwrap()
    } else {
        peer.to_canonical()
    };
    assert_eq!(key, want, "{text:?} trusts {peer}: {trusted}");
}

/// The reference grammar: an address (as std reads it), optionally `/` and a decimal prefix
/// length (digits) of at most 32 (IPv4) or 128 (IPv6), white space around the whole. An
/// IPv4-mapped IPv6 network is the IPv4 network it maps (`::ffff:10.0.0.0/104` is
/// `10.0.0.0/8`), since peers are compared as IPv4.
fn reference_network(text: &str) -> Option<(IpAddr, u32)> {
    let text = text.trim();
    let (addr, bits) = match text.split_once('/') {
        Some((a, b)) => (a, Some(b)),
        None => (text, None),
    };
    let addr: IpAddr = addr.parse().ok()?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let bits = match bits {
        Some(b) if !b.is_empty() && b.bytes().all(|c| c.is_ascii_digit()) => {
            b.parse::<u32>().ok().filter(|&b| b <= max)?
        }
        Some(_) => return None,
        None => max,
    };
    match addr {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => {
            let v4 = IpAddr::V4(v6.to_ipv4_mapped()?);
            // The mapped prefix ::ffff:0:0/96 is all of IPv4; a shorter one is not a network
            // of IPv4 addresses.
            (bits >= 96).then(|| (v4, bits - 96))
        }
        _ => Some((addr, bits)),
    }
}

fn flip(ip: IpAddr, mask: u64, width: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let m = (mask as u32) & u32::MAX.checked_shr(u32::from(width % 33)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from_bits(v4.to_bits() ^ m))
        }
        IpAddr::V6(v6) => {
            let m = u128::from(mask) & u128::MAX.checked_shr(u32::from(width % 129)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() ^ m))
        }
    }
}
