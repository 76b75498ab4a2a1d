//! The syntax of libpq connection strings: `key=value` pairs (single quotes, `\'`
//! and `\\` escapes) and `postgres://` / `postgresql://` URIs (percent-encoding,
//! `[v6]` addresses, several `host:port` entries). The result is the string's
//! settings in order, each under libpq's key name; what they mean is decided by
//! the caller.
//!
//! A connection string holds a password, so no error here quotes any of its text:
//! errors name a known key, a part of a URI, or a position (in characters, from 1).

use anyhow::{Result, anyhow, bail};

/// Keys walbox understands, with libpq's names.
pub const KEYS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "options",
    "application_name",
    "fallback_application_name",
    "connect_timeout",
    "tcp_user_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "target_session_attrs",
    "channel_binding",
    "load_balance_hosts",
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "service",
];

/// Keys libpq knows that walbox does not act on: refused by name rather than
/// silently ignored.
const UNSUPPORTED: &[&str] = &[
    "sslpassword",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "sslcompression",
    "sslcertmode",
    "sslnegotiation",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "requiressl",
    "requirepeer",
    "require_auth",
    "gssencmode",
    "gsslib",
    "gssdelegation",
    "krbsrvname",
    "replication",
];

/// A key as written, checked against the known ones. The error never quotes it:
/// an unknown "key" is often a piece of a value that lost its quotes.
fn known_key(key: &str, position: usize) -> Result<&'static str> {
    if let Some(k) = KEYS.iter().find(|k| **k == key) {
        return Ok(k);
    }
    if let Some(k) = UNSUPPORTED.iter().find(|k| **k == key) {
        bail!(
            "invalid connection string: walbox does not support the setting {k}; remove it \
             (the settings walbox reads are listed in docs/security.md)"
        );
    }
    bail!(
        "invalid connection string: unknown setting at position {position}; check its spelling, \
         and quote values that contain spaces as key='a value'"
    )
}

/// The settings of a connection string in order (a later one overrides an earlier
/// one with the same key). An empty or blank string has none.
pub fn parse(dsn: &str) -> Result<Vec<(&'static str, String)>> {
    if let Some(rest) = dsn
        .strip_prefix("postgresql://")
        .or_else(|| dsn.strip_prefix("postgres://"))
    {
        parse_uri(rest)
    } else {
        parse_key_value(dsn)
    }
}

fn parse_key_value(dsn: &str) -> Result<Vec<(&'static str, String)>> {
    let mut out = Vec::new();
    let mut chars = dsn.chars().enumerate().peekable();
    let skip_ws = |chars: &mut std::iter::Peekable<_>| {
        while chars
            .next_if(|(_, c): &(usize, char)| c.is_whitespace())
            .is_some()
        {}
    };
    loop {
        skip_ws(&mut chars);
        let Some(&(start, _)) = chars.peek() else {
            break;
        };
        let position = start + 1;
        let mut key = String::new();
        while let Some((_, c)) = chars.next_if(|(_, c)| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        skip_ws(&mut chars);
        if chars.next().is_none_or(|(_, c)| c != '=') {
            bail!(
                "invalid connection string: the word at position {position} is not followed by \"=\"; \
                 write key=value, and quote values that contain spaces as key='a value'"
            );
        }
        let key = known_key(&key, position)?;
        skip_ws(&mut chars);
        let mut value = String::new();
        if chars.next_if(|(_, c)| *c == '\'').is_some() {
            let mut closed = false;
            while let Some((_, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, n)) = chars.next() {
                            value.push(n);
                        }
                    }
                    '\'' => {
                        closed = true;
                        break;
                    }
                    c => value.push(c),
                }
            }
            if !closed {
                bail!(
                    "invalid connection string: the quoted value of {key} has no closing quote; \
                     end it with ' and write a quote inside it as \\'"
                );
            }
        } else {
            while let Some((_, c)) = chars.next_if(|(_, c)| !c.is_whitespace()) {
                if c == '\\' {
                    if let Some((_, n)) = chars.next() {
                        value.push(n);
                    }
                } else {
                    value.push(c);
                }
            }
        }
        out.push((key, value));
    }
    Ok(out)
}

