//! The rate-limit fields of a response: their values per decision, and the `RateLimit` values
//! each policy keeps.

use std::fmt;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};

use super::{
    HeaderProfile, RATELIMIT, RATELIMIT_POLICY, ResetFormat, X_RATELIMIT_LIMIT,
    X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
};
use crate::{Algorithm, Decision, Policy};

/// The field values of one response, computed when the decision is known.
#[derive(Debug, Default)]
pub(crate) struct FieldValues {
    policy: Option<HeaderValue>,
    status: Option<HeaderValue>,
    legacy: Option<Box<[HeaderValue; 3]>>,
}

impl FieldValues {
    /// The fields for `decision`, made by `policy`, whose `RateLimit` values `status` makes,
    /// with the `RateLimit-Policy` value of the policies that applied.
    #[inline]
    pub(crate) fn new(
        profile: HeaderProfile,
        reset: ResetFormat,
        decision: &Decision,
        policy: &Policy,
        status: &StatusField,
        policy_field: impl FnOnce() -> Option<HeaderValue>,
    ) -> Self {
        let mut values = FieldValues::default();
        if profile.ietf() {
            values.policy = policy_field();
            values.status = status.value(decision.remaining(), t_secs(decision, policy));
        }
        if profile.legacy() {
            values.legacy = Some(Box::new(legacy_values(reset, decision)));
        }
        values
    }

    /// Writes the fields into a response's headers.
    #[inline(always)]
    pub(crate) fn apply(self, headers: &mut HeaderMap) {
        if let Some(v) = self.policy {
            headers.insert(RATELIMIT_POLICY, v);
        }
        if let Some(v) = self.status {
            headers.insert(RATELIMIT, v);
        }
        if let Some(legacy) = self.legacy {
            let [limit, remaining, reset] = *legacy;
            headers.insert(X_RATELIMIT_LIMIT, limit);
            headers.insert(X_RATELIMIT_REMAINING, remaining);
            headers.insert(X_RATELIMIT_RESET, reset);
        }
    }
}

/// The wall clock in Unix seconds: only for the `X-RateLimit-Reset` variant that asks for it.
/// Limits themselves never read wall time.
#[allow(clippy::disallowed_methods)]
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The legacy trio: the limit, what remains, and the reset (seconds until full recovery, or
/// until the retry when refused; or that moment as a Unix time).
#[cold]
fn legacy_values(reset: ResetFormat, decision: &Decision) -> [HeaderValue; 3] {
    let secs = decision
        .retry_after_secs()
        .unwrap_or_else(|| decision.reset_after_secs());
    let reset = match reset {
        ResetFormat::DeltaSeconds => secs,
        ResetFormat::UnixSeconds => unix_now().saturating_add(secs),
    };
    [
        HeaderValue::from(decision.limit()),
        HeaderValue::from(decision.remaining()),
        HeaderValue::from(reset),
    ]
}

/// `RateLimit`'s `t` for `decision`, made by `policy`: the seconds until more quota is made
/// available (draft-ietf-httpapi-ratelimit-headers), rounded up; on a refusal, the seconds
/// until this request may be retried (the same number as `Retry-After`, never less).
///
/// - **Buckets** (token bucket, leaky bucket, GCRA): until the next unit refills, i.e.
///   [`Decision::reset_after`] modulo the interval (a whole interval when it divides
///   exactly; 0 when the bucket is full).
/// - **Fixed window**: until the window ends ([`Decision::reset_after`]).
/// - **Sliding log**: until the log has fully recovered ([`Decision::reset_after`], at most
///   the window): the oldest entry may leave sooner, so clients wait a little more than they
///   must, never less.
/// - **Sliding window counter**: until the current window ends (the counts of the current
///   window stop counting fully then), so never more than the window. With nothing left
///   (`r=0`), one nanosecond more: at the window's end the current window's count weighs
///   whole, as the previous one's, and an admission leaves it at most the limit, so a unit
///   is free one nanosecond later at the latest (and may be sooner, while the previous
///   window's count fades).
pub(crate) fn t_secs(decision: &Decision, policy: &Policy) -> u64 {
    if let Some(retry) = decision.retry_after_secs() {
        return retry;
    }
    let reset = saturating_nanos(decision.reset_after());
    let period = policy.period_nanos();
    let nanos = match policy.algorithm() {
        Algorithm::Gcra | Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            match reset.checked_rem(period) {
                _ if reset == 0 => 0,
                Some(0) | None => period,
                Some(part) => part,
            }
        }
        Algorithm::FixedWindow | Algorithm::SlidingLog => reset,
        Algorithm::SlidingWindow if reset > period => {
            (reset - period).saturating_add(u64::from(decision.remaining() == 0))
        }
        Algorithm::SlidingWindow => reset,
    };
    nanos.div_ceil(1_000_000_000)
}

