//! Tiers: policies chosen by who the key belongs to (free, pro, enterprise).

use std::fmt;
use std::future::Future;
use std::hash::BuildHasher;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hashbrown::HashTable;
use parking_lot::Mutex;

use crate::Policy;
use crate::clock::{Clock, SystemClock};
use crate::store::BoxError;
use crate::telemetry::Counter;

/// The default time a resolved tier is remembered.
pub const DEFAULT_TIER_TTL: Duration = Duration::from_secs(60);
/// The default number of keys whose tier is remembered.
pub const DEFAULT_TIER_CACHE_CAPACITY: usize = 100_000;
/// The default longest wait for a resolver's answer (see [`Tiers::timeout`]).
pub const DEFAULT_TIER_TIMEOUT: Duration = Duration::from_secs(1);

/// Finds the tier of a key (its plan: `"free"`, `"pro"`), typically by asking a database.
///
/// The answer is remembered for the time the [`Tiers`] say, so the resolver is asked about a
/// key at most once per that time. It is asked about a key once at a time (single flight):
/// requests for a key being looked up wait for that lookup and share its answer, so a burst of
/// a new key's first requests makes one call, not one per request. `None`, or a name the
/// `Tiers` do not know, means the default tier; that answer is remembered too.
///
/// A resolver that cannot answer is never waited on forever and never takes the request down
/// with it: when it fails (its future's output is an `Err`), panics (in `resolve` or in its
/// future), or has not answered within the [`Tiers::timeout`] (1 s by default), the request is
/// counted in the default tier, and so are the requests that waited for that lookup; nothing
/// is remembered, so the key's next request asks again. A panic is caught only where panics
/// unwind (not under `panic = "abort"`).
///
/// Any `Fn(String) -> impl Future<Output = A>` is a resolver, where `A` is an
/// `Option<String>` or a `Result<Option<String>, E>` (see [`TierAnswer`]); it gets the key the
/// rule's extractor found, as its [`Key`](crate::key::Key) text reads: a `%` in it is `%25`,
/// and with [`or`](crate::key::KeyExtractor::or) the fallback branch's keys start with `%|1|`
/// (so an API key is never mistaken for the address a request without one is keyed by). The
/// key is the extractor's whole key, however long: a resolver that looks keys up should bound
/// what it accepts.
///
/// ```
/// use tollgate::limiter::TierResolver;
///
/// let resolver = |api_key: String| async move {
///     // SELECT plan FROM api_keys WHERE key = $1
///     (api_key.starts_with("pro-")).then(|| "pro".to_owned())
/// };
/// # let answer = tokio::runtime::Builder::new_current_thread().build().unwrap()
/// #     .block_on(resolver.resolve("pro-123"));
/// assert_eq!(answer.as_deref(), Some("pro"));
/// ```
pub trait TierResolver: Send + Sync + 'static {
    /// The future of an answer.
    type Future: Future<Output: TierAnswer> + Send + 'static;

    /// The tier of `key`: `None` for the default tier, an error when the lookup failed.
    fn resolve(&self, key: &str) -> Self::Future;
}

impl<F, Fut> TierResolver for F
where
    F: Fn(String) -> Fut + Send + Sync + 'static,
    Fut: Future<Output: TierAnswer> + Send + 'static,
{
    type Future = Fut;

    fn resolve(&self, key: &str) -> Fut {
        self(key.to_owned())
    }
}

/// What a [`TierResolver`] answers: a tier's name, `None` for the default tier, or (for a
/// `Result`) the error of a lookup that failed, which counts the request in the default tier
/// without remembering anything.
///
/// ```
/// use tollgate::limiter::TierAnswer;
///
/// assert_eq!(Some("pro".to_owned()).into_tier().unwrap().as_deref(), Some("pro"));
/// let failed: Result<Option<String>, std::io::Error> = Err(std::io::ErrorKind::TimedOut.into());
/// assert!(failed.into_tier().is_err());
/// ```
pub trait TierAnswer: Send + 'static {
    /// The tier named (`None`: the default tier), or why there is no answer.
    fn into_tier(self) -> Result<Option<String>, BoxError>;
}

