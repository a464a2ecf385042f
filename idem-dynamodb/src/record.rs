//! A record by its key: `get` (a consistent read, the response read back
//! from its chunks if it has any) and `delete` (into a tombstone that keeps
//! the fence, sent once).

use std::collections::HashMap;

use aws_sdk_dynamodb::config::retry::RetryConfig;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::ReturnValue;
use idem_core::{IdempotencyKey, Record, RecordState, StoreError};

use crate::error::map_sdk;
use crate::item::{self, n, s, Response, State};
use crate::request::{names, random_rev};
use crate::response::Chunks;
use crate::store::{millis, wall, DynamoDbStore, TOMBSTONE_FOR};

/// Reads of a record by `get` when it keeps changing between the item's
/// read and its response's.
const GET_ROUNDS: usize = 8;

impl DynamoDbStore {
    pub(crate) async fn get_inner(
        &self,
        key: &IdempotencyKey,
    ) -> Result<Option<Record>, StoreError> {
        // The revision of an item whose response had a chunk missing: the
        // same item twice is corrupt; another one (the record was deleted,
        // purged or taken over since it was read) is read as it is now.
        let mut missing_in: Option<u64> = None;
        for _ in 0..GET_ROUNDS {
            let read = self.get_item(key).await?;
            let Some(attrs) = self.decodable(key, read).await? else {
                return Ok(None);
            };
            let item = item::decode(&attrs).map_err(|d| Self::corrupt(key, d))?;
            let now = self.now_ms();
            if item.is_tombstone() || self.gone(item.expires, now) {
                return Ok(None);
            }
            let Some(token) = item.token else {
                return Err(Self::corrupt(key, "a live record without a token"));
            };
            let state = match &item.state {
                State::InProgress { lease_until } => RecordState::InProgress {
                    lease_expires_at: wall(*lease_until),
                },
                State::Completed {
                    completed_at,
                    response,
                } => match self.response_of(key, &item, response).await? {
                    Chunks::Read(response) => RecordState::Completed {
                        response,
                        completed_at: wall(*completed_at),
                    },
                    Chunks::Missing(detail) => {
                        if missing_in == Some(item.rev) {
                            return Err(Self::corrupt(key, detail));
                        }
                        missing_in = Some(item.rev);
                        continue;
                    }
                },
                State::Released | State::Deleted { .. } => return Ok(None),
            };
            return Ok(Some(
                Record::new(
                    key.clone(),
                    state,
                    item.fingerprint,
                    token,
                    item.attempt,
                    wall(item.created),
                    wall(item.expires),
                )
                .with_fence(item.fence),
            ));
        }
        Err(StoreError::unavailable(format!(
            "get of {key}: the record changed under {GET_ROUNDS} reads of its response in a row"
        )))
    }

    pub(crate) async fn delete_inner(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let now = self.now_ms();
        let ex = now.saturating_add(millis(TOMBSTONE_FOR));
        let pk = Self::item_key(key);
        // The tombstone's revision: the clean tombstone that replaces a
        // corrupt one is written only over this very tombstone.
        let rev = random_rev();
        // Sent once (the SDK's retries off): a resend after a lost reply
        // could turn a reservation made since into a tombstone.
        let sent = self
            .client
            .update_item()
            .table_name(&*self.table)
            .set_key(Some(self.pk(pk.clone())))
            .update_expression(
                "SET #st = :x, #ex = :ex, #tt = :tt, #rv = :rv REMOVE #at, #fp, #le, #cr, #co, #rs, #rz",
            )
            .condition_expression("attribute_exists(#pk)")
            .set_expression_attribute_names(Some(names(&[
                item::PK,
                item::ST,
                item::EX,
                item::TT,
                item::RV,
                item::AT,
                item::FP,
                item::LE,
                item::CR,
                item::CO,
                item::RS,
                item::RZ,
            ])))
            .set_expression_attribute_values(Some(HashMap::from([
                (":x".to_owned(), s("x")),
                (":ex".to_owned(), n(ex)),
                (":tt".to_owned(), self.ttl_of(ex)),
                (":rv".to_owned(), n(rev)),
            ])))
            .return_values(ReturnValue::AllOld)
            .customize()
            .config_override(aws_sdk_dynamodb::Config::builder().retry_config(RetryConfig::disabled()))
            .send()
            .await;
        let old = match sent {
            Ok(out) => out.attributes().cloned(),
            Err(e) => {
                return match e.as_service_error() {
                    Some(UpdateItemError::ConditionalCheckFailedException(_)) => Ok(false),
                    _ => Err(map_sdk(e)),
                }
            }
        };
        let Some(old) = old else {
            return Ok(false);
        };
        match item::decode(&old) {
            Ok(item) => {
                // A completed record's chunks go too (one more request, on
                // this path only): they would otherwise live until the
                // deleted record's retention ended. A tombstone keeps
                // them named, so a delete sent again after this one's
                // reply was lost (or whose chunk delete failed) removes
                // them. The record is deleted either way; chunks left
                // behind are unreachable (a new completion has a new
                // token) and only take space until their expiry.
                let chunks = match &item.state {
                    State::Completed {
                        response: Response::Chunked { chunks, .. },
                        ..
                    } => Some(*chunks),
                    State::Deleted { chunks } => *chunks,
                    _ => None,
                };
                if let (Some(chunks), Some(token)) = (chunks, item.token) {
                    if let Err(e) = self.delete_chunks(token, chunks).await {
                        tracing::warn!(key = %key, error = %e, "the deleted record's response chunks were not all deleted");
                    }
                }
                Ok(!item.is_tombstone() && !self.gone(item.expires, now))
            }
            // Corrupt: the tombstone kept what was left of it, a fence or
            // a token that may not decode either. A clean tombstone
            // replaces it (one more request, on this path only), written
            // only over this call's own tombstone (an acquisition made
            // since is left alone). Its fence is the stored one if that
            // decodes; else one above any a client within the clock skew
            // margin can have handed out (its clock plus the margin), so
            // the next acquisition's fence is higher than every earlier
            // one.
            Err(_) => {
                let fence = item::get_n::<u64>(&old, item::FE).unwrap_or_else(|_| {
                    self.now_us().saturating_add(
                        u64::try_from(self.skew_ms)
                            .unwrap_or(0)
                            .saturating_mul(1000),
                    )
                });
                let tomb = HashMap::from([
                    (item::PK.to_owned(), s(pk)),
                    (item::ST.to_owned(), s("x")),
                    (item::FE.to_owned(), n(fence)),
                    (item::EX.to_owned(), n(ex)),
                    (item::TT.to_owned(), self.ttl_of(ex)),
                    (item::RV.to_owned(), n(random_rev())),
                ]);
                let put = self
                    .client
                    .put_item()
                    .table_name(&*self.table)
                    .set_item(Some(tomb))
                    .condition_expression("#rv = :rv")
                    .expression_attribute_names("#rv", item::RV)
                    .expression_attribute_values(":rv", n(rev))
                    .customize()
                    .config_override(
                        aws_sdk_dynamodb::Config::builder().retry_config(RetryConfig::disabled()),
                    )
                    .send()
                    .await;
                match put {
                    Ok(_) => Ok(true),
                    // An acquisition took the tombstone over since: the
                    // delete is done; what is there now is not ours.
                    Err(e)
                        if matches!(
                            e.as_service_error(),
                            Some(PutItemError::ConditionalCheckFailedException(_))
                        ) =>
                    {
                        Ok(true)
                    }
                    Err(e) => Err(map_sdk(e)),
                }
            }
        }
    }
}
