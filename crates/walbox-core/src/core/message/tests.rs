//! Unit tests of logical decoding messages in the core: transactional ones
//! among inserts, non-transactional ones as units of their own, ignored
//! prefixes, the stop policy, a replay's end and the resume skip.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use walbox_outbox::{MessageConfig, TableConfig, TopicTemplate};
use walbox_pgoutput::{
    DecodingMessage, Insert, LogicalMessage, Lsn, Relation, RelationColumn, ReplicaIdentity,
    TupleValue, encode,
};

use crate::checkpoint::Partial;
use crate::core::{Core, CoreConfig, Outcome, WalMessage};
use crate::error::CoreError;
use crate::holdback::ReplayWindow;

fn cfg(stop_on_poison: bool) -> CoreConfig {
    CoreConfig {
        tables: vec![TableConfig::new("outbox")],
        messages: vec![MessageConfig::new("walbox")],
        ignore_tables: Vec::new(),
        producer: "test".into(),
        publication: "p".into(),
        dead_letter_topic: TopicTemplate::parse("{topic}.dlq").unwrap(),
        stop_on_poison,
        max_in_flight: 1_000,
        max_in_flight_bytes: 1 << 20,
        replay_window: ReplayWindow::None,
        checkpoint_every: Duration::from_millis(100),
    }
}

fn data(msg: LogicalMessage) -> WalMessage {
    let mut buf = BytesMut::new();
    encode(&msg, &mut buf);
    WalMessage::Data {
        wal_start: Lsn(0),
        data: buf.freeze(),
    }
}

fn text(s: &str) -> TupleValue {
    TupleValue::Text(Bytes::copy_from_slice(s.as_bytes()))
}

fn relation() -> WalMessage {
    let cols = [
        "id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "payload",
    ];
    data(LogicalMessage::Relation(Relation {
        xid: None,
        oid: 16_400,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: ReplicaIdentity::Default,
        columns: cols
            .iter()
            .map(|n| RelationColumn {
                flags: 0,
                name: (*n).into(),
                type_oid: if *n == "payload" { 3802 } else { 25 },
                type_modifier: -1,
            })
            .collect(),
    }))
}

fn insert(id: &str, key: &str) -> WalMessage {
    data(LogicalMessage::Insert(Insert {
        xid: None,
        relation_oid: 16_400,
        new: vec![text(id), text("order"), text(key), text("T"), text("{}")],
    }))
}

fn message(prefix: &str, transactional: bool, lsn: u64, content: &str) -> WalMessage {
    data(LogicalMessage::Message(DecodingMessage {
        xid: None,
        flags: u8::from(transactional),
        lsn: Lsn(lsn),
        prefix: prefix.into(),
        content: Bytes::copy_from_slice(content.as_bytes()),
    }))
}

fn event(id: &str, key: &str) -> String {
    format!(
        r#"{{"id":"{id}","aggregate_type":"order","aggregate_id":"{key}","event_type":"T","payload":{{"n":1}}}}"#
    )
}

fn begin(final_lsn: u64) -> WalMessage {
    WalMessage::Begin {
        final_lsn: Lsn(final_lsn),
        xid: 9,
        commit_time: 1,
    }
}

fn commit(end: u64) -> WalMessage {
    WalMessage::Commit { end_lsn: Lsn(end) }
}

fn core(stop_on_poison: bool) -> Core {
    let mut c = Core::new(cfg(stop_on_poison));
    c.resume_at(Lsn(100), Lsn(100), None);
    c
}

fn drain(c: &mut Core) -> Vec<(walbox_outbox::Event, usize, crate::core::Provenance)> {
    std::iter::from_fn(|| c.next_send_with_origin()).collect()
}

#[test]
fn transactional_messages_are_events_among_the_inserts_in_wal_order() {
    let mut c = core(false);
    for m in [
        begin(300),
        relation(),
        insert("r-0", "a"),
        message("walbox", true, 210, &event("m-1", "b")),
        insert("r-2", "a"),
        message("walbox", true, 230, &event("m-3", "a")),
        commit(340),
    ] {
        c.on_wal(m).unwrap();
    }
    let sent = drain(&mut c);
    let got: Vec<(&str, u32, &str)> = sent
        .iter()
        .map(|(e, _, o)| (e.event_id.as_str(), e.position.index, &*o.table))
        .collect();
    assert_eq!(
        got,
        [
            ("r-0", 0, "public.outbox"),
            ("m-1", 1, "message:walbox"),
            ("r-2", 2, "public.outbox"),
            ("m-3", 3, "message:walbox"),
        ]
    );
    assert!(sent.iter().all(|(e, _, o)| !o.dead_letter
        && e.topic == "outbox.order"
        && e.position.commit_lsn == Lsn(300)));
    for (_, token, _) in sent {
        c.on_delivery(token, Outcome::Acked).unwrap();
    }
    assert_eq!(c.confirmed(), Lsn(340));
    assert_eq!(
        cfg(false).table_set(),
        ["message:walbox".to_owned(), "public.outbox".to_owned()]
    );
}

