//! What the proxy forwards, adds and removes.

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{json, Value};

use super::wire::{body_text, memory, raw_settled, raw_upstream, response, try_raw};
use super::{
    anonymous, client, header_values, options, post, raw_exchange, scope, send, settled, Proxy,
    Upstream,
};

fn echo_request(key: &str, extra: &str) -> Vec<u8> {
    let body = r#"{"amount":1}"#;
    format!(
        "POST /echo HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n{extra}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[tokio::test(flavor = "multi_thread")]
async fn hop_by_hop_headers_are_not_forwarded_either_way() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("hops"), &[]));
    let answer = raw_exchange(
        &proxy.addr(),
        &echo_request(
            "hops-1",
            "Connection: close, x-drop-me\r\nX-Drop-Me: secret\r\nKeep-Alive: timeout=5\r\n\
             TE: trailers\r\nUpgrade: websocket\r\nProxy-Connection: keep-alive\r\n\
             X-Keep-Me: yes\r\n",
        ),
    )
    .await;
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );

    let seen = upstream.seen("hops-1").await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    let got = &seen[0];
    for name in [
        "x-drop-me",
        "keep-alive",
        "te",
        "upgrade",
        "proxy-connection",
    ] {
        assert!(
            header_values(got, name).is_empty(),
            "{name} reached the upstream: {}",
            got["headers"]
        );
    }
    for value in header_values(got, "connection") {
        assert!(
            !value.to_lowercase().contains("x-drop-me"),
            "the client's Connection reached the upstream: {value}"
        );
    }
    assert_eq!(header_values(got, "x-keep-me"), vec!["yes"]);
    assert_eq!(
        header_values(got, "idempotency-key"),
        vec!["hops-1"],
        "the key header is forwarded as is"
    );

    // The upstream's own hop-by-hop headers do not reach the client.
    assert!(
        answer.values("x-secret-hop").is_empty(),
        "{:?}",
        answer.headers
    );
    assert!(
        answer.values("proxy-connection").is_empty(),
        "{:?}",
        answer.headers
    );
    assert!(
        answer
            .values("keep-alive")
            .iter()
            .all(|v| !v.contains("99")),
        "{:?}",
        answer.headers
    );
    assert!(
        answer
            .values("connection")
            .iter()
            .all(|v| !v.contains("x-secret-hop")),
        "{:?}",
        answer.headers
    );
    assert_eq!(answer.values("x-upstream-kept"), vec!["yes"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn forwarding_headers_name_the_client_and_the_original_host() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("fwd"), &[]));
    let answer = raw_exchange(
        &proxy.addr(),
        &echo_request(
            "fwd-1",
            "Connection: close\r\nX-Forwarded-For: 203.0.113.7\r\n",
        ),
    )
    .await;
    assert_eq!(answer.status, 200);

    let seen = upstream.seen("fwd-1").await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    let got = &seen[0];
    let chain: Vec<String> = header_values(got, "x-forwarded-for")
        .join(",")
        .split(',')
        .map(|s| s.trim().to_owned())
        .collect();
    assert_eq!(
        chain,
        vec!["203.0.113.7", "127.0.0.1"],
        "the client's address is appended"
    );
    let forwarded = header_values(got, "forwarded")
        .join(",")
        .to_lowercase()
        .replace('"', "");
    assert!(
        forwarded.contains("for=127.0.0.1")
            && forwarded.contains("proto=http")
            && forwarded.contains("host=shop.test"),
        "Forwarded: {forwarded:?}"
    );
    assert_eq!(header_values(got, "x-forwarded-proto"), vec!["http"]);
    assert_eq!(header_values(got, "x-forwarded-host"), vec!["shop.test"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_sent_fence_header_is_replaced_by_the_proxys_own() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("fence"), &[]));
    let forged = u64::MAX.to_string();
    let mut fences = Vec::new();
    for key in ["fence-1", "fence-2"] {
        let answer = send(
            client()
                .post(proxy.at("/echo"))
                .header("Idempotency-Key", key)
                .header("idem-fence", &forged)
                .header("idem-attempt", "9")
                .json(&json!({"amount": 1})),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.text());
        let seen = upstream.seen(key).await;
        assert_eq!(seen.len(), 1, "{seen:?}");
        let fence = header_values(&seen[0], "idem-fence");
        assert_eq!(fence.len(), 1, "one idem-fence, the proxy's: {fence:?}");
        assert_ne!(fence[0], forged, "the client's fence reached the upstream");
        let fence: u64 = fence[0]
            .parse()
            .unwrap_or_else(|e| panic!("idem-fence {:?}: {e}", fence[0]));
        fences.push(fence);
        assert_eq!(header_values(&seen[0], "idem-attempt"), vec!["1"]);
    }
    assert!(fences.iter().all(|f| *f != u64::MAX), "{fences:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn passthrough_routes_and_gets_reach_the_upstream_untouched_and_are_never_recorded() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("pass"),
        &["--pass", "/health-of-upstream"],
    ));

    // Under --pass: a POST with a key, three times, each body different.
    for n in 1..=3 {
        let answer = send(
            client()
                .post(proxy.at("/health-of-upstream"))
                .header("Idempotency-Key", "pass-1")
                .json(&json!({ "n": n })),
        )
        .await;
        assert_eq!(answer.status, 201, "{}", answer.text());
        assert!(!answer.replayed());
        assert_eq!(answer.json()["count"], n, "{}", answer.text());
    }
    let seen = upstream.seen("pass-1").await;
    assert_eq!(seen.len(), 3, "{seen:?}");
    for request in &seen {
        assert!(
            header_values(request, "idem-fence").is_empty(),
            "a passed request carries no fence: {}",
            request["headers"]
        );
    }

    // GET is not protected by default: with a key or without one.
    for n in 1..=3 {
        let with_key = send(
            client()
                .get(proxy.at("/pay"))
                .header("Idempotency-Key", "get-1"),
        )
        .await;
        assert_eq!(with_key.status, 201, "{}", with_key.text());
        assert!(!with_key.replayed());
        assert_eq!(with_key.json()["count"], n);
        let without = send(client().get(proxy.at("/report"))).await;
        assert_eq!(without.status, 201, "{}", without.text());
        assert_eq!(without.json()["count"], n);
    }
    let seen = upstream.seen("get-1").await;
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen
        .iter()
        .all(|r| header_values(r, "idem-fence").is_empty()));
    assert_eq!(upstream.seen_on("/report").await.len(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_caller_gets_every_upstream_header_and_the_replay_leaves_out_set_cookie() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("cookie"), &[]));
    let url = proxy.at("/cookie");
    let request = || {
        client()
            .post(&url)
            .header("Idempotency-Key", "cookie-1")
            .json(&json!({"amount": 1}))
    };
    let ran = send(request()).await;
    assert_eq!(ran.status, 201, "{}", ran.text());
    let cookies: Vec<_> = ran.headers.get_all("set-cookie").iter().collect();
    assert_eq!(
        cookies,
        vec!["session=abc; HttpOnly", "theme=dark"],
        "the caller whose request ran gets every Set-Cookie"
    );
    assert_eq!(ran.header("x-custom").as_deref(), Some("kept"));

    let replay = settled(request()).await;
    assert!(replay.replayed(), "{:?}", replay.headers);
    assert_eq!(replay.status, 201);
    assert!(
        replay.headers.get("set-cookie").is_none(),
        "a replay hands out no one's cookies: {:?}",
        replay.headers
    );
    assert_eq!(replay.header("x-custom").as_deref(), Some("kept"));
    assert_eq!(replay.body, ran.body);
    assert_eq!(upstream.seen("cookie-1").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_key_fence_and_attempt_headers_can_be_renamed() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("rename"),
        &[
            "--key-header",
            "X-Request-Id",
            "--fence-header",
            "X-Fence",
            "--attempt-header",
            "X-Attempt",
        ],
    ));
    let url = proxy.at("/echo");
    let request = || {
        client()
            .post(&url)
            .header("X-Request-Id", "rid-1")
            .json(&json!({"amount": 1}))
    };
    let ran = send(request()).await;
    assert_eq!(ran.status, 200, "{}", ran.text());
    let replay = settled(request()).await;
    assert!(replay.replayed(), "{} {:?}", replay.status, replay.headers);

    let seen = upstream.seen_on("/echo").await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    let got = &seen[0];
    assert_eq!(header_values(got, "x-request-id"), vec!["rid-1"]);
    assert_eq!(header_values(got, "x-attempt"), vec!["1"]);
    let fence = header_values(got, "x-fence");
    assert!(
        fence.len() == 1 && fence[0].parse::<u64>().is_ok(),
        "X-Fence: {fence:?}"
    );
    assert!(
        header_values(got, "idem-fence").is_empty(),
        "{}",
        got["headers"]
    );
    assert!(
        header_values(got, "idem-attempt").is_empty(),
        "{}",
        got["headers"]
    );

    // Idempotency-Key is no key now: a protected request without one.
    let no_key = send(
        client()
            .post(&url)
            .header("Idempotency-Key", "ik-1")
            .json(&json!({"amount": 1})),
    )
    .await;
    assert_eq!(no_key.status, 400, "{}", no_key.text());
    assert!(upstream.seen("ik-1").await.is_empty());
}