fn saturating_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The `RateLimit` values of one policy: `"name";r=R;t=T`, made once per `(r, t)` and shared.
///
/// A policy sends few distinct pairs (`r` is at most its limit, `t` at most its window), so
/// each pair's value is made the first time it is sent and kept in one of at most
/// [`STATUS_SLOTS`] slots of this policy (indexed by the pair when all its pairs fit, else by
/// a hash of it, the first pair to come keeping a slot). A kept value is static (its text is
/// kept for the life of the process, once per distinct text, at most [`STATUS_TEXTS`] texts
/// and [`STATUS_TEXT_BYTES`] bytes of text in all), so that sending it writes no reference count: the cores serving
/// requests would otherwise all write one shared counter per response. A pair that finds its
/// slot taken by another, or comes after the texts' bound is reached, gets a value of its own,
/// as every response once did. The slots are allocated the first time the policy sends a
/// value, and freed with the layer.
pub(crate) struct StatusField {
    /// `"name";r=`.
    item: Box<str>,
    /// `t` of the last pair indexed directly; past it, or past `r` = `direct_r`, hashed.
    direct_t: u64,
    direct_r: u64,
    /// Whether every pair of the policy has a slot of its own.
    pub(super) direct: bool,
    slots: OnceLock<Box<[OnceLock<Made>]>>,
}

/// A `RateLimit` value made for one `(r, t)`.
struct Made {
    r: u64,
    t: u64,
    value: HeaderValue,
}

/// The most slots one policy keeps `RateLimit` values in.
pub(crate) const STATUS_SLOTS: usize = 1024;

/// The most `RateLimit` texts kept for the life of the process, over all policies.
pub(crate) const STATUS_TEXTS: usize = 6 * 1024;

/// The most bytes of `RateLimit` texts kept for the life of the process, over all policies.
pub(crate) const STATUS_TEXT_BYTES: usize = 1 << 20;

impl StatusField {
    /// The values of a policy called `name`.
    pub(crate) fn new(name: &str, policy: &Policy) -> Self {
        use crate::limiter::SF_INTEGER_MAX;
        let window = policy.window().as_nanos().div_ceil(1_000_000_000);
        let direct_t = u64::try_from(window)
            .unwrap_or(u64::MAX)
            .min(SF_INTEGER_MAX);
        let direct_r = policy.limit().min(SF_INTEGER_MAX);
        let pairs = (u128::from(direct_r) + 1) * (u128::from(direct_t) + 1);
        StatusField {
            item: format!("\"{name}\";r=").into(),
            direct_t,
            direct_r,
            direct: pairs <= STATUS_SLOTS as u128,
            slots: OnceLock::new(),
        }
    }

