//! No secret is ever printed: every command, with a known password in the DSN, in
//! `WALBOX_DSN`, in `PGPASSWORD`, in the configuration file and as
//! `sasl.password`, through success and failure paths (bad host, bad password,
//! bad configuration key, bad TLS file, bad flag, a DSN that does not parse),
//! with `WALBOX_LOG=debug`: the passwords appear in no stdout, stderr or log line,
//! and in no topic record or dead-letter header. And `walbox run` relaying with
//! each sink at `WALBOX_LOG=trace`, with every client library's logging on
//! (librdkafka's debug contexts too), credentials in the DSN, in Kafka's
//! SASL/SCRAM settings and in a NATS server URL: no secret in its output, nor
//! in `/readyz`, `/healthz` or `/metrics`.

mod common;

use std::time::Duration;

use common::*;
use walbox_testkit::{
    Broker, BrokerUser, NatsOptions, NatsServer, OUTBOX_DDL, PgCluster, PgOptions, RedisOptions,
    RedisServer, Scram,
};

const PG_PASSWORD: &str = "pgSecret-4b7e21";
const KAFKA_PASSWORD: &str = "kafkaSecret-0d93c5";
const NATS_PASSWORD: &str = "natsSecret-7a1c39";
const WEBHOOK_SECRET: &str = "whsec_d2ViaG9va1NlY3JldC05YzRlMmE=";
const REDIS_PASSWORD: &str = "redisSecret-5e8f02";
const SECRETS: [&str; 5] = [
    PG_PASSWORD,
    KAFKA_PASSWORD,
    NATS_PASSWORD,
    WEBHOOK_SECRET,
    REDIS_PASSWORD,
];

/// Every command line walbox has (`walbox --help` lists them).
const COMMANDS: &[&[&str]] = &[
    &["run"],
    &["setup"],
    &["setup", "--snapshot"],
    &["replay", "--from", "0/0"],
    &["slot", "create"],
    &["slot", "status"],
    &["slot", "list"],
    &["slot", "drop"],
    &["doctor"],
    &[
        "inspect",
        "--slot",
        "walbox",
        "--publication",
        "walbox_outbox",
    ],
    &["verify", "--timeout-s", "5"],
    &["dlq", "replay", "--dry-run"],
];

fn assert_no_secret(what: &str, text: &str) {
    for secret in SECRETS {
        assert!(!text.contains(secret), "{what} printed a secret:\n{text}");
        // Half of it, in case a message cuts a value at a space or quote.
        assert!(
            !text.contains(&secret[secret.len() / 2..]),
            "{what} printed part of a secret:\n{text}"
        );
    }
}

/// Runs `args` with `env`, bounded, and checks its output.
fn run_checked(what: &str, args: &[&str], env: &[(&str, String)]) {
    let mut env = env.to_vec();
    env.push(("WALBOX_LOG", "debug".into()));
    let mut walbox = Walbox::spawn(args, &env);
    let exited = walbox_testkit::wait_until("walbox to exit", Duration::from_secs(10), || {
        (!walbox.running()).then_some(())
    });
    if exited.is_err() {
        // `run` keeps running on success, and retries an unreachable host: stop
        // it and check what it printed so far.
        walbox.kill9();
    }
    assert_no_secret(&format!("{what}: walbox {}", args.join(" ")), &walbox.log());
}

#[test]
fn help_of_every_command_shows_no_environment_value() {
    let env = vec![
        (
            "WALBOX_DSN",
            format!("host=db user=u password={PG_PASSWORD}"),
        ),
        ("PGPASSWORD", PG_PASSWORD.to_owned()),
    ];
    let (_, out, err) = walbox_cmd(&["--help"], &env);
    assert_no_secret("walbox --help", &format!("{out}{err}"));
    for args in COMMANDS {
        let mut help = args.to_vec();
        help.push("--help");
        let (code, out, err) = walbox_cmd(&help, &env);
        assert_eq!(code, Some(0), "walbox {}: {err}", help.join(" "));
        assert!(out.contains("Usage"), "{out}");
        assert_no_secret(
            &format!("walbox {}", help.join(" ")),
            &format!("{out}{err}"),
        );
    }
}