#[test]
fn a_bad_message_is_dead_lettered_in_its_place_or_stops_under_the_stop_policy() {
    let mut c = core(false);
    for m in [
        begin(300),
        message("walbox", true, 210, "not json"),
        message("walbox", true, 220, &event("m-1", "b")),
        commit(340),
    ] {
        c.on_wal(m).unwrap();
    }
    let sent = drain(&mut c);
    assert_eq!(sent.len(), 2);
    assert!(sent[0].2.dead_letter);
    assert_eq!(sent[0].0.topic, "walbox.message.walbox.dlq");
    assert_eq!(sent[0].0.event_id, format!("{}#0", Lsn(300)));
    assert_eq!(sent[1].0.position.index, 1);
    assert_eq!(c.stats().dead_lettered, 1);

    let mut c = core(true);
    c.on_wal(begin(300)).unwrap();
    let err = c
        .on_wal(message("walbox", true, 210, "not json"))
        .unwrap_err();
    assert!(
        matches!(&err, CoreError::Poison { table, class: "content_not_json", .. } if table == "message:walbox"),
        "{err}"
    );
    assert!(
        err.to_string()
            .starts_with("logical decoding message with event id"),
        "{err}"
    );
}

#[test]
fn a_transactional_message_outside_a_transaction_is_out_of_protocol() {
    let mut c = core(false);
    let err = c
        .on_wal(message("walbox", true, 210, &event("m", "k")))
        .unwrap_err();
    assert!(matches!(err, CoreError::Protocol(_)), "{err}");
}

