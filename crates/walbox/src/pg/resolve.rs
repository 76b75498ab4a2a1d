//! A connection string naming several servers (`host=a,b port=5432,5433
//! target_session_attrs=read-write`, or `postgresql://a:5432,b:5433/db?...`),
//! pinned to the one server a session uses: the first, in the order given, that
//! answers and has the kind `target_session_attrs` asks for, as libpq picks it.
//! The SQL and the replication connection of a session then both go to that
//! server, and after a promotion the next session finds the new primary. Asked
//! for the one server that accepts writes, every server is asked, and two
//! primaries (an old one back beside the promoted one) are refused.

use std::time::Duration;

use anyhow::{Result, bail};
use tokio_postgres::config::{Host, TargetSessionAttrs};

use super::ConnParams;

/// How long one server may take to answer when no `connect_timeout` is given.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The kind of server `target_session_attrs` asks for (libpq's values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TargetSession {
    /// Any server that answers (the default).
    #[default]
    Any,
    /// A server whose sessions accept writes (`transaction_read_only = off`).
    ReadWrite,
    /// A server whose sessions do not accept writes.
    ReadOnly,
    /// A server not in recovery.
    Primary,
    /// A server in recovery (a standby).
    Standby,
    /// A standby if one answers, else any server.
    PreferStandby,
}

impl std::str::FromStr for TargetSession {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "any" => Self::Any,
            "read-write" => Self::ReadWrite,
            "read-only" => Self::ReadOnly,
            "primary" => Self::Primary,
            "standby" => Self::Standby,
            "prefer-standby" => Self::PreferStandby,
            _ => bail!(
                "invalid connection string: target_session_attrs must be one of any, \
                 read-write, read-only, primary, standby, prefer-standby"
            ),
        })
    }
}

impl TargetSession {
    /// The closest setting tokio-postgres knows, for SQL connections that are
    /// not pinned.
    pub(super) fn driver(self) -> TargetSessionAttrs {
        match self {
            Self::ReadWrite | Self::Primary => TargetSessionAttrs::ReadWrite,
            Self::ReadOnly | Self::Standby => TargetSessionAttrs::ReadOnly,
            Self::Any | Self::PreferStandby => TargetSessionAttrs::Any,
        }
    }

    /// libpq's name of the setting's value.
    fn name(self) -> &'static str {
        match self {
            Self::Any => "any",
            Self::ReadWrite => "read-write",
            Self::ReadOnly => "read-only",
            Self::Primary => "primary",
            Self::Standby => "standby",
            Self::PreferStandby => "prefer-standby",
        }
    }

    /// What a server must be, in words, for logs and errors.
    fn describe(self) -> &'static str {
        match self {
            Self::Any | Self::PreferStandby => "that answers",
            Self::ReadWrite => "that accepts writes",
            Self::ReadOnly => "that is read-only",
            Self::Primary => "that is a primary",
            Self::Standby => "that is a standby",
        }
    }

    /// Whether at most one server may be of this kind: a second one means a
    /// split brain, so every server is asked, not only up to the first that
    /// qualifies.
    fn one_at_most(self) -> bool {
        matches!(self, Self::ReadWrite | Self::Primary)
    }

    /// Whether a server in this state qualifies.
    fn accepts(self, in_recovery: bool, read_only: bool) -> bool {
        match self {
            Self::Any | Self::PreferStandby => true,
            Self::ReadWrite => !read_only,
            Self::ReadOnly => read_only,
            Self::Primary => !in_recovery,
            Self::Standby => in_recovery,
        }
    }
}

impl ConnParams {
    /// How many servers the string names.
    pub fn host_count(&self) -> usize {
        self.pg.get_hosts().len()
    }

