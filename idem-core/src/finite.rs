//! A pass over a `Serialize` value that refuses what has no exact JSON
//! form.
//!
//! serde_json writes NaN, `inf` and `-inf` as `null` (and `to_value` maps
//! them to `Value::Null`), so two different payloads would share one
//! fingerprint or content key, and a recorded response would replay as
//! something else. [`check`] walks the value with a serializer that
//! produces nothing and fails on the first non-finite float.
//! [`check_canonical`] also refuses integers beyond ±(2^53 − 1), which
//! RFC 8785 (JCS) would round to a neighbouring double (see `canonical`).

use std::fmt;

use serde::ser::{self, Serialize};

/// Why a value was refused.
#[derive(Debug)]
pub(crate) struct NonFinite(String);

impl fmt::Display for NonFinite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NonFinite {}

impl ser::Error for NonFinite {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        NonFinite(msg.to_string())
    }
}

/// `Ok` when `value` serializes and holds no NaN or infinite float.
/// A `Serialize` impl that fails is reported with its own message.
pub(crate) fn check<T: Serialize + ?Sized>(value: &T) -> Result<(), NonFinite> {
    value.serialize(Check {
        exact_ints: false,
        number: false,
    })
}

/// The check the canonical writer makes of a number given as its text
/// (serde_json's `arbitrary_precision`): an integer must be
/// [`written_exactly`], any other form exactly its double's value.
pub(crate) fn canonical_number_text(text: &str) -> Result<(), NonFinite> {
    number_text(
        Check {
            exact_ints: true,
            number: true,
        },
        text,
    )
}

/// 2^53 − 1: every integer up to it is an exact double (ECMAScript's
/// `Number.MAX_SAFE_INTEGER`), written as its digits.
pub(crate) const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// Whether the canonical form of the integer of magnitude `abs` (its
/// nearest double, in ECMAScript form) is its own decimal digits. Beyond
/// 2^53 that holds for the integers a double-based producer (JavaScript)
/// writes, such as `9223372036854776000`, and fails for the others
/// (`2^53 + 1`, `2^63`, `u64::MAX`). Accepted integers keep distinct
/// forms: two of them with one form would have the same digits.
pub(crate) fn written_exactly(abs: u128) -> bool {
    if abs <= u128::from(MAX_SAFE_INTEGER) {
        return true;
    }
    // `as` rounds to the nearest double (ties to even), as a JSON parser
    // reading the digits does.
    let nearest = abs as f64;
    nearest.is_finite()
        && ryu_js::Buffer::new().format_finite(nearest).as_bytes()
            == itoa::Buffer::new().format(abs).as_bytes()
}

/// Why a non-finite float is refused.
pub(crate) fn non_finite(v: f64) -> String {
    format!("a non-finite float ({v}) has no JSON form: JSON would write it as null")
}

/// Why an integer that is not [`written_exactly`] is refused.
pub(crate) fn inexact_integer(shown: &dyn fmt::Display) -> String {
    format!(
        "the integer {shown} has no exact canonical form: RFC 8785 writes numbers as IEEE \
         doubles, and its nearest double is also another integer's; serialize it as a string"
    )
}

fn float(v: f64) -> Result<(), NonFinite> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(NonFinite(non_finite(v)))
    }
}

/// The check of an integer whose magnitude is `abs`.
fn integer(check: Check, abs: u128, shown: &dyn fmt::Display) -> Result<(), NonFinite> {
    if !check.exact_ints || written_exactly(abs) {
        return Ok(());
    }
    Err(NonFinite(inexact_integer(shown)))
}

#[derive(Clone, Copy)]
struct Check {
    /// Refuse integers that are not exact doubles.
    exact_ints: bool,
    /// Inside serde_json's number struct (feature `arbitrary_precision`):
    /// the field is the number's literal text.
    number: bool,
}

/// The name under which serde_json with `arbitrary_precision` serializes a
/// `Number`: a struct of one field, the number's text as parsed. Features
/// unify, so any crate of an application can turn it on.
const ARBITRARY_PRECISION_NUMBER: &str = "$serde_json::private::Number";

