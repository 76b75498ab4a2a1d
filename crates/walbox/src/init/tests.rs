use std::collections::BTreeMap;
use std::path::Path;

use serde::de::{self, Visitor};

use super::*;
use crate::config::{
    CheckpointConfig, DeadLetterConfig, LogConfig, MetricsConfig, ShutdownConfig, SinkConfig,
    SnapshotConfig, SourceConfig,
};

/// The keys a configuration struct accepts, as its `Deserialize` names them
/// (serde hands a struct's field names to the deserializer).
fn keys<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
    struct Fields<'a>(&'a mut &'static [&'static str]);
    impl<'de> serde::Deserializer<'de> for Fields<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("fields recorded"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Fields(&mut fields));
    assert!(
        !fields.is_empty(),
        "{} is a struct",
        std::any::type_name::<T>()
    );
    fields
}

/// The keys of a sink type's own table (`[sink.<type>]`), when it is a
/// struct of walbox's (Kafka's holds librdkafka's properties, stdout has
/// none). A new sink type names its settings here.
fn sink_table_keys(kind: SinkKind) -> Option<&'static [&'static str]> {
    match kind {
        SinkKind::Kafka | SinkKind::Stdout => None,
        SinkKind::Nats => Some(keys::<walbox_sink::NatsSinkConfig>()),
        SinkKind::Webhook => Some(keys::<walbox_sink::WebhookSinkConfig>()),
        SinkKind::Redis => Some(keys::<walbox_sink::RedisSinkConfig>()),
        SinkKind::RabbitMq => Some(keys::<walbox_sink::RabbitMqSinkConfig>()),
        SinkKind::Kinesis => Some(keys::<walbox_sink::KinesisSinkConfig>()),
        SinkKind::Sqs => Some(keys::<walbox_sink::SqsSinkConfig>()),
        SinkKind::PubSub => Some(keys::<walbox_sink::PubSubSinkConfig>()),
        SinkKind::Sns => Some(keys::<walbox_sink::SnsSinkConfig>()),
    }
}

/// `[sink]` keys only some sink types read.
const NOT_EVERY_SINKS: &[&str] = &["create_topics", "topic_partitions", "topic_replication"];

/// Which of [`NOT_EVERY_SINKS`] a sink type reads.
fn reads(kind: SinkKind, key: &str) -> bool {
    match kind {
        SinkKind::Kafka => true,
        SinkKind::Kinesis => matches!(key, "create_topics" | "topic_partitions"),
        SinkKind::Sqs | SinkKind::PubSub | SinkKind::Sns => key == "create_topics",
        SinkKind::Stdout
        | SinkKind::Nats
        | SinkKind::Webhook
        | SinkKind::Redis
        | SinkKind::RabbitMq => false,
    }
}

fn template(kind: SinkKind) -> String {
    render(
        kind,
        Some("host=127.0.0.1 user=walbox dbname=app"),
        "public.outbox",
        "walbox.toml",
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    )
}

fn parse(text: &str) -> Result<Config> {
    Config::parse(text, Path::new("walbox.toml"))
}

/// Each table of the text (`source`, `sink.nats`, `outbox`, ...; "" before
/// the first) and the keys set or shown commented out in it.
fn sections(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current = String::new();
    out.insert(current.clone(), Vec::new());
    for line in text.lines() {
        if line.starts_with('[') {
            current = line.trim_matches(|c| c == '[' || c == ']').to_owned();
            out.entry(current.clone()).or_default();
        } else if let Some(key) = key_of(line) {
            out.entry(current.clone()).or_default().push(key);
        }
    }
    out
}

/// The key a line sets, or shows commented out (`# key = value`).
fn key_of(line: &str) -> Option<String> {
    let body = line.strip_prefix("# ").unwrap_or(line);
    let (key, _) = body.split_once(" = ")?;
    let key = key.trim_matches('"');
    key.chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.')
        .then(|| key.to_owned())
}

/// The commented-out settings: `(line index, the line uncommented, an example)`.
fn commented(text: &str) -> Vec<(usize, String, bool)> {
    text.lines()
        .enumerate()
        .filter_map(|(i, line)| {
            key_of(line)?;
            let body = line.strip_prefix("# ")?;
            Some((i, body.to_owned(), body.ends_with("# example")))
        })
        .collect()
}

fn with_line(text: &str, index: usize, new: &str) -> String {
    let mut lines: Vec<&str> = text.lines().collect();
    lines[index] = new;
    lines.join("\n") + "\n"
}

