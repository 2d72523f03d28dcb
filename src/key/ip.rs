//! Keys from IP addresses: the peer of the connection, and the client behind trusted proxies.

use std::fmt::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use arrayvec::ArrayString;
use http::header::FORWARDED;
use http::request::Parts;
use http::{HeaderName, HeaderValue};
use smallvec::SmallVec;

use super::{Key, KeyExtractor};

/// The IPv6 prefix length that [`PeerIp`] and [`Forwarded`] group addresses by: one /64 is
/// what a single host or home network usually gets, and it holds 2^64 addresses to rotate
/// through.
pub const DEFAULT_IPV6_PREFIX: u8 = 64;

/// The most forwarding hops examined, counted from the right; anything further left is
/// ignored.
const MAX_HOPS: usize = 32;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The address of the connection the request came on.
///
/// It is read from the request extensions: axum's `ConnectInfo<SocketAddr>` (feature `axum`,
/// with `into_make_service_with_connect_info::<SocketAddr>()`, or `MockConnectInfo` in tests),
/// or a plain `SocketAddr` or
/// `IpAddr` extension that the server (or a layer of yours) put there. No address is no key.
///
/// IPv6 addresses are grouped by prefix, /64 unless set otherwise, so that one host cannot
/// rotate through its network for fresh keys; the key is then the network, as in
/// `2001:db8:1:2::/64`. IPv4 addresses are keyed one by one unless an IPv4 prefix is set.
/// IPv4-mapped IPv6 addresses (`::ffff:192.0.2.1`) count as the IPv4 address.
///
/// ```
/// use std::net::SocketAddr;
/// use tollgate::key::{KeyExtractor, PeerIp};
///
/// let key_of = |addr: &str| {
///     let mut request = http::Request::get("/").body(()).unwrap();
///     request.extensions_mut().insert(addr.parse::<SocketAddr>().unwrap());
///     PeerIp::new().extract(&request.into_parts().0).unwrap()
/// };
/// assert_eq!(key_of("[2001:db8:1:2:aaaa::1]:443").as_str(), "2001:db8:1:2::/64");
/// assert_eq!(key_of("[2001:db8:1:2:ffff::9]:443"), key_of("[2001:db8:1:2::7]:80"));
/// assert_eq!(key_of("192.0.2.1:5000").as_str(), "192.0.2.1");
/// ```
#[derive(Clone, Copy, Debug)]
pub struct PeerIp {
    grouping: Grouping,
}

impl PeerIp {
    /// The peer address, IPv6 grouped by /64.
    pub const fn new() -> Self {
        Self {
            grouping: Grouping::DEFAULT,
        }
    }

    /// Groups IPv6 addresses by their first `bits` bits (clamped to 0..=128; 128 keys every
    /// address on its own).
    pub const fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.grouping.v6 = if bits > 128 { 128 } else { bits };
        self
    }

    /// Groups IPv4 addresses by their first `bits` bits (clamped to 0..=32; 32, the default,
    /// keys every address on its own).
    pub const fn ipv4_prefix(mut self, bits: u8) -> Self {
        self.grouping.v4 = if bits > 32 { 32 } else { bits };
        self
    }

    /// The address of the connection, as the extensions tell it, if they do.
    pub fn peer_addr(parts: &Parts) -> Option<IpAddr> {
        #[cfg(feature = "axum")]
        if let Some(info) = parts
            .extensions
            .get::<axum::extract::ConnectInfo<SocketAddr>>()
        {
            return Some(info.0.ip());
        }
        #[cfg(feature = "axum")]
        if let Some(info) = parts
            .extensions
            .get::<axum::extract::connect_info::MockConnectInfo<SocketAddr>>()
        {
            return Some(info.0.ip());
        }
        if let Some(addr) = parts.extensions.get::<SocketAddr>() {
            return Some(addr.ip());
        }
        parts.extensions.get::<IpAddr>().copied()
    }
}

impl Default for PeerIp {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyExtractor for PeerIp {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        let mut key = Key::new();
        self.extract_into(parts, &mut key).then_some(key)
    }

    #[inline]
    fn extract_into(&self, parts: &Parts, out: &mut Key) -> bool {
        match PeerIp::peer_addr(parts) {
            Some(ip) => {
                self.grouping.write(ip, out);
                true
            }
            None => false,
        }
    }
}