impl TierAnswer for Option<String> {
    fn into_tier(self) -> Result<Option<String>, BoxError> {
        Ok(self)
    }
}

impl<E: Into<BoxError> + Send + 'static> TierAnswer for Result<Option<String>, E> {
    fn into_tier(self) -> Result<Option<String>, BoxError> {
        self.map_err(Into::into)
    }
}

/// A resolver's answer, boxed (only on a cache miss).
pub(crate) type Resolving = Pin<Box<dyn Future<Output = Result<Option<String>, BoxError>> + Send>>;

/// The boxed answer of any resolver.
pub(crate) fn boxed<R: TierResolver + ?Sized>(resolver: &R, key: &str) -> Resolving {
    let answer = resolver.resolve(key);
    Box::pin(async move { answer.await.into_tier() })
}

trait ErasedResolver: Send + Sync {
    fn resolve(&self, key: &str) -> Resolving;
}

impl<R: TierResolver> ErasedResolver for R {
    fn resolve(&self, key: &str) -> Resolving {
        boxed(self, key)
    }
}

/// How a resolution ended.
#[derive(Debug)]
pub(crate) enum Resolution {
    /// The resolver named a tier (or `None`, the default one).
    Answered(Option<String>),
    /// The resolver's answer was an error.
    Failed(BoxError),
    /// The resolver panicked.
    Panicked,
    /// No answer within the timeout.
    TimedOut,
}

impl Resolution {
    /// Why the request fell back to the default tier (for telemetry), if it did.
    pub(crate) fn fallback(&self) -> Option<&'static str> {
        match self {
            Resolution::Answered(_) => None,
            Resolution::Failed(_) => Some("error"),
            Resolution::Panicked => Some("panic"),
            Resolution::TimedOut => Some("timeout"),
        }
    }
}

/// A resolution in progress: the resolver's answer, bounded by a timeout, panics caught.
pub(crate) type Guarded = Pin<Box<dyn Future<Output = Resolution> + Send>>;

/// A key's tier to come ([`TierLookup::tier_of_owned`]).
pub(crate) type TierOf = Pin<Box<dyn Future<Output = u16> + Send>>;

/// Polls a resolver's answer with its panics caught.
struct CatchPanic(Resolving);

impl Future for CatchPanic {
    type Output = Resolution;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Resolution> {
        let answer = &mut self.0;
        match catch_unwind(AssertUnwindSafe(|| answer.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(Ok(tier))) => Poll::Ready(Resolution::Answered(tier)),
            Ok(Poll::Ready(Err(e))) => Poll::Ready(Resolution::Failed(e)),
            Err(_) => Poll::Ready(Resolution::Panicked),
        }
    }
}

/// The tiers of a [`Rule`](super::Rule): a resolver, each tier's policies, the default tier,
/// and how long answers are remembered.
///
/// A request whose key's tier is remembered is decided at once, as a rule without tiers. One
/// whose key's tier is not asks the resolver, or, while another request's lookup of the same
/// key is under way, waits for that lookup and takes its tier (one lookup per key at a time,
/// in the rate limit and the concurrency layers alike). Every request waits at most the
/// [timeout](Tiers::timeout) from its own start, whatever becomes of the lookup it waits
/// for: past it, it is counted in the default tier (a request that started the lookup and is
/// no longer polled, or requests that keep starting it and going away, hold no one longer).
/// Should the request doing the lookup go away first (its client gave up), a waiting one asks
/// in its place, within what is left of its own time.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Policy, Rate};
/// use tollgate::key::Header;
/// use tollgate::limiter::{Rule, Tiers};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let tiers = Tiers::new(|key: String| async move { (key == "k-1").then(|| "pro".to_owned()) })
///     .tier("free", [Policy::gcra(Rate::per_minute(60), 10)?.named("free")?])
///     .tier("pro", [
///         Policy::gcra(Rate::per_minute(600), 100)?.named("pro")?,
///         Policy::fixed_window(50_000, Duration::from_secs(86_400))?.named("pro-daily")?,
///     ])
///     .default_tier("free")
///     .cache_for(Duration::from_secs(300));
/// let rule = Rule::new("plan").key(Header::from_static("x-api-key")).tiers(tiers);
/// # let _ = rule;
/// # Ok(())
/// # }
/// ```
pub struct Tiers {
    resolver: Arc<dyn ErasedResolver>,
    pub(crate) tiers: Vec<(String, Vec<Policy>)>,
    pub(crate) default: Option<String>,
    ttl: Duration,
    capacity: usize,
    timeout: Duration,
    clock: Arc<dyn Clock>,
}

