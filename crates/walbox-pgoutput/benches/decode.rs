//! Decoding speed on a realistic outbox insert stream.
//!
//! The stream is what pgoutput sends for an outbox table written in transactions of
//! ten rows: Begin, ten Inserts, Commit, with one Relation message up front. Each row
//! has a uuid event id, aggregate type, one of 1,000 aggregate ids, event type, a
//! jsonb payload of about 300 bytes, a headers jsonb with a traceparent, a
//! timestamptz and a schema version, all in text format as pgoutput sends them.
//!
//! Run with `cargo bench -p walbox-pgoutput` (or `make bench-decoder`). Criterion
//! prints throughput twice: in bytes/s and in messages/s.

use std::hint::black_box;

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use walbox_pgoutput::*;

const TRANSACTIONS: u64 = 1_000;
const ROWS_PER_TRANSACTION: u64 = 10;

fn text(s: String) -> TupleValue {
    TupleValue::Text(Bytes::from(s))
}

fn outbox_stream() -> Vec<Bytes> {
    let mut messages = Vec::new();
    let mut push = |m: LogicalMessage| {
        let mut out = BytesMut::new();
        encode(&m, &mut out);
        messages.push(out.freeze());
    };
    let columns = [
        ("id", 2950),
        ("aggregate_type", 25),
        ("aggregate_id", 25),
        ("event_type", 25),
        ("payload", 3802),
        ("headers", 3802),
        ("occurred_at", 1184),
        ("schema_version", 23),
    ];
    push(LogicalMessage::Relation(Relation {
        xid: None,
        oid: 16_390,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: ReplicaIdentity::Default,
        columns: columns
            .iter()
            .map(|(name, oid)| RelationColumn {
                flags: u8::from(*name == "id"),
                name: (*name).into(),
                type_oid: *oid,
                type_modifier: -1,
            })
            .collect(),
    }));
    let mut lsn = 0x1_6B37_0000u64;
    for tx in 0..TRANSACTIONS {
        let commit_lsn = lsn + ROWS_PER_TRANSACTION * 520;
        push(LogicalMessage::Begin(Begin {
            final_lsn: Lsn(commit_lsn),
            timestamp: PgTimestamp(817_000_000_000_000 + tx as i64),
            xid: 1_000 + tx as u32,
        }));
        for row in 0..ROWS_PER_TRANSACTION {
            let n = tx * ROWS_PER_TRANSACTION + row;
            let payload = format!(
                r#"{{"order_id": "ord-{n:08}", "customer_id": "cus-{:05}", "currency": "EUR", "total_cents": {}, "lines": [{{"sku": "SKU-{:06}", "qty": 2, "unit_cents": 1299}}, {{"sku": "SKU-{:06}", "qty": 1, "unit_cents": 4550}}], "shipping": {{"method": "standard", "country": "DE"}}, "note": "leave at the door"}}"#,
                n % 977,
                n * 7 % 100_000,
                n % 999_983,
                (n + 1) % 999_983
            );
            push(LogicalMessage::Insert(Insert {
                xid: None,
                relation_oid: 16_390,
                new: vec![
                    text(format!(
                        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
                        n,
                        n % 65_536,
                        n % 4096,
                        n % 4096,
                        n
                    )),
                    text("order".into()),
                    text(format!("order-{}", n % 1_000)),
                    text("OrderPlaced".into()),
                    text(payload),
                    text(format!(
                        r#"{{"traceparent": "00-{n:032x}-{:016x}-01"}}"#,
                        n * 31
                    )),
                    text("2026-11-29 19:40:00.123456+00".into()),
                    text("1".into()),
                ],
            }));
        }
        push(LogicalMessage::Commit(Commit {
            flags: 0,
            commit_lsn: Lsn(commit_lsn),
            end_lsn: Lsn(commit_lsn + 48),
            timestamp: PgTimestamp(817_000_000_000_000 + tx as i64),
        }));
        lsn = commit_lsn + 48;
    }
    messages
}

fn decode_all(messages: &[Bytes]) -> usize {
    let mut decoder = Decoder::new();
    let mut columns = 0;
    for m in messages {
        if let LogicalMessage::Insert(i) = decoder.decode(m).expect("valid stream") {
            columns += i.new.len();
        }
    }
    columns
}

fn bench(c: &mut Criterion) {
    let messages = outbox_stream();
    let bytes: usize = messages.iter().map(Bytes::len).sum();
    let inserts = TRANSACTIONS * ROWS_PER_TRANSACTION;
    let mut out = std::io::stderr().lock();
    use std::io::Write as _;
    let _ = writeln!(
        out,
        "setup: {} messages ({inserts} outbox inserts in {TRANSACTIONS} transactions), {bytes} bytes, \
         mean message {} bytes; {} ({} cores)",
        messages.len(),
        bytes / messages.len(),
        std::env::consts::ARCH,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );

    let mut g = c.benchmark_group("outbox_stream");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function("decode/bytes", |b| {
        b.iter(|| black_box(decode_all(black_box(&messages))))
    });
    g.throughput(Throughput::Elements(messages.len() as u64));
    g.bench_function("decode/messages", |b| {
        b.iter(|| black_box(decode_all(black_box(&messages))))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
