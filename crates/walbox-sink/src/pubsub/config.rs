//! The settings of the Google Cloud Pub/Sub sink (`[sink.pubsub]`) and their
//! checks.

use std::time::Duration;

use serde::Deserialize;

use crate::SinkError;

/// Pub/Sub's own endpoint (global; a regional one, e.g.
/// `https://europe-west1-pubsub.googleapis.com`, keeps a key's messages in
/// one region, which Pub/Sub's ordering asks for).
pub const DEFAULT_ENDPOINT: &str = "https://pubsub.googleapis.com";

/// The environment variable Google's client libraries read the emulator's
/// `host:port` from.
pub const EMULATOR_HOST_ENV: &str = "PUBSUB_EMULATOR_HOST";

/// The most messages one Publish request may hold (Pub/Sub's limit).
pub const MAX_BATCH_MESSAGES: usize = 1000;

/// Settings of the Pub/Sub sink (`[sink.pubsub]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PubSubSinkConfig {
    /// The Google Cloud project the topics are in. Default: the
    /// `GOOGLE_CLOUD_PROJECT` environment variable.
    #[serde(default)]
    pub project: String,
    /// The REST endpoint. Default: Pub/Sub's global endpoint.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// The emulator's `host:port` (plain HTTP, no credentials). Default: the
    /// `PUBSUB_EMULATOR_HOST` environment variable; it wins over `endpoint`.
    #[serde(default)]
    pub emulator_host: Option<String>,
    /// The subscription that keeps a dead-letter topic's letters for
    /// `walbox dlq replay` (`{topic}` is the dead-letter topic). walbox
    /// creates it with the topic (`create_topics`), else checks it exists:
    /// letters published to a topic without a subscription would be lost.
    #[serde(default = "default_letters_subscription")]
    pub letters_subscription: String,
    /// How long the letters subscription keeps a letter nobody acknowledged,
    /// in days (Pub/Sub allows 10 minutes to 31 days).
    #[serde(default = "default_letters_retention_days")]
    pub letters_retention_days: u32,
    /// The subscription `walbox verify` reads a topic back from (`{topic}`
    /// is the topic): one made before the events were published, with
    /// message ordering, for audits only (verify acknowledges what it reads).
    #[serde(default)]
    pub verify_subscription: Option<String>,
    /// Most messages in one Publish request (at most 1000).
    #[serde(default = "default_max_batch_messages")]
    pub max_batch_messages: usize,
    /// Most bytes (data, attributes, ordering key) in one Publish request.
    #[serde(default = "default_max_batch_bytes")]
    pub max_batch_bytes: usize,
    /// Most Publish requests open at once (each holds one ordering key's
    /// messages).
    #[serde(default = "default_max_requests")]
    pub max_requests: usize,
    /// How long one request may take, response included, in ms.
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// The first retry's delay, in ms; it doubles per attempt, with jitter.
    #[serde(default = "default_retry_initial_ms")]
    pub retry_initial_ms: u64,
    /// The longest delay between attempts, in ms.
    #[serde(default = "default_retry_max_ms")]
    pub retry_max_ms: u64,
    /// How long a failed publish is tried again, its key paused meanwhile,
    /// before the session fails (and the relay sends again from its
    /// confirmed position), in seconds.
    #[serde(default = "default_max_retry_duration_s")]
    pub max_retry_duration_s: u64,
    /// Create missing topics (and the letters subscriptions); set from
    /// `sink.create_topics`.
    #[serde(skip)]
    pub create_topics: bool,
    /// Most events in flight (the relay's bound); set from `sink.max_in_flight`.
    #[serde(skip, default = "default_max_in_flight")]
    pub max_in_flight: usize,
}

fn default_letters_subscription() -> String {
    "{topic}.walbox-letters".into()
}
fn default_letters_retention_days() -> u32 {
    7
}
fn default_max_batch_messages() -> usize {
    MAX_BATCH_MESSAGES
}
fn default_max_batch_bytes() -> usize {
    // Below Pub/Sub's 10 MB per request, with room for JSON and base64.
    5 * 1024 * 1024
}
fn default_max_requests() -> usize {
    64
}
fn default_request_timeout_ms() -> u64 {
    60_000
}
fn default_retry_initial_ms() -> u64 {
    100
}
fn default_retry_max_ms() -> u64 {
    10_000
}
fn default_max_retry_duration_s() -> u64 {
    120
}
fn default_max_in_flight() -> usize {
    10_000
}

impl Default for PubSubSinkConfig {
    fn default() -> Self {
        PubSubSinkConfig {
            project: String::new(),
            endpoint: None,
            emulator_host: None,
            letters_subscription: default_letters_subscription(),
            letters_retention_days: default_letters_retention_days(),
            verify_subscription: None,
            max_batch_messages: default_max_batch_messages(),
            max_batch_bytes: default_max_batch_bytes(),
            max_requests: default_max_requests(),
            request_timeout_ms: default_request_timeout_ms(),
            retry_initial_ms: default_retry_initial_ms(),
            retry_max_ms: default_retry_max_ms(),
            max_retry_duration_s: default_max_retry_duration_s(),
            create_topics: false,
            max_in_flight: default_max_in_flight(),
        }
    }
}

