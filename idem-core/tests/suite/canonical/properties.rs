//! Property tests of the canonical JSON (RFC 8785) behind keys from
//! content and fingerprints: whitespace and member order never change the
//! bytes, the form is a fixed point, and two integers never share a key
//! (member order alone: tests/properties.rs).

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};

use idem_core::{canonical_json, IdempotencyKey};
use proptest::prelude::*;
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use serde::Serialize as DeriveSerialize;

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

/// Any key type serde_json accepts, and the shapes a derive writes:
/// variants of every kind, tuples, bytes, options, chars, u128 and
/// integer map keys.
#[derive(Debug, Clone, DeriveSerialize)]
enum Shape {
    Unit,
    Newtype(i64),
    Tuple(u8, String, Option<bool>),
    Struct {
        z: f64,
        a: Vec<Shape>,
        mid: char,
    },
    Bytes(#[serde(with = "serde_bytes_as_seq")] Vec<u8>),
    Keys(
        BTreeMap<u32, String>,
        BTreeMap<bool, i8>,
        BTreeMap<char, ()>,
    ),
    Wide(u128, i128, f32),
}

mod serde_bytes_as_seq {
    pub(crate) fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }
}

fn shape() -> impl Strategy<Value = Shape> {
    let leaf = prop_oneof![
        Just(Shape::Unit),
        any::<i32>().prop_map(|i| Shape::Newtype(i64::from(i))),
        (any::<u8>(), any::<String>(), any::<Option<bool>>())
            .prop_map(|(a, b, c)| Shape::Tuple(a, b, c)),
        prop::collection::vec(any::<u8>(), 0..8).prop_map(Shape::Bytes),
        (
            prop::collection::btree_map(any::<u32>(), any::<String>(), 0..4),
            prop::collection::btree_map(any::<bool>(), any::<i8>(), 0..2),
            prop::collection::btree_map(any::<char>(), Just(()), 0..3),
        )
            .prop_map(|(a, b, c)| Shape::Keys(a, b, c)),
        (
            0..1u128 << 53,
            -(1i128 << 53) + 1..1i128 << 53,
            any::<f32>().prop_filter("finite", |f| f.is_finite())
        )
            .prop_map(|(a, b, c)| Shape::Wide(a, b, c)),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        (
            any::<f64>().prop_filter("finite", |f| f.is_finite()),
            prop::collection::vec(inner, 0..4),
            any::<char>(),
        )
            .prop_map(|(z, a, mid)| Shape::Struct { z, a, mid })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// idem's single-pass writer gives the bytes of the
    /// `serde_json_canonicalizer` crate (an independent RFC 8785 writer)
    /// for any value either accepts, members in any order.
    #[test]
    fn the_writer_agrees_with_an_independent_jcs_implementation(n in node(), seed in any::<u64>(), s in shape()) {
        let theirs = serde_json_canonicalizer::to_vec(&Ordered(&n, seed)).unwrap_or_else(|e| panic!("{e}"));
        let ours = canon(&Ordered(&n, seed));
        prop_assert_eq!(String::from_utf8_lossy(&ours), String::from_utf8_lossy(&theirs));
        let theirs = serde_json_canonicalizer::to_vec(&s).unwrap_or_else(|e| panic!("{e}"));
        let ours = canon(&s);
        prop_assert_eq!(String::from_utf8_lossy(&ours), String::from_utf8_lossy(&theirs));
    }

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

/// A value nested `depth` arrays deep, built without a `serde_json::Value`
/// (whose own drop would recurse as deep).
struct Deep(usize);

impl Serialize for Deep {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(1))?;
        if self.0 > 1 {
            seq.serialize_element(&Deep(self.0 - 1))?;
        }
        seq.end()
    }
}

/// A payload nested far deeper than any parser allows is refused with an
/// error, never a stack overflow (which aborts the process); 256 levels
/// are fine.
#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let ok = canon(&Deep(256));
    assert_eq!(ok.len(), 512);
    let refused = std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(|| canonical_json(&Deep(1_000_000)).map_err(|e| e.to_string()))
        .unwrap_or_else(|e| panic!("{e}"))
        .join()
        .unwrap_or_else(|_| panic!("panicked"));
    assert!(
        matches!(&refused, Err(e) if e.contains("deeper than 256")),
        "{refused:?}"
    );
    assert!(canonical_json(&Deep(257)).is_err());
    assert!(IdempotencyKey::from_content("orders.create", &Deep(100_000)).is_err());
}
