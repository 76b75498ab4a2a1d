//! [`Mapper::compile`]: a [`TableConfig`] resolved against a table's shape from
//! a Relation message: which column plays which role, the payload's kind, where
//! the topic comes from.

use walbox_pgoutput::{Oid, Relation};

use super::{Col, Mapper, MappingError, PayloadKind, TopicSource};
use crate::config::{Format, KeyEncoding, Place, TableConfig, ValueFormat};
use crate::format::{ExtraKind, FieldNames, Formatter, settings_problem};
use crate::template::{TopicTemplate, validate_topic};

pub(super) const BOOL: Oid = 16;
pub(super) const BYTEA: Oid = 17;
pub(super) const INT8: Oid = 20;
pub(super) const INT2: Oid = 21;
pub(super) const INT4: Oid = 23;
pub(super) const OID: Oid = 26;
pub(super) const FLOAT4: Oid = 700;
pub(super) const FLOAT8: Oid = 701;
pub(super) const TEXT: Oid = 25;
pub(super) const JSON: Oid = 114;
pub(super) const BPCHAR: Oid = 1042;
pub(super) const VARCHAR: Oid = 1043;
pub(super) const UUID: Oid = 2950;
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
        let missing = |role: &'static str, name: &str| MappingError::MissingColumn {
            table: table.clone(),
            role,
            column: name.to_owned(),
            available: available(),
        };
        // A role's column: the configured name, which must exist, else the first
        // of the format's default names that the table has.
        let resolve = |role: &'static str,
                       configured: &Option<String>,
                       defaults: &[&str]|
         -> Result<Option<Col>, MappingError> {
            if let Some(name) = configured {
                return find(name)
                    .map(|index| {
                        Some(Col {
                            index,
                            name: name.clone(),
                        })
                    })
                    .ok_or_else(|| missing(role, name));
            }
            Ok(defaults.iter().find_map(|name| {
                find(name).map(|index| Col {
                    index,
                    name: (*name).to_owned(),
                })
            }))
        };
        let required = |role: &'static str, configured: &Option<String>, defaults: &[&str]| {
            resolve(role, configured, defaults)?.ok_or_else(|| {
                missing(
                    role,
                    configured
                        .as_deref()
                        .or(defaults.first().copied())
                        .unwrap_or_default(),
                )
            })
        };
        let optional = resolve;
        let type_of = |c: &Col| relation.columns.get(c.index).map_or(0, |c| c.type_oid);
        let c = &config.columns;
        let format = config.formatting.format;
        let names = RoleDefaults::of(format);
        let format_problem = |problem: String| MappingError::Format {
            table: table.clone(),
            format: format.name(),
            problem,
        };

        if let Some(p) = settings_problem(&config.formatting) {
            return Err(format_problem(p));
        }
        let id = required("event id", &c.id, &["id"])?;
        let value_column = match &config.value {
            ValueFormat::Envelope => None,
            ValueFormat::Column(_) if format != Format::Walbox => {
                return Err(format_problem(
                    "value = { column = ... } takes the value as it is, which only format \"walbox\" \
                     does; remove value or set format = \"walbox\""
                        .into(),
                ));
            }
            ValueFormat::Column(name) => Some(required("value", &Some(name.clone()), &[])?),
        };
        let (key, event_type, payload) = if value_column.is_none() {
            let payload = required("payload", &c.payload, &["payload"])?;
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
            let event_type = match format {
                Format::DebeziumOutbox => optional("event type", &c.event_type, names.event_type)?,
                Format::Walbox => Some(required("event type", &c.event_type, names.event_type)?),
                Format::CloudEvents => Some(
                    optional("event type", &c.event_type, names.event_type)?.ok_or_else(|| {
                        format_problem(format!(
                            "the CloudEvents type needs an event type column: the table has no \
                             column {:?}; name yours with columns.event_type",
                            names.event_type.first().copied().unwrap_or_default()
                        ))
                    })?,
                ),
            };
            (
                Some(required(
                    "aggregate id (key)",
                    &c.aggregate_id,
                    names.aggregate_id,
                )?),
                event_type,
                Some((payload, kind)),
            )
        } else {
            (
                optional("aggregate id (key)", &c.aggregate_id, names.aggregate_id)?,
                optional("event type", &c.event_type, names.event_type)?,
                None,
            )
        };
        // What the key's column holds, for key_encoding = "json": Debezium maps
        // integer columns to JSON numbers and text-like ones to JSON strings;
        // other types (numeric, timestamps) it writes in forms walbox does not.
        let key_kind = match key.as_ref().map(type_of) {
            Some(INT2 | INT4 | INT8) => ExtraKind::Number,
            Some(TEXT | VARCHAR | BPCHAR | UUID) | None => ExtraKind::Text,
            Some(other) if config.formatting.key_encoding == KeyEncoding::Json => {
                return Err(MappingError::WrongType {
                    table,
                    role: "aggregate id (key) with key_encoding = \"json\"",
                    column: key.map(|k| k.name).unwrap_or_default(),
                    type_oid: other,
                    expected: "text, varchar, char, uuid, smallint, integer or bigint",
                });
            }
            Some(_) => ExtraKind::Text,
        };
        let headers = optional("headers", &c.headers, &["headers"])?;
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
        let aggregate_type = optional("aggregate type", &c.aggregate_type, names.aggregate_type)?;
        let occurred_at = optional("occurrence time", &c.occurred_at, &["occurred_at"])?;
        let schema_version = optional("schema version", &c.schema_version, &["schema_version"])?;
        let mut placements = Vec::with_capacity(config.formatting.additional_placement.len());
        for p in &config.formatting.additional_placement {
            let col = required("additional placement", &Some(p.column.clone()), &[])?;
            let kind = match type_of(&col) {
                INT2 | INT4 | INT8 | FLOAT4 | FLOAT8 | OID => ExtraKind::Number,
                BOOL => ExtraKind::Bool,
                _ => ExtraKind::Text,
            };
            placements.push((col, kind));
        }
        if let Some((p, BYTEA)) = payload.as_ref().map(|(p, _)| (p, type_of(p)))
            && config
                .formatting
                .additional_placement
                .iter()
                .any(|p| p.place == Place::Envelope)
        {
            return Err(format_problem(format!(
                "payload column {:?} is bytea, which cannot sit in a JSON envelope; place the \
                 additional columns as headers (column:header) or make the payload json or jsonb",
                p.name
            )));
        }

        let topic = if let Some(col) = &config.topic_column {
            TopicSource::Column(required("topic", &Some(col.clone()), &[])?)
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
                    // A placeholder names a role (using its configured column, or
                    // the format's default names) or a column.
                    let col = match field {
                        "id" | "event_id" => Some(id.clone()),
                        "aggregate_type" => required(
                            "topic template field",
                            &c.aggregate_type,
                            names.aggregate_type,
                        )
                        .ok(),
                        "aggregate_id" => {
                            required("topic template field", &c.aggregate_id, names.aggregate_id)
                                .ok()
                        }
                        "event_type" => {
                            required("topic template field", &c.event_type, names.event_type).ok()
                        }
                        _ => None,
                    };
                    let col = match col {
                        Some(col) => col,
                        None => required("topic template field", &None, &[field])?,
                    };
                    cols.push(col);
                }
                TopicSource::Template(template, cols)
            }
        };

        let formatter = Formatter::new(
            &config.formatting,
            &table,
            producer,
            FieldNames {
                id: id.name.clone(),
                aggregate_id: key.as_ref().map_or("aggregate_id", |k| &k.name).to_owned(),
                aggregate_type: aggregate_type
                    .as_ref()
                    .map_or(
                        names.aggregate_type.first().copied().unwrap_or_default(),
                        |c| &c.name,
                    )
                    .to_owned(),
                event_type: event_type
                    .as_ref()
                    .map_or(names.event_type.first().copied().unwrap_or_default(), |c| {
                        &c.name
                    })
                    .to_owned(),
                payload: payload
                    .as_ref()
                    .map_or("payload", |(c, _)| &c.name)
                    .to_owned(),
                occurred_at: occurred_at
                    .as_ref()
                    .map_or("occurred_at", |c| &c.name)
                    .to_owned(),
            },
        )?;

        Ok(Mapper {
            table,
            columns: relation.columns.len(),
            formatter,
            placements,
            key_nullable: format == Format::DebeziumOutbox,
            id,
            key,
            key_kind,
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

/// A format's default column names per role, in order of preference.
struct RoleDefaults {
    aggregate_type: &'static [&'static str],
    aggregate_id: &'static [&'static str],
    event_type: &'static [&'static str],
}

impl RoleDefaults {
    fn of(format: Format) -> Self {
        RoleDefaults {
            aggregate_type: format.default_columns("aggregate_type"),
            aggregate_id: format.default_columns("aggregate_id"),
            event_type: format.default_columns("event_type"),
        }
    }
}
