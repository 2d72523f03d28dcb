//! The trait, the key type, and the extractors that need no address parsing.

use std::fmt;
use std::marker::PhantomData;

use arrayvec::ArrayString;
use http::HeaderName;
use http::request::Parts;

/// A request's key: a short UTF-8 string, stored inline up to 64 bytes (no allocation for an
/// address, a user id or a typical API key).
///
/// A key's text is an encoding in which two different inputs never meet, so that no key a
/// client supplies can spell one that tollgate makes: `%` is written `%25`, bytes that are not
/// UTF-8 as `%` and two hex digits each, as in percent-encoding. Every other `%` sequence is
/// tollgate's own: `%2F` for a `/` in the first part of an [`And`], `%|0|` and `%|1|` for the
/// branches of an [`Or`], and `%#` for a long key replaced by its hash.
///
/// ```
/// use tollgate::key::Key;
///
/// let mut key = Key::from("tenant-7");
/// key.push_str(":user-42");
/// assert_eq!(key.as_str(), "tenant-7:user-42");
/// assert_eq!(Key::from_bytes(b"caf\xe9").as_str(), "caf%e9"); // not UTF-8: percent-encoded
/// assert_eq!(Key::from("caf%e9").as_str(), "caf%25e9"); // so text cannot spell it
/// assert_ne!(Key::from_bytes(b"\xff"), Key::from("%ff"));
/// ```
#[derive(Clone)]
pub struct Key {
    repr: Repr,
}

#[derive(Clone)]
enum Repr {
    Inline(ArrayString<INLINE>),
    Heap(String),
}

/// Bytes of a key kept inline.
const INLINE: usize = 64;

impl Key {
    /// An empty key.
    pub const fn new() -> Self {
        Self {
            repr: Repr::Inline(ArrayString::new_const()),
        }
    }

    /// The key for arbitrary bytes: UTF-8 text as [`Key::push_str`] writes it, and each byte
    /// that is not part of UTF-8 text as `%` and two hex digits.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut key = Key::new();
        key.push_bytes(bytes);
        key
    }

    /// Appends text, with each `%` written `%25`.
    #[inline]
    pub fn push_str(&mut self, s: &str) {
        if !s.as_bytes().contains(&b'%') {
            return self.push_raw(s);
        }
        for (i, piece) in s.split('%').enumerate() {
            if i > 0 {
                self.push_raw("%25");
            }
            self.push_raw(piece);
        }
    }

    /// Appends text that is already in the key's encoding (or holds no `%`), as it is.
    #[inline(always)]
    pub(crate) fn push_raw(&mut self, s: &str) {
        match &mut self.repr {
            Repr::Inline(inline) => {
                if inline.try_push_str(s).is_err() {
                    let mut heap = String::with_capacity(inline.len() + s.len());
                    heap.push_str(inline);
                    heap.push_str(s);
                    self.repr = Repr::Heap(heap);
                }
            }
            Repr::Heap(heap) => heap.push_str(s),
        }
    }

    /// Appends bytes: UTF-8 text as [`Key::push_str`] writes it, and each byte that is not
    /// part of UTF-8 text as `%` and two hex digits.
    pub fn push_bytes(&mut self, bytes: &[u8]) {
        for chunk in bytes.utf8_chunks() {
            self.push_str(chunk.valid());
            for &b in chunk.invalid() {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                let escaped = [b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]];
                self.push_raw(std::str::from_utf8(&escaped).unwrap_or_default());
            }
        }
    }

    /// Appends the decimal digits of `n`, without the formatting machinery.
    #[inline]
    pub(crate) fn push_u64(&mut self, n: u64) {
        self.push_raw(itoa::Buffer::new().format(n));
    }

    /// The key as a string.
    #[inline]
    pub fn as_str(&self) -> &str {
        match &self.repr {
            Repr::Inline(inline) => inline,
            Repr::Heap(heap) => heap,
        }
    }

    /// The length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.as_str().len()
    }

    /// Whether the key is empty.
    pub fn is_empty(&self) -> bool {
        self.as_str().is_empty()
    }

    /// Shortens the key back to `len` bytes, a length it had before (the composing
    /// extractors undo a part that found no key). Crate-only: a cut elsewhere could leave half
    /// an escape, which text could then complete into another key.
    pub(crate) fn truncate(&mut self, len: usize) {
        let mut len = len.min(self.len());
        while len > 0 && !self.as_str().is_char_boundary(len) {
            len -= 1;
        }
        match &mut self.repr {
            Repr::Inline(inline) => inline.truncate(len),
            Repr::Heap(heap) => heap.truncate(len),
        }
    }
}

