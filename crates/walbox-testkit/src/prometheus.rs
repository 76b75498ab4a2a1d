//! A real Prometheus for tests: the `prometheus` server on a free port with a
//! temp dir for its data and a scrape config pointing at the given targets,
//! started as an unprivileged user when the caller is root, killed on drop.

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use tempfile::TempDir;

use crate::process::{self, log_tail, signal_group};
use crate::{Result, TestkitError, wait_until};

/// How long Prometheus may take to start.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// One series of a query's answer: its labels and value.
#[derive(Debug, Clone)]
pub struct Sample {
    /// The series' labels (`__name__` included when the query keeps it).
    pub labels: serde_json::Map<String, serde_json::Value>,
    /// Its value at the query's time.
    pub value: f64,
}

/// A running Prometheus scraping `targets`.
#[derive(Debug)]
pub struct Prometheus {
    dir: TempDir,
    port: u16,
    child: Option<Child>,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (`host:port`, path `/metrics`) every
    /// `interval` as job `walbox`.
    pub fn start(targets: &[String], interval: Duration) -> Result<Self> {
        let program = prometheus_program()?;
        let mut dir = tempfile::Builder::new()
            .prefix("walbox-prometheus-")
            .tempdir()
            .map_err(TestkitError::io("creating", std::env::temp_dir()))?;
        let millis = interval.as_millis().max(10);
        let list = targets
            .iter()
            .map(|t| format!("\"{t}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let config = format!(
            "global:\n  scrape_interval: {millis}ms\n  scrape_timeout: {millis}ms\n\
             scrape_configs:\n  - job_name: walbox\n    static_configs:\n      - targets: [{list}]\n"
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).map_err(TestkitError::io("writing", &config_path))?;
        std::fs::create_dir_all(dir.path().join("data"))
            .map_err(TestkitError::io("creating", dir.path()))?;
        let user = process::server_user()?;
        process::give_to(user.as_ref(), dir.path())?;
        let log_path = dir.path().join("prometheus.log");
        let mut last = None;
        for _ in 0..5 {
            let port = process::free_port()?;
            let (log, log_err) = process::log_files(&log_path)?;
            let mut cmd = process::command(&program, user.as_ref());
            cmd.arg(format!("--config.file={}", config_path.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .current_dir(dir.path())
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log_err);
            let child = cmd
                .spawn()
                .map_err(TestkitError::io("starting", &program))?;
            // From here on, dropping it stops the process.
            let mut p = Prometheus {
                dir,
                port,
                child: Some(child),
            };
            let ready = wait_until("Prometheus to be ready", START_TIMEOUT, || {
                if let Some(Ok(Some(status))) = p.child.as_mut().map(Child::try_wait) {
                    return Some(Err(status));
                }
                get(&format!("http://127.0.0.1:{port}/-/ready"))
                    .ok()
                    .map(|_| Ok(()))
            })?;
            match ready {
                Ok(()) => return Ok(p),
                Err(status) => {
                    p.child = None;
                    last = Some(TestkitError::Exited {
                        what: "prometheus".into(),
                        status,
                        log: log_tail(&log_path),
                    });
                    dir = std::mem::replace(
                        &mut p.dir,
                        tempfile::tempdir()
                            .map_err(TestkitError::io("creating", std::env::temp_dir()))?,
                    );
                }
            }
        }
        Err(last.unwrap_or(TestkitError::Timeout {
            what: "a free port for Prometheus".into(),
            after: START_TIMEOUT,
        }))
    }

    /// Its HTTP address.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The answer to an instant query (`/api/v1/query`): one sample per series.
    pub fn query(&self, promql: &str) -> Result<Vec<Sample>> {
        let url = format!("{}/api/v1/query", self.url());
        let body = ureq::get(&url)
            .query("query", promql)
            .call()
            .map_err(|e| TestkitError::Http(format!("GET {url}?query={promql}: {e}")))?
            .into_body()
            .read_to_string()
            .map_err(|e| TestkitError::Http(format!("reading {url}: {e}")))?;
        let answer: serde_json::Value = serde_json::from_str(&body)
            .map_err(|e| TestkitError::Http(format!("{url}: not JSON ({e}): {body}")))?;
        let result = answer
            .pointer("/data/result")
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| TestkitError::Http(format!("{url}: no data.result in {body}")))?;
        Ok(result
            .iter()
            .filter_map(|r| {
                let labels = r.get("metric")?.as_object()?.clone();
                let value = r.pointer("/value/1")?.as_str()?.parse().ok()?;
                Some(Sample { labels, value })
            })
            .collect())
    }

    /// The value of a query that answers one series; `None` while it answers none.
    pub fn value(&self, promql: &str) -> Result<Option<f64>> {
        Ok(self.query(promql)?.first().map(|s| s.value))
    }

    /// The tail of its log.
    #[must_use]
    pub fn log_tail(&self) -> String {
        log_tail(&self.dir.path().join("prometheus.log"))
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = signal_group(&child, Signal::SIGKILL);
            let _ = process::wait_group_gone(&mut child, "prometheus", START_TIMEOUT);
        }
    }
}

/// The body of a plain HTTP GET; an error for a status other than 2xx.
pub fn get(url: &str) -> Result<String> {
    ureq::get(url)
        .call()
        .map_err(|e| TestkitError::Http(format!("GET {url}: {e}")))?
        .into_body()
        .read_to_string()
        .map_err(|e| TestkitError::Http(format!("reading {url}: {e}")))
}

/// The status and body of an HTTP GET, whatever the status.
pub fn get_status(url: &str) -> Result<(u16, String)> {
    let response = ureq::get(url)
        .config()
        .http_status_as_error(false)
        .build()
        .call()
        .map_err(|e| TestkitError::Http(format!("GET {url}: {e}")))?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .read_to_string()
        .map_err(|e| TestkitError::Http(format!("reading {url}: {e}")))?;
    Ok((status, body))
}

/// The prometheus executable: `WALBOX_PROMETHEUS`, else `prometheus` on `PATH`.
fn prometheus_program() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("WALBOX_PROMETHEUS") {
        return Ok(PathBuf::from(p));
    }
    std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("prometheus"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| TestkitError::MissingProgram {
            program: "prometheus".into(),
            hint: "run `make deps` (apt-get install prometheus), or set WALBOX_PROMETHEUS".into(),
        })
}
