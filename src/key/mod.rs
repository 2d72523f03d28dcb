//! Who a request is counted against: the [`KeyExtractor`] trait and the built-in extractors.
//!
//! A rule of the [limiter](crate::limiter) asks its extractor for a [`Key`] and counts the
//! request against that key. Keys are untrusted input: they are built only from what the
//! server can vouch for, and the limiter bounds their length (a long key is replaced by a hash
//! of it, see [`MAX_KEY_LEN`]).
//!
//! | extractor | the key |
//! | --- | --- |
//! | [`PeerIp`] | the address of the connection (IPv6 grouped by /64) |
//! | [`Forwarded`] | the client address behind trusted proxies (`X-Forwarded-For` or `Forwarded`) |
//! | [`Header`] | a header's value, such as an API key |
//! | [`Extension`] | a value an earlier layer put into the request extensions (user, tenant) |
//! | [`Global`] | one key for every request |
//! | any `Fn(&Parts) -> Option<K>` | whatever the closure returns |
//!
//! Extractors compose: [`KeyExtractor::or`] falls back to a second extractor when the first
//! finds nothing, [`KeyExtractor::and`] joins two keys (a user within a tenant). Keys never
//! meet across inputs: a key's text escapes `%`, so that what a client writes cannot spell
//! the tags of `or` and `and`, bytes that are not UTF-8, or a hashed key (see [`Key`]). What a rule
//! does with a request that has no key at all is the rule's choice
//! ([`MissingKey`](crate::limiter::MissingKey)).
//!
//! ```
//! use std::net::SocketAddr;
//! use http::Request;
//! use tollgate::key::{Forwarded, Header, KeyExtractor, PeerIp};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut request = Request::get("/")
//!     .header("x-forwarded-for", "198.51.100.7, 203.0.113.9")
//!     .body(())?;
//! // The connection came from our load balancer at 10.0.0.2.
//! request.extensions_mut().insert("10.0.0.2:40000".parse::<SocketAddr>()?);
//! let (parts, _) = request.into_parts();
//!
//! assert_eq!(PeerIp::new().extract(&parts).unwrap().as_str(), "10.0.0.2");
//! let behind_proxy = Forwarded::trusting(["10.0.0.0/8"])?;
//! assert_eq!(behind_proxy.extract(&parts).unwrap().as_str(), "203.0.113.9");
//! // No API key: fall back to the client's address, in a namespace of its own (a client
//! // sending `x-api-key: 203.0.113.9` gets another key).
//! let api_key = Header::from_static("x-api-key").or(behind_proxy);
//! assert_eq!(api_key.extract(&parts).unwrap().as_str(), "%|1|203.0.113.9");
//! # Ok(())
//! # }
//! ```

mod extract;
mod ip;

pub use extract::{And, Extension, Global, Header, Key, KeyExtractor, Or};
pub use ip::{DEFAULT_IPV6_PREFIX, Forwarded, InvalidNetwork, PeerIp};

/// The longest key the limiter hands to a store, in bytes, including the rule's name. A longer
/// key is replaced by `%#`, the first 128 bits of its SHA-256 and the rule's name, so that a
/// client cannot make the store hold (or a Redis command carry) arbitrarily long keys, nor
/// steer two keys into one hash; the hash is the same in every process, so instances sharing
/// a Redis agree on it.
pub const MAX_KEY_LEN: usize = 160;
