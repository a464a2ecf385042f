//! Canonical JSON: the byte form that keys and fingerprints hash.
//!
//! The form is RFC 8785's, the JSON Canonicalization Scheme (JCS), so a
//! producer in another language computes the same bytes (npm
//! `canonicalize`, Python `rfc8785`): no whitespace; object members sorted
//! by their names' UTF-16 code units at every depth; strings with minimal
//! escaping (`"`, `\` and the controls below U+0020 only); numbers as
//! IEEE 754 doubles in ECMAScript's `Number.prototype.toString` form
//! (`1.0` and `1` are both `1`, `1e21` is `1e+21`, `-0` is `0`, through
//! the `ryu-js` crate). The writer is this module's own single-pass
//! serializer; these tests check it against RFC 8785's vectors and against
//! the `serde_json_canonicalizer` crate on random values, and
//! `tests/stores/canonical.rs` against Python's `rfc8785`.
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
//!   be a guess;
//! - **nesting deeper than 256 levels**, which would
//!   otherwise overflow the stack (serde_json's parser stops at 128).

use std::cmp::Ordering;
use std::ops::Range;

use serde::ser::{self, Error as _, Serialize};

use crate::finite::{self, MAX_SAFE_INTEGER};

type Error = serde_json::Error;

/// How deep arrays and objects may nest. Deeper is refused with an error
/// (serde_json's own parser stops at 128): a payload nested thousands of
/// levels deep would otherwise overflow the stack, which aborts the
/// process.
pub(crate) const MAX_DEPTH: usize = 256;

/// serde_json's name for a `Number` under `arbitrary_precision`: a struct
/// of one field, the number's text.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";
/// serde_json's name for a `RawValue`: its text is not checked, so refused.
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

/// The RFC 8785 (JCS) canonical JSON bytes of `value`.
///
/// Fails (never panics) when the value does not serialize, holds a
/// non-finite float or an integer that JCS would not write as its own
/// digits (beyond ±(2^53 − 1), most are not), repeats a member name in
/// one object, nests deeper than 256 levels, or holds a
/// `serde_json::value::RawValue` (its text is not canonical).
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::with_capacity(128);
    write_canonical(value, &mut out)?;
    Ok(out)
}

/// Appends the canonical JSON of `value` to `out` (left as it was on an
/// error is not promised: callers discard it).
pub(crate) fn write_canonical<T: Serialize + ?Sized>(
    value: &T,
    out: &mut Vec<u8>,
) -> Result<(), serde_json::Error> {
    let mut writer = Writer {
        out,
        members: Vec::new(),
        names: String::new(),
        scratch: Vec::new(),
        depth: 0,
    };
    value.serialize(&mut writer)?;
    // A `Serialize` that ignored an error and went on can leave an array
    // or an object open: never hash what it wrote.
    if writer.depth != 0 || !writer.members.is_empty() {
        return Err(went_on_after_an_error());
    }
    Ok(())
}

/// The error for output that a `Serialize` left incomplete (it ignored an
/// error of this writer and went on).
fn went_on_after_an_error() -> Error {
    Error::custom("the value's Serialize went on after an error: its JSON is incomplete")
}

/// A single-pass writer: members are written in the order they come, and
/// an object whose names are out of order is rewritten in place when it
/// ends (the sorted form has the same length), so a struct costs no
/// allocation per member.
struct Writer<'o> {
    out: &'o mut Vec<u8>,
    /// The members of the objects being written, innermost last.
    members: Vec<Member>,
    /// Their names as they decode (unescaped), which is how JCS sorts.
    names: String,
    /// Room to rewrite an object in sorted order.
    scratch: Vec<u8>,
    depth: usize,
}

/// One member of an open object: its name (in `Writer::names`) and its
/// bytes `"name":value` (in `Writer::out`).
struct Member {
    name: Range<usize>,
    bytes: Range<usize>,
}

