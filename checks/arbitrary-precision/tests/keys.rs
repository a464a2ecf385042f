//! Keys from content and fingerprints of a `serde_json::Value` in a build
//! where serde_json has `arbitrary_precision` (any crate of the
//! application may turn it on: features unify).
//!
//! `canonical_json` promises that an integer JCS cannot write as its own
//! digits is refused, "so two different u64/i64 never share a key". Its
//! check (`finite::Check`) sees integers through `serialize_u64` & co.
//! With `arbitrary_precision`, a `Value`'s number serializes as serde_json's
//! private number struct holding the digits as a string: the check sees a
//! string and passes it, and the JCS writer parses the digits to the
//! nearest double. `{"id": 9007199254740993}` and `{"id": 9007199254740992}`
//! (two different ids, both u64, both kept exactly by the Value) then get
//! one key: the second order is replayed the first one's result and never
//! runs. Without the feature the same program is told to send the id as a
//! string.

use idem_core::{Fingerprint, IdempotencyKey};
use serde_json::Value;

fn value(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

#[test]
fn two_different_u64_ids_in_a_value_never_share_a_key() {
    let a = value(r#"{"order_id": 9007199254740993}"#);
    let b = value(r#"{"order_id": 9007199254740992}"#);
    assert_ne!(a, b, "the Value keeps both ids exactly");
    let ka = IdempotencyKey::from_content("orders.ship", &a);
    let kb = IdempotencyKey::from_content("orders.ship", &b);
    assert!(
        ka.is_err() || ka != kb,
        "two different orders share one key from content: {ka:?}"
    );
}

#[test]
fn two_different_u64_amounts_in_a_value_never_share_a_fingerprint() {
    // A reused key with a different amount must be a Mismatch, not a replay.
    let a = value(r#"{"amount": 18446744073709551615}"#); // u64::MAX
    let b = value(r#"{"amount": 18446744073709551614}"#);
    assert_ne!(a, b, "the Value keeps both amounts exactly");
    let fa = Fingerprint::of(&a).map_err(|e| e.to_string());
    let fb = Fingerprint::of(&b).map_err(|e| e.to_string());
    assert!(
        fa.is_err() || fa != fb,
        "two different amounts share one fingerprint: {fa:?}"
    );
}

#[test]
fn a_decimal_finer_than_its_double_is_refused_and_equal_values_share_a_key() {
    let key = |text: &str| IdempotencyKey::from_content("prices", &value(text));
    // 0.1000000000000000000001 and 0.1 are different numbers with one double.
    assert!(key(r#"{"p": 0.1000000000000000000001}"#).is_err());
    assert!(key(r#"{"p": 1e400}"#).is_err(), "beyond a double");
    assert!(key(r#"{"p": 1e-400}"#).is_err(), "a nonzero number whose double is 0");
    // One number written several ways is one key, as without the feature.
    let one = key(r#"{"p": 1.5}"#).unwrap_or_else(|e| panic!("{e}"));
    for same in [r#"{"p": 1.50}"#, r#"{"p": 15e-1}"#, r#"{"p": 0.15E1}"#] {
        assert_eq!(key(same).unwrap_or_else(|e| panic!("{same}: {e}")), one, "{same}");
    }
    let typed = IdempotencyKey::from_content("prices", &serde_json::json!({"p": 1.5f64}));
    assert_eq!(typed.unwrap_or_else(|e| panic!("{e}")), one);
    assert_eq!(
        key(r#"{"p": 100}"#).unwrap_or_else(|e| panic!("{e}")),
        key(r#"{"p": 1e2}"#).unwrap_or_else(|e| panic!("{e}"))
    );
    assert_eq!(
        key(r#"{"p": -0.0}"#).unwrap_or_else(|e| panic!("{e}")),
        key(r#"{"p": 0}"#).unwrap_or_else(|e| panic!("{e}"))
    );
    // What JavaScript writes for 2^63 is accepted; u64::MAX is not.
    assert!(key(r#"{"id": 9223372036854776000}"#).is_ok());
    assert!(key(r#"{"id": 18446744073709551615}"#).is_err());
    // Beyond u128 too.
    assert!(key(r#"{"id": 1000000000000000000000000000000000000000000}"#).is_err());
}
