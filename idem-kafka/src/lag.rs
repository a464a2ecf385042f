//! A consumer group's committed offsets and lag, read with the
//! consumer's client or with a client of its own.

use std::collections::BTreeMap;
use std::time::Duration;

use idem_core::{Codec, IdempotencyStore};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::util::Timeout;

use crate::consumer::KafkaConsumer;
use crate::error::KafkaConsumerError;

impl<S: IdempotencyStore + ?Sized, C: Codec> KafkaConsumer<S, C> {
    /// The group's lag on the partitions assigned to this consumer now:
    /// the high watermark minus the committed offset (the low watermark
    /// if nothing is committed), per partition.
    pub async fn lag(&self) -> Result<BTreeMap<(String, i32), i64>, KafkaConsumerError> {
        let consumer = self.consumer.clone();
        let timeout = self.call_timeout;
        tokio::task::spawn_blocking(move || {
            let assignment = consumer.assignment()?;
            lag_of(&*consumer, assignment, timeout)
        })
        .await
        .map_err(|e| KafkaConsumerError::Config(format!("the lag task failed: {e}")))?
    }
}

/// The lag of `partitions` for the consumer's group, per partition.
fn lag_of<K: Consumer<X>, X: ConsumerContext>(
    consumer: &K,
    partitions: TopicPartitionList,
    timeout: Duration,
) -> Result<BTreeMap<(String, i32), i64>, KafkaConsumerError> {
    let committed = consumer.committed_offsets(partitions, Timeout::After(timeout))?;
    let mut out = BTreeMap::new();
    for e in committed.elements() {
        let (low, high) =
            consumer.fetch_watermarks(e.topic(), e.partition(), Timeout::After(timeout))?;
        let at = match e.offset() {
            Offset::Offset(o) => o,
            _ => low,
        };
        out.insert((e.topic().to_owned(), e.partition()), (high - at).max(0));
    }
    Ok(out)
}

/// A client of its own made from `config` (which must set
/// `bootstrap.servers` and `group.id`; it does not join the group), and
/// the partitions of `topic`.
fn group_reader(
    config: &ClientConfig,
    topic: &str,
    timeout: Duration,
) -> Result<(BaseConsumer, TopicPartitionList), KafkaConsumerError> {
    let consumer: BaseConsumer = config.create()?;
    let metadata = consumer.fetch_metadata(Some(topic), Timeout::After(timeout))?;
    let mut tpl = TopicPartitionList::new();
    for t in metadata.topics() {
        for p in t.partitions() {
            tpl.add_partition(t.name(), p.id());
        }
    }
    Ok((consumer, tpl))
}

/// The committed lag of a consumer group on a topic, per partition: the
/// high watermark minus the committed offset (the low watermark when
/// nothing is committed). Some brokers under-report the high watermark
/// (Tansu 0.6 answers a multi-record batch's base offset + 1): compare
/// [`group_committed`] with the producer's delivery reports there.
pub async fn group_lag(
    config: &ClientConfig,
    topic: &str,
    timeout: Duration,
) -> Result<BTreeMap<(String, i32), i64>, KafkaConsumerError> {
    let config = config.clone();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let (consumer, tpl) = group_reader(&config, &topic, timeout)?;
        lag_of(&consumer, tpl, timeout)
    })
    .await
    .map_err(|e| KafkaConsumerError::Config(format!("the lag task failed: {e}")))?
}

/// The offsets a consumer group committed on a topic, per partition
/// (partitions without a commit are left out).
pub async fn group_committed(
    config: &ClientConfig,
    topic: &str,
    timeout: Duration,
) -> Result<BTreeMap<(String, i32), i64>, KafkaConsumerError> {
    let config = config.clone();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let (consumer, tpl) = group_reader(&config, &topic, timeout)?;
        let committed = consumer.committed_offsets(tpl, Timeout::After(timeout))?;
        Ok(committed
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(o) => Some(((e.topic().to_owned(), e.partition()), o)),
                _ => None,
            })
            .collect())
    })
    .await
    .map_err(|e| KafkaConsumerError::Config(format!("the offsets task failed: {e}")))?
}
