//! The canonical JSON (RFC 8785) behind keys from content and
//! fingerprints: its properties, and the writer checked against other
//! implementations and odd `Serialize` impls.

mod properties;
mod writer;
