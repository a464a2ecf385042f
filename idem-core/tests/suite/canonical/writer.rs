//! Adversarial probes of idem's own RFC 8785 writer: probes against
//! the `serde_json_canonicalizer` crate, Python's `rfc8785` (the test
//! command installs it: `python3 -m pip install rfc8785`), and the
//! writer's own promises (never a panic, never two values with one form).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::{Command, Stdio};

use idem_core::canonical_json;
use serde::ser::{Serialize, SerializeMap, SerializeStruct, Serializer};
use serde::Serialize as DeriveSerialize;
use serde_json::Value;

fn ours<T: Serialize + ?Sized>(v: &T) -> Result<String, String> {
    match catch_unwind(AssertUnwindSafe(|| canonical_json(v))) {
        Ok(Ok(b)) => Ok(String::from_utf8(b).map_err(|e| format!("not UTF-8: {e}"))?),
        Ok(Err(e)) => Err(format!("error: {e}")),
        Err(p) => Err(format!(
            "PANIC: {}",
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default()
        )),
    }
}

fn theirs<T: Serialize>(v: &T) -> Result<String, String> {
    serde_json_canonicalizer::to_string(v).map_err(|e| format!("error: {e}"))
}

/// Python's `rfc8785.dumps` of each line's Python expression.
fn python(exprs: &[String]) -> Vec<String> {
    let script = r#"
import sys, rfc8785, struct
for line in sys.stdin:
    line = line.rstrip("\n")
    try:
        v = eval(line)
        print(rfc8785.dumps(v).hex())
    except Exception as e:
        print("ERR " + type(e).__name__)
"#;
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 with the rfc8785 package (scripts/test installs it: python3 -m pip install rfc8785)");
    let mut stdin = child.stdin.take().expect("stdin");
    let input: String = exprs.iter().map(|e| format!("{e}\n")).collect();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().expect("python3 output");
    writer.join().expect("writer").expect("write");
    String::from_utf8(out.stdout)
        .expect("utf8")
        .lines()
        .map(|l| {
            if l.starts_with("ERR") {
                return l.to_owned();
            }
            let bytes: Vec<u8> = (0..l.len() / 2)
                .map(|i| u8::from_str_radix(&l[2 * i..2 * i + 2], 16).unwrap_or(b'?'))
                .collect();
            String::from_utf8(bytes).unwrap_or_else(|e| format!("ERR utf8 {e}"))
        })
        .collect()
}

/// A map written in the given order, with a key then no value at the
/// end (a `Serialize` that breaks the protocol).
struct DanglingKey(Vec<(&'static str, i32)>, &'static str);
impl Serialize for DanglingKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.serialize_key(self.1)?;
        m.end()
    }
}

/// A map that ignores the error of one entry (a `Serialize` that
/// swallows errors, e.g. "best effort" logging wrappers).
struct Swallow;
impl Serialize for Swallow {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("b", &1)?;
        let _ = m.serialize_entry("c", &BadInner);
        m.serialize_entry("a", &2)?;
        m.end()
    }
}
struct BadInner;
impl Serialize for BadInner {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("z", &1)?;
        m.serialize_entry("y", &f64::NAN)?;
        m.end()
    }
}

#[derive(DeriveSerialize)]
enum E {
    U,
    N(i32),
    T(i32, String),
    S { z: i32, a: i32 },
}

#[derive(DeriveSerialize)]
struct Flat {
    b: i32,
    #[serde(flatten)]
    rest: BTreeMap<String, i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    a: Option<i32>,
    #[serde(flatten)]
    e: E,
}

#[derive(DeriveSerialize)]
#[serde(tag = "type")]
enum Tagged {
    V { z: i32, a: i32 },
    W(BTreeMap<String, i32>),
}

