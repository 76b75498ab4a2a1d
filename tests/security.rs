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
