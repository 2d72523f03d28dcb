//! The path that path rules compare: the one the application acts on, whatever its spelling.
//!
//! A request's path reaches a handler decoded: axum percent-decodes route parameters and
//! wildcards (`/files/%65xports/a.csv` is `exports/a.csv` to a `/files/{*path}` handler), a
//! wildcard takes `//` and `..` as they come, and a file server resolves them. So a path rule
//! (`Rule::path`, `Rule::path_prefix`, and the concurrency and shape layers' rules) compares
//! the path after:
//!
//! 1. **percent-decoding** every `%XX` escape once, `%2F` included (it is a `/` to the handler
//!    of a wildcard); a `%` not followed by two hex digits stays as it is;
//! 2. **collapsing** runs of `/` into one;
//!
//! and matches when this reading matches, or the same reading with its **dot segments
//! resolved** (`.` and `..`, RFC 3986 5.2.4) does, where a `..` may stop at the root of the
//! handler, which may be mounted at any of the rule's own first segments (`/files/../exports`
//! is `exports` to a handler of `/files/{*path}` that keeps clients inside its root, so it is
//! counted by a rule on `/files/exports`). An ambiguous spelling is counted rather than let
//! through. A path that ends with a dot segment ends at the segment it names (`/a/b/..` is
//! `/a`). The rule's own path is read the same way (dot segments resolved), once, when it is
//! made. Letters keep their case and a trailing `/` stays (`/login/` is not `/login`), as
//! axum's router has it. A path with no `%`, no `//` and no dot segment is compared as it is,
//! with nothing decoded or allocated; resolving is only tried for a path with a dot segment,
//! at most once per segment of the rule.
//!
//! Behind axum's `Router::nest`, inner layers see the path without the nest's prefix; with
//! feature `axum`, the path compared is the request's full original path (axum's
//! `OriginalUri`, which the outermost router puts into the extensions) where there is one.

use std::cell::OnceCell;

use http::request::Parts;

/// The path of one request as path rules read it: found, and decoded if it must be, at
/// most once however many rules ask, and not at all when no rule asks (or when the path as
/// it is matches).
pub(crate) struct RequestPath<'a> {
    parts: Option<&'a Parts>,
    raw: OnceCell<&'a str>,
    reading: OnceCell<Reading>,
}

/// How a path that does not match as it is reads.
enum Reading {
    /// As it is: nothing to decode, so nothing more to match.
    Plain,
    /// Percent-decoded, runs of `/` collapsed; whether it has a `..` segment.
    Spelled { decoded: Vec<u8>, up: bool },
}

impl<'a> RequestPath<'a> {
    /// The path `parts` is for: axum's `OriginalUri` (feature `axum`) if a router put one in
    /// the extensions, else the request's own (found when a rule first asks).
    #[inline]
    pub(crate) fn of(parts: &'a Parts) -> Self {
        RequestPath {
            parts: Some(parts),
            raw: OnceCell::new(),
            reading: OnceCell::new(),
        }
    }

    /// A path given as it is.
    #[cfg(test)]
    pub(crate) fn new(raw: &'a str) -> Self {
        RequestPath {
            parts: None,
            raw: OnceCell::from(raw),
            reading: OnceCell::new(),
        }
    }

    /// The path as the request has it.
    #[inline]
    fn raw(&self) -> &'a str {
        self.raw.get_or_init(|| self.parts.map_or("", raw_path))
    }

    /// Whether `test` holds for the path as it is, or, failing that, for one of its readings,
    /// against the rule path `rule`: decoded, or resolved by a handler whose root is any of
    /// the rule's first segments (a `..` there stops at that root, as a file server or URL
    /// resolution keeps a client inside it).
    #[inline]
    fn any(&self, rule: &[u8], test: impl Fn(&[u8]) -> bool) -> bool {
        let raw = self.raw();
        // A path that matches as it is is counted, whatever its other readings (an
        // ambiguous spelling is counted): nothing to decode then.
        if test(raw.as_bytes()) {
            return true;
        }
        let reading = self.reading.get_or_init(|| {
            if is_plain(raw.as_bytes()) {
                Reading::Plain
            } else {
                spelled(raw)
            }
        });
        match reading {
            Reading::Plain => false,
            Reading::Spelled { decoded, up } => {
                test(decoded)
                    || if *up {
                        rooted_readings(decoded, rule, &test)
                    } else {
                        test(&resolve(decoded, 0))
                    }
            }
        }
    }

    /// Whether the path is `path` (a [`normalize`]d rule path).
    #[inline]
    pub(crate) fn is(&self, path: &[u8]) -> bool {
        self.any(path, |p| p == path)
    }

    /// Whether the path is under `prefix` (a [`normalize`]d rule path), by whole segments.
    #[inline]
    pub(crate) fn is_under(&self, prefix: &[u8]) -> bool {
        self.any(prefix, |p| under(p, prefix))
    }
}

