//! The `walbox` process a test starts: spawned with its log in a file, signalled,
//! stopped, killed; one-shot commands (`setup` and others); the environment and
//! configuration files that point it at the test's cluster and broker; what it
//! prints.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use walbox_testkit::{Broker, PgCluster, wait_until};

use super::positions::checkpoint_path;

/// A `walbox` process started by a test, with its output in a log file.
pub struct Walbox {
    child: Option<Child>,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Walbox {
    /// Starts `walbox <args>` with `env` (and a quiet-enough log level).
    pub fn spawn(args: &[&str], env: &[(&str, String)]) -> Walbox {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("walbox.log");
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_walbox"));
        cmd.args(args)
            .env("WALBOX_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Walbox {
            child: Some(cmd.spawn().unwrap()),
            log,
            _dir: dir,
        }
    }

    /// `walbox setup`, then `walbox run`, with the usual environment; returns
    /// the environment for later commands.
    pub fn set_up_and_run(
        pg: &PgCluster,
        broker: &Broker,
    ) -> (Vec<(&'static str, String)>, Walbox) {
        let env = walbox_env(pg, broker);
        setup(&env);
        let walbox = Walbox::spawn(&["run"], &env);
        (env, walbox)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// What the process has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The metrics endpoint's address, from the line walbox logs once it has
    /// bound it: with `WALBOX_METRICS_LISTEN=127.0.0.1:0` the system picks the
    /// port, and no other server can take it between a pick and the bind.
    pub fn metrics_addr(&self) -> String {
        wait_until("walbox to serve /metrics", Duration::from_secs(60), || {
            log_field(&self.log(), "serving /metrics", "addr")
        })
        .unwrap_or_else(|e| panic!("{e}; log:\n{}", self.log()))
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        let _ = nix::sys::signal::kill(pid, signal);
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let status = wait_until("walbox to exit", timeout, || {
            child.try_wait().ok().flatten()
        })
        .unwrap_or_else(|e| panic!("{e}; log:\n{}", self.log()));
        self.child = None;
        status
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGTERM, and check it stops cleanly (exit 0) within a minute.
    pub fn stop(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        let log = self.log();
        assert_eq!(self.wait(Duration::from_secs(60)).code(), Some(0), "{log}");
    }

    /// SIGKILL, and wait for it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Walbox {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Environment for `walbox` against this cluster and broker.
pub fn walbox_env(pg: &PgCluster, broker: &Broker) -> Vec<(&'static str, String)> {
    vec![
        ("WALBOX_DSN", pg.conninfo("postgres")),
        ("WALBOX_BOOTSTRAP_SERVERS", broker.bootstrap()),
        ("WALBOX_CREATE_TOPICS", "true".into()),
        ("WALBOX_SLOT", "walbox".into()),
        ("WALBOX_PUBLICATION", "walbox_outbox".into()),
        (
            "WALBOX_CHECKPOINT",
            checkpoint_path(pg).display().to_string(),
        ),
    ]
}

/// Runs `walbox setup` and checks it succeeded.
pub fn setup(env: &[(&str, String)]) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_walbox"));
    cmd.arg("setup");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "walbox setup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs a walbox command to its end; returns (exit code, stdout, stderr).
pub fn walbox_cmd(args: &[&str], env: &[(&str, String)]) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_walbox"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Exit status code, for assertions.
pub fn code(s: ExitStatus) -> Option<i32> {
    s.code()
}

/// Writes a walbox configuration file beside the cluster; returns its path.
pub fn config_file(pg: &PgCluster, name: &str, toml: &str) -> String {
    let path = pg.client_dir().join(name);
    std::fs::write(&path, toml).unwrap();
    path.display().to_string()
}

/// Resident set size of `pid` in kB.
pub fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// The stdout sink's JSON lines in `output` (other lines skipped), parsed.
pub fn json_lines(output: &str) -> Vec<serde_json::Value> {
    // A last line without its newline may still be being written (the output
    // is read while walbox runs): taken only if it is whole. Any other line
    // must parse.
    let mut out = Vec::new();
    for l in output.split_inclusive('\n') {
        let whole = l.ends_with('\n');
        let l = l.trim_end();
        if !l.starts_with("{\"topic\"") {
            continue;
        }
        match serde_json::from_str(l) {
            Ok(v) => out.push(v),
            Err(_) if !whole => {}
            Err(e) => panic!("a line of the stdout sink that is no JSON ({e})"),
        }
    }
    out
}

/// The value of `field` (`field=value`) on the first text log line holding
/// `message`.
pub fn log_field(log: &str, message: &str, field: &str) -> Option<String> {
    let key = format!(" {field}=");
    log.lines()
        .filter(|l| l.contains(message))
        .find_map(|l| l.split(key.as_str()).nth(1)?.split_whitespace().next())
        .map(str::to_owned)
}
