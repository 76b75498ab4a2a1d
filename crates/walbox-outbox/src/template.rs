//! Topic name templates such as `outbox.{aggregate_type}`.

/// A parsed topic template: literal text and `{field}` placeholders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicTemplate {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Field(String),
}

/// Why a template does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// A `{` without its `}`.
    #[error("topic template {0:?}: unclosed '{{'")]
    Unclosed(String),
    /// `{}` with no field name.
    #[error("topic template {0:?}: empty '{{}}'")]
    EmptyField(String),
    /// A `}` without a `{`.
    #[error("topic template {0:?}: '}}' without '{{'")]
    StrayClose(String),
    /// The template is empty.
    #[error("topic template is empty")]
    Empty,
}

impl TopicTemplate {
    /// Parses `template`.
    pub fn parse(template: &str) -> Result<Self, TemplateError> {
        if template.is_empty() {
            return Err(TemplateError::Empty);
        }
        let mut parts = Vec::new();
        let mut rest = template;
        while !rest.is_empty() {
            match (rest.find('{'), rest.find('}')) {
                (_, Some(close)) if rest.find('{').is_none_or(|open| close < open) => {
                    return Err(TemplateError::StrayClose(template.to_owned()));
                }
                (Some(open), _) => {
                    if open > 0 {
                        parts.push(Part::Literal(rest[..open].to_owned()));
                    }
                    let after = &rest[open + 1..];
                    let close = after
                        .find('}')
                        .ok_or_else(|| TemplateError::Unclosed(template.to_owned()))?;
                    let name = after[..close].trim();
                    if name.is_empty() {
                        return Err(TemplateError::EmptyField(template.to_owned()));
                    }
                    parts.push(Part::Field(name.to_owned()));
                    rest = &after[close + 1..];
                }
                (None, _) => {
                    parts.push(Part::Literal(rest.to_owned()));
                    rest = "";
                }
            }
        }
        Ok(TopicTemplate { parts })
    }

    /// The placeholder names, in order.
    pub fn fields(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Field(f) => Some(f.as_str()),
            Part::Literal(_) => None,
        })
    }

    /// Whether the template has no placeholders (a fixed topic).
    #[must_use]
    pub fn is_fixed(&self) -> bool {
        self.fields().next().is_none()
    }

    /// Renders the template, taking each field's value from `value`.
    pub fn render<'a, E>(
        &self,
        mut value: impl FnMut(usize, &str) -> Result<&'a str, E>,
    ) -> Result<String, E> {
        let mut out = String::new();
        let mut field = 0;
        for p in &self.parts {
            match p {
                Part::Literal(l) => out.push_str(l),
                Part::Field(f) => {
                    out.push_str(value(field, f)?);
                    field += 1;
                }
            }
        }
        Ok(out)
    }
}

impl TopicTemplate {
    /// The dead-letter topic for events meant for `topic`, this being the
    /// dead-letter template (`{topic}` its only field); `walbox.dlq` when the
    /// result is not a valid topic name.
    #[must_use]
    pub fn dead_letter_topic(&self, topic: &str) -> String {
        let rendered = self
            .render(|_, _| Ok::<_, std::convert::Infallible>(topic))
            .unwrap_or_else(|never| match never {});
        if validate_topic(&rendered).is_ok() {
            rendered
        } else {
            "walbox.dlq".to_owned()
        }
    }
}

impl TopicTemplate {
    /// The dead-letter topic of rows of `table` (`schema.table`) that cannot name
    /// their topic (the field or column is NULL, or the name is not valid), this
    /// being the dead-letter template: the template applied to
    /// `walbox.<schema>.<table>` (characters a topic name cannot hold become `_`).
    #[must_use]
    pub fn fallback_dead_letter_topic(&self, table: &str) -> String {
        let safe: String = table
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        self.dead_letter_topic(&format!("walbox.{safe}"))
    }
}

/// Checks a Kafka topic name: 1 to 249 characters of `[a-zA-Z0-9._-]`, not `.` or
/// `..`. Returns the reason when it is not valid.
pub fn validate_topic(topic: &str) -> Result<(), &'static str> {
    if topic.is_empty() {
        return Err("topic name is empty");
    }
    if topic.len() > 249 {
        return Err("topic name is longer than 249 characters");
    }
    if topic == "." || topic == ".." {
        return Err("topic name cannot be '.' or '..'");
    }
    if !topic
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
    {
        return Err("topic name may only contain ASCII letters, digits, '.', '_' and '-'");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(t: &TopicTemplate, values: &[&'static str]) -> String {
        t.render(|i, _| Ok::<_, ()>(values[i])).unwrap()
    }

    #[test]
    fn parses_and_renders() {
        let t = TopicTemplate::parse("outbox.{aggregate_type}").unwrap();
        assert_eq!(t.fields().collect::<Vec<_>>(), vec!["aggregate_type"]);
        assert_eq!(render(&t, &["order"]), "outbox.order");
        let t = TopicTemplate::parse("{tenant}-{ aggregate_type }.events").unwrap();
        assert_eq!(
            t.fields().collect::<Vec<_>>(),
            vec!["tenant", "aggregate_type"]
        );
        assert_eq!(render(&t, &["acme", "order"]), "acme-order.events");
        let t = TopicTemplate::parse("orders").unwrap();
        assert!(t.is_fixed());
        assert_eq!(render(&t, &[]), "orders");
    }

    #[test]
    fn rejects_malformed_templates() {
        assert_eq!(TopicTemplate::parse(""), Err(TemplateError::Empty));
        assert!(matches!(
            TopicTemplate::parse("a.{b"),
            Err(TemplateError::Unclosed(_))
        ));
        assert!(matches!(
            TopicTemplate::parse("a.{}"),
            Err(TemplateError::EmptyField(_))
        ));
        assert!(matches!(
            TopicTemplate::parse("a}.b"),
            Err(TemplateError::StrayClose(_))
        ));
    }

    #[test]
    fn rows_without_a_topic_go_to_the_tables_fallback_dead_letter_topic() {
        let dlq = TopicTemplate::parse("{topic}.dlq").unwrap();
        assert_eq!(
            dlq.fallback_dead_letter_topic("public.outbox"),
            "walbox.public.outbox.dlq"
        );
        assert_eq!(
            dlq.fallback_dead_letter_topic("sales.Out Box"),
            "walbox.sales.Out_Box.dlq"
        );
    }

    #[test]
    fn validates_topic_names() {
        assert!(validate_topic("outbox.order-events_v2").is_ok());
        assert!(validate_topic("").is_err());
        assert!(validate_topic("..").is_err());
        assert!(validate_topic("has space").is_err());
        assert!(validate_topic("ünicode").is_err());
        assert!(validate_topic(&"a".repeat(250)).is_err());
        assert!(validate_topic(&"a".repeat(249)).is_ok());
    }
}
