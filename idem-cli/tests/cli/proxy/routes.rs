//! Which requests are protected: routes matched on one form of the path
//! however a client spells it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::json;

use super::wire::{body_text, memory, raw_post, raw_upstream, response};
use super::{client, raw_exchange, Proxy, Upstream};

/// With `--protect "POST /pay"`, the same payment sent as `//pay` (a base
/// URL with a trailing slash joined to `/pay`), `/./pay`, `/x/../pay` or
/// `/%70ay` is protected, and under the key of `/pay`: upstreams commonly
/// take such paths as `/pay` (upstream.py does), so a retry with the same
/// Idempotency-Key never runs it again.
#[tokio::test(flavor = "multi_thread")]
async fn a_non_normalised_path_to_a_protected_route_is_not_run_twice_for_one_key() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "paths",
        &["--protect", "POST /pay"],
    ));
    let mut twice = Vec::new();
    for (i, path) in ["//pay", "/./pay", "/x/../pay", "/%70ay"]
        .iter()
        .enumerate()
    {
        let key = format!("path-{i}");
        let body = json!({ "amount": 5 });
        let raw = |k: &str| {
            let text = body.to_string();
            format!(
                "POST {path} HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: {k}\r\n\
                 Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            )
            .into_bytes()
        };
        let _first = raw_exchange(&proxy.addr(), &raw(&key)).await;
        let _second = raw_exchange(&proxy.addr(), &raw(&key)).await;
        let seen = upstream.seen(&key).await;
        if seen.len() > 1 {
            twice.push(format!(
                "{path}: the upstream ran {} times for key {key}",
                seen.len()
            ));
        }
    }
    assert!(twice.is_empty(), "{}", twice.join("\n"));
}

/// A path parameter (`;jsessionid=...`), which servlet containers (Tomcat,
/// Jetty) and Spring strip before routing, does not reach `/pay` around
/// `--protect "POST /pay"`: the same key runs once.
#[tokio::test(flavor = "multi_thread")]
async fn a_path_parameter_does_not_reach_a_protected_route_around_its_rule() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "matrix",
        &["--protect", "POST /pay"],
    ));
    let body = json!({"amount": 5}).to_string();
    let first = raw_exchange(&proxy.addr(), &raw_post("/pay;jsessionid=1", "mx-1", &body)).await;
    let second = raw_exchange(&proxy.addr(), &raw_post("/pay;jsessionid=1", "mx-1", &body)).await;
    let seen = upstream.seen("mx-1").await;
    assert_eq!(
        seen.len(),
        1,
        "POST /pay;jsessionid=1 with one key ran {} times (answers {} then {})",
        seen.len(),
        first.status,
        second.status
    );
}

/// `/pay/` is a spelling of `/pay` to many frameworks (Express, Spring
/// before 6, Django's APPEND_SLASH...): a retry under it with the same key
/// never runs twice.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_with_a_trailing_slash_never_runs_twice() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(&upstream.url(), "slash", &[]));
    let body = json!({"amount": 6}).to_string();
    let first = raw_exchange(&proxy.addr(), &raw_post("/pay", "sl-1", &body)).await;
    let second = raw_exchange(&proxy.addr(), &raw_post("/pay/", "sl-1", &body)).await;
    let seen = upstream.seen("sl-1").await;
    assert!(
        seen.len() == 1,
        "/pay then /pay/ with one key ran {} times (answers {} then {})",
        seen.len(),
        first.status,
        second.status
    );
}

/// Under `--upstream http://h:p/api`, a passed request (`GET /../pay`)
/// never climbs out of the base path: the upstream never gets
/// `/api/../pay`.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_cannot_climb_out_of_the_upstream_base_path() {
    let upstream = Upstream::start();
    let base = format!("{}/api", upstream.url());
    let proxy = Proxy::start(&memory(&base, "base", &[]));
    let raw = b"GET /../pay HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: bp-1\r\nConnection: close\r\n\r\n";
    let answer = raw_exchange(&proxy.addr(), raw).await;
    let seen = upstream.seen("bp-1").await;
    let paths: Vec<String> = seen
        .iter()
        .map(|r| r["path"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert!(
        paths
            .iter()
            .all(|p| p.starts_with("/api/") && !p.contains("/../")),
        "answer {}; the upstream got {paths:?}",
        answer.status
    );
}

/// Long and odd paths never crash the proxy nor get a 5xx of its own.
#[tokio::test(flavor = "multi_thread")]
async fn odd_paths_get_no_5xx() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(&upstream.url(), "oddpaths", &[]));
    let long_dots = "/%2e%2e".repeat(8_000);
    let long_slashes = "/%2F".repeat(8_000);
    let mut bad = Vec::new();
    for (i, path) in [
        "/%2F".to_owned(),
        "/%00".to_owned(),
        "/%25".to_owned(),
        "/%".to_owned(),
        "/%e2%82%ac".to_owned(),
        "/caf\u{e9}".to_owned(),
        "/..%2F..%2F".to_owned(),
        "/a?x=/../y".to_owned(),
        long_dots,
        long_slashes,
    ]
    .iter()
    .enumerate()
    {
        let key = format!("op-{i}");
        let answer = super::wire::try_raw(&proxy.addr(), &raw_post(path, &key, "{}")).await;
        match answer {
            Ok((status, text)) if status >= 500 => bad.push(format!("{path:.40}: {status} {text}")),
            Ok(_) => {}
            Err(e) => bad.push(format!("{path:.40}: {e}")),
        }
    }
    let ok = client()
        .get(proxy.at("/healthz"))
        .send()
        .await
        .map(|r| r.status().as_u16());
    assert!(
        bad.is_empty() && matches!(ok, Ok(200)),
        "{bad:?} health {ok:?}"
    );
}