/// Percent-decodes `s`, one part of a URI named by `part` in errors.
fn decode(s: &str, part: &str) -> Result<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let byte = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    anyhow!(
                        "invalid connection string: the {part} in the URI has a \"%\" not followed \
                         by two hex digits; write a literal % as %25"
                    )
                })?;
            if byte == 0 {
                bail!(
                    "invalid connection string: the {part} in the URI contains %00, which libpq refuses too"
                );
            }
            out.push(byte);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| {
        anyhow!(
            "invalid connection string: the {part} in the URI is not UTF-8 once percent-decoded"
        )
    })
}

/// `[user[:password]@][host[:port][,...]][/dbname][?key=value&...]`, after the scheme.
fn parse_uri(rest: &str) -> Result<Vec<(&'static str, String)>> {
    let mut out = Vec::new();
    // The authority ends at the path or the query; its user part ends at its
    // last '@', as URL parsers have it, so that an unencoded '@' in a password
    // stays in the password instead of turning its tail into the host.
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let (userinfo, rest) = match authority.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    if let Some(userinfo) = userinfo {
        let (user, password) = match userinfo.split_once(':') {
            Some((u, p)) => (u, Some(p)),
            None => (userinfo, None),
        };
        if !user.is_empty() {
            out.push(("user", decode(user, "user name")?));
        }
        if let Some(p) = password {
            out.push(("password", decode(p, "password")?));
        }
    }
    let netloc_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (netloc, rest) = rest.split_at(netloc_end);
    let mut hosts = Vec::new();
    let mut ports = Vec::new();
    if !netloc.is_empty() {
        for entry in netloc.split(',') {
            let (host, port) = if let Some(v6) = entry.strip_prefix('[') {
                let (addr, after) = v6.split_once(']').ok_or_else(|| {
                    anyhow!(
                        "invalid connection string: an IPv6 address in the URI has no closing \"]\""
                    )
                })?;
                let port = match after {
                    "" => None,
                    p => Some(p.strip_prefix(':').ok_or_else(|| {
                        anyhow!(
                            "invalid connection string: expected \":\" and a port after an IPv6 \
                             address in the URI"
                        )
                    })?),
                };
                (addr.to_owned(), port)
            } else {
                // The host ends at the first ':' (libpq's rule).
                match entry.split_once(':') {
                    Some((h, p)) => (decode(h, "host")?, Some(p)),
                    None => (decode(entry, "host")?, None),
                }
            };
            let port = match port {
                Some(p) => {
                    let p = decode(p, "port")?;
                    if p.parse::<u16>().is_err() {
                        bail!(
                            "invalid connection string: a port in the URI is not a number from 0 to 65535"
                        );
                    }
                    p
                }
                None => String::new(),
            };
            hosts.push(host);
            ports.push(port);
        }
    }
    if hosts.iter().any(|h| !h.is_empty()) {
        out.push(("host", hosts.join(",")));
    }
    if ports.iter().any(|p| !p.is_empty()) {
        out.push(("port", ports.join(",")));
    }
    let (path, query) = match rest.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (rest, None),
    };
    if let Some(db) = path.strip_prefix('/')
        && !db.is_empty()
    {
        out.push(("dbname", decode(db, "database name")?));
    }
    for (n, pair) in query.into_iter().flat_map(|q| q.split('&')).enumerate() {
        if pair.is_empty() {
            continue;
        }
        let Some((k, v)) = pair.split_once('=') else {
            bail!(
                "invalid connection string: parameter {} of the URI has no \"=\"; write ?key=value&key=value",
                n + 1
            );
        };
        let k = decode(k, "parameter name")?;
        let v = decode(v, "parameter value")?;
        let position = n + 1;
        // libpq's JDBC-style alias.
        if k == "ssl" {
            if v == "true" {
                out.push(("sslmode", "require".to_owned()));
                continue;
            }
            bail!("invalid connection string: the URI's ssl parameter can only be true");
        }
        let key = known_key(&k, position).map_err(|_| {
            anyhow!(
                "invalid connection string: parameter {position} of the URI is not a setting walbox \
                 knows; check its spelling"
            )
        })?;
        out.push((key, v));
    }
    Ok(out)
}

