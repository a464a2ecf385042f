//! Canonical JSON of a payload with its numbers' exact text, and the parts
//! of it that JSON pointers name: what receivers fingerprint a JSON body
//! or message by (the HTTP layer, and every receiver given
//! [`PayloadFingerprint::json_pointers`](crate::PayloadFingerprint::json_pointers)).
//!
//! Two bodies get one canonical form only if every JSON parser reads them
//! as the same value: whitespace is dropped, object members are sorted by
//! key (a stable sort, so duplicate keys keep their order and
//! `{"a":1,"a":2}` stays apart from `{"a":2,"a":1}`), strings are decoded
//! and written back with minimal escaping, and **numbers keep their exact
//! text**. Parsing numbers to `f64` (as `serde_json::Value` does) would give
//! `12345678901234567890123` and `12345678901234567890124` one form, and a
//! different request would be replayed another's response; so `1.0`, `1`
//! and `1e0` stay three different bodies here (the safe side: a 422, never
//! a wrong replay).
//!
//! A body that is not valid JSON (or nests deeper than [`MAX_DEPTH`]) has
//! no canonical form: the caller hashes its bytes.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The deepest nesting canonicalized (serde_json's own limit); deeper
/// bodies are hashed as bytes, and the parser's recursion stays bounded
/// whatever the client sends.
pub const MAX_DEPTH: usize = 128;

/// The most pointers a [`JsonPointers`] takes.
pub const MAX_POINTERS: usize = 256;

/// The canonical form of `input`, or `None` if it is not a JSON text (or
/// nests deeper than [`MAX_DEPTH`]).
///
/// ```
/// use idem_core::json::canonical;
///
/// assert_eq!(canonical(br#"{ "b": 1.50, "a": [true] }"#).as_deref(), Some(&br#"{"a":[true],"b":1.50}"#[..]));
/// assert_eq!(canonical(b"{oops"), None);
/// ```
pub fn canonical(input: &[u8]) -> Option<Vec<u8>> {
    let (wanted, prefixes) = (HashMap::new(), HashSet::new());
    let mut parser = Parser::new(input, &wanted, &prefixes, 0)?;
    let mut out = Vec::with_capacity(input.len());
    parser.document(&mut out)?;
    Some(out)
}

/// JSON pointers (RFC 6901) naming the parts of a JSON payload that count
/// in its fingerprint, so that a retry whose other fields changed (a
/// timestamp, a trace id) is still the same request: `"/amount"`,
/// `"/account/id"`, `"/items/0/sku"` (`~1` is a `/` inside a name, `~0` a
/// `~`); `""` is the whole payload.
///
/// ```
/// use idem_core::json::JsonPointers;
///
/// let parts = JsonPointers::new(["/amount", "/account"])?;
/// let a = parts.select(br#"{"amount": 100, "account": "a-1", "sent_at": "10:00:00"}"#);
/// let b = parts.select(br#"{"sent_at": "10:00:05", "account": "a-1", "amount": 100}"#);
/// let c = parts.select(br#"{"amount": 200, "account": "a-1", "sent_at": "10:00:00"}"#);
/// assert_eq!(a, b);
/// assert_ne!(a, c);
/// assert_eq!(parts.select(b"not json"), None);
/// # Ok::<(), idem_core::json::PointerError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JsonPointers {
    pointers: Arc<[String]>,
    /// Each pointer with its places in the list.
    wanted: Arc<HashMap<String, Vec<usize>>>,
    /// Every pointer and each of its prefixes that ends between two
    /// reference tokens (`""`, `/a`, `/a/b` for `/a/b`): the paths a
    /// selection follows.
    prefixes: Arc<HashSet<String>>,
}

/// A list of JSON pointers that [`JsonPointers::new`] refuses. Not
/// retryable: the configuration is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PointerError {
    /// No pointer: every payload would have the same fingerprint, so a
    /// key reused with another payload would be replayed another's result.
    #[error("no JSON pointer given: a fingerprint of nothing would match every payload")]
    Empty,
    /// More than [`MAX_POINTERS`].
    #[error("{0} JSON pointers, more than the {MAX_POINTERS} allowed")]
    TooMany(usize),
    /// Not a JSON pointer: it must be empty or start with `/`, and every
    /// `~` must be followed by `0` or `1`.
    #[error("not a JSON pointer (RFC 6901): {0:?}")]
    Invalid(String),
    /// A pointer of more reference tokens than a payload can nest
    /// ([`MAX_DEPTH`]): it could never name anything.
    #[error("a JSON pointer of {0} tokens, deeper than any payload read ({MAX_DEPTH})")]
    TooDeep(usize),
}

