//! Duplicates of one key: one upstream call, one answer for all.

use serde_json::json;

use super::{anonymous, post, scope, send, settled, Proxy, Upstream};

#[tokio::test(flavor = "multi_thread")]
async fn fifty_concurrent_requests_with_one_key_reach_the_upstream_once_and_all_get_its_body() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("dup50"), &["--wait", "20s"]));
    let url = proxy.at("/pay?delay_ms=500");
    let body = json!({"amount": 4200, "currency": "EUR"});
    let calls: Vec<_> = (0..50)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            tokio::spawn(async move { send(post(&url, "order-50", &body)).await })
        })
        .collect();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.expect("the request task"));
    }

    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    assert!(
        statuses.iter().all(|s| *s == 201),
        "with --wait every duplicate gets the answer: {statuses:?}"
    );
    let first = &answers[0].body;
    for answer in &answers {
        assert_eq!(
            &answer.body,
            first,
            "{} vs {}",
            answer.text(),
            answers[0].text()
        );
    }
    let originals = answers.iter().filter(|a| !a.replayed()).count();
    assert_eq!(
        originals, 1,
        "exactly one answer is the upstream's own, 49 are replays"
    );
    assert_eq!(answers[0].json()["count"], 1, "{}", answers[0].text());
    let seen = upstream.seen("order-50").await;
    assert_eq!(seen.len(), 1, "the upstream saw: {seen:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn without_wait_concurrent_duplicates_get_409_with_retry_after_or_the_replay() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("dup409"), &[]));
    let url = proxy.at("/pay?delay_ms=500");
    let body = json!({"amount": 1});
    let calls: Vec<_> = (0..50)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            tokio::spawn(async move { send(post(&url, "order-409", &body)).await })
        })
        .collect();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.expect("the request task"));
    }

    let conflicts: Vec<_> = answers.iter().filter(|a| a.status == 409).collect();
    let ok: Vec<_> = answers.iter().filter(|a| a.status == 201).collect();
    assert_eq!(
        conflicts.len() + ok.len(),
        50,
        "only 201 or 409: {:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    assert!(
        !conflicts.is_empty(),
        "50 requests within the upstream's 500 ms: some find the key in progress"
    );
    for conflict in &conflicts {
        assert!(
            conflict.header("retry-after").is_some(),
            "a 409 in progress says when to retry: {:?}",
            conflict.headers
        );
    }
    assert_eq!(
        ok.iter().filter(|a| !a.replayed()).count(),
        1,
        "one original answer"
    );
    for answer in &ok {
        assert_eq!(answer.body, ok[0].body);
    }
    assert_eq!(upstream.seen("order-409").await.len(), 1);

    // Once completed, the duplicate is the replay.
    let again = settled(post(&url, "order-409", &body)).await;
    assert_eq!(again.status, 201, "{}", again.text());
    assert!(again.replayed(), "{:?}", again.headers);
    assert_eq!(again.body, ok[0].body);
    assert_eq!(upstream.seen("order-409").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_different_body_under_the_same_key_gets_422_and_never_reaches_the_upstream() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("mismatch"), &[]));
    let url = proxy.at("/pay");

    let first = send(post(&url, "order-422", &json!({"amount": 10, "to": "bob"}))).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed());

    let other = send(post(&url, "order-422", &json!({"amount": 11, "to": "bob"}))).await;
    assert_eq!(other.status, 422, "{}", other.text());

    // The same JSON, fields reordered and spaced: the same request.
    let same = settled(
        super::client()
            .post(&url)
            .header("Idempotency-Key", "order-422")
            .header("Content-Type", "application/json")
            .body("{ \"to\" : \"bob\",  \"amount\" : 10 }"),
    )
    .await;
    assert_eq!(same.status, 201, "{}", same.text());
    assert!(same.replayed(), "{:?}", same.headers);
    assert_eq!(same.body, first.body);

    let seen = upstream.seen("order-422").await;
    assert_eq!(seen.len(), 1, "the upstream saw: {seen:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_protected_request_without_a_key_gets_400_and_never_reaches_the_upstream() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("nokey"), &[]));
    let answer = send(
        super::client()
            .post(proxy.at("/pay"))
            .json(&json!({"a": 1})),
    )
    .await;
    assert_eq!(answer.status, 400, "{}", answer.text());
    assert!(upstream.seen_on("/pay").await.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn with_optional_key_a_request_without_a_key_passes_through_every_time() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("optional"),
        &["--optional-key"],
    ));
    for n in 1..=2 {
        let answer = send(
            super::client()
                .post(proxy.at("/pay"))
                .json(&json!({"a": 1})),
        )
        .await;
        assert_eq!(answer.status, 201, "{}", answer.text());
        assert!(!answer.replayed());
        assert_eq!(answer.json()["count"], n);
    }
    let seen = upstream.seen_on("/pay").await;
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen
        .iter()
        .all(|r| super::header_values(r, "idem-fence").is_empty()));

    // With a key it is still protected.
    let url = proxy.at("/pay");
    let ran = send(post(&url, "opt-1", &json!({"a": 1}))).await;
    let replay = settled(post(&url, "opt-1", &json!({"a": 1}))).await;
    assert!(!ran.replayed() && replay.replayed(), "{:?}", replay.headers);
    assert_eq!(upstream.seen("opt-1").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_fingerprint_pointers_only_those_fields_make_a_mismatch() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("pointer"),
        &["--fingerprint-pointer", "/amount"],
    ));
    let url = proxy.at("/pay");
    let ran = send(post(&url, "fp-1", &json!({"amount": 1, "note": "first"}))).await;
    assert_eq!(ran.status, 201, "{}", ran.text());
    let other_note = settled(post(&url, "fp-1", &json!({"amount": 1, "note": "retry"}))).await;
    assert_eq!(other_note.status, 201, "{}", other_note.text());
    assert!(other_note.replayed(), "{:?}", other_note.headers);
    assert_eq!(other_note.body, ran.body);
    let other_amount = send(post(&url, "fp-1", &json!({"amount": 2, "note": "first"}))).await;
    assert_eq!(other_amount.status, 422, "{}", other_amount.text());
    assert_eq!(upstream.seen("fp-1").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_key_on_another_path_is_another_key() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("paths"), &[]));
    let body = json!({"amount": 1});
    let pay = send(post(&proxy.at("/pay"), "path-1", &body)).await;
    let refund = send(post(&proxy.at("/refund"), "path-1", &body)).await;
    assert_eq!((pay.status, refund.status), (201, 201));
    assert!(!refund.replayed(), "another path runs on its own");
    assert_eq!(refund.json()["path"], "/refund");
    assert_eq!(upstream.seen("path-1").await.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_header_sent_twice_gets_400_and_never_reaches_the_upstream() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("twice"), &[]));
    let body = r#"{"amount":1}"#;
    let request = format!(
        "POST /pay HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: twice-1\r\n\
         Idempotency-Key: twice-2\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = super::raw_exchange(&proxy.addr(), request.as_bytes()).await;
    assert_eq!(
        answer.status,
        400,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert!(upstream.seen("twice-1").await.is_empty());
    assert!(upstream.seen("twice-2").await.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retry_sent_as_soon_as_the_whole_answer_arrived_is_the_replay() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("at-once"), &[]));
    let url = proxy.at("/pay");
    // 8 clients, 25 keys each: answer, then the retry at once.
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let url = url.clone();
            tokio::spawn(async move {
                let mut not_replayed = Vec::new();
                for k in 0..25 {
                    let key = format!("at-once-{c}-{k}");
                    let body = json!({"amount": k});
                    let ran = send(post(&url, &key, &body)).await;
                    assert_eq!(ran.status, 201, "{}", ran.text());
                    let retry = send(post(&url, &key, &body)).await;
                    if !retry.replayed() {
                        not_replayed.push(format!(
                            "{key}: {} retry-after {:?} {}",
                            retry.status,
                            retry.header("retry-after"),
                            retry.text()
                        ));
                    }
                }
                not_replayed
            })
        })
        .collect();
    let mut not_replayed = Vec::new();
    for client in clients {
        not_replayed.extend(client.await.expect("the client task"));
    }
    assert!(
        not_replayed.is_empty(),
        "{} of 200 retries sent once the whole answer had arrived were not the replay:\n{}",
        not_replayed.len(),
        not_replayed.join("\n")
    );
}