/// The client's address as reported by trusted proxies, in `X-Forwarded-For` or (after
/// [`Forwarded::rfc7239`]) the standard `Forwarded` header.
///
/// Forwarding headers are believed only as far as the proxies that wrote them are trusted:
///
/// - a request whose peer is not one of the trusted networks is keyed by its peer address,
///   whatever its headers say (a client cannot spoof its way to a fresh key);
/// - otherwise the header's addresses are read from the right (the hop closest to us) and the
///   first one that is not a trusted proxy is the client;
/// - an element that is not an address (malformed, `unknown`, an obfuscated RFC 7239
///   identifier) ends the walk: the key is the last trusted address seen, usually the proxy
///   that wrote it. Garbage therefore never becomes a key of its own. `Forwarded` lines are
///   read by RFC 7239's grammar: an element with any malformed pair (an unterminated or
///   misplaced quote, a name that is not a token, white space around `=`, a parameter given
///   twice) has no address, and a quoted string that never closes makes the rest of its line
///   one malformed element. Lines are read from the right, element by element, so an element a
///   proxy appended is read as the proxy wrote it, whatever a client wrote before it;
/// - if every address is trusted, the leftmost one is the client; at most 32 hops are read.
///
/// Only one header is read: the one your proxies write. Reading `Forwarded` while the proxy
/// only appends to `X-Forwarded-For` would believe whatever `Forwarded` the client sent.
/// Addresses are grouped as [`PeerIp`] groups them (IPv6 by /64).
///
/// ```
/// use std::net::SocketAddr;
/// use tollgate::key::{Forwarded, KeyExtractor};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let forwarded = Forwarded::trusting(["10.0.0.0/8", "fd00::/8"])?.rfc7239();
/// let key_of = |peer: &str, header: &str| {
///     let mut request = http::Request::get("/").header("forwarded", header).body(()).unwrap();
///     request.extensions_mut().insert(peer.parse::<SocketAddr>().unwrap());
///     forwarded.extract(&request.into_parts().0).unwrap()
/// };
/// let header = r#"for=192.0.2.60;proto=https, for="[2001:db8::17]:4711", for=10.1.2.3"#;
/// assert_eq!(key_of("10.0.0.2:1234", header).as_str(), "2001:db8::/64");
/// assert_eq!(key_of("198.51.100.1:1234", header).as_str(), "198.51.100.1"); // not our proxy
/// assert_eq!(key_of("10.0.0.2:1234", "for=unknown").as_str(), "10.0.0.2");
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Forwarded {
    trusted: Vec<Network>,
    header: Source,
    grouping: Grouping,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    XForwardedFor,
    Rfc7239,
}

impl Forwarded {
    /// Trusts proxies in the given networks (`10.0.0.0/8`, `2001:db8::/32`, or a single
    /// address; an IPv4-mapped network such as `::ffff:10.0.0.0/104` is the IPv4 network it
    /// maps), reading `X-Forwarded-For`. With no network at all this is [`PeerIp`].
    pub fn trusting<I>(networks: I) -> Result<Self, InvalidNetwork>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let trusted = networks
            .into_iter()
            .map(|n| n.as_ref().parse::<Network>())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            trusted,
            header: Source::XForwardedFor,
            grouping: Grouping::DEFAULT,
        })
    }

    /// Reads the RFC 7239 `Forwarded` header (its `for=` parameters) instead of
    /// `X-Forwarded-For`.
    pub fn rfc7239(mut self) -> Self {
        self.header = Source::Rfc7239;
        self
    }

    /// Reads `X-Forwarded-For` (the default).
    pub fn x_forwarded_for(mut self) -> Self {
        self.header = Source::XForwardedFor;
        self
    }

    /// Groups IPv6 addresses by their first `bits` bits (see [`PeerIp::ipv6_prefix`]).
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.grouping.v6 = bits.min(128);
        self
    }

    /// Groups IPv4 addresses by their first `bits` bits (see [`PeerIp::ipv4_prefix`]).
    pub fn ipv4_prefix(mut self, bits: u8) -> Self {
        self.grouping.v4 = bits.min(32);
        self
    }

    /// The client's address under the rules above, before grouping.
    pub fn client_addr(&self, parts: &Parts) -> Option<IpAddr> {
        let peer = canonical(PeerIp::peer_addr(parts)?);
        if !self.is_trusted(peer) {
            return Some(peer);
        }
        // The hops are read from the right, the proxies' end: what a proxy appended is read
        // as it wrote it, before anything a client wrote to its left, and the walk stops at
        // the client, at the first hop that is not an address, or after MAX_HOPS.
        let name = match self.header {
            Source::XForwardedFor => &X_FORWARDED_FOR,
            Source::Rfc7239 => &FORWARDED,
        };
        let lines: SmallVec<[&HeaderValue; 4]> = parts.headers.get_all(name).iter().collect();
        let mut walk = Walk {
            last_trusted: peer,
            hops: 0,
        };
        for line in lines.iter().rev() {
            let line = line.as_bytes();
            let found = match self.header {
                Source::XForwardedFor => line
                    .rsplit(|&b| b == b',')
                    .find_map(|element| walk.step(self, parse_node(trim(element)))),
                Source::Rfc7239 => rfc7239_elements_from_right(line)
                    .find_map(|element| walk.step(self, rfc7239_address(element))),
            };
            if let Some(end) = found {
                return Some(end);
            }
        }
        Some(walk.last_trusted)
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|n| n.contains(ip))
    }
}

impl KeyExtractor for Forwarded {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        let mut key = Key::new();
        self.extract_into(parts, &mut key).then_some(key)
    }

    fn extract_into(&self, parts: &Parts, out: &mut Key) -> bool {
        match self.client_addr(parts) {
            Some(ip) => {
                self.grouping.write(ip, out);
                true
            }
            None => false,
        }
    }
}

/// A walk along the hops from the right.
struct Walk {
    last_trusted: IpAddr,
    hops: usize,
}

