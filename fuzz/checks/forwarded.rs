//! The forwarded-address parsers (`X-Forwarded-For`, RFC 7239 `Forwarded`) through
//! [`Forwarded`]'s public API, against a reference walk, and the promise that a client behind
//! a trusted proxy never chooses its key.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use http::HeaderValue;
use tollgate::key::{Forwarded, KeyExtractor};

use crate::input::Input;

const TRUSTED: &[&[&str]] = &[
    &["10.0.0.0/8", "fd00::/8"],
    &["10.0.0.0/8", "192.168.0.0/16", "2001:db8::/32"],
    &["0.0.0.0/0", "::/0"],
    &["10.1.2.3", "::1"],
    &[],
];

const PEERS: &[&str] = &[
    "10.0.0.1:1",
    "192.168.7.7:2",
    "[fd00::1]:3",
    "[::ffff:10.1.2.3]:4",
    "203.0.113.50:5",
    "[2001:db8::9]:6",
    "[::1]:7",
];

/// Addresses the structured `Forwarded` cases are made of, trusted and not.
const NODES: &[&str] = &[
    "10.0.0.7",
    "10.1.2.3",
    "192.168.0.9",
    "203.0.113.9",
    "198.51.100.7",
    "fd00::17",
    "2001:db8::17",
    "2001:db8:cafe::1",
    "::ffff:10.2.2.2",
    "::1",
];

pub(crate) fn check(data: &[u8]) {
    let mut input = Input::new(data);
    match input.u8() % 3 {
        0 => against_the_reference(&mut input),
        1 => client_never_chooses(&mut input),
        _ => structured_forwarded(&mut input),
    }
}

/// Arbitrary header lines: no panic, the key is bounded, and `X-Forwarded-For` walks as the
/// reference walk does.
fn against_the_reference(input: &mut Input<'_>) {
    let trusted = *input.pick(TRUSTED);
    let peer: SocketAddr = input.pick(PEERS).parse().unwrap();
    let rfc7239 = input.bool();
    let lines: Vec<Vec<u8>> = input
        .rest()
        .split(|&b| b == b'\n')
        .take(8)
        .map(header_bytes)
        .collect();
    let name = if rfc7239 {
        "forwarded"
    } else {
        "x-forwarded-for"
    };
    let parts = request(peer, lines.iter().map(|l| (name, l.as_slice())));
    let exact = exact(trusted, rfc7239);
    let got = exact.client_addr(&parts).expect("a peer address is a key");
    // Grouped by default, the key is short whatever the header held.
    let grouped = forwarded(trusted, rfc7239).extract(&parts).expect("a key");
    assert!(grouped.as_str().len() <= 43, "{grouped:?}");
    let peer_ip = peer.ip().to_canonical();
    if !model_trusted(trusted, peer_ip) {
        assert_eq!(got, peer_ip, "an untrusted peer is its own key");
    }
    if !rfc7239 {
        let want = reference_xff(trusted, peer_ip, &lines);
        assert_eq!(got, want, "X-Forwarded-For {lines:?} behind {trusted:?}");
    }
    assert_eq!(
        exact.extract(&parts).expect("a key").as_str(),
        got.to_string(),
        "an exact key is the address as std writes it"
    );
}

/// Whatever a client writes before what a trusted proxy appends, the key is the address the
/// proxy wrote.
fn client_never_chooses(input: &mut Input<'_>) {
    let rfc7239 = input.bool();
    let own_line = input.bool();
    let (element, client) = if rfc7239 {
        *input.pick(&[
            ("for=203.0.113.9", "203.0.113.9"),
            ("for=\"[2001:db8:cafe::17]:4711\"", "2001:db8:cafe::17"),
            ("for=203.0.113.9;proto=https;by=10.0.0.1", "203.0.113.9"),
            ("for=203.0.113.9, for=10.0.0.7", "203.0.113.9"),
            ("for=\"203.0.113.9\"", "203.0.113.9"),
        ])
    } else {
        *input.pick(&[
            ("203.0.113.9", "203.0.113.9"),
            ("2001:db8:cafe::17", "2001:db8:cafe::17"),
            ("[2001:db8:cafe::17]:4711", "2001:db8:cafe::17"),
            ("203.0.113.9, 10.0.0.7", "203.0.113.9"),
            ("203.0.113.9:80", "203.0.113.9"),
        ])
    };
    let written = header_bytes(input.rest());
    let name = if rfc7239 {
        "forwarded"
    } else {
        "x-forwarded-for"
    };
    let joined = [&written[..], b", ", element.as_bytes()].concat();
    let lines: Vec<&[u8]> = if own_line {
        vec![&written, element.as_bytes()]
    } else {
        vec![&joined]
    };
    let peer: SocketAddr = "10.0.0.1:1".parse().unwrap();
    let parts = request(peer, lines.iter().map(|l| (name, *l)));
    let trusted: &[&str] = &["10.0.0.0/8"];
    let got = exact(trusted, rfc7239).client_addr(&parts);
    assert_eq!(
        got,
        Some(client.parse().unwrap()),
        "the client wrote {:?} before {element:?}",
        String::from_utf8_lossy(&written)
    );
}

