//! `make demo`: walbox on throwaway infrastructure.
//!
//! Starts a PostgreSQL cluster with `wal_level=logical`, creates an outbox table, a
//! publication and a pgoutput slot, lets four concurrent writers commit a few hundred
//! outbox events, then runs `walbox inspect` to show what the slot captured from the
//! WAL, and checks it against the table. Everything is removed on exit.

#![allow(clippy::print_stdout)] // this program's output is its purpose

use std::path::PathBuf;
use std::process::Command;

use walbox_testkit::{PgCluster, PgOptions};

const WRITERS: usize = 4;
const EVENTS_PER_WRITER: usize = 75;

fn walbox_binary() -> PathBuf {
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--walbox"
            && let Some(p) = args.next()
        {
            return PathBuf::from(p);
        }
    }
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("walbox")))
        .unwrap_or_else(|| PathBuf::from("walbox"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let walbox = walbox_binary();
    println!("== starting a throwaway PostgreSQL (wal_level=logical)");
    let pg = PgCluster::start_with(PgOptions::default().setting("timezone", "UTC"))?;
    println!(
        "   listening on {}:{} ({})",
        pg.host(),
        pg.port(),
        pg.bindir().display()
    );
    let db = pg.connect("postgres").await?;
    db.batch_execute(
        "CREATE TABLE outbox (
             id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
             aggregate_type text NOT NULL,
             aggregate_id text NOT NULL,
             event_type text NOT NULL,
             payload jsonb NOT NULL,
             headers jsonb,
             occurred_at timestamptz NOT NULL DEFAULT now()
         );
         CREATE PUBLICATION walbox_outbox FOR TABLE outbox;",
    )
    .await?;
    db.batch_execute("SELECT pg_create_logical_replication_slot('walbox', 'pgoutput')")
        .await?;
    println!("== outbox table, publication walbox_outbox and slot walbox created");

    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let client = pg.connect("postgres").await?;
        writers.push(tokio::spawn(async move {
            for n in 0..EVENTS_PER_WRITER {
                let order = format!("order-{}", (w * EVENTS_PER_WRITER + n) % 40);
                let payload = order_payload(w, n);
                client
                    .execute(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
                         VALUES ('order', $1, 'OrderPlaced', $2::text::jsonb,
                                 jsonb_build_object('traceparent', '00-' || md5($1) || '-00f067aa0ba902b7-01'))",
                        &[&order, &payload],
                    )
                    .await?;
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    for w in writers {
        w.await??;
    }
    let rows: i64 = db
        .query_one("SELECT count(*) FROM outbox", &[])
        .await?
        .get(0);
    println!("== {WRITERS} writers committed {rows} outbox events");

    println!("== walbox inspect: what the slot holds, decoded from pgoutput (no values shown)");
    let out = Command::new(&walbox)
        .args([
            "inspect",
            "--slot",
            "walbox",
            "--publication",
            "walbox_outbox",
        ])
        .env("WALBOX_DSN", pg.conninfo("postgres"))
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        return Err(format!(
            "walbox inspect failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let json = Command::new(&walbox)
        .args([
            "inspect",
            "--slot",
            "walbox",
            "--publication",
            "walbox_outbox",
            "--json",
        ])
        .env("WALBOX_DSN", pg.conninfo("postgres"))
        .output()?;
    let text = String::from_utf8_lossy(&json.stdout);
    let expected = format!("\"inserts\":{rows}");
    if text.contains(&expected) {
        println!("== every committed outbox row is in the slot ({rows} inserts)");
        Ok(())
    } else {
        Err(format!("slot summary does not show {rows} inserts: {text}").into())
    }
}

/// A small order payload, built as text so the demo needs no JSON library.
fn order_payload(writer: usize, n: usize) -> String {
    format!(
        r#"{{"writer": {writer}, "seq": {n}, "currency": "EUR", "total_cents": {}}}"#,
        1000 + n * 17
    )
}
