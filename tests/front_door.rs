//! The front door, for every sink type the configuration accepts: `walbox
//! init` writes a configuration, which with only the destination's address
//! filled in passes `walbox setup` and `walbox doctor` and runs the demo's
//! writers end to end against the demo's servers (every event there once or
//! more with its id, each key in commit order); `walbox init` never
//! overwrites a file; and `walbox doctor` names each destination problem it
//! is shown, with what to fix, against the same real servers.
//!
//! One test per sink type, each with its own PostgreSQL cluster and server
//! (the demo's), the doctor's problems checked after the run.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use walbox_testkit::demo::{self, Destination};
use walbox_testkit::{OUTBOX_DDL, PgCluster, wait_until};

const WALBOX: &str = env!("CARGO_BIN_EXE_walbox");

/// A walbox command in `dir`, to its end: (success, stdout, stderr).
fn walbox(dir: &Path, args: &[&str]) -> (bool, String, String) {
    walbox_with(dir, args, &[])
}

/// [`walbox`] with variables `env` besides (the AWS stand-ins' region and
/// credentials, which walbox takes from the AWS chain).
fn walbox_with(dir: &Path, args: &[&str], env: &[(&str, String)]) -> (bool, String, String) {
    let out = Command::new(WALBOX)
        .current_dir(dir)
        .args(args)
        .env_remove("WALBOX_CONFIG")
        .env_remove("WALBOX_DSN")
        .env("WALBOX_LOG", "info")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// One sink type's run from `walbox init` on.
struct FrontDoor {
    sink: &'static str,
    /// Kept running while the doctor is shown problems.
    _pg: PgCluster,
    destination: Destination,
    dir: tempfile::TempDir,
    /// The configuration as `walbox init` wrote it, its address filled in.
    config: String,
    /// Variables walbox needs besides (the destination's).
    env: Vec<(&'static str, String)>,
}

impl FrontDoor {
    /// `walbox init`, the address filled in, `walbox setup`, `walbox doctor`,
    /// `walbox run` under the demo's writers, the events read back and
    /// checked, and walbox stopped.
    async fn run(sink: &'static str) -> FrontDoor {
        let pg = PgCluster::start().unwrap();
        let db = pg.connect("postgres").await.unwrap();
        db.batch_execute(OUTBOX_DDL).await.unwrap();
        let destination = Destination::start(sink).await.unwrap();
        let env = destination.env();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("walbox.toml");

        let dsn = pg.conninfo("postgres");
        let init = [
            "init",
            "--sink",
            sink,
            "--dsn",
            &dsn,
            "--table",
            "public.outbox",
        ];
        let (ok, out, err) = walbox(dir.path(), &init);
        assert!(ok, "walbox init --sink {sink}: {out}{err}");
        assert!(out.contains("wrote walbox.toml"), "{out}");
        let written = std::fs::read_to_string(&path).unwrap();
        assert!(written.contains(&format!("type = \"{sink}\"")), "{written}");
        // Readable by its owner only: it holds the connection string.
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        // Never over a file that exists.
        let (ok, out, err) = walbox(dir.path(), &init);
        assert!(!ok, "{out}{err}");
        assert!(
            err.contains("walbox.toml exists: walbox init never overwrites a file"),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), written);

        let config = destination.fill_in(&written).unwrap();
        std::fs::write(&path, &config).unwrap();
        let (ok, out, err) = walbox_with(dir.path(), &["setup", "--config", "walbox.toml"], &env);
        assert!(ok, "walbox setup ({sink}): {out}{err}");
        let (ok, out, err) = walbox_with(dir.path(), &["doctor", "--config", "walbox.toml"], &env);
        assert!(ok, "walbox doctor ({sink}): {out}{err}");
        assert!(!out.contains("FAIL"), "{out}");

        let log = dir.path().join("walbox.log");
        let stdout = if destination.is_stdout() {
            Stdio::from(std::fs::File::create(destination.stdout_path()).unwrap())
        } else {
            Stdio::from(std::fs::File::create(dir.path().join("walbox.out")).unwrap())
        };
        let mut relay = Command::new(WALBOX)
            .current_dir(dir.path())
            .args(["run", "--config", "walbox.toml"])
            .env_remove("WALBOX_CONFIG")
            .env_remove("WALBOX_DSN")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(stdout)
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap();
        let show_log = || std::fs::read_to_string(&log).unwrap_or_default();

        demo::write_events(&pg).await.unwrap();
        let rows: i64 = db
            .query_one("SELECT count(*) FROM outbox", &[])
            .await
            .unwrap()
            .get(0);
        let wanted = usize::try_from(rows).unwrap();
        assert_eq!(wanted, demo::WRITERS * demo::EVENTS_PER_WRITER);
        let records = destination
            .read_back(wanted)
            .await
            .unwrap_or_else(|e| panic!("{sink}: {e}\n{}", show_log()));
        let checked = demo::check(&records).unwrap();
        assert_eq!(checked.ids, wanted, "{sink}: every event, by id");
        assert_eq!(checked.per_key.len(), demo::KEYS);
        assert!(checked.in_order, "{sink}: {:?}", checked.per_key);

        stop(&mut relay, &show_log);
        FrontDoor {
            sink,
            _pg: pg,
            destination,
            dir,
            config,
            env,
        }
    }

    /// `walbox doctor` on the configuration with `edit` applied: it fails,
    /// with a FAIL line holding each of `says`.
    fn doctor_fails(&self, edit: impl Fn(&str) -> String, says: &[&str]) {
        let config = edit(&self.config);
        assert_ne!(config, self.config, "the edit changed nothing");
        let path = self.dir.path().join("problem.toml");
        let _ = std::fs::remove_file(&path);
        std::fs::write(&path, &config).unwrap();
        let (ok, out, err) = walbox_with(
            self.dir.path(),
            &["doctor", "--config", "problem.toml"],
            &self.env,
        );
        assert!(!ok, "{}: doctor passed:\n{out}{err}", self.sink);
        let failed: Vec<&str> = out.lines().filter(|l| l.starts_with("FAIL")).collect();
        for s in says {
            assert!(
                failed.iter().any(|l| l.contains(s)),
                "{}: no FAIL line says {s:?}:\n{out}{err}",
                self.sink
            );
        }
    }

    /// `walbox doctor` on the configuration with `edit` applied passes and
    /// says `says`.
    fn doctor_passes(&self, edit: impl Fn(&str) -> String, says: &str) {
        let path = self.dir.path().join("fine.toml");
        let _ = std::fs::remove_file(&path);
        std::fs::write(&path, edit(&self.config)).unwrap();
        let (ok, out, err) = walbox_with(
            self.dir.path(),
            &["doctor", "--config", "fine.toml"],
            &self.env,
        );
        assert!(ok, "{}: {out}{err}", self.sink);
        assert!(out.contains(says), "{}: {out}", self.sink);
    }
}

/// SIGTERM, and exit 0 within a minute.
fn stop(relay: &mut Child, log: &dyn Fn() -> String) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(relay.id()).unwrap()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = wait_until("walbox to stop", Duration::from_secs(60), || {
        relay.try_wait().ok().flatten()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", log()));
    assert!(status.success(), "{status}\n{}", log());
}

/// `text` with `key` of table `table` (`sink.nats`, `[outbox]` for
/// `[[outbox]]`, ...) set
/// to `value`, its line (set or commented out) replaced.
fn set(text: &str, table: &str, key: &str, value: &str) -> String {
    // "[outbox]" names the array of tables [[outbox]].
    let header = format!("[{table}]");
    let mut inside = false;
    let mut done = false;
    let out: Vec<String> = text
        .lines()
        .map(|l| {
            if l.starts_with('[') {
                inside = l == header;
            }
            let body = l.strip_prefix("# ").unwrap_or(l);
            if inside && !done && body.starts_with(&format!("{key} = ")) {
                done = true;
                format!("{key} = {value}")
            } else {
                l.to_owned()
            }
        })
        .collect();
    assert!(done, "no {key} in [{table}]");
    out.join("\n") + "\n"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_from_init_to_events_and_what_doctor_names() {
    let f = FrontDoor::run("kafka").await;
    let port = closed_port();
    f.doctor_fails(
        |c| c.replace(&f.destination.address(), &format!("127.0.0.1:{port}")),
        &[&format!(
            "no Kafka broker answered at bootstrap.servers = 127.0.0.1:{port}"
        )],
    );
    // A topic the configuration names outright: missing, and not to be
    // created; then to be created.
    let fixed = |c: &str, create: &str| {
        set(
            &set(c, "[outbox]", "topic", "\"front.door.fixed\""),
            "sink",
            "create_topics",
            create,
        )
    };
    f.doctor_fails(
        |c| fixed(c, "false"),
        &[
            "topic front.door.fixed does not exist: create it",
            "or set sink.create_topics = true",
        ],
    );
    f.doctor_passes(
        |c| fixed(c, "true"),
        "topic front.door.fixed does not exist yet; walbox creates it",
    );
    // A broker that wants a password walbox does not have.
    let guarded = walbox_testkit::Broker::start_authenticated(&[walbox_testkit::BrokerUser::new(
        "walbox",
        "right-6c1f",
        walbox_testkit::Scram::Sha512,
    )])
    .unwrap();
    f.doctor_fails(
        |c| {
            let c = c.replace(&f.destination.address(), &guarded.bootstrap());
            let c = set(
                &c,
                "sink.kafka",
                "\"security.protocol\"",
                "\"sasl_plaintext\"",
            );
            let c = set(&c, "sink.kafka", "\"sasl.mechanism\"", "\"SCRAM-SHA-512\"");
            let c = set(&c, "sink.kafka", "\"sasl.username\"", "\"walbox\"");
            set(&c, "sink.kafka", "\"sasl.password\"", "\"wrong-6c1f\"")
        },
        &["check sasl.username, sasl.password and sasl.mechanism in sink.kafka"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_from_init_to_events_and_what_doctor_names() {
    let f = FrontDoor::run("nats").await;
    f.doctor_passes(|c| c.to_owned(), "stream OUTBOX exists");
    f.doctor_fails(
        |c| {
            set(
                &set(c, "sink.nats", "create_stream", "false"),
                "sink.nats",
                "stream",
                "\"NOSUCH\"",
            )
        },
        &[
            "stream NOSUCH does not exist: create it",
            "or set sink.nats.create_stream = true",
        ],
    );
    let port = closed_port();
    f.doctor_fails(
        |c| {
            c.replace(
                &f.destination.address(),
                &format!("nats://127.0.0.1:{port}"),
            )
        },
        &["check sink.nats.servers"],
    );
    // A server that wants a password walbox does not have.
    let guarded = walbox_testkit::NatsServer::start_with(walbox_testkit::NatsOptions {
        user: Some(("walbox".into(), "right".into())),
        ..Default::default()
    })
    .unwrap();
    f.doctor_fails(
        |c| {
            set(
                &c.replace(&f.destination.address(), &guarded.url()),
                "sink.nats",
                "user",
                "\"walbox\"\npassword = \"wrong\"",
            )
        },
        &["check sink.nats's user and password"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_from_init_to_events_and_what_doctor_names() {
    let f = FrontDoor::run("rabbitmq").await;
    let node = f.destination.rabbitmq().unwrap();
    f.doctor_fails(
        |c| {
            set(
                c,
                "sink.rabbitmq",
                "user",
                "\"nobody\"\npassword = \"wrong\"",
            )
        },
        &["refused user \"nobody\": check sink.rabbitmq.user and password"],
    );
    f.doctor_fails(
        |c| set(c, "sink.rabbitmq", "exchange", "\"no.such.exchange\""),
        &[
            "exchange no.such.exchange does not exist: declare it",
            "or set sink.rabbitmq.declare = true",
        ],
    );
    f.doctor_passes(
        |c| {
            set(
                &set(c, "sink.rabbitmq", "exchange", "\"no.such.exchange\""),
                "sink.rabbitmq",
                "declare",
                "true",
            )
        },
        "exchange no.such.exchange does not exist yet; walbox declares it",
    );
    f.doctor_fails(
        |c| set(c, "sink.rabbitmq", "dead_letter_queue", "\"no.such.queue\""),
        &["queue no.such.queue (sink.rabbitmq.dead_letter_queue, which walbox dlq replay reads) does not exist"],
    );
    node.declare_transient_queue("front.door.transient")
        .await
        .unwrap();
    f.doctor_fails(
        |c| {
            set(
                c,
                "sink.rabbitmq",
                "verify_queue",
                "\"front.door.transient\"",
            )
        },
        &["queue front.door.transient (sink.rabbitmq.verify_queue) is not durable"],
    );
    f.doctor_passes(
        |c| {
            set(
                c,
                "sink.rabbitmq",
                "verify_queue",
                &format!("\"{}\"", demo::QUEUE),
            )
        },
        &format!("queue {} (verify_queue) exists and is durable", demo::QUEUE),
    );
    // Stream mode: a stream the configuration names outright.
    f.doctor_fails(
        |c| {
            let c = set(c, "sink.rabbitmq", "mode", "\"stream\"");
            let c = set(
                &c,
                "sink.rabbitmq",
                "stream_port",
                &node.stream_port().to_string(),
            );
            set(&c, "[outbox]", "topic", "\"front.door.stream\"")
        },
        &["stream front.door.stream does not exist: declare it"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_from_init_to_events_and_what_doctor_names() {
    let f = FrontDoor::run("redis").await;
    let port = closed_port();
    f.doctor_fails(
        |c| {
            c.replace(
                &f.destination.address(),
                &format!("redis://127.0.0.1:{port}"),
            )
        },
        &["check sink.redis.url and that the server runs"],
    );
    let guarded = walbox_testkit::RedisServer::start_with(walbox_testkit::RedisOptions {
        password: Some("right".into()),
        ..Default::default()
    })
    .unwrap();
    f.doctor_fails(
        |c| {
            set(
                &c.replace(&f.destination.address(), &guarded.url()),
                "sink.redis",
                "password",
                "\"wrong\"",
            )
        },
        &["check sink.redis.username and password"],
    );
    // A server that no longer fsyncs every write.
    let client = redis::Client::open(f.destination.address()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("appendfsync")
        .arg("everysec")
        .query_async(&mut conn)
        .await
        .unwrap();
    f.doctor_fails(
        |c| c.replace("# allow_unsynced = false", "allow_unsynced = false"),
        &["walbox run refuses it: set appendonly yes, appendfsync always"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_from_init_to_events_and_what_doctor_names() {
    let f = FrontDoor::run("webhook").await;
    f.doctor_passes(|c| c.to_owned(), "accepts connections");
    let port = closed_port();
    f.doctor_fails(
        |c| {
            c.replace(
                &f.destination.address(),
                &format!("http://127.0.0.1:{port}"),
            )
        },
        &[
            &format!("nothing answers at http://127.0.0.1:{port}"),
            "check sink.webhook.url and that the receiver runs",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_from_init_to_events_and_what_doctor_names() {
    let f = FrontDoor::run("pubsub").await;
    f.doctor_passes(|c| c.to_owned(), "Pub/Sub emulator at");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinesis_from_init_to_events_and_what_doctor_names() {
    let f = FrontDoor::run("kinesis").await;
    let fixed = |c: &str| set(c, "[outbox]", "topic", "\"front.door.fixed\"");
    f.doctor_passes(
        |c| fixed(c),
        "Kinesis stream front.door.fixed does not exist; walbox creates it",
    );
    f.doctor_fails(
        |c| fixed(c).replace("create_topics = true", "create_topics = false"),
        &["Kinesis stream front.door.fixed does not exist: create it"],
    );
    let port = closed_port();
    f.doctor_fails(
        |c| {
            fixed(c).replace(
                &f.destination.address(),
                &format!("http://127.0.0.1:{port}"),
            )
        },
        &["kinesis"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_from_init_to_events_and_what_doctor_names() {
    let f = FrontDoor::run("sqs").await;
    let fixed = |c: &str| set(c, "[outbox]", "topic", "\"front.door.fixed\"");
    f.doctor_passes(
        |c| fixed(c),
        "SQS queue front-door-fixed.fifo (topic front.door.fixed) does not exist; walbox \
         creates it",
    );
    f.doctor_fails(
        |c| fixed(c).replace("create_topics = true", "create_topics = false"),
        &[
            "SQS queue front-door-fixed.fifo (topic front.door.fixed) does not exist: create it \
           as a FIFO queue",
        ],
    );
    f.doctor_fails(
        |c| c.replace("# fifo = true", "fifo = false"),
        &["ordered = false"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sns_from_init_to_events_and_what_doctor_names() {
    let f = FrontDoor::run("sns").await;
    // The demo's topic has its subscribed queue; a topic walbox would make
    // has none until its consumers subscribe, and SNS drops what it gets
    // before then.
    f.doctor_passes(
        |c| set(c, "[outbox]", "topic", "\"outbox.order\""),
        "SNS topic outbox-order.fifo exists, with 1 subscription",
    );
    let fixed = |c: &str| set(c, "[outbox]", "topic", "\"front.door.fixed\"");
    f.doctor_passes(
        |c| fixed(c),
        "SNS topic front-door-fixed.fifo (topic front.door.fixed) does not exist; walbox \
         creates it (create_topics), and stops until it has a subscription",
    );
    f.doctor_fails(
        |c| fixed(c).replace("create_topics = true", "create_topics = false"),
        &[
            "SNS topic front-door-fixed.fifo (topic front.door.fixed) does not exist: create it \
           as a FIFO topic",
        ],
    );
    f.doctor_fails(
        |c| c.replace("# fifo = true", "fifo = false"),
        &["ordered = false"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdout_from_init_to_events() {
    let f = FrontDoor::run("stdout").await;
    f.doctor_passes(|c| c.to_owned(), "nothing to reach");
}

/// The sink types this file runs are every one the configuration accepts
/// (`walbox init --sink`'s values, from the configuration's sink types).
#[test]
fn every_sink_type_the_configuration_accepts_goes_through_the_front_door() {
    let (ok, out, err) = walbox(Path::new("."), &["init", "--help"]);
    assert!(ok, "{err}");
    let accepted: Vec<&str> = out
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- "))
        .filter_map(|l| l.split(':').next())
        .collect();
    let tests: Vec<String> = include_str!("front_door.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("async fn "))
        .filter_map(|l| l.split("_from_init_to_events").next())
        .filter(|l| !l.contains('('))
        .map(str::to_owned)
        .collect();
    assert!(accepted.len() >= 6, "{out}");
    for sink in &accepted {
        assert!(
            tests.iter().any(|t| t == sink),
            "no front-door test of {sink}: {tests:?}"
        );
        assert!(demo::SINKS.contains(sink), "the demo does not run {sink}");
    }
}