/// Well-formed `Forwarded` lines made of chosen elements: the key is what the reference walk
/// finds in them.
fn structured_forwarded(input: &mut Input<'_>) {
    let trusted = *input.pick(TRUSTED);
    let peer: SocketAddr = input.pick(PEERS).parse().unwrap();
    let mut lines: Vec<String> = Vec::new();
    let mut hops: Vec<Option<IpAddr>> = Vec::new();
    let lines_wanted = 1 + input.below(3);
    for _ in 0..lines_wanted {
        let mut line = String::new();
        for e in 0..1 + input.below(5) {
            if e > 0 {
                line.push_str(input.pick::<&str>(&[",", ", ", " ,\t", ", , "]));
            }
            let (text, hop) = element(input);
            line.push_str(&text);
            hops.push(hop);
        }
        lines.push(line);
    }
    let parts = request(peer, lines.iter().map(|l| ("forwarded", l.as_bytes())));
    let got = exact(trusted, true).client_addr(&parts);
    let want = walk(
        trusted,
        peer.ip().to_canonical(),
        hops.iter().rev().copied(),
    );
    assert_eq!(got, Some(want), "Forwarded {lines:?} behind {trusted:?}");
}

/// One well-formed element (pairs in any order, `for` at most once unless `repeat`), and its
/// address.
fn element(input: &mut Input<'_>) -> (String, Option<IpAddr>) {
    let mut pairs: Vec<String> = Vec::new();
    let mut address = None;
    let mut malformed = false;
    let mut seen = [false; 4];
    for _ in 0..1 + input.below(4) {
        let which = input.below(5);
        if which < 4 && std::mem::replace(&mut seen[which], true) {
            // A parameter given twice: the element has no address.
            malformed = true;
        }
        let name = ["for", "by", "host", "proto", "ext"][which];
        let name = if input.bool() {
            name.to_ascii_uppercase()
        } else {
            name.to_owned()
        };
        let (value, ip) = match which {
            0 | 1 => node(input),
            2 => ("example.com".to_owned(), None),
            3 => (
                input.pick(&["http", "https", "\"https\""]).to_string(),
                None,
            ),
            _ => (
                input
                    .pick(&["\"a,b;c\"", "x", "\"\\\"\"", "\"=,\""])
                    .to_string(),
                None,
            ),
        };
        if which == 0 {
            address = ip;
        }
        pairs.push(format!("{name}={value}"));
    }
    let sep = *input.pick(&[";", " ; ", ";\t"]);
    let hop = if malformed { None } else { address };
    (pairs.join(sep), hop)
}

/// A node value as proxies write it, and its address.
fn node(input: &mut Input<'_>) -> (String, Option<IpAddr>) {
    let ip: IpAddr = input.pick(NODES).parse().unwrap();
    let canonical = Some(ip.to_canonical());
    match (ip, input.below(6)) {
        (_, 0) => (
            input
                .pick(&["unknown", "_hidden", "\"_x.y-z\""])
                .to_string(),
            None,
        ),
        (IpAddr::V4(v4), 1) => (format!("{v4}"), canonical),
        (IpAddr::V4(v4), 2) => (format!("{v4}:{}", input.u16()), canonical),
        (IpAddr::V4(v4), 3) => (format!("\"{v4}:_p{}\"", input.u8()), canonical),
        (IpAddr::V4(v4), _) => (format!("\"{v4}\""), canonical),
        (IpAddr::V6(v6), 1) => (format!("\"[{v6}]\""), canonical),
        (IpAddr::V6(v6), 2) => (format!("\"[{v6}]:{}\"", input.u16()), canonical),
        // An escaped character inside the quoted string reads as itself.
        (IpAddr::V6(v6), 3) => (format!("\"[\\{v6}]\""), canonical),
        (IpAddr::V6(v6), 4) => (format!("\"[{v6}]:_obf\""), canonical),
        (IpAddr::V6(v6), _) => (format!("{v6}"), canonical),
    }
}

