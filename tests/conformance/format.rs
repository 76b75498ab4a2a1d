//! The envelope formats of the suite: the lines that choose each in an
//! `[[outbox]]` or `[[messages]]` table, and where its records carry what
//! the writers put in the payload.

/// An envelope format (CloudEvents in each content mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Walbox,
    Debezium,
    CloudEventsBinary,
    CloudEventsStructured,
}

impl Format {
    pub const ALL: [Format; 4] = [
        Format::Walbox,
        Format::Debezium,
        Format::CloudEventsBinary,
        Format::CloudEventsStructured,
    ];

    /// The configuration lines of a table or message prefix in this format.
    pub fn lines(self) -> &'static str {
        match self {
            Format::Walbox => "format = \"walbox\"\n",
            Format::Debezium => "format = \"debezium-outbox\"\n",
            Format::CloudEventsBinary => {
                "format = \"cloudevents\"\ncloudevents_mode = \"binary\"\n"
            }
            Format::CloudEventsStructured => {
                "format = \"cloudevents\"\ncloudevents_mode = \"structured\"\n"
            }
        }
    }

    /// A short name for cell names.
    pub fn short(self) -> &'static str {
        match self {
            Format::Walbox => "walbox",
            Format::Debezium => "debezium",
            Format::CloudEventsBinary => "cebinary",
            Format::CloudEventsStructured => "cestructured",
        }
    }

    /// The payload the writer wrote (`{"seq": n, ...}`), where this format
    /// puts it in a record's value.
    pub fn payload(self, value: &serde_json::Value) -> &serde_json::Value {
        match self {
            Format::Walbox => &value["payload"],
            // Debezium's outbox router and a binary CloudEvent carry the
            // payload alone as the value.
            Format::Debezium | Format::CloudEventsBinary => value,
            Format::CloudEventsStructured => &value["data"],
        }
    }

    /// The per-key sequence number the writer wrote.
    pub fn seq(self, value: &serde_json::Value) -> Option<i64> {
        self.payload(value)["seq"].as_i64()
    }

    /// The format a history that runs one format only uses for `sink`, so that
    /// every format is seen by some sink's histories in the short profile.
    pub fn rotated(index: usize) -> Format {
        Format::ALL[index % Format::ALL.len()]
    }
}
