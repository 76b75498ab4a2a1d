//! The table-less outbox: logical decoding messages (`pg_logical_emit_message`)
//! whose content is a JSON object of the event's fields.
//!
//! A [`MessageConfig`] (a `[[messages]]` section) names the prefixes and which
//! field plays which role; [`MessageMapper::compile`] resolves it once per
//! prefix, and [`MessageMapper::map`] turns a message's content into the same
//! [`EventFields`] a row becomes, shaped by the same [`Formatter`], or into a
//! [`MessageError`] that names the field and what is wrong with it (never the
//! value). [`MessageMapper::dead_letter`] builds the dead-letter record of a
//! message that cannot be published.
//!
//! `{table}` and `{prefix}` in templates (the topic, CloudEvents' source and
//! subject) render as the message's prefix.

mod config;
mod json;

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;

use crate::config::{ColumnNames, Format};
use crate::event::{Event, HeaderName, Position};
use crate::format::{
    EventFields, Extra, ExtraKind, FieldNames, Formatter, Payload, PayloadKind, Text,
};
use crate::mapper::{Letter, MappingError, RowError};
use crate::template::{TopicTemplate, validate_topic};

pub use config::{MessageConfig, check_prefixes};

/// Header naming the prefix of a dead-lettered message.
pub const SOURCE_MESSAGE_PREFIX: &str = "walbox_source_message_prefix";

/// A message that cannot become an event. Names fields and roles, never values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// The content is not UTF-8 (JSON is).
    #[error("message content is not valid UTF-8")]
    NotUtf8,
    /// The content is not JSON.
    #[error("message content is not valid JSON: {reason}")]
    NotJson {
        /// The parser's complaint (position and kind, no content).
        reason: String,
    },
    /// The content is JSON but not an object.
    #[error("message content is not a JSON object")]
    NotObject,
    /// A required field is absent or null.
    #[error("message field {field:?} ({role}) is missing or null")]
    Missing {
        /// What the field is for.
        role: &'static str,
        /// The field's name.
        field: String,
    },
    /// A field that must not be empty is.
    #[error("message field {field:?} ({role}) is empty")]
    Empty {
        /// What the field is for.
        role: &'static str,
        /// The field's name.
        field: String,
    },
    /// A field holds another JSON type than its role takes.
    #[error("message field {field:?} ({role}) is not {expected}")]
    WrongType {
        /// What the field is for.
        role: &'static str,
        /// The field's name.
        field: String,
        /// What it must be.
        expected: &'static str,
    },
    /// The topic the message names is not a valid topic.
    #[error("topic {topic:?} is invalid: {reason}")]
    InvalidTopic {
        /// The topic the message produced.
        topic: String,
        /// Why.
        reason: &'static str,
    },
    /// The format could not shape the event.
    #[error("{0}")]
    Record(RowError),
    /// A non-transactional message: published outside any transaction, it has
    /// no place in commit order.
    #[error("non-transactional message: it has no commit order; emit it with transactional = true")]
    NonTransactional,
}

impl MessageError {
    /// A short, stable name of the error's class (for dead-letter headers and metrics).
    #[must_use]
    pub fn class(&self) -> &'static str {
        match self {
            Self::NotUtf8 => "not_utf8",
            Self::NotJson { .. } => "content_not_json",
            Self::NotObject => "content_not_object",
            Self::Missing { .. } => "missing_field",
            Self::Empty { .. } => "empty_field",
            Self::WrongType { .. } => "wrong_type",
            Self::InvalidTopic { .. } => "invalid_topic",
            Self::Record(e) => e.class(),
            Self::NonTransactional => "non_transactional_message",
        }
    }
}

/// The candidate field names of a role: the configured one, else the format's
/// defaults in order of preference (the first the content has plays the role).
#[derive(Debug, Clone)]
struct Role {
    role: &'static str,
    names: Vec<String>,
}