/// A path in raw UTF-8 (`/café`, which hyper takes) and the same path
/// percent-encoded (`/caf%C3%A9`, what a client library sends) are one
/// resource to every framework that decodes paths (werkzeug, Express,
/// Spring, Go's `URL.Path`): they share a key, and the retry is the replay.
#[tokio::test(flavor = "multi_thread")]
async fn a_raw_utf8_path_and_its_percent_encoding_share_a_key() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(&upstream.url(), "utf8", &[]));
    let body = json!({"amount": 8}).to_string();
    let first = raw_exchange(&proxy.addr(), &raw_post("/caf\u{e9}", "u8-1", &body)).await;
    let second = raw_exchange(&proxy.addr(), &raw_post("/caf%C3%A9", "u8-1", &body)).await;
    let seen = upstream.seen("u8-1").await;
    assert!(
        seen.len() <= 1,
        "/caf\u{e9} then /caf%C3%A9 with one key ran {} times (answers {} then {})",
        seen.len(),
        first.status,
        second.status
    );
}

/// `/pay;x%2F..%2Fother`: a servlet container removes the parameter up to
/// the next literal `/` before it decodes anything, and routes it to
/// `/pay`; a server that decodes first sees `/other`. The proxy protects it
/// under `--protect "POST /pay"` (either reading protected): one key runs
/// once.
#[tokio::test(flavor = "multi_thread")]
async fn a_path_parameter_holding_an_encoded_slash_does_not_escape_the_rule() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "matrix2",
        &["--protect", "POST /pay"],
    ));
    let body = json!({"amount": 5}).to_string();
    let path = "/pay;x%2F..%2Fother";
    let first = raw_exchange(&proxy.addr(), &raw_post(path, "mx2-1", &body)).await;
    let second = raw_exchange(&proxy.addr(), &raw_post(path, "mx2-1", &body)).await;
    let seen = upstream.seen("mx2-1").await;
    assert_eq!(
        seen.len(),
        1,
        "POST {path} (Tomcat: /pay) with one key ran {} times (answers {} then {}; fence header seen: {:?})",
        seen.len(),
        first.status,
        second.status,
        seen.first().map(|r| super::header_values(r, "idem-fence"))
    );
}

/// Under `--upstream .../api`, no reading of a path climbs out of the base:
/// `/;x%2F..%2F..%2Fadmin` is `/admin` when encoded slashes are decoded
/// first, so it gets 400, never forwarded.
#[tokio::test(flavor = "multi_thread")]
async fn no_reading_of_a_path_climbs_out_of_the_upstream_base() {
    let readings =
        idem_proxy::matching_forms(&idem_proxy::normal_form("/api/;x%2F..%2F..%2Fadmin"));
    assert_eq!(readings[1], "/admin", "the proxy's own second reading");
    let upstream = Upstream::start();
    let base = format!("{}/api", upstream.url());
    let proxy = Proxy::start(&memory(&base, "climb2", &[]));
    let control = raw_exchange(
        &proxy.addr(),
        b"GET /x%2F..%2F..%2Fadmin HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: climb-1\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(control.status, 400, "the first reading climbs: refused");
    let answer = raw_exchange(
        &proxy.addr(),
        b"GET /;x%2F..%2F..%2Fadmin HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: climb-2\r\nConnection: close\r\n\r\n",
    )
    .await;
    let paths: Vec<String> = upstream
        .seen("climb-2")
        .await
        .iter()
        .map(|r| r["path"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        answer.status, 400,
        "a path whose second reading under the base is /admin was forwarded; the upstream got {paths:?}"
    );
}

/// `/a//../pay` is `/a/pay` by RFC 3986, but `/pay` to an upstream that
/// merges slashes first (Tomcat, nginx, Go). The proxy forwards it in
/// normal form, `/a/pay`, with no dot segment left for the upstream to
/// read otherwise: it never reaches `/pay` around `--protect "POST /pay"`.
#[tokio::test(flavor = "multi_thread")]
async fn a_doubled_slash_before_a_dot_segment_does_not_reach_a_protected_route_unprotected() {
    let spelt = "/a//../pay";
    assert_eq!(slashes_merged_then_dots(spelt), "/pay");
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "slashdots",
        &["--protect", "POST /pay"],
    ));
    let raw = super::wire::raw_post(spelt, "sd-1", "{\"amount\":1}");
    let first = raw_exchange(&proxy.addr(), &raw).await;
    assert_eq!(first.status, 201);
    let seen = upstream.seen("sd-1").await;
    let paths: Vec<&str> = seen
        .iter()
        .map(|r| r["path"].as_str().unwrap_or_default())
        .collect();
    // The upstream gets the RFC's reading, `/a/pay`, and nothing it could
    // merge into `/pay`.
    assert_eq!(paths, ["/a/pay"]);
    for path in paths {
        assert_ne!(slashes_merged_then_dots(path), "/pay", "{path}");
    }
}

