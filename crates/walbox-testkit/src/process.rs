//! Process plumbing shared by the Postgres and broker launchers.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::{Pid, Uid, User, chown};

use crate::{Result, TestkitError, wait_until};

/// A port on 127.0.0.1 that was free a moment ago.
pub(crate) fn free_port() -> Result<u16> {
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(TestkitError::io("binding", "127.0.0.1:0"))?;
    let port = listener
        .local_addr()
        .map_err(TestkitError::io("reading address of", "127.0.0.1:0"))?
        .port();
    Ok(port)
}

/// Runs `launch` on free ports until one works, and gives that port: a port
/// found free can be taken by another process before the server binds it, so
/// five ports are tried before the last error is given.
pub(crate) fn launch_on_free_port(mut launch: impl FnMut(u16) -> Result<()>) -> Result<u16> {
    let mut tries = 0;
    loop {
        let port = free_port()?;
        match launch(port) {
            Ok(()) => return Ok(port),
            Err(e) if tries == 4 => return Err(e),
            Err(_) => tries += 1,
        }
    }
}

/// The unprivileged account servers run as when the caller is root (PostgreSQL
/// refuses to run as root). `WALBOX_TEST_USER` overrides the default `nobody`.
pub(crate) fn server_user() -> Result<Option<User>> {
    if !Uid::effective().is_root() {
        return Ok(None);
    }
    let name = std::env::var("WALBOX_TEST_USER").unwrap_or_else(|_| "nobody".to_owned());
    let user = User::from_name(&name)
        .map_err(|source| TestkitError::Sys {
            action: "looking up the test user",
            source,
        })?
        .ok_or_else(|| TestkitError::MissingProgram {
            program: format!("user {name}"),
            hint: "set WALBOX_TEST_USER to an existing unprivileged account".into(),
        })?;
    Ok(Some(user))
}

/// Hands `path` (and everything under it) to `user`.
pub(crate) fn give_to(user: Option<&User>, path: &Path) -> Result<()> {
    let Some(user) = user else { return Ok(()) };
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        chown(&p, Some(user.uid), Some(user.gid)).map_err(|source| TestkitError::Sys {
            action: "chown of a test directory",
            source,
        })?;
        if p.is_dir() {
            for entry in std::fs::read_dir(&p).map_err(TestkitError::io("listing", &p))? {
                stack.push(entry.map_err(TestkitError::io("listing", &p))?.path());
            }
        }
    }
    Ok(())
}

/// A command that runs as `user` (when given) in a process group of its own, so the
/// server and every process it forks can be signalled together.
pub(crate) fn command(program: &Path, user: Option<&User>) -> Command {
    let mut cmd = Command::new(program);
    if let Some(user) = user {
        cmd.uid(user.uid.as_raw()).gid(user.gid.as_raw());
        cmd.env("HOME", &user.dir).env("USER", &user.name);
    }
    cmd.process_group(0);
    cmd
}

/// Runs `cmd` to completion, failing with its output when it fails.
pub(crate) fn run(mut cmd: Command) -> Result<()> {
    let line = format!("{cmd:?}");
    let out = cmd
        .output()
        .map_err(TestkitError::io("running", cmd.get_program()))?;
    if out.status.success() {
        return Ok(());
    }
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Err(TestkitError::CommandFailed {
        command: line,
        status: out.status,
        output: tail(&text, 2000),
    })
}

/// Sends `signal` to the process group led by `child`.
pub(crate) fn signal_group(child: &Child, signal: Signal) -> Result<()> {
    let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    match killpg(pid, signal) {
        Ok(()) | Err(nix::Error::ESRCH) => Ok(()),
        Err(source) => Err(TestkitError::Sys {
            action: "signalling a test server",
            source,
        }),
    }
}

/// Waits until every process of `child`'s group has exited and reaps the leader.
pub(crate) fn wait_group_gone(child: &mut Child, what: &str, timeout: Duration) -> Result<()> {
    let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    wait_until(&format!("{what} to exit"), timeout, || {
        let _ = child.try_wait();
        // Signal 0 checks for existence; ESRCH means no process of the group is left.
        matches!(killpg(pid, None), Err(nix::Error::ESRCH)).then_some(())
    })?;
    let _ = child.wait();
    Ok(())
}

/// Kills `child` and every process it started with SIGKILL, and waits until all
/// of them are gone.
///
/// PostgreSQL's backends each call `setsid()`, so they are not in the
/// postmaster's process group: a SIGKILL to the group leaves them running until
/// they notice the postmaster is gone, and a server started again meanwhile
/// refuses to run while they still hold its shared memory. The postmaster is
/// stopped first (it forks nothing more), its children are read from `/proc`,
/// then all are killed.
pub(crate) fn kill_tree(child: &mut Child, what: &str, timeout: Duration) -> Result<()> {
    let leader = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    let _ = kill(leader, Signal::SIGSTOP);
    // The stop takes effect when the kernel next schedules it; only then is the
    // list of its children final.
    let _ = wait_until(&format!("{what} to stop"), timeout, || {
        stat_fields(leader)
            .is_none_or(|(state, _)| matches!(state, 'T' | 't' | 'Z' | 'X'))
            .then_some(())
    });
    let children = children_of(leader);
    for pid in &children {
        let _ = kill(*pid, Signal::SIGKILL);
    }
    signal_group(child, Signal::SIGKILL)?;
    wait_group_gone(child, what, timeout)?;
    wait_until(
        &format!("the processes {what} started to exit"),
        timeout,
        || children.iter().all(|pid| !alive(*pid)).then_some(()),
    )
}

/// The processes whose parent is `parent`, from `/proc/<pid>/stat`.
fn children_of(parent: Pid) -> Vec<Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            stat_fields(Pid::from_raw(*pid)).is_some_and(|(_, ppid)| ppid == parent.as_raw())
        })
        .map(Pid::from_raw)
        .collect()
}

/// State and parent of `pid` from `/proc/<pid>/stat` (the fields after the
/// command name, which is in parentheses and may hold spaces).
fn stat_fields(pid: Pid) -> Option<(char, i32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = text.get(text.rfind(')')? + 1..)?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

/// Whether `pid` still runs: a zombie holds no memory and no files any more.
fn alive(pid: Pid) -> bool {
    stat_fields(pid).is_some_and(|(state, _)| state != 'Z' && state != 'X')
}

/// The server log at `path`, opened for appending, twice: for stdout and stderr.
pub(crate) fn log_files(path: &Path) -> Result<(std::fs::File, std::fs::File)> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(TestkitError::io("opening", path))?;
    let err = log.try_clone().map_err(TestkitError::io("opening", path))?;
    Ok((log, err))
}

/// The last `max` bytes of `text`, on a character boundary.
pub(crate) fn tail(text: &str, max: usize) -> String {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text.get(start..).unwrap_or_default().to_owned()
}

/// The last part of a log file, for error messages.
pub(crate) fn log_tail(path: &Path) -> String {
    std::fs::read_to_string(path)
        .map(|t| tail(&t, 3000))
        .unwrap_or_else(|e| format!("(no log at {}: {e})", path.display()))
}
