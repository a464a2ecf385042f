//! A pass over a `Serialize` value that refuses non-finite floats.
//!
//! serde_json writes NaN, `inf` and `-inf` as `null` (and `to_value` maps
//! them to `Value::Null`), so two different payloads would share one
//! fingerprint or content key, and a recorded response would replay as
//! something else. [`check`] walks the value with a serializer that
//! produces nothing and fails on the first non-finite float.

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
    value.serialize(Check)
}

fn float(v: f64) -> Result<(), NonFinite> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(NonFinite(format!(
            "a non-finite float ({v}) has no JSON form: JSON would write it as null"
        )))
    }
}

struct Check;

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
        serialize_i32: i32, serialize_i64: i64, serialize_i128: i128,
        serialize_u8: u8, serialize_u16: u16, serialize_u32: u32,
        serialize_u64: u64, serialize_u128: u128, serialize_char: char,
        serialize_str: &str, serialize_bytes: &[u8]);

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
        v.serialize(Check)
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
        v.serialize(Check)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        v: &T,
    ) -> Result<(), NonFinite> {
        v.serialize(Check)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Check, NonFinite> {
        Ok(Check)
    }
    fn serialize_tuple(self, _: usize) -> Result<Check, NonFinite> {
        Ok(Check)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Check, NonFinite> {
        Ok(Check)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Check, NonFinite> {
        Ok(Check)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Check, NonFinite> {
        Ok(Check)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Check, NonFinite> {
        Ok(Check)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Check, NonFinite> {
        Ok(Check)
    }
}

/// The compound serializers whose elements are plain values.
macro_rules! check_elements {
    ($($trait:ident :: $method:ident),*) => {$(
        impl ser::$trait for Check {
            type Ok = ();
            type Error = NonFinite;
            fn $method<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), NonFinite> {
                v.serialize(Check)
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
        k.serialize(Check)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), NonFinite> {
        v.serialize(Check)
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
                v.serialize(Check)
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
}
