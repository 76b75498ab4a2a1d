//! The files that deploy and watch walbox, checked by the tools that consume
//! them where this machine has those tools, and against walbox itself:
//!
//! - the alert rules: `promtool check rules`, and their unit tests
//!   (`promtool test rules`), each alert with series that fire and series that
//!   do not;
//! - the Grafana dashboard: a dashboard over a Prometheus data source variable,
//!   every query valid PromQL (checked by promtool);
//! - the metric names the rules and the dashboard use: all exported by a
//!   running walbox's `/metrics`;
//! - the systemd unit: `systemd-analyze verify` with no warning;
//! - the Kubernetes manifests, the Dockerfile and docker-compose.yml: parsed,
//!   consistent with each other, with the tested build steps and with walbox's
//!   configuration keys.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use walbox_testkit::wait_until;
use yaml_rust2::{Yaml, YamlLoader};

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &str) -> String {
    let p = root().join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn yaml_docs(path: &str) -> Vec<Yaml> {
    YamlLoader::load_from_str(&read(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} (installed by scripts/deps.sh)"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The `walbox_*` metric names an expression uses.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = expr.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut i = 0;
    while i < bytes.len() {
        if ident(bytes[i]) && (i == 0 || !ident(bytes[i - 1])) {
            let start = i;
            while i < bytes.len() && ident(bytes[i]) {
                i += 1;
            }
            let word = &expr[start..i];
            if word.starts_with("walbox_") {
                names.insert(word.to_owned());
            }
        } else {
            i += 1;
        }
    }
    names
}

/// Every alert rule: name and expression.
fn alert_rules() -> Vec<(String, String)> {
    let docs = yaml_docs("deploy/prometheus/walbox-alerts.yml");
    let mut rules = Vec::new();
    for group in docs[0]["groups"].as_vec().unwrap() {
        for rule in group["rules"].as_vec().unwrap() {
            let name = rule["alert"].as_str().expect("every rule is an alert");
            let expr = rule["expr"].as_str().unwrap();
            rules.push((name.to_owned(), expr.to_owned()));
        }
    }
    rules
}

fn rule_test_files() -> Vec<PathBuf> {
    let dir = root().join("deploy/prometheus/tests");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yml"))
        .collect();
    files.sort();
    files
}

#[test]
fn alert_rules_pass_promtool_and_every_alert_is_tested_firing_and_silent() {
    let rules = root().join("deploy/prometheus/walbox-alerts.yml");
    let (ok, out) = run(Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(&rules));
    assert!(ok, "promtool check rules:\n{out}");

    let files = rule_test_files();
    assert!(
        !files.is_empty(),
        "no promtool tests in deploy/prometheus/tests"
    );
    let (ok, out) = run(Command::new("promtool")
        .args(["test", "rules"])
        .args(&files)
        .current_dir(root()));
    assert!(ok, "promtool test rules:\n{out}");

    // For each alert: a case where it fires and one where it stays silent.
    let mut fires = BTreeSet::new();
    let mut silent = BTreeSet::new();
    for f in &files {
        let docs = YamlLoader::load_from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
        for test in docs[0]["tests"].as_vec().unwrap() {
            for case in test["alert_rule_test"].as_vec().unwrap() {
                let name = case["alertname"].as_str().unwrap().to_owned();
                match case["exp_alerts"].as_vec() {
                    Some(v) if !v.is_empty() => fires.insert(name),
                    _ => silent.insert(name),
                };
            }
        }
    }
    for (name, _) in alert_rules() {
        assert!(fires.contains(&name), "no promtool test where {name} fires");
        assert!(
            silent.contains(&name),
            "no promtool test where {name} stays silent"
        );
    }
}

/// Every query of the dashboard (panels and variables).
fn dashboard_queries(d: &serde_json::Value) -> Vec<String> {
    let mut queries = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            queries.push(t["expr"].as_str().unwrap().to_owned());
        }
    }
    for v in d["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"]["query"].as_str() {
            queries.push(q.to_owned());
        }
    }
    queries
}

fn dashboard() -> serde_json::Value {
    serde_json::from_str(&read("deploy/grafana/walbox-dashboard.json")).unwrap()
}

