//! The lease holder's other calls, each an `UpdateItem` conditioned on its
//! token: `release` (into a tombstone that keeps the fence) and `extend`.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::types::ReturnValue;
use idem_core::{Lease, StoreError, IN_PROGRESS_GRACE};

use crate::item::{self, b, n, s, Item, State};
use crate::request::{names, random_rev, Write};
use crate::store::{millis, wall, DynamoDbStore, TOMBSTONE_FOR};

impl DynamoDbStore {
    pub(crate) async fn release_inner(&self, lease: &Lease) -> Result<(), StoreError> {
        let now = self.now_ms();
        let ex = now.saturating_add(millis(TOMBSTONE_FOR));
        let wrote = self
            .update(
                Self::item_key(&lease.key),
                "SET #st = :r, #ex = :ex, #tt = :tt, #rv = :rv REMOVE #at, #fp, #le, #cr",
                "#tk = :tk AND #st = :p AND #ex >= :gone",
                names(&[
                    item::TK,
                    item::ST,
                    item::EX,
                    item::TT,
                    item::RV,
                    item::AT,
                    item::FP,
                    item::LE,
                    item::CR,
                ]),
                HashMap::from([
                    (":tk".to_owned(), b(lease.token.to_bytes().to_vec())),
                    (":p".to_owned(), s("p")),
                    (":r".to_owned(), s("r")),
                    (":gone".to_owned(), n(now.saturating_sub(self.skew_ms))),
                    (":ex".to_owned(), n(ex)),
                    (":tt".to_owned(), self.ttl_of(ex)),
                    (":rv".to_owned(), n(random_rev())),
                ]),
                ReturnValue::None,
            )
            .await?;
        match wrote {
            Write::Done(_) => Ok(()),
            Write::Refused(old) => match self
                .decodable(&lease.key, old)
                .await?
                .as_ref()
                .map(item::decode)
            {
                // A resend of this release: its tombstone is there.
                Some(Ok(Item {
                    state: State::Released,
                    token: Some(t),
                    ..
                })) if t == lease.token => Ok(()),
                _ => Err(StoreError::LeaseLost),
            },
        }
    }

    pub(crate) async fn extend_inner(
        &self,
        lease: &Lease,
        lease_for: Duration,
    ) -> Result<Lease, StoreError> {
        if lease_for.is_zero() {
            return Err(StoreError::InvalidArgument {
                detail: "extending a lease by zero would end it at once".to_owned(),
            });
        }
        let now = self.now_ms();
        let until = now.saturating_add(millis(lease_for));
        let ex = until.saturating_add(millis(IN_PROGRESS_GRACE));
        let wrote = self
            .update(
                Self::item_key(&lease.key),
                "SET #le = :le, #ex = :ex, #tt = :tt, #rv = :rv",
                "#tk = :tk AND #st = :p AND #ex >= :gone",
                names(&[item::TK, item::ST, item::EX, item::TT, item::RV, item::LE]),
                HashMap::from([
                    (":tk".to_owned(), b(lease.token.to_bytes().to_vec())),
                    (":p".to_owned(), s("p")),
                    (":gone".to_owned(), n(now.saturating_sub(self.skew_ms))),
                    (":le".to_owned(), n(until)),
                    (":ex".to_owned(), n(ex)),
                    (":tt".to_owned(), self.ttl_of(ex)),
                    (":rv".to_owned(), n(random_rev())),
                ]),
                ReturnValue::AllNew,
            )
            .await?;
        match wrote {
            Write::Done(Some(new)) => {
                let new = item::decode(&new).map_err(|d| Self::corrupt(&lease.key, d))?;
                Ok(
                    Lease::new(lease.key.clone(), lease.token, new.attempt, wall(until))
                        .with_fence(new.fence)
                        .with_fingerprint(new.fingerprint),
                )
            }
            Write::Done(None) => {
                Ok(
                    Lease::new(lease.key.clone(), lease.token, lease.attempt, wall(until))
                        .with_fence(lease.fence)
                        .with_fingerprint(lease.fingerprint),
                )
            }
            Write::Refused(_) => Err(StoreError::LeaseLost),
        }
    }
}
