//! tollgate protects a service from too much traffic: rate limits and quotas with every
//! classic algorithm, exact to the last request, as tower middleware ([`RateLimitLayer`]) for
//! axum, tonic and any tower HTTP service, on an in-process store ([`MemoryStore`]) or on Redis
//! (`RedisStore`, feature `redis`) with the same decisions.
//!
//! - [`Policy`]: what a limit is (six algorithms, weighted costs); [`Decision`]: the answer,
//!   with an exact `retry_after`.
//! - [`store`]: the [`Store`] trait, the stores, and [`store::ResilientStore`] (timeouts, circuit
//!   breaker, fail open / closed / local fallback).
//! - [`key`], [`limiter`], [`http`]: keys from requests, rules and tiers, and the layer;
//!   [`answer`]: how every layer answers a refused request.
//! - [`concurrency`]: [`ConcurrencyLimitLayer`], at most so many requests in flight per key
//!   (a permit held until the response body ends), and in all; [`shed`]: [`LoadShedLayer`],
//!   refusing early when the service has no capacity left, least important first; [`shape`]:
//!   [`ShapeLayer`], the leaky bucket as a queue, delaying requests to a constant rate.
//! - [`algorithm`]: the pure state machines; [`clock`]: time.
//! - `envoy` (feature `envoy`): tollgate as Envoy's rate limit service (`ShouldRateLimit` on
//!   any store, envoyproxy/ratelimit's YAML files).
//! - [`telemetry`]: tracing spans and events (feature `tracing`), and `metrics` (feature
//!   `metrics`): every metric the layers and stores record, in one table.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{MemoryStore, Policy, Rate};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let policy = Policy::token_bucket(Rate::per_second(5), 10)?; // 5/s, bursts of 10
//! let store = MemoryStore::new();
//! let admitted = (0..12)
//!     .filter(|_| store.check_now("user:42", &policy, 1).map(|d| d.allowed()).unwrap_or(false))
//!     .count();
//! assert_eq!(admitted, 10);
//! # Ok(())
//! # }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]
// Library code never unwraps; tests may.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

#[cfg(feature = "redis")]
#[doc(hidden)]
#[path = "fuzz.rs"]
pub mod __fuzz;
pub mod algorithm;
pub mod answer;
mod breaker;
#[cfg(feature = "client")]
pub mod client;
pub mod clock;
pub mod concurrency;
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub mod config;
mod decision;
#[cfg(feature = "envoy")]
#[cfg_attr(docsrs, doc(cfg(feature = "envoy")))]
pub mod envoy;
pub mod http;
mod inflight;
pub mod key;
pub mod limiter;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
// Without the feature: only the names, for the no-op handles.
#[cfg(not(feature = "metrics"))]
#[allow(dead_code, unreachable_pub)]
mod metrics;
mod policy;
pub mod shape;
pub mod shed;
pub mod store;
mod sync;
pub mod telemetry;

pub use self::http::RateLimitLayer;
pub use concurrency::ConcurrencyLimitLayer;
pub use decision::Decision;
pub use policy::{Algorithm, MAX_NAME_LEN, MAX_SLIDING_LOG_LIMIT, Policy, PolicyError, Rate};
pub use shape::ShapeLayer;
pub use shed::LoadShedLayer;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::redis::RedisStore;
pub use store::{Check, MemoryStore, Store, StoreError};