impl Tiers {
    /// Tiers found by `resolver`; add the tiers with [`Tiers::tier`].
    pub fn new(resolver: impl TierResolver) -> Self {
        Self {
            resolver: Arc::new(resolver),
            tiers: Vec::new(),
            default: None,
            ttl: DEFAULT_TIER_TTL,
            capacity: DEFAULT_TIER_CACHE_CAPACITY,
            timeout: DEFAULT_TIER_TIMEOUT,
            clock: Arc::new(SystemClock::new()),
        }
    }

    /// A tier and its policies (all of which must admit a request).
    pub fn tier(
        mut self,
        name: impl Into<String>,
        policies: impl IntoIterator<Item = Policy>,
    ) -> Self {
        self.tiers
            .push((name.into(), policies.into_iter().collect()));
        self
    }

    /// The tier of keys the resolver does not place (the first tier unless set).
    pub fn default_tier(mut self, name: impl Into<String>) -> Self {
        self.default = Some(name.into());
        self
    }

    /// How long an answer is remembered (60 s by default; zero asks on every request, yet
    /// requests that come while a lookup of their key is under way still share it).
    pub fn cache_for(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How many keys' answers are remembered at most (100 000 by default; at least 1). When
    /// full, the cache drops the answers past their time, and if fewer than an eighth of its
    /// capacity were, also the answers closest to their time, until an eighth is free: one scan
    /// of the cache per eighth of its capacity of new keys. An answer dropped early only means
    /// one more call to the resolver.
    pub fn cache_capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity.max(1);
        self
    }

    /// The longest a request waits for the resolver (1 s by default), from its own start,
    /// whether it asks or waits for another request's lookup of its key: past it, the request
    /// is counted in the default tier, and the key's next request asks again, as when the
    /// resolver fails. The wait runs on tokio's timer (tokio's paused time in tests), so a resolution
    /// must be polled inside a tokio runtime with its timer enabled (`#[tokio::main]` enables
    /// it; in a runtime built without `enable_time`, tokio panics at the first resolution);
    /// outside any tokio runtime there is no timeout. `Duration::MAX` waits as long as the
    /// resolver takes, with no timer at all.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The clock that times the cache (the system's monotonic clock by default; a
    /// [`ManualClock`](crate::clock::ManualClock) in tests).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The lookup of rule `rule`'s tiers (its name labels the cache's metrics).
    pub(crate) fn into_resolved(self, rule: &str, default: u16) -> TierLookup {
        let names = self.tiers.iter().map(|(n, _)| n.as_str().into()).collect();
        let cache_metric = |result| {
            Counter::new(
                crate::metrics::TIER_CACHE_TOTAL,
                &[("rule", rule), ("result", result)],
            )
        };
        TierLookup {
            #[cfg(feature = "tracing")]
            rule: rule.into(),
            hits: cache_metric("hit"),
            misses: cache_metric("miss"),
            resolver: self.resolver,
            names,
            default,
            timeout: self.timeout,
            ttl: u64::try_from(self.ttl.as_nanos()).unwrap_or(u64::MAX),
            cache: Arc::new(TierCache {
                table: Mutex::new(HashTable::new()),
                hasher: foldhash::fast::RandomState::default(),
                capacity: self.capacity,
                #[cfg(test)]
                scans: Default::default(),
            }),
            flights: Arc::default(),
            clock: self.clock,
            #[cfg(feature = "tracing")]
            warned: Default::default(),
        }
    }
}

impl fmt::Debug for Tiers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tiers")
            .field("tiers", &self.tiers)
            .field("default", &self.default)
            .field("ttl", &self.ttl)
            .field("capacity", &self.capacity)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The tiers of a built rule: the resolver, the names (index = tier), and the cache.
