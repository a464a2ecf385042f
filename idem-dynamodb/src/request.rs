//! The requests every operation is made of: a conditional `PutItem` or
//! `UpdateItem` that hands back the item as it was when refused, a
//! consistent `GetItem`; expression names and item revisions.

use std::collections::HashMap;

use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure};
use idem_core::{IdempotencyKey, LeaseToken, StoreError};

use crate::error::map_sdk;
use crate::item::{self, n, s, Attrs};
use crate::store::DynamoDbStore;

/// How a conditional write failed: the item as it was, if any.
pub(crate) enum Write<T> {
    Done(T),
    Refused(Option<Attrs>),
}

pub(crate) fn names(pairs: &[&str]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|n| (format!("#{n}"), (*n).to_owned()))
        .collect()
}

pub(crate) fn random_rev() -> u64 {
    // 53 bits: DynamoDB numbers are exact far beyond, but a smaller value
    // keeps every tool that reads the table as f64 exact too.
    u64::try_from(LeaseToken::random().as_u128() & ((1 << 53) - 1)).unwrap_or(1)
}

impl DynamoDbStore {
    pub(crate) fn pk(&self, pk: String) -> HashMap<String, AttributeValue> {
        HashMap::from([(item::PK.to_owned(), s(pk))])
    }

    /// A `PutItem` of `attrs`, if no item exists (`expect_rev` `None`) or
    /// the item's revision is `expect_rev`.
    pub(crate) async fn put_if(
        &self,
        attrs: Attrs,
        expect_rev: Option<u64>,
    ) -> Result<Write<()>, StoreError> {
        let req = self
            .client
            .put_item()
            .table_name(&*self.table)
            .set_item(Some(attrs))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        let req = match expect_rev {
            None => req
                .condition_expression("attribute_not_exists(#pk)")
                .expression_attribute_names("#pk", item::PK),
            Some(rev) => req
                .condition_expression("#rv = :rv")
                .expression_attribute_names("#rv", item::RV)
                .expression_attribute_values(":rv", n(rev)),
        };
        match req.send().await {
            Ok(_) => Ok(Write::Done(())),
            Err(e) => match e.as_service_error() {
                Some(PutItemError::ConditionalCheckFailedException(c)) => {
                    Ok(Write::Refused(c.item().cloned()))
                }
                _ => Err(map_sdk(e)),
            },
        }
    }

    /// An `UpdateItem` of the record of `pk`; on a failed condition, the
    /// item as it was.
    pub(crate) async fn update(
        &self,
        pk: String,
        update: &str,
        condition: &str,
        names: HashMap<String, String>,
        values: HashMap<String, AttributeValue>,
        returns: ReturnValue,
    ) -> Result<Write<Option<Attrs>>, StoreError> {
        let req = self
            .client
            .update_item()
            .table_name(&*self.table)
            .set_key(Some(self.pk(pk)))
            .update_expression(update)
            .condition_expression(condition)
            .set_expression_attribute_names(Some(names))
            .set_expression_attribute_values(Some(values))
            .return_values(returns)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        match req.send().await {
            Ok(out) => Ok(Write::Done(out.attributes().cloned())),
            Err(e) => match e.as_service_error() {
                Some(UpdateItemError::ConditionalCheckFailedException(c)) => {
                    Ok(Write::Refused(c.item().cloned()))
                }
                _ => Err(map_sdk(e)),
            },
        }
    }

    pub(crate) async fn get_item(&self, key: &IdempotencyKey) -> Result<Option<Attrs>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&*self.table)
            .set_key(Some(self.pk(Self::item_key(key))))
            .consistent_read(true)
            .send()
            .await
            .map_err(map_sdk)?;
        Ok(out.item().cloned())
    }

    /// `old`, an item as a refused write or a read handed it out, read
    /// once more (consistently) if it does not decode. DynamoDB applies a
    /// write whole, at once; moto, the emulator the tests run on, applies
    /// an update's actions one by one and can hand out an item half
    /// updated (a status without the attributes that go with it). An item
    /// that still does not decode is reported by the caller as it always
    /// was (corrupt, or the lease lost).
    pub(crate) async fn decodable(
        &self,
        key: &IdempotencyKey,
        old: Option<Attrs>,
    ) -> Result<Option<Attrs>, StoreError> {
        match &old {
            Some(attrs) if item::decode(attrs).is_err() => self.get_item(key).await,
            _ => Ok(old),
        }
    }
}