    /// These parameters with only the `index`-th server (its host, port and
    /// `hostaddr`), asking for any kind of server.
    pub fn pinned(&self, index: usize) -> ConnParams {
        let src = &self.pg;
        let mut pg = tokio_postgres::Config::new();
        if let Some(u) = src.get_user() {
            pg.user(u);
        }
        if let Some(p) = src.get_password() {
            pg.password(p);
        }
        if let Some(d) = src.get_dbname() {
            pg.dbname(d);
        }
        if let Some(o) = src.get_options() {
            pg.options(o);
        }
        if let Some(a) = src.get_application_name() {
            pg.application_name(a);
        }
        match src.get_hosts().get(index) {
            Some(Host::Tcp(h)) => {
                pg.host(h);
            }
            Some(Host::Unix(p)) => {
                pg.host_path(p);
            }
            None => {}
        }
        if let Some(a) = src.get_hostaddrs().get(index) {
            pg.hostaddr(*a);
        }
        let ports = src.get_ports();
        if let Some(p) = ports.get(index).or_else(|| ports.first()) {
            pg.port(*p);
        }
        if let Some(t) = src.get_connect_timeout() {
            pg.connect_timeout(*t);
        }
        if let Some(t) = src.get_tcp_user_timeout() {
            pg.tcp_user_timeout(*t);
        }
        pg.keepalives(src.get_keepalives());
        pg.keepalives_idle(src.get_keepalives_idle());
        if let Some(i) = src.get_keepalives_interval() {
            pg.keepalives_interval(i);
        }
        if let Some(r) = src.get_keepalives_retries() {
            pg.keepalives_retries(r);
        }
        pg.channel_binding(src.get_channel_binding());
        ConnParams {
            pg,
            target: TargetSession::Any,
            ..self.clone()
        }
    }

    /// The server a session uses: with one server and no `target_session_attrs`,
    /// these parameters as they are; otherwise the first server, in the order
    /// given, that answers and is of the kind asked for (for `prefer-standby`, a
    /// standby first), pinned with [`pinned`](Self::pinned). Logs the choice
    /// (host and port).
    ///
    /// For `read-write` and `primary` with several servers, every server is
    /// asked: when two different servers accept writes, an old primary came back
    /// beside the promoted one, and either choice would publish one of them and
    /// lose the other's events, so the session is refused.
    ///
    /// # Errors
    /// The last connection error when no server answers; an error naming what
    /// was asked for when servers answer but none qualifies (while a standby is
    /// being promoted, say); [`TwoPrimaries`] when several servers qualify for
    /// `read-write` or `primary`.
    pub async fn resolve(&self) -> Result<ConnParams> {
        let count = self.host_count();
        if count <= 1 && self.target == TargetSession::Any {
            return Ok(self.clone());
        }
        let timeout = self
            .pg
            .get_connect_timeout()
            .copied()
            .unwrap_or(DEFAULT_CONNECT_TIMEOUT);
        let mut states = Vec::new();
        let mut qualified = Vec::new();
        let mut last_error = None;
        for index in 0..count.max(1) {
            let candidate = self.pinned(index);
            match tokio::time::timeout(timeout, server_state(&candidate)).await {
                Ok(Ok(state)) => {
                    states.push((index, state.in_recovery));
                    let wanted = match self.target {
                        TargetSession::PreferStandby => state.in_recovery,
                        other => other.accepts(state.in_recovery, state.read_only),
                    };
                    if wanted && !(self.target.one_at_most() && count > 1) {
                        return Ok(chosen(candidate, self.target));
                    }
                    if wanted {
                        qualified.push((index, state));
                    }
                }
                Ok(Err(e)) => {
                    tracing::debug!(server = %candidate.describe(), error = %format!("{e:#}"),
                        "server did not answer");
                    last_error = Some(e);
                }
                Err(_) => {
                    tracing::debug!(server = %candidate.describe(), "server did not answer in time");
                    last_error = Some(
                        NoServer {
                            message: format!(
                                "connecting to {}: no answer within {timeout:?} \
                                 (connect_timeout)",
                                candidate.describe()
                            ),
                        }
                        .into(),
                    );
                }
            }
        }
        match only_one(&qualified) {
            Ok(Some(index)) => return Ok(chosen(self.pinned(index), self.target)),
            Ok(None) => {}
            Err(several) => {
                let servers: Vec<String> = several
                    .iter()
                    .map(|(index, state)| {
                        let timeline = state.timeline.map_or_else(
                            || "timeline unknown".to_owned(),
                            |t| format!("timeline {t}"),
                        );
                        format!("{} ({timeline})", self.pinned(*index).server())
                    })
                    .collect();
                return Err(TwoPrimaries {
                    message: format!(
                        "two primaries: the servers {} all accept writes \
                         (target_session_attrs={}). One of them is an old primary that was not \
                         fenced after a failover; publishing from either would lose the events \
                         committed on the other. Fence the old primary (stop it, or make it a \
                         standby of the new one; the new primary is normally the one on the \
                         later timeline), then start walbox again",
                        servers.join(", "),
                        self.target.name()
                    ),
                }
                .into());
            }
        }
        if self.target == TargetSession::PreferStandby
            && let Some((index, _)) = states.first()
        {
            return Ok(chosen(self.pinned(*index), self.target));
        }
        if states.is_empty()
            && let Some(e) = last_error
        {
            return Err(e);
        }
        let servers: Vec<String> = (0..count).map(|i| self.pinned(i).server()).collect();
        Err(NoServer {
            message: format!(
                "none of the servers {} is a server {} (target_session_attrs); {} of them \
                 answered. While a standby is being promoted this passes; otherwise name the \
                 primary in the connection string",
                servers.join(", "),
                self.target.describe(),
                states.len()
            ),
        }
        .into())
    }

