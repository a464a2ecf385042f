//! Raw wire for the proxy tests: HTTP/1.1 and h2c upstreams written by
//! hand (answers a real server would not give), raw clients, and a proxy
//! that may refuse to start.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{options, raw_exchange, scope, Proxy, RawAnswer};

/// The proxy on the memory store, anonymous callers allowed.
pub(crate) fn memory(upstream: &str, tag: &str, more: &[&str]) -> Vec<String> {
    let mut args = options(upstream, "memory", &scope(tag), &["--allow-anonymous"]);
    args.extend(more.iter().map(|s| s.to_string()));
    args
}

/// One request read off a raw upstream connection.
#[allow(dead_code)]
pub(crate) struct Seen {
    pub(crate) head: String,
    pub(crate) body: Vec<u8>,
}

/// Reads one request (head, and a `Content-Length` body) from `stream`;
/// `None` at EOF. `read_body: false` leaves the body unread.
pub(crate) async fn read_request(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    read_body: bool,
) -> Option<Seen> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let length = head
                .lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(n, _)| n.trim().eq_ignore_ascii_case("content-length"))
                .and_then(|(_, v)| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            buf.drain(..end + 4);
            if !read_body {
                return Some(Seen {
                    head,
                    body: Vec::new(),
                });
            }
            while buf.len() < length {
                let mut chunk = [0u8; 65536];
                match stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            let body = buf.drain(..length).collect();
            return Some(Seen { head, body });
        }
        let mut chunk = [0u8; 65536];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A raw HTTP/1.1 upstream: every request it reads (on any connection)
/// is numbered from 1, and `answer(n, &request)` says what bytes to write
/// back, and whether to close the connection then (`None`: close it
/// unanswered). Returns its URL and the count.
pub(crate) async fn raw_upstream<F>(read_body: bool, answer: F) -> (String, Arc<AtomicUsize>)
where
    F: Fn(usize, &Seen) -> Option<(Vec<u8>, bool)> + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    serve_raw(listener, read_body, answer)
}

/// [`raw_upstream`] on a listener of the caller's.
pub(crate) fn serve_raw<F>(
    listener: TcpListener,
    read_body: bool,
    answer: F,
) -> (String, Arc<AtomicUsize>)
where
    F: Fn(usize, &Seen) -> Option<(Vec<u8>, bool)> + Send + Sync + 'static,
{
    let addr = listener.local_addr().expect("addr");
    let count = Arc::new(AtomicUsize::new(0));
    let answer = Arc::new(answer);
    let counted = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let (count, answer) = (counted.clone(), answer.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some(seen) = read_request(&mut stream, &mut buf, read_body).await {
                    let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                    match answer(n, &seen) {
                        Some((bytes, close)) => {
                            if stream.write_all(&bytes).await.is_err() || close {
                                return;
                            }
                        }
                        None => return,
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), count)
}

pub(crate) fn response(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Runs `idem proxy ARGS` until it exits (its code, stdout, stderr) or
/// prints its ready line (`None`: it started, and is killed).
pub(crate) fn run_to_exit_or_started(args: &[String]) -> (Option<i32>, String, String) {
    use std::io::Read as _;
    let mut all = vec!["proxy".to_owned()];
    all.extend(args.iter().cloned());
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(&all)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn idem proxy");
    let mut stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut byte = [0u8; 256];
        loop {
            match stdout.read(&mut byte) {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&byte[..n]),
            }
            if String::from_utf8_lossy(&seen).contains("listening on") {
                break;
            }
        }
        let _ = tx.send(String::from_utf8_lossy(&seen).into_owned());
    });
    let out = rx.recv_timeout(Duration::from_secs(20)).unwrap_or_default();
    if out.contains("listening on") {
        let _ = child.kill();
        let _ = child.wait();
        return (None, out, "(it started)".to_owned());
    }
    if !matches!(child.try_wait(), Ok(Some(_))) {
        let _ = child.kill();
    }
    let done = child.wait_with_output().expect("output");
    (
        done.status.code(),
        out,
        String::from_utf8_lossy(&done.stderr).into_owned(),
    )
}

/// Whether the proxy closed `stream` within `within` (EOF or reset).
pub(crate) async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut byte = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut byte)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

/// Writes `raw` and reads until the proxy closes: status and body text,
/// or why none came.
pub(crate) async fn try_raw(addr: &str, raw: &[u8]) -> Result<(u16, String), String> {
    let mut stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    // A peer that answers before reading everything may reset: keep what
    // was read.
    let _ = stream.write_all(raw).await;
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no answer: {text:?}"))?;
    Ok((status, text.chars().take(300).collect()))
}

