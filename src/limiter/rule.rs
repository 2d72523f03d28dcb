//! What a rule says: which requests, which key, which policies, what each request costs.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use http::{Method, StatusCode};
use smallvec::SmallVec;

use super::path::RequestPath;
use super::tier::Tiers;
use crate::Policy;
use crate::key::{Global, Key, KeyExtractor};

/// One limit of the [`Limiter`](super::Limiter): which requests it counts, by which key,
/// under which policies, at what cost.
///
/// - **Which requests**: every request, unless narrowed by methods ([`Rule::method`]) and a
///   route: an exact path ([`Rule::path`]), a path prefix ([`Rule::path_prefix`]) or, with
///   feature `axum`, a route template as axum matched it ([`Rule::route`], `/users/{id}`).
///   Every rule that matches a request applies to it; there is no first-match.
/// - **Which key**: [`Rule::key`], [`Global`](crate::key::Global) when not set (one limit for
///   all requests the rule matches).
/// - **Which policies**: one or several ([`Rule::policy`]; per second and per day, say), all
///   of which must admit the request; or [`Rule::tiers`], which picks the policies by the
///   key's tier.
/// - **What it costs**: 1 unless set, a fixed weight ([`Rule::cost`]) or a closure over the
///   request head ([`Rule::cost_fn`]). A cost of 0 is checked (and reported) but consumes
///   nothing. A cost above a policy's limit can never be admitted: the request is refused as
///   over that limit (429 naming the policy, with no `Retry-After`, since no wait would do;
///   gRPC `RESOURCE_EXHAUSTED`), without asking the store, and consumes nothing from any
///   policy. A store that answers such a cost with
///   [`StoreError::CostExceedsLimit`](crate::StoreError::CostExceedsLimit) gets the same
///   answer, never a 503 that a failure policy could turn into an admission.
/// - **Each policy once**: the same policy (algorithm, numbers and name) twice in one rule,
///   or in one tier, is refused when the limiter is built
///   ([`LimiterError::DuplicatePolicy`](super::LimiterError::DuplicatePolicy)): it is one
///   state in the store, which every request would be counted against twice.
/// - **No key**: see [`MissingKey`]; by default such a request is refused with a 500, which
///   makes a misconfigured key (say, `PeerIp` without `ConnectInfo`) impossible to miss.
/// - **Shadow**: [`Rule::shadow`] decides and reports without ever refusing.
///
/// The rule's name is shown to clients (it names the policies in the `RateLimit` fields
/// unless the policies have names of their own) and ends its keys in the store (`key@rule`),
/// so two rules never share state, whatever their names and keys. Names are 1 to 64
/// characters of `a-z A-Z 0-9 - _ . :`.
///
/// ```
/// use std::time::Duration;
/// use http::Method;
/// use tollgate::{Policy, Rate};
/// use tollgate::key::{Header, PeerIp};
/// use tollgate::limiter::{MissingKey, Rule};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let login = Rule::new("login")
///     .method(Method::POST)
///     .path("/login")
///     .key(PeerIp::new())
///     .policy(Policy::sliding_log(5, Duration::from_secs(15 * 60))?);
/// let exports = Rule::new("exports")
///     .path_prefix("/api/export")
///     .key(Header::from_static("x-api-key"))
///     .on_missing_key(MissingKey::Reject(http::StatusCode::UNAUTHORIZED))
///     .policy(Policy::token_bucket(Rate::per_minute(60), 60)?)
///     .cost(10);
/// assert_eq!(login.name(), "login");
/// # let _ = exports;
/// # Ok(())
/// # }
/// ```
pub struct Rule {
    pub(crate) name: String,
    pub(crate) methods: SmallVec<[Method; 2]>,
    pub(crate) exact_methods: bool,
    pub(crate) route: Route,
    pub(crate) key: Box<dyn KeyExtractor>,
    pub(crate) policies: Vec<Policy>,
    pub(crate) tiers: Option<Tiers>,
    pub(crate) cost: Cost,
    pub(crate) missing: MissingKey,
    pub(crate) shadow: bool,
}

