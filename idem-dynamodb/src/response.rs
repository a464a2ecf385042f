//! A record's response: kept in the record's item up to
//! [`INLINE_RESPONSE_BYTES`], else in chunk items written in one
//! transaction with the completion; `complete` writes it, `acquire` and
//! `get` read it back, `delete` removes its chunks.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::types::{
    AttributeValue, KeysAndAttributes, Put, ReturnValue, ReturnValuesOnConditionCheckFailure,
    TransactWriteItem, Update,
};
use bytes::{Bytes, BytesMut};
use idem_core::{IdempotencyKey, Lease, LeaseToken, StoreError};

use crate::error::map_sdk;
use crate::item::{self, b, n, s, Attrs, Item, Response, State};
use crate::request::{names, random_rev, Write};
use crate::store::{millis, DynamoDbStore, HARD_MAX_RESPONSE_BYTES, INLINE_RESPONSE_BYTES};

/// A completed record's response, as [`DynamoDbStore::response_of`] read
/// it.
pub(crate) enum Chunks {
    /// The whole response.
    Read(Bytes),
    /// A chunk was not there (why, in words): the record was deleted or
    /// purged since its item was read, or it is corrupt if the item is
    /// still the same.
    Missing(String),
}

impl DynamoDbStore {
    pub(crate) async fn complete_inner(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        if !idem_core::within_response_limit(response, self.max_response_bytes) {
            return Err(StoreError::ResponseTooLarge {
                size: response.len(),
                limit: self.max_response_bytes,
            });
        }
        let now = self.now_ms();
        let ex = now.saturating_add(millis(retention));
        let token = b(lease.token.to_bytes().to_vec());
        let condition = "#tk = :tk AND #st = :p AND #ex >= :gone";
        let mut values = HashMap::from([
            (":tk".to_owned(), token),
            (":p".to_owned(), s("p")),
            (":gone".to_owned(), n(now.saturating_sub(self.skew_ms))),
            (":c".to_owned(), s("c")),
            (":co".to_owned(), n(now)),
            (":ex".to_owned(), n(ex)),
            (":tt".to_owned(), self.ttl_of(ex)),
            (":rv".to_owned(), n(random_rev())),
        ]);
        let pk = Self::item_key(&lease.key);
        if response.len() <= INLINE_RESPONSE_BYTES {
            values.insert(":rs".to_owned(), b(response.to_vec()));
            let wrote = self
                .update(
                    pk,
                    "SET #st = :c, #rs = :rs, #co = :co, #ex = :ex, #tt = :tt, #rv = :rv REMOVE #le",
                    condition,
                    names(&[
                        item::TK,
                        item::ST,
                        item::EX,
                        item::RS,
                        item::CO,
                        item::TT,
                        item::RV,
                        item::LE,
                    ]),
                    values,
                    ReturnValue::None,
                )
                .await?;
            return match wrote {
                Write::Done(_) => Ok(()),
                Write::Refused(old) => {
                    let old = self.decodable(&lease.key, old).await?;
                    Self::completed_by(lease, old.as_ref())
                }
            };
        }
        // Chunked: the record and its chunks in one transaction.
        let chunks: Vec<&[u8]> = response.chunks(INLINE_RESPONSE_BYTES).collect();
        values.insert(":nc".to_owned(), n(chunks.len()));
        values.insert(":rz".to_owned(), n(response.len()));
        let mut actions = Vec::with_capacity(chunks.len() + 1);
        actions.push(
            TransactWriteItem::builder()
                .update(
                    Update::builder()
                        .table_name(&*self.table)
                        .set_key(Some(self.pk(pk.clone())))
                        .update_expression(
                            "SET #st = :c, #nc = :nc, #rz = :rz, #co = :co, #ex = :ex, #tt = :tt, #rv = :rv REMOVE #le",
                        )
                        .condition_expression(condition)
                        .return_values_on_condition_check_failure(
                            ReturnValuesOnConditionCheckFailure::AllOld,
                        )
                        .set_expression_attribute_names(Some(names(&[
                            item::TK,
                            item::ST,
                            item::EX,
                            item::NC,
                            item::RZ,
                            item::CO,
                            item::TT,
                            item::RV,
                            item::LE,
                        ])))
                        .set_expression_attribute_values(Some(values))
                        .build()
                        .map_err(StoreError::backend)?,
                )
                .build(),
        );
        for (i, part) in chunks.iter().enumerate() {
            let i = u32::try_from(i).unwrap_or(u32::MAX);
            let chunk = HashMap::from([
                (item::PK.to_owned(), s(item::chunk_pk(lease.token, i))),
                (item::D.to_owned(), b(part.to_vec())),
                (item::EX.to_owned(), n(ex)),
                (item::RV.to_owned(), n(random_rev())),
                (item::TT.to_owned(), self.ttl_of(ex)),
            ]);
            actions.push(
                TransactWriteItem::builder()
                    .put(
                        Put::builder()
                            .table_name(&*self.table)
                            .set_item(Some(chunk))
                            .build()
                            .map_err(StoreError::backend)?,
                    )
                    .build(),
            );
        }
        let sent = self
            .client
            .transact_write_items()
            .set_transact_items(Some(actions))
            .send()
            .await;
        match sent {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("TransactionCanceledException") => {
                // The record's own condition failed: its item, as it was,
                // is in the first cancellation reason (ALL_OLD).
                if let Some(TransactWriteItemsError::TransactionCanceledException(t)) =
                    e.as_service_error()
                {
                    if let Some(first) = t.cancellation_reasons().first() {
                        if first.code() == Some("ConditionalCheckFailed") && first.item().is_some()
                        {
                            let old = self.decodable(&lease.key, first.item().cloned()).await?;
                            return Self::completed_by(lease, old.as_ref());
                        }
                    }
                }
                // Otherwise (an emulator that leaves the item out, a
                // conflict with another transaction): read the record.
                let old = self.get_item(&lease.key).await?;
                if let Some(Ok(Item {
                    state: State::InProgress { .. },
                    token: Some(t),
                    expires,
                    ..
                })) = old.as_ref().map(item::decode)
                {
                    if t == lease.token && !self.gone(expires, self.now_ms()) {
                        // Still held by this lease: the transaction was
                        // cancelled for another reason (a conflict with
                        // another transaction, capacity). Retryable.
                        return Err(StoreError::unavailable(format!(
                            "the completion's transaction was cancelled with the lease still held: {e}"
                        )));
                    }
                }
                Self::completed_by(lease, old.as_ref())
            }
            Err(e) => Err(map_sdk(e)),
        }
    }

