//! The layer: configuration only.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::HeaderValue;
use tower_layer::Layer;

use super::service::RateLimit;
use crate::Store;
use crate::answer::{DefaultResponder, HeaderProfile, ResetFormat, Responder};
use crate::limiter::{Limiter, LimiterBuilder, LimiterError, Rule, ShadowRejection};
use crate::telemetry::KeyTrace;

/// The default `Retry-After` of a 503 sent because the store could not decide.
pub const DEFAULT_UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Applies a [`Limiter`]'s rules to every request of an HTTP service (see the
/// [module docs](crate::http)).
///
/// The limiter and the options live in one `Arc` made when the layer is built: cloning the
/// layer, applying it to many routes (axum's `Router::layer` does, once per route) or cloning
/// the services it makes shares one set of limits.
pub struct RateLimitLayer<St> {
    source: Source<St>,
}

/// Where a layer's services find the limiter and options: fixed when the layer was built, or
/// swapped whole by a [`Reloader`](crate::config::Reloader).
#[cfg_attr(not(feature = "serde"), allow(dead_code))]
pub(crate) enum Source<St> {
    Fixed(Arc<Shared<St>>),
    Live(Arc<ArcSwap<Shared<St>>>),
}

impl<St> Source<St> {
    /// What requests use now.
    pub(crate) fn current(&self) -> Arc<Shared<St>> {
        match self {
            Source::Fixed(shared) => Arc::clone(shared),
            Source::Live(cell) => cell.load_full(),
        }
    }
}

impl<St> Clone for Source<St> {
    fn clone(&self) -> Self {
        match self {
            Source::Fixed(shared) => Source::Fixed(Arc::clone(shared)),
            Source::Live(cell) => Source::Live(Arc::clone(cell)),
        }
    }
}

/// The limiter a layer runs now (see [`RateLimitLayer::limiter`]); it stays the same object
/// while held, whatever a reload does meanwhile.
pub struct CurrentLimiter<St>(Arc<Shared<St>>);

impl<St> std::ops::Deref for CurrentLimiter<St> {
    type Target = Limiter<St>;

    fn deref(&self) -> &Limiter<St> {
        &self.0.limiter
    }
}

impl<St> fmt::Debug for CurrentLimiter<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0.limiter, f)
    }
}

/// What every service of one layer shares.
pub(crate) struct Shared<St> {
    pub(crate) limiter: Limiter<St>,
    pub(crate) profile: HeaderProfile,
    pub(crate) reset: ResetFormat,
    pub(crate) responder: Arc<dyn Responder>,
    pub(crate) unavailable_retry_after: Duration,
    pub(crate) decision_extension: bool,
    /// `RateLimit-Policy` when every rule applied with its first policy set (the usual case
    /// of stacked rules without route filters or tiers), joined once at build time.
    pub(crate) all_policies: Option<HeaderValue>,
}

impl<St: Store> RateLimitLayer<St> {
    /// A builder of rules over `store`, with the options of the answers.
    pub fn builder(store: St) -> RateLimitLayerBuilder<St> {
        RateLimitLayerBuilder {
            limiter: Limiter::builder(store),
            profile: HeaderProfile::default(),
            reset: ResetFormat::default(),
            responder: Arc::new(DefaultResponder),
            unavailable_retry_after: DEFAULT_UNAVAILABLE_RETRY_AFTER,
            decision_extension: false,
            key_trace: KeyTrace::None,
        }
    }

    /// The layer of a limiter built on its own, with the default answers.
    pub fn new(limiter: Limiter<St>) -> Self {
        Self {
            source: Source::Fixed(Arc::new(Shared {
                profile: HeaderProfile::default(),
                reset: ResetFormat::default(),
                responder: Arc::new(DefaultResponder),
                unavailable_retry_after: DEFAULT_UNAVAILABLE_RETRY_AFTER,
                decision_extension: false,
                all_policies: all_policies(&limiter),
                limiter,
            })),
        }
    }

    /// The limiter that requests go through now (after a
    /// [reload](crate::config::Reloader), the new one).
    pub fn limiter(&self) -> CurrentLimiter<St> {
        CurrentLimiter(self.source.current())
    }

    /// A layer whose limiter and options a reloader swaps, and the cell it swaps.
    #[cfg_attr(not(feature = "serde"), allow(dead_code))]
    pub(crate) fn live(shared: Shared<St>) -> (Self, Arc<ArcSwap<Shared<St>>>) {
        let cell = Arc::new(ArcSwap::from_pointee(shared));
        let layer = RateLimitLayer {
            source: Source::Live(Arc::clone(&cell)),
        };
        (layer, cell)
    }

