//! The Redis store's own connections: the probe connection of `connect` is
//! closed once connected, and a server full of clients (`maxclients`) is a
//! passing condition (`Unavailable`), not a wrong password, even with a
//! password in the URL.

use std::time::{Duration, Instant};

use idemkit::redis::RedisStore;
use idemkit::{Acquisition, IdempotencyStore, StoreError};

use super::{key, report};
use crate::support;

/// `RedisStore::connect`'s first, unretried connection
/// (the probe) is closed: after connecting, the server sees one client of
/// the store, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_connect_probe_connection_is_closed() {
    let started = Instant::now();
    let server = tokio::task::block_in_place(|| support::redis_server::RedisServer::start(&[]));
    let store = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(store
        .acquire(&key("access.probe"), None, Duration::from_secs(30))
        .await
        .is_ok());
    let deadline = Instant::now() + Duration::from_secs(5);
    let clients = loop {
        // `command` opens a connection of its own: one line is the admin.
        let list = tokio::task::block_in_place(|| server.command("CLIENT LIST"));
        let n = list.lines().filter(|l| l.contains("id=")).count() - 1;
        if n <= 1 || Instant::now() > deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    report(
        "redis-connect-probe",
        "redis",
        &[("store_clients", clients.to_string())],
        started,
    );
    assert_eq!(clients, 1, "the store keeps one connection");
    drop(store);
}

/// Sends `lines` (one command each) on a raw admin connection to Redis
/// (kept open between calls: it may be the last client a full server
/// lets in) and returns what came back.
fn send_commands(stream: &mut std::net::TcpStream, lines: &[&str]) -> String {
    use std::io::{Read, Write};
    let mut out = String::new();
    for line in lines {
        stream
            .write_all(format!("{line}\r\n").as_bytes())
            .unwrap_or_else(|e| panic!("write to redis: {e}"));
        let mut buf = vec![0u8; 4096];
        let n = stream.read(&mut buf).unwrap_or(0);
        out.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    out
}

/// A Redis that has as many clients as `maxclients` answers a new
/// connection `-ERR max number of clients reached` and closes it: a load
/// condition that passes (PostgreSQL's "too many connections", 53300, is
/// `Unavailable` in PgStore). With a password in the URL, the redis crate
/// reads that reply as the answer to AUTH and reports
/// `AuthenticationFailed`; the store must still answer the retryable
/// `Unavailable`, not the `Backend` of a wrong password (a consumer would
/// dead-letter a message that succeeds a moment later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_max_clients_is_not_a_wrong_password() {
    let started = Instant::now();
    let server = tokio::task::block_in_place(|| support::redis_server::RedisServer::start(&[]));
    assert!(server
        .command("CONFIG SET requirepass secret")
        .starts_with("+OK"));
    // Through a TCP forwarder, as across any network hop (a load balancer,
    // a sidecar, a few hundred microseconds of distance): the server's
    // refusal reaches the client before the server sees the client's AUTH.
    let upstream: std::net::SocketAddr = format!("127.0.0.1:{}", server.port)
        .parse()
        .unwrap_or_else(|e| panic!("{e}"));
    let proxy = one_way_latency(upstream, Duration::from_millis(20)).await;
    let url = format!("redis://:secret@{proxy}/");
    let store = RedisStore::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        store
            .acquire(&key("access.maxclients"), None, Duration::from_secs(30))
            .await,
        Ok(Acquisition::Acquired(_))
    ));
    let mut admin =
        std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap_or_else(|e| panic!("{e}"));
    let _ = admin.set_read_timeout(Some(Duration::from_secs(5)));
    // A burst of clients: the server is full (only the admin connection
    // left), and the store's connection is dropped (a server-side
    // timeout, a network blip).
    let said = tokio::task::block_in_place(|| {
        send_commands(
            &mut admin,
            &[
                "AUTH secret",
                "CONFIG SET maxclients 1",
                "CLIENT KILL TYPE normal SKIPME yes",
            ],
        )
    });
    let during = store
        .acquire(&key("access.maxclients"), None, Duration::from_secs(30))
        .await;
    let during_again = store
        .acquire(&key("access.maxclients"), None, Duration::from_secs(30))
        .await;
    // A fresh connect while it lasts.
    let connect = RedisStore::connect(&url).await.map(|_| ());
    // The burst is over.
    tokio::task::block_in_place(|| send_commands(&mut admin, &["CONFIG SET maxclients 10000"]));
    let deadline = Instant::now() + Duration::from_secs(10);
    let after_key = key("access.maxclients");
    let after = loop {
        let r = store
            .acquire(&after_key, None, Duration::from_secs(30))
            .await;
        if r.is_ok() || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let show = |r: &Result<_, StoreError>| match r {
        Ok(_) => "ok".to_owned(),
        Err(e) => format!(
            "{}:{e}",
            if e.is_retryable() {
                "retryable"
            } else {
                "NOT-retryable"
            }
        ),
    };
    let during_s = show(&during.as_ref().map(|_| ()).map_err(clone_kind));
    let again_s = show(&during_again.as_ref().map(|_| ()).map_err(clone_kind));
    let connect_s = show(&connect.as_ref().map(|_| ()).map_err(clone_kind));
    report(
        "redis-maxclients",
        "redis",
        &[
            ("admin", format!("{:?}", said.replace("\r\n", " "))),
            ("during", format!("{during_s:?}")),
            ("during_again", format!("{again_s:?}")),
            ("connect", format!("{connect_s:?}")),
            ("after", format!("{}", after.is_ok())),
        ],
        started,
    );
    assert!(
        after.is_ok(),
        "the store works again once the burst is over: {after:?}"
    );
    for (what, r) in [("a call", &during), ("a second call", &during_again)] {
        if let Err(e) = r {
            assert!(
                e.is_retryable(),
                "{what} while the server is full of clients must be retryable (Unavailable), got {e:?}"
            );
        }
    }
    if let Err(e) = &connect {
        assert!(
            e.is_retryable(),
            "connect while the server is full of clients must be retryable, got {e:?}"
        );
    }
}

/// A copy of what matters in an error, for printing.
fn clone_kind(e: &StoreError) -> StoreError {
    if e.is_retryable() {
        StoreError::Unavailable(e.to_string().into())
    } else {
        StoreError::Backend(e.to_string().into())
    }
}

/// A TCP forwarder to `upstream` that delivers the server's bytes `delay`
/// late (one-way network latency) and the client's at once; a close on
/// either side is passed on as a half-close, as TCP does.
async fn one_way_latency(upstream: std::net::SocketAddr, delay: Duration) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = async move {
                    let _ = tokio::io::copy(&mut cr, &mut sw).await;
                    let _ = sw.shutdown().await;
                };
                let down = async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        tokio::time::sleep(delay).await;
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = cw.shutdown().await;
                };
                tokio::join!(up, down);
            });
        }
    });
    addr
}