impl Writer<'_> {
    fn enter(&mut self) -> Result<(), Error> {
        if self.depth >= MAX_DEPTH {
            return Err(Error::custom(format!(
                "the value nests deeper than {MAX_DEPTH} levels"
            )));
        }
        self.depth += 1;
        Ok(())
    }

    fn number(&mut self, abs: u128, negative: bool) -> Result<(), Error> {
        if abs > u128::from(MAX_SAFE_INTEGER) && !finite::written_exactly(abs) {
            let sign = if negative { "-" } else { "" };
            return Err(Error::custom(finite::inexact_integer(&format_args!(
                "{sign}{abs}"
            ))));
        }
        if negative && abs != 0 {
            self.out.push(b'-');
        }
        self.out
            .extend_from_slice(itoa::Buffer::new().format(abs).as_bytes());
        Ok(())
    }

    fn float(&mut self, v: f64) -> Result<(), Error> {
        if !v.is_finite() {
            return Err(Error::custom(finite::non_finite(v)));
        }
        self.out
            .extend_from_slice(ryu_js::Buffer::new().format_finite(v).as_bytes());
        Ok(())
    }

    /// Opens an object: `{`, and the place its members start from.
    fn open_object(&mut self) -> Result<Object, Error> {
        self.enter()?;
        self.out.push(b'{');
        Ok(Object {
            start: self.out.len() - 1,
            first: self.members.len(),
            names: self.names.len(),
            member_start: 0,
            name: 0..0,
            key: KeyState::Idle,
        })
    }

    /// Starts a member: the comma, then the name (escaped) and `:`.
    fn begin_member(&mut self, object: &mut Object, name: &str) -> Result<(), Error> {
        self.begin_name(object)?;
        write_string(self.out, name);
        self.names.push_str(name);
        self.end_name(object);
        Ok(())
    }

    fn begin_name(&mut self, object: &mut Object) -> Result<(), Error> {
        if object.key != KeyState::Idle {
            return Err(Error::custom("a map key without a value"));
        }
        if self.members.len() > object.first {
            self.out.push(b',');
        }
        object.member_start = self.out.len();
        object.name = self.names.len()..self.names.len();
        object.key = KeyState::Naming;
        Ok(())
    }

    fn end_name(&mut self, object: &mut Object) {
        object.name.end = self.names.len();
        object.key = KeyState::Named;
        self.out.push(b':');
    }

    fn end_member(&mut self, object: &mut Object) -> Result<(), Error> {
        if object.key != KeyState::Named {
            return Err(Error::custom("a map value without its key"));
        }
        object.key = KeyState::Idle;
        self.members.push(Member {
            name: object.name.clone(),
            bytes: object.member_start..self.out.len(),
        });
        Ok(())
    }

    /// Closes an object: sorts its members by their names' UTF-16 code
    /// units (rewriting them in place if they came in another order) and
    /// refuses a name given twice.
    fn close_object(&mut self, object: Object) -> Result<(), Error> {
        if object.key != KeyState::Idle {
            return Err(Error::custom("a map key without a value"));
        }
        // The members must be exactly what follows the `{`, comma
        // separated: a `Serialize` that ignored an error and went on can
        // leave a partial member, or an inner object's, in between.
        let mut next = object.start + 1;
        for (i, member) in self.members[object.first..].iter().enumerate() {
            if member.bytes.start != next + usize::from(i > 0) {
                return Err(went_on_after_an_error());
            }
            next = member.bytes.end;
        }
        if next != self.out.len() {
            return Err(went_on_after_an_error());
        }
        let Writer {
            out,
            members,
            names,
            scratch,
            ..
        } = self;
        let open = &mut members[object.first..];
        let by_name =
            |a: &Member, b: &Member| utf16_cmp(&names[a.name.clone()], &names[b.name.clone()]);
        if !open.is_sorted_by(|a, b| by_name(a, b) == Ordering::Less) {
            open.sort_unstable_by(by_name);
            if let Some(w) = open
                .windows(2)
                .find(|w| by_name(&w[0], &w[1]) == Ordering::Equal)
            {
                return Err(Error::custom(format!(
                    "the member name {:?} is written twice in one object",
                    &names[w[0].name.clone()]
                )));
            }
            scratch.clear();
            for (i, member) in open.iter().enumerate() {
                if i > 0 {
                    scratch.push(b',');
                }
                scratch.extend_from_slice(&out[member.bytes.clone()]);
            }
            out[object.start + 1..].copy_from_slice(scratch);
        }
        members.truncate(object.first);
        names.truncate(object.names);
        out.push(b'}');
        self.depth -= 1;
        Ok(())
    }

    /// `{"variant":` for the variants serde_json writes as one-member
    /// objects.
    fn open_variant(&mut self, variant: &str) -> Result<(), Error> {
        self.enter()?;
        self.out.push(b'{');
        write_string(self.out, variant);
        self.out.push(b':');
        Ok(())
    }

    fn close_variant(&mut self) {
        self.out.push(b'}');
        self.depth -= 1;
    }

    fn open_array(&mut self) -> Result<Array, Error> {
        self.enter()?;
        self.out.push(b'[');
        Ok(Array { first: true })
    }

    fn close_array(&mut self) {
        self.out.push(b']');
        self.depth -= 1;
    }
}

