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
//!   envoyproxy/ratelimit's `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` comes near: it reads
//!   the counters first and leaves out increments when one would go over, but the read and
//!   the increments are two round trips, so calls that meet between them still count.
//! - **Statuses.** One store call answers with the decision that binds: that descriptor's
//!   status is exact (`limit_remaining`, and `duration_until_reset` the time until the limit
//!   has reset, or on a refusal until this call would be admitted); the other counted
//!   descriptors report a lower bound on what remains (what they have left is at least as
//!   many calls of their cost). A refused descriptor reports what is left, not 0.
//! - **Shadow mode.** `shadow_mode` limits are checked in a second store call, only for calls
//!   the enforced limits admitted, and always answer `OK`.
//! - **Bad input is refused, not guessed at**: `INVALID_ARGUMENT` for an empty domain, no
//!   descriptors, more than [`DEFAULT_MAX_DESCRIPTORS`] descriptors, a descriptor without
//!   entries, with more than [`MAX_DESCRIPTOR_ENTRIES`] or with an empty key, a key or value
//!   over [`DEFAULT_MAX_ENTRY_LEN`] bytes, a
//!   limit override without a unit, or negative hits. A cost above a limit (say a
//!   `hits_addend` of `u32::MAX`) is `OVER_LIMIT` without touching the store.
//! - **Store failures** are `UNAVAILABLE`: Envoy then lets the request through unless its
//!   filter sets `failure_mode_deny: true`. Wrap the store in a
//!   [`ResilientStore`](crate::store::ResilientStore) to decide inside tollgate instead
//!   (fail open, fail closed, or a local fallback).
//! - `quota_mode` is refused when the configuration is read; `value_to_metric` and
//!   `metadata` are accepted and change nothing; `detailed_metric` labels the metrics by the
//!   request's values, within a bound (below).
//!
//! # Metrics
//!
//! With the `metrics` feature the service records, through the [`metrics`](crate::metrics)
//! facade (install the recorder before building the service):
//!
//! - `tollgate_envoy_hits_total{domain, descriptor, outcome}`: the hits of each descriptor
//!   that matched a counted limit, by `outcome`: `within_limit`, `near_limit` (more than
//!   80 % of the limit used, envoyproxy/ratelimit's default ratio; of the descriptors of one
//!   call, only the one that runs out first can be near, as the one store call tells the
//!   others' remainders only as lower bounds), `over_limit`,
//!   `shadow_mode` (a shadow limit would have refused), `not_counted` (another limit of the
//!   call refused it: all or nothing). They are exclusive, so their sum is
//!   envoyproxy/ratelimit's `total_hits`, and its `within_limit` is ours plus `near_limit`.
//! - `tollgate_envoy_calls_total{domain, result}`: `ok`, `over_limit`, `store_error`,
//!   `invalid`, `unknown_domain` (the last two with an empty `domain`: a request's domain is
//!   never a label).
//! - `tollgate_envoy_store_errors_total{domain, pass}`: failed store calls, `enforced` or
//!   `shadow`.
//! - `tollgate_envoy_config_reloads_total{result}`: `success` ([`RateLimitService::set_config`],
//!   [`RateLimitService::reload_from`]) or `error` (a configuration `reload_from` refused).
//!
//! `descriptor` is the configured descriptor's path, as envoyproxy/ratelimit names its
//! statistics (`key` or `key_value` per level, joined by `.`: `message_type_marketing.to_number`),
//! never the request's values, so the labels are bounded by the configuration. Two cases take
//! a label from the request: `detailed_metric: true` on the descriptor with the limit (each
//! entry's `key_value` as the request sent it; a `share_threshold` wildcard's pattern in place
//! of the value), and a limit Envoy sent (`override:` and the entries' keys). A service makes
//! at most [`RateLimitService::max_metric_descriptors`] such labels (default
//! [`DEFAULT_MAX_METRIC_DESCRIPTORS`]); past it, a new detailed label counts under the
//! configured path and a new override under `_other`. envoyproxy/ratelimit has no such bound.
//!
//! # Reload
//!
//! [`RateLimitService::set_config`] swaps the configuration for every clone of the service;
//! [`RateLimitService::reload_from`] reads a file or folder ([`Config::from_path`]) first and
//! keeps the running configuration when the new one has a problem. Counters live in the store
//! under the descriptor's entries and the limit's parameters: a limit the new configuration
//! keeps unchanged keeps its counts. `examples/envoy_rls.rs` reloads on SIGHUP and when its
//! files change.
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
mod metrics;
mod problems;
pub mod proto;
mod reader;
mod service;

pub use config::{Config, ConfigError, Problem, Unit};
pub use service::{
    DEFAULT_MAX_DESCRIPTORS, DEFAULT_MAX_ENTRY_LEN, DEFAULT_MAX_METRIC_DESCRIPTORS,
    MAX_DESCRIPTOR_ENTRIES, RateLimitService,
};
