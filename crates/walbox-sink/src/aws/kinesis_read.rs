//! Reading a Kinesis stream back: every record walbox wrote, shard by
//! shard from its start (`walbox verify`), and the letters of a dead-letter
//! stream that a replay has not done yet (`walbox dlq replay`), page by
//! page, so that memory holds at most one page and the letters not yet
//! replayed.
//!
//! Kinesis keeps no consumer position, so a replay keeps its own in the
//! stream: once the letters of a shard up to a sequence number are
//! replayed, a marker record naming the shard and that sequence number is
//! written into the shard (`{"walbox_dlq_replayed_through": {"group",
//! "shard", "sequence"}}`). Readers of events skip it: it has no
//! `event_id`.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::ShardIteratorType;

use super::kinesis::KinesisSinkConfig;
use super::{envelope, setup_error};
use crate::{OwnedRecord, RecordView, SinkError};

/// The field of a progress marker.
const REPLAYED_THROUGH: &str = "walbox_dlq_replayed_through";

/// A shard: its id and the start of its hash key range.
#[derive(Debug, Clone)]
struct Shard {
    id: String,
    start: String,
}

/// One record read back: its shard's index in the listing, its sequence
/// number, its place in the shard, its data.
struct Read<'a> {
    partition: i32,
    shard: &'a str,
    sequence: &'a str,
    offset: i64,
    data: &'a [u8],
}

/// The shards of `stream` in the order the stream lists them; `None` when
/// it does not exist.
async fn shards(
    client: &aws_sdk_kinesis::Client,
    stream: &str,
) -> Result<Option<Vec<Shard>>, SinkError> {
    let mut shards = Vec::new();
    let mut next: Option<String> = None;
    loop {
        let call = match &next {
            Some(token) => client.list_shards().next_token(token),
            None => client.list_shards().stream_name(stream),
        };
        match call.send().await {
            Ok(out) => {
                shards.extend(out.shards().iter().map(|s| {
                    Shard {
                        id: s.shard_id().to_owned(),
                        start: s
                            .hash_key_range()
                            .map(|r| r.starting_hash_key().to_owned())
                            .unwrap_or_default(),
                    }
                }));
                next = out.next_token().map(str::to_owned);
                if next.is_none() {
                    return Ok(Some(shards));
                }
            }
            Err(e) => {
                if e.as_service_error()
                    .is_some_and(|se| se.is_resource_not_found_exception())
                {
                    return Ok(None);
                }
                return Err(setup_error(
                    &e,
                    "kinesis",
                    &format!("listing the shards of {stream:?}"),
                ));
            }
        }
    }
}