impl Walk {
    /// One hop (`None`: not an address): `Some(key address)` when the walk ends here.
    fn step(&mut self, forwarded: &Forwarded, hop: Option<IpAddr>) -> Option<IpAddr> {
        self.hops += 1;
        match hop {
            // Garbage, or past the hops read: the last trusted hop is the client.
            _ if self.hops > MAX_HOPS => Some(self.last_trusted),
            None => Some(self.last_trusted),
            Some(ip) if forwarded.is_trusted(ip) => {
                self.last_trusted = ip;
                None
            }
            Some(ip) => Some(ip),
        }
    }
}

/// The elements of one `Forwarded` line, from the right: each split at the first comma
/// (going left) outside a quoted string, quotes counted from the right end, where a proxy's
/// well-formed element stands. Elements that are only white space are skipped, as the list
/// syntax allows.
fn rfc7239_elements_from_right(line: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut end = Some(line.len());
    std::iter::from_fn(move || {
        loop {
            let stop = end?;
            let mut quoted = false;
            let mut i = stop;
            let start = loop {
                if i == 0 {
                    break None;
                }
                i -= 1;
                match line[i] {
                    b'"' => {
                        // Escaped within a quoted string: an odd run of backslashes before it.
                        let slashes = line[..i].iter().rev().take_while(|&&b| b == b'\\').count();
                        if !(quoted && slashes % 2 == 1) {
                            quoted = !quoted;
                        }
                    }
                    b',' if !quoted => break Some(i),
                    _ => {}
                }
            };
            let element = &line[start.map_or(0, |s| s + 1)..stop];
            end = start;
            if !trim(element).is_empty() {
                return Some(element);
            }
        }
    })
}

/// The address of one `Forwarded` element: `None` for a well-formed element without one, and
/// for a malformed one (which must also read as exactly one element).
fn rfc7239_address(element: &[u8]) -> Option<IpAddr> {
    let mut hops: SmallVec<[Option<IpAddr>; 8]> = SmallVec::new();
    rfc7239_hops(element, &mut hops);
    match hops.as_slice() {
        [one] => *one,
        _ => None,
    }
}

/// Keeps the rightmost [`MAX_HOPS`] hops.
fn push_hop(hops: &mut SmallVec<[Option<IpAddr>; 8]>, hop: Option<IpAddr>) {
    if hops.len() == MAX_HOPS {
        hops.remove(0);
    }
    hops.push(hop);
}

/// The `for=` node of each element of one `Forwarded` field line, pushed left to right:
/// `Some(address)` for a well-formed element whose `for=` is an address, `None` for any other
/// element.
///
/// The grammar is RFC 7239's (`element *( "," element )`, `element = [pair] *( ";" [pair] )`,
/// `pair = token "=" ( token / quoted-string )`), with optional white space around `;` and `,`
/// and, as proxies write them, unquoted values holding `:` `[` `]`. An element is malformed, and
/// yields no address, when any of its pairs is: a name that is not a token, a missing `=`, white
/// space around `=`, an empty or unquoted value with characters a token cannot hold, text after
/// a closing quote, or a parameter given twice. A quoted string that never closes makes the rest
/// of the line one malformed element: whatever a client writes, the elements a proxy appends
/// after it are either read as the proxy wrote them or not read at all, and never lend their
/// place to an address the client wrote. Empty elements (`a, , b`) are skipped, as the list
/// syntax allows.
fn rfc7239_hops(line: &[u8], hops: &mut SmallVec<[Option<IpAddr>; 8]>) {
    let n = line.len();
    let mut i = 0;
    let mut element = Element::default();
    let mut quoted: SmallVec<[u8; 64]> = SmallVec::new();
    loop {
        // One pair, or an empty one, up to `;`, `,` or the end of the line.
        i = skip_ows(line, i);
        if i < n && !matches!(line[i], b';' | b',') {
            let start = i;
            while i < n && is_tchar(line[i]) {
                i += 1;
            }
            let name = &line[start..i];
            if name.is_empty() || i >= n || line[i] != b'=' {
                element.malformed = true;
            } else {
                i += 1;
                let value: &[u8] = if i < n && line[i] == b'"' {
                    match quoted_string(line, i + 1, &mut quoted) {
                        Some(after) => {
                            i = after;
                            &quoted
                        }
                        None => {
                            // Unterminated: the rest of the line is this element.
                            push_hop(hops, None);
                            return;
                        }
                    }
                } else {
                    let start = i;
                    while i < n && is_value_byte(line[i]) {
                        i += 1;
                    }
                    if i == start {
                        element.malformed = true;
                    }
                    &line[start..i]
                };
                element.pair(name, value);
            }
            i = skip_ows(line, i);
            if i < n && !matches!(line[i], b';' | b',') {
                // Text where a `;` or `,` must be: skip to the next one.
                element.malformed = true;
                while i < n && !matches!(line[i], b';' | b',') {
                    i += 1;
                }
            }
        }
        if i >= n || line[i] == b',' {
            if !element.is_empty() {
                push_hop(hops, element.address());
            }
            element = Element::default();
            if i >= n {
                return;
            }
        }
        i += 1;
    }
}

/// What has been read of one `Forwarded` element.
#[derive(Default)]
struct Element {
    pairs: u32,
    /// The parameters seen, one bit each: `for`, `by`, `host`, `proto`, anything else is not
    /// checked for repeats.
    seen: u8,
    node: Option<IpAddr>,
    malformed: bool,
}

