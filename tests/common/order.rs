//! Ordering checks: each key's events in commit order within one partition,
//! and the partition Kafka's Java client would pick for a key.

use std::collections::HashMap;

use walbox_testkit::kafka::Record;

/// Checks per-key order: within each key, the payload's `seq` grows by one from 0
/// in partition offset order (repeats allowed only as exact replays when
/// `allow_replay`).
pub fn assert_per_key_order(records: &[Record], allow_replay: bool) {
    let mut sorted: Vec<&Record> = records.iter().collect();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut next: HashMap<String, (i32, i64)> = HashMap::new();
    for r in sorted {
        let key = r.key_str().expect("key").to_owned();
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
        let seq = v["payload"]["seq"].as_i64().unwrap();
        let (partition, expected) = next.entry(key.clone()).or_insert((r.partition, 0));
        assert_eq!(*partition, r.partition, "key {key} on two partitions");
        if seq == *expected {
            *expected += 1;
        } else if allow_replay && seq < *expected {
            // A replay after a restart starts again from an earlier event.
            *expected = seq + 1;
        } else {
            panic!("key {key}: seq {seq} where {expected} was expected");
        }
    }
}

/// Kafka's Java client hash: `Utils.murmur2`.
pub fn java_murmur2(key: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = SEED ^ (key.len() as u32);
    let mut chunks = key.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if tail.len() >= 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if !tail.is_empty() {
        h ^= u32::from(tail[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition the Java client's default partitioner picks for `key`.
pub fn java_partition(key: &[u8], partitions: i32) -> i32 {
    (java_murmur2(key) & 0x7fff_ffff) % partitions
}
