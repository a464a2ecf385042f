//! A response whose body is still coming when the handler returns its
//! head: its caller gets the head and each frame as it comes, while the
//! run keeps a copy to record, up to the limit. The copy is given up at
//! the limit or at trailers: the rest of the body then goes to the caller
//! as it is, unread by the layer.
//!
//! The copy never waits for the caller: the frames it hands on wait in a
//! queue for the caller to read them, so a caller that stops reading (its
//! connection open, its window closed) holds up neither the recording nor
//! the lease. The queue holds what the copy holds, the body up to the
//! limit, at most: past it, the rest goes to the caller unread.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::mpsc;

use crate::{BoxError, LayerBody};

/// What the copy sends to the caller's body.
enum Piece {
    Frame(Frame<Bytes>),
    /// The body failed: the caller's body fails with it.
    Failed(BoxError),
    /// The rest of the body, no longer copied: the caller reads it itself.
    Rest(LayerBody),
    /// The body ended.
    End,
}

/// The caller's body of a response that streams: the frames read before
/// the head was handed out, then what the copy sends, then the rest of the
/// body if the copy was given up. A copy that stops without saying the
/// body ended (its task was cut off) is an error, never a short body that
/// looks whole.
pub(crate) struct Forwarded {
    read: VecDeque<Frame<Bytes>>,
    pieces: mpsc::UnboundedReceiver<Piece>,
    rest: Option<LayerBody>,
    ended: bool,
}

impl Body for Forwarded {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            if let Some(frame) = this.read.pop_front() {
                return Poll::Ready(Some(Ok(frame)));
            }
            if let Some(rest) = this.rest.as_mut() {
                return Pin::new(rest).poll_frame(cx);
            }
            if this.ended {
                return Poll::Ready(None);
            }
            return match this.pieces.poll_recv(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Some(Piece::Frame(frame))) => Poll::Ready(Some(Ok(frame))),
                Poll::Ready(Some(Piece::Rest(rest))) => {
                    this.rest = Some(rest);
                    continue;
                }
                Poll::Ready(Some(Piece::Failed(error))) => {
                    this.ended = true;
                    Poll::Ready(Some(Err(error)))
                }
                Poll::Ready(Some(Piece::End)) => {
                    this.ended = true;
                    Poll::Ready(None)
                }
                Poll::Ready(None) => {
                    this.ended = true;
                    Poll::Ready(Some(Err(
                        "the response was cut off before its end (its task stopped)".into(),
                    )))
                }
            };
        }
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_empty()
            && match &self.rest {
                Some(rest) => rest.is_end_stream(),
                None => self.ended,
            }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.rest {
            Some(rest) if self.read.is_empty() => rest.size_hint(),
            _ => SizeHint::new(),
        }
    }
}

/// Splits a body whose next frame is not there yet: `read` (data frames
/// already read, `size` bytes in all, within `limit`), then `rest`. Returns
/// the caller's body, to send now, and the copy: a future that reads the
/// rest, hands each frame on and ends with the whole body (`Ok`, to
/// record) or why it was not kept (`Err`: past `limit` bytes, trailers, a
/// failed body). The copy goes at the body's pace, never the caller's: a
/// caller that stops reading or goes away does not hold it up (the
/// handler's response is still recorded).
pub(crate) fn tee(
    read: VecDeque<Frame<Bytes>>,
    size: usize,
    rest: LayerBody,
    limit: usize,
) -> (Forwarded, impl Future<Output = Result<Bytes, String>>) {
    let mut copy = BytesMut::with_capacity(size);
    for frame in &read {
        if let Some(data) = frame.data_ref() {
            copy.extend_from_slice(data);
        }
    }
    let (tx, pieces) = mpsc::unbounded_channel();
    let caller = Forwarded {
        read,
        pieces,
        rest: None,
        ended: false,
    };
    let copying = async move {
        let mut rest = rest;
        loop {
            match rest.frame().await {
                None => {
                    let _ = tx.send(Piece::End);
                    return Ok(copy.freeze());
                }
                Some(Ok(frame)) => {
                    let given_up = match frame.data_ref() {
                        Some(data) if copy.len().saturating_add(data.len()) <= limit => {
                            copy.extend_from_slice(data);
                            None
                        }
                        Some(_) => Some(format!(
                            "the response body is larger than max_response_bytes ({limit} bytes)"
                        )),
                        None => {
                            Some("the response has trailers, which are not recorded".to_owned())
                        }
                    };
                    // A caller gone: the copy goes on (the response is
                    // still recorded).
                    let _ = tx.send(Piece::Frame(frame));
                    if let Some(why) = given_up {
                        let _ = tx.send(Piece::Rest(rest));
                        return Err(why);
                    }
                }
                Some(Err(error)) => {
                    let why = format!("the response body failed: {error}");
                    let _ = tx.send(Piece::Failed(error));
                    return Err(why);
                }
            }
        }
    };
    (caller, copying)
}
