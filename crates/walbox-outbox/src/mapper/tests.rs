//! Unit tests of compiling mappings, mapping rows and dead letters.

use bytes::Bytes;
use walbox_pgoutput::{Oid, Relation, RelationColumn, TupleValue};

use crate::test_rows::{pos, relation_named, t};

use super::compile::{BYTEA, JSONB, TEXT};
use super::value::{json_headers, rfc3339};
use super::*;
use crate::config::{ColumnNames, TableConfig};
use crate::event::Event;
use crate::template::TopicTemplate;

const STANDARD: &[(&str, Oid)] = &[
    ("id", 2950),
    ("aggregate_type", TEXT),
    ("aggregate_id", TEXT),
    ("event_type", TEXT),
    ("payload", JSONB),
    ("headers", JSONB),
    ("occurred_at", 1184),
    ("schema_version", 23),
];

fn relation(columns: &[(&str, Oid)]) -> Relation {
    relation_named("outbox", columns)
}

fn standard_row() -> Vec<TupleValue> {
    vec![
        t("7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11"),
        t("order"),
        t("order-42"),
        t("OrderPlaced"),
        t(r#"{"total": 1299, "items": [{"sku": "A-1"}], "note": "Grüße \"quoted\""}"#),
        t(r#"{"traceparent": "00-abc-def-01", "tenant": "acme", "retries": 3}"#),
        t("2026-11-29 19:40:00.123456+00"),
        t("2"),
    ]
}

fn header<'a>(e: &'a Event, name: &str) -> Option<&'a str> {
    e.headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| std::str::from_utf8(v).unwrap())
}

#[test]
fn standard_row_becomes_an_envelope_with_headers() {
    let m = Mapper::compile(
        &TableConfig::new("outbox"),
        "orders-service",
        &relation(STANDARD),
    )
    .unwrap();
    let e = m.map(&standard_row(), pos()).unwrap();
    assert_eq!(e.event_id, "7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11");
    assert_eq!(e.topic, "outbox.order");
    assert_eq!(e.key.as_deref(), Some(&b"order-42"[..]));
    let v: serde_json::Value = serde_json::from_slice(&e.value).unwrap();
    assert_eq!(
        v,
        serde_json::json!({
            "event_id": "7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11",
            "event_type": "OrderPlaced",
            "schema_version": 2,
            "occurred_at": "2026-11-29T19:40:00.123456+00:00",
            "producer": "orders-service",
            "payload": {"total": 1299, "items": [{"sku": "A-1"}], "note": "Grüße \"quoted\""}
        })
    );
    assert_eq!(
        header(&e, "event_id"),
        Some("7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11")
    );
    assert_eq!(header(&e, "event_type"), Some("OrderPlaced"));
    assert_eq!(header(&e, "schema_version"), Some("2"));
    assert_eq!(header(&e, "aggregate_type"), Some("order"));
    assert_eq!(header(&e, "traceparent"), Some("00-abc-def-01"));
    assert_eq!(header(&e, "tenant"), Some("acme"));
    assert_eq!(
        header(&e, "retries"),
        None,
        "only string entries become headers"
    );
    assert_eq!(header(&e, "walbox_commit_lsn"), Some("16/B374D848"));
    assert_eq!(header(&e, "walbox_index"), Some("3"));
    assert_eq!(header(&e, "walbox_xid"), Some("991"));
    assert_eq!(e.position, pos());
    assert!(e.size() > e.value.len());
}

