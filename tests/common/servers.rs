//! The servers of one test: a PostgreSQL cluster with the outbox table, a broker,
//! and a connection to the cluster.

use walbox_testkit::{Broker, BrokerOptions, OUTBOX_DDL, PgCluster, PgOptions};

/// A default cluster and an in-memory broker, with the outbox table created.
pub async fn servers() -> (PgCluster, Broker, tokio_postgres::Client) {
    servers_with(PgOptions::default(), BrokerOptions::default()).await
}

/// A cluster and a broker started with these options, with the outbox table
/// created.
pub async fn servers_with(
    pg: PgOptions,
    broker: BrokerOptions,
) -> (PgCluster, Broker, tokio_postgres::Client) {
    let pg = PgCluster::start_with(pg).unwrap();
    let broker = Broker::start_with(broker).unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    (pg, broker, db)
}