    /// `host:port` of the first server, for logs.
    pub fn server(&self) -> String {
        format!("{}:{}", self.host().unwrap_or_default(), self.port())
    }
}

/// Servers answered but none is of the kind asked for, or the last one tried
/// did not answer in time: may pass later (once a standby is promoted, say).
#[derive(Debug)]
pub struct NoServer {
    message: String,
}

impl std::fmt::Display for NoServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for NoServer {}

/// Several different servers accept writes where one primary was asked for: a
/// split brain that only fencing the old primary ends. Not retried.
#[derive(Debug)]
pub struct TwoPrimaries {
    message: String,
}

impl std::fmt::Display for TwoPrimaries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for TwoPrimaries {}

/// What a server said about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ServerState {
    in_recovery: bool,
    read_only: bool,
    /// The timeline it writes (`None` in recovery).
    timeline: Option<u32>,
    /// When its postmaster started: two entries of the list with the same
    /// start are one server under two names.
    started: String,
}

/// The one server of those that qualified (`None`: none did), or all of them
/// when they are different servers.
fn only_one(qualified: &[(usize, ServerState)]) -> Result<Option<usize>, &[(usize, ServerState)]> {
    match qualified.first() {
        None => Ok(None),
        Some((index, first)) if qualified.iter().all(|(_, s)| s.started == first.started) => {
            Ok(Some(*index))
        }
        Some(_) => Err(qualified),
    }
}

fn chosen(params: ConnParams, target: TargetSession) -> ConnParams {
    tracing::info!(host = %params.host().unwrap_or_default(), port = params.port(),
        target_session_attrs = ?target, "connecting to the server {}", target.describe());
    params
}

