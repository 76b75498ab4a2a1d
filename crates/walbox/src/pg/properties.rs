//! Property tests of connection-string parsing: any input is refused or read
//! without a panic; a password never shows in an error, in `describe()` or in
//! `Debug`; key=value and URI strings written from known settings (quotes,
//! escapes, percent-encoding, several hosts) read back as those settings.
//! `PROPTEST_CASES` sets the number of cases.

use proptest::prelude::*;
use tokio_postgres::config::Host;

use super::{ConnParams, Env};

/// Settings a connection string is written from.
#[derive(Debug, Clone)]
struct Fields {
    user: String,
    /// Words of upper-case letters joined by separators that need quoting,
    /// escaping or percent-encoding. No error message has such a word, so
    /// finding one in an error means a leak.
    password_words: Vec<String>,
    password: String,
    dbname: String,
    hosts: Vec<(String, Option<u16>)>,
    application_name: Option<String>,
}

fn host() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z][a-z0-9-]{0,12}(\\.[a-z][a-z0-9-]{0,8}){0,2}",
        (0u8..=255, 0u8..=255, 0u8..=255, 1u8..=254)
            .prop_map(|(a, b, c, d)| format!("{a}.{b}.{c}.{d}")),
        Just("::1".to_owned()),
        Just("fe80::1:2".to_owned()),
    ]
}

fn fields() -> impl Strategy<Value = Fields> {
    (
        "[a-z][a-z0-9_.@ ]{0,10}",
        prop::collection::vec("[A-Z]{6,10}", 1..4),
        prop::collection::vec("[ '\\\\=@:/?&%,#é\t]{1,3}", 3),
        "[a-z_ /'\\\\%?&=#é]{1,12}",
        prop::collection::vec((host(), prop::option::of(1u16..)), 1..4),
        prop::option::of("[a-z '\\\\%&=]{1,10}"),
    )
        .prop_map(|(user, words, seps, dbname, hosts, application_name)| {
            let mut password = String::new();
            for (i, w) in words.iter().enumerate() {
                if i > 0 {
                    password.push_str(&seps[i - 1]);
                }
                password.push_str(w);
            }
            Fields {
                user,
                password_words: words,
                password,
                dbname,
                hosts,
                application_name,
            }
        })
}