pub(crate) struct TierLookup {
    /// The rule's name, for the events that say it fell back to its default tier.
    #[cfg(feature = "tracing")]
    rule: Box<str>,
    resolver: Arc<dyn ErasedResolver>,
    names: Box<[Box<str>]>,
    default: u16,
    /// The longest wait for the resolver.
    timeout: Duration,
    ttl: u64,
    /// Shared with the lookup of the same rule after a reload that left the rule as it was.
    cache: Arc<TierCache>,
    /// The lookups under way, by key ([`TierLookup::tier_of`]): one per key at a time.
    flights: Arc<Mutex<std::collections::HashMap<Box<str>, Flight>>>,
    clock: Arc<dyn Clock>,
    /// Fallbacks: at most one WARN a second (on `clock`), the others at DEBUG.
    #[cfg(feature = "tracing")]
    warned: crate::telemetry::WarnEvery,

    /// `tollgate_tier_cache_total`, by result.
    hits: Counter,
    misses: Counter,
}

impl TierLookup {
    /// Takes over the answers `old` has cached (and the clock that times them): for a rule
    /// that a reload left exactly as it was, so that the reload asks the resolver nothing.
    pub(crate) fn adopt(&mut self, old: &TierLookup) {
        if self.names == old.names && self.ttl == old.ttl {
            self.cache = Arc::clone(&old.cache);
            self.clock = Arc::clone(&old.clock);
        }
    }

    /// The remembered tier of a key, if it is still fresh.
    #[inline]
    pub(crate) fn cached(&self, key: &str) -> Option<u16> {
        let tier = self.cache.get(key, self.clock.now());
        match tier {
            Some(_) => self.hits.increment(1),
            None => self.misses.increment(1),
        }
        tier
    }

    /// When a request that starts waiting for a tier now stops waiting: the timeout from now,
    /// on tokio's timer; `None` outside a tokio runtime (whose timer would panic) or with no
    /// bound at all (a runtime without its timer can still resolve tiers then).
    fn deadline(&self) -> Option<tokio::time::Instant> {
        if self.timeout == Duration::MAX || tokio::runtime::Handle::try_current().is_err() {
            return None;
        }
        tokio::time::Instant::now().checked_add(self.timeout)
    }

    /// Asks the resolver: its answer, or how it failed to give one by `deadline`.
    fn resolve_by(&self, key: &str, deadline: Option<tokio::time::Instant>) -> Guarded {
        let answer = match catch_unwind(AssertUnwindSafe(|| self.resolver.resolve(key))) {
            Ok(answer) => CatchPanic(answer),
            Err(_) => return Box::pin(std::future::ready(Resolution::Panicked)),
        };
        let Some(deadline) = deadline else {
            return Box::pin(answer);
        };
        Box::pin(async move {
            tokio::time::timeout_at(deadline, answer)
                .await
                .unwrap_or(Resolution::TimedOut)
        })
    }

    /// [`TierLookup::tier_of`] as a future that owns what it uses, for a response future
    /// (which is `'static`): the same lookup, in the same flights. Boxed, as the resolver's
    /// answer is: only on a cache miss.
    pub(crate) fn tier_of_owned(self: &Arc<Self>, key: Box<str>, raw: Box<str>) -> TierOf {
        let lookup = Arc::clone(self);
        Box::pin(async move { lookup.tier_of(&key, &raw).await })
    }

    /// Looks `key`'s tier up on a task of its own, unless a lookup of it is under way (for a
    /// shadow rule, which never holds a request up): its answer is remembered for the key's
    /// next requests. Needs a tokio runtime; outside one, nothing is looked up.
    pub(crate) fn look_up_in_background(self: &Arc<Self>, key: &str, raw: Box<str>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.flights.lock().contains_key(key) {
            return;
        }
        drop(runtime.spawn(self.tier_of_owned(key.into(), raw)));
    }