#[test]
fn optional_columns_may_be_absent_or_null() {
    let minimal = &STANDARD[..5];
    let m = Mapper::compile(&TableConfig::new("outbox"), "p", &relation(minimal)).unwrap();
    let e = m.map(&standard_row()[..5], pos()).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&e.value).unwrap();
    assert_eq!(v["schema_version"], serde_json::Value::Null);
    assert_eq!(v["occurred_at"], serde_json::Value::Null);
    assert_eq!(header(&e, "schema_version"), None);

    let m = Mapper::compile(&TableConfig::new("outbox"), "p", &relation(STANDARD)).unwrap();
    let mut row = standard_row();
    row[5] = TupleValue::Null;
    row[6] = TupleValue::Null;
    row[7] = TupleValue::Null;
    let e = m.map(&row, pos()).unwrap();
    assert_eq!(header(&e, "traceparent"), None);
    let v: serde_json::Value = serde_json::from_slice(&e.value).unwrap();
    assert_eq!(v["occurred_at"], serde_json::Value::Null);
}

#[test]
fn renamed_columns_and_fixed_topic() {
    let cfg: TableConfig = toml::from_str(
        r#"
        table = "events.outbox_v2"
        topic = "orders"
        [columns]
        id = "event_uuid"
        aggregate_id = "order_id"
        event_type = "kind"
        payload = "body"
        "#,
    )
    .unwrap();
    assert_eq!(cfg.qualified(), ("events", "outbox_v2"));
    let rel = relation(&[
        ("event_uuid", 2950),
        ("order_id", TEXT),
        ("kind", TEXT),
        ("body", TEXT),
    ]);
    let m = Mapper::compile(&cfg, "p", &rel).unwrap();
    let e = m
        .map(&[t("e-1"), t("o-9"), t("Shipped"), t(r#"[1,2]"#)], pos())
        .unwrap();
    assert_eq!(
        (e.topic.as_str(), e.key.as_deref()),
        ("orders", Some(&b"o-9"[..]))
    );
    let v: serde_json::Value = serde_json::from_slice(&e.value).unwrap();
    assert_eq!(v["payload"], serde_json::json!([1, 2]));
    assert_eq!(v["event_type"], "Shipped");
}

#[test]
fn ready_made_envelope_and_topic_columns() {
    let cfg: TableConfig = toml::from_str(
        r#"
        table = "outbox"
        topic_column = "topic"
        value = { column = "envelope" }
        [columns]
        id = "event_id"
        "#,
    )
    .unwrap();
    let rel = relation(&[("event_id", TEXT), ("topic", TEXT), ("envelope", BYTEA)]);
    let m = Mapper::compile(&cfg, "p", &rel).unwrap();
    let e = m
        .map(&[t("e-7"), t("billing.invoices"), t("\\x7b7d")], pos())
        .unwrap();
    assert_eq!(e.topic, "billing.invoices");
    assert_eq!(&e.value[..], b"\\x7b7d", "value column taken as sent");
    assert_eq!(e.key, None, "no aggregate id column: no key");
    assert_eq!(header(&e, "event_id"), Some("e-7"));
}

#[test]
fn bytea_and_text_payloads_must_hold_json() {
    let rel = |ty| {
        relation(&[
            ("id", TEXT),
            ("aggregate_type", TEXT),
            ("aggregate_id", TEXT),
            ("event_type", TEXT),
            ("payload", ty),
        ])
    };
    let row = |p: &str| vec![t("1"), t("a"), t("k"), t("E"), t(p)];
    let m = Mapper::compile(&TableConfig::new("outbox"), "p", &rel(BYTEA)).unwrap();
    // {"a":1} as bytea hex output.
    let e = m.map(&row("\\x7b2261223a317d"), pos()).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&e.value).unwrap();
    assert_eq!(v["payload"], serde_json::json!({"a": 1}));
    let err = m.map(&row("\\x6869"), pos()).unwrap_err();
    assert_eq!(err.class(), "payload_not_json");
    let err = m.map(&row("\\x6"), pos()).unwrap_err();
    assert_eq!(err.class(), "payload_not_json");
    // The same value under `bytea_output = escape`, and escapes of every kind.
    let e = m.map(&row(r#"{"a":1}"#), pos()).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&e.value).unwrap();
    assert_eq!(v["payload"], serde_json::json!({"a": 1}));
    let e = m.map(&row(r#"{"b":"\\\\ \303\274\101"}"#), pos()).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&e.value).unwrap();
    assert_eq!(v["payload"], serde_json::json!({"b": "\\ üA"}));
    for bad in [
        r#"{"a":1}\"#,
        r#"{"a":1}\4"#,
        r#"{"a":1}\400"#,
        r#"{"a":1}\x"#,
    ] {
        let err = m.map(&row(bad), pos()).unwrap_err();
        assert_eq!(err.class(), "payload_not_json", "{bad}");
    }

    let m = Mapper::compile(&TableConfig::new("outbox"), "p", &rel(TEXT)).unwrap();
    let err = m.map(&row("not json {"), pos()).unwrap_err();
    assert!(
        matches!(&err, RowError::PayloadNotJson { column, reason } if column == "payload" && reason.contains("line 1")),
        "{err}"
    );
    assert!(
        !err.to_string().contains("not json {"),
        "no values in errors"
    );

    let err = Mapper::compile(&TableConfig::new("outbox"), "p", &rel(23)).unwrap_err();
    assert!(err.to_string().contains("has type oid 23"), "{err}");
}

#[test]
fn poison_rows_are_classified_without_values() {
    let m = Mapper::compile(&TableConfig::new("outbox"), "p", &relation(STANDARD)).unwrap();
    let mut row = standard_row();
    row[0] = TupleValue::Null;
    let err = m.map(&row, pos()).unwrap_err();
    assert_eq!(err.class(), "null_column");
    assert_eq!(err.to_string(), "column \"id\" (event id) is NULL");

    let mut row = standard_row();
    row[2] = TupleValue::Null;
    assert_eq!(m.map(&row, pos()).unwrap_err().class(), "null_column");

    let mut row = standard_row();
    row[1] = t("bad topic!");
    let err = m.map(&row, pos()).unwrap_err();
    assert_eq!(err.class(), "invalid_topic");

    let mut row = standard_row();
    row[5] = t("[1, 2]");
    assert_eq!(
        m.map(&row, pos()).unwrap_err().class(),
        "headers_not_object"
    );

    let mut row = standard_row();
    row[3] = TupleValue::Text(Bytes::from_static(&[0xff, 0xfe]));
    assert_eq!(m.map(&row, pos()).unwrap_err().class(), "not_utf8");

    let err = m.map(&standard_row()[..7], pos()).unwrap_err();
    assert_eq!(err.class(), "row_shape");
}

#[test]
fn configuration_mismatches_name_the_column() {
    let err =
        Mapper::compile(&TableConfig::new("outbox"), "p", &relation(&STANDARD[1..])).unwrap_err();
    assert!(
        err.to_string()
            .contains("no column \"id\" for the event id"),
        "{err}"
    );
    let cfg = TableConfig {
        columns: ColumnNames {
            headers: Some("meta".into()),
            ..ColumnNames::default()
        },
        ..TableConfig::new("outbox")
    };
    let err = Mapper::compile(&cfg, "p", &relation(STANDARD)).unwrap_err();
    assert!(
        err.to_string()
            .contains("no column \"meta\" for the headers"),
        "{err}"
    );

    let cfg = TableConfig {
        topic: "outbox.{tenant}".into(),
        ..TableConfig::new("outbox")
    };
    let err = Mapper::compile(&cfg, "p", &relation(STANDARD)).unwrap_err();
    assert!(err.to_string().contains("\"tenant\""), "{err}");

    let cfg = TableConfig {
        topic: "bad topic".into(),
        ..TableConfig::new("outbox")
    };
    assert!(matches!(
        Mapper::compile(&cfg, "p", &relation(STANDARD)),
        Err(MappingError::InvalidTopic { .. })
    ));

    let toml_err = toml::from_str::<TableConfig>("table = \"o\"\ntopicc = \"x\"").unwrap_err();
    assert!(toml_err.to_string().contains("topicc"), "{toml_err}");
}

#[test]
fn template_over_any_column() {
    let cfg = TableConfig {
        topic: "{tenant}.{aggregate_type}.v1".into(),
        ..TableConfig::new("outbox")
    };
    let mut cols = STANDARD.to_vec();
    cols.push(("tenant", TEXT));
    let m = Mapper::compile(&cfg, "p", &relation(&cols)).unwrap();
    let mut row = standard_row();
    row.push(t("acme"));
    assert_eq!(m.map(&row, pos()).unwrap().topic, "acme.order.v1");
}

#[test]
fn timestamps_become_rfc3339() {
    assert_eq!(
        rfc3339("2026-11-29 19:40:00.123456+00"),
        "2026-11-29T19:40:00.123456+00:00"
    );
    assert_eq!(
        rfc3339("2026-11-29 19:40:00-05"),
        "2026-11-29T19:40:00-05:00"
    );
    assert_eq!(
        rfc3339("2026-11-29 19:40:00+05:30"),
        "2026-11-29T19:40:00+05:30"
    );
    assert_eq!(rfc3339("2026-11-29 19:40:00"), "2026-11-29T19:40:00");
    assert_eq!(rfc3339("infinity"), "infinity");
}

#[test]
fn dead_letters_carry_the_row_the_reason_and_the_position() {
    // A text payload, which can hold something that is not JSON (json and jsonb
    // cannot).
    let mut columns = STANDARD.to_vec();
    columns[4].1 = TEXT;
    let m = Mapper::compile(&TableConfig::new("outbox"), "p", &relation(&columns)).unwrap();
    let dlq = TopicTemplate::parse("{topic}.dlq").unwrap();

    // Payload not JSON: the intended topic is known.
    let mut row = standard_row();
    row[4] = t("not json");
    let err = m.map(&row, pos()).unwrap_err();
    let d = m.dead_letter(&row, pos(), &err, &dlq);
    assert_eq!(d.topic, "outbox.order.dlq");
    assert_eq!(d.event_id, "7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11");
    assert_eq!(d.key.as_deref(), Some(&b"order-42"[..]));
    assert_eq!(header(&d, "walbox_error_class"), Some("payload_not_json"));
    assert!(
        header(&d, "walbox_error")
            .unwrap()
            .contains("payload column \"payload\"")
    );
    assert_eq!(header(&d, "walbox_source_table"), Some("public.outbox"));
    assert_eq!(header(&d, "walbox_source_topic"), Some("outbox.order"));
    assert_eq!(header(&d, "walbox_commit_lsn"), Some("16/B374D848"));
    assert_eq!(header(&d, "walbox_attempts"), Some("1"));
    let v: serde_json::Value = serde_json::from_slice(&d.value).unwrap();
    assert_eq!(v["table"], "public.outbox");
    assert_eq!(v["columns"]["payload"], "not json");
    assert_eq!(v["columns"]["aggregate_id"], "order-42");

    // The row cannot name its topic: the table's fallback topic.
    let mut row = standard_row();
    row[1] = TupleValue::Null;
    let err = m.map(&row, pos()).unwrap_err();
    let d = m.dead_letter(&row, pos(), &err, &dlq);
    assert_eq!(d.topic, "walbox.public.outbox.dlq");
    assert_eq!(header(&d, "walbox_source_topic"), None);
    let v: serde_json::Value = serde_json::from_slice(&d.value).unwrap();
    assert_eq!(v["columns"]["aggregate_type"], serde_json::Value::Null);

    // No event id: the position stands in for it.
    let mut row = standard_row();
    row[0] = TupleValue::Null;
    let err = m.map(&row, pos()).unwrap_err();
    let d = m.dead_letter(
        &row,
        pos(),
        &err,
        &TopicTemplate::parse("dead.letters").unwrap(),
    );
    assert_eq!(d.event_id, "16/B374D848#3");
    assert_eq!(d.topic, "dead.letters");
}

#[test]
fn header_members_are_read_in_name_order_with_values_shared_with_the_row() {
    let raw = Bytes::from_static(
        br#"{"traceparent": "00-abc-01", "b\u0041": "x\ny", "n": 1, "o": {"k": "v"}, "a": [1, "s"], "z": null, "t": true, "d": "1", "d": "2"}"#,
    );
    let mut out = Vec::new();
    json_headers(&raw, &mut out).unwrap();
    let got: Vec<(&str, &[u8])> = out.iter().map(|(k, v)| (k.as_ref(), v.as_ref())).collect();
    assert_eq!(
        got,
        vec![
            ("bA", &b"x\ny"[..]),
            ("d", b"2"),
            ("traceparent", b"00-abc-01"),
        ]
    );
    // A value without escapes points into the row's buffer.
    let range = raw.as_ptr_range();
    assert!(range.contains(&out[2].1.as_ptr()));

    for not_an_object in [
        &br#"["a"]"#[..],
        b"\"s\"",
        b"{\"a\": }",
        b"{\"a\": \"b\"} x",
    ] {
        let mut out = Vec::new();
        assert!(
            json_headers(&Bytes::copy_from_slice(not_an_object), &mut out).is_err(),
            "{}",
            String::from_utf8_lossy(not_an_object)
        );
    }
}

#[test]
fn columns_used_are_the_columns_the_mapping_reads() {
    let m = Mapper::compile(&TableConfig::new("outbox"), "p", &relation(STANDARD)).unwrap();
    assert_eq!(
        m.columns_used(),
        [
            "id",
            "aggregate_id",
            "aggregate_type",
            "event_type",
            "payload",
            "headers",
            "occurred_at",
            "schema_version"
        ]
    );
    // Optional roles the table lacks are not used; a template field is.
    let mut rel = relation(&STANDARD[..5]);
    rel.columns.push(RelationColumn {
        flags: 0,
        name: "region".into(),
        type_oid: TEXT,
        type_modifier: -1,
    });
    rel.columns.push(RelationColumn {
        flags: 0,
        name: "unused".into(),
        type_oid: TEXT,
        type_modifier: -1,
    });
    let mut cfg = TableConfig::new("outbox");
    cfg.topic = "{region}.{aggregate_type}".into();
    let m = Mapper::compile(&cfg, "p", &rel).unwrap();
    assert_eq!(
        m.columns_used(),
        [
            "id",
            "aggregate_id",
            "aggregate_type",
            "event_type",
            "payload",
            "region"
        ]
    );
}

#[test]
fn walbox_format_records_are_pinned_byte_for_byte() {
    let m = Mapper::compile(
        &TableConfig::new("outbox"),
        "orders-service",
        &relation(STANDARD),
    )
    .unwrap();
    let e = m.map(&standard_row(), pos()).unwrap();
    assert_eq!(
        std::str::from_utf8(&e.value).unwrap(),
        r#"{"event_id":"7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11","event_type":"OrderPlaced","schema_version":2,"occurred_at":"2026-11-29T19:40:00.123456+00:00","producer":"orders-service","payload":{"total": 1299, "items": [{"sku": "A-1"}], "note": "Grüße \"quoted\""}}"#
    );
    let headers: Vec<(&str, &str)> = e
        .headers
        .iter()
        .map(|(k, v)| (k.as_ref(), std::str::from_utf8(v).unwrap()))
        .collect();
    assert_eq!(
        headers,
        [
            ("event_id", "7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11"),
            ("event_type", "OrderPlaced"),
            ("schema_version", "2"),
            ("aggregate_type", "order"),
            ("tenant", "acme"),
            ("traceparent", "00-abc-def-01"),
            ("walbox_commit_lsn", "16/B374D848"),
            ("walbox_index", "3"),
            ("walbox_xid", "991"),
        ]
    );
    assert_eq!(e.key.as_deref(), Some(&b"order-42"[..]));
    assert!(e.json_value);
}