/// A value for key=value: quoted, or unquoted with backslash escapes.
fn kv_value(value: &str, quoted: bool) -> String {
    if quoted {
        return super::dsn::quote(value);
    }
    let mut out = String::new();
    for c in value.chars() {
        if c.is_whitespace() || c == '\'' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn ports(f: &Fields) -> Option<String> {
    f.hosts.iter().any(|(_, p)| p.is_some()).then(|| {
        f.hosts
            .iter()
            .map(|(_, p)| p.map(|p| p.to_string()).unwrap_or_default())
            .collect::<Vec<_>>()
            .join(",")
    })
}

fn key_value(f: &Fields, quoted: &[bool], spaces: &[&str]) -> String {
    let hosts = f
        .hosts
        .iter()
        .map(|(h, _)| h.as_str())
        .collect::<Vec<_>>()
        .join(",");
    let mut pairs = vec![
        ("user", f.user.clone()),
        ("password", f.password.clone()),
        ("dbname", f.dbname.clone()),
        ("host", hosts),
    ];
    if let Some(p) = ports(f) {
        pairs.push(("port", p));
    }
    if let Some(a) = &f.application_name {
        pairs.push(("application_name", a.clone()));
    }
    pairs
        .iter()
        .enumerate()
        .map(|(i, (k, v))| {
            let sp = spaces[i % spaces.len()];
            format!("{k}{sp}={sp}{}", kv_value(v, quoted[i % quoted.len()]))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn uri(f: &Fields, scheme: &str) -> String {
    let hosts = f
        .hosts
        .iter()
        .map(|(h, p)| {
            let h = if h.contains(':') {
                format!("[{h}]")
            } else {
                h.clone()
            };
            match p {
                Some(p) => format!("{h}:{p}"),
                None => h,
            }
        })
        .collect::<Vec<_>>()
        .join(",");
    let mut s = format!(
        "{scheme}://{}:{}@{hosts}/{}",
        encode(&f.user),
        encode(&f.password),
        encode(&f.dbname)
    );
    if let Some(a) = &f.application_name {
        s.push_str(&format!("?application_name={}", encode(a)));
    }
    s
}

/// Percent-encodes `s` except `@`, which a user may leave unencoded in a
/// password: the user part ends at the authority's last `@`.
fn encode_but_at(s: &str) -> String {
    encode(s).replace("%40", "@")
}

fn check_read_back(c: &ConnParams, f: &Fields) {
    assert_eq!(c.pg.get_user(), Some(f.user.as_str()));
    assert_eq!(c.pg.get_password(), Some(f.password.as_bytes()));
    assert_eq!(c.pg.get_dbname(), Some(f.dbname.as_str()));
    assert_eq!(c.pg.get_application_name(), f.application_name.as_deref());
    let hosts: Vec<String> =
        c.pg.get_hosts()
            .iter()
            .map(|h| match h {
                Host::Tcp(h) => h.clone(),
                Host::Unix(p) => p.display().to_string(),
            })
            .collect();
    let want: Vec<String> = f.hosts.iter().map(|(h, _)| h.clone()).collect();
    assert_eq!(hosts, want);
    let want_ports: Vec<u16> = if ports(f).is_some() {
        f.hosts.iter().map(|(_, p)| p.unwrap_or(5432)).collect()
    } else {
        Vec::new()
    };
    assert_eq!(c.pg.get_ports(), want_ports.as_slice());
}

/// No word of the password in `text`.
fn assert_no_password(text: &str, f: &Fields) {
    for w in &f.password_words {
        assert!(
            !text.contains(w.as_str()),
            "password word {w:?} in {text:?}"
        );
    }
}

proptest! {
    #[test]
    fn any_input_is_read_or_refused_without_panic(s in any::<String>()) {
        let _ = ConnParams::parse_with(&s, &Env::empty());
        let _ = ConnParams::parse_with(&format!("postgresql://{s}"), &Env::empty());
        let _ = ConnParams::parse_with(&format!("password={s}"), &Env::empty());
    }

    #[test]
    fn uri_like_garbage_is_read_or_refused_without_panic(
        s in "postgres(ql)?://[a-z:@%/?&=,\\[\\]0-9A-F.]{0,40}"
    ) {
        let _ = ConnParams::parse_with(&s, &Env::empty());
    }

    #[test]
    fn key_value_strings_read_back(
        f in fields(),
        quoted in prop::collection::vec(any::<bool>(), 1..8),
        spaces in prop::collection::vec(prop_oneof![Just(""), Just(" "), Just("\t ")], 1..4),
    ) {
        let dsn = key_value(&f, &quoted, &spaces);
        let c = ConnParams::parse_with(&dsn, &Env::empty()).unwrap();
        check_read_back(&c, &f);
        assert_no_password(&c.describe(), &f);
        assert_no_password(&format!("{c:?}"), &f);
    }

    #[test]
    fn uris_read_back(f in fields(), long in any::<bool>()) {
        let dsn = uri(&f, if long { "postgresql" } else { "postgres" });
        let c = ConnParams::parse_with(&dsn, &Env::empty()).unwrap();
        check_read_back(&c, &f);
        assert_no_password(&c.describe(), &f);
        assert_no_password(&format!("{c:?}"), &f);
    }

    #[test]
    fn an_unencoded_at_in_a_uri_password_stays_in_the_password(f in fields()) {
        let mut f = f;
        f.password = f.password_words.join("@");
        let dsn = uri(&f, "postgresql").replacen(&encode(&f.password), &encode_but_at(&f.password), 1);
        let c = ConnParams::parse_with(&dsn, &Env::empty()).unwrap();
        check_read_back(&c, &f);
        assert_no_password(&c.describe(), &f);
        assert_no_password(&format!("{c:?}"), &f);
    }

    /// Damaged strings (a character inserted or removed anywhere, the string
    /// cut short) are refused or read; either way no password word shows.
    #[test]
    fn a_password_never_shows_in_errors(
        f in fields(),
        as_uri in any::<bool>(),
        quoted in prop::collection::vec(any::<bool>(), 1..8),
        at in any::<prop::sample::Index>(),
        cut in any::<prop::sample::Index>(),
        action in 0..3u8,
        insert in prop::sample::select(vec![' ', '\'', '\\', '=', '%', '@', ':', '/', '?', '&', ',', '[', ']']),
    ) {
        let dsn = if as_uri { uri(&f, "postgresql") } else { key_value(&f, &quoted, &[" "]) };
        let mut chars: Vec<char> = dsn.chars().collect();
        let i = at.index(chars.len() + 1);
        match action {
            0 => chars.insert(i, insert),
            1 if i < chars.len() => { chars.remove(i); }
            _ => chars.truncate(cut.index(chars.len() + 1)),
        }
        let damaged: String = chars.into_iter().collect();
        match ConnParams::parse_with(&damaged, &Env::empty()) {
            Ok(c) => {
                // A damaged string can move password text into another field
                // (`user=upassword=...` once a space is lost), which then shows
                // as that field; nothing else may show it.
                let mut shown = c.describe();
                let fields = [c.pg.get_user(), c.pg.get_dbname()]
                    .into_iter()
                    .flatten()
                    .map(str::to_owned)
                    .chain(c.pg.get_hosts().iter().map(|h| match h {
                        Host::Tcp(h) => h.clone(),
                        Host::Unix(p) => p.display().to_string(),
                    }))
                    .collect::<Vec<_>>();
                for field in &fields {
                    shown = shown.replace(field.as_str(), "");
                }
                shown.push_str(&format!("{c:?}"));
                for field in &fields {
                    shown = shown.replace(field.as_str(), "");
                }
                assert_no_password(&shown, &f);
            }
            Err(e) => {
                assert_no_password(&format!("{e:#}"), &f);
                assert_no_password(&format!("{e:?}"), &f);
            }
        }
    }
}
