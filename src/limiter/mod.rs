//! Rules and limits: which requests are counted, by which key, under which policies, at what
//! cost, decided all or nothing in one store call.
//!
//! A [`Limiter`] is a list of [`Rule`]s over one [`Store`](crate::Store). Every rule that
//! matches a request applies to it (per user, per tenant, global, per endpoint): the request
//! is admitted only if every policy of every applicable rule admits it, and it consumes from
//! none of them otherwise. Rules can take their policies from the key's tier ([`Tiers`],
//! resolved asynchronously and cached, one lookup per key at a time that the key's concurrent
//! requests share; a resolver that fails, panics or takes longer than [`Tiers::timeout`]
//! counts the requests in the default tier), and a rule in shadow mode is decided and
//! reported but never refuses. The [`RateLimitLayer`](crate::RateLimitLayer) runs a limiter in front of an
//! HTTP service.
//!
//! ```
//! use std::time::Duration;
//! use http::StatusCode;
//! use tollgate::{MemoryStore, Policy, Rate};
//! use tollgate::key::{Extension, Global, Header};
//! use tollgate::limiter::{Limiter, MissingKey, Rule, Tiers};
//!
//! # #[derive(Clone)] struct Tenant(String);
//! # impl std::fmt::Display for Tenant {
//! #     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str(&self.0) }
//! # }
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let limiter = Limiter::builder(MemoryStore::new())
//!     // Per API key, by plan; the plan is looked up at most once a minute per key.
//!     .rule(
//!         Rule::new("plan")
//!             .key(Header::from_static("x-api-key"))
//!             .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
//!             .tiers(
//!                 Tiers::new(|key: String| async move { key.starts_with("pro_").then(|| "pro".to_owned()) })
//!                     .tier("free", [Policy::gcra(Rate::per_minute(60), 10)?])
//!                     .tier("pro", [Policy::gcra(Rate::per_minute(600), 100)?])
//!                     .cache_for(Duration::from_secs(60)),
//!             ),
//!     )
//!     // Per tenant (set by the authentication layer), a daily quota.
//!     .rule(
//!         Rule::new("tenant")
//!             .key(Extension::<Tenant>::new())
//!             .on_missing_key(MissingKey::Skip)
//!             .policy(Policy::fixed_window(100_000, Duration::from_secs(86_400))?),
//!     )
//!     // Exports are expensive: 10 units each, against a global bucket.
//!     .rule(
//!         Rule::new("exports")
//!             .path_prefix("/export")
//!             .key(Global)
//!             .cost(10)
//!             .policy(Policy::token_bucket(Rate::per_second(50), 100)?),
//!     )
//!     .build()?;
//! assert_eq!(limiter.rule_names().count(), 3);
//! # Ok(())
//! # }
//! ```

mod build;
mod compiled;
mod observe;
mod plan;
mod rule;
mod tier;

pub(crate) use build::valid_name;
pub use build::{Limiter, LimiterBuilder, LimiterError};
pub(crate) use compiled::{SF_INTEGER_MAX, field_value};
pub use observe::ShadowRejection;
pub(crate) use plan::{Applied, NoKey, Plan, ShadowPlan, Single, Start, hashed_key};
pub(crate) use rule::Matcher;
pub use rule::{MissingKey, Rule};
pub use tier::{
    DEFAULT_TIER_CACHE_CAPACITY, DEFAULT_TIER_TIMEOUT, DEFAULT_TIER_TTL, TierAnswer, TierResolver,
    Tiers,
};
#[cfg(feature = "serde")]
pub(crate) use tier::{Resolving, boxed};
pub(crate) use tier::{TierLookup, TierOf};