impl PubSubSinkConfig {
    /// Checks the settings.
    pub fn validate(&self) -> Result<(), SinkError> {
        let bad = |m: String| Err(SinkError::Config(format!("sink.pubsub.{m}")));
        if self.project.is_empty() {
            return bad(
                "project: name the Google Cloud project (or set GOOGLE_CLOUD_PROJECT)".into(),
            );
        }
        if !self
            .project
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b':' | b'.'))
        {
            return bad(format!("project: {:?} is not a project id", self.project));
        }
        if let Some(e) = &self.endpoint
            && !(e.starts_with("https://") || e.starts_with("http://"))
        {
            return bad(format!("endpoint: {e:?} is not an http:// or https:// URL"));
        }
        if let Some(h) = &self.emulator_host
            && (h.is_empty() || h.contains('/'))
        {
            return bad(format!("emulator_host: {h:?} is not host:port"));
        }
        if !self.letters_subscription.contains("{topic}") {
            return bad(
                "letters_subscription: must hold {topic}, one subscription per dead-letter topic"
                    .into(),
            );
        }
        if let Some(v) = &self.verify_subscription
            && !v.contains("{topic}")
        {
            return bad("verify_subscription: must hold {topic}".into());
        }
        if !(1..=31).contains(&self.letters_retention_days) {
            return bad("letters_retention_days: must be 1 to 31".into());
        }
        if !(1..=MAX_BATCH_MESSAGES).contains(&self.max_batch_messages) {
            return bad(format!(
                "max_batch_messages: must be 1 to {MAX_BATCH_MESSAGES}"
            ));
        }
        if !(1024..=9 * 1024 * 1024).contains(&self.max_batch_bytes) {
            return bad("max_batch_bytes: must be 1 KiB to 9 MiB".into());
        }
        if self.max_requests == 0 {
            return bad("max_requests: must be at least 1".into());
        }
        if self.request_timeout_ms == 0 {
            return bad("request_timeout_ms: must be at least 1".into());
        }
        if self.retry_initial_ms == 0 || self.retry_max_ms < self.retry_initial_ms {
            return bad("retry_initial_ms: must be at least 1 and at most retry_max_ms".into());
        }
        Ok(())
    }

    /// The base URL of the project's resources (`.../v1/projects/P`), and
    /// whether requests go without credentials (the emulator).
    pub(crate) fn base(&self) -> (String, bool) {
        match &self.emulator_host {
            Some(host) => (format!("http://{host}/v1/projects/{}", self.project), true),
            None => (
                format!(
                    "{}/v1/projects/{}",
                    self.endpoint
                        .as_deref()
                        .unwrap_or(DEFAULT_ENDPOINT)
                        .trim_end_matches('/'),
                    self.project
                ),
                false,
            ),
        }
    }

    /// The letters subscription of dead-letter topic `topic`.
    #[must_use]
    pub fn letters_subscription_of(&self, topic: &str) -> String {
        self.letters_subscription.replace("{topic}", topic)
    }

    /// The verify subscription of `topic`, when one is set.
    #[must_use]
    pub fn verify_subscription_of(&self, topic: &str) -> Option<String> {
        self.verify_subscription
            .as_ref()
            .map(|v| v.replace("{topic}", topic))
    }

    pub(crate) fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_and_the_emulator_wins_over_the_endpoint() {
        let mut c = PubSubSinkConfig::default();
        assert!(c.validate().unwrap_err().to_string().contains("project"));
        c.project = "my-project".into();
        c.validate().unwrap();
        assert_eq!(
            c.base(),
            (
                "https://pubsub.googleapis.com/v1/projects/my-project".into(),
                false
            )
        );
        c.endpoint = Some("https://europe-west1-pubsub.googleapis.com/".into());
        assert_eq!(
            c.base().0,
            "https://europe-west1-pubsub.googleapis.com/v1/projects/my-project"
        );
        c.emulator_host = Some("127.0.0.1:8085".into());
        assert_eq!(
            c.base(),
            ("http://127.0.0.1:8085/v1/projects/my-project".into(), true)
        );
        assert_eq!(c.letters_subscription_of("o.dlq"), "o.dlq.walbox-letters");
        c.max_batch_messages = 1001;
        assert!(c.validate().is_err());
        c.max_batch_messages = 10;
        c.letters_subscription = "fixed".into();
        assert!(c.validate().is_err());
        let parsed: PubSubSinkConfig =
            toml::from_str("project = \"p\"\nmax_requests = 3\n").unwrap();
        assert_eq!(parsed.max_requests, 3);
        assert!(toml::from_str::<PubSubSinkConfig>("projekt = \"p\"\n").is_err());
    }
}
