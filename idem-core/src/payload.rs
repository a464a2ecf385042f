//! What of a payload a receiver fingerprints ([`PayloadFingerprint`]).

use std::fmt;
use std::sync::Arc;

use crate::json::{JsonPointers, PointerError};
use crate::Fingerprint;

/// A function that picks what of a payload counts
/// ([`PayloadFingerprint::with`]).
pub type PickFn = dyn Fn(&[u8]) -> Option<Vec<u8>> + Send + Sync;

/// What of each payload a receiver's fingerprint covers: the whole
/// payload (the default), the parts of a JSON payload that JSON pointers
/// name, or what a function of your own picks. A retry whose payload
/// differs only outside what is covered (a timestamp, a trace id the
/// client adds on each try) is then the same request: it gets the
/// recorded result instead of a payload mismatch (HTTP 422, a dead
/// letter).
///
/// Given to [`IdempotencyLayer::fingerprint`], and to the Kafka, SQS and
/// Redis Streams consumers' `fingerprint`. Changing it changes the
/// fingerprints of new requests: a retry of a request recorded before the
/// change is a mismatch.
///
/// [`IdempotencyLayer::fingerprint`]: https://docs.rs/idem-http
///
/// ```
/// use idem_core::PayloadFingerprint;
///
/// let parts = PayloadFingerprint::json_pointers(["/amount", "/currency"])?;
/// assert_eq!(
///     parts.fingerprint(br#"{"amount": 100, "currency": "EUR", "sent_at": "10:00:00"}"#),
///     parts.fingerprint(br#"{"amount": 100, "currency": "EUR", "sent_at": "10:00:07"}"#),
/// );
/// // Your own choice of what counts (here: the first line).
/// let first_line = PayloadFingerprint::with(|payload| payload.split(|&b| b == b'\n').next().map(<[u8]>::to_vec));
/// assert_eq!(first_line.fingerprint(b"pay 100\nsent 10:00"), first_line.fingerprint(b"pay 100\nsent 10:01"));
/// # Ok::<(), idem_core::json::PointerError>(())
/// ```
#[derive(Clone, Default)]
pub enum PayloadFingerprint {
    /// The whole payload, as the receiver fingerprints it by default.
    #[default]
    Whole,
    /// The parts of a JSON payload the pointers name
    /// ([`JsonPointers::select`]); a payload that is not JSON, or where a
    /// pointer names two values, counts whole.
    JsonPointers(JsonPointers),
    /// The bytes a function picks from the payload; `None` from it: the
    /// whole payload counts.
    With(Arc<PickFn>),
}