/// The state of the server `params` names.
async fn server_state(params: &ConnParams) -> Result<ServerState> {
    let sql = params.connect().await?;
    let row = sql
        .query_one(
            "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on',
                    CASE WHEN pg_is_in_recovery() THEN NULL
                         ELSE pg_walfile_name(pg_current_wal_lsn()) END,
                    pg_postmaster_start_time()::text",
            &[],
        )
        .await?;
    let walfile: Option<String> = row.get(2);
    Ok(ServerState {
        in_recovery: row.get(0),
        read_only: row.get(1),
        timeline: walfile.and_then(|f| u32::from_str_radix(f.get(..8)?, 16).ok()),
        started: row.get(3),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_server_of_a_list_is_pinned_with_its_port_and_the_shared_settings() {
        let c = ConnParams::parse(
            "host=a,b port=5432,5433 user=walbox password=x dbname=app connect_timeout=3 \
             target_session_attrs=read-write sslmode=require",
        )
        .unwrap();
        assert_eq!(c.host_count(), 2);
        assert_eq!(c.target, TargetSession::ReadWrite);
        let b = c.pinned(1);
        assert_eq!(b.describe(), "walbox@b:5433/app");
        assert_eq!(b.host_count(), 1);
        assert_eq!(b.pg.get_password(), Some(&b"x"[..]));
        assert_eq!(b.pg.get_connect_timeout(), Some(&Duration::from_secs(3)));
        assert_eq!(b.sslmode, super::super::SslMode::Require);
        assert_eq!(b.target, TargetSession::Any);
        assert_eq!(b.replication("s", "p").unwrap().host, "b");
        // One port for every host.
        let one = ConnParams::parse("host=a,b port=6000").unwrap();
        assert_eq!(one.pinned(1).server(), "b:6000");
    }

    #[test]
    fn the_replication_connection_goes_to_the_address_the_sql_connection_uses() {
        use std::net::{IpAddr, Ipv4Addr};
        let c = ConnParams::parse(
            "host=a.example,b.example hostaddr=10.0.0.1,10.0.0.2 port=5432,5433 \
             user=walbox dbname=app sslmode=require target_session_attrs=read-write",
        )
        .unwrap();
        for (index, addr, name, port) in [
            (0, [10, 0, 0, 1], "a.example", 5432),
            (1, [10, 0, 0, 2], "b.example", 5433),
        ] {
            let pinned = c.pinned(index);
            let addr = Ipv4Addr::from(addr);
            assert_eq!(pinned.pg.get_hostaddrs(), [IpAddr::V4(addr)]);
            let r = pinned.replication("s", "p").unwrap();
            assert_eq!(r.host, addr.to_string(), "the address the SQL check used");
            assert_eq!(r.port, port);
            // The certificate is verified against the name, as libpq does.
            assert_eq!(r.tls.sni_hostname.as_deref(), Some(name));
        }
        // An address alone: connected to and verified as itself.
        let r = ConnParams::parse("hostaddr=10.0.0.9 user=walbox dbname=app")
            .unwrap()
            .replication("s", "p")
            .unwrap();
        assert_eq!(r.host, "10.0.0.9");
        assert_eq!(r.tls.sni_hostname, None);
        // A name alone: no address to pin, the name is resolved as before.
        let r = ConnParams::parse("host=a.example user=walbox dbname=app")
            .unwrap()
            .replication("s", "p")
            .unwrap();
        assert_eq!(r.host, "a.example");
        assert_eq!(r.tls.sni_hostname, None);
    }

    #[test]
    fn the_uri_form_names_several_servers_and_the_kind_asked_for() {
        let c =
            ConnParams::parse("postgresql://walbox@a:5432,b:5433/app?target_session_attrs=primary")
                .unwrap();
        assert_eq!(c.host_count(), 2);
        assert_eq!(c.target, TargetSession::Primary);
        assert_eq!(c.pinned(0).server(), "a:5432");
        assert_eq!(c.pinned(1).server(), "b:5433");
    }

    #[test]
    fn two_different_servers_accepting_writes_are_not_a_choice() {
        let server = |timeline, started: &str| ServerState {
            in_recovery: false,
            read_only: false,
            timeline: Some(timeline),
            started: started.to_owned(),
        };
        assert_eq!(only_one(&[]), Ok(None));
        assert_eq!(only_one(&[(1, server(2, "t1"))]), Ok(Some(1)));
        // One server named twice (a name and its address, say).
        assert_eq!(
            only_one(&[(0, server(1, "t1")), (2, server(1, "t1"))]),
            Ok(Some(0))
        );
        let two = [(0, server(1, "t0")), (1, server(2, "t1"))];
        assert_eq!(only_one(&two), Err(&two[..]));
        assert!(TargetSession::ReadWrite.one_at_most());
        assert!(TargetSession::Primary.one_at_most());
        assert!(!TargetSession::Any.one_at_most());
        assert!(!TargetSession::PreferStandby.one_at_most());
    }

    #[test]
    fn each_kind_accepts_its_servers() {
        use TargetSession::*;
        // (in recovery, read-only)
        let primary = (false, false);
        let standby = (true, true);
        for (kind, on_primary, on_standby) in [
            (Any, true, true),
            (ReadWrite, true, false),
            (ReadOnly, false, true),
            (Primary, true, false),
            (Standby, false, true),
        ] {
            assert_eq!(kind.accepts(primary.0, primary.1), on_primary, "{kind:?}");
            assert_eq!(kind.accepts(standby.0, standby.1), on_standby, "{kind:?}");
        }
        let err = "sometimes"
            .parse::<TargetSession>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("target_session_attrs"), "{err}");
        assert!(err.contains("read-write"), "{err}");
        assert!(!err.contains("sometimes"), "the value is not quoted: {err}");
    }
}
