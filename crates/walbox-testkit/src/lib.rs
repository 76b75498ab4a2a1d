//! Real infrastructure for walbox's tests, demo and benchmarks.
//!
//! - [`PgCluster`]: a throwaway PostgreSQL cluster (`wal_level=logical`) in a temp
//!   dir on a free port, started as an unprivileged user when the caller is root,
//!   optionally with TLS (a generated CA and server certificate) and SCRAM
//!   passwords; it can be stopped, restarted and killed with SIGKILL, and it is
//!   removed when dropped, also during a panic. [`PgCluster::standby_of`] makes a
//!   physical standby of one (a low-level base backup, streaming through a
//!   physical slot) that [`PgCluster::promote`] turns into a primary.
//! - [`Broker`]: a Kafka-protocol broker. By default a `tansu` process on a free port
//!   with in-memory or SQLite storage (stop, restart, SIGKILL); when
//!   `WALBOX_TEST_KAFKA` is set, that bootstrap address (a real Kafka) instead.
//! - [`NatsServer`]: a `nats-server -js` on a free port with a temporary store
//!   (stop, restart on the same store, SIGKILL), optionally requiring a user and
//!   password or a token.
//! - [`RedisServer`]: a `redis-server` as an unprivileged user on a free port
//!   with its own data directory, `appendonly yes` and `appendfsync always`
//!   (stop, restart on the same directory, SIGKILL), optionally with a
//!   password.
//! - [`PubSubEmulator`]: Google's Pub/Sub emulator (Java) as an unprivileged
//!   user on a free port, in memory only (a restart is an empty server),
//!   with topic and subscription set-up.
//! - [`TcpProxy`]: a TCP proxy between a program and a server that cuts every
//!   connection, refuses new ones and accepts again on command, and counts
//!   the connections it holds (link faults).
//! - [`kafka`]: topic administration and a reader that drains a topic into
//!   [`kafka::Record`]s (key, headers, value, partition, offset) for assertions.
//! - [`Prometheus`]: a real Prometheus on a free port scraping given targets,
//!   queried through its HTTP API; [`prometheus::get_status`] for plain GETs.
//! - [`Receiver`]: a real HTTP receiver for webhooks (HTTP/1.1 and HTTP/2,
//!   optionally TLS) on a free port that records each request and answers by
//!   a script (2xx, a status, `Retry-After`, slow, a dropped connection).
//! - [`Kinesalite`]: a kinesalite (a Kinesis stand-in, `scripts/aws.sh`)
//!   on a free port with a data directory that keeps what it acknowledged
//!   through a SIGKILL (stop, restart, SIGKILL).
//! - [`LocalStack`]: LocalStack (SQS and SNS, `scripts/aws.sh`) on a free
//!   port, in memory (kill -9, start again empty).
//! - [`FaultProxy`]: an HTTP proxy in front of an AWS stand-in (or the Pub/Sub
//!   emulator, whose Publish requests it refuses whole) that answers
//!   chosen entries of a batch call (Kinesis `PutRecords`, SQS
//!   `SendMessageBatch`) as failed without forwarding them, as AWS does
//!   when it throttles part of a batch.
//! - [`demo`]: the demo's destinations (prepared as `make demo` prepares them,
//!   with the address a configuration of `walbox init` needs filled in), its
//!   writers and the checks of its summary.
//! - [`wait_until`]: polls a condition with a deadline, so tests wait on conditions,
//!   never on fixed sleeps.

mod broker;
pub mod demo;
mod error;
pub mod fault_proxy;
pub mod kafka;
pub mod kinesis;
pub mod localstack;
pub mod nats;
mod postgres;
mod process;
pub mod prometheus;
mod proxy;
pub mod pubsub;
pub mod rabbitmq;
pub mod redis;
mod tls;
mod wait;
pub mod webhook;

pub use broker::{Broker, BrokerOptions, BrokerStorage, BrokerUser, Scram};
pub use error::TestkitError;
pub use fault_proxy::FaultProxy;
pub use kinesis::Kinesalite;
pub use localstack::LocalStack;
pub use nats::{NatsOptions, NatsServer};
pub use postgres::{PgCluster, PgOptions, StopMode, major_bindir, server_major};
pub use prometheus::Prometheus;
pub use proxy::TcpProxy;
pub use pubsub::PubSubEmulator;
pub use rabbitmq::RabbitMq;
pub use redis::{RedisOptions, RedisServer};
pub use tls::TlsFiles;
pub use wait::{wait_until, wait_until_async};
pub use webhook::Receiver;

/// The outbox table of the tests, demo and benchmark: walbox's default column names.
pub const OUTBOX_DDL: &str = "
    CREATE TABLE outbox (
        id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
        aggregate_type text NOT NULL,
        aggregate_id text NOT NULL,
        event_type text NOT NULL,
        payload jsonb NOT NULL,
        headers jsonb,
        occurred_at timestamptz NOT NULL DEFAULT now(),
        schema_version int
    )";

/// Result of a test-kit operation.
pub type Result<T, E = TestkitError> = std::result::Result<T, E>;
