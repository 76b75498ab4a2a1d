//! A `[[messages]]` section: which prefixes of `pg_logical_emit_message` are
//! outbox events, which fields of their JSON content play which role, how the
//! topic is named and in which format the record is shaped.

use serde::Deserialize;

use crate::config::{
    CloudEventsMode, ColumnNames, DEFAULT_CLOUDEVENTS_SOURCE, DEFAULT_CLOUDEVENTS_SUBJECT, Format,
    FormatSettings, KeyEncoding, Placement,
};
use crate::format::Binding;

/// Logical decoding messages of some prefixes and how they become events.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "RawMessageConfig")]
pub struct MessageConfig {
    /// The prefixes (`prefix = "..."` or `prefixes = [...]`), non-empty, distinct.
    pub prefixes: Vec<String>,
    /// Topic template over the content's fields (roles, `{prefix}` or `{table}`
    /// for the prefix, or any top-level string field), or a fixed name.
    pub topic: String,
    /// Which field of the JSON content plays which role (defaults as for a
    /// table's columns).
    pub fields: ColumnNames,
    /// The record shape and its settings.
    pub formatting: FormatSettings,
}

/// [`MessageConfig`] as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMessageConfig {
    #[serde(default)]
    prefix: Option<String>,
    #[serde(default)]
    prefixes: Option<Vec<String>>,
    #[serde(default)]
    topic: Option<String>,
    #[serde(default)]
    fields: ColumnNames,
    #[serde(default)]
    format: Format,
    #[serde(default)]
    additional_placement: Vec<Placement>,
    #[serde(default)]
    cloudevents_mode: Option<CloudEventsMode>,
    #[serde(default)]
    cloudevents_source: Option<String>,
    #[serde(default)]
    cloudevents_subject: Option<String>,
    #[serde(default)]
    key_encoding: KeyEncoding,
}

impl TryFrom<RawMessageConfig> for MessageConfig {
    type Error = String;

    fn try_from(raw: RawMessageConfig) -> Result<Self, Self::Error> {
        section(raw).map_err(|e| format!("[[messages]]: {e}"))
    }
}

/// The section's checks, before they are named as `[[messages]]`'s.
fn section(raw: RawMessageConfig) -> Result<MessageConfig, String> {
    let prefixes = match (raw.prefix, raw.prefixes) {
        (Some(_), Some(_)) => {
            return Err("prefix and prefixes are both set; keep one of them".into());
        }
        (None, None) => {
            return Err(
                "no prefix: set prefix (one) or prefixes (a list), the prefixes given to \
                     pg_logical_emit_message"
                    .into(),
            );
        }
        (Some(p), None) => vec![p],
        (None, Some(ps)) => ps,
    };
    if prefixes.is_empty() {
        return Err("prefixes is empty; name at least one prefix".into());
    }
    if prefixes.iter().any(String::is_empty) {
        return Err("a prefix is empty; pg_logical_emit_message takes a non-empty one".into());
    }
    check_distinct(prefixes.iter().map(String::as_str))?;
    Ok(MessageConfig {
        prefixes,
        topic: raw
            .topic
            .unwrap_or_else(|| raw.format.default_topic().to_owned()),
        fields: raw.fields,
        formatting: FormatSettings {
            format: raw.format,
            additional_placement: raw.additional_placement,
            cloudevents_mode: raw.cloudevents_mode,
            cloudevents_source: raw
                .cloudevents_source
                .unwrap_or_else(|| DEFAULT_CLOUDEVENTS_SOURCE.to_owned()),
            cloudevents_subject: raw
                .cloudevents_subject
                .unwrap_or_else(|| DEFAULT_CLOUDEVENTS_SUBJECT.to_owned()),
            key_encoding: raw.key_encoding,
            binding: Binding::default(),
        },
    })
}

impl MessageConfig {
    /// One prefix with every default: fields named after their roles, topic
    /// `outbox.{aggregate_type}`, format `walbox`.
    #[must_use]
    pub fn new(prefix: &str) -> Self {
        MessageConfig {
            prefixes: vec![prefix.to_owned()],
            topic: Format::Walbox.default_topic().to_owned(),
            fields: ColumnNames::default(),
            formatting: FormatSettings::default(),
        }
    }

    /// The source name of a prefix's events (`message:<prefix>`): what metrics
    /// count them by and what a partly acknowledged transaction's count is
    /// recorded over.
    #[must_use]
    pub fn source_name(prefix: &str) -> String {
        format!("{MESSAGE_SOURCE}{prefix}")
    }

    /// Whether `source` (a table's `schema.name` or a source name) names a
    /// prefix's messages.
    #[must_use]
    pub fn is_message_source(source: &str) -> bool {
        source.starts_with(MESSAGE_SOURCE)
    }

    /// The prefix a message source name stands for; `None` for a table.
    #[must_use]
    pub fn prefix_of(source: &str) -> Option<&str> {
        source.strip_prefix(MESSAGE_SOURCE)
    }
}

/// What a message source name starts with (a table name has no colon).
const MESSAGE_SOURCE: &str = "message:";

/// Checks that no prefix is configured twice, across all `[[messages]]` sections.
///
/// # Errors
/// The repeated prefix.
pub fn check_prefixes(sections: &[MessageConfig]) -> Result<(), String> {
    check_distinct(
        sections
            .iter()
            .flat_map(|s| s.prefixes.iter().map(String::as_str)),
    )
}

fn check_distinct<'a>(prefixes: impl Iterator<Item = &'a str>) -> Result<(), String> {
    let mut seen: Vec<&str> = Vec::new();
    for p in prefixes {
        if seen.contains(&p) {
            return Err(format!(
                "prefix {p:?} is configured twice (over every [[messages]] section); each \
                 prefix belongs to one section"
            ));
        }
        seen.push(p);
    }
    Ok(())
}