// 1xx from the upstream.

/// `100 Continue` and `103 Early Hints` before the final answer: the final
/// answer is the one recorded and replayed.
#[tokio::test(flavor = "multi_thread")]
async fn informational_answers_from_the_upstream_are_skipped_and_the_final_one_is_recorded() {
    let (url, count) = raw_upstream(true, |n, _| {
        let mut bytes = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n".to_vec();
        bytes.extend(response("201 Created", &format!("final-{n}")));
        Some((bytes, false))
    })
    .await;
    let proxy = Proxy::start(&memory(&url, "info", &[]));
    let body = json!({"amount": 9});
    let first = send(post(&proxy.at("/pay"), "info-1", &body)).await;
    assert_eq!((first.status, first.text()), (201, "final-1".to_owned()));
    let again = settled(post(&proxy.at("/pay"), "info-1", &body)).await;
    assert!(again.replayed(), "{} {:?}", again.status, again.text());
    assert_eq!(again.text(), "final-1");
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

/// Non-UTF-8 key, tenant and Host values, an empty key, a 1 MiB header,
/// and an `OPTIONS *`: each gets an answer (no dropped connection, no
/// 5xx) and none reaches the upstream as a protected run with a key.
#[tokio::test(flavor = "multi_thread")]
async fn odd_heads_get_a_clean_answer() {
    let upstream = Upstream::start();
    let args = options(
        &upstream.url(),
        "memory",
        &scope("odd"),
        &["--tenant-header", "x-api-key", "--protect", "* /"],
    );
    let proxy = Proxy::start(&args);
    let big = "a".repeat(1 << 20);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "non-UTF-8 key",
            b"POST /pay HTTP/1.1\r\nHost: a\r\nx-api-key: t\r\nIdempotency-Key: \xff\xfe\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec(),
        ),
        (
            "empty key",
            b"POST /pay HTTP/1.1\r\nHost: a\r\nx-api-key: t\r\nIdempotency-Key: \r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec(),
        ),
        (
            "non-UTF-8 tenant and host",
            b"POST /pay HTTP/1.1\r\nHost: \xe9\xe9\r\nx-api-key: \xff\r\nIdempotency-Key: odd-1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec(),
        ),
        (
            "OPTIONS *",
            b"OPTIONS * HTTP/1.1\r\nHost: a\r\nx-api-key: t\r\nIdempotency-Key: odd-2\r\nConnection: close\r\n\r\n".to_vec(),
        ),
        (
            "1 MiB header",
            format!("POST /pay HTTP/1.1\r\nHost: a\r\nx-api-key: t\r\nIdempotency-Key: odd-3\r\nX-Big: {big}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").into_bytes(),
        ),
    ];
    let mut bad = Vec::new();
    for (name, raw) in cases {
        let answer =
            tokio::time::timeout(Duration::from_secs(25), try_raw(&proxy.addr(), &raw)).await;
        match answer {
            Ok(Ok((status, text))) if status != 500 => {
                eprintln!("{name}: {status} {text}");
            }
            other => bad.push(format!("{name}: {other:?}")),
        }
    }
    assert!(
        bad.is_empty(),
        "{}\nproxy stderr:\n{}",
        bad.join("\n"),
        proxy.logs()
    );
}