impl Role {
    fn new(role: &'static str, configured: Option<&String>, defaults: &[&str]) -> Self {
        let names = match configured {
            Some(n) => vec![n.clone()],
            None => defaults.iter().map(|d| (*d).to_owned()).collect(),
        };
        Role { role, names }
    }

    /// The name errors use.
    fn name(&self) -> String {
        self.names.first().cloned().unwrap_or_default()
    }
}

#[derive(Debug, Clone, Copy)]
enum RoleId {
    Id,
    AggregateType,
    AggregateId,
    EventType,
}

#[derive(Debug, Clone)]
enum TopicPart {
    Prefix,
    Role(RoleId),
    Field(String),
}

#[derive(Debug, Clone)]
enum TopicSource {
    Fixed(String),
    Template(TopicTemplate, Vec<TopicPart>),
}

/// A [`MessageConfig`] resolved for one prefix.
#[derive(Debug, Clone)]
pub struct MessageMapper {
    prefix: String,
    source: String,
    formatter: Formatter,
    event_type_required: bool,
    id: Role,
    aggregate_type: Role,
    aggregate_id: Role,
    event_type: Role,
    payload: Role,
    headers: Role,
    occurred_at: Role,
    schema_version: Role,
    topic: TopicSource,
}

/// A message's content, checked to be a JSON object, with its members' spans.
struct Content<'a> {
    raw: &'a Bytes,
    /// Names borrow the content unless they hold an escape.
    members: Vec<(Cow<'a, str>, Range<usize>)>,
}

impl Content<'_> {
    fn parse(raw: &Bytes) -> Result<Content<'_>, MessageError> {
        std::str::from_utf8(raw).map_err(|_| MessageError::NotUtf8)?;
        serde_json::from_slice::<serde::de::IgnoredAny>(raw).map_err(|e| {
            MessageError::NotJson {
                reason: format!(
                    "{} at line {} column {}",
                    classify(&e),
                    e.line(),
                    e.column()
                ),
            }
        })?;
        let members = json::members(raw).ok_or(MessageError::NotObject)?;
        Ok(Content { raw, members })
    }

    /// The value of the first of `role`'s names the content has (the last
    /// member of that name), with the name; `None` when absent or null.
    fn get<'r>(&self, role: &'r Role) -> Option<(&'r str, Bytes)> {
        role.names.iter().find_map(|name| {
            let range = self
                .members
                .iter()
                .rev()
                .find(|(k, _)| k == name)
                .map(|(_, r)| r.clone())?;
            let value = self.raw.slice(range);
            (&value[..] != b"null").then_some((name.as_str(), value))
        })
    }

    /// A role's text: a JSON string, or a number as written when `numbers`.
    fn text(&self, role: &Role, numbers: bool) -> Result<Option<Text>, MessageError> {
        let Some((name, value)) = self.get(role) else {
            return Ok(None);
        };
        let wrong = || MessageError::WrongType {
            role: role.role,
            field: name.to_owned(),
            expected: if numbers {
                "a string or a number"
            } else {
                "a string"
            },
        };
        match value.first() {
            // No escapes: the string's bytes are its text (the content is
            // valid JSON and UTF-8), shared with the message's buffer.
            Some(b'"') if !value.contains(&b'\\') => Ok(Some(
                Text::new(value.slice(1..value.len() - 1)).map_err(|_| wrong())?,
            )),
            Some(b'"') => {
                let s: String = serde_json::from_slice(&value).map_err(|_| wrong())?;
                Ok(Some(Text::from(s)))
            }
            Some(b'-' | b'0'..=b'9') if numbers => Ok(Some(Text::new(value).map_err(|_| wrong())?)),
            _ => Err(wrong()),
        }
    }

    fn required(&self, role: &Role, numbers: bool) -> Result<Text, MessageError> {
        self.text(role, numbers)?
            .ok_or_else(|| MessageError::Missing {
                role: role.role,
                field: role.name(),
            })
    }
}