#[test]
fn dashboard_is_a_grafana_dashboard_of_valid_promql_over_a_datasource_variable() {
    let d = dashboard();
    assert!(d["title"].is_string() && d["uid"].is_string());
    assert!(d["schemaVersion"].as_u64().unwrap() >= 36);
    let vars = d["templating"]["list"].as_array().unwrap();
    let ds = vars
        .iter()
        .find(|v| v["type"] == "datasource")
        .expect("a data source variable");
    assert_eq!(ds["query"], "prometheus");
    let ds_ref = format!("${{{}}}", ds["name"].as_str().unwrap());

    let mut ids = BTreeSet::new();
    let mut exprs = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        let title = p["title"].as_str().unwrap();
        assert!(ids.insert(p["id"].as_u64().unwrap()), "panel id twice");
        let g = &p["gridPos"];
        assert!(
            g["x"].as_u64().unwrap() + g["w"].as_u64().unwrap() <= 24,
            "{title}: wider than the grid"
        );
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], ds_ref.as_str(), "{title}");
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], ds_ref.as_str(), "{title}");
            exprs.push(t["expr"].as_str().unwrap().to_owned());
        }
    }
    for v in vars.iter().filter(|v| v["type"] == "query") {
        assert_eq!(v["datasource"]["uid"], ds_ref.as_str());
    }
    // Latency percentiles from both histograms' buckets.
    for h in [
        "walbox_commit_to_ack_seconds",
        "walbox_commit_to_read_seconds",
    ] {
        assert!(
            exprs
                .iter()
                .any(|e| e.contains("histogram_quantile(") && e.contains(&format!("{h}_bucket"))),
            "no percentile of {h}"
        );
    }

    // promtool parses every query, with the dashboard's variables filled in as
    // Grafana fills them.
    let dir = tempfile::tempdir().unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in exprs.iter().enumerate() {
        let e = e
            .replace("$__rate_interval", "1m")
            .replace("$job", ".*")
            .replace("$instance", ".*");
        // A JSON string is a YAML string.
        rules.push_str(&format!(
            "      - record: dashboard:query{i}\n        expr: {}\n",
            serde_json::to_string(&e).unwrap()
        ));
    }
    let file = dir.path().join("dashboard-queries.yml");
    std::fs::write(&file, rules).unwrap();
    let (ok, out) = run(Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(&file));
    assert!(ok, "a dashboard query is not valid PromQL:\n{out}");
}

/// `GET path` on `addr`: the status code and the body.
fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}