#[test]
fn every_sink_type_has_a_template_that_loads_as_that_sink() {
    for &kind in SinkKind::all() {
        for dsn in [
            Some("host=db user=walbox dbname=app password='it''s \"x\"'"),
            None,
        ] {
            let text = render(kind, dsn, "app.outbox", "walbox.toml", "whsec_eA==");
            let c = parse(&text).unwrap_or_else(|e| panic!("{kind:?}: {e:#}\n{text}"));
            assert_eq!(c.sink.kind, kind);
            assert_eq!(c.source.dsn.as_ref().map(Secret::expose), dsn);
            assert_eq!(c.outbox[0].table, "app.outbox");
            for p in [
                "DESTINATION",
                "NAME",
                "FILE",
                "DSN",
                "TABLE",
                "TOPIC_NAMES",
                "SECRET",
            ] {
                assert!(!text.contains(&format!("@{p}@")), "{kind:?}: @{p}@ left");
            }
            assert!(text.contains(kind.destination()), "{kind:?}");
        }
    }
}

#[test]
fn every_key_the_configuration_takes_for_the_sink_is_in_its_template() {
    let tables: [(&str, &[&str]); 8] = [
        ("source", keys::<SourceConfig>()),
        ("dead_letter", keys::<DeadLetterConfig>()),
        ("checkpoint", keys::<CheckpointConfig>()),
        ("snapshot", keys::<SnapshotConfig>()),
        ("shutdown", keys::<ShutdownConfig>()),
        ("metrics", keys::<MetricsConfig>()),
        ("log", keys::<LogConfig>()),
        ("outbox", &["table", "topic", "format"]),
    ];
    let sink_tables: Vec<&str> = SinkKind::all().iter().map(|k| k.name()).collect();
    for &kind in SinkKind::all() {
        let text = template(kind);
        let found = sections(&text);
        for top in keys::<Config>() {
            assert!(
                text.lines().any(|l| l.contains(&format!("[{top}]"))
                    || l.contains(&format!("[[{top}]]"))
                    || key_of(l).as_deref() == Some(top)),
                "{kind:?}: {top} is not in the template"
            );
        }
        for (table, wanted) in tables {
            for key in wanted {
                assert!(
                    found[table].iter().any(|k| k == key),
                    "{kind:?}: {table}.{key} is not in the template"
                );
            }
        }
        // [sink]: the keys every sink takes, Kafka's own for Kafka, and the
        // sink type's table.
        for key in keys::<SinkConfig>() {
            if sink_tables.contains(key) || (NOT_EVERY_SINKS.contains(key) && !reads(kind, key)) {
                continue;
            }
            assert!(
                found["sink"].iter().any(|k| k == key),
                "{kind:?}: sink.{key} is not in the template"
            );
        }
        assert!(keys::<SinkConfig>().contains(&"type"));
        let own = format!("sink.{}", kind.name());
        if let Some(wanted) = sink_table_keys(kind) {
            let shown = found
                .get(&own)
                .unwrap_or_else(|| panic!("{kind:?}: no [{own}]"));
            for key in wanted {
                assert!(
                    shown.iter().any(|k| k == key),
                    "{kind:?}: {own}.{key} is not in the template"
                );
            }
        }
        // No other sink's table.
        for other in &sink_tables {
            if *other != kind.name() {
                assert!(!found.contains_key(&format!("sink.{other}")), "{kind:?}");
            }
        }
    }
}

#[test]
fn a_commented_key_shows_its_default() {
    for &kind in SinkKind::all() {
        let text = template(kind);
        let as_written = format!("{:?}", parse(&text).unwrap());
        let mut defaults = 0;
        for (i, line, example) in commented(&text) {
            if example {
                continue;
            }
            let changed = parse(&with_line(&text, i, &line))
                .unwrap_or_else(|e| panic!("{kind:?}: {line}: {e:#}"));
            assert_eq!(
                format!("{changed:?}"),
                as_written,
                "{kind:?}: `{line}` is not the default (end the line in \"# example\" if it is one)"
            );
            defaults += 1;
        }
        assert!(defaults >= 15, "{kind:?}: {defaults} defaults shown");
    }
}

#[test]
fn every_key_uncommented_still_loads() {
    for &kind in SinkKind::all() {
        let text = template(kind);
        let mut all = text.clone();
        let lines = commented(&text);
        assert!(!lines.is_empty());
        for (i, line, _) in lines {
            all = with_line(&all, i, &line);
        }
        parse(&all).unwrap_or_else(|e| panic!("{kind:?}: {e:#}\n{all}"));
    }
}

#[test]
fn a_webhook_secret_is_new_each_time_and_of_the_standard_form() {
    let a = new_webhook_secret().unwrap();
    let b = new_webhook_secret().unwrap();
    assert_ne!(a, b);
    for s in [a, b] {
        let key = s.strip_prefix("whsec_").unwrap();
        use base64::Engine as _;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(key)
            .unwrap();
        assert_eq!(bytes.len(), 32);
    }
}