/// JCS member order: by UTF-16 code units (RFC 8785 section 3.2.3), which
/// differs from UTF-8 byte order only past U+FFFF.
fn utf16_cmp(a: &str, b: &str) -> Ordering {
    if a.is_ascii() && b.is_ascii() {
        return a.cmp(b);
    }
    a.encode_utf16().cmp(b.encode_utf16())
}

/// A JSON string with JCS's minimal escaping: `"`, `\` and the controls
/// below U+0020 (short forms where JSON has them, else `\u00xx`).
fn write_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut from = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0x00..=0x1f => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(&bytes[from..i]);
                out.extend_from_slice(&[
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[usize::from(b >> 4)],
                    HEX[usize::from(b & 0xf)],
                ]);
                from = i + 1;
                continue;
            }
            _ => continue,
        };
        out.extend_from_slice(&bytes[from..i]);
        out.extend_from_slice(escape);
        from = i + 1;
    }
    out.extend_from_slice(&bytes[from..]);
    out.push(b'"');
}

/// An object being written (a map, a struct, a struct variant's fields).
struct Object {
    /// Where its `{` is in the output.
    start: usize,
    /// Its first member in `Writer::members`.
    first: usize,
    /// Where its names start in `Writer::names`.
    names: usize,
    /// The member being written: where it starts, and its name.
    member_start: usize,
    name: Range<usize>,
    key: KeyState,
}

/// Where an object is between its members.
#[derive(Clone, Copy, PartialEq, Eq)]
enum KeyState {
    /// Between members.
    Idle,
    /// Its name is being written (a failed name stays here).
    Naming,
    /// Its name is written; its value comes next.
    Named,
}

struct Array {
    first: bool,
}

macro_rules! integers {
    ($($method:ident: $ty:ty),*) => {$(
        fn $method(self, v: $ty) -> Result<(), Error> {
            #[allow(unused_comparisons)]
            let negative = v < 0;
            self.number(v.unsigned_abs() as u128, negative)
        }
    )*};
}

macro_rules! unsigned {
    ($($method:ident: $ty:ty),*) => {$(
        fn $method(self, v: $ty) -> Result<(), Error> {
            self.number(u128::from(v), false)
        }
    )*};
}

