//! The webhook sink's dead letters: an append-only file of JSON lines on the
//! machine walbox runs on, so that a refused event's letter never depends on
//! the receiver that refused it. Each line is one record as a broker would
//! hold it: `{"topic", "key", "key_base64", "headers": [[name, value], ...],
//! "value"}` (text as text, anything else in base64); a line is written and
//! fsynced before its delivery is reported, so the position never passes a
//! letter that is not on disk. [`read_letters`] reads them back for
//! `walbox dlq replay`, which keeps its progress beside the file
//! ([`replayed_path`]).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use walbox_outbox::Event;

use crate::SinkError;

/// One dead letter as a line of the file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LetterLine {
    /// The dead-letter topic.
    pub topic: String,
    /// The key, when it is UTF-8 text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The key in base64, when it is not text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_base64: Option<String>,
    /// The headers, in order (values as text, lossy).
    pub headers: Vec<(String, String)>,
    /// The value as text (lossy).
    pub value: String,
}

impl LetterLine {
    fn of(event: &Event) -> Self {
        let (key, key_base64) = match &event.key {
            Some(k) => match std::str::from_utf8(k) {
                Ok(t) => (Some(t.to_owned()), None),
                Err(_) => (
                    None,
                    Some(base64::engine::general_purpose::STANDARD.encode(k)),
                ),
            },
            None => (None, None),
        };
        LetterLine {
            topic: event.topic.clone(),
            key,
            key_base64,
            headers: event
                .headers
                .iter()
                .map(|(k, v)| (k.to_string(), String::from_utf8_lossy(v).into_owned()))
                .collect(),
            value: String::from_utf8_lossy(&event.value).into_owned(),
        }
    }

    /// The key's bytes.
    #[must_use]
    pub fn key_bytes(&self) -> Option<Vec<u8>> {
        match (&self.key, &self.key_base64) {
            (Some(k), _) => Some(k.as_bytes().to_vec()),
            (None, Some(b)) => base64::engine::general_purpose::STANDARD.decode(b).ok(),
            (None, None) => None,
        }
    }

    /// The first header called `name`.
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The open file dead letters are appended to.
#[derive(Debug)]
pub(super) struct LetterFile {
    path: PathBuf,
    file: File,
}

impl LetterFile {
    pub(super) fn open(path: &Path) -> Result<Self, SinkError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| {
                SinkError::Config(format!(
                    "sink.webhook.dead_letter_file {}: {e}",
                    path.display()
                ))
            })?;
        Ok(LetterFile {
            path: path.to_owned(),
            file,
        })
    }

    /// Appends `event` as one line and waits until it is on disk.
    pub(super) fn append(&mut self, event: &Event) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(&LetterLine::of(event)).map_err(std::io::Error::other)?;
        line.push(b'\n');
        self.file.write_all(&line)?;
        self.file.sync_data()
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }
}

/// The dead letters in `path`, each with its line number (from 0); none when
/// the file does not exist. A last line cut short (a crash while it was
/// written, before it was reported) is left out.
pub fn read_letters(path: &Path) -> Result<Vec<(u64, LetterLine)>, SinkError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(SinkError::Io(e)),
    };
    let mut out = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        if let Ok(letter) = serde_json::from_str::<LetterLine>(&line) {
            out.push((n as u64, letter));
        }
    }
    Ok(out)
}

/// Where `walbox dlq replay` records how many lines of `path` are done.
#[must_use]
pub fn replayed_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".replayed");
    PathBuf::from(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use walbox_outbox::Position;

    #[test]
    fn letters_are_appended_on_disk_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dl.jsonl");
        let mut f = LetterFile::open(&path).unwrap();
        let mut event = Event {
            event_id: "e1".into(),
            topic: "t.dlq".into(),
            key: Some(Bytes::from_static(b"\xffk")),
            value: Bytes::from_static(b"{\"a\":1}"),
            json_value: true,
            headers: vec![(
                "walbox_error_class".into(),
                Bytes::from_static(b"http_refused"),
            )],
            position: Position {
                commit_lsn: walbox_pgoutput::Lsn(1),
                index: 0,
                xid: 1,
            },
        };
        f.append(&event).unwrap();
        event.key = Some(Bytes::from_static(b"k2"));
        f.append(&event).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"topic\":")
            .unwrap();
        let read = read_letters(&path).unwrap();
        assert_eq!(read.len(), 2);
        assert_eq!(read[0].1.key_bytes().unwrap(), b"\xffk");
        assert_eq!(read[1].1.key.as_deref(), Some("k2"));
        assert_eq!(read[1].1.header("walbox_error_class"), Some("http_refused"));
        assert!(read_letters(&dir.path().join("none")).unwrap().is_empty());
    }
}
