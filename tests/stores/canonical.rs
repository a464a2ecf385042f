//! Keys from content and fingerprints against another implementation of
//! RFC 8785: Python's `rfc8785` package (`pip install rfc8785`; the test
//! command installs it). A producer in Python that computes
//! `sha256(rfc8785.dumps(payload)).hexdigest()` must get the id that
//! `IdempotencyKey::from_content` gives the same payload here.

use std::io::Write;
use std::process::{Command, Stdio};

use idemkit::{canonical_json, Fingerprint, IdempotencyKey};
use serde::Serialize;
use serde_json::{json, Value};

/// Reads one JSON text per line; answers one JSON line each: the RFC 8785
/// form and its SHA-256, or the error's class name.
const PYTHON: &str = r#"
import hashlib, json, sys
import rfc8785
for line in sys.stdin:
    try:
        form = rfc8785.dumps(json.loads(line))
        out = {"form": form.decode("utf-8"), "sha256": hashlib.sha256(form).hexdigest()}
    except Exception as e:
        out = {"error": type(e).__name__}
    print(json.dumps(out), flush=True)
"#;

const HOW_TO: &str = "this test needs python3 with the rfc8785 package: \
                      `python3 -m pip install rfc8785` (scripts/test installs it)";

/// Python's answers for `texts`, one per text.
fn python(texts: &[String]) -> Vec<Value> {
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(PYTHON)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run python3: {e}. {HOW_TO}"));
    let mut input = String::new();
    for text in texts {
        assert!(!text.contains('\n'), "one line per text: {text}");
        input.push_str(text);
        input.push('\n');
    }
    let mut stdin = child.stdin.take().unwrap_or_else(|| panic!("no stdin"));
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("python3 failed: {e}"));
    let written = writer.join().map_err(|_| "writer panicked");
    assert!(
        out.status.success(),
        "python3 failed: {}. {HOW_TO}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(matches!(written, Ok(Ok(()))), "{written:?}");
    let answers: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(answers.len(), texts.len());
    answers
}

#[derive(Serialize)]
struct Order {
    customer: String,
    amount: f64,
    quantity: u32,
    lines: Vec<Line>,
    note: Option<String>,
    #[serde(rename = "€uro")]
    euro: bool,
}

#[derive(Serialize)]
struct Line {
    sku: &'static str,
    price: f64,
    id: u64,
}

/// Payloads as a producer would send them: Rust values, and JSON texts.
fn payloads() -> Vec<(String, Value)> {
    let order = Order {
        customer: "Zoë \"Z\" Ångström\t😀".to_owned(),
        amount: 100.0,
        quantity: 3,
        lines: vec![
            Line {
                sku: "sku-9",
                price: 33.333333333333336,
                id: 9_007_199_254_740_991,
            },
            Line {
                sku: "sku-\u{1}",
                price: 1e-7,
                id: 0,
            },
        ],
        note: None,
        euro: true,
    };
    let mut out: Vec<(String, Value)> = vec![(
        serde_json::to_string(&order).unwrap_or_default(),
        serde_json::to_value(&order).unwrap_or_default(),
    )];
    let texts = [
        r#"{"to": "a@b.c", "tpl": "welcome"}"#,
        r#"{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001], "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/", "literals": [null, true, false]}"#,
        r#"{"\u20ac": "Euro Sign", "\r": "Carriage Return", "\ufb33": "Hebrew Letter Dalet With Dagesh", "1": "One", "\ud83d\ude00": "Emoji: Grinning Face", "\u0080": "Control", "\u00f6": "Latin Small Letter O With Diaeresis", "\u0435\u0442": "Cyrillic"}"#,
        r#"[1e21, 1e-7, -0, -0.0, 333333333.33333329, 4.50, 2e-3, 0.000001, 1.0, 5e-324, 1.7976931348623157e308, 9007199254740991, -9007199254740991]"#,
        r#"{"b": {"z": [], "y": {}, "x": [{"k": "v", "K": "V"}]}, "a": "\u2028\u007f/"}"#,
        r#""just a string""#,
        r#"{"amount": 1e20, "tiny": -1e-300, "id": 12345678}"#,
    ];
    for text in texts {
        let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        out.push((text.to_owned(), value));
    }
    out
}