impl JsonPointers {
    /// The pointers, in the order given (the order counts in the
    /// fingerprint). Refused: no pointer, more than [`MAX_POINTERS`], or a
    /// text that is not a JSON pointer.
    pub fn new<I, S>(pointers: I) -> Result<Self, PointerError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let pointers: Vec<String> = pointers.into_iter().map(Into::into).collect();
        if pointers.is_empty() {
            return Err(PointerError::Empty);
        }
        if pointers.len() > MAX_POINTERS {
            return Err(PointerError::TooMany(pointers.len()));
        }
        for p in &pointers {
            if !valid_pointer(p) {
                return Err(PointerError::Invalid(p.clone()));
            }
            let tokens = p.matches('/').count();
            if tokens > MAX_DEPTH {
                return Err(PointerError::TooDeep(tokens));
            }
        }
        let mut wanted: HashMap<String, Vec<usize>> = HashMap::new();
        let mut prefixes = HashSet::new();
        for (i, pointer) in pointers.iter().enumerate() {
            wanted.entry(pointer.clone()).or_default().push(i);
            prefixes.insert(String::new());
            for (at, _) in pointer.match_indices('/').skip(1) {
                prefixes.insert(pointer[..at].to_owned());
            }
            prefixes.insert(pointer.clone());
        }
        Ok(JsonPointers {
            pointers: pointers.into(),
            wanted: Arc::new(wanted),
            prefixes: Arc::new(prefixes),
        })
    }

    /// The pointers.
    pub fn as_slice(&self) -> &[String] {
        &self.pointers
    }

    /// What of `payload` its fingerprint covers: each pointer with the
    /// SHA-256 of the canonical form of the value it names (numbers with
    /// their exact text) and of the kinds of the containers on its way, or
    /// a mark that it names nothing (absent is not `null`). Its size is
    /// bounded by the pointers, not the payload.
    /// `None` when `payload` is not a JSON text, or when a pointer names
    /// two values (an object with a repeated member name on its path:
    /// parsers disagree on which one counts); the caller then
    /// fingerprints the whole payload.
    pub fn select(&self, payload: &[u8]) -> Option<Vec<u8>> {
        let mut parser = Parser::new(payload, &self.wanted, &self.prefixes, self.pointers.len())?;
        parser.document(&mut Vec::with_capacity(payload.len()))?;
        if parser.twice {
            return None;
        }
        let mut out = b"json-pointers\n".to_vec();
        for (pointer, found) in self.pointers.iter().zip(parser.found) {
            framed(pointer.as_bytes(), &mut out);
            match found {
                Some(digest) => {
                    out.push(1);
                    out.extend_from_slice(&digest);
                }
                None => out.push(0),
            }
        }
        Some(out)
    }
}

