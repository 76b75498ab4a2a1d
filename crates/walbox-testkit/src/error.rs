//! The kit's error type: what went wrong while starting, driving or stopping
//! test infrastructure.

use std::path::PathBuf;
use std::time::Duration;

/// What went wrong while setting up or driving test infrastructure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestkitError {
    /// A program the kit needs is not installed.
    #[error("{program} not found ({hint})")]
    MissingProgram {
        /// The program.
        program: String,
        /// How to get it.
        hint: String,
    },
    /// A command ran and failed.
    #[error("{command} failed with {status}: {output}")]
    CommandFailed {
        /// The command line.
        command: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// The tail of what it printed.
        output: String,
    },
    /// A process did not reach the expected state in time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long it waited.
        after: Duration,
    },
    /// A server process exited while it should be running.
    #[error("{what} exited unexpectedly ({status}); log: {log}")]
    Exited {
        /// Which server.
        what: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// The tail of its log.
        log: String,
    },
    /// File-system or process I/O failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was attempted.
        action: &'static str,
        /// On which path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A system call failed.
    #[error("{action}: {source}")]
    Sys {
        /// What was attempted.
        action: &'static str,
        /// The cause.
        #[source]
        source: nix::Error,
    },
    /// Generating certificates failed.
    #[error("generating TLS certificates: {0}")]
    Certificate(#[from] rcgen::Error),
    /// A PostgreSQL query or connection failed.
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    /// An HTTP request of a test failed.
    #[error("http: {0}")]
    Http(String),
    /// A Kafka client call failed.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// The broker refused to create a topic.
    #[error("creating topic {topic}: {reason}")]
    CreateTopic {
        /// The topic.
        topic: String,
        /// The broker's answer.
        reason: String,
    },
}

impl TestkitError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| TestkitError::Io {
            action,
            path,
            source,
        }
    }
}
