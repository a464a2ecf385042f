//! A response whose body is still coming when the handler returns its
//! head: its caller gets the head and each frame as it comes, while the
//! run keeps a copy to record, up to the limit. The copy is given up at
//! the limit or at trailers: the rest of the body then goes to the caller
//! as it is, unread by the layer.
//!
//! The copy never waits for the caller: the data it hands on waits in a
//! queue for the caller to read it, so a caller that stops reading (its
//! connection open, its window closed) holds up neither the recording nor
//! the lease. The data waiting there is kept in one buffer (frames the
//! caller has not read yet are joined), so the queue holds the body up to
//! the limit, at most, whatever the size of its frames: past the limit,
//! the rest goes to the caller unread.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use crate::{BoxError, LayerBody};

/// What the copy sends to the caller's body after its data.
enum Piece {
    /// A frame that is not data (trailers).
    Frame(Frame<Bytes>),
    /// The body failed: the caller's body fails with it.
    Failed(BoxError),
    /// The rest of the body, no longer copied: the caller reads it itself.
    Rest(LayerBody),
    /// The body ended.
    End,
}

/// The queue from the copy to the caller's body.
#[derive(Default)]
struct Queue {
    /// Data handed on and not read yet, joined.
    data: BytesMut,
    /// What comes after that data, in order.
    after: VecDeque<Piece>,
    /// The caller's body, waiting for more.
    waker: Option<Waker>,
    /// The copy stopped (its sender dropped).
    closed: bool,
}

fn lock(queue: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    queue.lock().unwrap_or_else(|p| p.into_inner())
}

/// The copy's end of the queue; dropping it (the copy ended, or its task
/// was cut off) closes the queue.
struct Sender(Arc<Mutex<Queue>>);

impl Sender {
    fn data(&self, data: &[u8]) {
        let mut queue = lock(&self.0);
        queue.data.extend_from_slice(data);
        if let Some(waker) = queue.waker.take() {
            waker.wake();
        }
    }

    fn piece(&self, piece: Piece) {
        let mut queue = lock(&self.0);
        queue.after.push_back(piece);
        if let Some(waker) = queue.waker.take() {
            waker.wake();
        }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        let mut queue = lock(&self.0);
        queue.closed = true;
        if let Some(waker) = queue.waker.take() {
            waker.wake();
        }
    }
}

/// The caller's body of a response that streams: the frames read before
/// the head was handed out, then what the copy sends, then the rest of the
/// body if the copy was given up. A copy that stops without saying the
/// body ended (its task was cut off) is an error, never a short body that
/// looks whole.
pub(crate) struct Forwarded {
    read: VecDeque<Frame<Bytes>>,
    queue: Arc<Mutex<Queue>>,
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
            let piece = {
                let mut queue = lock(&this.queue);
                if !queue.data.is_empty() {
                    let data = queue.data.split().freeze();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                match queue.after.pop_front() {
                    Some(piece) => Some(piece),
                    None if queue.closed => None,
                    None => {
                        queue.waker = Some(cx.waker().clone());
                        return Poll::Pending;
                    }
                }
            };
            return match piece {
                Some(Piece::Frame(frame)) => Poll::Ready(Some(Ok(frame))),
                Some(Piece::Rest(rest)) => {
                    this.rest = Some(rest);
                    continue;
                }
                Some(Piece::Failed(error)) => {
                    this.ended = true;
                    Poll::Ready(Some(Err(error)))
                }
                Some(Piece::End) => {
                    this.ended = true;
                    Poll::Ready(None)
                }
                None => {
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
    let queue = Arc::new(Mutex::new(Queue::default()));
    let tx = Sender(queue.clone());
    let caller = Forwarded {
        read,
        queue,
        rest: None,
        ended: false,
    };
    let copying = async move {
        let mut rest = rest;
        loop {
            match rest.frame().await {
                None => {
                    tx.piece(Piece::End);
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
                    match frame.into_data() {
                        Ok(data) => tx.data(&data),
                        Err(frame) => tx.piece(Piece::Frame(frame)),
                    }
                    if let Some(why) = given_up {
                        tx.piece(Piece::Rest(rest));
                        return Err(why);
                    }
                }
                Some(Err(error)) => {
                    let why = format!("the response body failed: {error}");
                    tx.piece(Piece::Failed(error));
                    return Err(why);
                }
            }
        }
    };
    (caller, copying)
}
