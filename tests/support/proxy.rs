//! A TCP proxy on loopback that counts round trips: a *turn* is a burst of
//! client bytes sent after the server last answered. One store operation
//! that costs one round trip adds exactly one turn.
//!
//! It can also lose replies: after a request that contains a given pattern
//! (every n-th such request), the server's next reply on that connection is
//! dropped and the connection is cut, as when a network failure strikes
//! after the server ran the command. The client then sees a dropped
//! connection and may resend the command, which the server runs again.
//!
//! Or hold requests back: a request that contains a given pattern reaches
//! the server only after a delay (its reply comes that much later too), as
//! over a slow link or to a server that answers late.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

pub struct CountingProxy {
    pub addr: SocketAddr,
    turns: Arc<AtomicU64>,
    loss: Arc<Loss>,
    late: Arc<Late>,
    cut: Arc<AtomicBool>,
    pipes: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    task: tokio::task::JoinHandle<()>,
}

/// Which replies to lose.
#[derive(Default)]
struct Loss {
    /// Requests containing this are counted; empty: nothing is lost.
    pattern: Mutex<Vec<u8>>,
    /// Every `every`-th counted request loses its reply.
    every: AtomicU64,
    /// How many replies may still be lost.
    budget: AtomicU64,
    /// Counted requests so far.
    seen: AtomicU64,
    /// Replies lost so far.
    dropped: AtomicU64,
}

/// Which requests to hold back, and how long.
#[derive(Default)]
struct Late {
    /// Requests containing this are held back; empty: none.
    pattern: Mutex<Vec<u8>>,
    /// For how long.
    delay: Mutex<Duration>,
    /// Requests held back so far.
    held: AtomicU64,
}

impl Late {
    /// How long this request chunk is held back, if at all.
    fn hit(&self, chunk: &[u8]) -> Option<Duration> {
        let pattern = self.pattern.lock().unwrap_or_else(|p| p.into_inner());
        if pattern.is_empty() || !chunk.windows(pattern.len()).any(|w| w == &pattern[..]) {
            return None;
        }
        self.held.fetch_add(1, Ordering::SeqCst);
        Some(*self.delay.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Loss {
    /// Whether the reply to this request chunk is to be lost.
    fn hit(&self, chunk: &[u8]) -> bool {
        let pattern = self.pattern.lock().unwrap_or_else(|p| p.into_inner());
        if pattern.is_empty() || !chunk.windows(pattern.len()).any(|w| w == &pattern[..]) {
            return false;
        }
        let seen = self.seen.fetch_add(1, Ordering::SeqCst) + 1;
        let every = self.every.load(Ordering::SeqCst).max(1);
        seen.is_multiple_of(every)
            && self
                .budget
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| b.checked_sub(1))
                .is_ok()
    }
}

impl CountingProxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> CountingProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("proxy bind: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("proxy addr: {e}"));
        let turns = Arc::new(AtomicU64::new(0));
        let loss = Arc::new(Loss::default());
        let late = Arc::new(Late::default());
        let (counter, rule, slow) = (turns.clone(), loss.clone(), late.clone());
        let cut = Arc::new(AtomicBool::new(false));
        let pipes: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let (is_cut, open) = (cut.clone(), pipes.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if is_cut.load(Ordering::SeqCst) {
                    // Cut off: the connection is closed at once, as by a
                    // server that is not there.
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let piped = tokio::spawn(pipe(
                    client,
                    server,
                    counter.clone(),
                    rule.clone(),
                    slow.clone(),
                ));
                let mut open = open.lock().unwrap_or_else(|p| p.into_inner());
                open.retain(|p| !p.is_finished());
                open.push(piped.abort_handle());
            }
        });
        CountingProxy {
            addr,
            turns,
            loss,
            late,
            cut,
            pipes,
            task,
        }
    }

    pub fn turns(&self) -> u64 {
        self.turns.load(Ordering::SeqCst)
    }

    /// From now on, every `every`-th request containing `pattern` (say
    /// `b"EVALSHA"`) loses its reply and has its connection cut, at most
    /// `budget` times in all.
    pub fn lose_replies_to(&self, pattern: &[u8], every: u64, budget: u64) {
        self.loss.seen.store(0, Ordering::SeqCst);
        self.loss.every.store(every.max(1), Ordering::SeqCst);
        self.loss.budget.store(budget, Ordering::SeqCst);
        *self.loss.pattern.lock().unwrap_or_else(|p| p.into_inner()) = pattern.to_vec();
    }

    /// From now on, every request containing `pattern` (say
    /// `b"AmazonSQS.SendMessage\r"`) reaches the server `delay` late, and
    /// what follows it on its connection too.
    pub fn delay_requests_to(&self, pattern: &[u8], delay: Duration) {
        *self.late.delay.lock().unwrap_or_else(|p| p.into_inner()) = delay;
        *self.late.pattern.lock().unwrap_or_else(|p| p.into_inner()) = pattern.to_vec();
    }

    /// Requests held back so far.
    pub fn delayed(&self) -> u64 {
        self.late.held.load(Ordering::SeqCst)
    }

    /// Cuts every connection through the proxy and closes new ones at
    /// once (`true`), as a server that went away; `false` lets them
    /// through again.
    pub fn cut(&self, on: bool) {
        self.cut.store(on, Ordering::SeqCst);
        if on {
            for pipe in self
                .pipes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .drain(..)
            {
                pipe.abort();
            }
        }
    }

    /// Replies lost so far.
    pub fn lost(&self) -> u64 {
        self.loss.dropped.load(Ordering::SeqCst)
    }
}

impl Drop for CountingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pipe(
    client: TcpStream,
    server: TcpStream,
    turns: Arc<AtomicU64>,
    loss: Arc<Loss>,
    late: Arc<Late>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // true while the last bytes seen went server -> client.
    let server_spoke = Arc::new(AtomicBool::new(true));
    // Set when the server's next reply on this connection is to be lost.
    let lose_next = Arc::new(AtomicBool::new(false));
    // Told when a reply was lost: the connection is cut both ways.
    let cut = Arc::new(Notify::new());
    let up_flag = server_spoke.clone();
    let up_turns = turns.clone();
    let (up_lose, up_cut) = (lose_next.clone(), cut.clone());
    let lost = loss.clone();
    let upstream = async move {
        let forward = async {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match client_read.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if up_flag.swap(false, Ordering::SeqCst) {
                    up_turns.fetch_add(1, Ordering::SeqCst);
                }
                if loss.hit(&buf[..n]) {
                    up_lose.store(true, Ordering::SeqCst);
                }
                if let Some(delay) = late.hit(&buf[..n]) {
                    tokio::time::sleep(delay).await;
                }
                if server_write.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        };
        tokio::select! {
            _ = forward => {}
            _ = up_cut.notified() => {}
        }
    };
    let down_cut = cut.clone();
    let downstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            server_spoke.store(true, Ordering::SeqCst);
            if lose_next.swap(false, Ordering::SeqCst) {
                // The reply is lost and the connection cut.
                lost.dropped.fetch_add(1, Ordering::SeqCst);
                down_cut.notify_one();
                break;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    tokio::join!(upstream, downstream);
}
