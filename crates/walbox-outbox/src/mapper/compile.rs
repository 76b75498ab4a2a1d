//! [`Mapper::compile`]: a [`TableConfig`] resolved against a table's shape from
//! a Relation message: which column plays which role, the payload's kind, where
//! the topic comes from.

use walbox_pgoutput::{Oid, Relation};

use super::{Col, Mapper, MappingError, PayloadKind, TopicSource};
use crate::config::{TableConfig, ValueFormat};
use crate::template::{TopicTemplate, validate_topic};

pub(super) const BYTEA: Oid = 17;
pub(super) const TEXT: Oid = 25;
pub(super) const JSON: Oid = 114;
pub(super) const BPCHAR: Oid = 1042;
pub(super) const VARCHAR: Oid = 1043;
pub(super) const JSONB: Oid = 3802;

impl Mapper {
    /// Resolves `config` against `relation`; `producer` names this relay in envelopes.
    pub fn compile(
        config: &TableConfig,
        producer: &str,
        relation: &Relation,
    ) -> Result<Self, MappingError> {
        let table = format!("{}.{}", relation.namespace, relation.name);
        let available = || {
            relation
                .columns
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let find = |name: &str| relation.columns.iter().position(|c| c.name == name);
        let required = |role: &'static str, configured: &Option<String>, default: &str| {
            let name = configured.as_deref().unwrap_or(default);
            find(name)
                .map(|index| Col {
                    index,
                    name: name.to_owned(),
                })
                .ok_or_else(|| MappingError::MissingColumn {
                    table: table.clone(),
                    role,
                    column: name.to_owned(),
                    available: available(),
                })
        };
        let optional =
            |role: &'static str, configured: &Option<String>, default: &str| match configured {
                Some(_) => required(role, configured, default).map(Some),
                None => Ok(find(default).map(|index| Col {
                    index,
                    name: default.to_owned(),
                })),
            };
        let type_of = |c: &Col| relation.columns.get(c.index).map_or(0, |c| c.type_oid);
        let c = &config.columns;

        let id = required("event id", &c.id, "id")?;
        let envelope = matches!(config.value, ValueFormat::Envelope);
        let (key, event_type, payload) = if envelope {
            let payload = required("payload", &c.payload, "payload")?;
            let kind = match type_of(&payload) {
                JSON | JSONB => PayloadKind::Json,
                TEXT | VARCHAR | BPCHAR => PayloadKind::Text,
                BYTEA => PayloadKind::Bytea,
                other => {
                    return Err(MappingError::WrongType {
                        table,
                        role: "payload",
                        column: payload.name,
                        type_oid: other,
                        expected: "json, jsonb, text, varchar or bytea",
                    });
                }
            };
            (
                Some(required(
                    "aggregate id (key)",
                    &c.aggregate_id,
                    "aggregate_id",
                )?),
                Some(required("event type", &c.event_type, "event_type")?),
                Some((payload, kind)),
            )
        } else {
            (
                optional("aggregate id (key)", &c.aggregate_id, "aggregate_id")?,
                optional("event type", &c.event_type, "event_type")?,
                None,
            )
        };
        let headers = optional("headers", &c.headers, "headers")?;
        if let Some(h) = &headers
            && !matches!(type_of(h), JSON | JSONB)
        {
            return Err(MappingError::WrongType {
                table,
                role: "headers",
                column: h.name.clone(),
                type_oid: type_of(h),
                expected: "json or jsonb",
            });
        }
        let aggregate_type = optional("aggregate type", &c.aggregate_type, "aggregate_type")?;
        let occurred_at = optional("occurrence time", &c.occurred_at, "occurred_at")?;
        let schema_version = optional("schema version", &c.schema_version, "schema_version")?;
        let value_column = match &config.value {
            ValueFormat::Envelope => None,
            ValueFormat::Column(name) => Some(required("value", &Some(name.clone()), name)?),
        };

        let topic = if let Some(col) = &config.topic_column {
            TopicSource::Column(required("topic", &Some(col.clone()), col)?)
        } else {
            let template =
                TopicTemplate::parse(&config.topic).map_err(|source| MappingError::Template {
                    table: table.clone(),
                    source,
                })?;
            if template.is_fixed() {
                validate_topic(&config.topic).map_err(|reason| MappingError::InvalidTopic {
                    table: table.clone(),
                    topic: config.topic.clone(),
                    reason,
                })?;
                TopicSource::Fixed(config.topic.clone())
            } else {
                let mut cols = Vec::new();
                for field in template.fields() {
                    // A placeholder names a role (using its configured column) or a column.
                    let configured = match field {
                        "id" | "event_id" => c.id.clone(),
                        "aggregate_type" => c.aggregate_type.clone(),
                        "aggregate_id" => c.aggregate_id.clone(),
                        "event_type" => c.event_type.clone(),
                        _ => None,
                    };
                    let default = if field == "event_id" { "id" } else { field };
                    cols.push(required("topic template field", &configured, default)?);
                }
                TopicSource::Template(template, cols)
            }
        };

        Ok(Mapper {
            table,
            columns: relation.columns.len(),
            producer_json: serde_json::Value::from(producer).to_string(),
            id,
            key,
            aggregate_type,
            event_type,
            payload,
            headers,
            occurred_at,
            schema_version,
            topic,
            value_column,
            column_names: relation.columns.iter().map(|c| c.name.clone()).collect(),
        })
    }
}
