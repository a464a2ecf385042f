//! Who is calling: tenants never share keys.

use serde_json::{json, Value};

use super::{
    client, curl, options, post, redis_url, scope, send, settled, support, Answer, Proxy, Upstream,
};

fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

/// An unsigned-looking JWT (the proxy does not verify it) with `claims`.
fn jwt(claims: &Value) -> String {
    let head = base64url(br#"{"alg":"HS256","typ":"JWT"}"#);
    let body = base64url(claims.to_string().as_bytes());
    format!("{head}.{body}.{}", base64url(b"not checked"))
}

async fn pay(proxy: &Proxy, key: &str, header: Option<(&str, &str)>) -> Answer {
    let mut request = client()
        .post(proxy.at("/pay"))
        .header("Idempotency-Key", key)
        .json(&json!({"amount": 30}));
    if let Some((name, value)) = header {
        request = request.header(name, value);
    }
    settled(request).await
}

#[test]
fn base64url_encodes_without_padding() {
    assert_eq!(base64url(b"f"), "Zg");
    assert_eq!(base64url(b"fo"), "Zm8");
    assert_eq!(base64url(b"foo"), "Zm9v");
    assert_eq!(base64url(&[0xfb, 0xff]), "-_8");
}

#[tokio::test(flavor = "multi_thread")]
async fn with_a_tenant_header_two_tenants_with_one_key_each_run_and_each_gets_its_own_replay() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&options(
        &upstream.url(),
        &redis_url(),
        &scope("tenant-h"),
        &["--tenant-header", "x-api-key"],
    ));
    let alice = pay(&proxy, "t-1", Some(("x-api-key", "alice"))).await;
    assert_eq!(alice.status, 201, "{}", alice.text());
    let bob = pay(&proxy, "t-1", Some(("x-api-key", "bob"))).await;
    assert_eq!(bob.status, 201, "{}", bob.text());
    assert!(!bob.replayed(), "bob never gets alice's answer");
    assert_eq!(bob.json()["count"], 2);

    let alice_again = pay(&proxy, "t-1", Some(("x-api-key", "alice"))).await;
    assert!(alice_again.replayed(), "{:?}", alice_again.headers);
    assert_eq!(alice_again.body, alice.body);
    let bob_again = pay(&proxy, "t-1", Some(("x-api-key", "bob"))).await;
    assert!(bob_again.replayed(), "{:?}", bob_again.headers);
    assert_eq!(bob_again.body, bob.body);
    assert_eq!(upstream.seen("t-1").await.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_tenant_a_protected_request_gets_401_and_never_reaches_the_upstream() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&options(
        &upstream.url(),
        &redis_url(),
        &scope("tenant-none"),
        &["--tenant-header", "x-api-key"],
    ));
    let none = pay(&proxy, "t-2", None).await;
    assert_eq!(none.status, 401, "{}", none.text());
    let empty = pay(&proxy, "t-2", Some(("x-api-key", ""))).await;
    assert_eq!(empty.status, 401, "{}", empty.text());
    assert!(upstream.seen("t-2").await.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn with_tenant_jwt_a_key_is_the_subjects_and_only_the_same_token_replays_it() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&options(
        &upstream.url(),
        &redis_url(),
        &scope("tenant-jwt"),
        &["--tenant-jwt"],
    ));
    let iss = "https://issuer.test";
    // Two tokens with alice's `sub` (issued at other times, or one of
    // them forged: the proxy does not verify them): one tenant, but only
    // the token the request ran with gets its answer back.
    let alice_1 = format!(
        "Bearer {}",
        jwt(&json!({"iss": iss, "sub": "alice", "iat": 1_700_000_000}))
    );
    let alice_2 = format!(
        "Bearer {}",
        jwt(&json!({"iss": iss, "sub": "alice", "iat": 1_700_000_999}))
    );
    let bob = format!("Bearer {}", jwt(&json!({"iss": iss, "sub": "bob"})));

    let first = pay(&proxy, "j-1", Some(("authorization", &alice_1))).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let again = pay(&proxy, "j-1", Some(("authorization", &alice_1))).await;
    assert!(again.replayed(), "the same token: {:?}", again.headers);
    assert_eq!(again.body, first.body);
    let other_token = pay(&proxy, "j-1", Some(("authorization", &alice_2))).await;
    assert_eq!(
        other_token.status,
        422,
        "another token with the same sub: {}",
        other_token.text()
    );

    let other = pay(&proxy, "j-1", Some(("authorization", &bob))).await;
    assert_eq!(other.status, 201, "{}", other.text());
    assert!(!other.replayed(), "another sub runs on its own");
    assert_eq!(upstream.seen("j-1").await.len(), 2);

    let anonymous = pay(&proxy, "j-1", None).await;
    assert_eq!(anonymous.status, 401, "{}", anonymous.text());
    let garbage = pay(&proxy, "j-1", Some(("authorization", "Bearer not.a-jwt"))).await;
    assert_eq!(garbage.status, 401, "{}", garbage.text());
    assert_eq!(upstream.seen("j-1").await.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_tenant_jwt_the_same_sub_from_another_issuer_is_another_tenant() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&options(
        &upstream.url(),
        &redis_url(),
        &scope("tenant-iss"),
        &["--tenant-jwt"],
    ));
    let one = format!(
        "Bearer {}",
        jwt(&json!({"iss": "https://one.test", "sub": "alice"}))
    );
    let two = format!(
        "Bearer {}",
        jwt(&json!({"iss": "https://two.test", "sub": "alice"}))
    );
    let first = pay(&proxy, "j-2", Some(("authorization", &one))).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let second = pay(&proxy, "j-2", Some(("authorization", &two))).await;
    assert_eq!(second.status, 201, "{}", second.text());
    assert!(!second.replayed(), "{:?}", second.headers);
    assert_eq!(upstream.seen("j-2").await.len(), 2);
}

