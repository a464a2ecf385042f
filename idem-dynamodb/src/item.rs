//! The item of a key, as stored, and its decoding.
//!
//! Attribute names are short: DynamoDB bills an item by the bytes of its
//! names and values.
//!
//! | name | type | meaning |
//! |---|---|---|
//! | `pk` | S | `{scope}/{id}` (the table's partition key); `#{token}/{n}` for a chunk of a large response |
//! | `st` | S | `p` in progress, `c` completed, `r` released, `x` deleted (`r` and `x` are tombstones: absent, but they keep the fence) |
//! | `tk` | B | the lease token (16 bytes) of the holder or completer; of the releaser in an `r` tombstone; of the deleted record in an `x` tombstone |
//! | `fe` | N | the fence |
//! | `at` | N | the attempt (live records) |
//! | `fp` | B | the fingerprint (32 bytes), if any |
//! | `le` | N | the lease's end, ms since the epoch (in progress) |
//! | `cr` | N | created, ms |
//! | `co` | N | completed, ms |
//! | `ex` | N | when the item stops being live, ms (lease end + grace; completion + retention; a tombstone's end) |
//! | `rs` | B | the response, when it fits in the item |
//! | `nc`, `rz` | N | a response kept in `nc` chunk items, `rz` bytes in all; `nc` stays in an `x` tombstone, so a delete sent again removes the chunks |
//! | `rv` | N | a random revision, new on every write: a takeover is a compare-and-set on it |
//! | `tt` | N | `ex` in seconds (plus the skew margin), for DynamoDB's TTL |
//! | `d` | B | a chunk's bytes |

use std::collections::HashMap;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use bytes::Bytes;
use idem_core::{Fingerprint, LeaseToken};

pub(crate) const PK: &str = "pk";
pub(crate) const ST: &str = "st";
pub(crate) const TK: &str = "tk";
pub(crate) const FE: &str = "fe";
pub(crate) const AT: &str = "at";
pub(crate) const FP: &str = "fp";
pub(crate) const LE: &str = "le";
pub(crate) const CR: &str = "cr";
pub(crate) const CO: &str = "co";
pub(crate) const EX: &str = "ex";
pub(crate) const RS: &str = "rs";
pub(crate) const NC: &str = "nc";
pub(crate) const RZ: &str = "rz";
pub(crate) const RV: &str = "rv";
pub(crate) const TT: &str = "tt";
pub(crate) const D: &str = "d";

/// The response of a completed item.
#[derive(Debug, Clone)]
pub(crate) enum Response {
    Inline(Bytes),
    Chunked { chunks: u32, size: u64 },
}

/// What an item says.
#[derive(Debug, Clone)]
pub(crate) enum State {
    InProgress {
        lease_until: i64,
    },
    Completed {
        completed_at: i64,
        response: Response,
    },
    /// `r`: released by the holder of `token`.
    Released,
    /// `x`: deleted by an operator. The tombstone keeps the deleted
    /// response's chunk count (with its token), so a delete sent again
    /// after a lost reply removes the chunks the first one could not.
    Deleted {
        chunks: Option<u32>,
    },
}

/// A decoded item.
#[derive(Debug, Clone)]
pub(crate) struct Item {
    pub(crate) state: State,
    /// `None` in a tombstone of a delete that found no token.
    pub(crate) token: Option<LeaseToken>,
    pub(crate) fence: u64,
    pub(crate) attempt: u32,
    pub(crate) fingerprint: Option<Fingerprint>,
    pub(crate) created: i64,
    pub(crate) expires: i64,
    pub(crate) rev: u64,
}

impl Item {
    pub(crate) fn is_tombstone(&self) -> bool {
        matches!(self.state, State::Released | State::Deleted { .. })
    }
}

pub(crate) type Attrs = HashMap<String, AttributeValue>;

pub(crate) fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

pub(crate) fn n(v: impl ToString) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

pub(crate) fn b(v: impl Into<Vec<u8>>) -> AttributeValue {
    AttributeValue::B(Blob::new(v))
}

pub(crate) fn get_n<T: std::str::FromStr>(attrs: &Attrs, name: &str) -> Result<T, String> {
    match attrs.get(name) {
        Some(AttributeValue::N(v)) => v
            .parse()
            .map_err(|_| format!("attribute {name} = {v:?} is out of range")),
        Some(other) => Err(format!("attribute {name} is not a number: {other:?}")),
        None => Err(format!("attribute {name} is missing")),
    }
}