/// `bytes` with its length before it, so that two lists never read alike.
fn framed(bytes: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// RFC 6901: empty, or `/` then reference tokens where `~` is `~0` or `~1`.
fn valid_pointer(p: &str) -> bool {
    if p.is_empty() {
        return true;
    }
    if !p.starts_with('/') {
        return false;
    }
    let b = p.as_bytes();
    b.iter()
        .enumerate()
        .all(|(i, &c)| c != b'~' || matches!(b.get(i + 1), Some(b'0' | b'1')))
}

/// A child of a container: a member's name or an element's index.
enum Token<'k> {
    Name(&'k str),
    Index(usize),
}

/// `name` as a reference token of a JSON pointer: `~` as `~0`, `/` as `~1`.
fn push_token(name: &str, path: &mut String) {
    path.push('/');
    for c in name.chars() {
        match c {
            '~' => path.push_str("~0"),
            '/' => path.push_str("~1"),
            c => path.push(c),
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    at: usize,
    /// The pointers whose values are kept, with their places in the list
    /// (none: canonical form only).
    wanted: &'a HashMap<String, Vec<usize>>,
    /// Every pointer of `wanted` and each of its prefixes that ends
    /// between two reference tokens (`""`, `/a`, `/a/b` for `/a/b`).
    prefixes: &'a HashSet<String>,
    /// The pointer of the value being parsed, while it is one of
    /// `prefixes` (below that, nothing is wanted: not kept).
    path: String,
    /// Whether `path` is the value's own pointer (one of `prefixes`).
    tracked: bool,
    /// The kind of each container on `path`: `o` an object, `a` an array.
    kinds: String,
    /// The SHA-256 of the containers' kinds and the canonical form of each
    /// wanted pointer's value, if met.
    found: Vec<Option<[u8; 32]>>,
    /// A wanted value, or an object on the way to one, was met twice (a
    /// repeated member name): parsers disagree on which one counts.
    twice: bool,
}

impl<'a> Parser<'a> {
    fn new(
        input: &'a [u8],
        wanted: &'a HashMap<String, Vec<usize>>,
        prefixes: &'a HashSet<String>,
        pointers: usize,
    ) -> Option<Self> {
        let text = std::str::from_utf8(input).ok()?;
        Some(Parser {
            s: text.as_bytes(),
            text,
            at: 0,
            tracked: !wanted.is_empty(),
            wanted,
            prefixes,
            path: String::new(),
            kinds: String::new(),
            found: vec![None; pointers],
            twice: false,
        })
    }

    /// A whole JSON text, its canonical form written to `out`.
    fn document(&mut self, out: &mut Vec<u8>) -> Option<()> {
        self.value(out, 0)?;
        self.skip_ws();
        (self.at == self.s.len()).then_some(())
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        (self.peek() == Some(b)).then(|| self.at += 1)
    }

    fn literal(&mut self, word: &str, out: &mut Vec<u8>) -> Option<()> {
        let end = self.at.checked_add(word.len())?;
        (self.s.get(self.at..end)? == word.as_bytes()).then(|| {
            self.at = end;
            out.extend_from_slice(word.as_bytes());
        })
    }

    fn value(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        let start = out.len();
        self.bare_value(out, depth)?;
        if !self.tracked {
            return Some(());
        }
        if let Some(places) = self.wanted.get(self.path.as_str()) {
            for &i in places {
                if self.found[i].is_some() {
                    self.twice = true;
                } else {
                    // The kinds of the containers on the way count: an
                    // array's element and a member named like its index
                    // are two parts. A digest, not a copy: nested
                    // pointers would copy the payload once each.
                    use sha2::Digest;
                    let mut hash = sha2::Sha256::new();
                    hash.update(self.kinds.as_bytes());
                    hash.update(b"\n");
                    hash.update(&out[start..]);
                    self.found[i] = Some(hash.finalize().into());
                }
            }
        }
        Some(())
    }

    /// Enters the child `token` of the container of `kind` being parsed:
    /// the child's pointer is tracked while it is one of the prefixes.
    /// What to give [`leave`](Self::leave) afterwards.
    fn enter(&mut self, kind: char, token: Token<'_>) -> (usize, usize, bool) {
        let saved = (self.path.len(), self.kinds.len(), self.tracked);
        if !self.tracked {
            return saved;
        }
        match token {
            Token::Name(name) => push_token(name, &mut self.path),
            Token::Index(index) => {
                self.path.push('/');
                self.path.push_str(&index.to_string());
            }
        }
        if self.prefixes.contains(self.path.as_str()) {
            self.kinds.push(kind);
        } else {
            self.path.truncate(saved.0);
            self.tracked = false;
        }
        saved
    }

    fn leave(&mut self, (path, kinds, tracked): (usize, usize, bool)) {
        self.path.truncate(path);
        self.kinds.truncate(kinds);
        self.tracked = tracked;
    }

    fn bare_value(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        self.skip_ws();
        match self.peek()? {
            b'{' => self.object(out, depth + 1),
            b'[' => self.array(out, depth + 1),
            b'"' => {
                let s = self.string()?;
                write_string(&s, out);
                Some(())
            }
            b't' => self.literal("true", out),
            b'f' => self.literal("false", out),
            b'n' => self.literal("null", out),
            b'-' | b'0'..=b'9' => self.number(out),
            _ => None,
        }
    }

    fn array(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.eat(b'[')?;
        out.push(b'[');
        self.skip_ws();
        if self.eat(b']').is_some() {
            out.push(b']');
            return Some(());
        }
        let mut index = 0usize;
        loop {
            let saved = self.enter('a', Token::Index(index));
            self.value(out, depth)?;
            self.leave(saved);
            index += 1;
            self.skip_ws();
            match self.peek()? {
                b',' => {
                    self.at += 1;
                    out.push(b',');
                }
                b']' => {
                    self.at += 1;
                    out.push(b']');
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    fn object(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.eat(b'{')?;
        let mut members: Vec<(String, Vec<u8>)> = Vec::new();
        let mut on_the_way: HashSet<String> = HashSet::new();
        self.skip_ws();
        if self.eat(b'}').is_none() {
            loop {
                self.skip_ws();
                if self.peek()? != b'"' {
                    return None;
                }
                let key = self.string()?;
                self.skip_ws();
                self.eat(b':')?;
                let mut value = Vec::new();
                let saved = self.enter('o', Token::Name(&key));
                // A member on the way to a wanted value, named twice.
                if self.tracked && !on_the_way.insert(key.clone()) {
                    self.twice = true;
                }
                self.value(&mut value, depth)?;
                self.leave(saved);
                members.push((key, value));
                self.skip_ws();
                match self.peek()? {
                    b',' => self.at += 1,
                    b'}' => {
                        self.at += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        // Stable: members with one key keep their order.
        members.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        out.push(b'{');
        for (i, (key, value)) in members.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_string(key, out);
            out.push(b':');
            out.extend_from_slice(value);
        }
        out.push(b'}');
        Some(())
    }

    /// Checks the number grammar of RFC 8259 and copies its text.
    fn number(&mut self, out: &mut Vec<u8>) -> Option<()> {
        let start = self.at;
        let _ = self.eat(b'-');
        match self.peek()? {
            b'0' => self.at += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.eat(b'.').is_some() {
            if !self.peek()?.is_ascii_digit() {
                return None;
            }
            self.digits();
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            if !self.peek()?.is_ascii_digit() {
                return None;
            }
            self.digits();
        }
        out.extend_from_slice(&self.s[start..self.at]);
        Some(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.at += 1;
        }
    }

    /// A string, decoded; `None` on a bad escape, a lone surrogate or a
    /// raw control character.
    fn string(&mut self) -> Option<String> {
        self.eat(b'"')?;
        let mut decoded = String::new();
        loop {
            let run = self.at;
            while self
                .peek()
                .is_some_and(|b| b != b'"' && b != b'\\' && b >= 0x20)
            {
                self.at += 1;
            }
            // `run..at` ends before an ASCII byte, so on a char boundary.
            decoded.push_str(self.text.get(run..self.at)?);
            match self.peek()? {
                b'"' => {
                    self.at += 1;
                    return Some(decoded);
                }
                b'\\' => {
                    self.at += 1;
                    let escaped = self.peek()?;
                    self.at += 1;
                    match escaped {
                        b'"' => decoded.push('"'),
                        b'\\' => decoded.push('\\'),
                        b'/' => decoded.push('/'),
                        b'b' => decoded.push('\u{8}'),
                        b'f' => decoded.push('\u{c}'),
                        b'n' => decoded.push('\n'),
                        b'r' => decoded.push('\r'),
                        b't' => decoded.push('\t'),
                        b'u' => decoded.push(self.unicode_escape()?),
                        _ => return None,
                    }
                }
                _ => return None, // a raw control character
            }
        }
    }

    /// After `\u`: four hex digits, and a low surrogate's escape after a
    /// high one.
    fn unicode_escape(&mut self) -> Option<char> {
        let first = self.hex4()?;
        match first {
            0xD800..=0xDBFF => {
                self.eat(b'\\')?;
                self.eat(b'u')?;
                let second = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&second) {
                    return None;
                }
                char::from_u32(0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00))
            }
            0xDC00..=0xDFFF => None,
            c => char::from_u32(c),
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let end = self.at.checked_add(4)?;
        let digits = self.text.get(self.at..end)?;
        if !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        self.at = end;
        u32::from_str_radix(digits, 16).ok()
    }
}

/// A string with minimal escaping (serde_json's): `"`, `\` and control
/// characters only.
fn write_string(s: &str, out: &mut Vec<u8>) {
    // Writing a &str to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> Option<String> {
        canonical(s.as_bytes()).map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    #[test]
    fn order_and_whitespace_do_not_matter() {
        assert_eq!(
            canon("{ \"b\" : [1, {\"y\":true,\"x\":null}],\n\t\"a\":\"z\" }\r\n"),
            Some(r#"{"a":"z","b":[1,{"x":null,"y":true}]}"#.to_owned())
        );
        assert_eq!(canon(r#"{"a":1,"b":2}"#), canon(r#"{"b":2,"a":1}"#));
        assert_eq!(canon("[]"), Some("[]".to_owned()));
        assert_eq!(canon(" {} "), Some("{}".to_owned()));
        assert_eq!(canon("\"x\""), Some("\"x\"".to_owned()));
    }

    #[test]
    fn numbers_keep_their_exact_text() {
        assert_ne!(
            canon(r#"{"n":12345678901234567890123}"#),
            canon(r#"{"n":12345678901234567890124}"#)
        );
        assert_ne!(canon("[1.0]"), canon("[1]"));
        assert_ne!(canon("[1e0]"), canon("[1]"));
        assert_ne!(canon("[-0]"), canon("[0]"));
        assert_ne!(
            canon("[0.30000000000000000001]"),
            canon("[0.30000000000000000002]")
        );
        assert_eq!(canon("[ -1.5E+10 ]"), Some("[-1.5E+10]".to_owned()));
        for bad in [
            "[01]",
            "[1.]",
            "[.5]",
            "[1e]",
            "[+1]",
            "[-]",
            "[1e+]",
            "[NaN]",
            "[Infinity]",
        ] {
            assert_eq!(canon(bad), None, "{bad}");
        }
    }

    #[test]
    fn strings_are_decoded_and_escaped_minimally() {
        assert_eq!(canon(r#"["\u0041\/\u00e9"]"#), canon(r#"["A/é"]"#));
        assert_eq!(canon(r#"["\ud83d\ude00"]"#), canon("[\"😀\"]"));
        assert_eq!(canon(r#"{"\u0061":1}"#), canon(r#"{"a":1}"#));
        assert_ne!(canon(r#"["a\u0000"]"#), canon(r#"["a"]"#));
        for bad in [
            r#"["\ud83d"]"#,
            r#"["\ude00"]"#,
            r#"["\x"]"#,
            r#"["\u12"]"#,
            "[\"a\nb\"]",
            r#"["abc]"#,
        ] {
            assert_eq!(canon(bad), None, "{bad}");
        }
    }

    #[test]
    fn duplicate_keys_keep_their_order() {
        assert_ne!(canon(r#"{"a":1,"a":2}"#), canon(r#"{"a":2,"a":1}"#));
        assert_eq!(
            canon(r#"{"a":1,"b":0,"a":2}"#),
            canon(r#"{"b":0,"a":1,"a":2}"#)
        );
    }

    #[test]
    fn invalid_or_too_deep_is_none_never_a_panic() {
        for bad in [
            "",
            " ",
            "{",
            "}",
            "[1,]",
            "{\"a\"}",
            "{\"a\":}",
            "{,}",
            "[1 2]",
            "tru",
            "nul",
            "{\"a\":1,}",
            "{1:2}",
            "[] []",
            "\u{feff}[]",
        ] {
            assert_eq!(canon(bad), None, "{bad:?}");
        }
        assert_eq!(canonical(b"[\"\xff\"]"), None, "not UTF-8");
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert_eq!(canon(&deep), None);
        let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(canon(&ok).is_some());
        let deep_objects = "{\"a\":".repeat(MAX_DEPTH + 1) + "1" + &"}".repeat(MAX_DEPTH + 1);
        assert_eq!(canon(&deep_objects), None);
    }

    #[test]
    fn agrees_with_serde_json_on_what_is_json() {
        for text in [
            r#"{"a":[1,2,{"b":null}],"c":"d\"e"}"#,
            r#"{"a":1,"a":2}"#,
            "[\"\u{7f}\"]",
        ] {
            assert!(canon(text).is_some(), "{text}");
            assert!(
                serde_json::from_str::<serde_json::Value>(text).is_ok(),
                "{text}"
            );
        }
    }

    fn sel(pointers: &[&str], payload: &str) -> Option<Vec<u8>> {
        JsonPointers::new(pointers.iter().copied())
            .unwrap_or_else(|e| panic!("{e}"))
            .select(payload.as_bytes())
    }

    #[test]
    fn pointers_select_only_their_parts() {
        let p = ["/amount", "/account/id"];
        let a = sel(
            &p,
            r#"{"amount":100,"account":{"id":"a-1","name":"x"},"at":1}"#,
        );
        assert!(a.is_some());
        // Other members, their order and whitespace do not count.
        assert_eq!(
            a,
            sel(
                &p,
                r#"{ "at": 2, "account": {"name":"y", "id":"a-1"}, "amount": 100 }"#
            )
        );
        // A selected part does, to the digit.
        assert_ne!(a, sel(&p, r#"{"amount":101,"account":{"id":"a-1"}}"#));
        assert_ne!(
            sel(
                &p,
                r#"{"amount":12345678901234567890123,"account":{"id":"a"}}"#
            ),
            sel(
                &p,
                r#"{"amount":12345678901234567890124,"account":{"id":"a"}}"#
            )
        );
        assert_ne!(a, sel(&p, r#"{"amount":100.0,"account":{"id":"a-1"}}"#));
        // Absent is not null, and the pointers' order counts.
        assert_ne!(sel(&["/x"], r#"{"x":null}"#), sel(&["/x"], r#"{}"#));
        assert_ne!(
            sel(&["/a", "/b"], r#"{"a":1,"b":2}"#),
            sel(&["/b", "/a"], r#"{"a":1,"b":2}"#)
        );
        // Values move between pointers: never the same selection.
        assert_ne!(
            sel(&["/a", "/b"], r#"{"a":1,"b":2}"#),
            sel(&["/a", "/b"], r#"{"a":2,"b":1}"#)
        );
        // Arrays by index, escaped names, the whole document.
        assert_eq!(
            sel(&["/items/1/sku"], r#"{"items":[{"sku":"a"},{"sku":"b"}]}"#),
            sel(
                &["/items/1/sku"],
                r#"{"items":[{"sku":"z"},{"sku":"b","n":1}]}"#
            )
        );
        assert_ne!(
            sel(&["/a~1b", "/c~0d"], r#"{"a/b":1,"c~d":2}"#),
            sel(&["/a~1b", "/c~0d"], r#"{"a/b":1,"c~d":3}"#)
        );
        assert_eq!(
            sel(&[""], r#"{"a":1,"b":2}"#),
            sel(&[""], r#"{"b":2,"a":1}"#)
        );
        assert_ne!(sel(&[""], r#"{"a":1}"#), sel(&[""], r#"{"a":1,"b":2}"#));
    }

    #[test]
    fn pointers_on_a_payload_that_is_not_json_or_ambiguous_select_nothing() {
        assert_eq!(sel(&["/a"], "{oops"), None);
        assert_eq!(sel(&["/a"], ""), None);
        assert_eq!(sel(&["/a"], "\u{feff}{}"), None);
        // A repeated member name on the path: parsers disagree.
        assert_eq!(sel(&["/a"], r#"{"a":1,"a":2}"#), None);
        assert_eq!(sel(&["/a/b"], r#"{"a":{"b":1},"a":{"b":2}}"#), None);
        // Elsewhere it does not matter.
        assert!(sel(&["/a"], r#"{"a":1,"z":1,"z":2}"#).is_some());
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert_eq!(sel(&["/0"], &deep), None);
    }

    #[test]
    fn pointer_lists_are_checked() {
        assert_eq!(
            JsonPointers::new(Vec::<String>::new()),
            Err(PointerError::Empty)
        );
        for bad in ["a", "a/b", "/a~", "/a~2", "~0"] {
            assert_eq!(
                JsonPointers::new([bad]),
                Err(PointerError::Invalid(bad.to_owned())),
                "{bad}"
            );
        }
        assert!(JsonPointers::new(["", "/", "/a~0~1", "/0/-"]).is_ok());
        let many: Vec<String> = (0..=MAX_POINTERS).map(|i| format!("/{i}")).collect();
        assert_eq!(
            JsonPointers::new(many),
            Err(PointerError::TooMany(MAX_POINTERS + 1))
        );
    }

    /// A member name repeated on the way to a pointer's value, even when
    /// only one of the two holds the value: a last-wins parser (serde_json's
    /// `Value`, JavaScript's `JSON.parse`) reads `/a/b` of
    /// `{"a":{"b":1},"a":5}` as absent, a first-wins one as `1`. The
    /// payload counts whole, never as `{"a":{"b":1}}`'s part.
    #[test]
    fn a_repeated_name_on_the_way_to_a_part_counts_whole() {
        let plain = r#"{"a":{"b":1}}"#;
        let repeated = r#"{"a":{"b":1},"a":5}"#;
        // What a last-wins parser (the handler's) sees: different requests.
        let read = |t: &str| {
            serde_json::from_str::<serde_json::Value>(t)
                .ok()
                .and_then(|v| v.pointer("/a/b").cloned())
        };
        assert_ne!(read(plain), read(repeated));
        // The selection must not make them one request.
        assert_ne!(
            sel(&["/a/b"], plain),
            sel(&["/a/b"], repeated),
            "a body that repeats `a` on the path of /a/b shares the selection of one that does not"
        );
        // The mirror case: the part only in the second (last) occurrence.
        assert_ne!(
            sel(&["/a/b"], r#"{"a":{"c":0},"a":{"b":1}}"#),
            sel(&["/a/b"], r#"{"a":{"c":0,"b":1}}"#),
        );
    }

    /// RFC 6901 reads `/0` as member "0" of an object and element 0 of an
    /// array; the kinds of the containers on the way count, so two bodies
    /// of different shapes never share a part.
    #[test]
    fn an_array_element_and_a_member_named_like_its_index_are_two_parts() {
        assert_ne!(
            sel(&["/items/0/sku"], r#"{"items":[{"sku":"a"}]}"#),
            sel(&["/items/0/sku"], r#"{"items":{"0":{"sku":"a"}}}"#),
            "an array and an object keyed \"0\" share a selection"
        );
    }

    /// Escaping is one to one; unicode escapes in names are decoded; a
    /// name with `~` or `/` never meets a nested path.
    #[test]
    fn escaped_names_never_meet_other_paths() {
        assert_ne!(
            sel(&["/a~1b"], r#"{"a/b":1}"#),
            sel(&["/a~1b"], r#"{"a":{"b":1}}"#)
        );
        assert_ne!(
            sel(&["/a/b"], r#"{"a/b":1}"#),
            sel(&["/a/b"], r#"{"a":{"b":1}}"#)
        );
        assert_ne!(sel(&["/~01"], r#"{"~1":1}"#), sel(&["/~01"], r#"{"/":1}"#));
        assert_ne!(sel(&["/~1"], r#"{"/":1}"#), sel(&["/~1"], r#"{}"#));
        assert_eq!(sel(&["/a"], r#"{"\u0061":7}"#), sel(&["/a"], r#"{"a":7}"#));
        assert_ne!(sel(&["/a"], r#"{"\u0061":7}"#), sel(&["/a"], r#"{"a":8}"#));
        assert_ne!(
            sel(&["/x"], r#"{"x":null}"#),
            sel(&["/x"], r#"{"x":"null"}"#)
        );
        assert_ne!(sel(&["/0"], r#"[null]"#), sel(&["/0"], r#"[]"#));
        assert_ne!(
            sel(&["/a", "/b"], r#"{"a":"1\u0000","b":"2"}"#),
            sel(&["/a", "/b"], r#"{"a":"1","b":"\u00002"}"#)
        );
        assert_eq!(
            sel(&["/a"], "{\"a\":\"\u{0}\"}"),
            None,
            "raw control char: not JSON"
        );
        let bad_utf8: &[u8] = b"{\"a\":\"\xff\"}";
        assert_eq!(
            JsonPointers::new(["/a"])
                .ok()
                .and_then(|p| p.select(bad_utf8)),
            None
        );
    }

    /// 256 pointers in a 1 MiB body of the shape an API sees (many small
    /// objects): each found (the time is printed).
    #[test]
    fn a_1_mib_body_with_256_pointers() {
        let mut body = String::from("{\"items\":[");
        let mut i = 0;
        while body.len() < (1 << 20) - 64 {
            if i > 0 {
                body.push(',');
            }
            body.push_str(&format!(
                "{{\"sku\":\"s-{i}\",\"n\":{i},\"tags\":[\"x\",\"y\"]}}"
            ));
            i += 1;
        }
        body.push_str("],\"amount\":100}");
        let pointers: Vec<String> = (0..255)
            .map(|k| format!("/items/{}/sku", k * 97))
            .chain(["/amount".to_owned()])
            .collect();
        let p = JsonPointers::new(pointers).unwrap_or_else(|e| panic!("{e}"));
        let t = std::time::Instant::now();
        let got = p.select(body.as_bytes());
        let took = t.elapsed();
        eprintln!("1 MiB ({i} items), 256 pointers: {took:?}");
        let got = got.unwrap_or_else(|| panic!("a part"));
        let other = p.select(body.replace("\"s-0\"", "\"s-x\"").as_bytes());
        assert_ne!(Some(got), other, "/items/0/sku counts");
    }

    /// A body a client chooses cannot make the selection quadratic: one
    /// long member name above a long array (were every value's path
    /// hashed, it would cost name length x elements: 8 GiB hashed for 256
    /// KiB, the largest SQS message). Only the paths on the way to a
    /// pointer are built. Bounded loosely against the canonical form of
    /// the same body (linear), so a loaded machine does not fail it.
    #[test]
    fn a_long_member_name_above_a_long_array_is_selected_in_linear_time() {
        let size = 256 << 10;
        let name = "k".repeat(size / 2);
        let elements = size / 4;
        let mut body = String::with_capacity(size + 16);
        body.push_str("{\"");
        body.push_str(&name);
        body.push_str("\":[");
        for i in 0..elements {
            if i > 0 {
                body.push(',');
            }
            body.push('0');
        }
        body.push_str("],\"amount\":1}");
        let t = std::time::Instant::now();
        assert!(canonical(body.as_bytes()).is_some());
        let linear = t.elapsed();
        let p = JsonPointers::new(["/amount"]).unwrap_or_else(|e| panic!("{e}"));
        let t = std::time::Instant::now();
        assert!(p.select(body.as_bytes()).is_some());
        let took = t.elapsed();
        eprintln!(
            "{} KiB body: canonical {linear:?}, select of one pointer {took:?}",
            body.len() >> 10
        );
        assert!(
            took < linear * 20 + std::time::Duration::from_millis(500),
            "select took {took:?} where the canonical form took {linear:?}"
        );
    }

    /// Semantic probes that held (kept as regression tests): prefixes,
    /// the root with others, duplicates, a deeper repeated name.
    #[test]
    fn prefixes_the_root_duplicates_and_deeper_repeats() {
        // `/a` and `/a/b`: a change inside /a/b changes both parts.
        let p = ["/a", "/a/b"];
        assert_ne!(sel(&p, r#"{"a":{"b":1}}"#), sel(&p, r#"{"a":{"b":2}}"#));
        assert_eq!(
            sel(&p, r#"{"a":{"b":1,"c":2},"z":0}"#),
            sel(&p, r#"{"z":9,"a":{"c":2,"b":1}}"#)
        );
        // The root with others, duplicates in the list.
        let p = ["", "/a", "", "/a"];
        assert!(sel(&p, r#"{"a":1}"#).is_some());
        assert_ne!(sel(&p, r#"{"a":1}"#), sel(&p, r#"{"a":1,"b":0}"#));
        // A repeated name deeper on the way.
        assert_eq!(sel(&["/a/b/c"], r#"{"a":{"b":{"c":1},"b":{"c":1}}}"#), None);
        assert_eq!(sel(&["/a/b/c"], r#"{"a":{"b":{"c":1},"b":5}}"#), None);
        assert_eq!(sel(&["/a", "/a/b"], r#"{"a":{"b":1,"b":1}}"#), None);
        // A repeated name *inside* a selected value (not on the way): the
        // selection keeps both in order (a 422 at worst, never a replay).
        assert_ne!(
            sel(&["/a"], r#"{"a":{"x":1,"x":2}}"#),
            sel(&["/a"], r#"{"a":{"x":2}}"#)
        );
        // Kinds: array vs object at every level, root included.
        assert_ne!(sel(&["/0"], r#"[7]"#), sel(&["/0"], r#"{"0":7}"#));
        assert_ne!(
            sel(&["/0/0"], r#"[{"0":7}]"#),
            sel(&["/0/0"], r#"{"0":[7]}"#)
        );
        // Names with an empty token.
        assert_ne!(
            sel(&["//b"], r#"{"":{"b":1}}"#),
            sel(&["//b"], r#"{"b":1}"#)
        );
    }

    /// A pointer is configuration, but its prefixes are rebuilt by every
    /// A pointer deeper than any payload can nest is refused when the
    /// pointers are made (it could never name anything); the prefixes a
    /// selection follows are made once then, not per payload.
    #[test]
    fn a_pointer_deeper_than_any_payload_is_refused() {
        let too_deep = "/a".repeat(MAX_DEPTH + 1);
        assert_eq!(
            JsonPointers::new([too_deep]),
            Err(PointerError::TooDeep(MAX_DEPTH + 1))
        );
        assert_eq!(
            JsonPointers::new(["/a".repeat(20_000)]),
            Err(PointerError::TooDeep(20_000))
        );
        let deepest = JsonPointers::new(["/a".repeat(MAX_DEPTH)]).unwrap_or_else(|e| panic!("{e}"));
        assert!(deepest.select(b"{}").is_some());
    }

    /// A 1 MiB body with 256 pointers that are all prefixes of each other
    /// ("" and /a, /a/a, ... 127 deep, each twice): the selection holds a
    /// digest per pointer, not a copy of each value (256 copies of a
    /// client's 1 MiB would be a quarter of a GiB per request).
    #[test]
    fn nested_pointers_do_not_copy_the_body_once_per_pointer() {
        let depth = 127;
        let mut body = String::new();
        for _ in 0..depth {
            body.push_str("{\"a\":");
        }
        body.push('"');
        body.push_str(&"x".repeat(1 << 20));
        body.push('"');
        body.push_str(&"}".repeat(depth));
        let mut pointers = vec![String::new()];
        for d in 1..=depth {
            pointers.push("/a".repeat(d));
        }
        while pointers.len() < MAX_POINTERS {
            let again = pointers[pointers.len() % (depth + 1)].clone();
            pointers.push(again);
        }
        let p = JsonPointers::new(pointers).unwrap_or_else(|e| panic!("{e}"));
        let t = std::time::Instant::now();
        let c = canonical(body.as_bytes()).map(|c| c.len());
        let linear = t.elapsed();
        let t = std::time::Instant::now();
        let got = p.select(body.as_bytes()).map(|s| s.len());
        let took = t.elapsed();
        eprintln!(
            "{} KiB body: canonical {linear:?} ({c:?} bytes), select of 256 nested pointers {took:?} ({got:?} bytes)",
            body.len() >> 10
        );
        assert!(
            got.unwrap_or(0) < 16 * body.len(),
            "the selection of a {} byte body is {got:?} bytes",
            body.len()
        );
    }
}
