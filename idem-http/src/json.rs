//! Canonical JSON of a request body, for its fingerprint.
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

/// The deepest nesting canonicalized (serde_json's own limit); deeper
/// bodies are hashed as bytes, and the parser's recursion stays bounded
/// whatever the client sends.
pub(crate) const MAX_DEPTH: usize = 128;

/// The canonical form of `input`, or `None` if it is not a JSON text.
pub(crate) fn canonical(input: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(input).ok()?;
    let mut parser = Parser {
        s: text.as_bytes(),
        text,
        at: 0,
    };
    let mut out = Vec::with_capacity(input.len());
    parser.value(&mut out, 0)?;
    parser.skip_ws();
    (parser.at == parser.s.len()).then_some(out)
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    at: usize,
}

impl Parser<'_> {
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
        loop {
            self.value(out, depth)?;
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
                self.value(&mut value, depth)?;
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
}