/// The check of a number given as its literal text (serde_json's
/// `arbitrary_precision`). The canonical form writes it as its nearest
/// double, so, as for typed numbers: an integer must be [`written_exactly`],
/// and a fraction or exponent form must be exactly the value of its double
/// (`0.1`, `1.50`, `1e2`, not `0.1000000000000000000001`, whose double is
/// `0.1`'s). Non-finite (`1e400`) is refused in both checks.
fn number_text(check: Check, text: &str) -> Result<(), NonFinite> {
    let refuse = |why: &str| {
        Err(NonFinite(format!(
            "the number {text} {why}: RFC 8785 writes numbers as IEEE doubles, and its nearest \
             double is also another number's; serialize it as a string"
        )))
    };
    let digits = text.strip_prefix('-').unwrap_or(text);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return match digits.parse::<u128>() {
            Ok(abs) => integer(check, abs, &text),
            Err(_) if check.exact_ints => refuse("has no exact canonical form"),
            Err(_) => Ok(()),
        };
    }
    let Ok(double) = text.parse::<f64>() else {
        return Err(NonFinite(format!("{text} is not a JSON number")));
    };
    float(double)?;
    if check.exact_ints && decimal(text) != decimal(&format!("{double:e}")) {
        return refuse("is not exactly a double's value");
    }
    Ok(())
}

/// A decimal literal as (negative, significant digits, exponent of the
/// last digit), zero as `(false, "", 0)`: equal for equal values
/// (`1.50`, `15e-1`); `None` for what does not parse.
fn decimal(text: &str) -> Option<(bool, String, i64)> {
    let (negative, rest) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if !(int.bytes().chain(frac.bytes())).all(|b| b.is_ascii_digit()) {
        return None;
    }
    let all = format!("{int}{frac}");
    let trimmed = all.trim_start_matches('0');
    let significant = trimmed.trim_end_matches('0');
    if significant.is_empty() {
        return Some((false, String::new(), 0));
    }
    let trailing = i64::try_from(trimmed.len() - significant.len()).ok()?;
    let frac_len = i64::try_from(frac.len()).ok()?;
    let exponent = exponent.checked_sub(frac_len)?.checked_add(trailing)?;
    Some((negative, significant.to_owned(), exponent))
}

macro_rules! ok_scalars {
    ($($name:ident: $ty:ty),*) => {
        $(fn $name(self, _: $ty) -> Result<(), NonFinite> { Ok(()) })*
    };
}

impl ser::Serializer for Check {
    type Ok = ();
    type Error = NonFinite;
    type SerializeSeq = Check;
    type SerializeTuple = Check;
    type SerializeTupleStruct = Check;
    type SerializeTupleVariant = Check;
    type SerializeMap = Check;
    type SerializeStruct = Check;
    type SerializeStructVariant = Check;

    ok_scalars!(serialize_bool: bool, serialize_i8: i8, serialize_i16: i16,
        serialize_i32: i32, serialize_u8: u8, serialize_u16: u16, serialize_u32: u32,
        serialize_char: char, serialize_str: &str, serialize_bytes: &[u8]);

    fn serialize_i64(self, v: i64) -> Result<(), NonFinite> {
        integer(self, u128::from(v.unsigned_abs()), &v)
    }
    fn serialize_i128(self, v: i128) -> Result<(), NonFinite> {
        integer(self, v.unsigned_abs(), &v)
    }
    fn serialize_u64(self, v: u64) -> Result<(), NonFinite> {
        integer(self, u128::from(v), &v)
    }
    fn serialize_u128(self, v: u128) -> Result<(), NonFinite> {
        integer(self, v, &v)
    }

