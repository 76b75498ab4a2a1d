//! Pub/Sub's REST API (v1), through reqwest: publish, topics and
//! subscriptions, pull and acknowledge. Requests carry an OAuth token from
//! Application Default Credentials (`gcp_auth`), or none for the emulator.
//! Neither the token nor a message's content is ever logged; an error keeps
//! Pub/Sub's status and a short excerpt of its message.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};

use super::PubSubSinkConfig;
use crate::SinkError;

/// The OAuth scope of Pub/Sub.
const SCOPE: &str = "https://www.googleapis.com/auth/pubsub";

/// The most bytes of a server's error message kept.
const EXCERPT: usize = 300;

/// A failed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ApiError {
    /// The server answered with an error status.
    Status {
        /// The HTTP status.
        http: u16,
        /// Pub/Sub's status name (`INVALID_ARGUMENT`, `NOT_FOUND`, ...).
        status: String,
        /// An excerpt of its message.
        message: String,
    },
    /// No answer: the connection failed or timed out, or the answer was not
    /// Pub/Sub's.
    Transport(String),
    /// No token could be had.
    Credentials(String),
}

impl ApiError {
    pub(crate) fn http(&self) -> Option<u16> {
        match self {
            ApiError::Status { http, .. } => Some(*http),
            _ => None,
        }
    }

    /// Whether trying again may succeed: no answer, a token not had this
    /// time, or 408, 409 `ABORTED`, 429, 5xx.
    pub(crate) fn transient(&self) -> bool {
        match self {
            ApiError::Transport(_) | ApiError::Credentials(_) => true,
            ApiError::Status { http, status, .. } => {
                matches!(*http, 408 | 429 | 500..=599) || status == "ABORTED"
            }
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiError::Status {
                http,
                status,
                message,
            } => write!(f, "Pub/Sub answered {http} {status}: {message}"),
            ApiError::Transport(e) => write!(f, "no answer from Pub/Sub: {e}"),
            ApiError::Credentials(e) => write!(f, "no access token: {e}"),
        }
    }
}

/// A message pulled from a subscription.
#[derive(Debug, Clone)]
pub(crate) struct Received {
    pub ack_id: String,
    pub message_id: String,
    pub data: Vec<u8>,
    pub attributes: Vec<(String, String)>,
    pub ordering_key: Option<String>,
}

/// A client of one project.
#[derive(Clone)]
pub(crate) struct Client {
    http: reqwest::Client,
    base: String,
    auth: Option<Arc<dyn gcp_auth::TokenProvider>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base)
            .field("credentials", &self.auth.is_some())
            .finish()
    }
}