impl MessageMapper {
    /// Resolves `config` for `prefix`; `producer` names this relay in envelopes.
    ///
    /// # Errors
    /// A topic template that does not parse, a fixed topic that is not valid,
    /// format settings that do not fit the format.
    pub fn compile(
        config: &MessageConfig,
        prefix: &str,
        producer: &str,
    ) -> Result<Self, MappingError> {
        let source = MessageConfig::source_name(prefix);
        let f: &ColumnNames = &config.fields;
        let format = config.formatting.format;
        let id = Role::new("event id", f.id.as_ref(), &["id"]);
        let aggregate_type = Role::new(
            "aggregate type",
            f.aggregate_type.as_ref(),
            format.default_columns("aggregate_type"),
        );
        let aggregate_id = Role::new(
            "aggregate id (key)",
            f.aggregate_id.as_ref(),
            format.default_columns("aggregate_id"),
        );
        let event_type = Role::new(
            "event type",
            f.event_type.as_ref(),
            format.default_columns("event_type"),
        );
        let payload = Role::new("payload", f.payload.as_ref(), &["payload"]);
        let headers = Role::new("headers", f.headers.as_ref(), &["headers"]);
        let occurred_at = Role::new("occurrence time", f.occurred_at.as_ref(), &["occurred_at"]);
        let schema_version = Role::new(
            "schema version",
            f.schema_version.as_ref(),
            &["schema_version"],
        );
        let template = TopicTemplate::parse(&config.topic).map_err(|e| MappingError::Template {
            table: source.clone(),
            source: e,
        })?;
        let topic = if template.is_fixed() {
            validate_topic(&config.topic).map_err(|reason| MappingError::InvalidTopic {
                table: source.clone(),
                topic: config.topic.clone(),
                reason,
            })?;
            TopicSource::Fixed(config.topic.clone())
        } else {
            let parts = template
                .fields()
                .map(|field| match field {
                    "prefix" | "table" | "source" => TopicPart::Prefix,
                    "id" | "event_id" => TopicPart::Role(RoleId::Id),
                    "aggregate_type" => TopicPart::Role(RoleId::AggregateType),
                    "aggregate_id" => TopicPart::Role(RoleId::AggregateId),
                    "event_type" => TopicPart::Role(RoleId::EventType),
                    other => TopicPart::Field(other.to_owned()),
                })
                .collect();
            TopicSource::Template(template, parts)
        };
        let formatter = Formatter::new(
            &config.formatting,
            prefix,
            producer,
            FieldNames {
                id: id.name(),
                aggregate_id: aggregate_id.name(),
                aggregate_type: aggregate_type.name(),
                event_type: event_type.name(),
                payload: payload.name(),
                occurred_at: occurred_at.name(),
            },
        )
        .map_err(|e| match e {
            MappingError::Format {
                format, problem, ..
            } => MappingError::Format {
                table: source.clone(),
                format,
                problem,
            },
            other => other,
        })?;
        Ok(MessageMapper {
            prefix: prefix.to_owned(),
            source,
            formatter,
            event_type_required: format != Format::DebeziumOutbox,
            id,
            aggregate_type,
            aggregate_id,
            event_type,
            payload,
            headers,
            occurred_at,
            schema_version,
            topic,
        })
    }

    /// The prefix.
    #[must_use]
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The source name of this prefix's events (`message:<prefix>`).
    #[must_use]
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The format step this mapper ends with.
    #[must_use]
    pub fn formatter(&self) -> &Formatter {
        &self.formatter
    }

    fn role(&self, id: RoleId) -> &Role {
        match id {
            RoleId::Id => &self.id,
            RoleId::AggregateType => &self.aggregate_type,
            RoleId::AggregateId => &self.aggregate_id,
            RoleId::EventType => &self.event_type,
        }
    }