/// The hops from the right: the first untrusted address, the last trusted one when a hop is
/// not an address or after 32 hops, else the leftmost.
fn walk(trusted: &[&str], peer: IpAddr, hops: impl Iterator<Item = Option<IpAddr>>) -> IpAddr {
    if !model_trusted(trusted, peer) {
        return peer;
    }
    let mut last = peer;
    for (i, hop) in hops.enumerate() {
        match hop {
            _ if i >= 32 => return last,
            None => return last,
            Some(ip) if model_trusted(trusted, ip) => last = ip,
            Some(ip) => return ip,
        }
    }
    last
}

/// `X-Forwarded-For` as a reference: the lines are one comma-separated list.
fn reference_xff(trusted: &[&str], peer: IpAddr, lines: &[Vec<u8>]) -> IpAddr {
    let joined = lines.join(&b","[..]);
    let hops: Vec<Option<IpAddr>> = joined
        .split(|&b| b == b',')
        .map(|e| reference_node(trim_ows(e)))
        .collect();
    walk(trusted, peer, hops.into_iter().rev())
}

fn trim_ows(mut b: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = b {
        b = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = b {
        b = rest;
    }
    b
}

/// `a.b.c.d`, `a.b.c.d:port`, an IPv6 address, `[v6]` or `[v6]:port`; a port is decimal up to
/// 65535 or `_` and an obfuscated name; at most 64 bytes.
fn reference_node(b: &[u8]) -> Option<IpAddr> {
    let s = std::str::from_utf8(b).ok().filter(|s| s.len() <= 64)?;
    let port_ok = |p: &str| match p.strip_prefix('_') {
        Some(o) => {
            !o.is_empty()
                && o.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
        }
        None => !p.is_empty() && p.bytes().all(|c| c.is_ascii_digit()) && p.parse::<u16>().is_ok(),
    };
    if let Some(inner) = s.strip_prefix('[') {
        let close = inner.find(']')?;
        let after = &inner[close + 1..];
        if !after.is_empty() && !after.strip_prefix(':').is_some_and(port_ok) {
            return None;
        }
        return inner[..close]
            .parse::<Ipv6Addr>()
            .ok()
            .map(|v6| IpAddr::V6(v6).to_canonical());
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    let colon = s.rfind(':')?;
    if !port_ok(&s[colon + 1..]) {
        return None;
    }
    s[..colon].parse::<Ipv4Addr>().ok().map(IpAddr::V4)
}

/// Whether `ip` is in one of the networks, by comparing the leading bits one at a time.
pub(crate) fn model_trusted(trusted: &[&str], ip: IpAddr) -> bool {
    trusted.iter().any(|n| {
        let (addr, bits) = match n.split_once('/') {
            Some((a, b)) => (a.parse::<IpAddr>().unwrap(), b.parse::<u32>().unwrap()),
            None => {
                let a: IpAddr = n.parse().unwrap();
                (a, if a.is_ipv4() { 32 } else { 128 })
            }
        };
        same_prefix(addr.to_canonical(), ip, bits)
    })
}

/// Whether the first `bits` bits of two addresses of one family agree.
pub(crate) fn same_prefix(a: IpAddr, b: IpAddr, bits: u32) -> bool {
    let bytes = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    let (a, b) = (bytes(a), bytes(b));
    a.len() == b.len()
        && (0..bits as usize)
            .all(|i| (a[i / 8] >> (7 - i % 8)) & 1 == (b[i / 8] >> (7 - i % 8)) & 1)
}

fn forwarded(trusted: &[&str], rfc7239: bool) -> Forwarded {
    let f = Forwarded::trusting(trusted).unwrap();
    if rfc7239 { f.rfc7239() } else { f }
}

/// Keys that are the address itself (no grouping).
fn exact(trusted: &[&str], rfc7239: bool) -> Forwarded {
    forwarded(trusted, rfc7239).ipv4_prefix(32).ipv6_prefix(128)
}

/// The bytes a header value may hold (the others are dropped).
pub(crate) fn header_bytes(raw: &[u8]) -> Vec<u8> {
    raw.iter()
        .copied()
        .filter(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
        .collect()
}

pub(crate) fn request<'a>(
    peer: SocketAddr,
    headers: impl Iterator<Item = (&'a str, &'a [u8])>,
) -> http::request::Parts {
    let mut request = http::Request::new(());
    for (name, value) in headers {
        let value = HeaderValue::from_bytes(value).expect("header bytes were filtered");
        request.headers_mut().append(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value,
        );
    }
    request.extensions_mut().insert(peer);
    request.into_parts().0
}
