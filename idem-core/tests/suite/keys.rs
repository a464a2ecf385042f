//! Property tests of keys, canonical JSON and fingerprints: the field order
//! of objects (at every depth) never changes a key or a fingerprint; any
//! other change of the content does; canonical JSON keeps the value; key
//! validation never panics and accepts exactly the documented alphabet.

use idem_core::{canonical_json, Fingerprint, IdempotencyKey};
use proptest::prelude::*;
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};
use serde_json::Value;

/// A JSON tree whose objects serialize their fields in the order given, so
/// that the same content can be written in different field orders.
#[derive(Debug, Clone)]
enum Node {
    Scalar(Value),
    Array(Vec<Node>),
    Object(Vec<(String, Node)>),
}

impl Serialize for Node {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Node::Scalar(v) => v.serialize(s),
            Node::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Node::Object(fields) => {
                let mut map = s.serialize_map(Some(fields.len()))?;
                for (k, v) in fields {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

impl Node {
    /// The same content with every object's fields reordered by `seed`.
    fn reordered(&self, seed: u64) -> Node {
        match self {
            Node::Scalar(v) => Node::Scalar(v.clone()),
            Node::Array(items) => Node::Array(items.iter().map(|n| n.reordered(seed)).collect()),
            Node::Object(fields) => {
                let mut fields: Vec<_> = fields
                    .iter()
                    .map(|(k, v)| (k.clone(), v.reordered(seed)))
                    .collect();
                let mut rng = fastrand::Rng::with_seed(seed ^ fields.len() as u64);
                rng.shuffle(&mut fields);
                Node::Object(fields)
            }
        }
    }

    fn to_value(&self) -> Value {
        match self {
            Node::Scalar(v) => v.clone(),
            Node::Array(items) => Value::Array(items.iter().map(Node::to_value).collect()),
            Node::Object(fields) => Value::Object(
                fields
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_value()))
                    .collect(),
            ),
        }
    }
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        // integers RFC 8785 writes exactly (as doubles): up to 2^53 - 1,
        // and the larger ones whose digits are a double's shortest form
        // (others are refused: tests/canonical_properties.rs)
        (-(1i64 << 53) + 1..1i64 << 53).prop_map(Value::from),
        any::<i32>().prop_map(Value::from),
        (-1e19f64..1.8e19).prop_map(|f| {
            let digits = format!("{}", f.trunc());
            serde_json::from_str::<Value>(&digits).unwrap_or(Value::Null)
        }),
        // finite floats only: JSON has no NaN or infinity
        (-1e300f64..1e300).prop_map(Value::from),
        // any unicode, escapes and control characters included
        any::<String>().prop_map(Value::String),
    ]
}

/// `v` with every number as a double.
fn as_doubles(v: Value) -> Value {
    match v {
        Value::Number(n) => n.as_f64().map(Value::from).unwrap_or(Value::Null),
        Value::Array(items) => Value::Array(items.into_iter().map(as_doubles).collect()),
        Value::Object(map) => {
            Value::Object(map.into_iter().map(|(k, v)| (k, as_doubles(v))).collect())
        }
        other => other,
    }
}

fn node() -> impl Strategy<Value = Node> {
    scalar()
        .prop_map(Node::Scalar)
        .prop_recursive(4, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Node::Array),
                // unique field names (a JSON object has each name once)
                prop::collection::btree_map(any::<String>(), inner, 0..6)
                    .prop_map(|m| Node::Object(m.into_iter().collect())),
            ]
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn field_order_never_changes_keys_or_fingerprints(n in node(), seed in any::<u64>()) {
        let other = n.reordered(seed);
        prop_assert_eq!(canonical_json(&n).ok(), canonical_json(&other).ok());
        prop_assert_eq!(Fingerprint::of(&n).ok(), Fingerprint::of(&other).ok());
        prop_assert_eq!(
            IdempotencyKey::from_content("orders.create", &n).ok(),
            IdempotencyKey::from_content("orders.create", &other).ok()
        );
    }

    /// Canonical JSON reads back as the same value as serde_json's own
    /// output, numbers compared as the doubles RFC 8785 makes of them
    /// (`100.0` is written `100`).
    #[test]
    fn canonical_json_keeps_the_value(n in node()) {
        let fail = |e: serde_json::Error| TestCaseError::fail(e.to_string());
        let canonical: Value = serde_json::from_slice(&canonical_json(&n).map_err(fail)?).map_err(fail)?;
        let plain: Value = serde_json::from_slice(&serde_json::to_vec(&n).map_err(fail)?).map_err(fail)?;
        prop_assert_eq!(as_doubles(canonical), as_doubles(plain));
    }

    /// Fingerprints differ exactly when the values differ as JSON values
    /// whose numbers are doubles (RFC 8785's model: `1` and `1.0` are one
    /// number).
    #[test]
    fn different_content_gives_different_fingerprints(a in node(), b in node()) {
        let (va, vb) = (as_doubles(a.to_value()), as_doubles(b.to_value()));
        let (fa, fb) = (Fingerprint::of(&a).ok(), Fingerprint::of(&b).ok());
        prop_assert!(fa.is_some() && fb.is_some());
        prop_assert_eq!(va == vb, fa == fb, "{} vs {}", va, vb);
    }

    #[test]
    fn key_validation_accepts_exactly_the_documented_alphabet(scope in ".{0,70}", id in any::<String>()) {
        let scope_ok = (1..=64).contains(&scope.len())
            && scope.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
        let id_ok = (1..=512).contains(&id.len()) && !id.chars().any(char::is_control);
        prop_assert_eq!(IdempotencyKey::new(scope.clone(), id.clone()).is_ok(), scope_ok && id_ok);
    }

    #[test]
    fn keys_from_arbitrary_bytes_never_panic(id in prop::collection::vec(any::<u8>(), 0..600)) {
        let key = IdempotencyKey::from_utf8("bytes.id", &id);
        let valid = std::str::from_utf8(&id)
            .map(|s| (1..=512).contains(&s.len()) && !s.chars().any(char::is_control))
            .unwrap_or(false);
        prop_assert_eq!(key.is_ok(), valid);
    }

    #[test]
    fn composite_keys_are_unambiguous(
        a in prop::collection::vec("[a-z/%]{0,4}", 1..4),
        b in prop::collection::vec("[a-z/%]{0,4}", 1..4),
    ) {
        let (ka, kb) = (
            IdempotencyKey::composite("inventory.reserve", &a),
            IdempotencyKey::composite("inventory.reserve", &b),
        );
        if let (Ok(ka), Ok(kb)) = (ka, kb) {
            prop_assert_eq!(a == b, ka == kb);
        }
    }
}