impl Default for Key {
    fn default() -> Self {
        Key::new()
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Key {}

impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl fmt::Write for Key {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.push_str(s);
        Ok(())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for Key {
    fn from(s: &str) -> Self {
        let mut key = Key::new();
        key.push_str(s);
        key
    }
}

impl From<String> for Key {
    fn from(s: String) -> Self {
        Key::from(s.as_str())
    }
}

impl From<&String> for Key {
    fn from(s: &String) -> Self {
        Key::from(s.as_str())
    }
}

impl From<u64> for Key {
    fn from(n: u64) -> Self {
        let mut key = Key::new();
        key.push_u64(n);
        key
    }
}

/// Finds the key a request is counted against.
///
/// It sees the request's head (method, URI, headers, extensions), never its body. Returning
/// `None` means the request has no key for this rule; the rule then does what its
/// [`MissingKey`](crate::limiter::MissingKey) says.
///
/// Any `Fn(&Parts) -> Option<K>` with `K: Into<Key>` (a `String`, a `&'static str`, a `u64`, a
/// [`Key`]) is an extractor:
///
/// ```
/// use http::request::Parts;
/// use tollgate::key::KeyExtractor;
///
/// let by_tenant = |parts: &Parts| {
///     let host = parts.headers.get("host")?.to_str().ok()?;
///     Some(host.split('.').next()?.to_owned())
/// };
/// let (parts, _) = http::Request::get("/").header("host", "acme.example.com").body(()).unwrap().into_parts();
/// assert_eq!(by_tenant.extract(&parts).unwrap().as_str(), "acme");
/// ```
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key of this request, if it has one.
    fn extract(&self, parts: &Parts) -> Option<Key>;

    /// Appends this request's key to `out` and returns `true`, or returns `false` and leaves
    /// `out` as it was. The limiter calls this one, with the rule's name already in `out`; the
    /// default calls [`KeyExtractor::extract`], the built-in extractors write in place.
    fn extract_into(&self, parts: &Parts, out: &mut Key) -> bool {
        match self.extract(parts) {
            Some(key) => {
                out.push_raw(key.as_str());
                true
            }
            None => false,
        }
    }

    /// This extractor, or `other` when this one finds no key. The two never share a key:
    /// `other`'s keys start with `%|1|` (and this one's, in the rare case that they start with
    /// `%|`, with `%|0|`), so that a client cannot aim at the bucket of the other branch by
    /// writing its key (an API key `192.0.2.1` is not the address `192.0.2.1`).
    fn or<B: KeyExtractor>(self, other: B) -> Or<Self, B>
    where
        Self: Sized,
    {
        Or(self, other)
    }

    /// Both keys joined by `/` (say, a tenant and a user within it); no key unless both have
    /// one. Within the first key `%` is written `%25` and `/` `%2F`, so that (`a/b`, `c`) and
    /// (`a`, `b/c`) are two keys, nested too.
    fn and<B: KeyExtractor>(self, other: B) -> And<Self, B>
    where
        Self: Sized,
    {
        And(self, other)
    }
}

impl<F, K> KeyExtractor for F
where
    F: Fn(&Parts) -> Option<K> + Send + Sync + 'static,
    K: Into<Key>,
{
    fn extract(&self, parts: &Parts) -> Option<Key> {
        self(parts).map(Into::into)
    }
}

/// The first extractor's key, or the second's when the first finds none
/// ([`KeyExtractor::or`]).
#[derive(Clone, Debug)]
pub struct Or<A, B>(pub A, pub B);

impl<A: KeyExtractor, B: KeyExtractor> KeyExtractor for Or<A, B> {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        let mut key = Key::new();
        self.extract_into(parts, &mut key).then_some(key)
    }

    fn extract_into(&self, parts: &Parts, out: &mut Key) -> bool {
        let start = out.len();
        if self.0.extract_into(parts, out) {
            // Only keys that start as the second branch's do get a tag of their own.
            if out.as_str()[start..].starts_with(OR_MARK) {
                let first = out.as_str()[start..].to_owned();
                out.truncate(start);
                out.push_raw(OR_FIRST);
                out.push_raw(&first);
            }
            return true;
        }
        out.push_raw(OR_SECOND);
        if self.1.extract_into(parts, out) {
            return true;
        }
        out.truncate(start);
        false
    }
}

/// What the tags of [`Or`]'s branches start with; no key text does.
const OR_MARK: &str = "%|";
const OR_FIRST: &str = "%|0|";
const OR_SECOND: &str = "%|1|";

/// Both extractors' keys joined by `/` ([`KeyExtractor::and`]).
#[derive(Clone, Debug)]
pub struct And<A, B>(pub A, pub B);

impl<A: KeyExtractor, B: KeyExtractor> KeyExtractor for And<A, B> {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        let mut key = Key::new();
        self.extract_into(parts, &mut key).then_some(key)
    }