/// The reading of a path that needs decoding.
#[cold]
#[inline(never)]
fn spelled(raw: &str) -> Reading {
    let decoded = decode(raw.as_bytes());
    let up = decoded.split(|&b| b == b'/').any(|s| s == b"..");
    Reading::Spelled { decoded, up }
}

/// The path a request is for: the full original one a router of axum's kept, if any.
#[inline]
fn raw_path(parts: &Parts) -> &str {
    #[cfg(feature = "axum")]
    if let Some(original) = parts.extensions.get::<axum::extract::OriginalUri>() {
        return original.0.path();
    }
    parts.uri.path()
}

/// Whether `test` holds for `decoded` resolved at a root of `m` segments, for some `m` up to
/// the number of segments of `rule` with which it starts (at most one resolution per segment
/// of the rule).
fn rooted_readings(decoded: &[u8], rule: &[u8], test: &impl Fn(&[u8]) -> bool) -> bool {
    let segments = |p: &'_ [u8]| -> Vec<(usize, usize)> {
        // (start, end) of each segment after the leading `/`.
        let mut out = Vec::new();
        let mut start = usize::from(p.first() == Some(&b'/'));
        for (i, &b) in p.iter().enumerate().skip(start) {
            if b == b'/' {
                out.push((start, i));
                start = i + 1;
            }
        }
        out.push((start, p.len()));
        out
    };
    let ours = segments(decoded);
    let theirs = segments(rule);
    let mut root = 0;
    loop {
        if test(&resolve(decoded, root)) {
            return true;
        }
        // The next root: one more segment, if the path and the rule agree on it.
        let (Some(&(a, b)), Some(&(c, d))) = (ours.get(root), theirs.get(root)) else {
            return false;
        };
        if decoded[a..b] != rule[c..d] || root + 1 >= ours.len() {
            return false;
        }
        root += 1;
    }
}

/// Whether `path` is `prefix` or under it, by whole segments: `/api` takes `/api` and
/// `/api/users`, not `/apis`; `/api/` takes what starts with `/api/`.
#[inline]
fn under(path: &[u8], prefix: &[u8]) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with(b"/") || rest.starts_with(b"/"),
        None => false,
    }
}

/// A rule's path, read as request paths are: decoded, collapsed, dot segments resolved.
pub(crate) fn normalize(path: &str) -> Box<[u8]> {
    if is_plain(path.as_bytes()) {
        return path.as_bytes().into();
    }
    resolve(&decode(path.as_bytes()), 0).into()
}

/// Whether `path` needs no decoding: no `%`, no `//`, no `.` or `..` segment. One pass, one
/// comparison for most bytes (letters and digits are all above `/`).
#[inline]
pub(crate) fn is_plain(path: &[u8]) -> bool {
    // 1: just after a `/`; 2: after `/.`; 3: after `/..`; 0: elsewhere.
    let mut state = 0u8;
    for &b in path {
        if b > b'/' {
            state = 0;
            continue;
        }
        state = match (state, b) {
            (_, b'%') | (1..=3, b'/') => return false,
            (_, b'/') => 1,
            (1, b'.') => 2,
            (2, b'.') => 3,
            _ => 0,
        };
    }
    state < 2
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// `path` with every `%XX` decoded (once) and runs of `/` collapsed.
fn decode(path: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        let mut b = path[i];
        i += 1;
        if b == b'%' {
            if let (Some(hi), Some(lo)) = (
                path.get(i).copied().and_then(hex),
                path.get(i + 1).copied().and_then(hex),
            ) {
                b = (hi << 4) | lo;
                i += 2;
            }
        }
        if b == b'/' && out.last() == Some(&b'/') {
            continue;
        }
        out.push(b);
    }
    out
}