/// A path read the way Tomcat, nginx (`merge_slashes`, on by default) and
/// Go's `path.Clean` read it: repeated slashes merged first, then dot
/// segments removed.
fn slashes_merged_then_dots(path: &str) -> String {
    let mut merged = String::new();
    for c in path.chars() {
        if c == '/' && merged.ends_with('/') {
            continue;
        }
        merged.push(c);
    }
    let mut out: Vec<&str> = Vec::new();
    for segment in merged.trim_start_matches('/').split('/') {
        match segment {
            "." => {}
            ".." => {
                out.pop();
            }
            s => out.push(s),
        }
    }
    format!("/{}", out.join("/"))
}

/// `POST /pay/..;/..` reaches the upstream as `/pay/` (its RFC normal
/// form: the `..` removes `..;`): protected under `--protect "POST /pay"`,
/// since the route is chosen on what the upstream gets. One key runs once,
/// like the control `/pay/` and `/pay/orders` sent as spelled.
#[tokio::test(flavor = "multi_thread")]
async fn a_dot_segment_after_a_parameter_never_reaches_a_protected_route_unprotected() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "probe-dots",
        &["--protect", "POST /pay"],
    ));
    let body = serde_json::json!({"amount": 5}).to_string();
    let mut twice = Vec::new();
    for (i, path) in ["/pay/..;/..", "/pay/..%2F/..", "/pay/..;/../orders"]
        .iter()
        .enumerate()
    {
        let key = format!("probe-dots-{i}");
        let a = raw_exchange(&proxy.addr(), &raw_post(path, &key, &body)).await;
        let b = raw_exchange(&proxy.addr(), &raw_post(path, &key, &body)).await;
        let seen = upstream.seen(&key).await;
        let paths: Vec<_> = seen.iter().map(|s| s["path"].to_string()).collect();
        if seen.len() > 1 {
            twice.push(format!(
                "{path}: upstream ran {} times for key {key} at {paths:?} (answers {} {})",
                seen.len(),
                a.status,
                b.status
            ));
        }
    }
    // Control: `/pay/` itself, the path the upstream got, runs once.
    let a = raw_exchange(
        &proxy.addr(),
        &raw_post("/pay/", "probe-dots-control", &body),
    )
    .await;
    let b = raw_exchange(
        &proxy.addr(),
        &raw_post("/pay/", "probe-dots-control", &body),
    )
    .await;
    let control = upstream.seen("probe-dots-control").await.len();
    let c = raw_exchange(
        &proxy.addr(),
        &raw_post("/pay/orders", "probe-dots-control2", &body),
    )
    .await;
    let d = raw_exchange(
        &proxy.addr(),
        &raw_post("/pay/orders", "probe-dots-control2", &body),
    )
    .await;
    let control2 = upstream.seen("probe-dots-control2").await.len();
    assert!(twice.is_empty(), "{}\ncontrol /pay/orders: ran {control2} time(s) (answers {} {})\ncontrol /pay/: ran {control} time(s) (answers {} {})", twice.join("\n"), c.status, d.status, a.status, b.status);
}