    fn topic(&self, c: &Content<'_>) -> Result<String, MessageError> {
        let (template, parts) = match &self.topic {
            TopicSource::Fixed(t) => return Ok(t.clone()),
            TopicSource::Template(t, parts) => (t, parts),
        };
        let mut values: Vec<Text> = Vec::with_capacity(parts.len());
        for part in parts {
            let text = match part {
                TopicPart::Prefix => Text::from(self.prefix.clone()),
                TopicPart::Role(r) => {
                    let role = self.role(*r);
                    c.required(
                        &Role {
                            role: "topic template field",
                            names: role.names.clone(),
                        },
                        true,
                    )?
                }
                TopicPart::Field(name) => c.required(
                    &Role {
                        role: "topic template field",
                        names: vec![name.clone()],
                    },
                    true,
                )?,
            };
            values.push(text);
        }
        let topic = template.render(|i, _| {
            values
                .get(i)
                .map(Text::as_str)
                .ok_or(MessageError::NotObject)
        })?;
        validate_topic(&topic).map_err(|reason| MessageError::InvalidTopic {
            topic: topic.clone(),
            reason,
        })?;
        Ok(topic)
    }

    /// Maps a message's content of a transaction committed at `commit_time`
    /// (PostgreSQL microseconds since 2000-01-01 UTC).
    ///
    /// # Errors
    /// Content that is not a JSON object of the configured fields (named, never
    /// their values).
    pub fn map(
        &self,
        content: &Bytes,
        position: Position,
        commit_time: Option<i64>,
    ) -> Result<Event, MessageError> {
        let fields = self.fields(content, position, commit_time)?;
        self.formatter.render(fields).map_err(MessageError::Record)
    }

    /// The event fields of a message's content, before its format shapes them.
    ///
    /// # Errors
    /// As [`map`](Self::map).
    pub fn fields(
        &self,
        content: &Bytes,
        position: Position,
        commit_time: Option<i64>,
    ) -> Result<EventFields, MessageError> {
        let c = Content::parse(content)?;
        let event_id = c.required(&self.id, true)?;
        if event_id.as_str().is_empty() {
            return Err(MessageError::Empty {
                role: self.id.role,
                field: self.id.name(),
            });
        }
        let aggregate_id = c.required(&self.aggregate_id, true)?.bytes().clone();
        let key_kind = match c
            .get(&self.aggregate_id)
            .and_then(|(_, raw)| raw.first().copied())
        {
            Some(b'-' | b'0'..=b'9') => ExtraKind::Number,
            _ => ExtraKind::Text,
        };
        let event_type = if self.event_type_required {
            Some(c.required(&self.event_type, false)?)
        } else {
            c.text(&self.event_type, false)?
        };
        let aggregate_type = c.text(&self.aggregate_type, false)?;
        let schema_version = c.text(&self.schema_version, true)?;
        let occurred_at = c.text(&self.occurred_at, false)?;
        let payload = match c.get(&self.payload) {
            Some((_, bytes)) => Payload {
                bytes,
                kind: PayloadKind::Json,
            },
            None => {
                return Err(MessageError::Missing {
                    role: self.payload.role,
                    field: self.payload.name(),
                });
            }
        };
        let headers = self.headers(&c)?;
        let extra = self
            .formatter
            .placements()
            .iter()
            .map(|p| extra(&c, &p.column))
            .collect();
        let topic = self.topic(&c)?;
        Ok(EventFields {
            event_id,
            topic,
            aggregate_type,
            aggregate_id: Some(aggregate_id),
            key_kind,
            event_type,
            schema_version,
            occurred_at,
            commit_time,
            payload: Some(payload),
            value: None,
            headers,
            extra,
            position,
        })
    }