impl Rule {
    /// A rule named `name` that matches every request, keyed by [`Global`], costing 1, with no
    /// policy yet (add at least one, or tiers).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            methods: SmallVec::new(),
            exact_methods: false,
            route: Route::Any,
            key: Box::new(Global),
            policies: Vec::new(),
            tiers: None,
            cost: Cost::Fixed(1),
            missing: MissingKey::default(),
            shadow: false,
        }
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Only requests with this method (call again to add more methods). A rule on `GET` also
    /// applies to `HEAD`, which servers (axum's `get` among them) answer with the same handler;
    /// see [`Rule::exact_methods`].
    pub fn method(mut self, method: Method) -> Self {
        self.methods.push(method);
        self
    }

    /// Only the methods given, exactly: a rule on `GET` then does not apply to `HEAD`.
    pub fn exact_methods(mut self) -> Self {
        self.exact_methods = true;
        self
    }

    /// Only requests for exactly this path (`/login`), however it is spelled: paths are
    /// compared percent-decoded (`/%6Cogin` is `/login`), with runs of `/` collapsed and,
    /// as a second reading, dot segments resolved; with feature `axum`, the full path even
    /// inside a nested router. See [the rules on paths](super#paths).
    pub fn path(mut self, path: impl Into<String>) -> Self {
        self.route = Route::Exact(super::path::normalize(&path.into()));
        self
    }

    /// Only requests for paths under `prefix`, by whole segments: `/api` matches `/api` and
    /// `/api/users` but not `/apis`. Paths are read as [`Rule::path`] reads them:
    /// `/files/%65xports/a.csv` and `/files/exports%2Fa.csv` are under `/files/exports`.
    pub fn path_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.route = Route::Prefix(super::path::normalize(&prefix.into()));
        self
    }

    /// Only requests that axum routed to this route template (`/users/{id}`), as its
    /// `MatchedPath` says. This needs the layer inside the router (`Router::layer` or
    /// `Router::route_layer`), where axum has matched the route; a rule on a template never
    /// matches a request without a `MatchedPath`. axum 0.7's syntax (`/users/:id`,
    /// `/files/*rest`), which axum 0.8 never matches, is refused when the limiter is built
    /// ([`LimiterError::OldRouteSyntax`](super::LimiterError::OldRouteSyntax)), with the
    /// template in axum 0.8's syntax.
    #[cfg(feature = "axum")]
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    pub fn route(mut self, template: impl Into<String>) -> Self {
        self.route = Route::Template(template.into().into());
        self
    }

    /// Counts requests by the key this extractor finds (see [`crate::key`]).
    pub fn key(mut self, key: impl KeyExtractor) -> Self {
        self.key = Box::new(key);
        self
    }

    /// Adds a policy; a request is admitted only if every policy of every rule that applies
    /// admits it.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policies.push(policy);
        self
    }

    /// Adds several policies (per second, per minute, per day).
    pub fn policies(mut self, policies: impl IntoIterator<Item = Policy>) -> Self {
        self.policies.extend(policies);
        self
    }

    /// Picks the policies by the tier of the key (free, pro, ...) instead of fixed policies.
    pub fn tiers(mut self, tiers: Tiers) -> Self {
        self.tiers = Some(tiers);
        self
    }

    /// Every matching request costs `cost` units.
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = Cost::Fixed(cost);
        self
    }

    /// Each request costs what `cost` says, from its head (method, URI, headers).
    pub fn cost_fn<F>(mut self, cost: F) -> Self
    where
        F: Fn(&Parts) -> u64 + Send + Sync + 'static,
    {
        self.cost = Cost::Fn(Arc::new(cost));
        self
    }

    /// What to do with a request this rule matches but finds no key for.
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.missing = missing;
        self
    }

    /// Shadow mode: the rule is decided and reported (the
    /// [`ShadowRejection`](super::ShadowRejection) request extension, the limiter's
    /// observer) but never refuses a request, and its fields are not sent to clients: a request
    /// it finds no key for skips it, whatever [`Rule::on_missing_key`] says. Use it
    /// to roll out a limit safely. Shadow rules are checked after the enforced ones, all or
    /// nothing among themselves, and only for requests the enforced rules admitted. A shadow
    /// rule never holds a request up: with [`Rule::tiers`], a key whose tier is not known yet
    /// is skipped while its tier is looked up on a task of its own (one lookup per key at a
    /// time, on the tokio runtime; outside one nothing is looked up), and its next requests
    /// are decided in that tier.
    pub fn shadow(mut self) -> Self {
        self.shadow = true;
        self
    }
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("name", &self.name)
            .field("methods", &self.methods)
            .field("route", &self.route)
            .field("policies", &self.policies)
            .field("tiers", &self.tiers)
            .field("cost", &self.cost)
            .field("missing", &self.missing)
            .field("shadow", &self.shadow)
            .finish_non_exhaustive()
    }
}