/// Reads shard `index` of `stream` from its start to its end, page by
/// page, calling `each` for every record.
async fn read_shard(
    client: &aws_sdk_kinesis::Client,
    stream: &str,
    (index, shard): (usize, &Shard),
    deadline: tokio::time::Instant,
    mut each: impl FnMut(Read<'_>),
) -> Result<(), SinkError> {
    let partition = i32::try_from(index).unwrap_or(i32::MAX);
    let mut iterator = client
        .get_shard_iterator()
        .stream_name(stream)
        .shard_id(&shard.id)
        .shard_iterator_type(ShardIteratorType::TrimHorizon)
        .send()
        .await
        .map_err(|e| {
            setup_error(
                &e,
                "kinesis",
                &format!("reading shard {} of {stream:?}", shard.id),
            )
        })?
        .shard_iterator()
        .map(str::to_owned);
    let mut offset = 0i64;
    while let Some(it) = iterator.take() {
        if tokio::time::Instant::now() > deadline {
            return Err(SinkError::Read {
                topic: stream.to_owned(),
                reason: "reading took longer than the timeout".into(),
            });
        }
        let out = match client
            .get_records()
            .shard_iterator(&it)
            .limit(1000)
            .send()
            .await
        {
            Ok(out) => out,
            Err(e) => {
                let throttled = e
                    .as_service_error()
                    .is_some_and(|se| se.is_provisioned_throughput_exceeded_exception());
                if throttled {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    iterator = Some(it);
                    continue;
                }
                return Err(setup_error(&e, "kinesis", &format!("reading {stream:?}")));
            }
        };
        for r in out.records() {
            each(Read {
                partition,
                shard: &shard.id,
                sequence: r.sequence_number(),
                offset,
                data: r.data().as_ref(),
            });
            offset += 1;
        }
        // The end of what the shard holds now: an empty page with nothing
        // behind it (a closed shard has no next iterator).
        let caught_up = out.records().is_empty() && out.millis_behind_latest().unwrap_or(0) == 0;
        iterator = if caught_up {
            None
        } else {
            out.next_shard_iterator().map(str::to_owned)
        };
    }
    Ok(())
}

/// Reads `stream` from the start of each shard to its end (a shard's index
/// in the order the stream lists them as the record's partition, its place
/// in the shard as offset), calling `each` for every record walbox wrote;
/// returns how many. `Ok(None)` when the stream does not exist.
pub async fn read_kinesis_stream(
    config: &KinesisSinkConfig,
    stream: &str,
    timeout: Duration,
    mut each: impl FnMut(RecordView<'_>),
) -> Result<Option<u64>, SinkError> {
    let sdk = config.connection().sdk_config("sink.kinesis").await?;
    let client = aws_sdk_kinesis::Client::new(&sdk);
    let Some(shards) = shards(&client, stream).await? else {
        return Ok(None);
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let mut count = 0;
    for shard in shards.iter().enumerate() {
        read_shard(&client, stream, shard, deadline, |r| {
            if let Some(record) = envelope::decode(r.data, r.partition, r.offset) {
                each(RecordView::owned(&record));
                count += 1;
            }
        })
        .await?;
    }
    Ok(Some(count))
}

/// Whether sequence number `a` comes before `b` (decimal numbers of up to
/// 128 bits, compared as such).
fn sequence_before(a: &str, b: &str) -> bool {
    (a.len(), a) < (b.len(), b)
}

/// A letter read: its shard, its sequence number, the record.
#[derive(Debug)]
struct Letter {
    shard: String,
    sequence: String,
    record: OwnedRecord,
}

/// The letters one run of `walbox dlq replay` read from a Kinesis
/// dead-letter stream: in each shard, those after the last marker of its
/// group that names the shard (wherever the marker landed: a closed shard
/// takes no writes, so a split's marker lands in a child).
pub struct KinesisLetters {
    client: aws_sdk_kinesis::Client,
    stream: String,
    group: String,
    shards: Vec<Shard>,
    letters: Vec<Letter>,
}

impl std::fmt::Debug for KinesisLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KinesisLetters")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("letters", &self.letters.len())
            .finish_non_exhaustive()
    }
}

/// The group, shard and sequence number a marker names, if `data` is one.
fn marker(data: &[u8]) -> Option<(String, String, String)> {
    let serde_json::Value::Object(o) = serde_json::from_slice(data).ok()? else {
        return None;
    };
    let m = o.get(REPLAYED_THROUGH)?;
    Some((
        m.get("group")?.as_str()?.to_owned(),
        m.get("shard")?.as_str()?.to_owned(),
        m.get("sequence")?.as_str()?.to_owned(),
    ))
}

impl KinesisLetters {
    /// Reads the letters of `stream` the group `group` has not replayed.
    /// `None` when the stream does not exist (nothing was dead-lettered).
    pub async fn read(
        config: &KinesisSinkConfig,
        stream: &str,
        group: &str,
        timeout: Duration,
    ) -> Result<Option<Self>, SinkError> {
        let sdk = config.connection().sdk_config("sink.kinesis").await?;
        let client = aws_sdk_kinesis::Client::new(&sdk);
        let Some(shards) = shards(&client, stream).await? else {
            return Ok(None);
        };
        let deadline = tokio::time::Instant::now() + timeout;
        // Per shard, the last sequence number the group's markers name, and
        // the letters after it read so far.
        let mut through: HashMap<String, String> = HashMap::new();
        let mut letters: Vec<Letter> = Vec::new();
        for shard in shards.iter().enumerate() {
            read_shard(&client, stream, shard, deadline, |r| {
                if let Some((of, named, sequence)) = marker(r.data) {
                    if of == group {
                        let later = through
                            .get(&named)
                            .is_none_or(|known| sequence_before(known, &sequence));
                        if later {
                            letters.retain(|l| {
                                l.shard != named || sequence_before(&sequence, &l.sequence)
                            });
                            through.insert(named, sequence);
                        }
                    }
                    return;
                }
                let done = through
                    .get(r.shard)
                    .is_some_and(|t| !sequence_before(t, r.sequence));
                if done {
                    return;
                }
                if let Some(record) = envelope::decode(r.data, r.partition, r.offset) {
                    letters.push(Letter {
                        shard: r.shard.to_owned(),
                        sequence: r.sequence.to_owned(),
                        record,
                    });
                }
            })
            .await?;
        }
        Ok(Some(KinesisLetters {
            client,
            stream: stream.to_owned(),
            group: group.to_owned(),
            shards,
            letters,
        }))
    }

    /// Calls `each` for every letter read, in each shard's order, as
    /// partition 0 and its place in this read as offset.
    pub fn each(&self, mut each: impl FnMut(RecordView<'_>)) {
        for (i, letter) in self.letters.iter().enumerate() {
            // Partition 0 and the place in this read: unique, as the
            // replay's bookkeeping wants.
            let mut record = letter.record.clone();
            record.partition = 0;
            record.offset = i64::try_from(i).unwrap_or(i64::MAX);
            each(RecordView::owned(&record));
        }
    }

    /// Records the progress: in each shard, the letters before the first one
    /// `done` does not take (by the offset [`KinesisLetters::each`] gave)
    /// are replayed, and a marker naming the last of them is written into
    /// that shard. A shard whose first letter is not done keeps its marker.
    pub async fn settle(&self, done: impl Fn(i64) -> bool) -> Result<(), SinkError> {
        let mut stopped: HashSet<&str> = HashSet::new();
        let mut last: HashMap<&str, &str> = HashMap::new();
        for (i, letter) in self.letters.iter().enumerate() {
            let shard = letter.shard.as_str();
            if stopped.contains(shard) {
                continue;
            }
            if done(i64::try_from(i).unwrap_or(i64::MAX)) {
                last.insert(shard, letter.sequence.as_str());
            } else {
                stopped.insert(shard);
            }
        }
        for (shard, sequence) in last {
            let marker = serde_json::json!({
                REPLAYED_THROUGH: {"group": self.group, "shard": shard, "sequence": sequence}
            });
            let mut put = self
                .client
                .put_record()
                .stream_name(&self.stream)
                .partition_key(&self.group)
                .data(Blob::new(serde_json::to_vec(&marker).unwrap_or_default()));
            // Into the shard whose letters it names, while it is open.
            if let Some(s) = self.shards.iter().find(|s| s.id == shard)
                && !s.start.is_empty()
            {
                put = put.explicit_hash_key(&s.start);
            }
            put.send().await.map_err(|e| {
                setup_error(
                    &e,
                    "kinesis",
                    &format!("recording the replay's progress in {:?}", self.stream),
                )
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_numbers_compare_as_numbers() {
        assert!(sequence_before("9", "10"));
        assert!(sequence_before(
            "49590338271490256608559692538361571095921575989136588802",
            "49590338271490256608559692540925702759324208523137515522"
        ));
        assert!(!sequence_before("10", "10"));
    }

    #[test]
    fn a_marker_is_read_back_and_an_event_is_none() {
        let m = serde_json::json!({REPLAYED_THROUGH: {"group": "g", "shard": "shardId-000000000001", "sequence": "42"}});
        assert_eq!(
            marker(&serde_json::to_vec(&m).unwrap()),
            Some(("g".into(), "shardId-000000000001".into(), "42".into()))
        );
        assert_eq!(marker(br#"{"event_id": "e", "value": 1}"#), None);
    }
}
