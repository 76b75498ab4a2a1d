//! Unit tests of the formats, record by record: Debezium's outbox event router
//! (the shapes its documentation shows) and CloudEvents (binary and structured).

use walbox_pgoutput::{Oid, Relation, TupleValue};

use crate::test_rows::{pos, relation_named, t};

use super::Protocol;
use super::cloudevents::{event_time, is_rfc3339, pg_micros_rfc3339};
use crate::config::{CloudEventsMode, Format, Place, Placement, TableConfig};
use crate::event::Event;
use crate::mapper::{Mapper, MappingError};

const UUID: Oid = 2950;
const VARCHAR: Oid = 1043;
const TEXT: Oid = 25;
const JSONB: Oid = 3802;
const BYTEA: Oid = 17;
const INT4: Oid = 23;
const BOOL: Oid = 16;
const TIMESTAMPTZ: Oid = 1184;

fn relation(columns: &[(&str, Oid)]) -> Relation {
    relation_named("outboxevent", columns)
}

fn headers(e: &Event) -> Vec<(&str, &str)> {
    e.headers
        .iter()
        .map(|(k, v)| (k.as_ref(), std::str::from_utf8(v).unwrap()))
        .collect()
}

fn json(b: &[u8]) -> serde_json::Value {
    serde_json::from_slice(b).unwrap()
}

fn config(toml: &str) -> TableConfig {
    toml::from_str(toml).unwrap()
}

const POSITION_HEADERS: [(&str, &str); 3] = [
    ("walbox_commit_lsn", "16/B374D848"),
    ("walbox_index", "3"),
    ("walbox_xid", "991"),
];

// ---- debezium-outbox --------------------------------------------------------

/// The outbox table the router's documentation expects ("Basic outbox table").
const DEBEZIUM_TABLE: &[(&str, Oid)] = &[
    ("id", UUID),
    ("aggregatetype", VARCHAR),
    ("aggregateid", VARCHAR),
    ("type", VARCHAR),
    ("payload", JSONB),
];

/// The payload of the documentation's example message.
const ORDER_PAYLOAD: &str = r#"{"id": 1, "lineItems": [{"id": 1, "item": "Debezium in Action", "status": "ENTERED", "quantity": 2, "totalPrice": 39.98}, {"id": 2, "item": "Debezium for Dummies", "status": "ENTERED", "quantity": 1, "totalPrice": 29.99}], "orderDate": "2019-01-31T12:13:01", "customerId": 123}"#;

fn order_row() -> Vec<TupleValue> {
    vec![
        t("406c07f3-26f0-4eea-a50c-109940064b8f"),
        t("Order"),
        t("1"),
        t("OrderCreated"),
        t(ORDER_PAYLOAD),
    ]
}

fn debezium(extra: &str, columns: &[(&str, Oid)]) -> Mapper {
    let cfg = config(&format!(
        "table = \"public.outboxevent\"\nformat = \"debezium-outbox\"\n{extra}"
    ));
    Mapper::compile(&cfg, "p", &relation(columns)).unwrap()
}

#[test]
fn debezium_defaults_give_the_documented_example_message() {
    // The documentation's example: key "1", header id, topic outbox.event.
    // followed by the aggregatetype value, the value the payload alone.
    let m = debezium("", DEBEZIUM_TABLE);
    let e = m.map(&order_row(), pos()).unwrap();
    assert_eq!(e.topic, "outbox.event.Order");
    assert_eq!(e.key.as_deref(), Some(&b"1"[..]));
    assert_eq!(e.event_id, "406c07f3-26f0-4eea-a50c-109940064b8f");
    let mut expected = vec![("id", "406c07f3-26f0-4eea-a50c-109940064b8f")];
    expected.extend(POSITION_HEADERS);
    assert_eq!(headers(&e), expected, "the type column is placed nowhere");
    assert_eq!(json(&e.value), json(ORDER_PAYLOAD.as_bytes()));
    assert!(e.json_value);
}

