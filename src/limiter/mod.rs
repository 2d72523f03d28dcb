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
//! # Paths
//!
//! A rule on a path ([`Rule::path`]) or a prefix ([`Rule::path_prefix`]), here and in the
//! concurrency and shape layers, matches the path the application acts on, whatever its
//! spelling, since a router decodes what it hands a handler (`/files/%65xports/a.csv` is
//! `exports/a.csv` to the handler of `/files/{*path}`):
//!
//! - every `%XX` escape is decoded (once), `%2F` as a `/`: `/files/exports%2Fa.csv` is under
//!   `/files/exports`;
//! - runs of `/` count as one (`/files//exports`);
//! - dot segments are resolved, and the rule matches if the path does before or after: a
//!   `..` that could climb out of a handler's root is read as stopping there, at any of the
//!   rule's own segments (`/files/../exports` is counted by a rule on `/files/exports`);
//! - letters keep their case, and a trailing `/` stays part of the path (`/login/` is not
//!   `/login`), as in axum's router; the query string never counts.
//!
//! An ambiguous spelling is counted rather than let through. The rule's own path is read the
//! same way when it is made (`path("/%6Cogin")` is `path("/login")`). A path with no `%`, no
//! `//` and no dot segment (nearly all of them) is compared as it is, with nothing decoded or
//! allocated.
//!
//! With feature `axum`, the path is the request's full original path, from axum's
//! `OriginalUri`, which the outermost router puts into the extensions: inside
//! `Router::nest("/api", ...)`, where axum strips `/api` before the inner router's layers
//! see the path, a rule on `/api/login` still matches (a rule on `/login` does not). Outside
//! any router, the request's own path is used.
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
mod path;
mod plan;
mod rule;
mod tier;

pub(crate) use build::valid_name;
pub use build::{Limiter, LimiterBuilder, LimiterError};
pub(crate) use compiled::{SF_INTEGER_MAX, field_value};
pub use observe::ShadowRejection;
pub(crate) use plan::{
    Applied, Costly, NoKey, Plan, ShadowCheck, ShadowPlan, Single, Start, hashed_key,
};
pub(crate) use rule::Matcher;
#[cfg(feature = "axum")]
pub(crate) use rule::old_route_syntax;
pub use rule::{MissingKey, Rule};
pub use tier::{
    DEFAULT_TIER_CACHE_CAPACITY, DEFAULT_TIER_TIMEOUT, DEFAULT_TIER_TTL, TierAnswer, TierResolver,
    Tiers,
};
#[cfg(feature = "serde")]
pub(crate) use tier::{Resolving, boxed};
pub(crate) use tier::{TierLookup, TierOf};