/// The sample names of a Prometheus text exposition.
fn sample_names(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rules_and_the_dashboard_use_only_metrics_walbox_exports() {
    let mut used = BTreeMap::new();
    for (name, expr) in alert_rules() {
        for m in metric_names(&expr) {
            used.insert(m, format!("alert {name}"));
        }
    }
    for q in dashboard_queries(&dashboard()) {
        for m in metric_names(&q) {
            used.insert(m, "the dashboard".to_owned());
        }
    }
    assert!(used.len() > 20, "metric names found: {used:?}");

    // A walbox that has published, dead-lettered and lost a session, so that
    // every labelled series exists.
    let (pg, broker, db) = servers().await;
    let mut env = walbox_env(&pg, &broker);
    env.push(("WALBOX_TOPIC", "outbox.{aggregate_type}".into()));
    env.push(("WALBOX_METRICS_LISTEN", "127.0.0.1:0".into()));
    setup(&env);
    let walbox = Walbox::spawn(&["run"], &env);
    let addr = walbox.metrics_addr();
    db.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'k1', 'E', '{\"seq\": 0}'), ('bad topic!', 'k2', 'E', '{\"seq\": 0}');",
    )
    .await
    .unwrap();
    let scrape = || {
        http_get(&addr, "/metrics")
            .filter(|(s, _)| *s == 200)
            .map(|(_, b)| b)
    };
    let has = |body: &str, name: &str| sample_names(body).contains(name);
    wait_until(
        "the event published and the row dead-lettered",
        Duration::from_secs(60),
        || {
            scrape().filter(|b| {
                has(b, "walbox_events_published_total")
                    && has(b, "walbox_events_dead_lettered_total")
            })
        },
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    // The session ends under walbox; it starts another.
    db.batch_execute(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
         WHERE slot_name = 'walbox' AND active_pid IS NOT NULL",
    )
    .await
    .unwrap();
    let body = wait_until("a session ended by reason", Duration::from_secs(60), || {
        scrape().filter(|b| has(b, "walbox_sessions_ended_total"))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", walbox.log()));
    let exported = sample_names(&body);
    let missing: Vec<String> = used
        .iter()
        .filter(|(m, _)| !exported.contains(*m))
        .map(|(m, by)| format!("{m} (used by {by})"))
        .collect();
    assert!(
        missing.is_empty(),
        "not exported by /metrics: {missing:?}\nexported: {exported:?}"
    );
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    let unit = read("deploy/systemd/walbox.service");
    let exec = "ExecStart=/usr/local/bin/walbox run --config /etc/walbox/walbox.toml";
    assert!(
        unit.lines().any(|l| l == exec),
        "the shipped ExecStart is {exec}"
    );
    for line in [
        "DynamicUser=yes",
        "StateDirectory=walbox",
        "WorkingDirectory=/var/lib/walbox",
        "Restart=on-failure",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "CapabilityBoundingSet=",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        "SystemCallFilter=@system-service",
    ] {
        assert!(
            unit.lines().any(|l| l == line),
            "walbox.service lacks {line}"
        );
    }

    // systemd-analyze needs ExecStart's binary: the one this test built.
    let dir = tempfile::tempdir().unwrap();
    let verify = |text: &str| {
        let path = dir.path().join("walbox.service");
        std::fs::write(&path, text).unwrap();
        let (ok, out) = run(Command::new("systemd-analyze").arg("verify").arg(&path));
        // Unknown keys and bad values are only warnings: the unit's lines count.
        let warnings: Vec<&str> = out
            .lines()
            .filter(|l| l.contains("walbox.service"))
            .collect();
        (ok && warnings.is_empty(), out)
    };
    let built = unit.replace("/usr/local/bin/walbox", env!("CARGO_BIN_EXE_walbox"));
    let (ok, out) = verify(&built);
    assert!(ok, "systemd-analyze verify walbox.service:\n{out}");
    // The check sees a bad directive.
    let (ok, _) = verify(&built.replace("ProtectSystem=strict", "ProtectSystem=stricter"));
    assert!(
        !ok,
        "systemd-analyze verify passes a bad ProtectSystem value"
    );
}

/// The manifests by kind.
fn kubernetes() -> BTreeMap<String, Yaml> {
    let mut by_kind = BTreeMap::new();
    let kust = &yaml_docs("deploy/kubernetes/kustomization.yaml")[0];
    for file in kust["resources"].as_vec().unwrap() {
        for doc in yaml_docs(&format!("deploy/kubernetes/{}", file.as_str().unwrap())) {
            let kind = doc["kind"].as_str().unwrap().to_owned();
            assert!(by_kind.insert(kind.clone(), doc).is_none(), "two {kind}s");
        }
    }
    let listed = by_kind.len();
    let files = std::fs::read_dir(root().join("deploy/kubernetes"))
        .unwrap()
        .count();
    assert_eq!(files, listed + 1, "every manifest is in kustomization.yaml");
    by_kind
}

/// Port of an address `host:port`.
fn port_of(addr: &str) -> i64 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn the_kubernetes_manifests_run_one_walbox_with_its_checkpoint_volume_and_probes() {
    let k = kubernetes();
    let sts = &k["StatefulSet"];
    assert_eq!(sts["spec"]["replicas"].as_i64(), Some(1));
    let pod = &sts["spec"]["template"];
    let c = &pod["spec"]["containers"][0];

    // walbox.toml from the ConfigMap: the metrics port and the checkpoint.
    let toml_text = k["ConfigMap"]["data"]["walbox.toml"].as_str().unwrap();
    let config: toml::Table = toml::from_str(toml_text).unwrap();
    let metrics_port = port_of(config["metrics"]["listen"].as_str().unwrap());
    let checkpoint = config["checkpoint"]["path"].as_str().unwrap();
    assert!(
        config["source"].get("dsn").is_none(),
        "the DSN belongs in the Secret"
    );

    let ports = c["ports"].as_vec().unwrap();
    let metrics = ports
        .iter()
        .find(|p| p["name"].as_str() == Some("metrics"))
        .unwrap();
    assert_eq!(metrics["containerPort"].as_i64(), Some(metrics_port));
    let ann = &pod["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"].as_str(), Some("true"));
    assert_eq!(
        ann["prometheus.io/port"].as_str(),
        Some(&*metrics_port.to_string())
    );
    assert_eq!(ann["prometheus.io/path"].as_str(), Some("/metrics"));
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        assert_eq!(c[probe]["httpGet"]["path"].as_str(), Some(path));
        assert_eq!(c[probe]["httpGet"]["port"].as_str(), Some("metrics"));
    }

    // The checkpoint is on the claimed volume.
    let claim = sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
        .as_str()
        .unwrap();
    let mount = c["volumeMounts"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|m| m["name"].as_str() == Some(claim))
        .expect("the claim is mounted");
    assert!(checkpoint.starts_with(&format!("{}/", mount["mountPath"].as_str().unwrap())));

    // The DSN from a Secret; the configuration file from the ConfigMap.
    let dsn = c["env"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|e| e["name"].as_str() == Some("WALBOX_DSN"))
        .expect("WALBOX_DSN");
    assert!(dsn["valueFrom"]["secretKeyRef"]["name"].as_str().is_some());
    let args: Vec<&str> = c["args"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let config_at = args[args.iter().position(|a| *a == "--config").unwrap() + 1];
    let config_mount = c["volumeMounts"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|m| config_at.starts_with(m["mountPath"].as_str().unwrap()))
        .expect("the configuration file is mounted");
    let volume = pod["spec"]["volumes"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|v| v["name"] == config_mount["name"])
        .unwrap();
    assert_eq!(
        volume["configMap"]["name"],
        k["ConfigMap"]["metadata"]["name"]
    );
    assert_eq!(sts["spec"]["serviceName"], k["Service"]["metadata"]["name"]);

    // walbox accepts the file: it gets as far as connecting.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("walbox.toml");
    std::fs::write(&file, toml_text).unwrap();
    let port = free_port();
    let (code, _, err) = walbox_cmd(
        &["slot", "status", "--config", file.to_str().unwrap()],
        &[(
            "WALBOX_DSN",
            format!("host=127.0.0.1 port={port} user=walbox dbname=app connect_timeout=5"),
        )],
    );
    assert_ne!(code, Some(0));
    assert!(
        err.contains(&format!("connecting to walbox@127.0.0.1:{port}")),
        "walbox refused the ConfigMap's walbox.toml before connecting:\n{err}"
    );
}

/// The `RUN`, `FROM`, `COPY`, ... instructions of a Dockerfile, continuation
/// lines joined.
fn dockerfile() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in read("Dockerfile").lines() {
        let l = line.trim();
        if current.is_empty() && (l.is_empty() || l.starts_with('#')) {
            continue;
        }
        match l.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(l);
                let (op, rest) = current.split_once(' ').unwrap();
                out.push((op.to_uppercase(), rest.trim().to_owned()));
                current.clear();
            }
        }
    }
    out
}

