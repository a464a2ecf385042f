//! Property tests of the canonical JSON (RFC 8785) behind keys from
//! content and fingerprints: whitespace and member order never change the
//! bytes, the form is a fixed point, and two integers never share a key
//! (member order alone: tests/properties.rs).

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};

use idem_core::{canonical_json, IdempotencyKey};
use proptest::prelude::*;
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

/// A JSON value whose objects keep their members in a chosen order.
#[derive(Debug, Clone)]
enum Node {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Arr(Vec<Node>),
    Obj(BTreeMap<String, Node>),
}

/// `node` with every object's members written in an order drawn from
/// `seed` (a different order at every depth).
struct Ordered<'a>(&'a Node, u64);

fn rank(seed: u64, name: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (seed, name).hash(&mut h);
    h.finish()
}

impl Serialize for Ordered<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let Ordered(node, seed) = *self;
        match node {
            Node::Null => s.serialize_unit(),
            Node::Bool(b) => s.serialize_bool(*b),
            Node::Int(i) => s.serialize_i64(*i),
            Node::Float(f) => s.serialize_f64(*f),
            Node::Str(v) => s.serialize_str(v),
            Node::Arr(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(&Ordered(item, seed))?;
                }
                seq.end()
            }
            Node::Obj(members) => {
                let mut order: Vec<(&String, &Node)> = members.iter().collect();
                order.sort_by_key(|(name, _)| rank(seed, name));
                let mut map = s.serialize_map(Some(order.len()))?;
                for (name, value) in order {
                    map.serialize_entry(name, &Ordered(value, seed))?;
                }
                map.end()
            }
        }
    }
}

const MAX_SAFE: i64 = (1 << 53) - 1;

fn node() -> impl Strategy<Value = Node> {
    let leaf = prop_oneof![
        Just(Node::Null),
        any::<bool>().prop_map(Node::Bool),
        (-MAX_SAFE..=MAX_SAFE).prop_map(Node::Int),
        any::<i32>().prop_map(|i| Node::Int(i64::from(i))),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Node::Float),
        (-1e6f64..1e6).prop_map(Node::Float),
        any::<String>().prop_map(Node::Str),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Node::Arr),
            prop::collection::btree_map(any::<String>(), inner, 0..6).prop_map(Node::Obj),
        ]
    })
}

fn canon<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    canonical_json(value).unwrap_or_else(|e| panic!("not canonicalized: {e}"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The same value written as text with whitespace (pretty printed,
    /// members in another order) and read back canonicalizes alike; the
    /// canonical text read back is a fixed point.
    #[test]
    fn whitespace_never_changes_the_result_and_the_form_is_a_fixed_point(n in node(), seed in any::<u64>()) {
        let want = canon(&Ordered(&n, 0));
        let pretty = serde_json::to_string_pretty(&Ordered(&n, seed))
            .unwrap_or_else(|e| panic!("{e}"));
        let read: serde_json::Value = serde_json::from_str(&pretty).unwrap_or_else(|e| panic!("{e}"));
        prop_assert_eq!(&canon(&read), &want);
        let again: serde_json::Value = serde_json::from_slice(&want).unwrap_or_else(|e| panic!("{e}"));
        prop_assert_eq!(&canon(&again), &want);
        prop_assert!(has_whitespace_only_in_strings(&want));
    }

    /// Two different integers never share a key: up to 2^53 both are
    /// accepted and differ; beyond, one whose canonical form is not its
    /// own digits is refused rather than written as another's.
    #[test]
    fn different_integers_never_share_a_key(
        a in prop_oneof![any::<u64>(), 0..1u64 << 54, (1u64 << 53) - 4..(1u64 << 53) + 4],
        b in prop_oneof![any::<u64>(), 0..1u64 << 54, (1u64 << 53) - 4..(1u64 << 53) + 4],
        digits in 54..=63u32,
    ) {
        // Also what a double-based producer writes near 2^digits (its own
        // digits), and the integers next to it.
        let js = ((1u64 << digits) as f64).to_string().parse::<u64>().unwrap_or(0);
        for (x, y) in [(a, b), (a, a.wrapping_add(1)), (js, js + 1), (js, js - 1), (js, 1 << digits)] {
            if x == y {
                continue;
            }
            let kx = IdempotencyKey::from_content("s", &serde_json::json!({"id": x}));
            let ky = IdempotencyKey::from_content("s", &serde_json::json!({"id": y}));
            match (kx, ky) {
                (Ok(kx), Ok(ky)) => prop_assert_ne!(kx, ky, "{} {}", x, y),
                (kx, ky) => prop_assert!(
                    x > 1 << 53 || y > 1 << 53,
                    "{} {} {:?} {:?}", x, y, kx, ky
                ),
            }
        }
        let kjs = IdempotencyKey::from_content("s", &serde_json::json!({"id": js}));
        prop_assert!(kjs.is_ok(), "{} is what JavaScript writes", js);
    }
}

/// Whether every whitespace byte of canonical `json` is inside a string.
fn has_whitespace_only_in_strings(json: &[u8]) -> bool {
    let (mut in_string, mut escaped) = (false, false);
    for &b in json {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
        } else if b == b'"' {
            in_string = true;
        } else if matches!(b, b' ' | b'\n' | b'\t' | b'\r') {
            return false;
        }
    }
    true
}
