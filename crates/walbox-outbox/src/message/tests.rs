//! Unit tests of message sections, the content's field rules, every error and
//! the dead-letter record.

use bytes::Bytes;

use super::*;
use crate::test_rows::pos;

fn config(toml: &str) -> MessageConfig {
    toml::from_str(toml).unwrap()
}

fn mapper(toml: &str) -> MessageMapper {
    let c = config(toml);
    MessageMapper::compile(&c, &c.prefixes[0], "orders-service").unwrap()
}

fn map(m: &MessageMapper, content: &str) -> Result<Event, MessageError> {
    m.map(&Bytes::copy_from_slice(content.as_bytes()), pos(), Some(0))
}

fn header<'a>(e: &'a Event, name: &str) -> Option<&'a str> {
    e.headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| std::str::from_utf8(v).unwrap())
}

fn json(b: &[u8]) -> serde_json::Value {
    serde_json::from_slice(b).unwrap()
}

const FULL: &str = r#"{"id":"e-1","aggregate_type":"order","aggregate_id":"42",
    "event_type":"OrderPlaced","payload":{"total":12345678901234567890123,"x":[1,2]},
    "headers":{"traceparent":"00-a","tenant":"acme"},"occurred_at":"2026-11-29 19:40:00+00",
    "schema_version":2}"#;

