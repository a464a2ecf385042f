//! `purge_expired`: a consistent `Scan` for items past their expiry (the
//! sweep goes on where the last call left it), then a `DeleteItem`
//! conditioned on each item's revision.

use aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
use aws_sdk_dynamodb::types::AttributeValue;
use idem_core::StoreError;

use crate::error::map_sdk;
use crate::item::{self, n};
use crate::request::names;
use crate::store::DynamoDbStore;

impl DynamoDbStore {
    pub(crate) async fn purge_inner(&self, max: usize) -> Result<u64, StoreError> {
        if max == 0 {
            return Ok(0);
        }
        let now = self.now_ms();
        let cut = now.saturating_sub(self.skew_ms);
        let start = self
            .purge_cursor
            .lock()
            .map(|mut c| c.take())
            .unwrap_or(None);
        let mut cursor = start;
        let mut found: Vec<(String, u64)> = Vec::new();
        loop {
            // Where this page starts: kept as the next call's start if the
            // page found more than `max` (the rest are purged next time,
            // never skipped).
            let page_start = cursor.clone();
            // Each page, and each delete below, is bounded by the call
            // timeout (a sweep may take several).
            let scan = self
                .client
                .scan()
                .table_name(&*self.table)
                .consistent_read(true)
                .projection_expression("#pk, #rv")
                .filter_expression("#ex < :cut")
                .set_expression_attribute_names(Some(names(&[item::PK, item::RV, item::EX])))
                .expression_attribute_values(":cut", n(cut))
                .set_exclusive_start_key(cursor.take())
                .send();
            let out = self.timed(async { scan.await.map_err(map_sdk) }).await?;
            for it in out.items() {
                if let (Some(AttributeValue::S(pk)), Some(AttributeValue::N(rv))) =
                    (it.get(item::PK), it.get(item::RV))
                {
                    if let Ok(rv) = rv.parse::<u64>() {
                        found.push((pk.clone(), rv));
                    }
                }
            }
            cursor = out.last_evaluated_key().cloned();
            if found.len() > max {
                cursor = page_start;
                break;
            }
            if cursor.is_none() || found.len() == max {
                break;
            }
        }
        if let Ok(mut c) = self.purge_cursor.lock() {
            *c = cursor;
        }
        let mut removed = 0;
        for (pk, rv) in found.into_iter().take(max) {
            let sent = self
                .client
                .delete_item()
                .table_name(&*self.table)
                .set_key(Some(self.pk(pk)))
                .condition_expression("#rv = :rv")
                .expression_attribute_names("#rv", item::RV)
                .expression_attribute_values(":rv", n(rv))
                .send();
            let sent = self.timed(async { Ok(sent.await) }).await?;
            match sent {
                Ok(_) => removed += 1,
                Err(e) => match e.as_service_error() {
                    // Written since the scan (acquired again): kept.
                    Some(DeleteItemError::ConditionalCheckFailedException(_)) => {}
                    _ => return Err(map_sdk(e)),
                },
            }
        }
        Ok(removed)
    }
}