/// `value` quoted for a key=value string, read back as itself by libpq and
/// tokio-postgres.
pub fn quote(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('\'');
    for c in value.chars() {
        if c == '\'' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('\'');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get<'a>(pairs: &'a [(&str, String)], key: &str) -> Option<&'a str> {
        pairs
            .iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn key_value_quotes_and_escapes() {
        let p = parse(r"host = a  password='x \'y\' \\z' user=u\ v dbname=").unwrap();
        assert_eq!(get(&p, "host"), Some("a"));
        assert_eq!(get(&p, "password"), Some(r"x 'y' \z"));
        assert_eq!(get(&p, "user"), Some("u v"));
        assert_eq!(get(&p, "dbname"), Some(""));
        assert!(parse("").unwrap().is_empty());
        assert!(parse("  \t ").unwrap().is_empty());
    }

    #[test]
    fn a_value_with_a_space_is_refused_by_position_not_by_text() {
        let err = parse("host=a password=ab cd").unwrap_err().to_string();
        assert!(!err.contains("cd"), "{err}");
        assert!(err.contains("position 20"), "{err}");
        let err = parse("host=a password=ab cd=ef").unwrap_err().to_string();
        assert!(!err.contains("cd") && !err.contains("ef"), "{err}");
        assert!(err.contains("position 20"), "{err}");
        let err = parse("password='ab").unwrap_err().to_string();
        assert!(err.contains("password") && !err.contains("ab"), "{err}");
        let err = parse("sslpassword=x").unwrap_err().to_string();
        assert!(err.contains("sslpassword"), "{err}");
    }

    #[test]
    fn uri_parts_are_percent_decoded() {
        let p = parse("postgresql://us%20er:p%40ss%3Aw@h%2Fx:5433/d%62?application_name=a%26b&sslmode=require")
            .unwrap();
        assert_eq!(get(&p, "user"), Some("us er"));
        assert_eq!(get(&p, "password"), Some("p@ss:w"));
        assert_eq!(get(&p, "host"), Some("h/x"));
        assert_eq!(get(&p, "port"), Some("5433"));
        assert_eq!(get(&p, "dbname"), Some("db"));
        assert_eq!(get(&p, "application_name"), Some("a&b"));
        assert_eq!(get(&p, "sslmode"), Some("require"));
    }

    #[test]
    fn uri_with_several_hosts_and_v6() {
        let p = parse("postgres://u@a:1,b,[::1]:3/db").unwrap();
        assert_eq!(get(&p, "host"), Some("a,b,::1"));
        assert_eq!(get(&p, "port"), Some("1,,3"));
        let p = parse("postgres://a,b/db").unwrap();
        assert_eq!(get(&p, "host"), Some("a,b"));
        assert_eq!(get(&p, "port"), None);
        let p = parse("postgres:///db?host=/run/pg").unwrap();
        assert_eq!(get(&p, "host"), Some("/run/pg"));
        let p = parse("postgres://").unwrap();
        assert!(p.is_empty());
    }

    #[test]
    fn uri_errors_name_the_part() {
        for (uri, part) in [
            ("postgres://u:se%zzcret@h/db", "password"),
            ("postgres://h:port/db", "port"),
            ("postgres://h/db?secretvalue", "parameter 1"),
            (
                "postgres://h/db?application_name=x&nosuch=secretvalue",
                "parameter 2",
            ),
        ] {
            let err = parse(uri).unwrap_err().to_string();
            assert!(err.contains(part), "{uri}: {err}");
            assert!(!err.contains("secret"), "{uri}: {err}");
        }
    }

    #[test]
    fn an_unencoded_at_in_the_password_stays_in_the_password() {
        let p = parse("postgresql://walbox:p@ss@db/app").unwrap();
        assert_eq!(get(&p, "user"), Some("walbox"));
        assert_eq!(get(&p, "password"), Some("p@ss"));
        assert_eq!(get(&p, "host"), Some("db"));
        assert_eq!(get(&p, "dbname"), Some("app"));
        // The authority ends at the path or the query: an '@' after it is data.
        let p = parse("postgres://h?application_name=a@b").unwrap();
        assert_eq!(get(&p, "host"), Some("h"));
        assert_eq!(get(&p, "user"), None);
        assert_eq!(get(&p, "application_name"), Some("a@b"));
        let p = parse("postgres://u@h/d@b").unwrap();
        assert_eq!(get(&p, "user"), Some("u"));
        assert_eq!(get(&p, "dbname"), Some("d@b"));
    }

    #[test]
    fn quote_round_trips() {
        for v in ["", "a b", r"it's \ here", "=", "'"] {
            let p = parse(&format!("password={}", quote(v))).unwrap();
            assert_eq!(get(&p, "password"), Some(v));
        }
    }
}