/// What a rule does with a request it matches but finds no key for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// The rule does not apply to the request. To count such requests under a shared key
    /// instead, give the extractor a fallback: `Header::from_static("x-api-key").or(Global)`.
    Skip,
    /// The request is refused with this status and a problem+json body naming the rule (for
    /// gRPC, the matching gRPC status). The default is 500 Internal Server Error: a rule
    /// whose key cannot be found is usually a misconfiguration (no `ConnectInfo`, no
    /// authentication layer in front). Use 401 for a missing credential.
    Reject(StatusCode),
}

impl Default for MissingKey {
    fn default() -> Self {
        MissingKey::Reject(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

/// What a rule matches and how it finds a request's key: the part of a [`Rule`] that the
/// layers other than the rate limit use.
pub(crate) struct Matcher {
    pub(crate) name: Arc<str>,
    /// `@name`, the end of each of the rule's keys.
    suffix: Box<str>,
    methods: SmallVec<[Method; 2]>,
    route: Route,
    key: Box<dyn KeyExtractor>,
    missing: MissingKey,
    cost: Cost,
}

impl Matcher {
    /// The matching part of `rule`; its policies, tiers and shadow mode are the caller's to
    /// refuse.
    pub(crate) fn new(rule: Rule) -> Self {
        Matcher {
            suffix: format!("@{}", rule.name).into(),
            name: rule.name.into(),
            methods: effective_methods(rule.methods, rule.exact_methods),
            route: rule.route,
            key: rule.key,
            missing: rule.missing,
            cost: rule.cost,
        }
    }

    pub(crate) fn matches(&self, parts: &Parts) -> bool {
        (self.methods.is_empty() || self.methods.contains(&parts.method))
            && self.route.matches(parts, &RequestPath::of(parts))
    }

    /// Whether the rule refuses a request it finds no key for.
    pub(crate) fn refuses_without_key(&self) -> bool {
        matches!(self.missing, MissingKey::Reject(_))
    }

    /// The request's key, `key@rule` (hashed past [`MAX_KEY_LEN`](crate::key::MAX_KEY_LEN),
    /// as the limiter's are); `Ok(None)` when the rule skips a request without a key, `Err`
    /// with the status to refuse it with otherwise.
    pub(crate) fn key(&self, parts: &Parts) -> Result<Option<Key>, StatusCode> {
        let mut key = Key::new();
        if !self.key.extract_into(parts, &mut key) {
            return match self.missing {
                MissingKey::Reject(status) => Err(status),
                _ => Ok(None),
            };
        }
        key.push_raw(&self.suffix);
        if key.len() <= crate::key::MAX_KEY_LEN {
            return Ok(Some(key));
        }
        let text = key.as_str();
        let hashed = super::plan::hashed_key(&text[..text.len() - self.suffix.len()], &self.suffix);
        Ok(Some(hashed))
    }

    /// The key the rule's extractor finds, before `@rule` and never hashed: what a tier
    /// resolver is asked about.
    pub(crate) fn raw_key(&self, parts: &Parts) -> Option<Box<str>> {
        let mut key = Key::new();
        self.key
            .extract_into(parts, &mut key)
            .then(|| key.as_str().into())
    }

    /// What the request costs.
    pub(crate) fn cost(&self, parts: &Parts) -> u64 {
        self.cost.of(parts)
    }
}

/// The methods a rule matches: those given, and `HEAD` with `GET` unless `exact`.
pub(crate) fn effective_methods(
    mut methods: SmallVec<[Method; 2]>,
    exact: bool,
) -> SmallVec<[Method; 2]> {
    if !exact && methods.contains(&Method::GET) && !methods.contains(&Method::HEAD) {
        methods.push(Method::HEAD);
    }
    methods
}

/// Which requests a rule matches, by path: exact paths and prefixes as
/// [`normalize`](super::path::normalize) reads them.
#[derive(Clone)]
pub(crate) enum Route {
    Any,
    Exact(Box<[u8]>),
    Prefix(Box<[u8]>),
    #[cfg(feature = "axum")]
    Template(Box<str>),
}

impl fmt::Debug for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Route::Any => f.write_str("Any"),
            Route::Exact(p) => write!(f, "Exact({:?})", String::from_utf8_lossy(p)),
            Route::Prefix(p) => write!(f, "Prefix({:?})", String::from_utf8_lossy(p)),
            #[cfg(feature = "axum")]
            Route::Template(t) => write!(f, "Template({t:?})"),
        }
    }
}