/// TLS terminated at the proxy, a client certificate required (two CAs
/// trusted), the tenant the certificate's SHA-256: two clients with one
/// key each run once and each replays its own; a client without a
/// certificate never reaches the upstream.
#[tokio::test(flavor = "multi_thread")]
async fn with_tenant_client_cert_each_certificate_is_a_tenant_and_none_is_refused() {
    let certs = support::tls::certs();
    let dir = support::temp_dir("proxy-mtls");
    let client_cas = dir.join("client-cas.pem");
    std::fs::write(&client_cas, [certs.ca_pem("a"), certs.ca_pem("b")].concat())
        .unwrap_or_else(|e| panic!("{e}"));
    let path = |p: std::path::PathBuf| p.display().to_string();
    let upstream = Upstream::start();
    let proxy = Proxy::start(&options(
        &upstream.url(),
        &redis_url(),
        &scope("tenant-cert"),
        &[
            "--tls-cert",
            &path(certs.cert("a")),
            "--tls-key",
            &path(certs.key("a")),
            "--tls-client-ca",
            &path(client_cas),
            "--tenant-client-cert",
        ],
    ));
    assert!(proxy.url.starts_with("https://"), "{}", proxy.url);
    let url = proxy.at("/pay");
    let ca = path(certs.ca("a"));
    let pay_as = |which: Option<&'static str>| {
        let (url, ca) = (url.clone(), ca.clone());
        let (cert, key) = match which {
            Some(w) => (path(certs.cert(w)), path(certs.key(w))),
            None => (String::new(), String::new()),
        };
        async move {
            let mut args = vec![
                "--cacert",
                ca.as_str(),
                "-H",
                "Idempotency-Key: cert-1",
                "-H",
                "content-type: application/json",
                "--data",
                r#"{"amount":31}"#,
            ];
            if which.is_some() {
                args.extend(["--cert", cert.as_str(), "--key", key.as_str()]);
            }
            args.push(url.as_str());
            curl(&args).await
        }
    };
    let a = pay_as(Some("a")).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.status, 201, "{}", a.text());
    let b = pay_as(Some("b")).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(b.status, 201, "{}", b.text());
    assert!(!b.replayed(), "b never gets a's answer");
    assert_eq!(b.json()["count"], 2);
    let settle = |which| async move {
        for _ in 0..100 {
            let answer = pay_as(Some(which)).await.unwrap_or_else(|e| panic!("{e}"));
            if answer.status != 409 {
                return answer;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("still 409 for {which}");
    };
    let (a_again, b_again) = (settle("a").await, settle("b").await);
    assert!(
        a_again.replayed() && a_again.body == a.body,
        "{}",
        a_again.text()
    );
    assert!(
        b_again.replayed() && b_again.body == b.body,
        "{}",
        b_again.text()
    );

    let anonymous = pay_as(None).await;
    assert!(
        anonymous.as_ref().map_or(true, |r| r.status == 401),
        "no certificate: {anonymous:?}"
    );
    assert_eq!(upstream.seen("cert-1").await.len(), 2);
}

/// With `--tenant-jwt` the token is read, not verified, so a replay needs
/// the very token the request ran with. Alice's request runs with her
/// (signed) token; a forged token with her `sub` and another signature,
/// sent with her key and body, gets 422, never her recorded answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_jwt_with_another_subjects_sub_never_gets_that_subjects_recorded_answer() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&options(
        &upstream.url(),
        "memory",
        &scope("forged"),
        &["--tenant-jwt"],
    ));
    let head = base64url(br#"{"alg":"HS256","typ":"JWT"}"#);
    let claims = base64url(br#"{"iss":"https://issuer.test","sub":"alice"}"#);
    let alice = format!(
        "Bearer {head}.{claims}.{}",
        base64url(b"alice's real signature")
    );
    let forged = format!("Bearer {head}.{claims}.{}", base64url(b"forged by mallory"));
    let body = json!({"to": "alice's account"});
    let url = proxy.at("/echo");
    let first = send(post(&url, "forged-1", &body).header("authorization", &alice)).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let stolen = settled(post(&url, "forged-1", &body).header("authorization", &forged)).await;
    assert!(
        !(stolen.status == 200 && stolen.replayed()),
        "a forged token got alice's recorded answer ({} replayed; alice's answer had Vary: {:?}):\n{}",
        stolen.status,
        first.header("vary"),
        stolen.text()
    );
}

/// `--tenant-header x-api-key --allow-anonymous`: a request that carries
/// the API key twice names no tenant, yet it is not anonymous (the
/// upstream may take it for the key's owner, and an anonymous caller with
/// the same key would get that answer back): 401, nothing sent. A caller
/// without the header is anonymous and runs.
#[tokio::test(flavor = "multi_thread")]
async fn an_api_key_sent_twice_gets_401_even_with_anonymous_use_allowed() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&options(
        &upstream.url(),
        "memory",
        &scope("twice"),
        &["--tenant-header", "x-api-key", "--allow-anonymous"],
    ));
    let body = json!({"amount": 7});
    let alice = send(
        post(&proxy.at("/echo"), "tw-1", &body)
            .header("x-api-key", "alice-secret")
            .header("x-api-key", "alice-secret"),
    )
    .await;
    assert_eq!(alice.status, 401, "{}", alice.text());
    let empty = send(post(&proxy.at("/echo"), "tw-1", &body).header("x-api-key", "")).await;
    assert_eq!(empty.status, 401, "{}", empty.text());
    assert!(upstream.seen("tw-1").await.is_empty(), "nothing was sent");
    let anonymous = settled(post(&proxy.at("/echo"), "tw-1", &body)).await;
    assert_eq!((anonymous.status, anonymous.replayed()), (200, false));
    assert!(!anonymous.text().contains("alice-secret"));
}

