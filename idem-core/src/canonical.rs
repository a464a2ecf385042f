//! Canonical JSON: the byte form that keys and fingerprints hash.
//!
//! The value is serialized with serde_json, then written with object keys
//! sorted (by their UTF-8 bytes) at every depth and no whitespace. Numbers
//! keep serde_json's formatting (`1` and `1.0` differ), strings its escaping.
//! Sorting is done here, not left to `serde_json::Map`, so the result does
//! not depend on whether some crate in the build turned on serde_json's
//! `preserve_order` feature.
//!
//! Non-finite floats (NaN, `inf`, `-inf`) are refused: JSON has no form for
//! them and serde_json would write `null`, so two different payloads would
//! hash alike.

use serde::Serialize;
use serde_json::Value;

/// The canonical JSON bytes of `value`.
///
/// Fails (never panics) when the value does not serialize or holds a
/// non-finite float.
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    crate::finite::check(value).map_err(<serde_json::Error as serde::ser::Error>::custom)?;
    let value = serde_json::to_value(value)?;
    let mut out = Vec::with_capacity(128);
    write_value(&value, &mut out)?;
    Ok(out)
}

fn write_value(value: &Value, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, k)?;
                out.push(b':');
                write_value(v, out)?;
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(v, out)?;
            }
            out.push(b']');
        }
        scalar => serde_json::to_writer(&mut *out, scalar)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sorted_and_compact() {
        let bytes =
            canonical_json(&json!({"b": [3, {"z": null, "a": true}], "a": "x\"y", "é": 1.5}));
        let text = bytes.ok().and_then(|b| String::from_utf8(b).ok());
        assert_eq!(
            text.as_deref(),
            Some(r#"{"a":"x\"y","b":[3,{"a":true,"z":null}],"é":1.5}"#)
        );
    }

    #[test]
    fn non_finite_floats_are_refused() {
        for v in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(canonical_json(&v).is_err(), "{v}");
            assert!(canonical_json(&vec![("x", v)]).is_err(), "{v}");
        }
        // `null` itself is fine and differs from nothing else.
        assert_eq!(
            canonical_json(&Option::<f64>::None).ok(),
            Some(b"null".to_vec())
        );
    }
}