    fn extract_into(&self, parts: &Parts, out: &mut Key) -> bool {
        let start = out.len();
        if !self.0.extract_into(parts, out) {
            return false;
        }
        // The first part's `%` and `/` escaped: (`a/b`, `c`) and (`a`, `b/c`) are two keys,
        // and so are nested ones, whose own `%2F` must not read as an escaped `/`.
        if out.as_str()[start..].contains(['/', '%']) {
            let first = out.as_str()[start..]
                .replace('%', "%25")
                .replace('/', "%2F");
            out.truncate(start);
            out.push_raw(&first);
        }
        out.push_raw("/");
        if !self.1.extract_into(parts, out) {
            out.truncate(start);
            return false;
        }
        true
    }
}

/// One key for every request: a limit on the whole service (or on a route, with a rule that
/// matches it).
#[derive(Clone, Copy, Debug, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract(&self, _: &Parts) -> Option<Key> {
        Some(Key::new())
    }

    fn extract_into(&self, _: &Parts, _: &mut Key) -> bool {
        true
    }
}

/// The value of a request header, such as an API key. The first value counts when the header
/// is repeated; an absent or empty header is no key. Values that are not UTF-8 are keyed by
/// their hex digits.
///
/// Only key by a header the client cannot choose freely, or one your authentication checks
/// before this layer runs: an unchecked header lets a client mint a fresh key per request.
///
/// ```
/// use tollgate::key::{Header, KeyExtractor};
///
/// let api_key = Header::from_static("x-api-key");
/// let (parts, _) = http::Request::get("/").header("x-api-key", "k-123").body(()).unwrap().into_parts();
/// assert_eq!(api_key.extract(&parts).unwrap().as_str(), "k-123");
/// ```
#[derive(Clone, Debug)]
pub struct Header(pub HeaderName);

impl Header {
    /// The header named `name` (lowercase, checked at compile time where possible: this panics
    /// on an invalid name, like [`HeaderName::from_static`]).
    pub const fn from_static(name: &'static str) -> Self {
        Header(HeaderName::from_static(name))
    }
}

impl KeyExtractor for Header {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        let mut key = Key::new();
        self.extract_into(parts, &mut key).then_some(key)
    }

    fn extract_into(&self, parts: &Parts, out: &mut Key) -> bool {
        match parts.headers.get(&self.0) {
            Some(value) if !value.is_empty() => {
                out.push_bytes(value.as_bytes());
                true
            }
            _ => false,
        }
    }
}

/// A value of type `T` that an earlier layer (authentication, say) put into the request
/// extensions, keyed by its `Display` form. No such extension is no key.
///
/// ```
/// use std::fmt;
/// use tollgate::key::{Extension, KeyExtractor};
///
/// #[derive(Clone)]
/// struct UserId(u64);
/// impl fmt::Display for UserId {
///     fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { write!(f, "user-{}", self.0) }
/// }
///
/// let mut request = http::Request::get("/").body(()).unwrap();
/// request.extensions_mut().insert(UserId(42)); // what the auth layer does
/// let (parts, _) = request.into_parts();
/// assert_eq!(Extension::<UserId>::new().extract(&parts).unwrap().as_str(), "user-42");
/// ```
pub struct Extension<T> {
    _type: PhantomData<fn() -> T>,
}

impl<T> Extension<T> {
    /// The extension of type `T`.
    pub const fn new() -> Self {
        Self { _type: PhantomData }
    }
}

impl<T> Default for Extension<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for Extension<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Extension<T> {}

impl<T> fmt::Debug for Extension<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Extension")
            .field(&std::any::type_name::<T>())
            .finish()
    }
}

