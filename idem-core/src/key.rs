//! Idempotency keys: validation and the helpers that build them.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::canonical::canonical_json;
use crate::error::KeyError;
use crate::fingerprint::Fingerprint;

/// Longest accepted scope, in bytes.
pub const MAX_SCOPE_LEN: usize = 64;
/// Longest accepted id, in bytes.
pub const MAX_ID_LEN: usize = 512;

/// The identity of one logical operation: a `scope` naming the operation
/// (`"payments.charge"`) and an `id` unique within it (a message id, an
/// `Idempotency-Key` header, a natural key).
///
/// A key is always valid once built: the scope is 1 to 64 bytes of
/// `[A-Za-z0-9._:-]`, the id is 1 to 512 bytes of UTF-8 without control
/// characters. Construction never panics; it returns a [`KeyError`].
///
/// ```
/// use idem_core::IdempotencyKey;
///
/// let key = IdempotencyKey::new("payments.charge", "msg-8f2c")?;
/// assert_eq!(key.scope(), "payments.charge");
/// assert!(IdempotencyKey::new("bad scope", "x").is_err());
/// # Ok::<(), idem_core::KeyError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "RawKey", into = "RawKey")]
pub struct IdempotencyKey {
    scope: String,
    id: String,
}

#[derive(Serialize, Deserialize)]
struct RawKey {
    scope: String,
    id: String,
}

impl TryFrom<RawKey> for IdempotencyKey {
    type Error = KeyError;
    fn try_from(raw: RawKey) -> Result<Self, KeyError> {
        IdempotencyKey::new(raw.scope, raw.id)
    }
}

impl From<IdempotencyKey> for RawKey {
    fn from(key: IdempotencyKey) -> Self {
        RawKey {
            scope: key.scope,
            id: key.id,
        }
    }
}

impl IdempotencyKey {
    /// Builds a key from a scope and an id, validating both.
    pub fn new(scope: impl Into<String>, id: impl Into<String>) -> Result<Self, KeyError> {
        let scope = scope.into();
        let id = id.into();
        validate_scope(&scope)?;
        validate_id(&id)?;
        Ok(IdempotencyKey { scope, id })
    }

    /// Builds a key from an id given as raw bytes (a broker header, say).
    /// Bytes that are not UTF-8 give [`KeyError::IdNotUtf8`].
    pub fn from_utf8(scope: impl Into<String>, id: &[u8]) -> Result<Self, KeyError> {
        let id = std::str::from_utf8(id).map_err(|e| KeyError::IdNotUtf8 {
            valid_up_to: e.valid_up_to(),
        })?;
        Self::new(scope, id)
    }

    /// The key, in `scope`, of a counter kept about this key (a receiver's
    /// count of failed or cut-off runs): a SHA-256 of this key's scope and
    /// ID, so that no two keys share a counter. `None` when `scope` is not
    /// a valid scope.
    pub fn counter_of(&self, scope: &str) -> Option<IdempotencyKey> {
        let id = Fingerprint::of_bytes(format!("{}\u{0}{}", self.scope, self.id).as_bytes());
        IdempotencyKey::new(scope, id.to_hex()).ok()
    }