/// Shapes that held: idem's bytes are the crate's (struct, tuple,
/// newtype and unit variants, in maps; flatten of maps and enums;
/// skip_serializing_if; internally tagged enums; keys that are bools,
/// negative integers, newtypes, unit variants, chars around the surrogate
/// range; names with escapes; empty objects; objects nested in unsorted
/// objects; -0.0; f32 and subnormal values; 1 MiB strings and names).
#[test]
#[allow(clippy::excessive_precision)] // the largest subnormal, as written
fn shapes_that_agree_with_the_crate() {
    let mut diffs = Vec::new();
    macro_rules! same {
        ($($e:expr),* $(,)?) => {$({
            let v = $e;
            let (o, t) = (ours(&v), theirs(&v));
            if o != t {
                diffs.push(format!("{}\n  idem:  {:.200?}\n  crate: {:.200?}", stringify!($e), o, t));
            }
        })*};
    }
    same!(
        vec![E::U, E::N(1), E::T(1, "x".into()), E::S { z: 1, a: 2 }],
        BTreeMap::from([("k", E::S { z: 1, a: 2 }), ("a", E::T(2, "y".into()))]),
        Flat {
            b: 1,
            rest: BTreeMap::from([("c".into(), 3), ("0".into(), 0)]),
            a: None,
            e: E::S { z: 1, a: 2 }
        },
        Flat {
            b: 1,
            rest: BTreeMap::from([("c".into(), 3)]),
            a: Some(5),
            e: E::T(1, "t".into())
        },
        Flat {
            b: 1,
            rest: BTreeMap::new(),
            a: Some(5),
            e: E::N(7)
        },
        Tagged::V { z: 1, a: 2 },
        Tagged::W(BTreeMap::from([("b".into(), 1), ("a".into(), 2)])),
        -0.0f64,
        vec![f32::MIN_POSITIVE, f32::MAX, 1e-45f32, 16777217f32, 0.3f32],
        vec![
            f64::MIN_POSITIVE,
            2.2250738585072009e-308,
            5e-324,
            1e-7,
            1e21,
            1e20,
            123456789012345680000.0
        ],
        BTreeMap::from([
            ('\u{e000}', 1),
            ('\u{10000}', 2),
            ('\u{ffff}', 3),
            ('\u{d7ff}', 4)
        ]),
        BTreeMap::from([
            ("a\"", 1),
            ("a\\", 2),
            ("a\u{1}", 3),
            ("a", 4),
            ("a\u{7f}", 5),
            ("a\u{1f}", 6)
        ]),
        BTreeMap::from([(true, 1), (false, 2)]),
        BTreeMap::from([(E2::B, 1), (E2::A, 2)]),
        BTreeMap::from([(NT(2), 1), (NT(10), 2)]),
        BTreeMap::from([(-1i8, 1), (-2, 2), (10, 3)]),
        BTreeMap::from([(1.5f64.to_bits() as f64, 1)].map(|(k, v)| (k.to_string(), v))),
        BTreeMap::from([("x", BTreeMap::<String, i32>::new())]),
        vec![BTreeMap::<String, i32>::new(), BTreeMap::new()],
        serde_json::json!({"b": {"d": {"f": 1, "e": 2}, "c": [ {"y":1,"x":2}, {} ]}, "a": {}}),
        serde_json::json!({"\u{10000}": 1, "\u{ffff}": 2, "\u{e000}": 3, "\u{fb33}": 4}),
        "x".repeat(1 << 20),
        BTreeMap::from([("y".repeat(1 << 20), 1), ("x".repeat(1 << 20), 2)]),
        b"bytes".as_slice(),
        serde_bytes_like(b"ab"),
        Some(()),
        ((), U, NT(3)),
    );
    assert!(diffs.is_empty(), "{}", diffs.join("\n"));
    // Refused by both (the messages differ).
    for r in [
        ours(&Flat {
            b: 1,
            rest: BTreeMap::from([("a".into(), 3)]),
            a: Some(5),
            e: E::N(7),
        }),
        ours(&BTreeMap::from([((), 1)])),
        ours(&BTreeMap::from([(U, 1)])),
    ] {
        assert!(r.as_ref().is_err_and(|e| !e.contains("PANIC")), "{r:?}");
    }
}

// ---------------------------------------------------------------------
// Bugs these probes found: each test below failed on fe0a77f.
// ---------------------------------------------------------------------

/// A `Serialize` that ignores the error of one map entry (here an
/// inner object holding NaN, refused mid-object) and goes on: the inner
/// object's members stay on the writer's stack, and closing the outer
/// object (out of order, so rewritten) panics in `copy_from_slice`
/// (lengths 17 vs 27). The contract: "Fails (never panics)". serde_json
/// and serde_json_canonicalizer return a value (no panic).
#[test]
fn a_serialize_that_ignores_an_error_and_goes_on_gets_an_error_never_a_panic() {
    let got = ours(&Swallow);
    // An error (idem never hashes what such a value wrote), not a panic.
    assert!(got.as_ref().is_err_and(|e| !e.contains("PANIC")), "{got:?}");
    let key = catch_unwind(|| idem_core::IdempotencyKey::from_content("orders.create", &Swallow));
    assert!(key.is_ok(), "IdempotencyKey::from_content panicked");
}