#[test]
fn a_command_line_error_never_quotes_the_argument() {
    // An unquoted connection string: its second word is an unexpected argument.
    let cases: &[(&[&str], &str)] = &[
        (
            &["doctor", "--dsn", "host=x", "password=hunter2"],
            "quoted as one argument",
        ),
        (
            &["run", "--dsn", "host=x", &format!("password={PG_PASSWORD}")],
            "quoted as one argument",
        ),
        // A value where a flag wants another type.
        (&["verify", "--timeout-s", PG_PASSWORD], "--timeout-s"),
        // A flag's value mistaken for a flag.
        (&[&format!("--{PG_PASSWORD}")], "unexpected argument"),
    ];
    for (args, names) in cases {
        let (code, out, err) = walbox_cmd(args, &[]);
        let what = format!("walbox {}", args.join(" "));
        assert_eq!(code, Some(2), "{what}: {err}");
        assert!(err.contains(names), "{what}: {err}");
        assert!(!format!("{out}{err}").contains("hunter2"), "{what}: {err}");
        assert_no_secret(&what, &format!("{out}{err}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_command_prints_a_secret_on_success_or_failure() {
    let pg = PgCluster::start_with(PgOptions {
        password: Some(PG_PASSWORD.into()),
        ..PgOptions::default()
    })
    .unwrap();
    let broker =
        Broker::start_authenticated(&[BrokerUser::new("walbox", KAFKA_PASSWORD, Scram::Sha512)])
            .unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let good_dsn = pg.conninfo("postgres");
    assert!(
        good_dsn.contains(PG_PASSWORD),
        "the DSN carries the password"
    );
    let kafka = |password: &str| {
        format!(
            "[sink.kafka]\n\"security.protocol\" = \"SASL_PLAINTEXT\"\n\
             \"sasl.mechanism\" = \"SCRAM-SHA-512\"\n\"sasl.username\" = \"walbox\"\n\
             \"sasl.password\" = \"{password}\"\n\"message.timeout.ms\" = 10000\n"
        )
    };
    // The DSN in the file, the Kafka password beside it.
    let in_file = config_file(
        &pg,
        "in-file.toml",
        &format!("[source]\ndsn = \"{good_dsn}\"\n{}", kafka(KAFKA_PASSWORD)),
    );
    let base = |config: &str| {
        let mut env = walbox_env(&pg, &broker);
        env.retain(|(k, _)| *k != "WALBOX_DSN");
        env.push(("WALBOX_CONFIG", config.to_owned()));
        env
    };

    // Success paths: the DSN from the file, from WALBOX_DSN, from --dsn.
    let with_kafka = config_file(&pg, "kafka.toml", &kafka(KAFKA_PASSWORD));
    let mut from_env = base(&with_kafka);
    from_env.push(("WALBOX_DSN", good_dsn.clone()));
    run_checked("setup", &["setup"], &base(&in_file));
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'k1', 'Created', '{\"n\": 1}'),
                ('bad topic!', 'k2', 'Created', '{\"n\": 2}')",
    )
    .await
    .unwrap();
    for args in COMMANDS {
        run_checked("file", args, &base(&in_file));
        run_checked("WALBOX_DSN", args, &from_env);
        let mut flag = args.to_vec();
        flag.extend(["--dsn", good_dsn.as_str()]);
        run_checked("--dsn", &flag, &base(&with_kafka));
    }

    // Failure paths.
    let no_password_dsn = good_dsn.replace(&format!(" password={PG_PASSWORD}"), "");
    let failures: Vec<(&str, Vec<(&str, String)>)> = vec![
        ("bad host", {
            let mut e = base(&with_kafka);
            e.push((
                "WALBOX_DSN",
                format!("host=no-such-host.invalid user=x password={PG_PASSWORD}"),
            ));
            e
        }),
        ("bad password in PGPASSWORD", {
            let mut e = base(&with_kafka);
            e.push(("WALBOX_DSN", no_password_dsn.clone()));
            e.push(("PGPASSWORD", format!("{PG_PASSWORD}x")));
            e
        }),
        ("bad password in the DSN", {
            let mut e = base(&with_kafka);
            e.push(("WALBOX_DSN", format!("{good_dsn}x")));
            e
        }),
        ("bad Kafka password", {
            let mut e = base(&config_file(
                &pg,
                "bad-kafka.toml",
                &kafka(&format!("{KAFKA_PASSWORD}x")),
            ));
            e.push(("WALBOX_DSN", good_dsn.clone()));
            e
        }),
        ("bad configuration key", {
            let file = config_file(
                &pg,
                "bad-key.toml",
                &format!("[source]\ndsn = \"{good_dsn}\"\npasword = \"{PG_PASSWORD}\"\n"),
            );
            base(&file)
        }),
        ("bad Kafka key", {
            let file = config_file(
                &pg,
                "bad-kafka-key.toml",
                &format!(
                    "[source]\ndsn = \"{good_dsn}\"\n[sink.kafka]\n\"sasl.pasword\" = \"{KAFKA_PASSWORD}\"\n"
                ),
            );
            base(&file)
        }),
        ("bad TLS file", {
            let mut e = base(&with_kafka);
            e.push((
                "WALBOX_DSN",
                format!("{good_dsn} sslmode=verify-full sslrootcert=/no/such/ca.pem"),
            ));
            e
        }),
    ];
    for (what, env) in &failures {
        for args in COMMANDS {
            run_checked(what, args, env);
        }
    }
    // A bad flag, with every secret in the environment.
    let mut bad_flag = from_env.clone();
    bad_flag.push(("PGPASSWORD", PG_PASSWORD.into()));
    for args in COMMANDS {
        let mut a = args.to_vec();
        a.push("--no-such-flag");
        run_checked("bad flag", &a, &bad_flag);
    }

    // What reached the broker: no record or dead-letter header holds a secret.
    let mut props = BrokerUser::new("walbox", KAFKA_PASSWORD, Scram::Sha512).client_properties();
    props.push(("bootstrap.servers".into(), broker.bootstrap()));
    let text = tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let mut c = rdkafka::ClientConfig::new();
        for (k, v) in &props {
            c.set(k, v);
        }
        let consumer: BaseConsumer = c.create().unwrap();
        let md = consumer
            .fetch_metadata(None, Duration::from_secs(30))
            .unwrap();
        let topics: Vec<String> = md.topics().iter().map(|t| t.name().to_owned()).collect();
        let mut text = String::new();
        for t in topics.iter().filter(|t| !t.starts_with("__")) {
            walbox_sink::read_topic(&props, t, Duration::from_secs(30), |r| {
                text.push_str(&String::from_utf8_lossy(r.value().unwrap_or_default()));
                for h in [
                    "walbox_error_class",
                    "walbox_error",
                    "walbox_source_table",
                    "walbox_source_topic",
                    "walbox_attempts",
                    "event_id",
                ] {
                    text.push_str(r.header(h).unwrap_or_default());
                }
            })
            .unwrap();
        }
        (topics, text)
    })
    .await
    .unwrap();
    assert!(
        text.0.iter().any(|t| t.ends_with(".dlq")),
        "a dead letter was written: {:?}",
        text.0
    );
    assert_no_secret("topic records", &text.1);

    // Last: a DSN that does not parse, with the password split at a space.
    let mut unparsable = base(&with_kafka);
    unparsable.push((
        "WALBOX_DSN",
        format!(
            "host=localhost password={} {}",
            &PG_PASSWORD[..7],
            &PG_PASSWORD[7..]
        ),
    ));
    for args in COMMANDS {
        run_checked("a DSN that does not parse", args, &unparsable);
    }
}