#[test]
fn the_dockerfile_builds_with_the_tested_steps_and_runs_as_a_user_with_a_volume() {
    let ins = dockerfile();
    let all = |op: &str| -> Vec<String> {
        ins.iter()
            .filter(|(o, _)| o == op)
            .map(|(_, r)| r.clone())
            .collect()
    };
    let from = all("FROM");
    assert_eq!(from.len(), 2, "a builder and a runtime stage");
    assert!(from[1].starts_with("debian:") && from[1].contains("slim"));

    // The builder's Rust is at least the workspace's rust-version.
    let image = from[0].split_whitespace().next().unwrap();
    let version = image
        .strip_prefix("rust:")
        .unwrap()
        .split('-')
        .next()
        .unwrap();
    let needed = read("Cargo.toml")
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .unwrap()
        .trim_matches('"')
        .to_owned();
    let parse = |v: &str| -> Vec<u32> { v.split('.').map(|n| n.parse().unwrap()).collect() };
    assert!(
        parse(version) >= parse(&needed),
        "rust {version} < rust-version {needed}"
    );

    // Build steps: deps.sh's build tools and `make release`, which is the
    // Makefile's cargo build of walbox.
    let runs = all("RUN");
    assert!(
        runs.iter()
            .any(|r| r.contains("scripts/deps.sh --build-only"))
    );
    assert!(runs.iter().any(|r| r == "make release"));
    let makefile = read("Makefile");
    let recipe = makefile
        .split("\nrelease:\n")
        .nth(1)
        .and_then(|r| r.lines().next())
        .expect("a release target");
    assert_eq!(recipe.trim(), "$(RELEASE_BUILD)");
    let (ok, out) = run(Command::new(root().join("scripts/deps.sh")).arg("--build-only"));
    assert!(ok, "scripts/deps.sh --build-only:\n{out}");
    assert!(
        all("COPY")
            .iter()
            .any(|c| c == "--from=build /src/target/release/walbox /usr/local/bin/walbox")
    );
    assert!(read(".dockerignore").lines().any(|l| l == "target/"));

    // The runtime image has the shared libraries the binary links (this
    // machine is Debian, like the image): each library's package is installed
    // in the image or is part of every Debian image.
    let runtime_install = runs
        .iter()
        .find(|r| r.contains("apt-get install"))
        .expect("the runtime's packages");
    let (ok, ldd) = run(Command::new("ldd").arg(env!("CARGO_BIN_EXE_walbox")));
    assert!(ok, "{ldd}");
    for lib in ldd.lines().filter_map(|l| l.split(" => ").nth(1)) {
        let path = lib.split_whitespace().next().unwrap();
        let (ok, owner) = run(Command::new("dpkg").args(["-S", path]));
        let owner = if ok {
            owner.split(':').next().unwrap().to_owned()
        } else {
            // The usr-merged path: /lib is /usr/lib.
            let (ok, o) = run(Command::new("dpkg").args(["-S", &format!("/usr{path}")]));
            assert!(ok, "{path}: {o}");
            o.split(':').next().unwrap().to_owned()
        };
        assert!(
            ["libc6", "libgcc-s1"].contains(&owner.as_str())
                || runtime_install.split_whitespace().any(|w| w == owner),
            "the runtime image lacks {owner} ({path})"
        );
    }

    // Non-root, the checkpoint (written to the working directory by default) on
    // a volume, the metrics port exposed and served on all interfaces.
    let user = all("USER").pop().expect("a USER");
    assert!(
        !user.starts_with("root") && !user.starts_with("0"),
        "USER {user}"
    );
    let workdir = all("WORKDIR").pop().unwrap();
    assert!(
        all("VOLUME")
            .iter()
            .any(|v| v.contains(&format!("\"{workdir}\"")))
    );
    let env = all("ENV").join(" ");
    let listen = env
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("WALBOX_METRICS_LISTEN="))
        .expect("WALBOX_METRICS_LISTEN");
    assert!(listen.starts_with("0.0.0.0:"));
    assert_eq!(all("EXPOSE"), vec![port_of(listen).to_string()]);
}

