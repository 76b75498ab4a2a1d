//! Where walbox's credentials come from and which rights it asks for, end to end:
//! a password only in a password file, that file refused when others may read
//! it, and the least-privilege roles of the README running `setup` and `run`.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::*;
use walbox_testkit::{BrokerOptions, PgOptions};

const TOPIC: &str = "outbox.order";
const PASSWORD: &str = "Pgpass-Only-7f3c";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_comes_from_a_private_password_file_and_never_from_a_readable_one() {
    let (pg, broker, db) = servers_with(
        PgOptions {
            password: Some(PASSWORD.to_owned()),
            ..PgOptions::default()
        },
        BrokerOptions::default(),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let pgpass = dir.path().join("pgpass");
    std::fs::write(
        &pgpass,
        format!(
            "# walbox\n127.0.0.1:{}:postgres:{}:{PASSWORD}\n",
            pg.port(),
            pg.user()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&pgpass, std::fs::Permissions::from_mode(0o600)).unwrap();

    let mut env = walbox_env(&pg, &broker);
    for (k, v) in &mut env {
        if *k == "WALBOX_DSN" {
            // The string has no password: it comes from the file.
            *v = format!(
                "host={} port={} user={} dbname=postgres",
                pg.host(),
                pg.port(),
                pg.user()
            );
        }
    }
    env.push(("PGPASSFILE", pgpass.display().to_string()));

    // The SQL connection (setup) and the replication connection (run) both log in.
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&pg, 1, 5, 2, 3).await;
    assert_all_delivered(
        &db,
        &broker.bootstrap(),
        TOPIC,
        10,
        "a password from the file",
    )
    .await;
    walbox.stop();
    assert!(!walbox.log().contains(PASSWORD));

    // Readable by the group: ignored with a warning naming the file, so the
    // server refuses the login.
    std::fs::set_permissions(&pgpass, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, out, err) = walbox_cmd(&["doctor"], &env);
    assert_ne!(code, Some(0), "{out}{err}");
    assert!(
        err.contains("password file has group or world access"),
        "{err}"
    );
    assert!(err.contains(&pgpass.display().to_string()), "{err}");
    assert!(
        err.contains("password authentication failed") || err.contains("password missing"),
        "{err}"
    );
    assert!(
        !out.contains(PASSWORD) && !err.contains(PASSWORD),
        "{out}{err}"
    );
}

/// The SQL block after `marker` in the README.
fn readme_sql(marker: &str) -> String {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let after = &readme[readme
        .find(marker)
        .unwrap_or_else(|| panic!("{marker} in README"))..];
    let block = &after[after.find("```sql\n").unwrap() + 7..];
    block[..block.find("```").unwrap()].to_owned()
}

fn as_role(
    env: &[(&'static str, String)],
    pg: &walbox_testkit::PgCluster,
    user: &str,
) -> Vec<(&'static str, String)> {
    let mut env = env.to_vec();
    for (k, v) in &mut env {
        if *k == "WALBOX_DSN" {
            *v = format!(
                "host={} port={} user={user} dbname=app",
                pg.host(),
                pg.port()
            );
        }
    }
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_roles_set_up_and_stream_and_doctor_names_what_a_superuser_does_not_need() {
    let (pg, broker, db) = servers().await;
    db.batch_execute("CREATE DATABASE app").await.unwrap();
    db.batch_execute("CREATE ROLE app_owner").await.unwrap();
    let app = pg.connect("app").await.unwrap();
    app.batch_execute(walbox_testkit::OUTBOX_DDL).await.unwrap();
    app.batch_execute("ALTER TABLE public.outbox OWNER TO app_owner")
        .await
        .unwrap();
    // Exactly the README's statements.
    app.batch_execute(&readme_sql("<!-- least-privilege: streaming role -->"))
        .await
        .unwrap();
    app.batch_execute(&readme_sql("<!-- least-privilege: setup role -->"))
        .await
        .unwrap();

    let env = walbox_env(&pg, &broker);
    let setup_env = as_role(&env, &pg, "walbox_setup");
    let stream_env = as_role(&env, &pg, "walbox");
    let super_env = as_role(&env, &pg, pg.user());

    // The streaming role cannot create the publication; the setup role can.
    let (code, out, err) = walbox_cmd(&["setup"], &stream_env);
    assert_ne!(code, Some(0), "{out}{err}");
    setup(&setup_env);

    // As the streaming role, doctor finds nothing missing and nothing extra.
    let (code, out, err) = walbox_cmd(&["doctor"], &stream_env);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(!out.contains("FAIL"), "{out}");
    assert!(out.contains("role walbox may replicate"), "{out}");
    assert!(
        out.contains("walbox may SELECT from public.outbox"),
        "{out}"
    );
    for line in out.lines().filter(|l| l.starts_with("warn")) {
        assert!(!line.contains("role walbox"), "{line}");
    }

    let mut walbox = Walbox::spawn(&["run"], &stream_env);
    app.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', g::text, 'OrderPlaced', jsonb_build_object('seq', g) FROM generate_series(1, 20) g",
    )
    .await
    .unwrap();
    assert_all_delivered(
        &app,
        &broker.bootstrap(),
        TOPIC,
        20,
        "streaming as the least-privilege role",
    )
    .await;
    walbox.stop();

    // The setup role owns the table through app_owner: doctor says so.
    let (_, out, _) = walbox_cmd(&["doctor"], &setup_env);
    assert!(
        out.lines()
            .any(|l| l.starts_with("warn") && l.contains("role walbox_setup owns 1 table(s)")),
        "{out}"
    );
    assert!(
        out.contains("REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON public.outbox FROM walbox_setup"),
        "{out}"
    );

    // A superuser works, with the warning and its fix.
    let (code, out, err) = walbox_cmd(&["doctor"], &super_env);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.lines().any(|l| l.starts_with("warn")
            && l.contains("role postgres is a superuser")
            && l.contains("Least privilege")),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_level_security_fails_a_snapshot_loudly_instead_of_hiding_rows() {
    let (pg, broker, db) = servers().await;
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', g::text, 'OrderPlaced', jsonb_build_object('seq', g) FROM generate_series(1, 5) g;
         ALTER TABLE public.outbox ENABLE ROW LEVEL SECURITY;
         CREATE PUBLICATION walbox_outbox FOR TABLE public.outbox WITH (publish_via_partition_root = true);
         CREATE ROLE walbox LOGIN REPLICATION;
         GRANT SELECT ON public.outbox TO walbox;",
    )
    .await
    .unwrap();
    let env = walbox_env(&pg, &broker);
    let mut stream_env = env.clone();
    for (k, v) in &mut stream_env {
        if *k == "WALBOX_DSN" {
            *v = format!(
                "host={} port={} user=walbox dbname=postgres",
                pg.host(),
                pg.port()
            );
        }
    }

    // No policy, no BYPASSRLS: the role sees no row. The snapshot fails naming
    // row-level security instead of publishing none.
    let (code, out, err) = walbox_cmd(&["setup", "--snapshot"], &stream_env);
    assert_ne!(code, Some(0), "{out}{err}");
    assert!(err.contains("row-level security"), "{out}{err}");

    // doctor says why, and what fixes it.
    let (_, out, _) = walbox_cmd(&["doctor"], &stream_env);
    assert!(
        out.lines().any(|l| l.starts_with("warn")
            && l.contains("public.outbox has row-level security enabled")
            && l.contains("ALTER ROLE walbox BYPASSRLS")),
        "{out}"
    );

    // With BYPASSRLS doctor does not call it unneeded, and warns no more.
    db.batch_execute("ALTER ROLE walbox BYPASSRLS")
        .await
        .unwrap();
    let (_, out, _) = walbox_cmd(&["doctor"], &stream_env);
    assert!(!out.contains("BYPASSRLS"), "{out}");
    assert!(!out.contains("row-level security"), "{out}");
    // Without row-level security on an outbox table, BYPASSRLS is unneeded.
    db.batch_execute("ALTER TABLE public.outbox DISABLE ROW LEVEL SECURITY")
        .await
        .unwrap();
    let (_, out, _) = walbox_cmd(&["doctor"], &stream_env);
    assert!(
        out.lines().any(
            |l| l.starts_with("warn") && l.contains("has BYPASSRLS, which walbox does not use")
        ),
        "{out}"
    );
}
