//! Redis Cluster hash slots: the slot of a key, a `delete` marker key in
//! the slot of its record, and a batch split into one script call per slot.

use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use idem_core::IdempotencyKey;
use redis::aio::ConnectionLike;

use crate::store::RedisStore;

/// The number of Redis Cluster hash slots.
const SLOTS: u16 = 16384;

/// CRC16 (XMODEM), the hash of Redis Cluster's key slots.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The cluster slot of a key: of its hash tag (the bytes between the first
/// `{` and the first `}` after it, when not empty), else of the whole key.
pub(crate) fn slot_of(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&c| c == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let len = rest.iter().position(|&c| c == b'}')?;
            (len > 0).then(|| &rest[..len])
        })
        .unwrap_or(key);
    crc16(hashed) % SLOTS
}

/// For every slot, the smallest number whose decimal digits hash to it:
/// a hash tag `{n}` that puts a key in that slot. Made once (about 170,000
/// CRCs of a few bytes).
fn slot_tags() -> &'static [u32] {
    static TAGS: OnceLock<Vec<u32>> = OnceLock::new();
    TAGS.get_or_init(|| {
        let mut tags = vec![u32::MAX; usize::from(SLOTS)];
        let mut left = usize::from(SLOTS);
        let mut n: u32 = 0;
        while left > 0 && n < u32::MAX {
            let slot = usize::from(slot_of(n.to_string().as_bytes()));
            if tags[slot] == u32::MAX {
                tags[slot] = n;
                left -= 1;
            }
            n += 1;
        }
        tags
    })
}

/// The key of one call's marker (`delete`, `release`, `delete_if_token`:
/// the answer a resend of the call gets; `request` is its random id): in
/// the record's hash slot, so the script touching both works on Redis
/// Cluster. `{prefix}delete/{n}/{request}`, where the hash tag `{n}` maps
/// to the record's slot; if the prefix holds a hash tag of its own (then
/// the record key's tag too), `{n}{prefix}delete/{request}`. Checked
/// against the `redis` crate's own slot computation; `None` (never seen:
/// the table covers every slot) means no such key was found.
pub(crate) fn delete_marker(prefix: &str, redis_key: &str, request: &str) -> Option<String> {
    let slot = slot_of(redis_key.as_bytes());
    let tag = *slot_tags().get(usize::from(slot))?;
    if tag == u32::MAX {
        return None;
    }
    let same_slot = |marker: &str| {
        redis::cluster_routing::Slot::for_key(marker)
            == redis::cluster_routing::Slot::for_key(redis_key)
    };
    [
        format!("{prefix}delete/{{{tag}}}/{request}"),
        format!("{{{tag}}}{prefix}delete/{request}"),
    ]
    .into_iter()
    .find(|marker| same_slot(marker))
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The batch's items grouped for one script call each: all in one
    /// group, or on Redis Cluster one group per hash slot (a script's keys
    /// must share a slot). Indexes into the items, in order within a group.
    pub(crate) fn slot_groups<'k>(
        &self,
        keys: impl Iterator<Item = &'k IdempotencyKey>,
    ) -> Vec<Vec<usize>> {
        if !self.cluster.load(Ordering::Relaxed) {
            return vec![keys.enumerate().map(|(i, _)| i).collect()];
        }
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, key) in keys.enumerate() {
            let slot = slot_of(self.redis_key(key).as_bytes());
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, group)) => group.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        groups.into_iter().map(|(_, group)| group).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delete_markers_live_in_the_record_slot() {
        // Known values: CRC16/XMODEM("123456789") = 0x31C3; Redis's
        // `CLUSTER KEYSLOT foo` = 12182.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"{foo}bar"), 12182);
        assert_eq!(slot_of(b"a{}foo"), slot_of(b"a{}foo"));
        assert!(
            slot_tags().iter().all(|&t| t != u32::MAX),
            "a slot without a tag"
        );
        for prefix in ["idem:", "", "{app}:", "a{", "}{", "{}", "x{y"] {
            for id in ["k", "{k}", "}", "{", "a{b}c", "{}x"] {
                let record = format!("{prefix}scope/{id}");
                let marker = delete_marker(prefix, &record, "00ff")
                    .unwrap_or_else(|| panic!("no marker for {record:?}"));
                assert_eq!(
                    slot_of(marker.as_bytes()),
                    slot_of(record.as_bytes()),
                    "{record:?} {marker:?}"
                );
                assert!(marker.contains("00ff"));
            }
        }
        assert!(
            delete_marker("idem:", "idem:s/k", "r").is_some_and(|m| m.starts_with("idem:delete/{"))
        );
    }
}