#[test]
fn a_non_transactional_message_is_a_dead_lettered_unit_the_position_passes_once_acknowledged() {
    let mut c = core(false);
    for m in [begin(150), relation(), insert("r-0", "a"), commit(200)] {
        c.on_wal(m).unwrap();
    }
    c.on_wal(message("walbox", false, 250, &event("m-1", "b")))
        .unwrap();
    let sent = drain(&mut c);
    let (dead, token, origin) = &sent[1];
    assert!(origin.dead_letter);
    assert_eq!(&*origin.table, "message:walbox");
    assert_eq!(dead.topic, "outbox.order.dlq");
    assert_eq!(dead.event_id, "m-1");
    assert_eq!(dead.position.commit_lsn, Lsn(250));
    assert!(
        dead.headers
            .iter()
            .any(|(k, v)| k == "walbox_error" && v.starts_with(b"non-transactional message"))
    );
    c.on_delivery(sent[0].1, Outcome::Acked).unwrap();
    assert_eq!(c.confirmed(), Lsn(200));
    // A keepalive past it does not pass it while its dead letter is in flight.
    c.on_wal(WalMessage::KeepAlive { wal_end: Lsn(400) })
        .unwrap();
    assert_eq!(c.confirmed(), Lsn(200));
    c.on_delivery(*token, Outcome::Acked).unwrap();
    assert_eq!(c.confirmed(), Lsn(250));

    // The stop policy stops with the reason.
    let mut c = core(true);
    let err = c
        .on_wal(message("walbox", false, 250, &event("m-1", "b")))
        .unwrap_err();
    assert!(
        matches!(
            &err,
            CoreError::Poison {
                class: "non_transactional_message",
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("emit it with transactional = true")
    );
}

#[test]
fn messages_of_other_prefixes_are_ignored_and_counted() {
    let mut c = core(false);
    for m in [
        begin(300),
        relation(),
        message("other", true, 210, "anything"),
        insert("r-1", "a"),
        commit(340),
    ] {
        c.on_wal(m).unwrap();
    }
    c.on_wal(message("other", false, 350, "x")).unwrap();
    let sent = drain(&mut c);
    assert_eq!(sent.len(), 1);
    assert_eq!(
        sent[0].0.position.index, 0,
        "an ignored message takes no index"
    );
    assert_eq!(c.stats().ignored_messages, 2);
}

#[test]
fn a_replay_takes_a_non_transactional_message_up_to_its_end_and_not_after() {
    // A checkpoint at 250 is what acknowledging a message ending at 250 leaves:
    // a replay to it sends that message's dead letter again.
    let mut c = core(false);
    c.stop_at(Lsn(250));
    c.on_wal(message("walbox", false, 250, &event("m", "k")))
        .unwrap();
    assert!(!c.reached_end());
    assert_eq!(drain(&mut c).len(), 1);
    c.on_wal(message("walbox", false, 251, &event("m2", "k")))
        .unwrap();
    assert!(c.reached_end());
    assert!(drain(&mut c).is_empty());
}

#[test]
fn a_non_transactional_message_and_the_transaction_committing_at_its_lsn_differ_in_id_and_xid() {
    // emit(false) as the last thing before COMMIT: the message ends where the
    // commit record starts.
    let mut c = core(false);
    c.on_wal(message("walbox", false, 300, "not json")).unwrap();
    for m in [
        begin(300),
        message("walbox", true, 290, "not json either"),
        commit(340),
    ] {
        c.on_wal(m).unwrap();
    }
    let sent = drain(&mut c);
    assert_eq!(sent.len(), 2);
    let (a, b) = (&sent[0].0, &sent[1].0);
    assert_eq!(
        (a.position.commit_lsn, b.position.commit_lsn),
        (Lsn(300), Lsn(300))
    );
    assert_ne!(a.event_id, b.event_id);
    assert_eq!(a.event_id, format!("{}#nt", Lsn(300)));
    assert_eq!(b.event_id, format!("{}#0", Lsn(300)));
    assert_eq!((a.position.xid, b.position.xid), (0, 9));
}

#[test]
fn a_message_tied_with_the_insert_after_it_is_taken_first() {
    // A message in a subtransaction ends at 0x500, where the next insert (of
    // the top transaction) starts: the server may send the insert first.
    let at = |wal_start: u64, m: WalMessage| match m {
        WalMessage::Data { data, .. } => WalMessage::Data {
            wal_start: Lsn(wal_start),
            data,
        },
        other => other,
    };
    let mut c = core(false);
    for m in [
        begin(0x900),
        relation(),
        at(0x400, insert("r-0", "k")),
        at(0x500, insert("r-2", "k")),
        message("walbox", true, 0x500, &event("m-1", "k")),
        at(0x600, insert("r-3", "k")),
        commit(0x980),
    ] {
        c.on_wal(m).unwrap();
    }
    let ids: Vec<(String, u32)> = drain(&mut c)
        .into_iter()
        .map(|(e, _, _)| (e.event_id, e.position.index))
        .collect();
    assert_eq!(
        ids,
        [
            ("r-0".to_owned(), 0),
            ("m-1".to_owned(), 1),
            ("r-2".to_owned(), 2),
            ("r-3".to_owned(), 3)
        ]
    );
    // A multi-insert record (COPY): every row starts at the record's start.
    let mut c = core(false);
    for m in [
        begin(0x900),
        relation(),
        at(0x500, insert("c-0", "k")),
        at(0x500, insert("c-1", "k")),
        at(0x500, insert("c-2", "k")),
        message("walbox", true, 0x500, &event("m-1", "k")),
        commit(0x980),
    ] {
        c.on_wal(m).unwrap();
    }
    let ids: Vec<String> = drain(&mut c)
        .into_iter()
        .map(|(e, _, _)| e.event_id)
        .collect();
    assert_eq!(ids, ["m-1", "c-0", "c-1", "c-2"]);
    // Not tied: the order as sent.
    let mut c = core(false);
    for m in [
        begin(0x900),
        relation(),
        at(0x400, insert("r-0", "k")),
        message("walbox", true, 0x3ff, &event("m-1", "k")),
        commit(0x980),
    ] {
        c.on_wal(m).unwrap();
    }
    let ids: Vec<String> = drain(&mut c)
        .into_iter()
        .map(|(e, _, _)| e.event_id)
        .collect();
    assert_eq!(ids, ["r-0", "m-1"]);
}

#[test]
fn the_resume_skip_counts_messages_over_the_same_prefixes_only() {
    let stream = || {
        [
            begin(300),
            relation(),
            insert("r-0", "a"),
            message("walbox", true, 210, &event("m-1", "b")),
            insert("r-2", "a"),
            commit(340),
        ]
    };
    let partial = |tables: Vec<String>| Partial {
        commit_lsn: Lsn(300),
        events: 2,
        tables,
    };
    let mut c = Core::new(cfg(false));
    c.resume_at(Lsn(100), Lsn(100), Some(partial(cfg(false).table_set())));
    for m in stream() {
        c.on_wal(m).unwrap();
    }
    let ids: Vec<String> = drain(&mut c)
        .into_iter()
        .map(|(e, _, _)| e.event_id)
        .collect();
    assert_eq!(ids, ["r-2"]);

    // Counted without the prefix: the whole transaction again.
    let mut c = Core::new(cfg(false));
    c.resume_at(
        Lsn(100),
        Lsn(100),
        Some(partial(vec!["public.outbox".into()])),
    );
    for m in stream() {
        c.on_wal(m).unwrap();
    }
    assert_eq!(drain(&mut c).len(), 3);
}

#[test]
fn a_held_insert_never_stops_reading_when_nothing_else_is_in_flight() {
    let mut c = Core::new(CoreConfig {
        max_in_flight: 1,
        ..cfg(false)
    });
    for m in [begin(0x900), relation(), insert("r-0", "k")] {
        c.on_wal(m).unwrap();
    }
    assert!(c.reading(false), "held, nothing in flight: read on");
    c.on_wal(commit(0x980)).unwrap();
    assert_eq!(drain(&mut c).len(), 1);
    assert!(c.full());
}

#[test]
fn held_inserts_count_against_the_byte_bound_while_something_else_is_in_flight() {
    let at = |wal_start: u64, id: &str, pad: usize| {
        let mut buf = BytesMut::new();
        encode(
            &LogicalMessage::Insert(Insert {
                xid: None,
                relation_oid: 16_400,
                new: vec![
                    text(id),
                    text("order"),
                    text("k"),
                    text("T"),
                    text(&format!(r#"{{"p":"{}"}}"#, "x".repeat(pad))),
                ],
            }),
            &mut buf,
        );
        WalMessage::Data {
            wal_start: Lsn(wal_start),
            data: buf.freeze(),
        }
    };
    let mut c = Core::new(CoreConfig {
        max_in_flight: 100,
        max_in_flight_bytes: 2_000,
        ..cfg(false)
    });
    // r-0 is released (in flight) by the insert at another position, which is
    // held; so is the second row of its multi-insert record.
    for m in [
        begin(0x900),
        relation(),
        at(0x800, "r-0", 10),
        at(0x810, "r-1", 900),
    ] {
        c.on_wal(m).unwrap();
    }
    assert_eq!(c.in_flight(), 1);
    assert!(c.in_flight_bytes() < 1_000);
    assert!(!c.full(), "one small event in flight, one row held");
    c.on_wal(at(0x810, "r-2", 900)).unwrap();
    let (rows, bytes) = c.held();
    assert_eq!(rows, 2);
    assert!(bytes > 1_800, "{bytes}");
    assert!(
        c.full(),
        "the held rows' bytes with the event in flight reach the bound: reading waits"
    );
    // Nothing else in flight: the held rows alone never stop reading.
    let (_, token, _) = drain(&mut c).pop().unwrap();
    c.on_delivery(token, Outcome::Acked).unwrap();
    assert!(!c.full());
    c.on_wal(commit(0x980)).unwrap();
    assert_eq!(c.held(), (0, 0));
    assert_eq!(drain(&mut c).len(), 2);
}

#[test]
fn a_pause_before_a_held_insert_that_its_commit_releases_ends_reading_cleanly() {
    // With [[messages]], an insert is held until the next change: here the
    // Commit, which releases it into the pause.
    let mut c = core(false);
    c.pause_before([(16_400, "public.outbox".to_owned())]);
    for m in [begin(0x900), relation(), insert("r-0", "k"), commit(0x980)] {
        c.on_wal(m).unwrap();
    }
    assert!(c.paused());
    assert!(c.reached_end());
    assert!(c.idle(), "nothing of the transaction was taken");
    assert!(drain(&mut c).is_empty());
    assert_eq!(c.confirmed(), Lsn(100), "the position stays before it");
}

#[test]
fn a_non_transactional_message_whose_dead_letter_is_refused_is_dead_lettered_without_its_content() {
    use crate::error::{Failure, Rejected};
    let mut c = core(false);
    let big = format!(
        r#"{{"id":"m","aggregate_type":"order","aggregate_id":"k","event_type":"T","payload":{{"s":"{}"}}}}"#,
        "x".repeat(100_000)
    );
    c.on_wal(message("walbox", false, 250, &big)).unwrap();
    let (dead, token, _) = drain(&mut c).pop().unwrap();
    let refused = Failure {
        event_id: dead.event_id.clone(),
        topic: dead.topic.clone(),
        class: "message_too_large",
        reason: "too large".into(),
        about_message: true,
        lasting: false,
        rejected: Some(Rejected {
            key: dead.key.clone(),
            headers: dead.headers.clone(),
            value_len: dead.value.len(),
            attempts: 1,
        }),
    };
    c.on_delivery(token, Outcome::Failed(refused))
        .expect("a smaller letter takes its place");
    let (smaller, token, origin) = drain(&mut c).pop().unwrap();
    assert!(origin.dead_letter);
    assert_eq!(smaller.topic, dead.topic);
    assert!(smaller.value.len() < 200, "{}", smaller.value.len());
    assert_eq!(c.confirmed(), Lsn(100));
    c.on_delivery(token, Outcome::Acked).unwrap();
    assert_eq!(c.confirmed(), Lsn(250));
    assert_eq!(
        c.stats().dead_lettered,
        1,
        "one event, one dead letter counted"
    );
}

#[test]
fn ignored_prefixes_are_remembered_in_bounded_memory() {
    let mut c = core(false);
    for i in 0..10_000u64 {
        c.on_wal(message(&format!("audit.{i}"), false, 200 + i, "x"))
            .unwrap();
    }
    assert_eq!(c.stats().ignored_messages, 10_000);
    assert_eq!(
        c.unknown_prefixes.len(),
        super::super::message::IGNORED_PREFIXES_NAMED
    );
    assert!(drain(&mut c).is_empty());
}

/// `relation()` and `insert()` under another oid.
fn swapped(msg: WalMessage, oid: u32) -> WalMessage {
    let WalMessage::Data { data, .. } = msg else {
        unreachable!()
    };
    let mut decoded = walbox_pgoutput::Decoder::new().decode(&data).unwrap();
    match &mut decoded {
        LogicalMessage::Relation(r) => r.oid = oid,
        LogicalMessage::Insert(i) => i.relation_oid = oid,
        _ => unreachable!(),
    }
    self::data(decoded)
}

#[test]
fn a_table_swapped_while_streaming_ends_reading_before_its_first_insert() {
    let mut c = core(false);
    c.expect_tables([("public.outbox".to_owned(), 16_400)]);
    for m in [begin(0x200), relation(), insert("a", "k"), commit(0x280)] {
        c.on_wal(m).unwrap();
    }
    assert_eq!(drain(&mut c).len(), 1);
    // The new table of the same name: its first insert is not taken.
    for m in [
        begin(0x300),
        swapped(relation(), 16_500),
        swapped(insert("b", "k"), 16_500),
        commit(0x380),
    ] {
        c.on_wal(m).unwrap();
    }
    assert!(c.paused() && c.reached_end());
    assert!(drain(&mut c).is_empty());
}

#[test]
fn an_earlier_table_of_the_name_before_the_expected_one_is_streamed() {
    // The stream starts before a swap whose snapshot is complete: the old
    // table's inserts come first, then the recorded new table's.
    let mut c = core(false);
    c.expect_tables([("public.outbox".to_owned(), 16_500)]);
    for m in [
        begin(0x200),
        relation(),
        insert("a", "k"),
        commit(0x280),
        begin(0x300),
        swapped(relation(), 16_500),
        swapped(insert("b", "k"), 16_500),
        commit(0x380),
    ] {
        c.on_wal(m).unwrap();
    }
    assert!(!c.paused());
    let ids: Vec<String> = drain(&mut c)
        .into_iter()
        .map(|(e, _, _)| e.event_id.to_string())
        .collect();
    assert_eq!(ids, ["a", "b"]);
}

#[test]
fn every_event_a_replay_reads_is_the_replays_a_non_transactional_messages_letter_too() {
    // `walbox replay --from 0/C8` reads a transaction and, before it, a
    // non-transactional message: both are the replay's copies (a sink
    // stores them under the replay's ids), and the message's letter stays
    // outside commit order (a sink keeps its id apart from the commit that
    // may share its LSN).
    let mut c = core(false);
    c.replay_from(Lsn(200));
    c.on_wal(message("walbox", false, 300, "not json")).unwrap();
    for m in [
        begin(300),
        message("walbox", true, 290, &event("t", "k")),
        commit(340),
    ] {
        c.on_wal(m).unwrap();
    }
    let sent = drain(&mut c);
    let origins: Vec<&walbox_outbox::Origin> = sent.iter().map(|(e, _, _)| &e.origin).collect();
    assert_eq!(
        origins,
        [
            &walbox_outbox::Origin::Message {
                replay: Some(Lsn(200))
            },
            &walbox_outbox::Origin::Replay { from: Lsn(200) },
        ]
    );
    assert!(
        sent.iter()
            .all(|(e, _, _)| e.origin.replay_name().as_deref() == Some("0/C8"))
    );
    assert!(sent[0].0.origin.outside_commit_order());
    assert!(!sent[1].0.origin.outside_commit_order());
}
