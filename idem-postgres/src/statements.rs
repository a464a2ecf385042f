//! The SQL statements (`sql/*.sql`), rendered once per store, and the
//! values they take.

use std::sync::Arc;
use std::time::Duration;

use idem_core::saturate;
use sqlx::AssertSqlSafe;

/// The statements, rendered once for the configured table. Only validated
/// identifiers are interpolated; every value is a bind parameter.
pub(crate) struct Statements {
    pub(crate) acquire: Arc<str>,
    pub(crate) acquire_many: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) complete_many: Arc<str>,
    pub(crate) release: Arc<str>,
    pub(crate) extend: Arc<str>,
    pub(crate) get: Arc<str>,
    pub(crate) delete: Arc<str>,
    pub(crate) purge: Arc<str>,
}

/// Marks SQL built from validated identifiers as safe for sqlx.
pub(crate) fn sql(text: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(text.clone())
}

/// How many times `acquire` re-runs its statement when a concurrent commit
/// was not visible to it (READ COMMITTED takes a new snapshot each time).
pub(crate) const ACQUIRE_TRIES: usize = 16;

/// `d` in whole microseconds for a statement: saturated to
/// [`MAX_DURATION`](idem_core::MAX_DURATION), so every deadline
/// (`now + lease + IN_PROGRESS_GRACE`) stays far inside timestamptz's
/// range, and rounded up, so a lease under a microsecond is not a zero
/// lease.
pub(crate) fn micros(d: Duration) -> i64 {
    let d = saturate(d);
    let us = d.as_micros() + u128::from(!d.subsec_nanos().is_multiple_of(1_000));
    // MAX_DURATION is about 3.2e15 µs: always fits.
    i64::try_from(us).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use idem_core::IN_PROGRESS_GRACE;

    use super::*;

    #[test]
    fn durations_are_saturated_and_rounded_up() {
        assert_eq!(micros(Duration::ZERO), 0);
        assert_eq!(micros(Duration::from_nanos(1)), 1);
        assert_eq!(micros(Duration::from_nanos(1_500)), 2);
        assert_eq!(micros(Duration::from_millis(7)), 7_000);
        let max = idem_core::MAX_DURATION.as_micros() as i64;
        for huge in [
            Duration::MAX,
            Duration::from_secs(u64::MAX),
            idem_core::MAX_DURATION + Duration::from_nanos(1),
        ] {
            assert_eq!(micros(huge), max, "{huge:?}");
        }
        // The longest deadline offset a statement computes, lease + grace,
        // is exact in the float8 that `int8 * interval` goes through.
        let longest = max + micros(IN_PROGRESS_GRACE);
        assert_eq!(longest as f64 as i64, longest);
    }
}