    /// A natural key made of several parts (`["order-17", "line-3"]`),
    /// joined so that different part lists never give the same id: each part
    /// has `%` and `/` percent-escaped, and parts are joined with `/`.
    ///
    /// ```
    /// use idem_core::IdempotencyKey;
    ///
    /// let a = IdempotencyKey::composite("inventory.reserve", ["a/b", "c"])?;
    /// let b = IdempotencyKey::composite("inventory.reserve", ["a", "b/c"])?;
    /// assert_ne!(a, b);
    /// # Ok::<(), idem_core::KeyError>(())
    /// ```
    pub fn composite<I>(scope: impl Into<String>, parts: I) -> Result<Self, KeyError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut id = String::new();
        for (i, part) in parts.into_iter().enumerate() {
            if i > 0 {
                id.push('/');
            }
            for ch in part.as_ref().chars() {
                match ch {
                    '%' => id.push_str("%25"),
                    '/' => id.push_str("%2F"),
                    c => id.push(c),
                }
            }
        }
        Self::new(scope, id)
    }

    /// A key derived from the content of a message: the lowercase hex
    /// SHA-256 of its canonical JSON in RFC 8785's form (JCS: members
    /// sorted by UTF-16 code units at every depth, no whitespace, numbers
    /// in ECMAScript form), so the order of fields never changes the key
    /// and a producer in another language computes the same one (Python:
    /// `hashlib.sha256(rfc8785.dumps(payload)).hexdigest()`).
    ///
    /// [`KeyError::Content`] when the content has no exact canonical form:
    /// a non-finite float, a repeated member name, or an integer that JCS
    /// would write as a neighbour's double (see [`canonical_json`](crate::canonical_json)).
    ///
    /// ```
    /// use idem_core::IdempotencyKey;
    /// use serde_json::json;
    ///
    /// let a = IdempotencyKey::from_content("emails.send", &json!({"a": 1, "b": {"x": 1, "y": 2}}))?;
    /// let b = IdempotencyKey::from_content("emails.send", &json!({"b": {"y": 2, "x": 1}, "a": 1}))?;
    /// assert_eq!(a, b);
    /// # Ok::<(), idem_core::KeyError>(())
    /// ```
    pub fn from_content<T: Serialize + ?Sized>(
        scope: impl Into<String>,
        content: &T,
    ) -> Result<Self, KeyError> {
        let bytes = canonical_json(content).map_err(|e| KeyError::Content(e.to_string()))?;
        Self::new(scope, Fingerprint::of_bytes(&bytes).to_hex())
    }

    /// A key that is the same for every `at` in one time window: the id is
    /// `id` plus the index of the `window`-long bucket (counted from the Unix
    /// epoch) that holds `at`. Use it to let an operation run at most once
    /// per window ("one digest email per user per day").
    ///
    /// ```
    /// use std::time::{Duration, UNIX_EPOCH};
    /// use idem_core::IdempotencyKey;
    ///
    /// let day = Duration::from_secs(86_400);
    /// let morning = UNIX_EPOCH + Duration::from_secs(86_400 * 100 + 3_600);
    /// let evening = UNIX_EPOCH + Duration::from_secs(86_400 * 100 + 80_000);
    /// let a = IdempotencyKey::windowed("digest.send", "user-7", day, morning)?;
    /// let b = IdempotencyKey::windowed("digest.send", "user-7", day, evening)?;
    /// assert_eq!(a, b);
    /// # Ok::<(), idem_core::KeyError>(())
    /// ```
    pub fn windowed(
        scope: impl Into<String>,
        id: &str,
        window: Duration,
        at: SystemTime,
    ) -> Result<Self, KeyError> {
        let window_ms = window.as_millis();
        if window_ms == 0 {
            return Err(KeyError::ZeroWindow);
        }
        let since_epoch = at.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
        let bucket = since_epoch.as_millis() / window_ms;
        Self::composite(scope, [id, &format!("w{window_ms}ms-{bucket}")])
    }

    /// The operation this key belongs to.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The id within the scope.
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.scope, self.id)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({:?}/{:?})", self.scope, self.id)
    }
}

fn validate_scope(scope: &str) -> Result<(), KeyError> {
    if scope.is_empty() {
        return Err(KeyError::EmptyScope);
    }
    if scope.len() > MAX_SCOPE_LEN {
        return Err(KeyError::ScopeTooLong { len: scope.len() });
    }
    if let Some((index, ch)) = scope
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
    {
        return Err(KeyError::InvalidScopeChar { index, ch });
    }
    Ok(())
}