    /// The headers object: string values only, ordered by name.
    fn headers(&self, c: &Content<'_>) -> Result<Vec<(HeaderName, Bytes)>, MessageError> {
        let Some((name, raw)) = c.get(&self.headers) else {
            return Ok(Vec::new());
        };
        let wrong = || MessageError::WrongType {
            role: "headers",
            field: name.to_owned(),
            expected: "an object of string values",
        };
        let mut headers = Vec::new();
        crate::mapper::value::json_string_headers(&raw, &mut headers).map_err(|_| wrong())?;
        Ok(headers)
    }

    /// A dead-letter record for a message that cannot be published because of
    /// `error`.
    ///
    /// Topic: `template` with `{topic}` replaced by the topic the event was meant
    /// for or, when the message cannot name one, `walbox.message.<prefix>`
    /// (characters a topic cannot hold become `_`). Key: the aggregate id when
    /// readable. Value: `{"prefix", "content"}` with the content as a string, or
    /// base64 with `"content_encoding": "base64"` when it is not UTF-8. Headers:
    /// the event id when readable (else `<commit LSN>#<index>`), the error class
    /// and reason, the prefix, the intended topic, the position, the attempts.
    #[must_use]
    pub fn dead_letter(
        &self,
        content: &Bytes,
        position: Position,
        error: &MessageError,
        template: &TopicTemplate,
    ) -> Event {
        let parsed = Content::parse(content).ok();
        let intended = parsed.as_ref().and_then(|c| self.topic(c).ok());
        let topic = match &intended {
            Some(t) => template.dead_letter_topic(t),
            None => template.fallback_dead_letter_topic(&format!("message.{}", self.prefix)),
        };
        let event_id = parsed
            .as_ref()
            .and_then(|c| c.text(&self.id, true).ok().flatten())
            .filter(|t| !t.as_str().is_empty())
            .map_or_else(
                // xid 0: a non-transactional message, whose LSN a transaction
                // committing right after it shares as its commit LSN.
                || {
                    if position.xid == 0 {
                        format!("{}#nt", position.commit_lsn)
                    } else {
                        format!("{}#{}", position.commit_lsn, position.index)
                    }
                },
                |t| t.as_str().to_owned(),
            );
        let key = parsed
            .as_ref()
            .and_then(|c| c.text(&self.aggregate_id, true).ok().flatten())
            .map(|t| t.bytes().clone());
        let value = match std::str::from_utf8(content) {
            Ok(text) => serde_json::json!({ "prefix": self.prefix, "content": text }),
            Err(_) => serde_json::json!({
                "prefix": self.prefix,
                "content": json::base64(content),
                "content_encoding": "base64",
            }),
        };
        Letter {
            event_id,
            topic,
            key,
            value: value.to_string(),
            class: error.class(),
            reason: error.to_string(),
            source: (SOURCE_MESSAGE_PREFIX, self.prefix.clone()),
            intended,
            position,
        }
        .into_event()
    }
}

/// An extra field's value: a string as its text, a number or boolean as
/// written, an object or array as its JSON; absent or null: `None`.
fn extra(c: &Content<'_>, field: &str) -> Option<Extra> {
    let role = Role {
        role: "additional placement",
        names: vec![field.to_owned()],
    };
    let (_, raw) = c.get(&role)?;
    let (value, kind) = match raw.first() {
        Some(b'"') => (c.text(&role, false).ok().flatten()?, ExtraKind::Text),
        Some(b't' | b'f') => (Text::new(raw).ok()?, ExtraKind::Bool),
        Some(b'-' | b'0'..=b'9') => (Text::new(raw).ok()?, ExtraKind::Number),
        _ => (Text::new(raw).ok()?, ExtraKind::Text),
    };
    Some(Extra { value, kind })
}

fn classify(e: &serde_json::Error) -> &'static str {
    match e.classify() {
        serde_json::error::Category::Io => "I/O error",
        serde_json::error::Category::Syntax => "syntax error",
        serde_json::error::Category::Data => "unexpected data",
        serde_json::error::Category::Eof => "unexpected end",
    }
}

#[cfg(test)]
mod tests;
