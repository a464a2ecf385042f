//! A TCP proxy on loopback that counts round trips: a *turn* is a burst of
//! client bytes sent after the server last answered. One store operation
//! that costs one round trip adds exactly one turn.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct CountingProxy {
    pub addr: SocketAddr,
    turns: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
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
        let counter = turns.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                tokio::spawn(pipe(client, server, counter.clone()));
            }
        });
        CountingProxy { addr, turns, task }
    }

    pub fn turns(&self) -> u64 {
        self.turns.load(Ordering::SeqCst)
    }
}

impl Drop for CountingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pipe(client: TcpStream, server: TcpStream, turns: Arc<AtomicU64>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // true while the last bytes seen went server -> client.
    let server_spoke = Arc::new(AtomicBool::new(true));
    let up_flag = server_spoke.clone();
    let up_turns = turns.clone();
    let upstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if up_flag.swap(false, Ordering::SeqCst) {
                up_turns.fetch_add(1, Ordering::SeqCst);
            }
            if server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    let downstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            server_spoke.store(true, Ordering::SeqCst);
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    tokio::join!(upstream, downstream);
}
