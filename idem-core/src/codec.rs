//! How responses are turned into bytes for the store and back.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::CodecError;

/// Encodes handler responses for the store and decodes recorded ones for
/// replay. [`JsonCodec`] is the default; implement this for another format.
pub trait Codec: Send + Sync + 'static {
    /// Serializes a response.
    fn encode<T: Serialize>(&self, value: &T) -> Result<Vec<u8>, CodecError>;
    /// Deserializes a recorded response.
    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, CodecError>;
}

/// JSON through serde_json: readable in the store, tolerant of added fields.
/// A value holding a non-finite float (NaN, ±inf) does not encode
/// (serde_json would write `null`, which then fails to replay as the type).
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonCodec;

impl Codec for JsonCodec {
    fn encode<T: Serialize>(&self, value: &T) -> Result<Vec<u8>, CodecError> {
        crate::finite::check(value).map_err(|e| CodecError::Encode(Box::new(e)))?;
        serde_json::to_vec(value).map_err(|e| CodecError::Encode(Box::new(e)))
    }

    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, CodecError> {
        serde_json::from_slice(bytes).map_err(|e| CodecError::Decode(Box::new(e)))
    }
}