impl Route {
    /// Whether the request (whose path, read once for all rules, is `path`) is on this route.
    #[inline]
    pub(crate) fn matches(&self, parts: &Parts, path: &RequestPath<'_>) -> bool {
        #[cfg(not(feature = "axum"))]
        let _ = parts;
        match self {
            Route::Any => true,
            Route::Exact(exact) => path.is(exact),
            Route::Prefix(prefix) => path.is_under(prefix),
            #[cfg(feature = "axum")]
            Route::Template(template) => parts
                .extensions
                .get::<axum::extract::MatchedPath>()
                .is_some_and(|m| m.as_str() == &**template),
        }
    }
}

/// `template` in axum 0.8's syntax if it is written in axum 0.7's (a segment that starts with
/// `:` or `*`, which axum 0.8 no longer reads as a parameter): `/users/:id` is
/// `/users/{id}`, `/files/*rest` is `/files/{*rest}`.
#[cfg(feature = "axum")]
pub(crate) fn old_route_syntax(template: &str) -> Option<String> {
    let old = |s: &str| s.len() > 1 && (s.starts_with(':') || s.starts_with('*'));
    if !template.split('/').any(old) {
        return None;
    }
    let segments: Vec<String> = template
        .split('/')
        .map(|s| match s.strip_prefix(':') {
            Some(name) if !name.is_empty() => format!("{{{name}}}"),
            _ if old(s) => format!("{{{s}}}"),
            _ => s.to_owned(),
        })
        .collect();
    Some(segments.join("/"))
}

/// What a request costs.
#[derive(Clone)]
pub(crate) enum Cost {
    Fixed(u64),
    Fn(Arc<dyn Fn(&Parts) -> u64 + Send + Sync>),
}

impl Cost {
    #[inline]
    pub(crate) fn of(&self, parts: &Parts) -> u64 {
        match self {
            Cost::Fixed(c) => *c,
            Cost::Fn(f) => f(parts),
        }
    }
}

impl fmt::Debug for Cost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cost::Fixed(c) => write!(f, "Fixed({c})"),
            Cost::Fn(_) => f.write_str("Fn(..)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_match_whole_segments() {
        let parts = |p: &str| http::Request::get(p).body(()).unwrap().into_parts().0;
        let on = |route: &Route, p: &str| {
            let parts = parts(p);
            route.matches(&parts, &RequestPath::of(&parts))
        };
        let api = Route::Prefix(b"/api"[..].into());
        assert!(on(&api, "/api"));
        assert!(on(&api, "/api/users"));
        assert!(!on(&api, "/apis"));
        let slash = Route::Prefix(b"/api/"[..].into());
        assert!(on(&slash, "/api/x"));
        assert!(!on(&slash, "/api"));
        assert!(on(&Route::Exact(b"/a"[..].into()), "/a?x=1"));
        assert!(!on(&Route::Exact(b"/a"[..].into()), "/a/"));
    }

    #[cfg(feature = "axum")]
    #[test]
    fn axum_07_templates_are_told_apart() {
        let new = |t: &str| old_route_syntax(t);
        assert_eq!(new("/users/:id").as_deref(), Some("/users/{id}"));
        assert_eq!(new("/a/:x/b/*rest").as_deref(), Some("/a/{x}/b/{*rest}"));
        for fine in [
            "/users/{id}",
            "/files/{*rest}",
            "/a:b",
            "/a/b:c",
            "/",
            "/:",
            "/*",
        ] {
            assert_eq!(new(fine), None, "{fine}");
        }
    }
}