#[test]
fn debezium_expands_a_string_payload_holding_json() {
    // table.expand.json.payload: the documentation's escaped string becomes the
    // JSON object it holds.
    let mut cols = DEBEZIUM_TABLE.to_vec();
    cols[4] = ("payload", VARCHAR);
    let m = debezium("", &cols);
    let e = m.map(&order_row(), pos()).unwrap();
    assert_eq!(json(&e.value), json(ORDER_PAYLOAD.as_bytes()));
    assert!(
        json(&e.value).is_object(),
        "expanded, not an escaped string"
    );

    // "If no content found or in case of parsing error, the content is kept as
    // is": the string itself, which the JSON converter writes as a JSON string.
    let mut row = order_row();
    row[4] = t("not json: \"quoted\"");
    let e = m.map(&row, pos()).unwrap();
    assert_eq!(&e.value[..], br#""not json: \"quoted\"""#);
    assert_eq!(json(&e.value), serde_json::json!("not json: \"quoted\""));
    row[4] = t("");
    let e = m.map(&row, pos()).unwrap();
    assert_eq!(&e.value[..], b"\"\"");
}

#[test]
fn debezium_additional_fields_as_headers_and_envelope() {
    // The documentation's examples: an eventType column placed as header `type`
    // (eventType:header:type) and as envelope field `type` (eventType:envelope:type).
    let mut cols = DEBEZIUM_TABLE.to_vec();
    cols.push(("eventType", VARCHAR));
    cols.push(("version", INT4));
    cols.push(("urgent", BOOL));
    let mut row = order_row();
    row[1] = t("purchase-order");
    row.push(t("order-created"));
    row.push(t("7"));
    row.push(t("t"));

    let m = debezium(r#"additional_placement = ["eventType:header:type"]"#, &cols);
    let e = m.map(&row, pos()).unwrap();
    assert_eq!(e.topic, "outbox.event.purchase-order");
    let mut expected = vec![
        ("id", "406c07f3-26f0-4eea-a50c-109940064b8f"),
        ("type", "order-created"),
    ];
    expected.extend(POSITION_HEADERS);
    assert_eq!(headers(&e), expected);
    assert_eq!(
        json(&e.value),
        json(ORDER_PAYLOAD.as_bytes()),
        "no envelope"
    );

    let m = debezium(
        r#"additional_placement = ["eventType:envelope:type", "version:envelope", "urgent:envelope", "aggregateid:header"]"#,
        &cols,
    );
    let e = m.map(&row, pos()).unwrap();
    let mut expected = vec![
        ("id", "406c07f3-26f0-4eea-a50c-109940064b8f"),
        ("aggregateid", "1"),
    ];
    expected.extend(POSITION_HEADERS);
    assert_eq!(headers(&e), expected);
    assert_eq!(
        json(&e.value),
        serde_json::json!({
            "payload": json(ORDER_PAYLOAD.as_bytes()),
            "type": "order-created",
            "version": 7,
            "urgent": true,
        })
    );

    // A NULL placed column: no header; null in the envelope.
    let m = debezium(
        r#"additional_placement = ["eventType:header:type", "version:envelope"]"#,
        &cols,
    );
    row[5] = TupleValue::Null;
    row[6] = TupleValue::Null;
    let e = m.map(&row, pos()).unwrap();
    assert!(!headers(&e).iter().any(|(k, _)| *k == "type"));
    assert_eq!(json(&e.value)["version"], serde_json::Value::Null);
    assert!(m.columns_used().contains(&"eventType"));
    assert!(m.columns_used().contains(&"version"));
}

#[test]
fn debezium_placement_specs_are_parsed_or_refused() {
    let p: Placement = "eventType:header:type".to_owned().try_into().unwrap();
    assert_eq!(
        p,
        Placement {
            column: "eventType".into(),
            place: Place::Header,
            name: "type".into()
        }
    );
    let p: Placement = "region:envelope".to_owned().try_into().unwrap();
    assert_eq!((p.place, p.name.as_str()), (Place::Envelope, "region"));
    for bad in ["region", "region:payload", ":header", "a:header:b:c"] {
        let err = Placement::try_from(bad.to_owned()).unwrap_err();
        assert!(
            err.contains("column:header[:alias]") || err.contains("unknown placement"),
            "{err}"
        );
    }
    let err = Placement::try_from("p:partition".to_owned()).unwrap_err();
    assert!(err.contains("partition"), "{err}");
    let err = toml::from_str::<TableConfig>(
        "table = \"o\"\nformat = \"debezium-outbox\"\nadditional_placement = [\"x:nowhere\"]",
    )
    .unwrap_err();
    assert!(err.to_string().contains("x:nowhere"), "{err}");

    // Placements belong to the Debezium format.
    let cfg = config("table = \"o\"\nadditional_placement = [\"type:header\"]");
    let err = Mapper::compile(&cfg, "p", &relation(DEBEZIUM_TABLE)).unwrap_err();
    assert!(err.to_string().contains("debezium-outbox"), "{err}");
    // A placed column must exist.
    let cfg = config(
        "table = \"o\"\nformat = \"debezium-outbox\"\nadditional_placement = [\"region:header\"]",
    );
    let err = Mapper::compile(&cfg, "p", &relation(DEBEZIUM_TABLE)).unwrap_err();
    assert!(matches!(err, MappingError::MissingColumn { .. }), "{err}");
}

#[test]
fn debezium_topic_default_and_column_names() {
    let cfg = config("table = \"o\"\nformat = \"debezium-outbox\"");
    assert_eq!(cfg.topic, "outbox.event.{aggregate_type}");
    assert_eq!(config("table = \"o\"").topic, "outbox.{aggregate_type}");
    assert_eq!(
        config("table = \"o\"\nformat = \"debezium-outbox\"\ntopic = \"events\"").topic,
        "events"
    );

    // A table with walbox's column names works too.
    let cols = [
        ("id", UUID),
        ("aggregate_type", TEXT),
        ("aggregate_id", TEXT),
        ("event_type", TEXT),
        ("payload", JSONB),
    ];
    let m = debezium("", &cols);
    let e = m.map(&order_row(), pos()).unwrap();
    assert_eq!(e.topic, "outbox.event.Order");
    assert_eq!(e.key.as_deref(), Some(&b"1"[..]));

    // Renamed columns, as table.field.event.key and friends do.
    let cols = [
        ("event_id", UUID),
        ("kind", TEXT),
        ("order_id", TEXT),
        ("body", JSONB),
    ];
    let m = debezium(
        "[columns]\nid = \"event_id\"\naggregate_type = \"kind\"\naggregate_id = \"order_id\"\npayload = \"body\"",
        &cols,
    );
    let row = vec![t("e-1"), t("invoice"), t("inv-9"), t("{}")];
    let e = m.map(&row, pos()).unwrap();
    assert_eq!(e.topic, "outbox.event.invoice");
    assert_eq!(headers(&e)[0], ("id", "e-1"));
}

#[test]
fn debezium_key_may_be_null_and_bytea_payloads_pass_as_bytes() {
    let m = debezium("", DEBEZIUM_TABLE);
    let mut row = order_row();
    row[2] = TupleValue::Null;
    let e = m.map(&row, pos()).unwrap();
    assert_eq!(e.key, None, "the key is used when the column has a value");

    // A binary payload (Avro, say) is the value as it is.
    let mut cols = DEBEZIUM_TABLE.to_vec();
    cols[4] = ("payload", BYTEA);
    let m = debezium("", &cols);
    let mut row = order_row();
    row[4] = t("\\x00ff4f");
    let e = m.map(&row, pos()).unwrap();
    assert_eq!(&e.value[..], &[0x00, 0xff, 0x4f]);
    assert!(!e.json_value);

    // ... and cannot sit in a JSON envelope.
    let cfg = config(
        "table = \"o\"\nformat = \"debezium-outbox\"\nadditional_placement = [\"type:envelope\"]",
    );
    let err = Mapper::compile(&cfg, "p", &relation(&cols)).unwrap_err();
    assert!(err.to_string().contains("bytea"), "{err}");
}

// ---- cloudevents ------------------------------------------------------------

const WALBOX_TABLE: &[(&str, Oid)] = &[
    ("id", UUID),
    ("aggregate_type", TEXT),
    ("aggregate_id", TEXT),
    ("event_type", TEXT),
    ("payload", JSONB),
    ("headers", JSONB),
    ("occurred_at", TIMESTAMPTZ),
];

fn walbox_row() -> Vec<TupleValue> {
    vec![
        t("7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11"),
        t("order"),
        t("order-42"),
        t("OrderPlaced"),
        t(r#"{"total": 1299}"#),
        t(r#"{"traceparent": "00-abc-def-01"}"#),
        t("2026-11-29 19:40:00.123456+00"),
    ]
}

fn cloudevents(extra: &str, columns: &[(&str, Oid)]) -> Result<Mapper, MappingError> {
    let cfg = config(&format!(
        "table = \"public.outbox\"\nformat = \"cloudevents\"\n{extra}"
    ));
    assert_eq!(cfg.formatting.format, Format::CloudEvents);
    Mapper::compile(&cfg, "p", &relation(columns))
}

#[test]
fn cloudevents_binary_mode_puts_attributes_in_headers() {
    let m = cloudevents("", WALBOX_TABLE).unwrap();
    let e = m.map_at(&walbox_row(), pos(), Some(0)).unwrap();
    assert_eq!(e.topic, "outbox.order");
    assert_eq!(e.key.as_deref(), Some(&b"order-42"[..]));
    let mut expected = vec![
        ("ce_specversion", "1.0"),
        ("ce_id", "7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11"),
        ("ce_source", "/walbox/public.outboxevent"),
        ("ce_type", "OrderPlaced"),
        ("ce_time", "2026-11-29T19:40:00.123456+00:00"),
        ("ce_subject", "order-42"),
        ("content-type", "application/json"),
        ("traceparent", "00-abc-def-01"),
    ];
    expected.extend(POSITION_HEADERS);
    assert_eq!(headers(&e), expected);
    assert_eq!(&e.value[..], br#"{"total": 1299}"#);
}

#[test]
fn cloudevents_structured_mode_is_one_json_event() {
    let m = cloudevents(
        "cloudevents_mode = \"structured\"\ncloudevents_source = \"urn:walbox:{table}\"\ncloudevents_subject = \"{aggregate_type}/{aggregate_id}\"",
        WALBOX_TABLE,
    )
    .unwrap();
    let e = m.map(&walbox_row(), pos()).unwrap();
    let mut expected = vec![
        ("content-type", "application/cloudevents+json"),
        ("traceparent", "00-abc-def-01"),
    ];
    expected.extend(POSITION_HEADERS);
    assert_eq!(headers(&e), expected);
    assert_eq!(
        json(&e.value),
        serde_json::json!({
            "specversion": "1.0",
            "id": "7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11",
            "source": "urn:walbox:public.outboxevent",
            "type": "OrderPlaced",
            "subject": "order/order-42",
            "time": "2026-11-29T19:40:00.123456+00:00",
            "datacontenttype": "application/json",
            "data": {"total": 1299},
        })
    );
    assert!(e.json_value);
}

#[test]
fn cloudevents_time_falls_back_to_the_commit_time() {
    let m = cloudevents("cloudevents_subject = \"\"", &WALBOX_TABLE[..5]).unwrap();
    let row = &walbox_row()[..5];
    let e = m.map_at(row, pos(), Some(849_296_400_123_456)).unwrap();
    let h = headers(&e);
    assert!(
        h.contains(&("ce_time", "2026-11-29T19:40:00.123456Z")),
        "{h:?}"
    );
    assert!(
        !h.iter().any(|(k, _)| *k == "ce_subject"),
        "empty subject template: none"
    );
    // Unknown commit time (a snapshot row) and no occurrence time: no time.
    let e = m.map_at(row, pos(), None).unwrap();
    assert!(!headers(&e).iter().any(|(k, _)| *k == "ce_time"));

    // A timestamp without zone is taken as UTC.
    let mut cols = WALBOX_TABLE.to_vec();
    cols[6] = ("occurred_at", 1114);
    let m = cloudevents("", &cols).unwrap();
    let mut row = walbox_row();
    row[6] = t("2026-11-29 19:40:00");
    let e = m.map(&row, pos()).unwrap();
    assert!(headers(&e).contains(&("ce_time", "2026-11-29T19:40:00Z")));
}

#[test]
fn commit_times_format_as_rfc3339() {
    assert_eq!(pg_micros_rfc3339(0), "2000-01-01T00:00:00.000000Z");
    assert_eq!(pg_micros_rfc3339(-1), "1999-12-31T23:59:59.999999Z");
    assert_eq!(
        pg_micros_rfc3339(762_523_200_000_000),
        "2024-02-29T12:00:00.000000Z"
    );
}

#[test]
fn cloudevents_needs_an_event_type_and_json() {
    let cols = [
        ("id", UUID),
        ("aggregate_type", TEXT),
        ("aggregate_id", TEXT),
        ("payload", JSONB),
    ];
    let err = cloudevents("", &cols).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("columns.event_type") && msg.contains("cloudevents"),
        "{msg}"
    );

    // Debezium's column names are understood.
    let m = cloudevents("", DEBEZIUM_TABLE).unwrap();
    let e = m.map(&order_row(), pos()).unwrap();
    assert!(headers(&e).contains(&("ce_type", "OrderCreated")));
    assert!(headers(&e).contains(&("ce_subject", "1")));

    // content-type application/json: a text payload that is not JSON is a poison row.
    let mut cols = WALBOX_TABLE.to_vec();
    cols[4] = ("payload", TEXT);
    let m = cloudevents("", &cols).unwrap();
    let mut row = walbox_row();
    row[4] = t("not json");
    assert_eq!(m.map(&row, pos()).unwrap_err().class(), "payload_not_json");
    row[3] = TupleValue::Null;
    row[4] = t("{}");
    assert_eq!(m.map(&row, pos()).unwrap_err().class(), "null_column");

    let err = cloudevents("cloudevents_source = \"/x/{tenant}\"", WALBOX_TABLE).unwrap_err();
    assert!(
        err.to_string().contains("cloudevents_source") && err.to_string().contains("{tenant}"),
        "{err}"
    );
    let err = toml::from_str::<TableConfig>(
        "table = \"o\"\nformat = \"cloudevents\"\ncloudevents_mode = \"mixed\"",
    )
    .unwrap_err();
    assert!(err.to_string().contains("structured"), "{err}");
    let err = toml::from_str::<TableConfig>("table = \"o\"\nformat = \"debezium\"").unwrap_err();
    assert!(err.to_string().contains("debezium-outbox"), "{err}");
}

#[test]
fn value_columns_belong_to_the_walbox_format() {
    let cfg = config("table = \"o\"\nformat = \"cloudevents\"\nvalue = { column = \"payload\" }");
    let err = Mapper::compile(&cfg, "p", &relation(WALBOX_TABLE)).unwrap_err();
    assert!(err.to_string().contains("only format \"walbox\""), "{err}");
    assert_eq!(CloudEventsMode::default(), CloudEventsMode::Binary);
}

#[test]
fn the_event_id_is_found_in_every_format() {
    let m = debezium("", DEBEZIUM_TABLE);
    let mut records = vec![m.map(&order_row(), pos()).unwrap()];
    for mode in ["binary", "structured"] {
        let m = cloudevents(&format!("cloudevents_mode = \"{mode}\""), DEBEZIUM_TABLE).unwrap();
        records.push(m.map(&order_row(), pos()).unwrap());
    }
    let walbox = Mapper::compile(
        &config("table = \"o\""),
        "p",
        &relation(&[
            ("id", UUID),
            ("aggregate_type", TEXT),
            ("aggregate_id", TEXT),
            ("event_type", TEXT),
            ("payload", JSONB),
        ]),
    )
    .unwrap();
    records.push(walbox.map(&order_row(), pos()).unwrap());
    for e in &records {
        let header = |name: &str| {
            e.headers
                .iter()
                .find(|(k, _)| k == name)
                .and_then(|(_, v)| std::str::from_utf8(v).ok())
        };
        assert_eq!(
            crate::record_event_id(header, Some(&e.value)).as_deref(),
            Some("406c07f3-26f0-4eea-a50c-109940064b8f"),
            "{e:?}"
        );
    }
    assert_eq!(
        crate::record_event_id(|_| None, Some(b"{\"id\":\"x\"}")),
        None
    );
}

/// [`walbox_row`] with `headers` as its headers column.
fn row_with_headers(headers: &str) -> Vec<TupleValue> {
    let mut row = walbox_row();
    row[5] = t(headers);
    row
}

#[test]
fn source_headers_named_like_walbox_s_own_are_refused_in_every_format() {
    let formats = [
        "format = \"walbox\"",
        "format = \"debezium-outbox\"\n[columns]\naggregate_type = \"aggregate_type\"\naggregate_id = \"aggregate_id\"\nevent_type = \"event_type\"",
        "format = \"cloudevents\"",
        "format = \"cloudevents\"\ncloudevents_mode = \"structured\"",
    ];
    for format in formats {
        let cfg = config(&format!("table = \"public.outbox\"\n{format}"));
        let m = Mapper::compile(&cfg, "p", &relation(WALBOX_TABLE)).unwrap();
        // Any format: the position, the id headers of every format, the
        // CloudEvents markers.
        for name in [
            "walbox_commit_lsn",
            "WALBOX_INDEX",
            "event_id",
            "ce_id",
            "ce_specversion",
        ] {
            let err = m
                .map(
                    &row_with_headers(&format!(r#"{{"{name}": "v-93kq"}}"#)),
                    pos(),
                )
                .unwrap_err();
            assert_eq!(err.class(), "reserved_header", "{format}: {name}");
            assert!(err.to_string().contains(name), "{err}");
            assert!(!err.to_string().contains("v-93kq"), "no value: {err}");
        }
        let structured = r#"{"content-type": "application/cloudevents+json"}"#;
        assert!(
            m.map(&row_with_headers(structured), pos()).is_err(),
            "{format}"
        );
        // Names the others write pass in a format that does not write them.
        let e = m
            .map(
                &row_with_headers(r#"{"traceparent": "t", "tenant": "acme"}"#),
                pos(),
            )
            .unwrap();
        assert_eq!(
            crate::record_event_id(
                |n| e
                    .headers
                    .iter()
                    .find(|(k, _)| k == n)
                    .and_then(|(_, v)| std::str::from_utf8(v).ok()),
                Some(&e.value)
            )
            .as_deref(),
            Some("7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11"),
            "{format}"
        );
    }
    let walbox = Mapper::compile(
        &config("table = \"public.outbox\""),
        "p",
        &relation(WALBOX_TABLE),
    )
    .unwrap();
    for (name, ok) in [("id", true), ("ce_source", true), ("event_type", false)] {
        let row = row_with_headers(&format!(r#"{{"{name}": "v-93kq"}}"#));
        assert_eq!(walbox.map(&row, pos()).is_ok(), ok, "walbox format: {name}");
    }
    let debezium = debezium(
        "[columns]\naggregate_type = \"aggregate_type\"\naggregate_id = \"aggregate_id\"\nevent_type = \"event_type\"",
        WALBOX_TABLE,
    );
    for (name, ok) in [("event_type", true), ("Id", false)] {
        let row = row_with_headers(&format!(r#"{{"{name}": "v-93kq"}}"#));
        assert_eq!(debezium.map(&row, pos()).is_ok(), ok, "debezium: {name}");
    }
    let binary = cloudevents("", WALBOX_TABLE).unwrap();
    for (name, ok) in [
        ("id", true),
        ("event_type", true),
        ("ce_source", false),
        ("content-type", false),
    ] {
        let row = row_with_headers(&format!(r#"{{"{name}": "v-93kq"}}"#));
        assert_eq!(binary.map(&row, pos()).is_ok(), ok, "cloudevents: {name}");
    }
}

#[test]
fn the_event_id_of_a_record_is_its_format_s_even_beside_other_id_names() {
    // A binary CloudEvent whose source headers hold `id`: `ce_id` is the id.
    let binary = cloudevents("", WALBOX_TABLE).unwrap();
    let e = binary
        .map(&row_with_headers(r#"{"id": "app-id"}"#), pos())
        .unwrap();
    let header = |n: &str| {
        e.headers
            .iter()
            .find(|(k, _)| k == n)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    };
    assert_eq!(
        crate::record_event_id(header, Some(&e.value)).as_deref(),
        Some("7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11")
    );
    // A structured one with an `id` header: the value's id.
    let structured = cloudevents("cloudevents_mode = \"structured\"", WALBOX_TABLE).unwrap();
    let e = structured
        .map(&row_with_headers(r#"{"id": "app-id"}"#), pos())
        .unwrap();
    let header = |n: &str| {
        e.headers
            .iter()
            .find(|(k, _)| k == n)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    };
    assert_eq!(
        crate::record_event_id(header, Some(&e.value)).as_deref(),
        Some("7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11")
    );
}

// ---- CloudEvents over NATS ---------------------------------------------------

fn cloudevents_on(protocol: Protocol, extra: &str) -> Mapper {
    let mut cfg = config(&format!(
        "table = \"public.outbox\"\nformat = \"cloudevents\"\n{extra}"
    ));
    cfg.formatting.binding = protocol.cloudevents();
    Mapper::compile(&cfg, "p", &relation(WALBOX_TABLE)).unwrap()
}

#[test]
fn cloudevents_on_nats_are_structured_by_default_with_the_binding_s_content_type() {
    let e = cloudevents_on(Protocol::Nats, "")
        .map(&walbox_row(), pos())
        .unwrap();
    let mut expected = vec![
        ("Content-Type", "application/cloudevents+json"),
        ("traceparent", "00-abc-def-01"),
    ];
    expected.extend(POSITION_HEADERS);
    assert_eq!(headers(&e), expected);
    assert_eq!(json(&e.value)["id"], "7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11");
    assert_eq!(json(&e.value)["data"], serde_json::json!({"total": 1299}));
    // Kafka keeps binary as its default.
    let e = cloudevents_on(Protocol::Kafka, "")
        .map(&walbox_row(), pos())
        .unwrap();
    assert!(headers(&e).contains(&("ce_specversion", "1.0")));
}

#[test]
fn binary_cloudevents_on_nats_follow_the_nats_binding_field_by_field() {
    let m = cloudevents_on(
        Protocol::Nats,
        "cloudevents_mode = \"binary\"\ncloudevents_source = \"urn:walbox:{table}\"\n\
         cloudevents_subject = \"{aggregate_type} {aggregate_id}\"\ntopic = \"outbox.order\"",
    );
    let mut row = walbox_row();
    row[1] = t("Bestellung \"groß\"");
    row[2] = t("100%");
    let e = m.map(&row, pos()).unwrap();
    // Every attribute under ce-, percent-encoded (space, '"', '%', non-ASCII),
    // datacontenttype as ce-datacontenttype, no content-type.
    let mut expected = vec![
        ("ce-specversion", "1.0"),
        ("ce-id", "7d9f0c2e-6a51-4c1b-9a57-2f1b5e0c9d11"),
        ("ce-source", "urn:walbox:public.outboxevent"),
        ("ce-type", "OrderPlaced"),
        ("ce-time", "2026-11-29T19:40:00.123456+00:00"),
        ("ce-subject", "Bestellung%20%22gro%C3%9F%22%20100%25"),
        ("ce-datacontenttype", "application/json"),
        ("traceparent", "00-abc-def-01"),
    ];
    expected.extend(POSITION_HEADERS);
    assert_eq!(headers(&e), expected);
    assert_eq!(&e.value[..], br#"{"total": 1299}"#);

    // An event id that needs encoding is found decoded.
    let mut row = walbox_row();
    row[0] = t("id with space");
    let e = m.map(&row, pos()).unwrap();
    assert!(headers(&e).contains(&("ce-id", "id%20with%20space")));
    let header = |n: &str| {
        e.headers
            .iter()
            .find(|(k, _)| k == n)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    };
    assert_eq!(
        crate::record_event_id(header, Some(&e.value)).as_deref(),
        Some("id with space")
    );
    // Source headers named like the binding's are refused.
    for name in ["ce-source", "CE-ID", "ce-specversion"] {
        let err = m
            .map(&row_with_headers(&format!(r#"{{"{name}": "x"}}"#)), pos())
            .unwrap_err();
        assert_eq!(err.class(), "reserved_header", "{name}");
    }
}

// ---- time --------------------------------------------------------------------

#[test]
fn an_occurrence_time_that_cannot_be_rfc3339_is_refused_naming_the_column() {
    let cases = [
        (1082, "2024-05-01"), // date
        (1184, "infinity"),   // timestamptz
        (1184, "-infinity"),  // timestamptz
        (1114, "infinity"),   // timestamp
        (1184, "0044-03-15 12:00:00+00 BC"),
        (1184, "10000-01-01 00:00:00+00"),
        (25, "yesterday"),
        (25, "2024-02-30T00:00:00Z"),
    ];
    for (oid, value) in cases {
        let mut cols = WALBOX_TABLE.to_vec();
        cols[6] = ("occurred_at", oid);
        for mode in ["binary", "structured"] {
            let m = cloudevents(&format!("cloudevents_mode = \"{mode}\""), &cols).unwrap();
            let mut row = walbox_row();
            row[6] = t(value);
            let err = m.map(&row, pos()).unwrap_err();
            assert_eq!(err.class(), "invalid_time", "{value}");
            let msg = err.to_string();
            assert!(
                msg.contains("\"occurred_at\"") && msg.contains("RFC 3339"),
                "{msg}"
            );
            assert!(!msg.contains(value), "no value: {msg}");
        }
    }
    // What PostgreSQL writes for the time types, and RFC 3339 text, passes.
    assert_eq!(
        event_time("2026-11-29 19:40:00.123456+00").as_deref(),
        Some("2026-11-29T19:40:00.123456+00:00")
    );
    assert_eq!(
        event_time("2026-11-29 19:40:00").as_deref(),
        Some("2026-11-29T19:40:00Z")
    );
    assert_eq!(
        event_time("2024-02-29t23:59:60.5z").as_deref(),
        Some("2024-02-29T23:59:60.5Z")
    );
    assert_eq!(
        event_time("0001-01-01 00:00:00+05:30").as_deref(),
        Some("0001-01-01T00:00:00+05:30")
    );
}

#[test]
fn rfc3339_date_times_are_checked_field_by_field() {
    for ok in [
        "2026-11-29T19:40:00Z",
        "2026-11-29T19:40:00.1+01:00",
        "2000-02-29T00:00:00-23:59",
        "9999-12-31T23:59:59.999999999Z",
    ] {
        assert!(is_rfc3339(ok), "{ok}");
    }
    for bad in [
        "2026-11-29",
        "2026-11-29Z",
        "infinityZ",
        "2026-11-29 19:40:00Z",
        "2026-13-01T00:00:00Z",
        "2026-00-01T00:00:00Z",
        "2026-04-31T00:00:00Z",
        "2100-02-29T00:00:00Z",
        "0000-01-01T00:00:00Z",
        "2026-11-29T24:00:00Z",
        "2026-11-29T19:60:00Z",
        "2026-11-29T19:40:61Z",
        "2026-11-29T19:40:00.Z",
        "2026-11-29T19:40:00",
        "2026-11-29T19:40:00+0100",
        "2026-11-29T19:40:00+24:00",
        "2026-11-29T19:40:00+01:00 BC",
        "+2026-11-29T19:40:00Z",
        "2026-11-29T19:40:00.123456+00",
    ] {
        assert!(!is_rfc3339(bad), "{bad}");
    }
}

// ---- debezium key encoding ---------------------------------------------------

#[test]
fn json_keys_are_what_the_json_converter_writes() {
    let string = debezium("", DEBEZIUM_TABLE);
    let json = debezium("key_encoding = \"json\"", DEBEZIUM_TABLE);
    let mut row = order_row();
    for (id, as_string, as_json) in [
        ("1", "1", "\"1\""),
        ("a\"b\\c\nd", "a\"b\\c\nd", "\"a\\\"b\\\\c\\nd\""),
        ("Grüße/1", "Grüße/1", "\"Grüße/1\""),
    ] {
        row[2] = t(id);
        let e = string.map(&row, pos()).unwrap();
        assert_eq!(e.key.as_deref(), Some(as_string.as_bytes()));
        let e = json.map(&row, pos()).unwrap();
        assert_eq!(e.key.as_deref(), Some(as_json.as_bytes()), "{id}");
    }
    // An integer column: a JSON number; a NULL aggregate id: no key.
    let mut cols = DEBEZIUM_TABLE.to_vec();
    cols[2] = ("aggregateid", INT4);
    let json_int = debezium("key_encoding = \"json\"", &cols);
    row[2] = t("-42");
    assert_eq!(
        json_int.map(&row, pos()).unwrap().key.as_deref(),
        Some(&b"-42"[..])
    );
    row[2] = TupleValue::Null;
    assert_eq!(json_int.map(&row, pos()).unwrap().key, None);
    // A type Debezium writes in another form is refused, naming the column.
    cols[2] = ("aggregateid", 1700);
    let cfg = config(
        "table = \"public.outboxevent\"\nformat = \"debezium-outbox\"\nkey_encoding = \"json\"",
    );
    let err = Mapper::compile(&cfg, "p", &relation(&cols)).unwrap_err();
    assert!(
        err.to_string().contains("aggregateid") && err.to_string().contains("key_encoding"),
        "{err}"
    );
    // Only the debezium-outbox format takes a key encoding.
    let err = cloudevents("key_encoding = \"json\"", WALBOX_TABLE).unwrap_err();
    assert!(err.to_string().contains("key_encoding"), "{err}");
    assert!(toml::from_str::<TableConfig>("table = \"o\"\nkey_encoding = \"avro\"").is_err());
}