/// A map that calls `serialize_key` and then `end` without a
/// value (a buggy hand-written `Serialize`): out of order, the rewrite
/// panics (`copy_from_slice`: 11 vs 16); in order, the writer returns
/// invalid JSON `{"a":1,"b":2,"c":}` and hashes it. serde_json_canonicalizer
/// drops the dangling key; an error would be the safe answer.
#[test]
fn a_map_key_without_a_value_is_an_error_never_a_panic_or_invalid_json() {
    let unsorted = ours(&DanglingKey(vec![("b", 1), ("a", 2)], "c"));
    let sorted = ours(&DanglingKey(vec![("a", 1), ("b", 2)], "c"));
    let bad = |r: &Result<String, String>| match r {
        Err(e) => e.contains("PANIC"),
        Ok(s) => serde_json::from_str::<Value>(s).is_err(),
    };
    assert!(
        !bad(&unsorted) && !bad(&sorted),
        "unsorted: {unsorted:?}\nsorted: {sorted:?}"
    );
}

// Tried and not a regression: a `Serialize` that calls `collect_str`
// with a `Display` that returns `Err` panics in idem (serde's default
// `collect_str` calls `to_string`), but serde_json (and so the crate)
// panics too ("there should be an error", serde_json ser.rs:451), and
// such a `Display` breaks `Display`'s own contract.