    /// After a refused completion: `Ok` if `lease` itself completed the
    /// record (a resend of the same call), else `LeaseLost`.
    fn completed_by(lease: &Lease, old: Option<&Attrs>) -> Result<(), StoreError> {
        match old.map(item::decode) {
            Some(Ok(Item {
                state: State::Completed { .. },
                token: Some(t),
                ..
            })) if t == lease.token => Ok(()),
            _ => Err(StoreError::LeaseLost),
        }
    }

    /// The response of a completed item: inline, or read from its chunks
    /// (one consistent `BatchGetItem`, more if DynamoDB leaves keys
    /// unprocessed). A chunk that is not there is [`Chunks::Missing`]:
    /// the record may have been deleted (or purged) since its item was
    /// read, so the caller reads the item again before calling it
    /// corrupt.
    pub(crate) async fn response_of(
        &self,
        key: &IdempotencyKey,
        item: &Item,
        response: &Response,
    ) -> Result<Chunks, StoreError> {
        let (chunks, size) = match response {
            Response::Inline(bytes) => return Ok(Chunks::Read(bytes.clone())),
            Response::Chunked { chunks, size } => (*chunks, *size),
        };
        let Some(token) = item.token else {
            return Err(Self::corrupt(key, "a chunked response without a token"));
        };
        if chunks as usize > HARD_MAX_RESPONSE_BYTES / INLINE_RESPONSE_BYTES
            || size > HARD_MAX_RESPONSE_BYTES as u64
        {
            return Err(Self::corrupt(
                key,
                format!("a chunked response of {chunks} chunks, {size} bytes"),
            ));
        }
        let mut found: HashMap<String, Bytes> = HashMap::with_capacity(chunks as usize);
        let mut wanted: Vec<Attrs> = (0..chunks)
            .map(|i| self.pk(item::chunk_pk(token, i)))
            .collect();
        for _ in 0..16 {
            if wanted.is_empty() {
                break;
            }
            let keys = KeysAndAttributes::builder()
                .set_keys(Some(std::mem::take(&mut wanted)))
                .consistent_read(true)
                .build()
                .map_err(StoreError::backend)?;
            let out = self
                .client
                .batch_get_item()
                .request_items(&*self.table, keys)
                .send()
                .await
                .map_err(map_sdk)?;
            for got in out
                .responses()
                .and_then(|r| r.get(&*self.table))
                .into_iter()
                .flatten()
            {
                let (Some(AttributeValue::S(pk)), Some(AttributeValue::B(d))) =
                    (got.get(item::PK), got.get(item::D))
                else {
                    return Err(Self::corrupt(key, "a chunk item without pk or d"));
                };
                found.insert(pk.clone(), Bytes::copy_from_slice(d.as_ref()));
            }
            if let Some(left) = out
                .unprocessed_keys()
                .and_then(|u| u.get(&*self.table))
                .map(|k| k.keys().to_vec())
            {
                wanted = left;
            }
        }
        let mut whole = BytesMut::with_capacity(usize::try_from(size).unwrap_or(0));
        for i in 0..chunks {
            match found.get(&item::chunk_pk(token, i)) {
                Some(part) => whole.extend_from_slice(part),
                None => {
                    return Ok(Chunks::Missing(format!(
                        "chunk {i} of {chunks} of the response is missing"
                    )))
                }
            }
        }
        if whole.len() as u64 != size {
            return Err(Self::corrupt(
                key,
                format!(
                    "the response's chunks hold {} bytes, not {size}",
                    whole.len()
                ),
            ));
        }
        Ok(Chunks::Read(whole.freeze()))
    }

