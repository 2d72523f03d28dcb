//! [`Bindings`]: what a configuration names but only code can give (key extractors, tier
//! resolvers, a responder), and the wrappers that share them.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use http::request::Parts;

use crate::answer::Responder;
use crate::key::{Key, KeyExtractor};
use crate::limiter::{Resolving, TierResolver, boxed};

/// A resolver bound in code.
pub(super) type BoundResolver = Arc<dyn Fn(&str) -> Resolving + Send + Sync>;

/// What a configuration file cannot say, given in code by name: key extractors (a tenant an
/// authentication layer put in the extensions), tier resolvers (a database lookup), and the
/// responder of refusals. The file refers to them (`kind = "custom"`, `binding = "tenant"`;
/// `resolver = "plans"`), and building fails, naming the field, if a name is not bound.
///
/// ```
/// use tollgate::config::{Bindings, Config};
/// use tollgate::key::Extension;
///
/// # #[derive(Clone)] struct Tenant(String);
/// # impl std::fmt::Display for Tenant {
/// #     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str(&self.0) }
/// # }
/// let bindings = Bindings::new()
///     .key("tenant", Extension::<Tenant>::new())
///     .resolver("plans", |key: String| async move { key.starts_with("pro-").then(|| "pro".to_owned()) });
/// let config = Config::from_toml(r#"
///     keys.tenant = { kind = "custom", binding = "tenant" }
///     [[rules]]
///     name = "per-tenant"
///     key = "tenant"
///     tiers.resolver = "plans"
///     tiers.plans = [
///       { name = "free", policies = [{ algorithm = "gcra", rate = "1/s" }] },
///       { name = "pro", policies = [{ algorithm = "gcra", rate = "100/s" }] },
///     ]
/// "#)?;
/// let layer = config.rate_limit_layer(tollgate::MemoryStore::new(), &bindings)?;
/// # let _ = layer;
/// let unbound = config.rate_limit_layer(tollgate::MemoryStore::new(), &Bindings::new()).unwrap_err();
/// assert_eq!(unbound.paths(), ["keys.tenant.binding", "rules[0].tiers.resolver"]);
/// # Ok::<(), tollgate::config::ConfigErrors>(())
/// ```
#[derive(Clone, Default)]
pub struct Bindings {
    pub(super) keys: BTreeMap<String, Arc<dyn KeyExtractor>>,
    pub(super) resolvers: BTreeMap<String, BoundResolver>,
    pub(crate) responder: Option<Arc<dyn Responder>>,
}

impl Bindings {
    /// No bindings.
    pub fn new() -> Self {
        Self::default()
    }

    /// A key extractor, for `kind = "custom"` keys with `binding = name`.
    pub fn key(mut self, name: impl Into<String>, extractor: impl KeyExtractor) -> Self {
        self.keys.insert(name.into(), Arc::new(extractor));
        self
    }

    /// A tier resolver, for tiers with `resolver = name`.
    pub fn resolver(mut self, name: impl Into<String>, resolver: impl TierResolver) -> Self {
        let resolver = Arc::new(resolver);
        self.resolvers.insert(
            name.into(),
            Arc::new(move |key: &str| -> Resolving { boxed(&*resolver, key) }),
        );
        self
    }

    /// The responder of the rate-limit layer's refusals (the default one unless set).
    pub fn responder(mut self, responder: impl Responder) -> Self {
        self.responder = Some(Arc::new(responder));
        self
    }
}

impl fmt::Debug for Bindings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bindings")
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("resolvers", &self.resolvers.keys().collect::<Vec<_>>())
            .field("responder", &self.responder.is_some())
            .finish()
    }
}

/// A key extractor made from the file, or bound in code.
#[derive(Clone)]
pub(super) struct SharedKey(pub(super) Arc<dyn KeyExtractor>);

impl KeyExtractor for SharedKey {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        self.0.extract(parts)
    }

    fn extract_into(&self, parts: &Parts, out: &mut Key) -> bool {
        self.0.extract_into(parts, out)
    }
}

/// The tiers listed in the file, then the resolver bound in code.
pub(super) struct ListedThenResolved {
    pub(super) listed: BTreeMap<String, String>,
    pub(super) resolver: Option<BoundResolver>,
}

impl TierResolver for ListedThenResolved {
    type Future = Resolving;

    fn resolve(&self, key: &str) -> Resolving {
        if let Some(tier) = self.listed.get(key) {
            let tier = tier.clone();
            return Box::pin(async move { Ok(Some(tier)) });
        }
        match &self.resolver {
            Some(resolver) => resolver(key),
            None => Box::pin(std::future::ready(Ok(None))),
        }
    }
}