impl Element {
    fn pair(&mut self, name: &[u8], value: &[u8]) {
        self.pairs += 1;
        let bit = [&b"for"[..], b"by", b"host", b"proto"]
            .iter()
            .position(|known| name.eq_ignore_ascii_case(known))
            .map_or(0, |i| 1 << i);
        if self.seen & bit != 0 {
            self.malformed = true;
        }
        self.seen |= bit;
        if bit == 1 {
            self.node = parse_node(value);
        }
    }

    fn is_empty(&self) -> bool {
        self.pairs == 0 && !self.malformed
    }

    fn address(&self) -> Option<IpAddr> {
        if self.malformed { None } else { self.node }
    }
}

/// Reads a quoted string whose opening quote is just before `start` into `out` (escapes
/// undone), and returns the index after its closing quote; `None` if it never closes.
fn quoted_string(line: &[u8], start: usize, out: &mut SmallVec<[u8; 64]>) -> Option<usize> {
    out.clear();
    let mut i = start;
    while i < line.len() {
        match line[i] {
            b'"' => return Some(i + 1),
            b'\\' => {
                out.push(*line.get(i + 1)?);
                i += 2;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    None
}

fn skip_ows(line: &[u8], mut i: usize) -> usize {
    while i < line.len() && matches!(line[i], b' ' | b'\t') {
        i += 1;
    }
    i
}

/// A byte of an HTTP token.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A byte of an unquoted value: a token's, and the `:` `[` `]` of addresses and ports that
/// proxies write unquoted although RFC 7239 asks for quotes.
fn is_value_byte(b: u8) -> bool {
    is_tchar(b) || matches!(b, b':' | b'[' | b']')
}

fn trim(bytes: &[u8]) -> &[u8] {
    bytes.trim_ascii()
}

/// An address as proxies write it: `192.0.2.1`, `192.0.2.1:80`, `2001:db8::1`,
/// `[2001:db8::1]`, `[2001:db8::1]:80`. Anything else is `None`.
fn parse_node(node: &[u8]) -> Option<IpAddr> {
    let node = std::str::from_utf8(node).ok()?;
    if node.len() > 64 {
        return None;
    }
    if let Some(rest) = node.strip_prefix('[') {
        let (addr, after) = rest.split_once(']')?;
        if !(after.is_empty() || after.strip_prefix(':').is_some_and(is_port)) {
            return None;
        }
        return addr.parse::<Ipv6Addr>().ok().map(|ip| canonical(ip.into()));
    }
    if let Ok(ip) = node.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    let (addr, port) = node.rsplit_once(':')?;
    if !is_port(port) {
        return None;
    }
    addr.parse::<Ipv4Addr>().ok().map(IpAddr::V4)
}

/// A port as RFC 7239 writes one: digits, or an obfuscated one (`_` and letters, digits, `.`,
/// `_`, `-`).
fn is_port(s: &str) -> bool {
    match s.strip_prefix('_') {
        Some(obfuscated) => {
            !obfuscated.is_empty()
                && obfuscated
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        }
        None => s.bytes().all(|b| b.is_ascii_digit()) && s.parse::<u16>().is_ok(),
    }
}

fn canonical(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// The decimal text of every octet, followed by a dot.
#[rustfmt::skip]
static OCTET_DOT: [&str; 256] = [
    "0.", "1.", "2.", "3.", "4.", "5.", "6.", "7.", "8.", "9.", "10.", "11.",
    "12.", "13.", "14.", "15.", "16.", "17.", "18.", "19.", "20.", "21.", "22.", "23.",
    "24.", "25.", "26.", "27.", "28.", "29.", "30.", "31.", "32.", "33.", "34.", "35.",
    "36.", "37.", "38.", "39.", "40.", "41.", "42.", "43.", "44.", "45.", "46.", "47.",
    "48.", "49.", "50.", "51.", "52.", "53.", "54.", "55.", "56.", "57.", "58.", "59.",
    "60.", "61.", "62.", "63.", "64.", "65.", "66.", "67.", "68.", "69.", "70.", "71.",
    "72.", "73.", "74.", "75.", "76.", "77.", "78.", "79.", "80.", "81.", "82.", "83.",
    "84.", "85.", "86.", "87.", "88.", "89.", "90.", "91.", "92.", "93.", "94.", "95.",
    "96.", "97.", "98.", "99.", "100.", "101.", "102.", "103.", "104.", "105.", "106.", "107.",
    "108.", "109.", "110.", "111.", "112.", "113.", "114.", "115.", "116.", "117.", "118.", "119.",
    "120.", "121.", "122.", "123.", "124.", "125.", "126.", "127.", "128.", "129.", "130.", "131.",
    "132.", "133.", "134.", "135.", "136.", "137.", "138.", "139.", "140.", "141.", "142.", "143.",
    "144.", "145.", "146.", "147.", "148.", "149.", "150.", "151.", "152.", "153.", "154.", "155.",
    "156.", "157.", "158.", "159.", "160.", "161.", "162.", "163.", "164.", "165.", "166.", "167.",
    "168.", "169.", "170.", "171.", "172.", "173.", "174.", "175.", "176.", "177.", "178.", "179.",
    "180.", "181.", "182.", "183.", "184.", "185.", "186.", "187.", "188.", "189.", "190.", "191.",
    "192.", "193.", "194.", "195.", "196.", "197.", "198.", "199.", "200.", "201.", "202.", "203.",
    "204.", "205.", "206.", "207.", "208.", "209.", "210.", "211.", "212.", "213.", "214.", "215.",
    "216.", "217.", "218.", "219.", "220.", "221.", "222.", "223.", "224.", "225.", "226.", "227.",
    "228.", "229.", "230.", "231.", "232.", "233.", "234.", "235.", "236.", "237.", "238.", "239.",
    "240.", "241.", "242.", "243.", "244.", "245.", "246.", "247.", "248.", "249.", "250.", "251.",
    "252.", "253.", "254.", "255.",
];

/// How addresses become keys.
#[derive(Clone, Copy, Debug)]
struct Grouping {
    v4: u8,
    v6: u8,
}

impl Grouping {
    const DEFAULT: Grouping = Grouping {
        v4: 32,
        v6: DEFAULT_IPV6_PREFIX,
    };

    #[cfg(test)]
    fn key(&self, ip: IpAddr) -> Key {
        let mut key = Key::new();
        self.write(ip, &mut key);
        key
    }

    #[inline]
    fn write(&self, ip: IpAddr, key: &mut Key) {
        // Writing to a `Key` never fails.
        let _ = match canonical(ip) {
            IpAddr::V4(v4) if self.v4 >= 32 => {
                // The common case, without the formatting machinery: four short copies.
                let [a, b, c, d] = v4.octets().map(|o| OCTET_DOT[usize::from(o)]);
                key.push_raw(a);
                key.push_raw(b);
                key.push_raw(c);
                key.push_raw(d.strip_suffix('.').unwrap_or(d));
                Ok(())
            }
            IpAddr::V4(v4) => {
                let masked = Ipv4Addr::from_bits(v4.to_bits() & mask32(self.v4));
                write!(key, "{masked}/{}", self.v4)
            }
            IpAddr::V6(v6) if self.v6 >= 128 => write!(key, "{v6}"),
            IpAddr::V6(v6) if self.v6 <= 64 => {
                let masked = Ipv6Addr::from_bits(v6.to_bits() & mask128(self.v6));
                key.push_raw(&network64(masked, self.v6));
                Ok(())
            }
            IpAddr::V6(v6) => {
                let masked = Ipv6Addr::from_bits(v6.to_bits() & mask128(self.v6));
                write!(key, "{masked}/{}", self.v6)
            }
        };
    }
}

/// `masked/bits` for an IPv6 network of at most 64 bits, as the standard library writes
/// it: the last four groups are zero, so the longest run of zero groups is the one at the end
/// (with any zero groups just before it), and `::` stands for it. Built on the stack and
/// pushed onto the key at once; at most 4 x 5 + 2 + 3 bytes are written, so no push fails.
#[inline]
fn network64(masked: Ipv6Addr, bits: u8) -> ArrayString<32> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let groups = masked.segments();
    let shown = groups[..4]
        .iter()
        .rposition(|&g| g != 0)
        .map_or(0, |i| i + 1);
    let mut text = ArrayString::<32>::new();
    for (i, &group) in groups[..shown].iter().enumerate() {
        if i > 0 {
            let _ = text.try_push(':');
        }
        let digits = (16 - group.leading_zeros()).div_ceil(4).max(1);
        for d in (0..digits).rev() {
            let _ = text.try_push(char::from(HEX[usize::from((group >> (4 * d)) & 0xf)]));
        }
    }
    let bits = OCTET_DOT[usize::from(bits)];
    let _ = text.try_push_str("::/");
    let _ = text.try_push_str(bits.strip_suffix('.').unwrap_or(bits));
    text
}

fn mask32(bits: u8) -> u32 {
    u32::MAX
        .checked_shl(32 - u32::from(bits.min(32)))
        .unwrap_or(0)
}

fn mask128(bits: u8) -> u128 {
    u128::MAX
        .checked_shl(128 - u32::from(bits.min(128)))
        .unwrap_or(0)
}

/// A network in CIDR notation, or one address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Network {
    addr: IpAddr,
    bits: u8,
}

impl Network {
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let m = mask32(self.bits);
                net.to_bits() & m == ip.to_bits() & m
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let m = mask128(self.bits);
                net.to_bits() & m == ip.to_bits() & m
            }
            _ => false,
        }
    }
}

