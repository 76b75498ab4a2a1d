//! The stream walbox publishes to: checked (its duplicate window) or created
//! at the start of a session.

use async_nats::jetstream;

use super::{NatsSinkConfig, NatsStorage};
use crate::SinkError;

/// Checks the configured stream, or creates it.
pub(super) async fn ensure_stream(
    js: &jetstream::Context,
    config: &NatsSinkConfig,
) -> Result<(), SinkError> {
    match js.get_stream(&config.stream).await {
        Ok(_) => check_window(js, &config.stream, config).await.map(drop),
        Err(e)
            if matches!(
                e.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(ref j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            if !config.create_stream {
                return Err(SinkError::MissingStream {
                    subject: config.subjects.join(", "),
                    stream: config.stream.clone(),
                });
            }
            js.create_stream(jetstream::stream::Config {
                name: config.stream.clone(),
                subjects: config.subjects.clone(),
                storage: match config.storage {
                    NatsStorage::File => jetstream::stream::StorageType::File,
                    NatsStorage::Memory => jetstream::stream::StorageType::Memory,
                },
                num_replicas: config.replicas,
                duplicate_window: config.duplicate_window(),
                ..Default::default()
            })
            .await
            .map_err(|e| create_error(&config.stream, &e))?;
            tracing::info!(
                stream = config.stream,
                subjects = ?config.subjects,
                duplicate_window_s = config.duplicate_window_s(),
                "created stream"
            );
            Ok(())
        }
        Err(e) => Err(SinkError::Nats(format!(
            "looking up stream {}: {e}",
            config.stream
        ))),
    }
}

/// What a failed stream creation means: the server did not answer in time or
/// JetStream was not up yet (a server restarting): a new session may
/// succeed; else the server refused the stream as configured, which trying
/// again would only repeat.
fn create_error(stream: &str, e: &jetstream::context::CreateStreamError) -> SinkError {
    use jetstream::context::CreateStreamErrorKind as K;
    match e.kind() {
        K::TimedOut | K::JetStreamUnavailable | K::Response | K::ResponseParse => {
            SinkError::Nats(format!("creating stream {stream}: {e}"))
        }
        _ => SinkError::CreateTopic {
            topic: stream.to_owned(),
            reason: e.to_string(),
        },
    }
}

/// Checks that stream `name` keeps message ids at least as long as configured;
/// returns its largest message size (negative: no limit).
pub(super) async fn check_window(
    js: &jetstream::Context,
    name: &str,
    config: &NatsSinkConfig,
) -> Result<i32, SinkError> {
    let mut stream = js
        .get_stream(name)
        .await
        .map_err(|e| SinkError::Nats(format!("looking up stream {name}: {e}")))?;
    let info = stream
        .info()
        .await
        .map_err(|e| SinkError::Nats(format!("reading stream {name}'s settings: {e}")))?;
    let window = info.config.duplicate_window;
    if window < config.duplicate_window() && config.duplicate_window_s.is_none() {
        // A stream made before the default window grew: refusing it would stop
        // a walbox that ran on it until now.
        tracing::warn!(
            stream = name,
            window_s = window.as_secs(),
            default_s = config.duplicate_window_s(),
            "the stream keeps message ids for less than walbox's default duplicate window: \
             exactly once into it holds only for outages shorter than its window; raise it \
             (nats stream edit {name} --dupe-window {}s), or set sink.nats.duplicate_window_s \
             to the stream's window to silence this",
            config.duplicate_window_s()
        );
    } else if window < config.duplicate_window() {
        return Err(SinkError::Config(format!(
            "stream {name} keeps message ids for {} s, less than sink.nats.duplicate_window_s = \
             {}: a replay after a longer outage would be stored twice; raise the stream's \
             duplicate window (nats stream edit {name} --dupe-window {}s) or lower \
             duplicate_window_s",
            window.as_secs(),
            config.duplicate_window_s(),
            config.duplicate_window_s()
        )));
    }
    Ok(info.config.max_message_size)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A creation that timed out (a server restarting while walbox starts)
    /// ends the session for a new one to try again; a refusal stops walbox.
    #[test]
    fn a_stream_creation_that_timed_out_is_tried_again_and_a_refusal_is_not() {
        use jetstream::context::{CreateStreamError, CreateStreamErrorKind as K};
        for kind in [K::TimedOut, K::JetStreamUnavailable] {
            let e = create_error("OUTBOX", &CreateStreamError::new(kind));
            assert!(matches!(e, SinkError::Nats(_)), "{e}");
        }
        let e = create_error("OUTBOX", &CreateStreamError::new(K::InvalidStreamName));
        assert!(matches!(e, SinkError::CreateTopic { .. }), "{e}");
    }

    /// The longest delay before the shipped deployments start walbox again
    /// after a crash: systemd's `RestartSec`, and a crash-looping pod's
    /// back-off, which Kubernetes caps at 300 s.
    fn longest_restart_delay_s() -> u64 {
        let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
        let unit = std::fs::read_to_string(deploy.join("systemd/walbox.service")).unwrap();
        let systemd: u64 = unit
            .lines()
            .find_map(|l| l.strip_prefix("RestartSec="))
            .and_then(|v| v.trim().trim_end_matches('s').parse().ok())
            .expect("RestartSec= in seconds");
        let pod = std::fs::read_to_string(deploy.join("kubernetes/statefulset.yaml")).unwrap();
        // A StatefulSet's pods restart always (the only policy it allows),
        // with CrashLoopBackOff between crashes.
        assert!(!pod.contains("restartPolicy: Never") && !pod.contains("restartPolicy: OnFailure"));
        let crash_loop_back_off = 300;
        systemd.max(crash_loop_back_off)
    }

    #[test]
    fn the_default_window_covers_the_longest_restart_delay_of_the_shipped_deployments() {
        let window = NatsSinkConfig::default().duplicate_window_s();
        let delay = longest_restart_delay_s();
        assert_eq!(delay, 300);
        // The restart, then as long again to reach the event and publish it.
        assert!(
            window >= 2 * delay,
            "window {window} s, restart delay {delay} s"
        );
        assert_eq!(
            NatsSinkConfig::default().duplicate_window(),
            Duration::from_secs(600)
        );
    }
}