    /// The slot of `(r, t)`: none for a pair outside the policy's own (a refusal's `t`
    /// past the window) when every pair of the policy has a slot of its own.
    #[inline(always)]
    fn slot(&self, r: u64, t: u64) -> Option<usize> {
        if !self.direct {
            let mixed = (r ^ t.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            return Some((mixed >> (64 - STATUS_SLOTS.trailing_zeros())) as usize);
        }
        // Then (direct_r + 1) * (direct_t + 1) <= STATUS_SLOTS: no overflow.
        (r <= self.direct_r && t <= self.direct_t).then(|| (r * (self.direct_t + 1) + t) as usize)
    }

    /// `"name";r=R;t=T`.
    #[inline]
    pub(crate) fn value(&self, r: u64, t: u64) -> Option<HeaderValue> {
        use crate::limiter::SF_INTEGER_MAX;
        let (r, t) = (r.min(SF_INTEGER_MAX), t.min(SF_INTEGER_MAX));
        let slots = self.slots.get_or_init(|| {
            let n = if self.direct {
                ((self.direct_r + 1) * (self.direct_t + 1)) as usize
            } else {
                STATUS_SLOTS
            };
            (0..n).map(|_| OnceLock::new()).collect()
        });
        let Some(slot) = self.slot(r, t).and_then(|i| slots.get(i)) else {
            return self.make(r, t);
        };
        match slot.get() {
            Some(made) if made.r == r && made.t == t => Some(made.value.clone()),
            Some(_) => self.make(r, t),
            None => self.keep(slot, r, t),
        }
    }

    /// A value of its own, as every response once had.
    #[cold]
    fn make(&self, r: u64, t: u64) -> Option<HeaderValue> {
        HeaderValue::from_maybe_shared(Bytes::from(self.text(r, t))).ok()
    }

    /// Makes the value of `(r, t)`, static if the texts' bound allows, and keeps it in `slot`.
    #[cold]
    fn keep(&self, slot: &OnceLock<Made>, r: u64, t: u64) -> Option<HeaderValue> {
        let text = self.text(r, t);
        let Some(text) = keep_text(text) else {
            return self.make(r, t);
        };
        let made = slot.get_or_init(|| Made {
            r,
            t,
            value: HeaderValue::from_static(text),
        });
        if made.r == r && made.t == t {
            Some(made.value.clone())
        } else {
            self.make(r, t)
        }
    }

    fn text(&self, r: u64, t: u64) -> Vec<u8> {
        let mut r_digits = itoa::Buffer::new();
        let r = r_digits.format(r).as_bytes();
        let mut t_digits = itoa::Buffer::new();
        let t = t_digits.format(t).as_bytes();
        let mut text = Vec::with_capacity(self.item.len() + r.len() + 3 + t.len());
        text.extend_from_slice(self.item.as_bytes());
        text.extend_from_slice(r);
        text.extend_from_slice(b";t=");
        text.extend_from_slice(t);
        text
    }
}

impl fmt::Debug for StatusField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatusField")
            .field("item", &self.item)
            .finish_non_exhaustive()
    }
}

/// `text` kept for the life of the process (once per distinct text), if it is visible ASCII
/// (what `HeaderValue::from_static` takes) and the bounds on kept texts allow.
///
/// The set of kept texts is made at its full size the first time, so that keeping a text
/// never grows it: a request allocates as much whether its text was kept before or not (its
/// text is made either way, then kept or dropped).
fn keep_text(text: Vec<u8>) -> Option<&'static str> {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{LazyLock, Mutex};
    type Kept = (HashSet<&'static str>, usize);
    static KEPT: LazyLock<Mutex<Kept>> =
        LazyLock::new(|| Mutex::new((HashSet::with_capacity(STATUS_TEXTS), 0)));
    // Set once a bound is reached: no lock is taken after that.
    static FULL: AtomicBool = AtomicBool::new(false);
    if FULL.load(Ordering::Relaxed) || !text.iter().all(|b| (b' '..=b'~').contains(b)) {
        return None;
    }
    let text = String::from_utf8(text).ok()?;
    let mut kept = KEPT.lock().ok()?;
    let (set, bytes) = &mut *kept;
    if let Some(&text) = set.get(text.as_str()) {
        return Some(text);
    }
    if set.len() >= STATUS_TEXTS || *bytes + text.len() > STATUS_TEXT_BYTES {
        FULL.store(true, Ordering::Relaxed);
        return None;
    }
    *bytes += text.len();
    let text: &'static str = Box::leak(text.into_boxed_str());
    set.insert(text);
    Some(text)
}