/// `path` (collapsed) with its `.` and `..` segments resolved after its first `root`
/// segments, which `..` never leaves (RFC 3986 5.2.4 for a root of 0). A path that ended in
/// a dot segment ends at the segment it named, without a `/`.
fn resolve(path: &[u8], root: usize) -> Vec<u8> {
    let body = path.strip_prefix(b"/").unwrap_or(path);
    let mut kept: Vec<&[u8]> = Vec::new();
    for (i, segment) in body.split(|&b| b == b'/').enumerate() {
        match segment {
            b"." if i >= root => {}
            b".." if i >= root => {
                if kept.len() > root {
                    kept.pop();
                }
            }
            s => kept.push(s),
        }
    }
    let mut out = Vec::with_capacity(path.len());
    for s in &kept {
        out.push(b'/');
        out.extend_from_slice(s);
    }
    if out.is_empty() {
        out.push(b'/');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(p: &[u8]) -> String {
        String::from_utf8_lossy(p).into_owned()
    }

    fn resolved(path: &str) -> String {
        text(&resolve(&decode(path.as_bytes()), 0))
    }

    #[test]
    fn plain_paths_are_compared_as_they_are() {
        for plain in [
            "/",
            "",
            "*",
            "/a/b",
            "/.well-known/x",
            "/a/..b",
            "/a/b.",
            "/a./b",
            "/a/...",
            "/a/",
        ] {
            assert!(is_plain(plain.as_bytes()), "{plain}");
        }
        for spelled in [
            "/%61", "//a", "/a//", "/.", "/./a", "/a/..", "/a/../b", "/a/.", "%",
        ] {
            assert!(!is_plain(spelled.as_bytes()), "{spelled}");
        }
    }

    /// The one-pass test agrees with its definition on every string of up to 6 bytes over the
    /// bytes that matter.
    #[test]
    fn plain_is_what_it_says() {
        let naive = |p: &[u8]| {
            !p.contains(&b'%')
                && !p.windows(2).any(|w| w == b"//")
                && p.split(|&b| b == b'/')
                    .skip(1)
                    .all(|s| s != b"." && s != b"..")
        };
        let alphabet = [b'/', b'.', b'%', b'a'];
        let mut strings = vec![Vec::new()];
        for _ in 0..6 {
            let longer: Vec<Vec<u8>> = strings
                .iter()
                .flat_map(|s| alphabet.iter().map(move |&b| [s.as_slice(), &[b]].concat()))
                .collect();
            for s in &longer {
                let mut p = vec![b'/'];
                p.extend_from_slice(s);
                assert_eq!(is_plain(&p), naive(&p), "{}", text(&p));
            }
            strings = longer;
        }
    }

    #[test]
    fn decoded_collapsed_and_resolved() {
        assert_eq!(resolved("/files/%65xports/a.csv"), "/files/exports/a.csv");
        assert_eq!(resolved("/files/exports%2Fa.csv"), "/files/exports/a.csv");
        assert_eq!(resolved("/files/exports%2fa.csv"), "/files/exports/a.csv");
        assert_eq!(resolved("//files///exports//"), "/files/exports/");
        assert_eq!(resolved("/files/./exports"), "/files/exports");
        assert_eq!(resolved("/files/x/../exports"), "/files/exports");
        assert_eq!(resolved("/files/%2e%2E/files/exports"), "/files/exports");
        assert_eq!(resolved("/../../a"), "/a");
        assert_eq!(resolved("/a/b/.."), "/a");
        assert_eq!(resolved("/a/."), "/a");
        assert_eq!(resolved("/.."), "/");
        // Decoded once: an escaped `%` is a `%`, not the start of another escape.
        assert_eq!(text(&decode(b"/a%252F")), "/a%2F");
        // Not an escape: left as it is.
        assert_eq!(text(&decode(b"/a%2/%zz%")), "/a%2/%zz%");
        // A root that `..` does not leave.
        assert_eq!(
            text(&resolve(b"/files/../exports/a", 1)),
            "/files/exports/a"
        );
        assert_eq!(text(&resolve(b"/files/../../x", 1)), "/files/x");
    }

    #[test]
    fn every_reading_is_counted() {
        let rule = normalize("/files/exports");
        let counted = |p: &str| RequestPath::new(p).is_under(&rule);
        for yes in [
            "/files/exports",
            "/files/exports/a.csv",
            "/files/%65xports/a.csv",
            "/files/exports%2Fa.csv",
            "/files//exports/a.csv",
            "/files/./exports/a.csv",
            "/files/x/../exports/a.csv",
            // Unresolved, it is under the prefix; resolved, elsewhere: counted.
            "/files/exports/../../admin",
            // A handler of `/files/{*path}` keeping clients in its root reads `exports/a`.
            "/files/../exports/a",
            "/files/%2E%2E/%2e%2e/exports/a",
            "/%66iles/%65xports",
        ] {
            assert!(counted(yes), "{yes}");
        }
        for no in [
            "/files/exportsx",
            "/files/Exports",
            "/files/x/exports",
            "/files/exports.csv",
            "/other/../exports",
        ] {
            assert!(!counted(no), "{no}");
        }
        // Exact paths too, with a handler rooted anywhere on the rule's path.
        let exact = normalize("/files/exports/a");
        let is = |p: &str| RequestPath::new(p).is(&exact);
        assert!(is("/files/exports/../a"));
        assert!(is("/files/exports/a/b/.."));
        assert!(is("/files/%65xports/a"));
        assert!(!is("/files/exports/a/b"));
        // A rule's own spelling is read the same way.
        assert_eq!(&*normalize("/files/%65xports/"), b"/files/exports/");
        assert!(RequestPath::new("/login").is(&normalize("/%6Cogin")));
        assert!(!RequestPath::new("/login/").is(&normalize("/login")));
    }
}
