//! Canonical JSON: the byte form that keys and fingerprints hash.
//!
//! The form is RFC 8785's, the JSON Canonicalization Scheme (JCS), so a
//! producer in another language computes the same bytes (npm
//! `canonicalize`, Python `rfc8785`): no whitespace; object members sorted
//! by their names' UTF-16 code units at every depth; strings with minimal
//! escaping (`"`, `\` and the controls below U+0020 only); numbers as
//! IEEE 754 doubles in ECMAScript's `Number.prototype.toString` form
//! (`1.0` and `1` are both `1`, `1e21` is `1e+21`, `-0` is `0`). The writer
//! is the `serde_json_canonicalizer` crate, which these tests check
//! against RFC 8785's vectors, and `tests/canonical.rs` against Python's
//! `rfc8785`.
//!
//! Refused with an error (never a panic, never rounded), because JCS has
//! no exact form for them and two different payloads would hash alike:
//!
//! - **non-finite floats** (NaN, `inf`, `-inf`): JSON has none, and
//!   serde_json would write `null` (see `finite`);
//! - **integers that JCS would not write as their own digits**: JCS
//!   writes every number as an IEEE double, and `2^53 + 1`, `2^63` or a
//!   `u64` id near `u64::MAX` would be written as a neighbour's double
//!   (`2^63 + 1` and `2^63` both as `9223372036854776000`), so two ids
//!   would share one key. Such an integer is refused, never rounded:
//!   serialize it as a string. Every integer up to ±(2^53 − 1) is
//!   accepted, and so is a larger one whose digits are its canonical form
//!   (`9223372036854776000`, `10000000000000000000`): that is every
//!   integer a JavaScript producer writes, and two accepted integers never
//!   share a form. Python's `rfc8785` refuses every `int` beyond
//!   ±(2^53 − 1); pass such a value to it as a `float`. Map keys follow
//!   the same rule (the writer formats an integer key as a double too);
//! - **a member name written twice** by one object (a hand-written
//!   `Serialize`, a `flatten` that repeats a field): which one counts would
//!   be a guess.

use serde::Serialize;