    /// How the decision span shows keys (see [`RateLimitLayerBuilder::trace_keys`]).
    pub fn key_trace(&self) -> KeyTrace {
        self.source.current().limiter.key_trace
    }
}

impl<St> Clone for RateLimitLayer<St> {
    fn clone(&self) -> Self {
        Self {
            source: self.source.clone(),
        }
    }
}

impl<St> fmt::Debug for RateLimitLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shared = self.source.current();
        f.debug_struct("RateLimitLayer")
            .field("limiter", &shared.limiter)
            .field("profile", &shared.profile)
            .field("reloadable", &matches!(self.source, Source::Live(_)))
            .finish_non_exhaustive()
    }
}

impl<S, St> Layer<S> for RateLimitLayer<St> {
    type Service = RateLimit<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::from_source(inner, self.source.clone())
    }
}

/// Builds a [`RateLimitLayer`]: rules (as [`LimiterBuilder`] takes them) and the options of the
/// answers.
pub struct RateLimitLayerBuilder<St> {
    limiter: LimiterBuilder<St>,
    profile: HeaderProfile,
    reset: ResetFormat,
    responder: Arc<dyn Responder>,
    unavailable_retry_after: Duration,
    decision_extension: bool,
    key_trace: KeyTrace,
}

impl<St: Store> RateLimitLayerBuilder<St> {
    /// Adds a rule.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.limiter = self.limiter.rule(rule);
        self
    }

    /// See [`LimiterBuilder::on_shadow_rejection`].
    pub fn on_shadow_rejection<F>(mut self, observer: F) -> Self
    where
        F: Fn(&ShadowRejection) + Send + Sync + 'static,
    {
        self.limiter = self.limiter.on_shadow_rejection(observer);
        self
    }

    /// Which rate-limit fields responses carry ([`HeaderProfile::Ietf`] by default).
    pub fn headers(mut self, profile: HeaderProfile) -> Self {
        self.profile = profile;
        self
    }

    /// How `X-RateLimit-Reset` tells the time, for the legacy profiles.
    pub fn legacy_reset(mut self, format: ResetFormat) -> Self {
        self.reset = format;
        self
    }

    /// Answers refused requests with `responder` instead of [`DefaultResponder`].
    pub fn responder(mut self, responder: impl Responder) -> Self {
        self.responder = Arc::new(responder);
        self
    }

    /// The same, shared (a reloader keeps the one it was given).
    #[cfg_attr(not(feature = "serde"), allow(dead_code))]
    pub(crate) fn shared_responder(mut self, responder: Arc<dyn Responder>) -> Self {
        self.responder = responder;
        self
    }

    /// The `Retry-After` of a 503 sent because the store failed (1 s by default). It is sent
    /// in whole seconds, rounded up, and at least 1 s: `Retry-After: 0` would ask every
    /// refused client to come back at once, while the store is down.
    pub fn unavailable_retry_after(mut self, after: Duration) -> Self {
        self.unavailable_retry_after = after.max(Duration::from_secs(1));
        self
    }

    /// Whether the [`Decision`](crate::Decision) of an admitted request is put into its
    /// extensions, for the handler to read (no by default: it costs an allocation and a
    /// hash-map insertion per request, a fifth of what the layer costs around an axum router).
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use http::{Request, Response};
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tollgate::{Decision, MemoryStore, Policy, Rate, RateLimitLayer};
    /// use tollgate::limiter::Rule;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limits = RateLimitLayer::builder(MemoryStore::new())
    ///     .rule(Rule::new("all").policy(Policy::gcra(Rate::per_second(10), 20)?))
    ///     .decision_extension(true) // in axum: a handler may take `Extension<Decision>`
    ///     .build()?;
    /// let service = ServiceBuilder::new().layer(limits).service_fn(|request: Request<()>| async move {
    ///     let d = request.extensions().get::<Decision>().copied();
    ///     let text = d.map(|d| format!("{} of {} left", d.remaining(), d.limit()));
    ///     Ok::<_, Infallible>(Response::new(text.unwrap_or_default()))
    /// });
    /// let response = service.oneshot(Request::new(())).await?;
    /// assert_eq!(response.body(), "19 of 20 left");
    /// # Ok(())
    /// # }
    /// ```
    pub fn decision_extension(mut self, insert: bool) -> Self {
        self.decision_extension = insert;
        self
    }

    /// How the DEBUG `tollgate.decision` span shows the keys a request was counted against
    /// (feature `tracing`): not at all ([`KeyTrace::None`], the default), as a short stable
    /// hash ([`KeyTrace::Hashed`]) or as they are ([`KeyTrace::Plain`]). Keys never appear
    /// above DEBUG; see [`telemetry`](crate::telemetry).
    pub fn trace_keys(mut self, trace: KeyTrace) -> Self {
        self.key_trace = trace;
        self
    }

    /// Validates the rules and builds the layer, and registers its metrics (feature
    /// `metrics`: install the recorder first).
    pub fn build(self) -> Result<RateLimitLayer<St>, LimiterError> {
        Ok(RateLimitLayer {
            source: Source::Fixed(Arc::new(self.build_shared()?)),
        })
    }

    /// What the layer's services share, unwrapped.
    pub(crate) fn build_shared(self) -> Result<Shared<St>, LimiterError> {
        let mut limiter = self.limiter.build()?;
        limiter.key_trace = self.key_trace;
        Ok(Shared {
            all_policies: all_policies(&limiter),
            limiter,
            profile: self.profile,
            reset: self.reset,
            responder: self.responder,
            unavailable_retry_after: self.unavailable_retry_after,
            decision_extension: self.decision_extension,
        })
    }
}

