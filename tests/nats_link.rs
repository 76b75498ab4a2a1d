//! The link between walbox and nats-server flaps under load: a TCP proxy
//! between them cuts every connection and refuses new ones while writers
//! commit, until walbox gave up the session, then accepts again; 20 times.
//! Each failed session's client is closed with its queue and the PubAcks it
//! awaited: walbox holds at most two connections to the proxy after each flap,
//! and its memory after 20 flaps stays within a small margin of what it was
//! after 2. The stream holds every event once, each key's in commit order.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use walbox_testkit::{NatsServer, OUTBOX_DDL, PgCluster, TcpProxy};

/// Flaps of the link.
const FLAPS: usize = 20;
/// How far walbox's resident memory may grow from the 2nd flap to the last
/// (kB). A session's in-flight state is bounded by `max_in_flight` (2,000
/// events of about 1 KiB here); a client kept per failed session adds its
/// queue, its buffers and the PubAcks it awaits, 18 times over (measured: flat
/// within 1 MB when each is closed, 64 MB more when each lives on).
const RSS_MARGIN_KB: u64 = 8 * 1024;

/// One outbox insert whose payload carries `seq` and 1 KiB of padding, so that
/// a queue left behind weighs.
fn padded_insert(key: &str, seq: i64) -> String {
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', '{key}', 'OrderPlaced',
                 jsonb_build_object('seq', {seq}, 'pad', repeat('x', 1024)));"
    )
}

/// Commits a transaction of 5 padded inserts over 10 keys every 10 ms until
/// stopped (a steady load that keeps the stream's size modest); yields how
/// many events it committed.
async fn paced_writer(pg: &PgCluster, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<usize> {
    let db = pg.connect("postgres").await.unwrap();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seq = [0i64; 10];
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let mut sql = String::from("BEGIN;");
            for _ in 0..5 {
                let k = n % 10;
                sql.push_str(&padded_insert(&format!("order-{k}"), seq[k]));
                seq[k] += 1;
                n += 1;
            }
            sql.push_str("COMMIT;");
            db.batch_execute(&sql).await.unwrap();
        }
        n
    })
}

/// The position of walbox's checkpoint (written every 100 ms as it moves).
fn saved(pg: &PgCluster) -> walbox_pgoutput::Lsn {
    checkpoint(pg).map_or(walbox_pgoutput::Lsn(0), |c| c.lsn)
}

/// Waits until walbox's checkpoint moves past where it is now.
fn wait_saved_moves(pg: &PgCluster, walbox: &Walbox, what: &str) {
    let before = saved(pg);
    walbox_testkit::wait_until(what, Duration::from_secs(60), || {
        (saved(pg) > before).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
}

async fn outbox_count(db: &tokio_postgres::Client) -> i64 {
    db.query_one("SELECT count(*) FROM outbox", &[])
        .await
        .unwrap()
        .get(0)
}

#[allow(clippy::print_stderr)] // prints its connection and memory figures
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_link_flapping_20_times_under_load_leaves_no_client_behind_and_loses_nothing() {
    let pg = PgCluster::start().unwrap();
    let nats = NatsServer::start().unwrap();
    let server: SocketAddr = nats.url().trim_start_matches("nats://").parse().unwrap();
    let proxy = TcpProxy::start(server).unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let toml = format!(
        "[sink]\ntype = \"nats\"\nmax_in_flight = 2000\n\n[sink.nats]\nservers = \
         [\"nats://{}\"]\n{CREATE}\nack_timeout_ms = 2000\n",
        proxy.addr()
    );
    let env = nats_env(&pg, &toml);
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    let stop_writing = Arc::new(AtomicBool::new(false));
    let writer = paced_writer(&pg, Arc::clone(&stop_writing)).await;
    let started = Instant::now();
    let mut rss = Vec::new();
    let mut connections = Vec::new();
    // The stream exists (the sink makes it at its first publication) before
    // the first flap, and the first session has relayed past its checkpoint.
    walbox_testkit::wait_until("the stream to be created", Duration::from_secs(60), || {
        walbox.log().contains("created stream").then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    wait_saved_moves(&pg, &walbox, "the first session to relay");
    for flap in 1..=FLAPS {
        let ended = sessions_ended(&walbox);
        let rows = outbox_count(&db).await;
        proxy.refuse();
        proxy.cut();
        // Writers commit while the link is down, and walbox gives the session
        // up (its PubAcks time out after 2 s).
        walbox_testkit::wait_until_async(
            "the session to end and writers to commit meanwhile",
            Duration::from_secs(60),
            || async {
                (sessions_ended(&walbox) > ended && outbox_count(&db).await >= rows + 100)
                    .then_some(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("flap {flap}: {e}\n{}", walbox.log()));
        proxy.accept();
        // A new session relays what was committed meanwhile.
        wait_saved_moves(
            &pg,
            &walbox,
            &format!("a session after flap {flap} to relay"),
        );
        connections.push(proxy.live());
        rss.push(rss_kb(walbox.pid()));
        assert!(walbox.running(), "{}", walbox.log());
    }
    let flapping = started.elapsed();
    eprintln!(
        "{FLAPS} flaps in {flapping:?}; walbox's connections to the proxy after each: \
         {connections:?}; RSS (kB) after each: {rss:?}; connections accepted {}, refused {}",
        proxy.accepted(),
        proxy.refused()
    );
    // MEM: no client of a failed session lives on. It would hold its queue
    // and, once the proxy accepts again, a connection.
    let (second, last) = (rss[1], rss[FLAPS - 1]);
    assert!(
        last <= second + RSS_MARGIN_KB,
        "RSS grew from {second} kB after flap 2 to {last} kB after flap {FLAPS}: {rss:?}\n{}",
        walbox.log()
    );
    assert!(
        connections.iter().all(|c| *c <= 2),
        "walbox holds more connections to the proxy than one session needs: {connections:?}"
    );
    stop_writing.store(true, Ordering::Relaxed);
    let written = writer.await.unwrap();
    caught_up(&db, &walbox).await;
    assert_eq!(proxy.live(), 1, "one connection once caught up");
    walbox.stop();
    eprintln!("{written} events written");

    // NL, ORD: every event in the stream once, each key's in commit order.
    let messages = read_subject(&nats, SUBJECT).await;
    let ids = outbox_ids(&db).await;
    assert_eq!(ids.len(), written);
    assert_each_event_once(&messages, &ids);
    assert_per_key_order_once(&messages);
    drop(pg);
}
