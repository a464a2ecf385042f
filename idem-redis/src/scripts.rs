//! The Lua scripts (`scripts/*.lua`, one per operation) and the arguments
//! they are given: the record key written in place, durations in
//! milliseconds.

use std::time::Duration;

use idem_core::{saturate, IdempotencyKey};
use redis::{RedisWrite, Script, ToRedisArgs};

pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) acquire_many: Script,
    pub(crate) complete_many: Script,
    pub(crate) complete: Script,
    pub(crate) release: Script,
    pub(crate) extend: Script,
    pub(crate) delete: Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Scripts {
            acquire: Script::new(include_str!("../scripts/acquire.lua")),
            acquire_many: Script::new(include_str!("../scripts/acquire_many.lua")),
            complete_many: Script::new(include_str!("../scripts/complete_many.lua")),
            complete: Script::new(include_str!("../scripts/complete.lua")),
            release: Script::new(include_str!("../scripts/release.lua")),
            extend: Script::new(include_str!("../scripts/extend.lua")),
            delete: Script::new(include_str!("../scripts/delete.lua")),
        }
    }
}

/// A record's Redis key, `{prefix}{scope}/{id}`, as a command argument
/// written in place.
pub(crate) struct RecordKey<'a> {
    pub(crate) prefix: &'a str,
    pub(crate) key: &'a IdempotencyKey,
}

impl ToRedisArgs for RecordKey<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        let mut w = out.writer_for_next_arg();
        // Writes into a Vec: they cannot fail.
        let _ = w.write_all(self.prefix.as_bytes());
        let _ = w.write_all(self.key.scope().as_bytes());
        let _ = w.write_all(b"/");
        let _ = w.write_all(self.key.id().as_bytes());
    }
}

/// `d` in whole milliseconds for a script: saturated to
/// [`MAX_DURATION`](idem_core::MAX_DURATION) (so no deadline the script
/// computes overflows what `PEXPIREAT` takes), and rounded up, so a lease of
/// less than a millisecond is not a zero lease.
pub(crate) fn millis(d: Duration) -> u64 {
    let d = saturate(d);
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    // MAX_DURATION is about 3.2e12 ms: always fits.
    u64::try_from(ms).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::IdempotencyKey;
    use redis::Cmd;

    #[test]
    fn scripts_know_max_duration() {
        let max_ms = idem_core::MAX_DURATION.as_millis().to_string();
        for (name, script) in [
            ("acquire", include_str!("../scripts/acquire.lua")),
            ("complete", include_str!("../scripts/complete.lua")),
            ("extend", include_str!("../scripts/extend.lua")),
        ] {
            assert!(
                script.contains(&format!("local MAX_MS = {max_ms} ")),
                "{name}.lua does not cap durations at MAX_DURATION ({max_ms} ms)"
            );
        }
        assert_eq!(
            millis(Duration::MAX),
            idem_core::MAX_DURATION.as_millis() as u64
        );
    }

    /// The key written in place into a script command is exactly
    /// `redis_key`, byte for byte, and is the command's key argument.
    #[test]
    fn record_keys_are_written_in_place_as_redis_key() {
        let key = IdempotencyKey::new("pay.charge", "id/with:odd{chars}")
            .unwrap_or_else(|e| panic!("{e}"));
        let scripts = Scripts::new();
        for prefix in ["", "idem:", "{tag}app:"] {
            let expected = {
                let mut k = String::from(prefix);
                k.push_str(key.scope());
                k.push('/');
                k.push_str(key.id());
                k
            };
            let mut cmd = Cmd::with_capacity(8, 64);
            cmd.arg("EVALSHA")
                .arg(scripts.acquire.get_hash())
                .arg(1)
                .arg(RecordKey { prefix, key: &key });
            let args: Vec<Vec<u8>> = cmd
                .args_iter()
                .map(|a| match a {
                    redis::Arg::Simple(b) => b.to_vec(),
                    _ => Vec::new(),
                })
                .collect();
            assert_eq!(args.len(), 4);
            assert_eq!(args[3], expected.as_bytes());
        }
    }

    #[test]
    fn durations_are_saturated_and_rounded_up() {
        assert_eq!(millis(Duration::ZERO), 0);
        assert_eq!(millis(Duration::from_nanos(1)), 1);
        assert_eq!(millis(Duration::from_micros(1_500)), 2);
        assert_eq!(millis(Duration::from_millis(7)), 7);
        let max = idem_core::MAX_DURATION.as_millis() as u64;
        for huge in [
            Duration::MAX,
            Duration::from_secs(u64::MAX),
            idem_core::MAX_DURATION + Duration::from_nanos(1),
        ] {
            assert_eq!(millis(huge), max, "{huge:?}");
        }
    }
}