/// A hand-rolled h2c upstream: the second stream it sees (the first is
/// the proxy's check at start) is refused with
/// `RST_STREAM(REFUSED_STREAM)` (RFC 9113 8.7: "the stream was not
/// processed", what a server sends when it is at its limit or restarting);
/// every later stream is answered `200` at once. Returns its URL and the
/// streams answered.
pub(crate) async fn h2c_refusing_its_second_stream() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let answered = Arc::new(AtomicUsize::new(0));
    let streams = Arc::new(AtomicUsize::new(0));
    let counted = answered.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let (answered, streams) = (counted.clone(), streams.clone());
            tokio::spawn(async move {
                // Server preface: an empty SETTINGS frame.
                if stream
                    .write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0])
                    .await
                    .is_err()
                {
                    return;
                }
                let mut preface = [0u8; 24];
                if stream.read_exact(&mut preface).await.is_err() {
                    return;
                }
                loop {
                    let mut head = [0u8; 9];
                    if stream.read_exact(&mut head).await.is_err() {
                        return;
                    }
                    let len = (usize::from(head[0]) << 16)
                        | (usize::from(head[1]) << 8)
                        | usize::from(head[2]);
                    let (kind, flags) = (head[3], head[4]);
                    let id = [head[5] & 0x7f, head[6], head[7], head[8]];
                    let mut payload = vec![0u8; len];
                    if stream.read_exact(&mut payload).await.is_err() {
                        return;
                    }
                    let reply: Vec<u8> = match kind {
                        // SETTINGS (not an ACK): ACK it.
                        4 if flags & 1 == 0 => vec![0, 0, 0, 4, 1, 0, 0, 0, 0],
                        // PING: answer it.
                        6 if flags & 1 == 0 => {
                            let mut r = vec![0, 0, 8, 6, 1, 0, 0, 0, 0];
                            r.extend_from_slice(&payload);
                            r
                        }
                        // HEADERS: a new request.
                        1 => {
                            // The proxy's check at start is stream 0.
                            if streams.fetch_add(1, Ordering::SeqCst) == 1 {
                                // RST_STREAM, REFUSED_STREAM (0x7).
                                let mut r = vec![0, 0, 4, 3, 0];
                                r.extend_from_slice(&id);
                                r.extend_from_slice(&[0, 0, 0, 7]);
                                r
                            } else {
                                answered.fetch_add(1, Ordering::SeqCst);
                                // HEADERS, END_STREAM | END_HEADERS, `:status 200`
                                // (HPACK static index 8).
                                let mut r = vec![0, 0, 1, 1, 5];
                                r.extend_from_slice(&id);
                                r.push(0x88);
                                r
                            }
                        }
                        _ => Vec::new(),
                    };
                    if !reply.is_empty() && stream.write_all(&reply).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), answered)
}

pub(crate) fn error_lines(proxy: &Proxy) -> String {
    proxy
        .logs()
        .lines()
        .filter(|l| l.contains("ERROR") || l.contains("WARN"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// With `processed`: the second stream is processed (counted), then the
/// upstream sends `GOAWAY` naming that very stream as the last it may
/// have acted on, with the error code REFUSED_STREAM, and closes.
pub(crate) async fn h2c_going_away(processed: bool) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let answered = Arc::new(AtomicUsize::new(0));
    let streams = Arc::new(AtomicUsize::new(0));
    let counted = answered.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let (answered, streams) = (counted.clone(), streams.clone());
            tokio::spawn(async move {
                if stream
                    .write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0])
                    .await
                    .is_err()
                {
                    return;
                }
                let mut preface = [0u8; 24];
                if stream.read_exact(&mut preface).await.is_err() {
                    return;
                }
                let mut gone = false;
                loop {
                    let mut head = [0u8; 9];
                    if stream.read_exact(&mut head).await.is_err() {
                        return;
                    }
                    let len = (usize::from(head[0]) << 16)
                        | (usize::from(head[1]) << 8)
                        | usize::from(head[2]);
                    let (kind, flags) = (head[3], head[4]);
                    let id = u32::from_be_bytes([head[5] & 0x7f, head[6], head[7], head[8]]);
                    let mut payload = vec![0u8; len];
                    if stream.read_exact(&mut payload).await.is_err() {
                        return;
                    }
                    if gone {
                        continue;
                    }
                    let reply: Vec<u8> = match kind {
                        4 if flags & 1 == 0 => vec![0, 0, 0, 4, 1, 0, 0, 0, 0],
                        6 if flags & 1 == 0 => {
                            let mut r = vec![0, 0, 8, 6, 1, 0, 0, 0, 0];
                            r.extend_from_slice(&payload);
                            r
                        }
                        1 => {
                            if streams.fetch_add(1, Ordering::SeqCst) == 1 {
                                gone = true;
                                let (last, code) = if processed {
                                    // Acted on, then going away with an
                                    // error, this stream included.
                                    answered.fetch_add(1, Ordering::SeqCst);
                                    (id, 7u32)
                                } else {
                                    // GOAWAY, last stream id below this
                                    // one, NO_ERROR: not processed.
                                    (id.saturating_sub(2), 0u32)
                                };
                                let mut r = vec![0, 0, 8, 7, 0, 0, 0, 0, 0];
                                r.extend_from_slice(&last.to_be_bytes());
                                r.extend_from_slice(&code.to_be_bytes());
                                if processed {
                                    let _ = stream.write_all(&r).await;
                                    let _ = stream.flush().await;
                                    return;
                                }
                                r
                            } else {
                                answered.fetch_add(1, Ordering::SeqCst);
                                let mut r = vec![0, 0, 1, 1, 5];
                                r.extend_from_slice(&id.to_be_bytes());
                                r.push(0x88);
                                r
                            }
                        }
                        _ => Vec::new(),
                    };
                    if !reply.is_empty() && stream.write_all(&reply).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), answered)
}

pub(crate) fn raw_post(path: &str, key: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

pub(crate) fn body_text(a: &RawAnswer) -> String {
    String::from_utf8_lossy(&a.body).into_owned()
}

/// Sends `raw` on fresh connections until the answer is not a 409 (5 s).
pub(crate) async fn raw_settled(addr: &str, raw: &[u8]) -> RawAnswer {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let answer = raw_exchange(addr, raw).await;
        if answer.status != 409 || Instant::now() >= deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
