//! Replies lost after the server ran the command (a connection cut after
//! the script ran): the client resends it, and nothing runs twice.

use super::*;

/// On Redis Cluster, every 5th script call loses its reply
/// (the proxy in front of the node drops it and cuts the connection, after
/// the node ran the script), so the cluster client reconnects and resends
/// it. Every message is delivered twice: the first delivery executes (a
/// resent `acquire` answers "acquired", a resent `complete` answers done),
/// the second replays. 0 answered "in progress", 0 failed, 0 doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster() {
    let started = Instant::now();
    let (servers, proxies) = support::redis_server::start_cluster_behind_proxies().await;
    let store = RedisStore::connect_cluster(
        proxies
            .iter()
            .map(|p| format!("redis://{}/", p.addr))
            .collect::<Vec<_>>(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let idem = Idempotency::new(store)
        .lease(Duration::from_secs(30))
        .on_in_progress(InProgressPolicy::Reject);
    let run = run_id();
    let messages = 200u64;
    // Load the scripts on every node first (a first EVALSHA answers
    // NOSCRIPT): only replies of scripts that ran are lost.
    for m in 0..32 {
        let k = key("faults.lost-reply-warm", &run, m);
        let _ = idem
            .process_with(&k, None, |_| async { Ok::<_, std::io::Error>(0u64) })
            .await;
    }
    let evalsha_before: u64 = servers
        .iter()
        .map(|s| support::redis_server::command_calls(s, "evalsha"))
        .sum();
    for proxy in &proxies {
        proxy.lose_replies_to(b"EVALSHA", 5, u64::MAX);
    }
    let ledger = Ledger::new(messages);
    let (mut executed, mut replayed, mut in_progress, mut failed) = (0u64, 0u64, 0u64, 0u64);
    for round in 0..2 {
        for m in 0..messages {
            let ledger = ledger.clone();
            let out = idem
                .process_with(&key("faults.lost-reply", &run, m), None, |_| async move {
                    ledger.effect(m);
                    Ok::<_, std::io::Error>(m)
                })
                .await;
            match out {
                Ok(Processed::Executed(v)) if round == 0 && v == m => executed += 1,
                Ok(Processed::Replayed(v)) if round == 1 && v == m => replayed += 1,
                Err(IdemError::InProgress { .. }) => in_progress += 1,
                other => {
                    println!("round {round}, message {m}: {other:?}");
                    failed += 1
                }
            }
        }
    }
    let lost: u64 = proxies.iter().map(|p| p.lost()).sum();
    let evalsha_runs: u64 = servers
        .iter()
        .map(|s| support::redis_server::command_calls(s, "evalsha"))
        .sum::<u64>()
        - evalsha_before;
    let doubled = (0..messages).filter(|m| ledger.count(*m) > 1).count();
    report(
        "lost-reply",
        Backend::RedisCluster,
        &[
            ("messages", messages.to_string()),
            ("deliveries", (2 * messages).to_string()),
            ("lost_replies", lost.to_string()),
            ("script_runs", evalsha_runs.to_string()),
            ("executed", executed.to_string()),
            ("replayed", replayed.to_string()),
            ("in_progress", in_progress.to_string()),
            ("failed", failed.to_string()),
            ("double_effects", doubled.to_string()),
        ],
        started,
    );
    assert!(lost >= 2 * messages / 5, "only {lost} replies were lost");
    assert_eq!(in_progress, 0, "a resent acquire answered in progress");
    assert_eq!(failed, 0, "deliveries failed");
    assert_eq!((executed, replayed), (messages, messages));
    assert_eq!(doubled, 0);
}
