//! The time rule of a call: how long it may take, until when a statement
//! may be sent, and the server's own timeouts, all from `call_timeout`.

use std::time::Duration;

/// The time budget of one call, derived from `call_timeout`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    /// The whole call, on the client.
    pub(crate) call: Duration,
    /// A statement is sent only within this much of the call's start.
    pub(crate) send_by: Duration,
    /// `statement_timeout` and `lock_timeout` on the server, in ms.
    pub(crate) server_ms: u64,
}

impl Timeouts {
    /// The longest call timeout taken as given.
    const MAX_CALL: Duration = Duration::from_secs(86_400);

    pub(crate) fn new(call: Duration) -> Self {
        let call = call.clamp(Duration::from_millis(1), Self::MAX_CALL);
        // The server stops a statement after half the call timeout; one is
        // sent only while 60% of it is left, which leaves a tenth for the
        // server's answer to come back before the client gives up.
        let server_ms = u64::try_from((call / 2).as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        Timeouts {
            call,
            send_by: call * 2 / 5,
            server_ms,
        }
    }
}