impl std::str::FromStr for Network {
    type Err = InvalidNetwork;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidNetwork(s.chars().take(64).collect());
        let (addr, bits) = match s.trim().split_once('/') {
            Some((addr, bits)) => (addr, Some(bits)),
            None => (s.trim(), None),
        };
        let addr = addr.parse::<IpAddr>().map_err(|_| invalid())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let bits = match bits {
            // Decimal digits only (`u8::from_str` would take `+8` too).
            Some(b) if !b.is_empty() && b.bytes().all(|c| c.is_ascii_digit()) => b
                .parse::<u8>()
                .ok()
                .filter(|&b| b <= max)
                .ok_or_else(invalid)?,
            Some(_) => return Err(invalid()),
            None => max,
        };
        // Peers are compared as IPv4 when they are IPv4-mapped, so a mapped network is the
        // IPv4 network it maps (`::ffff:10.0.0.0/104` is `10.0.0.0/8`); one wider than the
        // mapped range `::ffff:0:0/96` is not a network of IPv4 addresses, and is refused
        // rather than read as some IPv4 network.
        if let IpAddr::V6(v6) = addr {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return match bits.checked_sub(96) {
                    Some(bits) => Ok(Network {
                        addr: IpAddr::V4(v4),
                        bits,
                    }),
                    None => Err(invalid()),
                };
            }
        }
        Ok(Network { addr, bits })
    }
}