    /// The tier of `key` (the extractor's key `raw` is what the resolver is asked), with one
    /// lookup per key at a time (single flight): requests for a key being looked up wait for
    /// that lookup and get its tier (its fallback, the default tier, if it failed). Should the
    /// request that looks up go away first, the next one waiting looks up in its place. Every
    /// request waits at most the [timeout](Tiers::timeout) from its own start, whatever
    /// becomes of the lookup it waits for (a request that started it and is no longer polled
    /// holds no one past it): past it, the default tier, remembered for nobody.
    pub(crate) async fn tier_of(&self, key: &str, raw: &str) -> u16 {
        let deadline = self.deadline();
        loop {
            let flight = {
                let mut flights = self.flights.lock();
                match flights.get(key) {
                    Some(flight) => Err(flight.clone()),
                    // A lookup that landed since the caller missed the cache remembered its
                    // answer before it left `flights`: no need to ask again.
                    None => match self.cache.get(key, self.clock.now()) {
                        Some(tier) => return tier,
                        None => {
                            let (sender, receiver) = tokio::sync::watch::channel(None);
                            flights.insert(key.into(), receiver);
                            Ok(sender)
                        }
                    },
                }
            };
            match flight {
                Ok(sender) => {
                    // Ends the flight however the lookup ends (the request may go away).
                    let _landing = Landing {
                        flights: &self.flights,
                        key,
                    };
                    let resolution = self.resolve_by(raw, deadline).await;
                    let tier = self.settle(key, &resolution);
                    sender.send_replace(Some(tier));
                    return tier;
                }
                Err(mut follow) => loop {
                    if let Some(tier) = *follow.borrow_and_update() {
                        return tier;
                    }
                    let changed = match deadline {
                        None => follow.changed().await,
                        Some(deadline) => {
                            match tokio::time::timeout_at(deadline, follow.changed()).await {
                                Ok(changed) => changed,
                                // Its own time is up: the lookup goes on for the others.
                                Err(_) => return self.settle(key, &Resolution::TimedOut),
                            }
                        }
                    };
                    if changed.is_err() {
                        // The lookup went away unfinished, unless it finished as it went.
                        if let Some(tier) = *follow.borrow() {
                            return tier;
                        }
                        break;
                    }
                },
            }
        }
    }

    /// The tier of a finished resolution: an answer is remembered for `key`; a resolver that
    /// failed, panicked or timed out gives the default tier, remembered for nobody.
    pub(crate) fn settle(&self, key: &str, resolution: &Resolution) -> u16 {
        if let Some(reason) = resolution.fallback() {
            // The resolver's error is its own text, which may hold the key it was asked about
            // (personal data): the WARN says only which rule and why, the text is DEBUG only.
            // Not inside the caller's span either (the DEBUG decision span may carry the key).
            #[cfg(feature = "tracing")]
            if self.warned.now(self.clock.now()) {
                crate::telemetry::event!(
                    warn,
                    name: "tollgate.tier_fallback",
                    parent: None,
                    rule = &*self.rule,
                    reason,
                    "the tier resolver gave no answer: the request counts in the default tier \
                     (at most one such WARN a second; the others at DEBUG)"
                );
            } else {
                crate::telemetry::event!(
                    debug,
                    name: "tollgate.tier_fallback",
                    parent: None,
                    rule = &*self.rule,
                    reason,
                    "the tier resolver gave no answer: the request counts in the default tier"
                );
            }
            if let Resolution::Failed(error) = resolution {
                crate::telemetry::event!(
                    debug,
                    name: "tollgate.tier_fallback.error",
                    parent: None,
                    rule = &*self.rule,
                    error = %error,
                    "the tier resolver's error"
                );
                let _ = error;
            }
            let _ = reason;
            return self.default;
        }
        match resolution {
            Resolution::Answered(answer) => self.remember(key, answer.as_deref()),
            _ => self.default,
        }
    }

    /// Turns an answer into a tier and remembers it for `key`.
    pub(crate) fn remember(&self, key: &str, answer: Option<&str>) -> u16 {
        let tier = answer
            .and_then(|a| self.names.iter().position(|n| **n == *a))
            .and_then(|i| u16::try_from(i).ok())
            .unwrap_or(self.default);
        if self.ttl > 0 {
            let now = self.clock.now();
            self.cache
                .insert(key, tier, now.saturating_add(self.ttl), now);
        }
        tier
    }
}

/// A lookup under way: its tier once it has one.
type Flight = tokio::sync::watch::Receiver<Option<u16>>;

