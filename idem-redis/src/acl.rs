//! Access: the ACL rules the store needs, and the check of a key prefix
//! that such rules must be able to name.

use idem_core::StoreError;

#[cfg(doc)]
use crate::store::RedisStore;

/// The Redis ACL rules the store needs for record keys under `prefix`
/// (`idem:` by default), on a standalone Redis: exactly the commands it
/// sends (`EVALSHA`, `SCRIPT LOAD` when a script is not loaded yet, `GET`
/// for [`get`](idem_core::IdempotencyStore::get)) and those its scripts run
/// (`GET SET DEL MGET PTTL TIME`), and the keys under the prefix (its
/// `delete` markers included). With `wait` ([`RedisStore::wait_for_replicas`]),
/// `WAIT`, `EXISTS` and `TIME` too. `CONFIG GET` is not needed: without it
/// the eviction check at connect logs a warning and the store goes on.
/// The operator scans (`idem` command) need `+scan` besides; Redis Streams
/// consumers their stream commands and keys.
///
/// Each rule is one argument of `ACL SETUSER` (they are joined by single
/// spaces, none holds one): paste them into `redis-cli`, a `users.acl`
/// file or a `user` line of `redis.conf`, or split them on whitespace to
/// send them from code. The store refuses a prefix with whitespace or a
/// control character ([`RedisStore::prefix`]): Redis refuses a key pattern
/// with whitespace, so no rule could name exactly such a prefix.
///
/// ```
/// assert_eq!(
///     idem_redis::acl_rules("idem:", false),
///     "resetkeys ~idem:* resetchannels -@all +evalsha +script|load +get +set +del +mget +pttl +time"
/// );
/// // ACL SETUSER idem on >password resetkeys ~idem:* resetchannels -@all +evalsha ...
/// ```
pub fn acl_rules(prefix: &str, wait: bool) -> String {
    let mut escaped = String::with_capacity(prefix.len() + 4);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    let mut rules = format!("resetkeys ~{escaped}*");
    if prefix.contains('{') {
        // `delete` markers of a prefix with a hash tag: `{n}{prefix}delete/...`.
        rules.push_str(&format!(" ~{{*}}{escaped}delete/*"));
    }
    rules.push_str(" resetchannels -@all +evalsha +script|load +get +set +del +mget +pttl +time");
    if wait {
        rules.push_str(" +wait +exists");
    }
    rules
}

/// Whether `prefix` can be a record key prefix: no whitespace (a Redis
/// ACL key pattern cannot hold it, so [`acl_rules`] could not express the
/// prefix) and no control character.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), StoreError> {
    match prefix
        .char_indices()
        .find(|(_, c)| c.is_whitespace() || c.is_control())
    {
        None => Ok(()),
        Some((at, c)) => Err(StoreError::InvalidArgument {
            detail: format!(
                "the key prefix {prefix:?} holds {c:?} at byte {at}: a Redis ACL key pattern cannot hold whitespace, so no ACL could give a user exactly these keys; choose a prefix without whitespace or control characters"
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_with_whitespace_or_control_characters_are_refused() {
        for good in [
            "idem:",
            "",
            "{tag}app:",
            "glob*?[x]\\:",
            "quote\"d'app:",
            "é:",
        ] {
            assert!(check_prefix(good).is_ok(), "{good:?}");
            // Every rule is one whitespace-free argument.
            let rules = acl_rules(good, true);
            assert!(rules.split(' ').all(|r| !r.is_empty()), "{rules:?}");
        }
        for bad in [
            "billing app:",
            "tab\tx:",
            "nl\n",
            "nul\0",
            "nbsp\u{a0}x",
            "\u{1}",
        ] {
            assert!(
                matches!(check_prefix(bad), Err(StoreError::InvalidArgument { .. })),
                "{bad:?}"
            );
        }
    }
}
