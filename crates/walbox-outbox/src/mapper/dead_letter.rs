//! Dead letters: the record for a row that cannot be published, carrying every
//! column, the reason and the position to a dead-letter topic.

use bytes::Bytes;
use walbox_pgoutput::TupleValue;

use super::map::push_position;
use super::value::text;
use super::{Mapper, RowError};
use crate::event::{Event, HeaderName, Position, header};
use crate::template::TopicTemplate;

/// Header names of dead-letter records.
pub mod dead_letter_header {
    /// Short class of the reason ([`RowError::class`](crate::RowError::class)).
    pub const ERROR_CLASS: &str = "walbox_error_class";
    /// The reason, naming the column (never its value).
    pub const ERROR: &str = "walbox_error";
    /// `schema.table` the row came from.
    pub const SOURCE_TABLE: &str = "walbox_source_table";
    /// The topic the event was meant for, when it could be named.
    pub const SOURCE_TOPIC: &str = "walbox_source_topic";
    /// How many times walbox tried to publish the row.
    pub const ATTEMPTS: &str = "walbox_attempts";
    /// On a dead letter that was itself refused for what it is (too large): the
    /// class of that refusal; its value then only describes what was left out.
    pub const VALUE_OMITTED: &str = "walbox_value_omitted";
}

impl Mapper {
    /// A dead-letter record for a row that cannot be published because of `error`.
    ///
    /// Topic: `template` with `{topic}` replaced by the topic the event was meant for
    /// or, when the row cannot name one, `walbox.<schema>.<table>` (`walbox.dlq` if
    /// that is still not a valid topic). Key: the aggregate id when the row has one.
    /// Value: `{"table", "columns": {name: text or null}}` with every column as the
    /// server sent it. Headers: the event id when readable, the error class and
    /// reason, the source table and topic, the position, the attempt count.
    #[must_use]
    pub fn dead_letter(
        &self,
        row: &[TupleValue],
        position: Position,
        error: &RowError,
        template: &TopicTemplate,
    ) -> Event {
        let intended = self.topic(row).ok();
        let topic = match &intended {
            Some(t) => template.dead_letter_topic(t),
            None => template.fallback_dead_letter_topic(&self.table),
        };
        let event_id = text(row, &self.id, "event id")
            .map(str::to_owned)
            .unwrap_or_else(|_| format!("{}#{}", position.commit_lsn, position.index));
        let key = self
            .key
            .as_ref()
            .and_then(|c| row.get(c.index))
            .and_then(|v| v.bytes().cloned());
        let columns: serde_json::Map<String, serde_json::Value> = self
            .column_names
            .iter()
            .zip(row)
            .map(|(name, v)| {
                let value = match v {
                    TupleValue::Null => serde_json::Value::Null,
                    TupleValue::UnchangedToast => {
                        serde_json::Value::String("(unchanged TOAST value, not sent)".into())
                    }
                    TupleValue::Text(b) | TupleValue::Binary(b) => {
                        serde_json::Value::String(String::from_utf8_lossy(b).into_owned())
                    }
                };
                (name.clone(), value)
            })
            .collect();
        let value = serde_json::json!({ "table": self.table, "columns": columns }).to_string();
        Letter {
            event_id,
            topic,
            key,
            value,
            class: error.class(),
            reason: error.to_string(),
            source: (dead_letter_header::SOURCE_TABLE, self.table.clone()),
            intended,
            position,
        }
        .into_event()
    }
}

/// A dead letter's parts, for a row's and a message's alike.
pub(crate) struct Letter {
    pub event_id: String,
    pub topic: String,
    pub key: Option<Bytes>,
    /// The value's JSON text.
    pub value: String,
    pub class: &'static str,
    /// The reason, naming the field or column, never its value.
    pub reason: String,
    /// The header naming where it came from, and its value.
    pub source: (&'static str, String),
    /// The topic the event was meant for, when it could be named.
    pub intended: Option<String>,
    pub position: Position,
}

impl Letter {
    /// The record: headers event id, error class and reason, source, intended
    /// topic, position, attempts.
    pub(crate) fn into_event(self) -> Event {
        let mut headers: Vec<(HeaderName, Bytes)> = vec![
            (header::EVENT_ID.into(), Bytes::from(self.event_id.clone())),
            (
                dead_letter_header::ERROR_CLASS.into(),
                Bytes::from_static(self.class.as_bytes()),
            ),
            (dead_letter_header::ERROR.into(), Bytes::from(self.reason)),
            (self.source.0.into(), Bytes::from(self.source.1)),
        ];
        if let Some(t) = self.intended {
            headers.push((dead_letter_header::SOURCE_TOPIC.into(), Bytes::from(t)));
        }
        push_position(&mut headers, self.position);
        headers.push((
            dead_letter_header::ATTEMPTS.into(),
            Bytes::from_static(b"1"),
        ));
        Event {
            event_id: self.event_id,
            topic: self.topic,
            key: self.key,
            value: Bytes::from(self.value),
            json_value: true,
            headers,
            position: self.position,
            origin: crate::Origin::Stream,
        }
    }
}