impl<'a, 'o> ser::Serializer for &'a mut Writer<'o> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Elements<'a, 'o>;
    type SerializeTuple = Elements<'a, 'o>;
    type SerializeTupleStruct = Elements<'a, 'o>;
    type SerializeTupleVariant = Elements<'a, 'o>;
    type SerializeMap = Members<'a, 'o>;
    type SerializeStruct = Members<'a, 'o>;
    type SerializeStructVariant = Members<'a, 'o>;

    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }

    integers!(serialize_i8: i8, serialize_i16: i16, serialize_i32: i32, serialize_i64: i64,
        serialize_i128: i128);
    unsigned!(serialize_u8: u8, serialize_u16: u16, serialize_u32: u32, serialize_u64: u64,
        serialize_u128: u128);

    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        self.float(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        self.float(v)
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        write_string(self.out, v.encode_utf8(&mut [0; 4]));
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        write_string(self.out, v);
        Ok(())
    }
    /// As serde_json writes bytes: an array of numbers.
    fn serialize_bytes(self, v: &[u8]) -> Result<(), Error> {
        use ser::SerializeSeq;
        let mut seq = self.serialize_seq(Some(v.len()))?;
        for b in v {
            seq.serialize_element(b)?;
        }
        seq.end()
    }
    fn serialize_none(self) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> Result<(), Error> {
        v.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Error> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, v: &'static str) -> Result<(), Error> {
        self.serialize_str(v)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        v: &T,
    ) -> Result<(), Error> {
        v.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        v: &T,
    ) -> Result<(), Error> {
        self.open_variant(variant)?;
        v.serialize(&mut *self)?;
        self.close_variant();
        Ok(())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Elements<'a, 'o>, Error> {
        let array = self.open_array()?;
        Ok(Elements {
            w: self,
            array,
            variant: false,
        })
    }
    fn serialize_tuple(self, len: usize) -> Result<Elements<'a, 'o>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        len: usize,
    ) -> Result<Elements<'a, 'o>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Elements<'a, 'o>, Error> {
        self.open_variant(variant)?;
        let array = self.open_array()?;
        Ok(Elements {
            w: self,
            array,
            variant: true,
        })
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Members<'a, 'o>, Error> {
        let object = self.open_object()?;
        Ok(Members {
            w: self,
            object: Some(object),
            variant: false,
        })
    }
    fn serialize_struct(self, name: &'static str, len: usize) -> Result<Members<'a, 'o>, Error> {
        match name {
            NUMBER_TOKEN => Ok(Members {
                w: self,
                object: None,
                variant: false,
            }),
            RAW_VALUE_TOKEN => Err(Error::custom(
                "a RawValue has no canonical form here (its text is not checked): \
                 parse it into a serde_json::Value first",
            )),
            _ => self.serialize_map(Some(len)),
        }
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Members<'a, 'o>, Error> {
        self.open_variant(variant)?;
        let object = self.open_object()?;
        Ok(Members {
            w: self,
            object: Some(object),
            variant: true,
        })
    }
}

/// The elements of an array (a tuple variant's: `variant` closes its
/// object too).
struct Elements<'a, 'o> {
    w: &'a mut Writer<'o>,
    array: Array,
    variant: bool,
}

impl Elements<'_, '_> {
    fn element<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Error> {
        if !self.array.first {
            self.w.out.push(b',');
        }
        self.array.first = false;
        v.serialize(&mut *self.w)
    }

    fn finish(self) -> Result<(), Error> {
        self.w.close_array();
        if self.variant {
            self.w.close_variant();
        }
        Ok(())
    }
}

macro_rules! elements {
    ($($trait:ident :: $method:ident),*) => {$(
        impl ser::$trait for Elements<'_, '_> {
            type Ok = ();
            type Error = Error;
            fn $method<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Error> {
                self.element(v)
            }
            fn end(self) -> Result<(), Error> {
                self.finish()
            }
        }
    )*};
}

elements!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

/// The members of an object (a struct variant's: `variant` closes its
/// outer object too). `object` is `None` for serde_json's
/// arbitrary-precision number, whose one field is the number's text.
struct Members<'a, 'o> {
    w: &'a mut Writer<'o>,
    object: Option<Object>,
    variant: bool,
}

impl Members<'_, '_> {
    fn field<T: Serialize + ?Sized>(&mut self, name: &'static str, v: &T) -> Result<(), Error> {
        let Some(object) = self.object.as_mut() else {
            return number_text(self.w, v);
        };
        self.w.begin_member(object, name)?;
        v.serialize(&mut *self.w)?;
        self.w.end_member(object)
    }

    fn finish(self) -> Result<(), Error> {
        if let Some(object) = self.object {
            self.w.close_object(object)?;
        }
        if self.variant {
            self.w.close_variant();
        }
        Ok(())
    }
}

/// serde_json's arbitrary-precision number: its text, checked as a typed
/// number would be and written in the form of its double.
fn number_text<T: Serialize + ?Sized>(w: &mut Writer<'_>, v: &T) -> Result<(), Error> {
    let text = match serde_json::to_value(v) {
        Ok(serde_json::Value::String(text)) => text,
        _ => {
            return Err(Error::custom(format!(
                "{NUMBER_TOKEN} holds something other than a number's text"
            )))
        }
    };
    finite::canonical_number_text(&text).map_err(Error::custom)?;
    match text.parse::<f64>() {
        Ok(double) => w.float(double),
        Err(_) => Err(Error::custom(format!("{text} is not a JSON number"))),
    }
}

/// Structs and struct variants: named fields, members of the object.
macro_rules! fields {
    ($($trait:ident),*) => {$(
        impl ser::$trait for Members<'_, '_> {
            type Ok = ();
            type Error = Error;
            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                name: &'static str,
                v: &T,
            ) -> Result<(), Error> {
                self.field(name, v)
            }
            fn end(self) -> Result<(), Error> {
                self.finish()
            }
        }
    )*};
}

