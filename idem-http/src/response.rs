//! The layer's answers: the body type, the recording policy's default,
//! the replay of a recorded response, and the rendering of problems.

use std::convert::Infallible;
use std::sync::Mutex;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use idem_core::IdempotencyKey;

use crate::layer::Config;
use crate::problem;
use crate::recorded::Recorded;
#[cfg(doc)]
use crate::{IdempotencyLayer, IDEMPOTENCY_KEY};
use crate::{Problem, ProblemKind};

/// The response header set on a replayed response (`true`); see
/// [`IDEMPOTENCY_KEY`] for an example.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The body of the layer's responses: the handler's own body, passed
/// through, or a recorded or problem body. Read it as any
/// [`http_body::Body`]:
///
/// ```
/// use http_body_util::BodyExt;
/// use idem_http::{Problem, ProblemKind};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_http::BoxError> {
/// let body = Problem::new(ProblemKind::Mismatch).to_response().into_body();
/// let bytes = body.collect().await?.to_bytes();
/// assert!(bytes.starts_with(b"{"));
/// # Ok(()) }
/// ```
pub type LayerBody = UnsyncBoxBody<Bytes, BoxError>;
/// A boxed error: the error of a [`LayerBody`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The default of [`IdempotencyLayer::record_status`]: `true` (record)
/// for every status but those that say "nothing happened, try again":
/// 401, 408, 425, 429, 502, 503, 504.
///
/// ```
/// use http::StatusCode;
/// use idem_http::default_record_status;
///
/// assert!(default_record_status(StatusCode::CREATED));
/// assert!(default_record_status(StatusCode::INTERNAL_SERVER_ERROR), "it may have done part of its work");
/// assert!(!default_record_status(StatusCode::TOO_MANY_REQUESTS), "nothing happened: a retry runs");
/// ```
pub fn default_record_status(status: StatusCode) -> bool {
    !matches!(status.as_u16(), 401 | 408 | 425 | 429 | 502 | 503 | 504)
}

/// A problem as the layer's renderer makes it: the custom one if set
/// (the default if that panics), with `Retry-After` when it has one.
pub(crate) fn render<S: ?Sized, C>(config: &Config<S, C>, problem: Problem) -> Response<LayerBody> {
    let mut response = render_problem(config, problem);
    response
        .extensions_mut()
        .insert(crate::service::LayerAnswer);
    response
}

fn render_problem<S: ?Sized, C>(config: &Config<S, C>, problem: Problem) -> Response<LayerBody> {
    let Some(custom) = &config.render else {
        return problem.to_response();
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| custom(&problem))) {
        Ok(mut response) => {
            if let Some(after) = problem.retry_after {
                if !response.headers().contains_key(RETRY_AFTER) {
                    problem::set_retry_after(&mut response, after);
                }
            }
            response
        }
        Err(_) => {
            tracing::error!(
                kind = problem.kind.as_str(),
                "idempotency layer: the problem renderer panicked; the default rendering was sent"
            );
            problem.to_response()
        }
    }
}

/// The replay of a recorded response, marked `Idempotent-Replayed: true`,
/// through the replay hook if there is one.
pub(crate) fn replay<S: ?Sized, C>(
    config: &Config<S, C>,
    key: &IdempotencyKey,
    recorded: Recorded,
) -> Response<LayerBody> {
    let Ok(status) = StatusCode::from_u16(recorded.status) else {
        tracing::error!(
            status = recorded.status,
            key = %key,
            "idempotency layer: the recorded status is not valid"
        );
        return render(config, Problem::new(ProblemKind::Internal));
    };
    let mut response = Response::new(recorded.body.0.clone());
    *response.status_mut() = status;
    *response.headers_mut() = recorded.header_map();
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if let Some(hook) = &config.on_replay {
        let hooked =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&mut response, key)));
        if hooked.is_err() {
            // The response may be half edited: none of it is sent.
            tracing::error!(key = %key, "idempotency layer: the replay hook panicked");
            return render(config, Problem::new(ProblemKind::Internal));
        }
    }
    response.map(full)
}

pub(crate) fn box_response<B>(response: Response<B>) -> Response<LayerBody>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    response.map(|b| b.map_err(Into::into).boxed_unsync())
}

pub(crate) fn full(bytes: impl Into<Bytes>) -> LayerBody {
    Full::new(bytes.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

/// Whether a response is a `text/event-stream`.
pub(crate) fn is_event_stream(headers: &http::HeaderMap) -> bool {
    let media = headers
        .get(CONTENT_TYPE)
        .map(|v| v.as_bytes().split(|&b| b == b';').next().unwrap_or(b""))
        .unwrap_or(b"");
    media
        .trim_ascii()
        .eq_ignore_ascii_case(b"text/event-stream")
}

pub(crate) fn put<T>(slot: &Mutex<Option<T>>, value: T) {
    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(value);
}