    fn serialize_f32(self, v: f32) -> Result<(), NonFinite> {
        float(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), NonFinite> {
        float(v)
    }
    fn serialize_none(self) -> Result<(), NonFinite> {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> Result<(), NonFinite> {
        v.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), NonFinite> {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), NonFinite> {
        Ok(())
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
    ) -> Result<(), NonFinite> {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        v: &T,
    ) -> Result<(), NonFinite> {
        v.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        v: &T,
    ) -> Result<(), NonFinite> {
        v.serialize(self)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Check, NonFinite> {
        Ok(self)
    }
    fn serialize_tuple(self, _: usize) -> Result<Check, NonFinite> {
        Ok(self)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Check, NonFinite> {
        Ok(self)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Check, NonFinite> {
        Ok(self)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Check, NonFinite> {
        Ok(self)
    }
    fn serialize_struct(self, name: &'static str, _: usize) -> Result<Check, NonFinite> {
        Ok(Check {
            number: name == ARBITRARY_PRECISION_NUMBER,
            ..self
        })
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Check, NonFinite> {
        Ok(self)
    }
}

/// The compound serializers whose elements are plain values.
macro_rules! check_elements {
    ($($trait:ident :: $method:ident),*) => {$(
        impl ser::$trait for Check {
            type Ok = ();
            type Error = NonFinite;
            fn $method<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), NonFinite> {
                v.serialize(*self)
            }
            fn end(self) -> Result<(), NonFinite> {
                Ok(())
            }
        }
    )*};
}

check_elements!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

impl ser::SerializeMap for Check {
    type Ok = ();
    type Error = NonFinite;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, k: &T) -> Result<(), NonFinite> {
        k.serialize(*self)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), NonFinite> {
        v.serialize(*self)
    }
    fn end(self) -> Result<(), NonFinite> {
        Ok(())
    }
}

/// The compound serializers whose fields are named.
macro_rules! check_fields {
    ($($trait:ident),*) => {$(
        impl ser::$trait for Check {
            type Ok = ();
            type Error = NonFinite;
            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                _: &'static str,
                v: &T,
            ) -> Result<(), NonFinite> {
                if self.number {
                    // The field is the number's text (a `&str`).
                    return match serde_json::to_value(v) {
                        Ok(serde_json::Value::String(text)) => number_text(*self, &text),
                        _ => Err(NonFinite(format!(
                            "{ARBITRARY_PRECISION_NUMBER} holds something other than a number's text"
                        ))),
                    };
                }
                v.serialize(*self)
            }
            fn end(self) -> Result<(), NonFinite> {
                Ok(())
            }
        }
    )*};
}

check_fields!(SerializeStruct, SerializeStructVariant);

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// The canonical writer, which makes this module's integer checks.
    fn check_canonical<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
        crate::canonical::canonical_json(value)
    }

    #[test]
    fn refuses_nan_and_infinities_at_any_depth() {
        assert!(check(&1.5f64).is_ok());
        assert!(check(&f64::NAN).is_err());
        assert!(check(&f32::INFINITY).is_err());
        assert!(check(&vec![Some(1.0), Some(f64::NEG_INFINITY)]).is_err());
        let mut m = BTreeMap::new();
        m.insert("a", (1u8, [0.0f64, f64::NAN]));
        assert!(check(&m).is_err());
        assert!(check(&serde_json::json!({"a": [1, 2.5, null]})).is_ok());
    }

    #[test]
    fn only_the_canonical_check_refuses_inexact_integers() {
        let big = vec![(1u64 << 63) + 1];
        // A response keeps its u64 exactly (serde_json does): fine to record.
        assert!(check(&big).is_ok());
        assert!(check_canonical(&big).is_err());
        assert!(check_canonical(&[MAX_SAFE_INTEGER, MAX_SAFE_INTEGER + 1]).is_ok());
        assert!(check_canonical(&[-(MAX_SAFE_INTEGER as i64) - 1]).is_ok());
        assert!(check_canonical(&[MAX_SAFE_INTEGER + 2]).is_err());
        assert!(check_canonical(&[-(MAX_SAFE_INTEGER as i64) - 2]).is_err());
        for v in [i64::MIN, i64::MAX] {
            assert!(check_canonical(&Some(v)).is_err(), "{v}");
        }
        for v in [u64::MAX, u64::MAX - 1, 1 << 63, (1 << 63) + 1] {
            assert!(check_canonical(&v).is_err(), "{v}");
        }
        // What JavaScript writes for 2^63 and for 1e19: their own digits.
        assert!(check_canonical(&9_223_372_036_854_776_000u64).is_ok());
        assert!(check_canonical(&-1_434_269_174_621_768_700i64).is_ok());
        assert!(check_canonical(&10_000_000_000_000_000_000u64).is_ok());
        assert!(check_canonical(&100_000_000_000_000_000_000u128).is_ok());
        // From 1e21 on, the form has an exponent: never the digits.
        assert!(check_canonical(&1_000_000_000_000_000_000_000u128).is_err());
        assert!(check_canonical(&u128::MAX).is_err());
        assert!(check_canonical(&i128::MIN).is_err());
        // Map keys too (the canonical writer formats them as doubles).
        let mut m = BTreeMap::new();
        m.insert(9_223_372_036_854_776_000u64, 1u64);
        assert!(check_canonical(&m).is_ok());
        m.insert(u64::MAX, 1);
        assert!(check_canonical(&m).is_err());
        assert!(check(&m).is_ok());
    }

    #[test]
    fn written_exactly_around_the_powers_of_two() {
        assert!(written_exactly(0));
        assert!(written_exactly(u128::from(MAX_SAFE_INTEGER)));
        assert!(written_exactly(1 << 53), "2^53 is 9007199254740992");
        assert!(!written_exactly((1 << 53) + 1));
        for shift in 54..=70u32 {
            let p = 1u128 << shift;
            assert!(!written_exactly(p + 1), "2^{shift} + 1");
            assert!(!written_exactly(p - 1), "2^{shift} - 1");
        }
    }
}
