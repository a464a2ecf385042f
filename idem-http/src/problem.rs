//! The layer's own answers (a missing key, a payload mismatch, the store
//! down...) as values, and their default rendering as RFC 9457
//! `application/problem+json`.

use std::time::Duration;

use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::response::full;
use crate::LayerBody;

/// What went wrong, as a machine-readable value: each kind has one status.
///
/// ```
/// use http::StatusCode;
/// use idem_http::ProblemKind;
///
/// assert_eq!(ProblemKind::Mismatch.status(), StatusCode::UNPROCESSABLE_ENTITY);
/// assert_eq!(ProblemKind::KeyMissing.as_str(), "key_missing");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// `401`: the tenant function does not know the caller (and anonymous
    /// use is off). Nothing ran.
    CallerUnknown,
    /// `400`: the request carries no idempotency key where one is required.
    KeyMissing,
    /// `400`: the key is not 1 to 255 visible ASCII characters.
    KeyMalformed,
    /// `413`: the body is over `max_body_bytes`. Nothing ran.
    BodyTooLarge,
    /// `400`: the request body could not be read. Nothing ran.
    BodyUnreadable,
    /// `409` with `Retry-After`: a request with this key is running.
    InProgress,
    /// `409`, no `Retry-After`: a request with this key ran, but its
    /// response was not recorded; it will not run again for this key.
    NotRecorded,
    /// `422`: the key was used with another request (method, path, media
    /// type or body).
    Mismatch,
    /// `503` with `Retry-After`: the store is unreachable. Nothing ran.
    StoreUnavailable,
    /// `500`: the layer failed otherwise (the error is logged, never sent).
    Internal,
}

impl ProblemKind {
    /// The status the layer answers with.
    pub fn status(self) -> StatusCode {
        match self {
            ProblemKind::CallerUnknown => StatusCode::UNAUTHORIZED,
            ProblemKind::KeyMissing | ProblemKind::KeyMalformed | ProblemKind::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            ProblemKind::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemKind::InProgress | ProblemKind::NotRecorded => StatusCode::CONFLICT,
            ProblemKind::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProblemKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A stable snake_case name (`"key_missing"`), for a machine-readable
    /// field of a custom rendering.
    pub fn as_str(self) -> &'static str {
        match self {
            ProblemKind::CallerUnknown => "caller_unknown",
            ProblemKind::KeyMissing => "key_missing",
            ProblemKind::KeyMalformed => "key_malformed",
            ProblemKind::BodyTooLarge => "body_too_large",
            ProblemKind::BodyUnreadable => "body_unreadable",
            ProblemKind::InProgress => "in_progress",
            ProblemKind::NotRecorded => "not_recorded",
            ProblemKind::Mismatch => "mismatch",
            ProblemKind::StoreUnavailable => "store_unavailable",
            ProblemKind::Internal => "internal",
        }
    }
}

/// One of the layer's own answers, handed to
/// [`IdempotencyLayer::problem_response`](crate::IdempotencyLayer::problem_response)
/// to render. The title and detail are the layer's fixed texts: they never
/// hold an internal error's text (that is logged with `tracing`).
///
/// ```
/// use idem_http::{Problem, ProblemKind};
///
/// let problem = Problem::new(ProblemKind::Mismatch);
/// let response = problem.to_response();
/// assert_eq!(response.status(), 422);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// What went wrong.
    pub kind: ProblemKind,
    /// The status the layer means to answer with (`kind.status()`).
    pub status: StatusCode,
    /// A short, human-readable summary.
    pub title: String,
    /// What the client can do about it.
    pub detail: String,
    /// When to retry (`InProgress`, `StoreUnavailable`): the layer sets
    /// `Retry-After` from it on the rendered response if the renderer did
    /// not set one.
    pub retry_after: Option<Duration>,
}

impl Problem {
    /// A problem of `kind` with the layer's default title and detail.
    pub fn new(kind: ProblemKind) -> Problem {
        let (title, detail) = match kind {
            ProblemKind::CallerUnknown => (
                "Caller unknown",
                "Idempotent requests are scoped by caller; this request does not say who is \
                 calling.",
            ),
            ProblemKind::KeyMissing => (
                "Idempotency key missing",
                "This operation requires an idempotency key.",
            ),
            ProblemKind::KeyMalformed => (
                "Idempotency key malformed",
                "The idempotency key must be 1 to 255 visible ASCII characters (a string, \
                 optionally quoted).",
            ),
            ProblemKind::BodyTooLarge => (
                "Request body too large",
                "The request body is larger than this operation accepts.",
            ),
            ProblemKind::BodyUnreadable => (
                "Request body could not be read",
                "The request body could not be read. Nothing ran.",
            ),
            ProblemKind::InProgress => (
                "A request with this Idempotency-Key is being processed",
                "Retry after the time given in Retry-After to get its response.",
            ),
            ProblemKind::NotRecorded => (
                "The original response was not recorded",
                "A request with this Idempotency-Key was processed, but its response could not \
                 be recorded for replay (it was streamed, too large, or not storable). It will \
                 not be processed again with this key.",
            ),
            ProblemKind::Mismatch => (
                "Idempotency-Key reused with a different request",
                "This key was used with another method, path or body. Use a new key for a new \
                 request.",
            ),
            ProblemKind::StoreUnavailable => (
                "Idempotency store unavailable",
                "The request could not be processed now. Retry after the time given in \
                 Retry-After.",
            ),
            ProblemKind::Internal => (
                "Idempotent processing failed",
                "The request could not be processed. The error was logged.",
            ),
        };
        Problem {
            kind,
            status: kind.status(),
            title: title.to_owned(),
            detail: detail.to_owned(),
            retry_after: None,
        }
    }

    pub(crate) fn with_detail(mut self, detail: impl Into<String>) -> Problem {
        self.detail = detail.into();
        self
    }

    pub(crate) fn with_retry_after(mut self, after: Duration) -> Problem {
        self.retry_after = Some(after);
        self
    }

    /// The default rendering: `application/problem+json` (RFC 9457) with
    /// `type`, `title`, `status` and `detail`, and `Retry-After` when the
    /// problem has one. A custom renderer can fall back to it.
    pub fn to_response(&self) -> Response<LayerBody> {
        let body = serde_json::json!({
            "type": "about:blank",
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        let mut response = Response::new(full(body.to_string()));
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = self.retry_after {
            set_retry_after(&mut response, after);
        }
        response
    }
}

/// `Retry-After` in whole seconds, rounded up, at least 1.
pub(crate) fn set_retry_after<B>(response: &mut Response<B>, after: Duration) {
    let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(seconds.max(1)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_problem_kind_has_its_status_and_a_distinct_name() {
        use ProblemKind::*;
        let kinds = [
            (CallerUnknown, 401),
            (KeyMissing, 400),
            (KeyMalformed, 400),
            (BodyTooLarge, 413),
            (BodyUnreadable, 400),
            (InProgress, 409),
            (NotRecorded, 409),
            (Mismatch, 422),
            (StoreUnavailable, 503),
            (Internal, 500),
        ];
        let mut names = std::collections::HashSet::new();
        for (kind, status) in kinds {
            let problem = Problem::new(kind);
            assert_eq!(
                (problem.status.as_u16(), kind.status().as_u16()),
                (status, status)
            );
            assert!(names.insert(kind.as_str()), "{}", kind.as_str());
            let response = problem
                .with_retry_after(Duration::from_millis(1500))
                .to_response();
            assert_eq!(response.status().as_u16(), status);
            assert_eq!(response.headers()[RETRY_AFTER], "2", "rounded up");
        }
    }
}