fn get_b<'a>(attrs: &'a Attrs, name: &str) -> Result<Option<&'a [u8]>, String> {
    match attrs.get(name) {
        Some(AttributeValue::B(v)) => Ok(Some(v.as_ref())),
        Some(other) => Err(format!("attribute {name} is not binary: {}", kind(other))),
        None => Ok(None),
    }
}

fn kind(v: &AttributeValue) -> &'static str {
    match v {
        AttributeValue::S(_) => "a string",
        AttributeValue::N(_) => "a number",
        AttributeValue::B(_) => "binary",
        AttributeValue::Bool(_) => "a boolean",
        AttributeValue::Null(_) => "null",
        AttributeValue::M(_) => "a map",
        AttributeValue::L(_) => "a list",
        _ => "a set",
    }
}

/// Decodes an item, or says what is wrong with it.
pub(crate) fn decode(attrs: &Attrs) -> Result<Item, String> {
    let status = match attrs.get(ST) {
        Some(AttributeValue::S(v)) => v.as_str(),
        Some(other) => return Err(format!("attribute st is {}", kind(other))),
        None => return Err("attribute st is missing".into()),
    };
    let fence: u64 = get_n(attrs, FE)?;
    let expires: i64 = get_n(attrs, EX)?;
    let rev: u64 = get_n(attrs, RV)?;
    let token = match get_b(attrs, TK)? {
        Some(t) => Some(LeaseToken::from_slice(t).ok_or("the token is not 16 bytes")?),
        None => None,
    };
    if status == "x" {
        let chunks = match attrs.get(NC) {
            Some(_) => Some(get_n(attrs, NC)?),
            None => None,
        };
        return Ok(Item {
            state: State::Deleted { chunks },
            token,
            fence,
            attempt: 0,
            fingerprint: None,
            created: 0,
            expires,
            rev,
        });
    }
    let token = Some(token.ok_or("attribute tk is missing")?);
    if status == "r" {
        return Ok(Item {
            state: State::Released,
            token,
            fence,
            attempt: 0,
            fingerprint: None,
            created: 0,
            expires,
            rev,
        });
    }
    let attempt: u32 = get_n(attrs, AT)?;
    if attempt == 0 {
        return Err("attempt 0".into());
    }
    let created: i64 = get_n(attrs, CR)?;
    let fingerprint = match get_b(attrs, FP)? {
        Some(f) => Some(Fingerprint::from_slice(f).ok_or("the fingerprint is not 32 bytes")?),
        None => None,
    };
    let state = match status {
        "p" => {
            if attrs.contains_key(RS) || attrs.contains_key(NC) {
                return Err("in progress with a response".into());
            }
            State::InProgress {
                lease_until: get_n(attrs, LE)?,
            }
        }
        "c" => {
            let completed_at: i64 = get_n(attrs, CO)?;
            let response = match get_b(attrs, RS)? {
                Some(r) => Response::Inline(Bytes::copy_from_slice(r)),
                None => {
                    let chunks: u32 = get_n(attrs, NC)?;
                    let size: u64 = get_n(attrs, RZ)?;
                    if chunks == 0 {
                        return Err("a chunked response of 0 chunks".into());
                    }
                    Response::Chunked { chunks, size }
                }
            };
            State::Completed {
                completed_at,
                response,
            }
        }
        other => return Err(format!("unknown status {other:?}")),
    };
    Ok(Item {
        state,
        token,
        fence,
        attempt,
        fingerprint,
        created,
        expires,
        rev,
    })
}

/// The partition key of a record: scopes never hold `/`, so the first `/`
/// ends the scope and no two keys share an item.
pub(crate) fn record_pk(scope: &str, id: &str) -> String {
    let mut k = String::with_capacity(scope.len() + id.len() + 1);
    k.push_str(scope);
    k.push('/');
    k.push_str(id);
    k
}

/// The partition key of chunk `i` of the response completed by `token`:
/// `#` never starts a scope, so chunks never meet records.
pub(crate) fn chunk_pk(token: LeaseToken, i: u32) -> String {
    format!("#{}/{i}", token.to_hex())
}