fields!(SerializeStruct, SerializeStructVariant);

impl ser::SerializeMap for Members<'_, '_> {
    type Ok = ();
    type Error = Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        let Some(object) = self.object.as_mut() else {
            return Err(Error::custom("a map inside a number"));
        };
        self.w.begin_name(object)?;
        key.serialize(Name { w: &mut *self.w })?;
        self.w.end_name(object);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Error> {
        let Some(object) = self.object.as_mut() else {
            return Err(Error::custom("a map inside a number"));
        };
        // A value without its key is refused by `end_member`.
        v.serialize(&mut *self.w)?;
        self.w.end_member(object)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

/// A map key, which JSON writes as a string: what serde_json accepts as
/// a key (strings, chars, numbers and booleans as their text, unit
/// variants as their name), numbers in their canonical form.
struct Name<'a, 'o> {
    w: &'a mut Writer<'o>,
}

impl Name<'_, '_> {
    fn text(self, text: &str) -> Result<(), Error> {
        write_string(self.w.out, text);
        self.w.names.push_str(text);
        Ok(())
    }

    /// A number key: its canonical form, quoted.
    fn number(self, write: impl FnOnce(&mut Writer<'_>) -> Result<(), Error>) -> Result<(), Error> {
        let at = self.w.out.len();
        write(self.w)?;
        let text = std::str::from_utf8(&self.w.out[at..])
            .map_err(Error::custom)?
            .to_owned();
        self.w.out.truncate(at);
        self.text(&text)
    }
}

fn key_must_be_a_string() -> Error {
    Error::custom("key must be a string")
}

macro_rules! number_keys {
    ($($method:ident: $ty:ty),*) => {$(
        fn $method(self, v: $ty) -> Result<(), Error> {
            self.number(|w| ser::Serializer::$method(w, v))
        }
    )*};
}

macro_rules! refused_keys {
    ($($method:ident $(: $ty:ty)?),*) => {$(
        fn $method(self $(, _: $ty)?) -> Result<(), Error> {
            Err(key_must_be_a_string())
        }
    )*};
}

impl ser::Serializer for Name<'_, '_> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = ser::Impossible<(), Error>;
    type SerializeTuple = ser::Impossible<(), Error>;
    type SerializeTupleStruct = ser::Impossible<(), Error>;
    type SerializeTupleVariant = ser::Impossible<(), Error>;
    type SerializeMap = ser::Impossible<(), Error>;
    type SerializeStruct = ser::Impossible<(), Error>;
    type SerializeStructVariant = ser::Impossible<(), Error>;

    fn serialize_str(self, v: &str) -> Result<(), Error> {
        self.text(v)
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        self.text(v.encode_utf8(&mut [0; 4]))
    }
    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.text(if v { "true" } else { "false" })
    }
    number_keys!(serialize_i8: i8, serialize_i16: i16, serialize_i32: i32, serialize_i64: i64,
        serialize_i128: i128, serialize_u8: u8, serialize_u16: u16, serialize_u32: u32,
        serialize_u64: u64, serialize_u128: u128, serialize_f32: f32, serialize_f64: f64);
    fn serialize_unit_variant(self, _: &'static str, _: u32, v: &'static str) -> Result<(), Error> {
        self.text(v)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        v: &T,
    ) -> Result<(), Error> {
        v.serialize(self)
    }
    refused_keys!(serialize_bytes: &[u8], serialize_none, serialize_unit,
        serialize_unit_struct: &'static str);
    /// As serde_json: `Some(k)` is the key `k` (`None` is refused).
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> Result<(), Error> {
        v.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeStruct, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Error> {
        Err(key_must_be_a_string())
    }
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