/// A trusted network that is not an address or a CIDR network (`10.0.0.0/8`, `::1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidNetwork(pub String);

impl fmt::Display for InvalidNetwork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a network: write an address or address/prefix-length, as 10.0.0.0/8 or fd00::/8",
            self.0
        )
    }
}

impl std::error::Error for InvalidNetwork {}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(peer: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::get("/");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let mut r = b.body(()).unwrap();
        r.extensions_mut()
            .insert(peer.parse::<SocketAddr>().unwrap());
        r.into_parts().0
    }

    fn xff(f: &Forwarded, peer: &str, value: &str) -> String {
        f.extract(&parts(peer, &[("x-forwarded-for", value)]))
            .unwrap()
            .to_string()
    }

    #[test]
    fn networks_parse_and_match() {
        let n: Network = "10.0.0.0/8".parse().unwrap();
        assert!(n.contains("10.255.0.1".parse().unwrap()));
        assert!(!n.contains("11.0.0.1".parse().unwrap()));
        assert!(!n.contains("::1".parse().unwrap()));
        let all: Network = "::/0".parse().unwrap();
        assert!(all.contains("2001:db8::1".parse().unwrap()));
        let one: Network = "::ffff:192.0.2.1".parse().unwrap();
        assert_eq!(one, "192.0.2.1/32".parse().unwrap());
        // A mapped network is the IPv4 network it maps (found by fuzzing: /104 was refused
        // and /8 read as 10.0.0.0/8).
        let mapped: Network = "::ffff:10.0.0.0/104".parse().unwrap();
        assert_eq!(mapped, "10.0.0.0/8".parse().unwrap());
        assert_eq!(
            "::ffff:0:0/96".parse::<Network>().unwrap(),
            "0.0.0.0/0".parse().unwrap()
        );
        for bad in [
            "",
            "10.0.0.0/33",
            "10.0.0/8",
            "fd00::/129",
            "x/1",
            "1.2.3.4/-1",
            "10.0.0.0/+8",
            "10.0.0.0/",
            "::ffff:10.0.0.0/8",
            "::ffff:10.0.0.0/95",
        ] {
            assert!(bad.parse::<Network>().is_err(), "{bad}");
        }
        assert!(Forwarded::trusting(["10.0.0.0/8", "nope"]).is_err());
    }

    #[test]
    fn x_forwarded_for_takes_the_rightmost_untrusted() {
        let f = Forwarded::trusting(["10.0.0.0/8", "192.168.0.0/16"]).unwrap();
        assert_eq!(
            xff(&f, "10.0.0.1:1", "1.1.1.1, 2.2.2.2, 192.168.1.1"),
            "2.2.2.2"
        );
        assert_eq!(
            xff(&f, "10.0.0.1:1", "1.1.1.1:80,[2001:db8::1]:443"),
            "2001:db8::/64"
        );
        // Untrusted peer: the header is ignored.
        assert_eq!(xff(&f, "9.9.9.9:1", "1.1.1.1"), "9.9.9.9");
        // All trusted: the leftmost.
        assert_eq!(xff(&f, "10.0.0.1:1", "10.9.9.9, 192.168.0.7"), "10.9.9.9");
        // Garbage right of the client stops the walk at the last trusted hop.
        assert_eq!(
            xff(&f, "10.0.0.1:1", "1.1.1.1, garbage, 10.0.0.5"),
            "10.0.0.5"
        );
        assert_eq!(xff(&f, "10.0.0.1:1", "1.1.1.1, unknown"), "10.0.0.1");
        // Garbage left of the client does not matter.
        assert_eq!(xff(&f, "10.0.0.1:1", "x!@#, 3.3.3.3"), "3.3.3.3");
        assert_eq!(xff(&f, "10.0.0.1:1", ""), "10.0.0.1");
        assert_eq!(xff(&f, "10.0.0.1:1", ",,,"), "10.0.0.1");
        assert_eq!(xff(&f, "10.0.0.1:1", "[::1"), "10.0.0.1");
        assert_eq!(xff(&f, "10.0.0.1:1", "1.2.3.4:99999"), "10.0.0.1");
        // Several header lines read as one list, in order.
        let p = parts(
            "10.0.0.1:1",
            &[
                ("x-forwarded-for", "4.4.4.4"),
                ("x-forwarded-for", "10.0.0.9"),
            ],
        );
        assert_eq!(f.extract(&p).unwrap().as_str(), "4.4.4.4");
        // No peer address: no key.
        let r = http::Request::get("/").body(()).unwrap().into_parts().0;
        assert!(f.extract(&r).is_none());
    }

    #[test]
    fn long_chains_are_bounded() {
        let f = Forwarded::trusting(["10.0.0.0/8"]).unwrap();
        let mut chain = vec!["5.5.5.5".to_owned()];
        chain.extend((0..100).map(|i| format!("10.0.{}.{}", i / 256, i % 256)));
        // The client is beyond the 32 hops read: the leftmost hop read is the key.
        let key = xff(&f, "10.0.0.1:1", &chain.join(","));
        assert!(key.starts_with("10.0."), "{key}");
        assert_eq!(xff(&f, "10.0.0.1:1", &chain[..20].join(",")), "5.5.5.5");
    }

    #[test]
    fn rfc7239_parses_quotes_ports_and_obfuscation() {
        let f = Forwarded::trusting(["10.0.0.0/8"]).unwrap().rfc7239();
        let key = |v: &str| {
            f.extract(&parts("10.0.0.1:1", &[("forwarded", v)]))
                .unwrap()
                .to_string()
        };
        assert_eq!(key("for=192.0.2.43"), "192.0.2.43");
        assert_eq!(key("For=\"192.0.2.43:4711\";proto=http"), "192.0.2.43");
        assert_eq!(
            key("for=\"[2001:db8:cafe::17]:4711\""),
            "2001:db8:cafe::/64"
        );
        assert_eq!(key("for=1.1.1.1;ext=\"a,b;c\", for=10.0.0.3"), "1.1.1.1");
        assert_eq!(key("for=1.1.1.1, by=10.0.0.3"), "10.0.0.1");
        assert_eq!(key("for=_hidden, for=10.0.0.3"), "10.0.0.3");
        assert_eq!(key("for=\"unterminated"), "10.0.0.1");
        assert_eq!(key(";;,,==\"\\"), "10.0.0.1");
        // X-Forwarded-For is not read in this mode.
        let p = parts("10.0.0.1:1", &[("x-forwarded-for", "1.1.1.1")]);
        assert_eq!(f.extract(&p).unwrap().as_str(), "10.0.0.1");
    }

    /// Malformed elements yield no address, wherever a client puts them.
    #[test]
    fn rfc7239_malformed_elements_never_yield_an_address() {
        let f = Forwarded::trusting(["10.0.0.0/8"]).unwrap().rfc7239();
        let key = |v: &str| {
            f.extract(&parts("10.0.0.1:1", &[("forwarded", v)]))
                .unwrap()
                .to_string()
        };
        // The reported attack: the client's unterminated quote swallowed the proxy's element,
        // and the client's own `for=` became the client. Read from the right, the proxy's
        // element is read as the proxy wrote it: the client is the address it wrote.
        assert_eq!(key("for=198.51.100.7;x=\", for=203.0.113.9"), "203.0.113.9");
        // The same with the proxy's value quoted: the client's quote cannot reach into it.
        assert_eq!(
            key("for=198.51.100.7;x=\", for=\"[2001:db8::1]:4711\""),
            "2001:db8::/64"
        );
        assert_eq!(
            key(r#"for="198.51.100.7\", for=203.0.113.9"#),
            "203.0.113.9"
        );
        // A malformed element written by the client alone ends the walk at the proxy.
        assert_eq!(key("for=198.51.100.7;x=\""), "10.0.0.1");
        assert_eq!(
            key(r#"for=1.1.1.1;x="a\"b,for=9.9.9.9", for=203.0.113.9"#),
            "203.0.113.9"
        );
        // Text after a closing quote, a repeated parameter, white space around `=`, a quote in
        // an unquoted value, an empty value, a name that is not a token.
        for bad in [
            r#"for="203.0.113.9"x"#,
            "for=203.0.113.9;for=198.51.100.7",
            "for=203.0.113.9;proto=http;PROTO=https",
            "for = 203.0.113.9",
            "for=203.0.113.9\"x",
            "for=",
            "f(r=203.0.113.9",
            "for=203.0.113.9 x",
        ] {
            assert_eq!(key(bad), "10.0.0.1", "{bad}");
        }
        // Well-formed: empty elements skipped, white space around `;`, obfuscated ports,
        // bracketed IPv6 with and without a port, a well-formed client prefix.
        assert_eq!(key("for=203.0.113.9, , "), "203.0.113.9");
        assert_eq!(key("for=203.0.113.9 ; proto=https"), "203.0.113.9");
        assert_eq!(key(r#"for="[2001:db8::17]:_p1""#), "2001:db8::/64");
        assert_eq!(key(r#"for="[2001:db8::17]""#), "2001:db8::/64");
        assert_eq!(key("for=192.0.2.43:_x"), "192.0.2.43");
        assert_eq!(key("for=198.51.100.7, for=203.0.113.9"), "203.0.113.9");
        assert_eq!(
            key("for=198.51.100.7, by=1.1.1.1;for=203.0.113.9"),
            "203.0.113.9"
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]

        /// Whatever a client writes in front of what a trusted proxy appends, the key is the
        /// address the proxy wrote: never one the client wrote, nor (by writing garbage) the
        /// proxy's own.
        #[test]
        fn a_client_never_chooses_its_key_behind_a_trusted_proxy(
            pieces in proptest::collection::vec(0usize..CLIENT_PIECES.len(), 0..16),
            appended in 0usize..4,
            own_line in proptest::prelude::any::<bool>(),
            rfc7239 in proptest::prelude::any::<bool>(),
        ) {
            let written: String = pieces.iter().map(|&i| CLIENT_PIECES[i]).collect();
            let (header, element, client) = if rfc7239 {
                let (element, client) = [
                    ("for=203.0.113.9", "203.0.113.9"),
                    ("for=\"[2001:db8:cafe::17]:4711\"", "2001:db8:cafe::/64"),
                    ("for=203.0.113.9;proto=https;by=10.0.0.1", "203.0.113.9"),
                    ("for=203.0.113.9, for=10.0.0.7", "203.0.113.9"),
                ][appended];
                ("forwarded", element, client)
            } else {
                let (element, client) = [
                    ("203.0.113.9", "203.0.113.9"),
                    ("2001:db8:cafe::17", "2001:db8:cafe::/64"),
                    ("[2001:db8:cafe::17]:4711", "2001:db8:cafe::/64"),
                    ("203.0.113.9, 10.0.0.7", "203.0.113.9"),
                ][appended];
                ("x-forwarded-for", element, client)
            };
            let joined = format!("{written}, {element}");
            let lines: Vec<(&str, &str)> = if own_line {
                vec![(header, written.as_str()), (header, element)]
            } else {
                vec![(header, joined.as_str())]
            };
            proptest::prop_assume!(
                lines.iter().all(|(_, v)| http::HeaderValue::from_str(v).is_ok())
            );
            let mut f = Forwarded::trusting(["10.0.0.0/8"]).unwrap();
            if rfc7239 {
                f = f.rfc7239();
            }
            let key = f.extract(&parts("10.0.0.1:1", &lines)).unwrap().to_string();
            proptest::prop_assert_eq!(key, client, "from {:?}", lines);
        }
    }

    /// What a client may write: addresses of its choosing (trusted ones too), and every
    /// character that means something to the parsers.
    const CLIENT_PIECES: &[&str] = &[
        "for=198.51.100.7;",
        "x=\"",
        ";x=\"a\\\"",
        "for=",
        "198.51.100.7",
        "10.9.9.9",
        "\"",
        "\\",
        ";",
        ",",
        " ",
        "\t",
        "=",
        "[",
        "]",
        ":",
        "x",
        "_h",
        "unknown",
        "by=",
        "for=198.51.100.8",
        "for=\"[2001:db8:bad::1]:1\"",
        "\"[2001:db8:bad::2]\"",
        "2001:db8:bad::3",
    ];

    #[test]
    fn grouping() {
        let g = Grouping { v4: 24, v6: 48 };
        assert_eq!(
            g.key("192.0.2.200".parse().unwrap()).as_str(),
            "192.0.2.0/24"
        );
        assert_eq!(
            g.key("2001:db8:1:2::1".parse().unwrap()).as_str(),
            "2001:db8:1::/48"
        );
        assert_eq!(
            g.key("::ffff:192.0.2.9".parse().unwrap()).as_str(),
            "192.0.2.0/24"
        );
        let all = Grouping { v4: 0, v6: 0 };
        assert_eq!(
            all.key("192.0.2.200".parse().unwrap()).as_str(),
            "0.0.0.0/0"
        );
        assert_eq!(PeerIp::new().ipv6_prefix(200).grouping.v6, 128);
        // Every octet value in every position reads as the standard library writes it.
        for o in 0..=255u8 {
            for ip in [
                [o, 1, 22, 203],
                [9, o, 99, 100],
                [0, 255, o, 4],
                [255, 0, 10, o],
            ] {
                let ip = Ipv4Addr::from(ip);
                assert_eq!(Grouping::DEFAULT.key(ip.into()).as_str(), ip.to_string());
            }
        }
    }

    proptest::proptest! {
        /// IPv6 networks of up to 64 bits are written without the formatting machinery, and
        /// read exactly as the standard library writes them.
        #[test]
        fn ipv6_networks_read_as_std_writes_them(
            bits in proptest::prelude::any::<u128>(),
            zero_groups in proptest::prelude::any::<u8>(),
            prefix in 0u8..=128,
        ) {
            // Zero some groups, so runs of zeros of every length and place come up.
            let mut groups = Ipv6Addr::from_bits(bits).segments();
            for (i, g) in groups.iter_mut().enumerate() {
                if zero_groups & (1 << i) != 0 {
                    *g = 0;
                }
            }
            let ip = Ipv6Addr::from(groups);
            let masked = Ipv6Addr::from_bits(ip.to_bits() & mask128(prefix));
            let grouping = Grouping { v4: 32, v6: prefix };
            let expected = if prefix == 128 {
                ip.to_string()
            } else {
                format!("{masked}/{prefix}")
            };
            // An IPv4-mapped address is keyed as IPv4; the rest as std writes them.
            if ip.to_ipv4_mapped().is_none() {
                let key = grouping.key(ip.into());
                proptest::prop_assert_eq!(key.as_str(), expected);
            }
        }
    }
}
