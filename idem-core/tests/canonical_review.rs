//! Review of fe0a77f (idem's own RFC 8785 writer): probes against the
//! `serde_json_canonicalizer` crate, Python's `rfc8785`, and the writer's
//! own promises (never a panic, never two values with one form).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::{Command, Stdio};

use idem_core::canonical_json;
use serde::ser::{Serialize, SerializeMap, SerializeStruct, Serializer};
use serde::Serialize as DeriveSerialize;

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
        print(rfc8785.dumps(v).decode("utf-8").encode("unicode_escape").decode("ascii"))
    except Exception as e:
        print("ERR " + type(e).__name__)
"#;
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    {
        let mut stdin = child.stdin.take().expect("stdin");
        for e in exprs {
            writeln!(stdin, "{e}").expect("write");
        }
    }
    let out = child.wait_with_output().expect("python3 output");
    String::from_utf8(out.stdout)
        .expect("utf8")
        .lines()
        .map(|l| l.to_owned())
        .collect()
}

/// A Rust string as Python's `unicode_escape` writes it back (for
/// comparing with `python`).
fn py_escaped(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || (0x7f..0x100).contains(&(c as u32)) => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c if (c as u32) < 0x7f => out.push(c),
            c if (c as u32) < 0x10000 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push_str(&format!("\\U{:08x}", c as u32)),
        }
    }
    out
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
        let inner = serde_json::json!({"z": 1, "y": f64::NAN.to_string()});
        let _ = m.serialize_entry("c", &BadInner);
        let _ = inner;
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

#[test]
fn explore() {
    macro_rules! cmp {
        ($e:expr) => {{
            let v = $e;
            let (o, t) = (ours(&v), theirs(&v));
            println!("{} {}\n  ours:   {:?}\n  theirs: {:?}", if o == t { "SAME" } else { "DIFF" }, stringify!($e), o, t);
        }};
    }
    cmp!(DanglingKey(vec![("b", 1), ("a", 2)], "c"));
    cmp!(DanglingKey(vec![("a", 1), ("b", 2)], "c"));
    cmp!(Swallow);
    cmp!(vec![E::U, E::N(1), E::T(1, "x".into()), E::S { z: 1, a: 2 }]);
    cmp!(BTreeMap::from([("k", E::S { z: 1, a: 2 }), ("a", E::T(2, "y".into()))]));
    cmp!(Flat { b: 1, rest: BTreeMap::from([("c".into(), 3), ("0".into(), 0)]), a: None, e: E::S { z: 1, a: 2 } });
    cmp!(Flat { b: 1, rest: BTreeMap::from([("c".into(), 3)]), a: Some(5), e: E::T(1, "t".into()) });
    cmp!(Flat { b: 1, rest: BTreeMap::new(), a: Some(5), e: E::N(7) });
    cmp!(Flat { b: 1, rest: BTreeMap::from([("a".into(), 3)]), a: Some(5), e: E::N(7) });
    cmp!(Tagged::V { z: 1, a: 2 });
    cmp!(Tagged::W(BTreeMap::from([("b".into(), 1), ("a".into(), 2)])));
    cmp!(BTreeMap::from([(1.5f64.to_bits(), 1)]));
    cmp!(vec![(1i128 << 100), i128::MIN, i128::MAX]);
    cmp!(vec![u128::MAX]);
    cmp!(i128::MIN);
    cmp!(-0.0f64);
    cmp!(vec![f32::MIN_POSITIVE, f32::MAX, 1e-45f32, 16777217f32, 0.3f32]);
    cmp!(vec![f64::MIN_POSITIVE, 2.2250738585072009e-308, 5e-324, 1e-7, 1e21, 1e20, 123456789012345680000.0]);
    cmp!(BTreeMap::from([('\u{e000}', 1), ('\u{10000}', 2), ('\u{ffff}', 3), ('\u{d7ff}', 4)]));
    cmp!(BTreeMap::from([("a\"", 1), ("a\\", 2), ("a\u{1}", 3), ("a", 4), ("a\u{7f}", 5), ("a\u{1f}", 6)]));
    cmp!(BTreeMap::from([(true, 1), (false, 2)]));
    cmp!(BTreeMap::from([(E2::B, 1), (E2::A, 2)]));
    cmp!(BTreeMap::from([(NT(2), 1), (NT(10), 2)]));
    cmp!(BTreeMap::from([(-1i8, 1), (-2, 2), (10, 3)]));
    cmp!(BTreeMap::from([((), 1)]));
    cmp!(BTreeMap::from([(Some(1), 1)]));
    cmp!(BTreeMap::from([(U, 1)]));
    cmp!(BTreeMap::from([("x", BTreeMap::<String, i32>::new())]));
    cmp!(vec![BTreeMap::<String, i32>::new(), BTreeMap::new()]);
    cmp!(serde_json::json!({"b": {"d": {"f": 1, "e": 2}, "c": [ {"y":1,"x":2}, {} ]}, "a": {}}));
    cmp!(serde_json::json!({"\u{10000}": 1, "\u{ffff}": 2, "\u{e000}": 3, "\u{fb33}": 4}));
    cmp!("x".repeat(1 << 20));
    cmp!(BTreeMap::from([("y".repeat(1 << 20), 1), ("x".repeat(1<<20), 2)]));
    cmp!(b"bytes".as_slice());
    cmp!(serde_bytes_like(b"ab"));
    cmp!(Some(()));
    cmp!(((), U, NT(3)));
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
        doubles.push(((rng.next() >> (rng.next() % 40)) as f64) * 2f64.powi((rng.next() % 20) as i32));
    }
    for p in 0..=400 {
        doubles.push(10f64.powi(p - 330));
        doubles.push(f64::from_bits(10f64.powi(p - 330).to_bits().wrapping_add(1)));
        doubles.push(f64::from_bits(10f64.powi(p - 330).to_bits().wrapping_sub(1)));
    }
    doubles.retain(|d| d.is_finite());
    let exprs: Vec<String> = doubles
        .iter()
        .map(|d| format!("__import__('struct').unpack('<d', ({}).to_bytes(8, 'little'))[0]", d.to_bits()))
        .collect();
    let want = python(&exprs);
    assert_eq!(want.len(), doubles.len());
    let mut bad = Vec::new();
    for (d, want) in doubles.iter().zip(&want) {
        let got = ours(d).unwrap_or_else(|e| e);
        if &got != want {
            bad.push(format!("{:#018x} ({d:e}): idem {got}, python {want}", d.to_bits()));
        }
    }
    assert!(bad.is_empty(), "{} of {} differ: {:#?}", bad.len(), doubles.len(), &bad[..bad.len().min(20)]);
}