impl<St> fmt::Debug for RateLimitLayerBuilder<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("limiter", &self.limiter)
            .field("profile", &self.profile)
            .field("key_trace", &self.key_trace)
            .finish_non_exhaustive()
    }
}

/// The `RateLimit-Policy` value of all rules with their first policy sets, when there are
/// several (one rule's value is cached with its set already).
fn all_policies<St>(limiter: &Limiter<St>) -> Option<HeaderValue> {
    if limiter.rules.len() < 2 {
        return None;
    }
    let mut joined = String::new();
    for rule in limiter.rules.iter() {
        if !joined.is_empty() {
            joined.push_str(", ");
        }
        joined.push_str(&rule.sets.first()?.field);
    }
    crate::limiter::field_value(&joined)
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http::{Request, Response};
    use tower::{ServiceBuilder, ServiceExt};

    use super::*;
    use crate::key::Global;
    use crate::{MemoryStore, Policy, Rate};

    /// A 503's `Retry-After` is never 0: that would send every refused client back at once.
    #[test]
    fn unavailable_retry_after_is_at_least_a_second() {
        let builder = || RateLimitLayer::builder(MemoryStore::new());
        for (set, sent) in [(0, 1000), (1, 1000), (1500, 1500), (5000, 5000)] {
            let b = builder().unavailable_retry_after(Duration::from_millis(set));
            assert_eq!(b.unavailable_retry_after, Duration::from_millis(sent));
        }
    }

    /// The decision goes into the request's extensions only when asked for.
    #[tokio::test]
    async fn the_decision_extension_is_opt_in() {
        let policy = Policy::gcra(Rate::per_second(5), 5).unwrap();
        for insert in [None, Some(false), Some(true)] {
            let mut builder = RateLimitLayer::builder(MemoryStore::new())
                .rule(Rule::new("all").policy(policy.clone()));
            if let Some(insert) = insert {
                builder = builder.decision_extension(insert);
            }
            let service = ServiceBuilder::new()
                .layer(builder.build().unwrap())
                .service_fn(|request: Request<String>| async move {
                    let d = request.extensions().get::<crate::Decision>().copied();
                    let text = d.map(|d| d.remaining().to_string());
                    Ok::<_, Infallible>(Response::new(text.unwrap_or_default()))
                });
            let response = service.oneshot(Request::new(String::new())).await.unwrap();
            let expected = if insert == Some(true) { "4" } else { "" };
            assert_eq!(response.body(), expected, "{insert:?}");
        }
    }

    /// The joined `RateLimit-Policy` of all rules is used only when every rule applied.
    #[tokio::test]
    async fn policy_field_of_the_rules_that_applied() {
        let policy = |n| Policy::gcra(Rate::per_second(n), n).unwrap();
        let layer = RateLimitLayer::builder(MemoryStore::new())
            .rule(Rule::new("all").key(Global).policy(policy(5)))
            .rule(
                Rule::new("api")
                    .path_prefix("/api")
                    .key(Global)
                    .policy(policy(4)),
            )
            .build()
            .unwrap();
        let service = ServiceBuilder::new()
            .layer(layer)
            .service_fn(|_: Request<String>| async {
                Ok::<_, Infallible>(Response::new(String::new()))
            });
        let field = |path: &'static str| {
            let service = service.clone();
            async move {
                let request = Request::get(path).body(String::new()).unwrap();
                let response = service.oneshot(request).await.unwrap();
                response.headers()["ratelimit-policy"].clone()
            }
        };
        assert_eq!(field("/api/x").await, r#""all";q=5;w=1, "api";q=4;w=1"#);
        assert_eq!(field("/other").await, r#""all";q=5;w=1"#);
    }
}