/// Removes a key's flight when its lookup ends (or is dropped).
struct Landing<'a> {
    flights: &'a Mutex<std::collections::HashMap<Box<str>, Flight>>,
    key: &'a str,
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        self.flights.lock().remove(self.key);
    }
}

struct TierCache {
    table: Mutex<HashTable<CacheEntry>>,
    hasher: foldhash::fast::RandomState,
    capacity: usize,
    /// How many times the cache was scanned to make room.
    #[cfg(test)]
    scans: std::sync::atomic::AtomicU64,
}

struct CacheEntry {
    key: Box<str>,
    tier: u16,
    expires: u64,
}

impl TierCache {
    fn get(&self, key: &str, now: u64) -> Option<u16> {
        let hash = self.hasher.hash_one(key);
        let table = self.table.lock();
        table
            .find(hash, |e| *e.key == *key)
            .filter(|e| e.expires > now)
            .map(|e| e.tier)
    }

    fn insert(&self, key: &str, tier: u16, expires: u64, now: u64) {
        let hash = self.hasher.hash_one(key);
        let mut table = self.table.lock();
        if let Some(e) = table.find_mut(hash, |e| *e.key == *key) {
            e.tier = tier;
            e.expires = expires;
            return;
        }
        if table.len() >= self.capacity {
            self.make_room(&mut table, now);
        }
        let hasher = &self.hasher;
        table.insert_unique(
            hash,
            CacheEntry {
                key: key.into(),
                tier,
                expires,
            },
            |e| hasher.hash_one(&*e.key),
        );
    }

    /// Frees an eighth of a full cache: the answers past their time, then as many as needed of
    /// those closest to it.
    fn make_room(&self, table: &mut HashTable<CacheEntry>, now: u64) {
        #[cfg(test)]
        self.scans
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        table.retain(|e| e.expires > now);
        let free = (self.capacity / 8).max(1);
        // At most `table.len()`, as `free <= capacity`.
        let n = (table.len() + free).saturating_sub(self.capacity);
        if n == 0 {
            return;
        }
        let mut expiries: Vec<u64> = table.iter().map(|e| e.expires).collect();
        let (before, &mut at, _) = expiries.select_nth_unstable(n - 1);
        let mut ties = n - before.iter().filter(|&&e| e < at).count();
        table.retain(|e| {
            if e.expires < at {
                false
            } else if e.expires == at && ties > 0 {
                ties -= 1;
                false
            } else {
                true
            }
        });
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.table.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    /// Single flight: a request that waits for another's lookup of its key looks up itself
    /// once that one goes away unfinished (its client gave up), and gets the answer.
    #[tokio::test(start_paused = true)]
    async fn a_lookup_whose_request_goes_away_is_taken_over() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let calls = Arc::new(AtomicUsize::new(0));
        let lookup = {
            let calls = calls.clone();
            Tiers::new(move |_: String| {
                calls.fetch_add(1, Ordering::SeqCst);
                async {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    Some("pro".to_owned())
                }
            })
            .tier("free", [])
            .tier("pro", [])
            .into_resolved("r", 0)
        };
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut first = Box::pin(lookup.tier_of("k", "k"));
        let mut second = Box::pin(lookup.tier_of("k", "k"));
        assert!(first.as_mut().poll(&mut cx).is_pending());
        assert!(second.as_mut().poll(&mut cx).is_pending());
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one lookup at a time");
        drop(first);
        assert_eq!(second.await, 1);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert!(lookup.flights.lock().is_empty());
    }

