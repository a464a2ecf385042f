//! Payload fingerprints.

use std::fmt;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::canonical::canonical_json;

/// The SHA-256 of a request payload, stored with a key when it is first
/// acquired. A later request with the same key and a *different*
/// fingerprint is a [`Mismatch`](crate::Acquisition::Mismatch): the caller
/// reused a key for another operation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a payload: SHA-256 of its canonical JSON
    /// ([`canonical_json`](crate::canonical_json), RFC 8785), so field order
    /// does not matter.
    pub fn of<T: Serialize + ?Sized>(payload: &T) -> Result<Self, serde_json::Error> {
        Ok(Self::of_bytes(&canonical_json(payload)?))
    }

    /// The fingerprint of caller-provided bytes (a raw HTTP body, say).
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Fingerprint(Sha256::digest(bytes).into())
    }

    /// Wraps 32 bytes that already are a fingerprint (read back from a store).
    pub const fn from_array(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }

    /// Reads a fingerprint from a byte slice; `None` unless it is 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 32]>::try_from(bytes).ok().map(Fingerprint)
    }

    /// Parses the 64-character lowercase or uppercase hex form.
    pub fn from_hex(hex_str: &str) -> Option<Self> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(hex_str, &mut out).ok()?;
        Some(Fingerprint(out))
    }

    /// The 32 bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn field_order_does_not_matter() {
        let a = Fingerprint::of(&json!({"amount": 100, "currency": "EUR"})).ok();
        let b = Fingerprint::of(&json!({"currency": "EUR", "amount": 100})).ok();
        let c = Fingerprint::of(&json!({"currency": "EUR", "amount": 101})).ok();
        assert!(a.is_some());
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn hex_round_trip() {
        let f = Fingerprint::of_bytes(b"abc");
        assert_eq!(
            f.to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(Fingerprint::from_hex(&f.to_hex()), Some(f));
        assert_eq!(Fingerprint::from_hex("zz"), None);
        assert_eq!(Fingerprint::from_slice(f.as_bytes()), Some(f));
        assert_eq!(Fingerprint::from_slice(&[1, 2]), None);
    }
}
