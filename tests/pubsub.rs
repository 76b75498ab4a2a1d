//! walbox into Google's Pub/Sub emulator (one for the binary) from a real
//! PostgreSQL: `walbox verify` reads a topic back through its verify
//! subscription (and, as it acknowledges what it reads, a second run finds
//! nothing there); and with Application Default Credentials (a service
//! account file whose token endpoint is a local server), neither the key,
//! the signed assertion nor the access token reaches the log, even at
//! `WALBOX_LOG=trace`, where the HTTP and credentials libraries log too;
//! `walbox doctor` says where walbox publishes and with which credentials.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use walbox_testkit::{OUTBOX_DDL, PgCluster, PubSubEmulator};

const TOPIC: &str = "outbox.order";

/// The binary's emulator, gone when the binary ends.
fn emulator() -> &'static PubSubEmulator {
    static EMULATOR: OnceLock<PubSubEmulator> = OnceLock::new();
    EMULATOR.get_or_init(|| {
        let e = PubSubEmulator::start().expect("starting the pubsub emulator");
        e.removed_when_this_process_ends().unwrap();
        e
    })
}

/// A cluster with the outbox table, and walbox's environment with
/// `[sink.pubsub]` holding `lines` (the project and `create_topics` given).
async fn servers(
    lines: &str,
) -> (
    PgCluster,
    tokio_postgres::Client,
    Vec<(&'static str, String)>,
) {
    let pg = PgCluster::start().unwrap();
    let db = pg.connect("postgres").await.unwrap();
    db.batch_execute(OUTBOX_DDL).await.unwrap();
    let toml = format!(
        "[sink]\ntype = \"pubsub\"\ncreate_topics = true\n\n[sink.pubsub]\nproject = \"{}\"\n\
         {lines}\n",
        PubSubEmulator::PROJECT
    );
    let env = vec![
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_SLOT", "walbox".into()),
        ("WALBOX_PUBLICATION", "walbox_outbox".into()),
        (
            "WALBOX_CHECKPOINT",
            checkpoint_path(&pg).display().to_string(),
        ),
        (
            "WALBOX_CONFIG",
            config_file(&pg, "walbox-pubsub.toml", &toml),
        ),
    ];
    (pg, db, env)
}

async fn write_events(db: &tokio_postgres::Client, keys: usize, per_key: usize) {
    for seq in 0..per_key {
        let mut sql = String::from("BEGIN;");
        for k in 0..keys {
            sql.push_str(&format!(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ('order', 'k{k}', 'OrderPlaced', '{{\"seq\": {seq}}}');"
            ));
        }
        sql.push_str("COMMIT;");
        db.batch_execute(&sql).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reads_a_topic_back_through_its_verify_subscription_once() {
    let em = emulator();
    // Made before walbox publishes: a subscription holds what comes after.
    em.create_subscription("outbox.order.audit", TOPIC, true)
        .unwrap();
    let (_pg, db, env) = servers(&format!(
        "emulator_host = \"{}\"\nverify_subscription = \"{{topic}}.audit\"\n",
        em.host()
    ))
    .await;
    setup(&env);
    let mut walbox = Walbox::spawn(&["run"], &env);
    write_events(&db, 4, 10).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    // doctor says where walbox publishes.
    let (_, out, err) = walbox_cmd(&["doctor"], &env);
    assert!(out.contains("Pub/Sub emulator at http://"), "{out}{err}");
    let (status, out, err) = walbox_cmd(&["verify", "--timeout-s", "10"], &env);
    assert_eq!(status, Some(0), "{out}{err}");
    assert!(out.contains("(40 records)"), "{out}");
    assert!(out.contains("missing          0"), "{out}");
    assert!(out.contains("out of order     0"), "{out}");
    // Read once: verify acknowledged what it read, and a second run finds
    // every event missing (docs/guarantees.md says so).
    let (status, out, _) = walbox_cmd(&["verify", "--timeout-s", "3"], &env);
    assert_ne!(status, Some(0), "{out}");
    assert!(out.contains("missing          40"), "{out}");
}

/// A token endpoint on a free port: answers every request with `token`,
/// keeps the bodies it was sent (the signed assertions), counts them.
struct TokenServer {
    port: u16,
    asked: Arc<AtomicUsize>,
    bodies: Arc<Mutex<Vec<String>>>,
    _task: tokio::task::JoinHandle<()>,
}

impl TokenServer {
    async fn start(token: &'static str) -> TokenServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let asked = Arc::new(AtomicUsize::new(0));
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let (a, b) = (Arc::clone(&asked), Arc::clone(&bodies));
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let (a, b) = (Arc::clone(&a), Arc::clone(&b));
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    // The request: headers, then Content-Length bytes.
                    loop {
                        let n = s.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        let text = String::from_utf8_lossy(&buf).into_owned();
                        if let Some(end) = text.find("\r\n\r\n") {
                            let len = text[..end]
                                .lines()
                                .find_map(|l| {
                                    l.to_ascii_lowercase()
                                        .strip_prefix("content-length:")
                                        .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                                })
                                .unwrap_or(0);
                            if buf.len() >= end + 4 + len {
                                b.lock().unwrap().push(text[end + 4..].to_owned());
                                break;
                            }
                        }
                    }
                    a.fetch_add(1, Ordering::SeqCst);
                    let body = format!(
                        "{{\"access_token\":\"{token}\",\"expires_in\":3600,\"token_type\":\"Bearer\"}}"
                    );
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(answer.as_bytes()).await;
                });
            }
        });
        TokenServer {
            port,
            asked,
            bodies,
            _task: task,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_never_reach_the_log_even_at_trace() {
    const TOKEN: &str = "ya29.walbox-test-access-token-0123456789";
    let em = emulator();
    em.create_subscription("creds.order.sub", "creds.order", true)
        .unwrap();
    let tokens = TokenServer::start(TOKEN).await;
    // A service account key as Google issues it (RSA, PKCS#8), its token
    // endpoint the local one.
    let dir = tempfile::tempdir().unwrap();
    let key_path = dir.path().join("key.pem");
    let out = std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
        ])
        .arg(&key_path)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pem = std::fs::read_to_string(&key_path).unwrap();
    let account = serde_json::json!({
        "type": "service_account",
        "project_id": PubSubEmulator::PROJECT,
        "private_key_id": "0123456789abcdef0123456789abcdef01234567",
        "private_key": pem,
        "client_email": "walbox@walbox-test.iam.gserviceaccount.com",
        "client_id": "100000000000000000001",
        "token_uri": format!("http://127.0.0.1:{}/token", tokens.port),
    });
    let account_path = dir.path().join("account.json");
    std::fs::write(&account_path, account.to_string()).unwrap();
    // Not the emulator's way in: the endpoint, with credentials.
    let (_pg, db, mut env) = servers(&format!("endpoint = \"http://{}\"\n", em.host())).await;
    env.push((
        "GOOGLE_APPLICATION_CREDENTIALS",
        account_path.display().to_string(),
    ));
    // The topic template writes to creds.order.
    let cfg = env
        .iter()
        .find(|(k, _)| *k == "WALBOX_CONFIG")
        .unwrap()
        .1
        .clone();
    let mut toml = std::fs::read_to_string(&cfg).unwrap();
    toml.push_str("\n[[outbox]]\ntable = \"public.outbox\"\ntopic = \"creds.{aggregate_type}\"\n");
    std::fs::write(&cfg, toml).unwrap();
    setup(&env);
    let mut trace = env.clone();
    trace.push(("WALBOX_LOG", "trace".into()));
    let mut walbox = Walbox::spawn(&["run"], &trace);
    write_events(&db, 2, 5).await;
    caught_up(&db, &walbox).await;
    walbox.stop();
    let log = walbox.log();
    assert!(
        tokens.asked.load(Ordering::SeqCst) >= 1,
        "no token asked for:\n{log}"
    );
    // The events went with the token.
    let config = walbox_sink::PubSubSinkConfig {
        project: PubSubEmulator::PROJECT.into(),
        emulator_host: Some(em.host()),
        ..Default::default()
    };
    let mut read = 0;
    walbox_sink::read_subscription(&config, "creds.order.sub", Duration::from_secs(10), |_| {
        read += 1;
    })
    .await
    .unwrap();
    assert_eq!(read, 10);
    // The libraries did log: the credentials' and the HTTP client's.
    assert!(
        log.contains("gcp_auth") && log.contains("requesting token"),
        "{log}"
    );
    assert!(log.contains("TRACE hyper_util"), "{log}");
    assert!(!log.contains(TOKEN), "the access token is in the log");
    assert!(
        !log.contains("walbox-test-access-token"),
        "part of the token is in the log"
    );
    for line in pem.lines().filter(|l| !l.starts_with("-----")) {
        assert!(
            !log.contains(line),
            "a line of the private key is in the log"
        );
    }
    for body in tokens.bodies.lock().unwrap().iter() {
        let assertion = body
            .split('&')
            .find_map(|p| p.strip_prefix("assertion="))
            .expect("a JWT bearer grant");
        // The signature, the part only the key could make.
        let signature = assertion.rsplit('.').next().unwrap();
        assert!(signature.len() > 100);
        assert!(
            !log.contains(signature),
            "the signed assertion is in the log"
        );
    }
}
