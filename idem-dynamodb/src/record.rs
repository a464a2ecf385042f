//! A record by its key: `get` (a consistent read, the response read back
//! from its chunks if it has any) and `delete` (into a tombstone that keeps
//! the fence, sent once).

use std::collections::HashMap;

use aws_sdk_dynamodb::config::retry::RetryConfig;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::ReturnValue;
use idem_core::{IdempotencyKey, Record, RecordState, StoreError};

use crate::error::map_sdk;
use crate::item::{self, n, s, Response, State};
use crate::request::{names, random_rev};
use crate::store::{millis, wall, DynamoDbStore, TOMBSTONE_FOR};

impl DynamoDbStore {
    pub(crate) async fn get_inner(
        &self,
        key: &IdempotencyKey,
    ) -> Result<Option<Record>, StoreError> {
        let Some(attrs) = self.get_item(key).await? else {
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
            } => RecordState::Completed {
                response: self.response_of(key, &item, response).await?,
                completed_at: wall(*completed_at),
            },
            State::Released | State::Deleted => return Ok(None),
        };
        Ok(Some(
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
        ))
    }

    pub(crate) async fn delete_inner(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let now = self.now_ms();
        let ex = now.saturating_add(millis(TOMBSTONE_FOR));
        let pk = Self::item_key(key);
        // Sent once (the SDK's retries off): a resend after a lost reply
        // could turn a reservation made since into a tombstone.
        let sent = self
            .client
            .update_item()
            .table_name(&*self.table)
            .set_key(Some(self.pk(pk.clone())))
            .update_expression(
                "SET #st = :x, #ex = :ex, #tt = :tt, #rv = :rv REMOVE #tk, #at, #fp, #le, #cr, #co, #rs, #nc, #rz",
            )
            .condition_expression("attribute_exists(#pk)")
            .set_expression_attribute_names(Some(names(&[
                item::PK,
                item::ST,
                item::EX,
                item::TT,
                item::RV,
                item::TK,
                item::AT,
                item::FP,
                item::LE,
                item::CR,
                item::CO,
                item::RS,
                item::NC,
                item::RZ,
            ])))
            .set_expression_attribute_values(Some(HashMap::from([
                (":x".to_owned(), s("x")),
                (":ex".to_owned(), n(ex)),
                (":tt".to_owned(), self.ttl_of(ex)),
                (":rv".to_owned(), n(random_rev())),
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
        match old.as_ref().map(item::decode) {
            Some(Ok(old)) => {
                if let (
                    State::Completed {
                        response: Response::Chunked { chunks, .. },
                        ..
                    },
                    Some(token),
                ) = (&old.state, old.token)
                {
                    // Its chunks go too (one more request, on this path
                    // only): they would otherwise live until the deleted
                    // record's retention ended.
                    // The record is deleted either way; chunks left
                    // behind are unreachable (a new completion has a new
                    // token) and only take space until their expiry.
                    if let Err(e) = self.delete_chunks(token, *chunks).await {
                        tracing::warn!(key = %key, error = %e, "the deleted record's response chunks were not all deleted");
                    }
                }
                Ok(!old.is_tombstone() && !self.gone(old.expires, now))
            }
            None => Ok(false),
            // Corrupt: the tombstone kept what was left of it, a fence
            // that may not decode either. A clean tombstone replaces it,
            // its fence from this clock (one more request, on this path
            // only).
            Some(Err(_)) => {
                let tomb = HashMap::from([
                    (item::PK.to_owned(), s(pk)),
                    (item::ST.to_owned(), s("x")),
                    (item::FE.to_owned(), n(self.now_us())),
                    (item::EX.to_owned(), n(ex)),
                    (item::TT.to_owned(), self.ttl_of(ex)),
                    (item::RV.to_owned(), n(random_rev())),
                ]);
                self.client
                    .put_item()
                    .table_name(&*self.table)
                    .set_item(Some(tomb))
                    .customize()
                    .config_override(
                        aws_sdk_dynamodb::Config::builder().retry_config(RetryConfig::disabled()),
                    )
                    .send()
                    .await
                    .map_err(map_sdk)?;
                Ok(true)
            }
        }
    }
}
