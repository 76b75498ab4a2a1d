//! Helpers shared by the end-to-end tests in this directory, by concern:
//!
//! - [`aws`]: the AWS destinations' stand-ins' environment for walbox, and
//!   their records read back.
//! - [`process`]: the `walbox` process and its commands, environment and output.
//! - [`positions`]: the server's WAL position, the slot's confirmed position and
//!   walbox's checkpoint, and waiting on them.
//! - [`writers`]: writers of outbox rows.
//! - [`kill_loop`]: a writer that commits until stopped, and SIGKILL rounds.
//! - [`messages`]: logical decoding messages as events (the table-less outbox).
//! - [`topics`]: reading topics back and auditing them against the outbox table.
//! - [`order`]: per-key order and the Java client's partitioner.
//! - [`servers`]: a cluster with the outbox table and a broker for one test.
//! - [`rabbitmq`]: the test binary's RabbitMQ node, a cluster and walbox's
//!   configuration for it, four writers, the queue audited.
//! - [`nats`]: a cluster with the outbox table and a JetStream server, the
//!   stream read back.
//! - [`webhook`]: a cluster with the outbox table and a scripted HTTP
//!   receiver, arrivals checked for order and by the Standard Webhooks library.
//!
//! Each test file starts its own PostgreSQL cluster and broker through
//! `walbox-testkit`; nothing here talks to a server the test did not start, except
//! a real Kafka named by `WALBOX_TEST_KAFKA`.

#![allow(dead_code)] // each test binary uses a different part

mod aws;
mod kill_loop;
mod messages;
mod nats;
mod order;
mod positions;
mod process;
mod rabbitmq;
mod servers;
mod topics;
mod venv;
mod webhook;
mod writers;

// Each test binary uses a different part.
#[allow(unused_imports)]
pub use aws::*;
#[allow(unused_imports)]
pub use kill_loop::*;
#[allow(unused_imports)]
pub use messages::*;
#[allow(unused_imports)]
pub use nats::*;
#[allow(unused_imports)]
pub use order::*;
#[allow(unused_imports)]
pub use positions::*;
#[allow(unused_imports)]
pub use process::*;
#[allow(unused_imports)]
pub use rabbitmq::*;
#[allow(unused_imports)]
pub use servers::*;
#[allow(unused_imports)]
pub use topics::*;
#[allow(unused_imports)]
pub use venv::*;
#[allow(unused_imports)]
pub use webhook::*;
#[allow(unused_imports)]
pub use writers::*;
