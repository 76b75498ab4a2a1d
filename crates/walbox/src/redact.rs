//! Secrets kept out of the log, whoever writes the line: walbox's own code
//! never prints one, but the client libraries log at `debug` and `trace` what
//! they see (async-nats its connection settings, librdkafka what its debug
//! contexts show, tokio-postgres its connection). Every secret the
//! configuration holds (the PostgreSQL password, from the connection string, the
//! environment, the service or password file; every secret Kafka property; the
//! NATS password, token, NKey seed and the credentials of a server URL) is
//! registered here once it is read, and every log line is written with each of
//! them replaced by `<redacted>`: as given, percent-encoded (a URL's form),
//! and escaped (a JSON string's and a `Debug` string's forms).

use std::borrow::Cow;
use std::io::{self, Write};
use std::sync::RwLock;

use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

/// What stands in for a secret.
const REDACTED: &str = "<redacted>";

/// The characters a URL's user information percent-encodes.
const USERINFO: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'`')
    .add(b'{')
    .add(b'}')
    .add(b'/')
    .add(b':')
    .add(b';')
    .add(b'=')
    .add(b'@')
    .add(b'[')
    .add(b'\\')
    .add(b']')
    .add(b'^')
    .add(b'|');

/// Every form of every secret registered so far, longest first.
#[derive(Default)]
struct Secrets(Vec<String>);

impl Secrets {
    const fn new() -> Self {
        Secrets(Vec::new())
    }

    fn add(&mut self, secret: &str) {
        if secret.is_empty() {
            return;
        }
        let quoted = |s: String| s[1..s.len() - 1].to_owned();
        let forms = [
            secret.to_owned(),
            utf8_percent_encode(secret, USERINFO).to_string(),
            quoted(serde_json::Value::from(secret).to_string()),
            quoted(format!("{secret:?}")),
        ];
        for form in forms {
            if !form.is_empty() && !self.0.contains(&form) {
                self.0.push(form);
            }
        }
        // A secret that holds another is replaced whole.
        self.0.sort_by_key(|s| std::cmp::Reverse(s.len()));
    }

    fn redact<'a>(&self, text: &'a str) -> Cow<'a, str> {
        let mut out = Cow::Borrowed(text);
        for secret in &self.0 {
            if out.contains(secret.as_str()) {
                out = Cow::Owned(out.replace(secret.as_str(), REDACTED));
            }
        }
        out
    }
}

static SECRETS: RwLock<Secrets> = RwLock::new(Secrets::new());

/// Keeps `secret` out of every log line written from now on.
pub fn keep_out(secret: &str) {
    SECRETS
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .add(secret);
}

/// `text` with every registered secret replaced.
fn redact(text: &str) -> Cow<'_, str> {
    SECRETS
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .redact(text)
}

/// Standard error, one log line at a time, redacted (the log's writer).
#[derive(Clone, Copy, Default)]
pub struct RedactedStderr;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for RedactedStderr {
    type Writer = Line;

    fn make_writer(&'a self) -> Self::Writer {
        Line(Vec::new())
    }
}

/// One log line, written to standard error when dropped.
pub struct Line(Vec<u8>);

impl Write for Line {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let text = String::from_utf8_lossy(&self.0);
        // Nothing to do when stderr is gone.
        let _ = io::stderr().lock().write_all(redact(&text).as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_of_a_secret_is_replaced() {
        let mut secrets = Secrets::new();
        secrets.add("s3cret \"q\"@x/y");
        secrets.add("s3cret");
        for line in [
            "password=s3cret \"q\"@x/y end",
            "url=nats://u:s3cret%20%22q%22%40x%2Fy@h:4222",
            r#"{"dsn":"password=s3cret \"q\"@x/y"}"#,
            "connect_info: Some(\"s3cret \\\"q\\\"@x/y\")",
        ] {
            let shown = secrets.redact(line);
            assert!(!shown.contains("s3cret"), "{line} -> {shown}");
            assert!(shown.contains(REDACTED), "{shown}");
        }
        assert_eq!(secrets.redact("nothing here"), "nothing here");
        secrets.add("");
        assert_eq!(secrets.redact("nothing here"), "nothing here");
    }

    #[test]
    fn registered_secrets_are_replaced_in_what_the_log_writes() {
        keep_out("reg-9d2e7f");
        // Other tests of this binary register their own secrets too.
        let shown = redact("password=reg-9d2e7f");
        assert!(
            !shown.contains("9d2e7f") && shown.contains(REDACTED),
            "{shown}"
        );
    }
}
