//! The stored form of a record (format 2): one Redis string, a 94-byte
//! header then, for a completed record, the response. The scripts write
//! it (`scripts/acquire.lua` describes the layout); the client decodes it
//! for a replay and for `get`.
//!
//! One string rather than a hash: a duplicate is one `GET` in the script
//! and one bulk string on the wire, and a record with a response over 64
//! bytes stays one allocation (a hash that large leaves Redis's compact
//! listpack encoding for a hash table, about 2.5 times the memory).

use bytes::Bytes;

/// Bytes before the response.
pub(crate) const HEADER_LEN: usize = 94;

/// A decoded record; `response` is a slice of the reply, not a copy.
#[derive(Debug)]
pub(crate) struct Stored {
    pub completed: bool,
    pub fingerprint: Option<[u8; 32]>,
    pub token: [u8; 16],
    pub attempt: u32,
    pub fence: u64,
    /// Lease deadline, ms (0 once completed).
    pub lease_until_ms: u64,
    pub created_ms: u64,
    pub expires_ms: u64,
    /// Completion time, ms (0 while in progress).
    pub completed_ms: u64,
    pub response: Bytes,
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(word)
}

/// Decodes a stored record, or says what is wrong with it.
pub(crate) fn decode(raw: Bytes) -> Result<Stored, String> {
    if raw.len() < HEADER_LEN {
        return Err(format!(
            "record of {} bytes, shorter than its {HEADER_LEN}-byte header",
            raw.len()
        ));
    }
    let b = &raw[..];
    let completed = match b[0] {
        b'c' => true,
        b'p' => false,
        other => return Err(format!("unknown status byte {other:#04x}")),
    };
    let mut fp = [0u8; 32];
    fp.copy_from_slice(&b[2..34]);
    let fingerprint = match b[1] {
        b'1' => Some(fp),
        b'0' => None,
        other => return Err(format!("bad fingerprint flag {other:#04x}")),
    };
    let mut token = [0u8; 16];
    token.copy_from_slice(&b[34..50]);
    let mut word = [0u8; 4];
    word.copy_from_slice(&b[50..54]);
    let attempt = u32::from_be_bytes(word);
    if attempt == 0 {
        return Err("attempt 0".into());
    }
    let stored = Stored {
        completed,
        fingerprint,
        token,
        attempt,
        fence: u64_at(b, 54),
        lease_until_ms: u64_at(b, 62),
        created_ms: u64_at(b, 70),
        expires_ms: u64_at(b, 78),
        completed_ms: u64_at(b, 86),
        response: Bytes::new(),
    };
    const MAX_EXACT: u64 = (1 << 53) - 1; // what a script's numbers hold exactly
    for (what, v) in [
        ("fence", stored.fence),
        ("lease", stored.lease_until_ms),
        ("created", stored.created_ms),
        ("expires", stored.expires_ms),
        ("completed", stored.completed_ms),
    ] {
        if v > MAX_EXACT {
            return Err(format!("{what} {v} out of range"));
        }
    }
    if !completed && stored.lease_until_ms == 0 {
        return Err("in progress without a lease deadline".into());
    }
    if !completed && raw.len() != HEADER_LEN {
        return Err("in progress with a response".into());
    }
    Ok(Stored {
        response: if completed {
            raw.slice(HEADER_LEN..)
        } else {
            Bytes::new()
        },
        ..stored
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(status: u8, flag: u8, attempt: u32, lease: u64) -> Vec<u8> {
        let mut v = vec![status, flag];
        v.extend_from_slice(&[7; 32]);
        v.extend_from_slice(&[9; 16]);
        v.extend_from_slice(&attempt.to_be_bytes());
        for n in [11u64, lease, 1, 2, 3] {
            v.extend_from_slice(&n.to_be_bytes());
        }
        v
    }

    #[test]
    fn a_completed_record_decodes_and_its_response_is_a_slice() {
        let mut raw = header(b'c', b'1', 2, 0);
        raw.extend_from_slice(b"resp");
        let s = decode(Bytes::from(raw)).unwrap_or_else(|e| panic!("{e}"));
        assert!(s.completed);
        assert_eq!(s.fingerprint, Some([7; 32]));
        assert_eq!((s.attempt, s.fence, s.expires_ms), (2, 11, 2));
        assert_eq!(&s.response[..], b"resp");
    }

    #[test]
    fn damaged_records_say_why_never_panic() {
        for (raw, why) in [
            (Vec::new(), "shorter"),
            (header(b'c', b'1', 1, 0)[..93].to_vec(), "shorter"),
            (header(b'x', b'1', 1, 0), "status"),
            (header(b'c', b'7', 1, 0), "flag"),
            (header(b'c', b'0', 0, 0), "attempt 0"),
            (header(b'p', b'0', 1, 0), "lease"),
            (header(b'p', b'0', 1, u64::MAX), "out of range"),
            (
                [header(b'p', b'0', 1, 5), b"x".to_vec()].concat(),
                "response",
            ),
        ] {
            let Err(err) = decode(Bytes::from(raw)) else {
                panic!("decoded a record damaged at its {why}")
            };
            assert!(err.contains(why), "{err} (expected {why})");
        }
    }
}