/// `/pay/orders/` and `/pay/orders/..;/..` reach the upstream as the same
/// request (`/pay/orders/`, one fingerprint) and are keyed alike, by a
/// reading of that path: one Idempotency-Key runs once.
#[tokio::test(flavor = "multi_thread")]
async fn requests_forwarded_alike_share_one_key() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "probe-keypath",
        &["--protect", "POST /pay"],
    ));
    let body = serde_json::json!({"amount": 5}).to_string();
    let a = raw_exchange(&proxy.addr(), &raw_post("/pay/orders/", "probe-kp", &body)).await;
    let b = raw_exchange(
        &proxy.addr(),
        &raw_post("/pay/orders/..;/..", "probe-kp", &body),
    )
    .await;
    let seen = upstream.seen("probe-kp").await;
    let paths: Vec<_> = seen.iter().map(|s| s["path"].to_string()).collect();
    assert_eq!(
        seen.len(),
        1,
        "one key ran {} times at {paths:?} (answers {} {}, second replayed: {:?})",
        seen.len(),
        a.status,
        b.status,
        b.values("idempotent-replayed")
    );
}

/// A raw upstream that reads methods without regard to case, as
/// ASP.NET Core (`HttpMethods.IsPost`), Werkzeug/Flask and Django
/// (`REQUEST_METHOD.upper()`) do: every request it takes for a POST is a
/// side effect, counted.
async fn case_blind_upstream() -> (String, Arc<AtomicUsize>, Arc<std::sync::Mutex<Vec<String>>>) {
    let effects = Arc::new(AtomicUsize::new(0));
    let methods = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (e, m) = (effects.clone(), methods.clone());
    let (url, _) = raw_upstream(true, move |_, seen| {
        let method = seen.head.split(' ').next().unwrap_or("").to_owned();
        m.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(method.clone());
        let n = if method.eq_ignore_ascii_case("POST") {
            e.fetch_add(1, Ordering::SeqCst) + 1
        } else {
            0
        };
        Some((response("201 Created", &format!("charged-{n}")), false))
    })
    .await;
    (url, effects, methods)
}

fn raw_with_method(method: &str, key: &str) -> Vec<u8> {
    let body = r#"{"amount":5}"#;
    format!(
        "{method} /pay HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// `POST /pay` with a key runs once; a retry of it spelt `post`, or a
/// `head` (a client given the method in lower case) is refused with `400`,
/// nothing sent: an upstream that reads methods without regard to case
/// would run the key again, and HTTP clients frame a `head` answer as an
/// unknown method's. Under the default routes and under `* /`.
#[tokio::test(flavor = "multi_thread")]
async fn a_standard_method_spelt_in_another_case_is_refused_and_never_runs_a_key_again() {
    for routes in [&[][..], &["--protect", "* /"][..]] {
        let (url, effects, methods) = case_blind_upstream().await;
        let proxy = Proxy::start(&memory(&url, "lcase", routes));
        let first = raw_exchange(&proxy.addr(), &raw_with_method("POST", "lc-1")).await;
        assert_eq!(
            (first.status, body_text(&first)),
            (201, "charged-1".to_owned())
        );
        for method in ["post", "Post", "head", "get"] {
            let again = raw_exchange(&proxy.addr(), &raw_with_method(method, "lc-1")).await;
            assert_eq!(
                again.status,
                400,
                "{routes:?} {method}: {}",
                body_text(&again)
            );
        }
        assert_eq!(
            (
                effects.load(Ordering::SeqCst),
                methods.lock().map(|m| m.len()).unwrap_or(0)
            ),
            (1, 1),
            "{routes:?}: the upstream saw {:?}",
            methods.lock().unwrap_or_else(|p| p.into_inner())
        );
    }
}

/// `--protect "* /"` and a request with an extension method (WebDAV's
/// `MKCOL`, a custom `CHARGE`) sent twice with one key: the upstream runs
/// it once.
#[tokio::test(flavor = "multi_thread")]
async fn star_protects_extension_methods_too() {
    let count = Arc::new(AtomicUsize::new(0));
    let counted = count.clone();
    let (url, _) = raw_upstream(true, move |_, seen| {
        let n = if seen.head.starts_with("CHARGE ") {
            counted.fetch_add(1, Ordering::SeqCst) + 1
        } else {
            0
        };
        Some((response("201 Created", &format!("charged-{n}")), false))
    })
    .await;
    let proxy = Proxy::start(&memory(&url, "xmethod", &["--protect", "* /"]));
    let mut answers = Vec::new();
    for _ in 0..2 {
        let a = raw_exchange(&proxy.addr(), &raw_with_method("CHARGE", "xm-1")).await;
        answers.push((
            a.status,
            body_text(&a),
            a.values("idempotent-replayed").join(","),
        ));
    }
    assert_eq!(
        count.load(Ordering::SeqCst),
        1,
        "`* /` protects every method, yet CHARGE with one key ran {} times: {answers:?}",
        count.load(Ordering::SeqCst)
    );
}