impl Client {
    /// A client for `config`'s project: Application Default Credentials are
    /// looked up here (not for the emulator).
    pub(crate) async fn connect(config: &PubSubSinkConfig) -> Result<Client, SinkError> {
        let (base, emulator) = config.base();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(config.request_timeout())
            .pool_idle_timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| SinkError::PubSub(format!("building the HTTP client: {e}")))?;
        let auth = if emulator {
            None
        } else {
            Some(
                gcp_auth::provider()
                    .await
                    .map_err(|e| SinkError::PubSubAuthentication(e.to_string()))?,
            )
        };
        Ok(Client { http, base, auth })
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<String>,
    ) -> Result<Value, ApiError> {
        let mut request = self
            .http
            .request(method, format!("{}/{path}", self.base))
            .header(reqwest::header::CONTENT_TYPE, "application/json");
        if let Some(auth) = &self.auth {
            let token = auth
                .token(&[SCOPE])
                .await
                .map_err(|e| ApiError::Credentials(e.to_string()))?;
            // Marked sensitive by reqwest: never in its logs.
            request = request.bearer_auth(token.as_str());
        }
        if let Some(body) = body {
            request = request.body(body);
        }
        let response = request
            .send()
            .await
            .map_err(|e| ApiError::Transport(without_url(&e)))?;
        let http = response.status().as_u16();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| ApiError::Transport(without_url(&e)))?;
        let value: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).map_err(|_| {
                if (200..300).contains(&http) {
                    ApiError::Transport(format!("an answer that is not JSON (status {http})"))
                } else {
                    ApiError::Status {
                        http,
                        status: String::new(),
                        message: excerpt(&String::from_utf8_lossy(&bytes)),
                    }
                }
            })?
        };
        if (200..300).contains(&http) {
            return Ok(value);
        }
        let error = &value["error"];
        Err(ApiError::Status {
            http,
            status: error["status"].as_str().unwrap_or_default().to_owned(),
            message: excerpt(error["message"].as_str().unwrap_or_default()),
        })
    }

    /// Publishes `body` (`{"messages": [...]}`) to `topic`; the server's
    /// message ids, one per message.
    pub(crate) async fn publish(&self, topic: &str, body: String) -> Result<Vec<String>, ApiError> {
        let v = self
            .call(
                reqwest::Method::POST,
                &format!("topics/{topic}:publish"),
                Some(body),
            )
            .await?;
        Ok(v["messageIds"]
            .as_array()
            .map(|ids| {
                ids.iter()
                    .filter_map(|i| i.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Whether `topic` exists.
    pub(crate) async fn topic_exists(&self, topic: &str) -> Result<bool, ApiError> {
        self.exists(&format!("topics/{topic}")).await
    }

    /// Whether `subscription` exists.
    pub(crate) async fn subscription_exists(&self, subscription: &str) -> Result<bool, ApiError> {
        self.exists(&format!("subscriptions/{subscription}")).await
    }

    async fn exists(&self, path: &str) -> Result<bool, ApiError> {
        match self.call(reqwest::Method::GET, path, None).await {
            Ok(_) => Ok(true),
            Err(e) if e.http() == Some(404) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Creates `topic`; one that exists already is fine.
    pub(crate) async fn create_topic(&self, topic: &str) -> Result<(), ApiError> {
        match self
            .call(
                reqwest::Method::PUT,
                &format!("topics/{topic}"),
                Some("{}".into()),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.http() == Some(409) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Creates `subscription` to `topic` that never expires; with message
    /// ordering when `ordered`, keeping unacknowledged messages for
    /// `retention_days` (default 7). One that exists already is fine.
    pub(crate) async fn create_subscription(
        &self,
        subscription: &str,
        topic: &str,
        ordered: bool,
        retention_days: Option<u32>,
    ) -> Result<(), ApiError> {
        let mut body = json!({
            "topic": format!("{}/topics/{topic}", self.project_path()),
            "ackDeadlineSeconds": 600,
            "enableMessageOrdering": ordered,
            // No expiration: an idle subscription would otherwise be
            // deleted after 31 days, with what it holds.
            "expirationPolicy": {},
        });
        if let Some(days) = retention_days {
            body["messageRetentionDuration"] = json!(format!("{}s", u64::from(days) * 86_400));
        }
        match self
            .call(
                reqwest::Method::PUT,
                &format!("subscriptions/{subscription}"),
                Some(body.to_string()),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.http() == Some(409) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `projects/P`, the name resources are under.
    fn project_path(&self) -> &str {
        self.base
            .find("/v1/")
            .map_or(self.base.as_str(), |i| &self.base[i + 4..])
    }

    /// Up to `max` messages of `subscription`, without waiting for more.
    pub(crate) async fn pull(
        &self,
        subscription: &str,
        max: usize,
    ) -> Result<Vec<Received>, ApiError> {
        let v = self
            .call(
                reqwest::Method::POST,
                &format!("subscriptions/{subscription}:pull"),
                Some(json!({"maxMessages": max, "returnImmediately": true}).to_string()),
            )
            .await?;
        let Some(list) = v["receivedMessages"].as_array() else {
            return Ok(Vec::new());
        };
        let b64 = base64::engine::general_purpose::STANDARD;
        Ok(list
            .iter()
            .map(|r| {
                let m = &r["message"];
                Received {
                    ack_id: r["ackId"].as_str().unwrap_or_default().to_owned(),
                    message_id: m["messageId"].as_str().unwrap_or_default().to_owned(),
                    data: m["data"]
                        .as_str()
                        .and_then(|d| b64.decode(d).ok())
                        .unwrap_or_default(),
                    attributes: m["attributes"]
                        .as_object()
                        .map(|a| {
                            a.iter()
                                .map(|(k, v)| {
                                    (k.clone(), v.as_str().unwrap_or_default().to_owned())
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                    ordering_key: m["orderingKey"]
                        .as_str()
                        .filter(|k| !k.is_empty())
                        .map(str::to_owned),
                }
            })
            .collect())
    }

    /// Acknowledges `ack_ids` of `subscription`.
    pub(crate) async fn acknowledge(
        &self,
        subscription: &str,
        ack_ids: &[String],
    ) -> Result<(), ApiError> {
        for chunk in ack_ids.chunks(1000) {
            self.call(
                reqwest::Method::POST,
                &format!("subscriptions/{subscription}:acknowledge"),
                Some(json!({ "ackIds": chunk }).to_string()),
            )
            .await?;
        }
        Ok(())
    }

    /// Hands `ack_ids` back to `subscription` at once (deadline 0).
    pub(crate) async fn hand_back(
        &self,
        subscription: &str,
        ack_ids: &[String],
    ) -> Result<(), ApiError> {
        for chunk in ack_ids.chunks(1000) {
            self.call(
                reqwest::Method::POST,
                &format!("subscriptions/{subscription}:modifyAckDeadline"),
                Some(json!({ "ackIds": chunk, "ackDeadlineSeconds": 0 }).to_string()),
            )
            .await?;
        }
        Ok(())
    }
}

/// reqwest's error without the URL (which holds nothing secret, but is long).
fn without_url(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    let mut text = kind.to_owned();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    excerpt(&text)
}

fn excerpt(text: &str) -> String {
    if text.len() <= EXCERPT {
        return text.to_owned();
    }
    let mut end = EXCERPT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}