/// A client (or a proxy in front) that sent `X-Forwarded-For` and
/// `Forwarded` on two field lines each: RFC 9110 5.3 makes them one list,
/// so the upstream gets every element the client sent, then the proxy's
/// own.
#[tokio::test(flavor = "multi_thread")]
async fn forwarding_headers_sent_on_several_lines_keep_every_element() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(&upstream.url(), "xff", &[]));
    let raw = "POST /echo HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: xff-1\r\n\
               X-Forwarded-For: 203.0.113.7\r\nX-Forwarded-For: 198.51.100.9\r\n\
               Forwarded: for=203.0.113.7\r\nForwarded: for=198.51.100.9\r\n\
               Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
    let answer = raw_exchange(&proxy.addr(), raw.as_bytes()).await;
    assert_eq!(answer.status, 200);
    let seen = upstream.seen("xff-1").await;
    let chain = |name: &str| -> Vec<String> {
        super::header_values(&seen[0], name)
            .join(",")
            .split(',')
            .map(|s| s.trim().to_owned())
            .collect()
    };
    let xff = chain("x-forwarded-for");
    let fwd = chain("forwarded");
    assert!(
        xff == ["203.0.113.7", "198.51.100.9", "127.0.0.1"]
            && fwd.len() == 3
            && fwd[1].contains("198.51.100.9"),
        "X-Forwarded-For: {xff:?}\nForwarded: {fwd:?}"
    );
}

