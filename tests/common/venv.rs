//! Python virtual environments with one package from PyPI, made once per
//! target directory, for tests that check walbox's output with a reference
//! library (the CloudEvents SDK, Standard Webhooks).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The python of a virtual environment `name` (under the target's temp dir)
/// holding `requirement` (`package==version`), made on first use. Tests of a
/// binary run at once: one of them makes it while the others wait.
pub fn python_with(name: &str, requirement: &str) -> PathBuf {
    static MAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = MAKING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let python = dir.join("bin").join("python");
    let ready = dir.join("installed");
    if std::fs::read_to_string(&ready).is_ok_and(|r| r == requirement) {
        return python;
    }
    let run = |cmd: &mut Command| {
        let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(Command::new("python3").args(["-m", "venv"]).arg(&dir));
    run(Command::new(dir.join("bin").join("pip")).args([
        "install",
        "--quiet",
        "--disable-pip-version-check",
        requirement,
    ]));
    std::fs::write(&ready, requirement).unwrap();
    python
}