#[test]
fn sections_take_one_prefix_or_a_list_and_refuse_both_none_empty_and_repeats() {
    assert_eq!(config(r#"prefix = "walbox""#).prefixes, ["walbox"]);
    assert_eq!(config(r#"prefixes = ["a", "b"]"#).prefixes, ["a", "b"]);
    let err = |t: &str| toml::from_str::<MessageConfig>(t).unwrap_err().to_string();
    assert!(
        err(r#"prefix = "a"
prefixes = ["b"]"#)
        .contains("prefix and prefixes are both set")
    );
    assert!(err(r#"topic = "t""#).contains("no prefix"));
    assert!(err("prefixes = []").contains("prefixes is empty"));
    assert!(err(r#"prefix = """#).contains("a prefix is empty"));
    assert!(err(r#"prefixes = ["a", "a"]"#).contains("configured twice"));
    assert!(
        err(r#"prefix = "a"
colour = "red""#)
        .contains("unknown field")
    );
    let two = [
        config(r#"prefix = "a""#),
        config(r#"prefixes = ["b", "a"]"#),
    ];
    assert!(
        check_prefixes(&two)
            .unwrap_err()
            .contains("\"a\" is configured twice")
    );
    assert!(check_prefixes(&two[..1]).is_ok());
}

#[test]
fn the_topic_defaults_by_format() {
    assert_eq!(config(r#"prefix = "w""#).topic, "outbox.{aggregate_type}");
    assert_eq!(
        config("prefix = \"w\"\nformat = \"debezium-outbox\"").topic,
        "outbox.event.{aggregate_type}"
    );
}

#[test]
fn content_becomes_the_same_envelope_as_a_row() {
    let m = mapper(r#"prefix = "walbox""#);
    let e = map(&m, FULL).unwrap();
    assert_eq!(e.event_id, "e-1");
    assert_eq!(e.topic, "outbox.order");
    assert_eq!(e.key.as_deref(), Some(&b"42"[..]));
    assert_eq!(header(&e, "event_type"), Some("OrderPlaced"));
    assert_eq!(header(&e, "aggregate_type"), Some("order"));
    assert_eq!(header(&e, "schema_version"), Some("2"));
    assert_eq!(header(&e, "tenant"), Some("acme"));
    assert_eq!(header(&e, "traceparent"), Some("00-a"));
    assert_eq!(header(&e, "walbox_index"), Some("3"));
    let v = std::str::from_utf8(&e.value).unwrap();
    // The payload is embedded as written: a number beyond 64 bits stays exact.
    assert!(
        v.ends_with(r#""payload":{"total":12345678901234567890123,"x":[1,2]}}"#),
        "{v}"
    );
    let v = json(&e.value);
    assert_eq!(v["event_id"], "e-1");
    assert_eq!(v["schema_version"], 2);
    assert_eq!(v["occurred_at"], "2026-11-29T19:40:00+00:00");
    assert_eq!(v["producer"], "orders-service");
    assert_eq!(m.source(), "message:walbox");
}

#[test]
fn a_numeric_id_and_key_are_taken_as_written() {
    let m = mapper(r#"prefix = "w""#);
    let e = map(
        &m,
        r#"{"id":1007,"aggregate_type":"order","aggregate_id":42,"event_type":"T","payload":"s"}"#,
    )
    .unwrap();
    assert_eq!(e.event_id, "1007");
    assert_eq!(e.key.as_deref(), Some(&b"42"[..]));
    assert_eq!(json(&e.value)["payload"], "s");
}

#[test]
fn fields_are_renamed_per_role_and_the_topic_takes_any_field_and_the_prefix() {
    let m = mapper(
        r#"prefix = "shop"
topic = "{prefix}.{tenant}.{event_type}"
fields = { id = "event_id", aggregate_id = "order_id", event_type = "kind", payload = "data", headers = "meta" }"#,
    );
    let e = map(
        &m,
        r#"{"event_id":"x","order_id":"7","kind":"Paid","tenant":"acme","data":[1],"meta":{"h":"v"}}"#,
    )
    .unwrap();
    assert_eq!(e.topic, "shop.acme.Paid");
    assert_eq!(e.event_id, "x");
    assert_eq!(e.key.as_deref(), Some(&b"7"[..]));
    assert_eq!(header(&e, "h"), Some("v"));
    assert_eq!(json(&e.value)["payload"], serde_json::json!([1]));
    // A configured name must be there: the default's does not stand in.
    let err = map(
        &m,
        r#"{"id":"x","order_id":"7","kind":"Paid","tenant":"acme","data":1}"#,
    )
    .unwrap_err();
    assert_eq!(
        err,
        MessageError::Missing {
            role: "event id",
            field: "event_id".into()
        }
    );
}

#[test]
fn each_error_names_the_field_and_never_the_value() {
    let m = mapper(r#"prefix = "w""#);
    let cases: &[(&[u8], &str, &str)] = &[
        (b"\xff\xfe{}", "not_utf8", "not valid UTF-8"),
        (b"{\"id\": secret", "content_not_json", "not valid JSON"),
        (b"[\"secret\"]", "content_not_object", "not a JSON object"),
        (
            br#"{"aggregate_id":"k","event_type":"T","payload":1}"#,
            "missing_field",
            r#"field "id" (event id) is missing"#,
        ),
        (
            br#"{"id":null,"aggregate_id":"k","event_type":"T","payload":1}"#,
            "missing_field",
            r#"field "id" (event id)"#,
        ),
        (
            br#"{"id":"","aggregate_id":"k","event_type":"T","payload":1}"#,
            "empty_field",
            r#"field "id" (event id) is empty"#,
        ),
        (
            br#"{"id":{"secret":1},"aggregate_id":"k","event_type":"T","payload":1}"#,
            "wrong_type",
            r#"field "id" (event id) is not a string or a number"#,
        ),
        (
            br#"{"id":"e","event_type":"T","payload":1}"#,
            "missing_field",
            r#"field "aggregate_id" (aggregate id (key))"#,
        ),
        (
            br#"{"id":"e","aggregate_id":true,"event_type":"T","payload":1}"#,
            "wrong_type",
            r#"field "aggregate_id" (aggregate id (key)) is not"#,
        ),
        (
            br#"{"id":"e","aggregate_id":"k","payload":1}"#,
            "missing_field",
            r#"field "event_type" (event type)"#,
        ),
        (
            br#"{"id":"e","aggregate_id":"k","event_type":7,"payload":1}"#,
            "wrong_type",
            r#"field "event_type" (event type) is not a string"#,
        ),
        (
            br#"{"id":"e","aggregate_id":"k","event_type":"T","aggregate_type":"o"}"#,
            "missing_field",
            r#"field "payload" (payload)"#,
        ),
        (
            br#"{"id":"e","aggregate_id":"k","event_type":"T","aggregate_type":"o","payload":null}"#,
            "missing_field",
            r#"field "payload" (payload)"#,
        ),
        (
            br#"{"id":"e","aggregate_id":"k","event_type":"T","payload":1,"aggregate_type":"o","headers":{"a":1}}"#,
            "wrong_type",
            r#"field "headers" (headers) is not an object of string values"#,
        ),
        (
            br#"{"id":"e","aggregate_id":"k","event_type":"T","payload":1,"aggregate_type":"o","headers":"secret"}"#,
            "wrong_type",
            r#"field "headers" (headers)"#,
        ),
        (
            br#"{"id":"e","aggregate_id":"k","event_type":"T","payload":1}"#,
            "missing_field",
            r#"field "aggregate_type" (topic template field)"#,
        ),
        (
            br#"{"id":"e","aggregate_id":"k","event_type":"T","payload":1,"aggregate_type":"a b"}"#,
            "invalid_topic",
            "topic \"outbox.a b\" is invalid",
        ),
    ];
    for (content, class, reason) in cases {
        let err = m
            .map(&Bytes::from_static(content), pos(), None)
            .expect_err(std::str::from_utf8(content).unwrap_or("binary"));
        assert_eq!(err.class(), *class, "{err}");
        let text = err.to_string();
        assert!(text.contains(reason), "{text:?} lacks {reason:?}");
        assert!(!text.contains("secret"), "{text:?} quotes the content");
    }
}

#[test]
fn debezium_takes_its_names_and_an_absent_event_type() {
    let m = mapper(
        "prefix = \"w\"\nformat = \"debezium-outbox\"\nadditional_placement = [\"tenant:header\", \"n:envelope\"]",
    );
    let e = map(
        &m,
        r#"{"id":"e","aggregatetype":"Order","aggregateid":"9","payload":{"a":1},"tenant":"acme","n":5}"#,
    )
    .unwrap();
    assert_eq!(e.topic, "outbox.event.Order");
    assert_eq!(header(&e, "id"), Some("e"));
    assert_eq!(header(&e, "tenant"), Some("acme"));
    assert_eq!(
        json(&e.value),
        serde_json::json!({"payload": {"a": 1}, "n": 5})
    );
}

#[test]
fn cloudevents_render_the_prefix_as_the_source() {
    let m = mapper("prefix = \"shop\"\nformat = \"cloudevents\"\ntopic = \"events\"");
    let e = map(
        &m,
        r#"{"id":"e","aggregate_id":"9","event_type":"Paid","payload":{"a":1}}"#,
    )
    .unwrap();
    assert_eq!(header(&e, "ce_source"), Some("/walbox/shop"));
    assert_eq!(header(&e, "ce_type"), Some("Paid"));
    assert_eq!(header(&e, "ce_subject"), Some("9"));
    assert_eq!(header(&e, "ce_id"), Some("e"));
    assert_eq!(header(&e, "ce_time"), Some("2000-01-01T00:00:00.000000Z"));
    assert_eq!(json(&e.value), serde_json::json!({"a": 1}));
}

#[test]
fn compiling_refuses_bad_templates_and_placements_naming_the_prefix() {
    let c = config("prefix = \"w\"\ntopic = \"a b\"");
    let e = MessageMapper::compile(&c, "w", "p").unwrap_err();
    assert!(e.to_string().contains("message:w"), "{e}");
    let c = config("prefix = \"w\"\nadditional_placement = [\"a:header\"]");
    let e = MessageMapper::compile(&c, "w", "p").unwrap_err();
    assert!(e.to_string().contains("message:w"), "{e}");
    assert!(e.to_string().contains("debezium-outbox"), "{e}");
}

#[test]
fn dead_letters_carry_the_content_the_reason_and_the_prefix() {
    let m = mapper(r#"prefix = "walbox""#);
    let dlq = TopicTemplate::parse("{topic}.dlq").unwrap();
    let content =
        Bytes::from_static(br#"{"id":"e-9","aggregate_id":"k","aggregate_type":"order"}"#);
    let err = m.map(&content, pos(), None).unwrap_err();
    let d = m.dead_letter(&content, pos(), &err, &dlq);
    assert_eq!(d.topic, "outbox.order.dlq");
    assert_eq!(d.event_id, "e-9");
    assert_eq!(d.key.as_deref(), Some(&b"k"[..]));
    assert_eq!(header(&d, "event_id"), Some("e-9"));
    assert_eq!(header(&d, "walbox_error_class"), Some("missing_field"));
    assert!(
        header(&d, "walbox_error")
            .unwrap()
            .contains("\"event_type\"")
    );
    assert_eq!(header(&d, "walbox_source_message_prefix"), Some("walbox"));
    assert_eq!(header(&d, "walbox_source_topic"), Some("outbox.order"));
    assert_eq!(header(&d, "walbox_attempts"), Some("1"));
    assert_eq!(header(&d, "walbox_index"), Some("3"));
    let v = json(&d.value);
    assert_eq!(v["prefix"], "walbox");
    assert_eq!(v["content"], std::str::from_utf8(&content).unwrap());
    assert!(v.get("content_encoding").is_none());

    // Not UTF-8: base64, the position as the id, the prefix's fallback topic.
    let content = Bytes::from_static(b"\xff\x00ab");
    let err = m.map(&content, pos(), None).unwrap_err();
    let d = m.dead_letter(&content, pos(), &err, &dlq);
    assert_eq!(d.topic, "walbox.message.walbox.dlq");
    assert_eq!(d.event_id, format!("{}#3", pos().commit_lsn));
    assert!(d.key.is_none());
    let v = json(&d.value);
    assert_eq!(v["content"], "/wBhYg==");
    assert_eq!(v["content_encoding"], "base64");
    assert!(header(&d, "walbox_source_topic").is_none());

    // A readable message that was not transactional.
    let content = Bytes::copy_from_slice(FULL.as_bytes());
    let d = m.dead_letter(&content, pos(), &MessageError::NonTransactional, &dlq);
    assert_eq!(d.topic, "outbox.order.dlq");
    assert_eq!(d.event_id, "e-1");
    assert_eq!(
        header(&d, "walbox_error_class"),
        Some("non_transactional_message")
    );
    assert!(
        header(&d, "walbox_error")
            .unwrap()
            .contains("emit it with transactional = true")
    );
}

#[test]
fn cloudevents_refuse_an_occurrence_time_that_cannot_be_rfc3339() {
    let m = mapper("prefix = \"walbox\"\nformat = \"cloudevents\"");
    for bad in ["2024-05-01", "infinity", "next tuesday"] {
        let content = FULL.replace("2026-11-29 19:40:00+00", bad);
        let err = map(&m, &content).unwrap_err();
        assert_eq!(err.class(), "invalid_time", "{bad}");
        assert!(err.to_string().contains("\"occurred_at\""), "{err}");
        assert!(!err.to_string().contains(bad), "no value: {err}");
    }
    let e = map(&m, FULL).unwrap();
    assert_eq!(header(&e, "ce_time"), Some("2026-11-29T19:40:00+00:00"));
}

#[test]
fn debezium_keys_take_the_json_encoding_as_the_content_writes_them() {
    let m = mapper("prefix = \"walbox\"\nformat = \"debezium-outbox\"\nkey_encoding = \"json\"");
    let content = |key: &str| {
        format!(r#"{{"id":"e-1","aggregatetype":"order","aggregateid":{key},"payload":{{}}}}"#)
    };
    let e = map(&m, &content("\"42\"")).unwrap();
    assert_eq!(e.key.as_deref(), Some(&b"\"42\""[..]));
    let e = map(&m, &content("42")).unwrap();
    assert_eq!(e.key.as_deref(), Some(&b"42"[..]));
    let plain = mapper("prefix = \"walbox\"\nformat = \"debezium-outbox\"");
    let e = map(&plain, &content("\"42\"")).unwrap();
    assert_eq!(e.key.as_deref(), Some(&b"42"[..]));
}

#[test]
fn escaped_names_and_strings_are_decoded_and_plain_ones_read_as_written() {
    let m = mapper(r#"prefix = "walbox""#);
    // An escaped member name, and escaped texts beside plain ones.
    let e = map(
        &m,
        r#"{"i\u0064":"e-\"1\"","aggregate_type":"order","aggregate_id":"a\\b\u00e9",
            "event_type":"Order\/Placed","payload":{}}"#,
    )
    .unwrap();
    assert_eq!(e.event_id, "e-\"1\"");
    assert_eq!(e.key.as_deref(), Some("a\\bé".as_bytes()));
    assert_eq!(header(&e, "event_type"), Some("Order/Placed"));
    assert_eq!(header(&e, "aggregate_type"), Some("order"));
    let plain = map(&m, FULL).unwrap();
    assert_eq!(plain.event_id, "e-1");
    assert_eq!(plain.key.as_deref(), Some(&b"42"[..]));
    assert_eq!(header(&plain, "event_type"), Some("OrderPlaced"));
}

#[test]
fn message_headers_are_ordered_by_name_the_last_duplicate_wins_and_only_strings_pass() {
    let m = mapper(r#"prefix = "walbox""#);
    let with = |headers: &str| {
        map(
            &m,
            &format!(
                r#"{{"id":"e-1","aggregate_type":"order","aggregate_id":"42","event_type":"T","payload":{{}},"headers":{headers}}}"#
            ),
        )
    };
    let e = with(r#"{"b":"2","a":"1","a":"3\n","c":"x\u0041"}"#).unwrap();
    assert_eq!(header(&e, "a"), Some("3\n"));
    assert_eq!(header(&e, "b"), Some("2"));
    assert_eq!(header(&e, "c"), Some("xA"));
    let names: Vec<&str> = e
        .headers
        .iter()
        .map(|(k, _)| k.as_ref())
        .filter(|k| ["a", "b", "c"].contains(k))
        .collect();
    assert_eq!(names, ["a", "b", "c"]);
    for bad in [r#"{"n":1}"#, r#"{"o":{"x":"y"}}"#, r#"["a"]"#, r#""a""#] {
        assert!(
            matches!(
                with(bad),
                Err(MessageError::WrongType {
                    role: "headers",
                    ..
                })
            ),
            "{bad}"
        );
    }
    // A later string replaces an earlier value of another type.
    assert_eq!(header(&with(r#"{"a":1,"a":"s"}"#).unwrap(), "a"), Some("s"));
}

#[test]
fn a_header_member_replaced_by_a_later_string_is_not_read_further() {
    // Valid JSON whose replaced value serde_json's Value would refuse (a number
    // beyond f64): the later string is the header, as for a row's headers.
    let m = mapper(r#"prefix = "walbox""#);
    let e = map(
        &m,
        r#"{"id":"e-1","aggregate_type":"order","aggregate_id":"42","event_type":"T",
            "payload":{},"headers":{"a":[1e400],"a":"s"}}"#,
    )
    .unwrap();
    assert_eq!(header(&e, "a"), Some("s"));
}