#[test]
fn keys_from_content_match_python_rfc8785() {
    let payloads = payloads();
    let texts: Vec<String> = payloads.iter().map(|(t, _)| t.clone()).collect();
    let answers = python(&texts);
    for ((text, value), answer) in payloads.iter().zip(&answers) {
        let form = canonical_json(value).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(
            Some(String::from_utf8_lossy(&form).as_ref()),
            answer["form"].as_str(),
            "{text}"
        );
        let key = IdempotencyKey::from_content("orders.create", value)
            .unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(Some(key.id()), answer["sha256"].as_str(), "{text}");
        let fingerprint = Fingerprint::of(value).map(|f| f.to_hex()).ok();
        assert_eq!(fingerprint.as_deref(), answer["sha256"].as_str(), "{text}");
    }
}

/// A Rust struct and the JSON text another producer sends for it get one
/// key, whatever the field order.
#[test]
fn a_struct_and_its_json_text_from_python_share_a_key() {
    let payload = payloads().remove(0);
    let text = json!({"quantity": 3, "€uro": true, "note": null, "lines": [
        {"price": 33.333333333333336, "id": 9007199254740991u64, "sku": "sku-9"},
        {"id": 0, "sku": "sku-\u{1}", "price": 1e-7}
    ], "amount": 100, "customer": "Zoë \"Z\" Ångström\t😀"})
    .to_string();
    let answer = python(&[text]).remove(0);
    let key = IdempotencyKey::from_content("orders.create", &payload.1).ok();
    assert_eq!(key.as_ref().map(|k| k.id()), answer["sha256"].as_str());
}

/// Random doubles (any bit pattern but NaN and the infinities) are
/// written in ECMAScript form exactly as Python's implementation writes
/// them.
#[test]
fn random_doubles_match_python_rfc8785() {
    let mut rng = fastrand::Rng::with_seed(8785);
    let mut doubles: Vec<f64> = Vec::new();
    while doubles.len() < 5000 {
        let d = match doubles.len() % 3 {
            0 => f64::from_bits(rng.u64(..)),
            1 => rng.f64() * 10f64.powi(rng.i32(-30..30)),
            _ => (rng.i64(-(1 << 60)..1 << 60) as f64) / 10f64.powi(rng.i32(0..8)),
        };
        if d.is_finite() {
            doubles.push(d);
        }
    }
    let texts: Vec<String> = doubles
        .iter()
        .map(|d| serde_json::to_string(d).unwrap_or_default())
        .collect();
    let answers = python(&texts);
    for ((d, text), answer) in doubles.iter().zip(&texts).zip(&answers) {
        let ours = canonical_json(d).map(|b| String::from_utf8_lossy(&b).into_owned());
        assert_eq!(
            ours.ok().as_deref(),
            answer["form"].as_str(),
            "{text} ({:#x})",
            d.to_bits()
        );
    }
}

/// What both refuse: numbers JSON has no exact form for. Python refuses
/// every `int` beyond ±(2^53 - 1); here an integer is refused unless its
/// digits are its canonical form, so these agree.
#[test]
fn both_refuse_integers_that_would_collide() {
    let texts: Vec<String> = [
        "9223372036854775809",
        "9007199254740993",
        "-9007199254740993",
        "18446744073709551615",
    ]
    .iter()
    .map(|t| format!("{{\"id\":{t}}}"))
    .collect();
    let answers = python(&texts);
    for (text, answer) in texts.iter().zip(&answers) {
        assert!(
            answer["error"].is_string(),
            "python accepted {text}: {answer}"
        );
        let value: Value = serde_json::from_str(text).unwrap_or_default();
        assert!(IdempotencyKey::from_content("s", &value).is_err(), "{text}");
    }
}