/// The RFC 8785 (JCS) canonical JSON bytes of `value`.
///
/// Fails (never panics) when the value does not serialize, holds a
/// non-finite float or an integer that JCS would not write as its own
/// digits (beyond ±(2^53 − 1), most are not), or
/// repeats a member name in one object.
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    crate::finite::check_canonical(value)
        .map_err(<serde_json::Error as serde::ser::Error>::custom)?;
    serde_json_canonicalizer::to_vec(&value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::ser::{SerializeMap, Serializer};
    use serde_json::json;

    fn text<T: Serialize + ?Sized>(value: &T) -> Option<String> {
        canonical_json(value)
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
    }

    #[test]
    fn sorted_and_compact() {
        assert_eq!(
            text(&json!({"b": [3, {"z": null, "a": true}], "a": "x\"y", "é": 1.5})).as_deref(),
            Some(r#"{"a":"x\"y","b":[3,{"a":true,"z":null}],"é":1.5}"#)
        );
    }

    /// RFC 8785 Appendix B: the IEEE 754 doubles and their JSON forms.
    #[test]
    fn rfc8785_appendix_b_numbers() {
        let vectors: [(u64, &str); 24] = [
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ];
        for (bits, want) in vectors {
            let got = text(&f64::from_bits(bits));
            assert_eq!(got.as_deref(), Some(want), "{bits:#018x}");
        }
        // The RFC's NaN and Infinity rows are errors.
        for bits in [0x7fffffffffffffff_u64, 0x7ff0000000000000] {
            assert!(canonical_json(&f64::from_bits(bits)).is_err(), "{bits:#x}");
        }
    }

    /// The numbers of the issue, as doubles in ECMAScript form.
    #[test]
    #[allow(clippy::excessive_precision)] // the RFC's own input digits
    fn numbers_in_ecmascript_form() {
        for (v, want) in [
            (1e21, "1e+21"),
            (1e-7, "1e-7"),
            (-0.0, "0"),
            (333333333.33333329, "333333333.3333333"),
            (4.50, "4.5"),
            (2e-3, "0.002"),
            (0.000001, "0.000001"),
            (1.0, "1"),
            (100.0, "100"),
            (1e30, "1e+30"),
        ] {
            assert_eq!(text(&v).as_deref(), Some(want), "{v:e}");
        }
        // One number, one form: an integer and the equal double agree.
        assert_eq!(text(&json!({"n": 1})), text(&json!({"n": 1.0})));
        assert_eq!(text(&0.1f32).as_deref(), Some("0.10000000149011612"));
    }

    /// RFC 8785 section 3.2.2's example (the input as the RFC writes it).
    #[test]
    fn rfc8785_section_3_2_2_example() {
        let input = r#"{
          "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        let value: serde_json::Value = serde_json::from_str(input).unwrap_or_default();
        assert_eq!(
            text(&value).as_deref(),
            Some(
                r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
            )
        );
    }

    /// RFC 8785 section 3.2.3: member names sorted by their UTF-16 code
    /// units (the emoji's surrogates, 0xD83D, sort before U+FB33; by UTF-8
    /// bytes it would come after).
    #[test]
    fn rfc8785_sorting_by_utf16_code_units() {
        let input = r#"{
          "\u20ac": "Euro Sign",
          "\r": "Carriage Return",
          "\ufb33": "Hebrew Letter Dalet With Dagesh",
          "1": "One",
          "\ud83d\ude00": "Emoji: Grinning Face",
          "\u0080": "Control",
          "\u00f6": "Latin Small Letter O With Diaeresis",
          "\u0435\u0442": "Cyrillic"
        }"#;
        let value: serde_json::Value = serde_json::from_str(input).unwrap_or_default();
        let got = text(&value).unwrap_or_default();
        let names: Vec<String> = got
            .split("\":\"")
            .map(|s| s.rsplit('"').next().unwrap_or_default().to_owned())
            .collect();
        assert_eq!(
            got,
            "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
             \"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{435}\u{442}\":\"Cyrillic\",\
             \"\u{20ac}\":\"Euro Sign\",\"\u{1f600}\":\"Emoji: Grinning Face\",\
             \"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}",
            "{names:?}"
        );
    }

    /// Strings: only `"`, `\` and the controls below U+0020 are escaped,
    /// with the short forms where JSON has them and lowercase `\u00xx`
    /// otherwise; `/`, DEL and U+2028 are written as they are.
    #[test]
    fn string_escaping() {
        assert_eq!(
            text("\u{0}\u{1}\u{1f}\u{7f}\u{2028}\"\\/\u{8}\u{c}\n\r\tA€😀").as_deref(),
            Some("\"\\u0000\\u0001\\u001f\u{7f}\u{2028}\\\"\\\\/\\b\\f\\n\\r\\tA€😀\"")
        );
        // An escaped member name sorts by what it decodes to.
        assert_eq!(
            text(&json!({"a\"b": 1, "a": 2, "a\n": 3})).as_deref(),
            Some(r#"{"a":2,"a\n":3,"a\"b":1}"#)
        );
    }

    #[test]
    fn non_finite_floats_are_refused() {
        for v in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(canonical_json(&v).is_err(), "{v}");
            assert!(canonical_json(&vec![("x", v)]).is_err(), "{v}");
            assert!(canonical_json(&json!({"a": [1]}).as_object().map(|_| vec![v])).is_err());
        }
        // `null` itself is fine and differs from nothing else.
        assert_eq!(text(&Option::<f64>::None).as_deref(), Some("null"));
    }

    /// Integers that JCS would write as a neighbour's double (2^63 + 1
    /// and 2^63 would share a key) are refused, never rounded; those whose
    /// digits are their canonical form are written as they are.
    #[test]
    fn integers_without_an_exact_form_are_refused() {
        const MAX_SAFE: u64 = (1 << 53) - 1;
        assert_eq!(text(&MAX_SAFE).as_deref(), Some("9007199254740991"));
        assert_eq!(
            text(&-(MAX_SAFE as i64)).as_deref(),
            Some("-9007199254740991")
        );
        assert_eq!(text(&(MAX_SAFE + 1)).as_deref(), Some("9007199254740992"));
        assert_eq!(
            text(&json!({"id": MAX_SAFE})).as_deref(),
            Some(r#"{"id":9007199254740991}"#)
        );
        for big in [
            MAX_SAFE + 2,
            1 << 63,
            (1 << 63) + 1,
            (1 << 63) - 1,
            u64::MAX,
            u64::MAX - 1,
        ] {
            let err = canonical_json(&json!({"id": big}))
                .err()
                .map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains("as a string")),
                "{big}: {err:?}"
            );
            assert!(canonical_json(&big).is_err(), "{big}");
        }
        for big in [i64::MAX, i64::MIN, -(MAX_SAFE as i64) - 2] {
            assert!(canonical_json(&big).is_err(), "{big}");
            assert!(canonical_json(&vec![Some(big)]).is_err(), "{big}");
        }
        assert!(canonical_json(&u128::MAX).is_err());
        assert!(canonical_json(&(1u128 << 70)).is_err());
        // The digits JavaScript writes for the double 2^63: the same
        // number, so the same form as that double.
        let js = 9_223_372_036_854_776_000u64;
        assert_eq!(text(&js).as_deref(), Some("9223372036854776000"));
        assert_eq!(text(&js), text(&9223372036854775808.0f64));
        // As a string, an id is kept exactly, and neighbours differ.
        assert_ne!(
            text(&json!({"id": (1u64 << 63).to_string()})),
            text(&json!({"id": ((1u64 << 63) + 1).to_string()}))
        );
        // An integer map key is written in the same double form, so the
        // same rule holds.
        let a = std::collections::BTreeMap::from([(MAX_SAFE, 1), (10, 2)]);
        assert_eq!(
            text(&a).as_deref(),
            Some(r#"{"10":2,"9007199254740991":1}"#)
        );
        for big in [u64::MAX, u64::MAX - 1] {
            let b = std::collections::BTreeMap::from([(big, 1)]);
            assert!(canonical_json(&b).is_err(), "{big}");
        }
    }

    /// A `Serialize` that writes one member name twice (a custom impl, or
    /// `#[serde(flatten)]` over a map that repeats a field).
    struct Twice(i32, i32);

    impl Serialize for Twice {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut m = s.serialize_map(None)?;
            m.serialize_entry("a", &self.0)?;
            m.serialize_entry("a", &self.1)?;
            m.end()
        }
    }

    #[test]
    fn a_duplicate_member_name_is_refused() {
        assert!(canonical_json(&Twice(1, 2)).is_err());
        assert!(canonical_json(&vec![Twice(2, 1)]).is_err());
    }
}