/// BUG 3 (a regression, not a wrong hash). serde_json writes a map key
/// `Some(k)` as `k` (its MapKeySerializer forwards `serialize_some`), and
/// so did idem before fe0a77f (check + serde_json_canonicalizer); the new
/// `Name` serializer refuses it ("key must be a string"), so a payload
/// with `BTreeMap<Option<u32>, _>` keys that fingerprinted yesterday is
/// now refused.
#[test]
fn an_option_map_key_is_its_value_as_in_serde_json() {
    let v = BTreeMap::from([(Some(2u32), "x"), (Some(10), "y")]);
    assert_eq!(theirs(&v).as_deref(), Ok(r#"{"10":"y","2":"x"}"#));
    assert_eq!(ours(&v), theirs(&v));
}

fn serde_bytes_like(b: &'static [u8]) -> impl Serialize {
    struct B(&'static [u8]);
    impl Serialize for B {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }
    B(b)
}

#[derive(DeriveSerialize, PartialEq, Eq, PartialOrd, Ord)]
enum E2 {
    A,
    B,
}
#[derive(DeriveSerialize, PartialEq, Eq, PartialOrd, Ord)]
struct NT(i32);
#[derive(DeriveSerialize, PartialEq, Eq, PartialOrd, Ord)]
struct U;

/// A small deterministic generator (no extra dependency).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Doubles of every kind written as Python writes them (`rfc8785`, an
/// independent implementation of ECMAScript's number form).
#[test]
fn doubles_agree_with_python_rfc8785() {
    let mut rng = Lcg(7);
    let mut doubles: Vec<f64> = Vec::new();
    for _ in 0..60_000 {
        doubles.push(f64::from_bits(rng.next()));
    }
    for _ in 0..30_000 {
        // exponents around the fixed/exponent switch (1e-7, 1e21) and subnormals
        let e = (rng.next() % 60) as i32 - 30;
        let m = (rng.next() >> 11) as f64 / (1u64 << 53) as f64 + 0.5;
        doubles.push(m * 10f64.powi(e));
        doubles.push(-(m * 10f64.powi(e)));
        doubles.push(f64::from_bits(rng.next() >> 12)); // subnormal
        doubles
            .push(((rng.next() >> (rng.next() % 40)) as f64) * 2f64.powi((rng.next() % 20) as i32));
    }
    for p in 0..=400 {
        doubles.push(10f64.powi(p - 330));
        doubles.push(f64::from_bits(
            10f64.powi(p - 330).to_bits().wrapping_add(1),
        ));
        doubles.push(f64::from_bits(
            10f64.powi(p - 330).to_bits().wrapping_sub(1),
        ));
    }
    doubles.retain(|d| d.is_finite());
    let exprs: Vec<String> = doubles
        .iter()
        .map(|d| {
            format!(
                "__import__('struct').unpack('<d', ({}).to_bytes(8, 'little'))[0]",
                d.to_bits()
            )
        })
        .collect();
    let want = python(&exprs);
    assert_eq!(want.len(), doubles.len());
    let mut bad = Vec::new();
    for (d, want) in doubles.iter().zip(&want) {
        let got = ours(d).unwrap_or_else(|e| e);
        if &got != want {
            bad.push(format!(
                "{:#018x} ({d:e}): idem {got}, python {want}",
                d.to_bits()
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} differ: {:#?}",
        bad.len(),
        doubles.len(),
        &bad[..bad.len().min(20)]
    );
}

const ALPHABET: [&str; 14] = [
    "a",
    "b",
    "",
    "\u{e000}",
    "\u{ffff}",
    "\u{10000}",
    "\u{1f600}",
    "\"",
    "\\",
    "\u{1}",
    "\u{7f}",
    "\u{e9}",
    "\u{fb33}",
    "\u{d7ff}",
];

fn random_text(rng: &mut Lcg) -> String {
    let n = rng.next() % 4;
    (0..n)
        .map(|_| ALPHABET[(rng.next() % ALPHABET.len() as u64) as usize])
        .collect()
}

fn random_value(rng: &mut Lcg, depth: u32) -> Value {
    let pick = rng.next() % if depth == 0 { 6 } else { 9 };
    match pick {
        0 => Value::Null,
        1 => Value::Bool(rng.next().is_multiple_of(2)),
        2 => Value::from((rng.next() % (1 << 54)) as i64 - (1 << 53) + 1),
        3 => {
            let f = f64::from_bits(rng.next());
            if f.is_finite() {
                Value::from(f)
            } else {
                Value::from(0.5)
            }
        }
        4 | 5 => Value::String(random_text(rng)),
        6 => Value::Array(
            (0..rng.next() % 4)
                .map(|_| random_value(rng, depth - 1))
                .collect(),
        ),
        _ => Value::Object(
            (0..rng.next() % 6)
                .map(|_| (random_text(rng), random_value(rng, depth - 1)))
                .collect(),
        ),
    }
}

/// `value` with every object's members written in a shuffled order.
struct Shuffled<'a>(&'a Value, u64);
impl Serialize for Shuffled<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Value::Array(items) => {
                use serde::ser::SerializeSeq;
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(&Shuffled(
                        item,
                        self.1.wrapping_mul(31).wrapping_add(1),
                    ))?;
                }
                seq.end()
            }
            Value::Object(members) => {
                let mut order: Vec<_> = members.iter().collect();
                let mut rng = Lcg(self.1);
                for i in (1..order.len()).rev() {
                    order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
                }
                let mut m = s.serialize_map(Some(order.len()))?;
                for (k, v) in order {
                    m.serialize_entry(k, &Shuffled(v, rng.next()))?;
                }
                m.end()
            }
            other => other.serialize(s),
        }
    }
}

/// Random values (names of surrogate-adjacent characters, escapes, empty
/// names; members in any order) against both references.
#[test]
fn random_values_agree_with_python_and_the_crate() {
    let mut rng = Lcg(42);
    let values: Vec<Value> = (0..4000).map(|_| random_value(&mut rng, 4)).collect();
    let exprs: Vec<String> = values
        .iter()
        .map(|v| {
            let text = serde_json::to_string(v).unwrap_or_default();
            let hex: String = text.bytes().map(|b| format!("{b:02x}")).collect();
            format!("__import__('json').loads(bytes.fromhex('{hex}'))")
        })
        .collect();
    let py = python(&exprs);
    let mut bad = Vec::new();
    for (i, (v, want)) in values.iter().zip(&py).enumerate() {
        let got = ours(&Shuffled(v, i as u64)).unwrap_or_else(|e| e);
        let crate_ = theirs(&Shuffled(v, i as u64)).unwrap_or_else(|e| e);
        if &got != want || got != crate_ {
            bad.push(format!(
                "{v}\n idem   {got}\n python {want}\n crate  {crate_}"
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{} differ:\n{}",
        bad.len(),
        bad[..bad.len().min(5)].join("\n")
    );
}

/// serde_json's `arbitrary_precision` number, as serde_json serializes it:
/// a struct of one field, both named by its private token.
struct ApNum(&'static str);
impl Serialize for ApNum {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("$serde_json::private::Number", 1)?;
        st.serialize_field("$serde_json::private::Number", self.0)?;
        st.end()
    }
}

#[test]
fn arbitrary_precision_numbers() {
    for (text, want) in [
        ("1", Some("1")),
        ("1.0", Some("1")),
        ("1e2", Some("100")),
        ("1E+2", Some("100")),
        ("-0", Some("0")),
        ("-0.0", Some("0")),
        ("0.1", Some("0.1")),
        ("5e-324", Some("5e-324")),
        ("1e21", Some("1e+21")),
        ("9223372036854776000", Some("9223372036854776000")),
        ("9.223372036854776e18", Some("9223372036854776000")),
        ("9223372036854775808", None),
        ("9223372036854775808.0", None),
        ("9007199254740993", None),
        ("9007199254740993.0", None),
        ("0.10000000000000001", None),
        ("1e400", None),
        ("-1e-400", None),
        ("1e-400", None),
        ("0e99999999999999999999", None),
        ("1.5e-9223372036854775808", None),
        ("123456789012345678901234567890123456789012345", None),
    ] {
        let got = ours(&BTreeMap::from([("b", ApNum(text)), ("a", ApNum(text))]));
        let want = want.map(|w| format!("{{\"a\":{w},\"b\":{w}}}"));
        println!("{text:>30}: {got:?}");
        match want {
            Some(w) => assert_eq!(got.as_deref(), Ok(w.as_str()), "{text}"),
            None => assert!(
                got.as_ref().is_err_and(|e| !e.contains("PANIC")),
                "{text}: {got:?}"
            ),
        }
    }
}

/// 256 levels, the most the writer accepts, fit on a 2 MiB stack (a
/// tokio worker's) in a debug build.
#[test]
fn depth_256_fits_a_two_mib_stack() {
    #[derive(DeriveSerialize)]
    enum L {
        S { next: Box<L>, z: i32 },
        T(Box<L>, i32),
        End,
    }
    let r = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(|| {
            let mut v = Value::Null;
            for i in 0..256 {
                v = if i % 2 == 0 {
                    serde_json::json!({"b": v, "a": i})
                } else {
                    serde_json::json!([v, i])
                };
            }
            let a = ours(&v).map(|s| s.len());
            let mut l = L::End;
            for i in 0..128 {
                l = if i % 2 == 0 {
                    L::S {
                        next: Box::new(l),
                        z: 1,
                    }
                } else {
                    L::T(Box::new(l), 1)
                };
            }
            let b = ours(&l).map(|s| s.len());
            (a, b)
        })
        .expect("spawn")
        .join()
        .expect("join");
    println!("{r:?}");
    assert!(r.0.is_ok() && r.1.is_ok(), "{r:?}");
}

/// A map whose key fails (a key that is not a string) but which goes on
/// with that entry's value, then another entry.
struct ValueAfterAFailedKey;

impl Serialize for ValueAfterAFailedKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("b", &1)?;
        let _ = m.serialize_key(&[1, 2]);
        let _ = m.serialize_value(&2);
        m.serialize_entry("a", &3)?;
        m.end()
    }
}

/// An array whose element is an object left open by an ignored error.
struct OpenObjectInAnArray;

impl Serialize for OpenObjectInAnArray {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        struct Open;
        impl Serialize for Open {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut m = s.serialize_map(None)?;
                m.serialize_entry("y", &f64::NAN)?;
                m.end()
            }
        }
        let mut seq = s.serialize_seq(None)?;
        let _ = seq.serialize_element(&Open);
        seq.serialize_element(&2)?;
        seq.end()
    }
}

/// Neither leaves invalid JSON to hash, nor panics: both are errors.
#[test]
fn partial_members_and_open_objects_left_by_ignored_errors_are_errors() {
    for got in [ours(&ValueAfterAFailedKey), ours(&OpenObjectInAnArray)] {
        assert!(got.as_ref().is_err_and(|e| !e.contains("PANIC")), "{got:?}");
    }
}