impl PayloadFingerprint {
    /// The parts of a JSON payload that `pointers` name (RFC 6901:
    /// `"/amount"`, `"/account/id"`, `"/items/0/sku"`). Refused: no
    /// pointer, more than [`MAX_POINTERS`](crate::json::MAX_POINTERS), or
    /// one that is not a JSON pointer.
    pub fn json_pointers<I, S>(pointers: I) -> Result<Self, PointerError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        JsonPointers::new(pointers).map(PayloadFingerprint::JsonPointers)
    }

    /// What `pick` returns from the payload (`None`: the whole payload;
    /// a panic in it too, logged at `warn`).
    pub fn with<F>(pick: F) -> Self
    where
        F: Fn(&[u8]) -> Option<Vec<u8>> + Send + Sync + 'static,
    {
        PayloadFingerprint::With(Arc::new(pick))
    }

    /// `true` for [`Whole`](Self::Whole).
    pub fn is_whole(&self) -> bool {
        matches!(self, PayloadFingerprint::Whole)
    }

    /// The bytes that stand for `payload` in its fingerprint when only a
    /// part counts, or `None` when the whole payload counts (the default,
    /// a payload the pointers cannot read, a function that returned
    /// `None`). A part is framed apart from any whole payload: a payload
    /// whose bytes happen to equal another's selection never shares its
    /// fingerprint.
    pub fn selected(&self, payload: &[u8]) -> Option<Vec<u8>> {
        let part = match self {
            PayloadFingerprint::Whole => return None,
            PayloadFingerprint::JsonPointers(pointers) => pointers.select(payload)?,
            PayloadFingerprint::With(pick) => {
                // A panic in the function is no part: the whole payload
                // counts (a retry may get 422, never another's result).
                let picked =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pick(payload)));
                let picked = match picked {
                    Ok(picked) => picked?,
                    Err(_) => {
                        tracing::warn!(
                            "the PayloadFingerprint function panicked: the whole payload counts"
                        );
                        return None;
                    }
                };
                let mut part = b"picked\n".to_vec();
                part.extend_from_slice(&picked);
                part
            }
        };
        let mut out = b"part\n".to_vec();
        out.extend_from_slice(&part);
        Some(out)
    }

    /// The fingerprint of a payload taken as bytes (a Kafka value, an SQS
    /// body): with [`Whole`](Self::Whole), `Fingerprint::of_bytes(payload)`
    /// as before; otherwise the SHA-256 of the selected part, or of the
    /// whole payload framed apart from any part.
    pub fn fingerprint(&self, payload: &[u8]) -> Fingerprint {
        if self.is_whole() {
            return Fingerprint::of_bytes(payload);
        }
        match self.selected(payload) {
            Some(part) => Fingerprint::of_bytes(&part),
            None => {
                let mut whole = b"whole\n".to_vec();
                whole.extend_from_slice(payload);
                Fingerprint::of_bytes(&whole)
            }
        }
    }
}

impl fmt::Debug for PayloadFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PayloadFingerprint::Whole => f.write_str("Whole"),
            PayloadFingerprint::JsonPointers(p) => {
                f.debug_tuple("JsonPointers").field(&p.as_slice()).finish()
            }
            PayloadFingerprint::With(_) => f.write_str("With(..)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_is_the_bytes_fingerprint_of_before() {
        let p = PayloadFingerprint::default();
        assert_eq!(p.fingerprint(b"abc"), Fingerprint::of_bytes(b"abc"));
        assert_eq!(p.selected(b"{}"), None);
    }

    #[test]
    fn a_part_and_a_whole_payload_never_share_a_fingerprint() {
        let parts = PayloadFingerprint::json_pointers(["/a"]).unwrap_or_else(|e| panic!("{e}"));
        let json = br#"{"a":1}"#;
        let part = parts.selected(json).unwrap_or_else(|| panic!("a part"));
        // A payload whose bytes are another's part, or the framing of a
        // whole payload: still another fingerprint.
        assert_ne!(parts.fingerprint(&part), parts.fingerprint(json));
        let mut framed_whole = b"whole\n".to_vec();
        framed_whole.extend_from_slice(b"{oops");
        assert_ne!(
            parts.fingerprint(&framed_whole),
            parts.fingerprint(b"{oops")
        );
        // Not JSON: the whole payload, to the byte.
        assert_ne!(parts.fingerprint(b"{oops"), parts.fingerprint(b"{oops "));
        assert_eq!(parts.fingerprint(b"{oops"), parts.fingerprint(b"{oops"));
        // A function's part and a pointers' part of the same bytes differ.
        let same = part.clone();
        let picked = PayloadFingerprint::with(move |_| Some(same.clone()));
        assert_ne!(picked.fingerprint(json), parts.fingerprint(json));
    }

    #[test]
    fn a_function_that_panics_counts_the_whole_payload() {
        let panics = PayloadFingerprint::with(|_| panic!("a bug in the picker"));
        assert_eq!(panics.selected(b"{}"), None);
        assert_eq!(panics.fingerprint(b"a"), panics.fingerprint(b"a"));
        assert_ne!(panics.fingerprint(b"a"), panics.fingerprint(b"b"));
    }
}
