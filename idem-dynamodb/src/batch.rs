//! Batches: one call per item, the items of one key in order, the keys
//! [`BATCH_CONCURRENCY`] at once.

use std::collections::HashMap;

use idem_core::{IdempotencyKey, StoreError};

/// How many requests of one batch run at once.
pub const BATCH_CONCURRENCY: usize = 32;

/// Runs `call(i)` for every item: the items of one key one after the
/// other, in order, the keys [`BATCH_CONCURRENCY`] at once. Once an item
/// of a key finds the store unavailable, the later items of that key are
/// not sent (they get a retryable error of their own).
pub(crate) async fn per_key<'a, T, K, C, F>(
    len: usize,
    key_of: K,
    call: C,
) -> Vec<Result<T, StoreError>>
where
    K: Fn(usize) -> &'a IdempotencyKey,
    C: Fn(usize) -> F,
    F: std::future::Future<Output = Result<T, StoreError>>,
{
    use futures_util::StreamExt;
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut group_of: HashMap<&IdempotencyKey, usize> = HashMap::new();
    for i in 0..len {
        let g = *group_of.entry(key_of(i)).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push(i);
    }
    let call = &call;
    let done: Vec<Vec<(usize, Result<T, StoreError>)>> = futures_util::stream::iter(groups)
        .map(|group| async move {
            let mut out = Vec::with_capacity(group.len());
            let mut down = false;
            for i in group {
                if down {
                    out.push((
                        i,
                        Err(StoreError::unavailable(
                            "not sent: an earlier item of this key found the store unavailable",
                        )),
                    ));
                    continue;
                }
                let r = call(i).await;
                down = matches!(r, Err(StoreError::Unavailable(_)));
                out.push((i, r));
            }
            out
        })
        .buffer_unordered(BATCH_CONCURRENCY)
        .collect()
        .await;
    let mut results: Vec<Option<Result<T, StoreError>>> = (0..len).map(|_| None).collect();
    for (i, r) in done.into_iter().flatten() {
        results[i] = Some(r);
    }
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| Err(StoreError::backend("an item of the batch got no answer")))
        })
        .collect()
}