    /// A lookup whose request keeps its future without polling it holds no one: a request
    /// waiting for it gets the default tier at its own timeout (before the fix it waited for
    /// as long as the first future lived: still waiting after 600 s).
    #[tokio::test(start_paused = true)]
    async fn a_lookup_no_longer_polled_holds_no_waiter_past_the_timeout() {
        let lookup = Tiers::new(|_: String| async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Some("pro".to_owned())
        })
        .tier("free", [])
        .tier("pro", [])
        .into_resolved("r", 0);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut first = Box::pin(lookup.tier_of("k", "k"));
        assert!(first.as_mut().poll(&mut cx).is_pending());
        // Polled once, then kept and left.
        let start = tokio::time::Instant::now();
        let waiter = tokio::time::timeout(Duration::from_secs(600), lookup.tier_of("k", "k"));
        assert_eq!(waiter.await, Ok(0), "the default tier at its own timeout");
        assert_eq!(start.elapsed(), DEFAULT_TIER_TIMEOUT);
        // Remembered for nobody; the first lookup, polled again, still lands.
        assert_eq!(lookup.cached("k"), None);
        assert_eq!(first.await, 1);
        assert_eq!(lookup.cached("k"), Some(1));
    }

    #[test]
    fn answers_are_remembered_for_their_time_and_bounded() {
        let clock = ManualClock::new();
        let tiers = Tiers::new(|_k: String| async { None })
            .tier("free", [])
            .tier("pro", [])
            .cache_for(Duration::from_secs(10))
            .cache_capacity(8)
            .clock(clock.clone())
            .into_resolved("r", 0);
        assert_eq!(tiers.cached("a"), None);
        assert_eq!(tiers.remember("a", Some("pro")), 1);
        assert_eq!(tiers.remember("b", Some("gold")), 0); // unknown: default
        assert_eq!(tiers.remember("c", None), 0);
        assert_eq!(tiers.cached("a"), Some(1));
        clock.advance(Duration::from_secs(10));
        assert_eq!(tiers.cached("a"), None);
        for i in 0..100 {
            tiers.remember(&format!("k{i}"), Some("pro"));
            assert!(tiers.cache.len() <= 8);
        }
        assert_eq!(tiers.cached("k99"), Some(1));
    }

    fn cache_of(capacity: usize, ttl: Duration, clock: &ManualClock) -> TierLookup {
        Tiers::new(|_k: String| async { None })
            .tier("free", [])
            .cache_for(ttl)
            .cache_capacity(capacity)
            .clock(clock.clone())
            .into_resolved("r", 0)
    }

    #[test]
    fn a_full_cache_under_a_steady_flow_of_new_keys_is_scanned_once_per_eighth() {
        // Each answer lasts `capacity` ms and a new key comes every ms: once full, the cache
        // holds exactly one answer past its time at each new key.
        let capacity = 800;
        let clock = ManualClock::new();
        let tiers = cache_of(capacity, Duration::from_millis(capacity as u64), &clock);
        let n = 20 * capacity;
        for i in 0..capacity + n {
            tiers.remember(&format!("k{i}"), None);
            assert!(tiers.cache.len() <= capacity);
            clock.advance(Duration::from_millis(1));
        }
        let scans = tiers.cache.scans.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            scans <= (n / (capacity / 8) + 1) as u64,
            "{scans} scans for {n} keys"
        );
        // The newest answers are still there.
        let newest = capacity + n - 1;
        assert_eq!(tiers.cached(&format!("k{newest}")), Some(0));
    }

    #[test]
    fn a_full_cache_drops_answers_past_their_time_then_those_closest_to_it() {
        let clock = ManualClock::new();
        let tiers = cache_of(16, Duration::from_secs(20), &clock);
        for i in 0..16 {
            clock.set(Duration::from_secs(i));
            tiers.remember(&format!("k{i}"), None);
        }
        clock.set(Duration::from_secs(20));
        // k0 is past its time: it alone goes, and the next oldest, k1, to free an eighth.
        tiers.remember("new", None);
        assert_eq!(tiers.cache.len(), 15);
        assert_eq!(tiers.cached("k1"), None);
        assert!((2..16).all(|i| tiers.cached(&format!("k{i}")).is_some()));
        // Nothing past its time: the two closest to it go.
        tiers.remember("newer", None);
        assert_eq!(tiers.cache.len(), 16);
        tiers.remember("newest", None);
        assert_eq!(tiers.cache.len(), 15);
        assert_eq!(tiers.cached("k2"), None);
        assert_eq!(tiers.cached("k3"), None);
        assert!((4..16).all(|i| tiers.cached(&format!("k{i}")).is_some()));
        assert!(
            ["new", "newer", "newest"]
                .iter()
                .all(|k| tiers.cached(k).is_some())
        );
    }
}
