//! A bound on how deeply a configuration text nests, checked before it is parsed.
//!
//! The TOML parser, and the clone, deserialisation and drop of what it parsed, recurse once
//! per level of nesting; toml bounds inline tables and dotted keys each on its own, so the
//! two together nest thousands of levels in a few kilobytes, enough to overflow a thread's
//! stack (an abort, not a panic). This scan counts them together, in one pass that
//! understands strings and comments, and refuses a text above [`MAX_NESTING`] before anything
//! recurses on it.

/// The deepest a configuration text may nest: tables (each part of a dotted key; each part of
/// a table header counts twice, as it may be an array of tables and its element), inline
/// tables and arrays, all together. A text that nests deeper is refused before it is parsed.
/// A configuration needs about 8 (`[[rules]]`, `tiers`, `plans`, a plan, `policies`, a
/// policy).
pub const MAX_NESTING: usize = 32;

/// Where a text nests deeper than [`MAX_NESTING`]: the line (from 1) at which it does.
pub(crate) fn too_deep(text: &str) -> Option<usize> {
    Scan::new(text.as_bytes()).run()
}

#[derive(Clone, Copy, PartialEq)]
enum Open {
    /// An array: its items are values.
    Array,
    /// An inline table: its entries start with keys.
    Table,
}

struct Scan<'a> {
    text: &'a [u8],
    at: usize,
    line: usize,
    /// The open arrays and inline tables, each with the depth inside it.
    open: Vec<(Open, usize)>,
    /// The depth inside the table the last header opened.
    table: usize,
}