fn validate_id(id: &str) -> Result<(), KeyError> {
    if id.is_empty() {
        return Err(KeyError::EmptyId);
    }
    if id.len() > MAX_ID_LEN {
        return Err(KeyError::IdTooLong { len: id.len() });
    }
    if let Some((index, _)) = id.char_indices().find(|(_, c)| c.is_control()) {
        return Err(KeyError::ControlCharInId { index });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn limits_are_inclusive() {
        assert!(IdempotencyKey::new("a".repeat(64), "x").is_ok());
        assert!(matches!(
            IdempotencyKey::new("a".repeat(65), "x"),
            Err(KeyError::ScopeTooLong { len: 65 })
        ));
        assert!(IdempotencyKey::new("s", "é".repeat(256)).is_ok());
        assert!(matches!(
            IdempotencyKey::new("s", "x".repeat(513)),
            Err(KeyError::IdTooLong { len: 513 })
        ));
    }

    #[test]
    fn bad_keys_are_typed_errors() {
        assert!(matches!(
            IdempotencyKey::new("", "x"),
            Err(KeyError::EmptyScope)
        ));
        assert!(matches!(
            IdempotencyKey::new("s", ""),
            Err(KeyError::EmptyId)
        ));
        assert!(matches!(
            IdempotencyKey::new("pay ments", "x"),
            Err(KeyError::InvalidScopeChar { index: 3, ch: ' ' })
        ));
        assert!(matches!(
            IdempotencyKey::new("s", "a\nb"),
            Err(KeyError::ControlCharInId { index: 1 })
        ));
        assert!(matches!(
            IdempotencyKey::new("s", "a\u{0}"),
            Err(KeyError::ControlCharInId { index: 1 })
        ));
        assert!(matches!(
            IdempotencyKey::from_utf8("s", b"ab\xff"),
            Err(KeyError::IdNotUtf8 { valid_up_to: 2 })
        ));
        assert!(matches!(
            IdempotencyKey::new("sc\u{e9}", "x"),
            Err(KeyError::InvalidScopeChar { index: 2, .. })
        ));
    }

    #[test]
    fn composite_is_unambiguous() {
        let k = |parts: &[&str]| {
            IdempotencyKey::composite("s", parts.iter().copied()).map(|k| k.id().to_owned())
        };
        assert_ne!(k(&["a/b", "c"]).ok(), k(&["a", "b/c"]).ok());
        assert_ne!(k(&["a%2Fb"]).ok(), k(&["a/b"]).ok());
        assert_ne!(k(&["a", ""]).ok(), k(&["a"]).ok());
        assert_eq!(
            k(&["order-1", "line-2"]).ok().as_deref(),
            Some("order-1/line-2")
        );
        assert!(matches!(k(&[]), Err(KeyError::EmptyId)));
    }

    #[test]
    fn from_content_ignores_field_order_at_every_depth() {
        let a = IdempotencyKey::from_content("s", &json!({"a": 1, "b": 2})).ok();
        let b = IdempotencyKey::from_content("s", &json!({"b": 2, "a": 1})).ok();
        assert!(a.is_some());
        assert_eq!(a, b);
        let c = IdempotencyKey::from_content(
            "s",
            &json!({"n": {"x": [1, {"q": 1, "p": 2}], "y": "é"}}),
        )
        .ok();
        let d = IdempotencyKey::from_content(
            "s",
            &json!({"n": {"y": "é", "x": [1, {"p": 2, "q": 1}]}}),
        )
        .ok();
        assert_eq!(c, d);
        let e = IdempotencyKey::from_content(
            "s",
            &json!({"n": {"x": [{"p": 2, "q": 1}, 1], "y": "é"}}),
        )
        .ok();
        assert_ne!(c, e, "array order matters");
        assert_eq!(a.map(|k| k.id().len()), Some(64));
    }

    #[test]
    fn windowed_buckets() {
        let hour = Duration::from_secs(3600);
        let t = UNIX_EPOCH + Duration::from_secs(3600 * 10);
        let a = IdempotencyKey::windowed("s", "u", hour, t).ok();
        let b = IdempotencyKey::windowed("s", "u", hour, t + Duration::from_secs(3599)).ok();
        let c = IdempotencyKey::windowed("s", "u", hour, t + hour).ok();
        assert!(a.is_some());
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(matches!(
            IdempotencyKey::windowed("s", "u", Duration::ZERO, t),
            Err(KeyError::ZeroWindow)
        ));
    }

    #[test]
    fn serde_validates() {
        let ok: Result<IdempotencyKey, _> = serde_json::from_str(r#"{"scope":"a.b","id":"1"}"#);
        assert!(ok.is_ok());
        let bad: Result<IdempotencyKey, _> = serde_json::from_str(r#"{"scope":"a b","id":"1"}"#);
        assert!(bad.is_err());
    }
}