    /// Deletes the chunk items of the response completed by `token`: one
    /// `BatchWriteItem` (more if DynamoDB leaves some unprocessed).
    pub(crate) async fn delete_chunks(
        &self,
        token: LeaseToken,
        chunks: u32,
    ) -> Result<(), StoreError> {
        use aws_sdk_dynamodb::types::{DeleteRequest, WriteRequest};
        let chunks = chunks
            .min(u32::try_from(HARD_MAX_RESPONSE_BYTES / INLINE_RESPONSE_BYTES).unwrap_or(10));
        let mut requests = Vec::with_capacity(chunks as usize);
        for i in 0..chunks {
            requests.push(
                WriteRequest::builder()
                    .delete_request(
                        DeleteRequest::builder()
                            .set_key(Some(self.pk(item::chunk_pk(token, i))))
                            .build()
                            .map_err(StoreError::backend)?,
                    )
                    .build(),
            );
        }
        for _ in 0..8 {
            if requests.is_empty() {
                return Ok(());
            }
            let out = self
                .client
                .batch_write_item()
                .request_items(&*self.table, std::mem::take(&mut requests))
                .send()
                .await
                .map_err(map_sdk)?;
            requests = out
                .unprocessed_items()
                .and_then(|u| u.get(&*self.table))
                .cloned()
                .unwrap_or_default();
        }
        if requests.is_empty() {
            Ok(())
        } else {
            Err(StoreError::unavailable(
                "DynamoDB left chunks of the deleted response unprocessed; they expire with its retention",
            ))
        }
    }
}