impl<'a> Scan<'a> {
    fn new(text: &'a [u8]) -> Self {
        Scan {
            text,
            at: 0,
            line: 1,
            open: Vec::new(),
            table: 0,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn starts(&self, s: &[u8]) -> bool {
        self.text.get(self.at..).is_some_and(|t| t.starts_with(s))
    }

    /// Runs over the text; the line at which it nests too deeply, if it does.
    fn run(mut self) -> Option<usize> {
        // Whether the next token starts a key (a line at the top level, an inline table's
        // entry) rather than a value.
        let mut key = true;
        // The depth of the value that comes next.
        let mut value = 0;
        while let Some(b) = self.peek() {
            match b {
                b' ' | b'\t' | b'\r' => self.at += 1,
                b'\n' => {
                    self.at += 1;
                    self.line += 1;
                    if self.open.is_empty() {
                        key = true;
                    }
                }
                b'#' => self.comment(),
                b'[' if key && self.open.is_empty() => {
                    // Each part may be an array of tables and its element: two levels.
                    self.table = self.header().saturating_mul(2);
                    if self.table > MAX_NESTING {
                        return Some(self.line);
                    }
                }
                b']' | b'}' => {
                    self.at += 1;
                    self.open.pop();
                    key = false;
                    value = self.open.last().map_or(self.table, |&(_, d)| d);
                }
                b',' => {
                    self.at += 1;
                    match self.open.last() {
                        Some(&(Open::Table, _)) => key = true,
                        Some(&(Open::Array, d)) => value = d,
                        None => {}
                    }
                }
                b'[' | b'{' => {
                    self.at += 1;
                    let inside = value + 1;
                    if inside > MAX_NESTING {
                        return Some(self.line);
                    }
                    if b == b'[' {
                        self.open.push((Open::Array, inside));
                        value = inside;
                    } else {
                        self.open.push((Open::Table, inside));
                        key = true;
                    }
                }
                b'=' => {
                    self.at += 1;
                    key = false;
                }
                _ if key => {
                    let base = self.open.last().map_or(self.table, |&(_, d)| d);
                    // `a.b.c = v`: v is inside the tables a and b.
                    value = base + self.key() - 1;
                    key = false;
                    if value > MAX_NESTING {
                        return Some(self.line);
                    }
                }
                b'"' | b'\'' => self.string(),
                _ => self.at += 1,
            }
        }
        None
    }

    /// Skips a comment, up to its line's end.
    fn comment(&mut self) {
        while let Some(b) = self.peek() {
            if b == b'\n' {
                return;
            }
            self.at += 1;
        }
    }

    /// Skips a string (basic or literal, on one line or several); a string left open ends
    /// the text (or its line, for one that may not span lines).
    fn string(&mut self) {
        let quote = self.text[self.at];
        let triple = [quote; 3];
        if self.starts(&triple) {
            self.at += 3;
            while self.at < self.text.len() {
                if quote == b'"' && self.text[self.at] == b'\\' {
                    self.at += 2;
                    continue;
                }
                if self.starts(&triple) {
                    self.at += 3;
                    // Up to two more quotes belong to the string.
                    while self.peek() == Some(quote) {
                        self.at += 1;
                    }
                    return;
                }
                if self.text[self.at] == b'\n' {
                    self.line += 1;
                }
                self.at += 1;
            }
            return;
        }
        self.at += 1;
        while let Some(b) = self.peek() {
            match b {
                b'\\' if quote == b'"' => self.at += 2,
                b'\n' => return,
                _ if b == quote => {
                    self.at += 1;
                    return;
                }
                _ => self.at += 1,
            }
        }
    }

    /// Reads a key, up to its `=` (or its line's end); how many parts it has.
    fn key(&mut self) -> usize {
        let mut parts = 1;
        while let Some(b) = self.peek() {
            match b {
                b'=' | b'\n' | b'#' => break,
                // `}`: an empty inline table, or one ending with a comma.
                b'}' | b']' | b',' | b'{' | b'[' => break,
                b'.' => {
                    parts += 1;
                    self.at += 1;
                }
                b'"' | b'\'' => self.string(),
                _ => self.at += 1,
            }
        }
        parts
    }

    /// Reads a table header (`[a.b]`, `[[a.b]]`) to its end; how many parts its key has.
    fn header(&mut self) -> usize {
        while self.peek() == Some(b'[') {
            self.at += 1;
        }
        let mut parts = 1;
        while let Some(b) = self.peek() {
            match b {
                b']' | b'\n' | b'#' => break,
                b'.' => {
                    parts += 1;
                    self.at += 1;
                }
                b'"' | b'\'' => self.string(),
                _ => self.at += 1,
            }
        }
        while self.peek() == Some(b']') {
            self.at += 1;
        }
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth_ok(text: &str) -> bool {
        too_deep(text).is_none()
    }

    #[test]
    fn counts_every_kind_of_nesting_together() {
        let n = MAX_NESTING;
        // At the bound, and one past it, for each kind alone.
        let arrays = |d: usize| format!("a = {}1{}", "[".repeat(d), "]".repeat(d));
        assert!(depth_ok(&arrays(n)));
        assert!(!depth_ok(&arrays(n + 1)));
        let dotted = |d: usize| format!("{}a = 1", "a.".repeat(d));
        assert!(depth_ok(&dotted(n)));
        assert!(!depth_ok(&dotted(n + 1)));
        let tables = |d: usize| format!("a = {}1{}", "{ b = ".repeat(d), " }".repeat(d));
        assert!(depth_ok(&tables(n)));
        assert!(!depth_ok(&tables(n + 1)));
        // Together: a header of 4 parts (8), a key of 5 parts (4), 10 inline tables of
        // 2-part keys (20): 32.
        let mixed = |extra: &str| {
            format!(
                "[a.b.c.d]\nk.k.k.k.k = {}{extra}1{}\n",
                "{ x.y = ".repeat(10),
                " }".repeat(10)
            )
        };
        assert!(depth_ok(&mixed("")));
        assert_eq!(too_deep(&format!("\n\n{}", mixed("["))), Some(4));
        // Arrays of tables count their element.
        assert!(depth_ok(&format!("[[{}a]]", "a.".repeat(n / 2 - 1))));
        assert!(!depth_ok(&format!("[[{}a]]", "a.".repeat(n / 2))));
    }

    #[test]
    fn strings_and_comments_hold_nothing() {
        let noise = "[{.".repeat(100);
        for text in [
            format!(r#"a = "{noise}""#),
            format!("a = '{noise}'"),
            format!("a = \"\"\"\n{noise}\n\"\"\"\nb = 1"),
            format!("a = '''\n{noise}\n'''"),
            format!(r#"a = "\"{noise}""#),
            format!("# {noise}\na = 1"),
            format!("a = [ # {noise}\n 1 ]"),
            format!(r#""{noise}" = 1"#),
            format!("['{noise}']\na = 1"),
            // A string left open ends the text: never a panic, never a loop.
            format!("a = \"\"\"{noise}"),
            r#"a = "\"#.to_owned(),
            "a = '''x''".to_owned(),
        ] {
            assert!(depth_ok(&text), "{text}");
        }
    }

    #[test]
    fn any_bytes_end_the_scan() {
        // Every short text over the bytes the scan cares about: no panic, no endless loop.
        let alphabet: &[u8] = b"[]{}=.,\"'#\\\na";
        let mut texts = vec![String::new()];
        for _ in 0..4 {
            texts = texts
                .iter()
                .flat_map(|t| alphabet.iter().map(move |&b| format!("{t}{}", b as char)))
                .collect();
            for t in &texts {
                let _ = too_deep(t);
            }
        }
    }
}