/// `--tenant-jwt`: the tenant is `iss` and `sub`. A token whose `iss` is
/// not a string (`1`, `2`) names no tenant (401, nothing sent), never the
/// tenant of the tokens without an issuer, where two callers would
/// collide.
#[tokio::test(flavor = "multi_thread")]
async fn a_jwt_whose_issuer_is_not_a_string_names_no_tenant() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&options(
        &upstream.url(),
        "memory",
        &scope("jwtiss"),
        &["--tenant-jwt"],
    ));
    let pay = |token: String| {
        client()
            .post(proxy.at("/pay"))
            .header("Idempotency-Key", "ji-1")
            .header("Authorization", format!("Bearer {token}"))
            .json(&json!({"amount": 7}))
    };
    for iss in [json!(1), json!(2), json!({"x": 1})] {
        let answer = send(pay(jwt(&json!({"iss": iss, "sub": "alice"})))).await;
        assert_eq!(answer.status, 401, "iss {iss}: {}", answer.text());
    }
    assert!(upstream.seen("ji-1").await.is_empty());
    let named = send(pay(jwt(
        &json!({"iss": "https://issuer.test", "sub": "alice"}),
    )))
    .await;
    assert_eq!(named.status, 201, "{}", named.text());
}

/// Two tenants send the same key at the same moment, both still running
/// when the other arrives: each runs once and gets its own answer; each
/// replay is its own.
#[tokio::test(flavor = "multi_thread")]
async fn the_same_key_from_two_tenants_at_once_runs_for_each_and_replays_each_its_own() {
    let upstream = Upstream::start();
    let args = options(
        &upstream.url(),
        &super::redis_url(),
        &scope("twotenants"),
        &["--tenant-header", "x-api-key"],
    );
    let proxy = Proxy::start(&args);
    let url = proxy.at("/pay?delay_ms=700");
    let body = json!({"amount": 1});
    let calls: Vec<_> = ["tenant-a", "tenant-b"]
        .iter()
        .map(|t| {
            let (url, body, t) = (url.clone(), body.clone(), t.to_string());
            tokio::spawn(
                async move { send(post(&url, "same-key", &body).header("x-api-key", t)).await },
            )
        })
        .collect();
    let mut firsts = Vec::new();
    for c in calls {
        firsts.push(c.await.expect("task"));
    }
    assert!(
        firsts.iter().all(|a| a.status == 201 && !a.replayed()),
        "{firsts:?}"
    );
    for (i, t) in ["tenant-a", "tenant-b"].iter().enumerate() {
        let again = settled(post(&url, "same-key", &body).header("x-api-key", *t)).await;
        assert!(again.replayed(), "{t}: {} {}", again.status, again.text());
        assert_eq!(again.body, firsts[i].body, "{t} got another's answer");
    }
    assert_eq!(upstream.seen("same-key").await.len(), 2);
}