impl<T> KeyExtractor for Extension<T>
where
    T: fmt::Display + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Option<Key> {
        let mut key = Key::new();
        self.extract_into(parts, &mut key).then_some(key)
    }

    fn extract_into(&self, parts: &Parts, out: &mut Key) -> bool {
        match parts.extensions.get::<T>() {
            Some(value) => fmt::Write::write_fmt(out, format_args!("{value}")).is_ok(),
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(request: http::request::Builder) -> Parts {
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn keys_hold_utf8_and_hex_otherwise() {
        let mut key = Key::from("é");
        key.push_bytes(&[0xc3]);
        assert_eq!(key.as_str(), "é%c3");
        key.truncate(1); // inside "é": back to the boundary
        assert_eq!(key.as_str(), "");
        assert_eq!(Key::from(42u64).as_str(), "42");
        assert_eq!(Key::from(0u64).as_str(), "0");
        assert_eq!(Key::from(u64::MAX).as_str(), u64::MAX.to_string());
        let long = Key::from("x".repeat(200));
        assert_eq!(long.len(), 200);
    }

    /// No two different inputs meet: text cannot spell bytes that are not UTF-8, nor the
    /// tags of `Or` and `And`.
    #[test]
    fn keys_from_different_inputs_never_meet() {
        assert_ne!(Key::from_bytes(b"\xff"), Key::from("0xff"));
        assert_ne!(Key::from_bytes(b"\xff"), Key::from("%ff"));
        assert_eq!(Key::from_bytes(b"a\xff%b").as_str(), "a%ff%25b");
        assert_eq!(Key::from("100%").as_str(), "100%25");
        let mut written = Key::new();
        let _ = fmt::Write::write_str(&mut written, "%|1|x");
        assert_eq!(written.as_str(), "%25|1|x");
        // Every byte string, one byte at a time, and text: all distinct.
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            assert!(seen.insert(Key::from_bytes(&[b])), "{b}");
            assert!(seen.insert(Key::from_bytes(&[b'%', b])), "% {b}");
        }
    }

    /// `Or` keeps its branches apart, nested too; `And` keeps its parts apart.
    #[test]
    fn composed_keys_never_meet() {
        let h = |name: &'static str| Header::from_static(name);
        let of = |e: &dyn KeyExtractor, headers: &[(&str, &str)]| {
            let mut r = http::Request::get("/");
            for (k, v) in headers {
                r = r.header(*k, *v);
            }
            e.extract(&parts(r)).map(|k| k.to_string())
        };
        // A client writing someone else's fallback key gets a key of its own.
        let or = h("x-api-key").or(h("x-ip"));
        let own = of(&or, &[("x-api-key", "192.0.2.1")]).unwrap();
        let fallback = of(&or, &[("x-ip", "192.0.2.1")]).unwrap();
        assert_eq!(own, "192.0.2.1");
        assert_eq!(fallback, "%|1|192.0.2.1");
        assert_ne!(own, fallback);
        // ... also when it writes the fallback's tag (the `%` is escaped).
        assert_ne!(
            of(&or, &[("x-api-key", "%|1|192.0.2.1")]).unwrap(),
            fallback
        );
        // Nested: every branch of Or(Or(a, b), c) has its own keys.
        let nested = h("x-a").or(h("x-b")).or(h("x-c"));
        let keys = ["x-a", "x-b", "x-c"].map(|name| of(&nested, &[(name, "v")]).unwrap());
        assert_eq!(keys, ["v", "%|0|%|1|v", "%|1|v"]);
        assert_eq!(of(&nested, &[]), None);
        // And: (a/b, c) and (a, b/c) are two keys.
        let and = h("x-a").and(h("x-b"));
        let ab_c = of(&and, &[("x-a", "a/b"), ("x-b", "c")]).unwrap();
        let a_bc = of(&and, &[("x-a", "a"), ("x-b", "b/c")]).unwrap();
        assert_eq!(ab_c, "a%2Fb/c");
        assert_eq!(a_bc, "a/b/c");
        // Nested: ((x/y, z), w) and ((x, y/z), w) stay apart.
        let nested = h("x-a").and(h("x-b")).and(h("x-c"));
        let one = of(&nested, &[("x-a", "x/y"), ("x-b", "z"), ("x-c", "w")]).unwrap();
        let two = of(&nested, &[("x-a", "x"), ("x-b", "y/z"), ("x-c", "w")]).unwrap();
        assert_ne!(one, two);
        assert_eq!(one, "x%252Fy%2Fz/w");
        assert_eq!(two, "x%2Fy%2Fz/w");
        // A part that finds no key leaves nothing behind.
        let mut out = Key::from("rule");
        let p = parts(http::Request::get("/").header("x-a", "a/b"));
        assert!(!and.extract_into(&p, &mut out));
        assert!(!h("x-none").or(h("x-none2")).extract_into(&p, &mut out));
        assert_eq!(out.as_str(), "rule");
    }

    #[test]
    fn headers_and_composition() {
        let p = parts(
            http::Request::get("/")
                .header("x-tenant", "t7")
                .header("x-user", "u1")
                .header("x-empty", ""),
        );
        let tenant = Header::from_static("x-tenant");
        let user = Header::from_static("x-user");
        assert_eq!(
            tenant
                .clone()
                .and(user.clone())
                .extract(&p)
                .unwrap()
                .as_str(),
            "t7/u1"
        );
        assert!(Header::from_static("x-empty").extract(&p).is_none());
        assert!(
            Header::from_static("x-none")
                .and(user.clone())
                .extract(&p)
                .is_none()
        );
        let fallback = Header::from_static("x-none").or(Global);
        assert_eq!(fallback.extract(&p).unwrap().as_str(), "%|1|");
        let closure = |_: &Parts| Some("fixed");
        assert_eq!(closure.extract(&p).unwrap().as_str(), "fixed");
        let boxed: Box<dyn KeyExtractor> = Box::new(user);
        assert_eq!(boxed.as_ref().extract(&p).unwrap().as_str(), "u1");
    }
}