#[allow(clippy::print_stderr)] // prints how much each run logged
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sink_relays_at_trace_with_credentials_everywhere_and_prints_no_secret() {
    let pg = PgCluster::start_with(PgOptions {
        password: Some(PG_PASSWORD.into()),
        ..PgOptions::default()
    })
    .unwrap();
    let broker =
        Broker::start_authenticated(&[BrokerUser::new("walbox", KAFKA_PASSWORD, Scram::Sha512)])
            .unwrap();
    let nats = NatsServer::start_with(NatsOptions {
        user: Some(("walbox".into(), NATS_PASSWORD.into())),
        token: None,
    })
    .unwrap();
    let receiver = walbox_testkit::Receiver::start().unwrap();
    let redis = RedisServer::start_with(RedisOptions {
        password: Some(REDIS_PASSWORD.into()),
        ..RedisOptions::default()
    })
    .unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let dsn = pg.conninfo("postgres");
    assert!(dsn.contains(PG_PASSWORD), "the DSN carries the password");
    let nats_url = nats
        .url()
        .replace("nats://", &format!("nats://walbox:{NATS_PASSWORD}@"));
    let sinks = [
        (
            "kafka",
            format!(
                "[sink.kafka]\n\"security.protocol\" = \"SASL_PLAINTEXT\"\n\
                 \"sasl.mechanism\" = \"SCRAM-SHA-512\"\n\"sasl.username\" = \"walbox\"\n\
                 \"sasl.password\" = \"{KAFKA_PASSWORD}\"\ndebug = \"all\"\n"
            ),
        ),
        (
            "nats",
            format!(
                "[sink]\ntype = \"nats\"\n[sink.nats]\nservers = [\"{nats_url}\"]\n\
                 create_stream = true\nsubjects = [\"outbox.>\"]\n"
            ),
        ),
        ("stdout", "[sink]\ntype = \"stdout\"\n".to_owned()),
        (
            "webhook",
            format!(
                "[sink]\ntype = \"webhook\"\n[sink.webhook]\nurl = \"{}/{{topic}}\"\n\
                 secrets = [\"{WEBHOOK_SECRET}\"]\ndead_letter_file = \"{}\"\n",
                receiver.base_url(),
                pg.client_dir().join("dead-letters.jsonl").display()
            ),
        ),
        (
            "redis",
            format!(
                "[sink]\ntype = \"redis\"\n[sink.redis]\nurl = \"{}\"\n",
                redis
                    .url()
                    .replace("redis://", &format!("redis://:{REDIS_PASSWORD}@"))
            ),
        ),
    ];
    for (n, (sink, toml)) in sinks.iter().enumerate() {
        let mut env = walbox_env(&pg, &broker);
        env.push((
            "WALBOX_CONFIG",
            config_file(&pg, &format!("{sink}.toml"), toml),
        ));
        env.push(("WALBOX_METRICS_LISTEN", "127.0.0.1:0".into()));
        if n == 0 {
            setup(&env);
        }
        // Everything at trace, tokio-postgres too (held at info unless named).
        env.push(("WALBOX_LOG", "trace,tokio_postgres=trace".into()));
        // Text for one sink, JSON (other escaping) for another.
        if *sink == "nats" {
            env.push(("WALBOX_LOG_FORMAT", "json".into()));
        }
        let mut walbox = Walbox::spawn(&["run"], &env);
        db.batch_execute(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'k' || n % 3, 'Created', jsonb_build_object('n', n, 'sink', '{sink}')
             FROM generate_series(1, 20) n"
        ))
        .await
        .unwrap();
        let target = current_lsn(&db).await;
        walbox_testkit::wait_until_async(
            "walbox to relay the events",
            Duration::from_secs(60),
            || async { (confirmed_lsn(&db, "walbox").await >= target).then_some(()) },
        )
        .await
        .unwrap_or_else(|e| panic!("{sink}: {e}; log:\n{}", walbox.log()));
        let addr = walbox_testkit::wait_until("/metrics", Duration::from_secs(60), || {
            walbox
                .log()
                .lines()
                .filter(|l| l.contains("serving /metrics"))
                .find_map(|l| match serde_json::from_str::<serde_json::Value>(l) {
                    Ok(v) => v["addr"].as_str().map(str::to_owned),
                    Err(_) => log_field(l, "serving /metrics", "addr"),
                })
        })
        .unwrap();
        let mut served = String::new();
        for path in ["readyz", "healthz", "metrics"] {
            let (status, body) =
                walbox_testkit::prometheus::get_status(&format!("http://{addr}/{path}")).unwrap();
            assert!(
                status < 500 || path != "metrics",
                "{sink}: /{path}: {status}"
            );
            served.push_str(&body);
        }
        assert!(served.contains("walbox_"), "{sink}: {served}");
        walbox.stop();
        let log = walbox.log();
        assert!(log.contains("TRACE"), "{sink}: no TRACE line:\n{log}");
        assert!(
            log.contains("tokio_postgres"),
            "{sink}: tokio-postgres silent"
        );
        assert_no_secret(&format!("walbox run with the {sink} sink at trace"), &log);
        assert_no_secret(&format!("the {sink} sink's endpoints"), &served);
        eprintln!(
            "{sink}: {} lines of log, none with a secret ({} redacted)",
            log.lines().count(),
            log.matches("<redacted>").count()
        );
        for l in log.lines().filter(|l| l.contains("<redacted>")) {
            eprintln!("  {}", l.chars().take(400).collect::<String>());
        }
    }
}