/// The proxy tells the upstream which host was asked for
/// (`X-Forwarded-Host`, `Forwarded: host=`), and an upstream that serves
/// several hosts answers each its own: the same key, path and body sent to
/// `b.shop.test` never gets the answer `a.shop.test` made (the host is in
/// the fingerprint).
#[tokio::test(flavor = "multi_thread")]
async fn another_host_never_gets_the_replay_of_a_request_to_the_first() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(&upstream.url(), "hosts", &[]));
    let body = "{\"amount\":3}";
    let raw = |host: &str| {
        format!(
            "POST /echo HTTP/1.1\r\nHost: {host}\r\nIdempotency-Key: host-1\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    };
    let a = raw_exchange(&proxy.addr(), &raw("a.shop.test")).await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    let b = raw_exchange(&proxy.addr(), &raw("b.shop.test")).await;
    let text = String::from_utf8_lossy(&b.body).into_owned();
    assert!(
        !(b.values("idempotent-replayed") == ["true"] && text.contains("a.shop.test")),
        "a request to b.shop.test got the replay of a.shop.test's: {} {text}",
        b.status
    );
}

/// An absolute-form request target (`POST http://shop.example/echo`)
/// names the host, whatever `Host` says (RFC 9112 section 3.2.2): the
/// upstream is told that host (`X-Forwarded-Host`, `Forwarded: host=`) and
/// the fingerprint holds it. So a retry to the same target under another
/// `Host` is the replay of an answer made for that very host, and the same
/// key sent to another target host gets 422, never that answer.
#[tokio::test(flavor = "multi_thread")]
async fn an_absolute_form_target_names_the_host_for_the_fingerprint_and_the_upstream() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(&upstream.url(), "absform", &[]));
    let body = "{\"amount\":3}";
    let raw = |target: &str, host: &str| {
        format!(
            "POST http://{target}/echo HTTP/1.1\r\nHost: {host}\r\nIdempotency-Key: abs-1\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    };
    let a = raw_exchange(&proxy.addr(), &raw("shop.example", "a.example")).await;
    assert_eq!(a.status, 200, "{}", body_text(&a));
    let a_doc: Value = serde_json::from_slice(&a.body).expect("json");
    assert_eq!(
        a_doc["headers"]["x-forwarded-host"],
        json!(["shop.example"]),
        "the upstream is told the target's host: {a_doc}"
    );
    let again = raw_settled(&proxy.addr(), &raw("shop.example", "b.example")).await;
    assert_eq!(
        again.values("idempotent-replayed"),
        ["true"],
        "{}",
        body_text(&again)
    );
    assert_eq!(again.body, a.body);
    let other = raw_settled(&proxy.addr(), &raw("other.example", "a.example")).await;
    assert_eq!(other.status, 422, "another host: {}", body_text(&other));
    assert_eq!(upstream.seen("abs-1").await.len(), 1);
}
