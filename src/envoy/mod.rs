//! tollgate as Envoy's rate limit service (feature `envoy`): `ShouldRateLimit`
//! (`envoy.service.ratelimit.v3.RateLimitService`) over gRPC on any [`Store`](crate::Store),
//! configured by envoyproxy/ratelimit's YAML files as they are.
//!
//! - [`Config`]: the YAML files (`domain`, nested `descriptors`, `rate_limit` with `unit` and
//!   `requests_per_unit`, `unlimited`, `name`, `replaces`, `shadow_mode`, wildcards,
//!   `share_threshold`), and tollgate's `algorithm` and `burst`.
//! - [`RateLimitService`]: the service; [`RateLimitService::into_server`] is the tonic server.
//! - [`proto`]: the messages, a server and a client, generated once from `src/envoy/rls.proto`
//!   (our own file, wire-compatible with Envoy's) and committed: no build script, no `protoc`.
//!
//! # Matching, as envoyproxy/ratelimit matches
//!
//! A descriptor's entries are matched level by level against the domain's tree: at each
//! level the entry's exact value first, then a value with `*` wildcards, then the key alone
//! (any value, each value with a counter of its own). The descriptor gets the limit of the
//! node its last entry reaches; a descriptor with more entries than the tree has levels, or
//! that leaves it, gets none and is `OK`. An unknown domain is `OK` for every descriptor.
//! A limit override sent by Envoy (`limit` in the descriptor) takes the place of the
//! configured limit, as a fixed window of its unit. `unlimited: true` is `OK` with
//! `limit_remaining` of `u32::MAX`; `requests_per_unit: 0` refuses every call that costs
//! anything. A named limit gives way to another limit of the same call that `replaces` it.
//! A call costs each descriptor its `hits_addend` if set (0 is a peek: it counts nothing),
//! else the request's `hits_addend`, else 1. A plain `unit` + `requests_per_unit` is a fixed
//! window aligned to the unit (`[kW, (k+1)W)` on the store's clock: Unix time on Redis, as
//! envoyproxy/ratelimit; the process's clock in memory); `algorithm` picks any other.
//!
//! # Where tollgate differs on purpose
//!
//! - **All or nothing.** envoyproxy/ratelimit increments every descriptor's counter on every
//!   call, even those over the limit, so a refused request still uses up the other limits
//!   (and keeps a client that is over its per-second limit from ever recovering its daily
//!   one). tollgate decides every enforced descriptor of a call in **one**
//!   [`Store::check_all`](crate::Store::check_all): a call over any limit consumes from none.
//! - **Statuses.** One store call answers with the decision that binds: that descriptor's
//!   status is exact (`limit_remaining`, and `duration_until_reset` the time until the limit
//!   has reset, or on a refusal until this call would be admitted); the other counted
//!   descriptors report a lower bound on what remains (what they have left is at least as
//!   many calls of their cost). A refused descriptor reports what is left, not 0.
//! - **Shadow mode.** `shadow_mode` limits are checked in a second store call, only for calls
//!   the enforced limits admitted, and always answer `OK`.
//! - **Bad input is refused, not guessed at**: `INVALID_ARGUMENT` for an empty domain, no
//!   descriptors, more than [`DEFAULT_MAX_DESCRIPTORS`] descriptors, a descriptor without
//!   entries or with an empty key, a key or value over [`DEFAULT_MAX_ENTRY_LEN`] bytes, a
//!   limit override without a unit, or negative hits. A cost above a limit (say a
//!   `hits_addend` of `u32::MAX`) is `OVER_LIMIT` without touching the store.
//! - **Store failures** are `UNAVAILABLE`: Envoy then lets the request through unless its
//!   filter sets `failure_mode_deny: true`. Wrap the store in a
//!   [`ResilientStore`](crate::store::ResilientStore) to decide inside tollgate instead
//!   (fail open, fail closed, or a local fallback).
//! - `quota_mode` is refused when the configuration is read; `detailed_metric`,
//!   `value_to_metric` and `metadata` are accepted and change nothing.
//!
//! ```
//! use tollgate::MemoryStore;
//! use tollgate::envoy::proto::{RateLimitDescriptor, RateLimitRequest, rate_limit_descriptor::Entry};
//! use tollgate::envoy::{Config, RateLimitService};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let config = Config::from_yaml(
//!     "domain: edge
//! descriptors:
//!   - key: remote_address
//!     rate_limit: { unit: second, requests_per_unit: 2 }
//! ",
//! )?;
//! let service = RateLimitService::new(MemoryStore::new(), config);
//! let request = RateLimitRequest {
//!     domain: "edge".into(),
//!     descriptors: vec![RateLimitDescriptor {
//!         entries: vec![Entry { key: "remote_address".into(), value: "10.0.0.1".into() }],
//!         ..Default::default()
//!     }],
//!     hits_addend: 0,
//! };
//! let mut codes = Vec::new();
//! for _ in 0..3 {
//!     codes.push(service.decide(&request).await?.overall_code);
//! }
//! assert_eq!(codes, [1, 1, 2]); // OK, OK, OVER_LIMIT
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! To serve it: `tonic::transport::Server::builder().add_service(service.into_server())`
//! (tonic's `server` feature); `examples/envoy_rls.rs` is a complete server.

mod config;
mod problems;
pub mod proto;
mod reader;
mod service;

pub use config::{Config, ConfigError, Problem, Unit};
pub use service::{DEFAULT_MAX_DESCRIPTORS, DEFAULT_MAX_ENTRY_LEN, RateLimitService};