/// The `cargo build` commands `make -n TARGET` prints, in order.
fn cargo_builds(target: &str) -> Vec<String> {
    let (ok, out) = run(Command::new("make").current_dir(root()).args([
        "-n",
        "-s",
        "--no-print-directory",
        "CARGO=cargo",
        target,
    ]));
    assert!(ok, "make -n {target}:\n{out}");
    out.lines()
        .filter(|l| l.starts_with("cargo build"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn demo_bench_and_release_run_one_release_build() {
    let release = cargo_builds("release");
    assert_eq!(release.len(), 1, "{release:?}");
    let build = &release[0];
    for wanted in [
        "--release",
        "--locked",
        "-p walbox ",
        "-p walbox-testkit",
        "-p walbox-bench",
    ] {
        assert!(format!("{build} ").contains(wanted), "{build}: no {wanted}");
    }
    assert!(!build.contains("--features"), "{build}");
    for target in ["demo", "bench-relay", "flamegraphs"] {
        assert_eq!(cargo_builds(target), release, "make {target}");
    }
    // No build of its own for the benchmark's allocation counts: no feature.
    assert!(
        !read("crates/walbox/Cargo.toml").contains("\n[features]"),
        "a feature of walbox would make a second build"
    );
}

#[test]
fn docker_compose_runs_walbox_beside_postgres_and_kafka_with_its_metrics_port() {
    let doc = &yaml_docs("docker-compose.yml")[0];
    let services = &doc["services"];
    for s in ["postgres", "kafka", "walbox"] {
        assert!(!services[s].is_badvalue(), "no {s} service");
    }
    let walbox = &services["walbox"];
    assert_eq!(walbox["build"].as_str(), Some("."));
    let env = &walbox["environment"];
    let listen = env["WALBOX_METRICS_LISTEN"].as_str().unwrap();
    let published: Vec<&str> = walbox["ports"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(published.contains(&&*format!("{0}:{0}", port_of(listen))));
    // walbox reaches the broker on a listener Kafka advertises to containers.
    let advertised = services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
        .as_str()
        .unwrap();
    let bootstrap = env["WALBOX_BOOTSTRAP_SERVERS"].as_str().unwrap();
    assert!(
        advertised
            .split(',')
            .any(|l| l.ends_with(&format!("//{bootstrap}")))
    );
    assert!(
        env["WALBOX_DSN"]
            .as_str()
            .unwrap()
            .contains("host=postgres")
    );
    let volumes: Vec<&str> = walbox["volumes"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(volumes.iter().any(|v| v.ends_with(":/var/lib/walbox")));
}
