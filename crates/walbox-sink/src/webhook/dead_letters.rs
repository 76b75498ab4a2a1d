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
use std::io::Write;
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
///
/// The file only ever ends with a whole line: a line cut short (a crash or a
/// failed write while it was appended, so never reported) is cut off before
/// the first append and after a failed append, so that the next letter does not
/// join it on one line that no longer parses.
#[derive(Debug)]
pub(super) struct LetterFile {
    path: PathBuf,
    file: File,
    /// The length of the whole lines, once known (at the first append).
    len: Option<u64>,
}

impl LetterFile {
    pub(super) fn open(path: &Path) -> Result<Self, SinkError> {
        let existed = path.exists();
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)
            .and_then(|f| {
                if !existed {
                    // The new file's name must survive a crash as its lines do.
                    sync_dir(path)?;
                }
                Ok(f)
            })
            .map_err(|e| {
                SinkError::Config(format!(
                    "sink.webhook.dead_letter_file {}: {e}",
                    path.display()
                ))
            })?;
        Ok(LetterFile {
            path: path.to_owned(),
            file,
            len: None,
        })
    }

    /// Appends `event` as one line and waits until it is on disk. On an
    /// error the file is cut back to the lines before it. Before the first
    /// append, a line an earlier run left cut short is cut off (not when the
    /// file is only opened: `walbox dlq replay` opens it while `walbox run`
    /// may be appending).
    pub(super) fn append(&mut self, event: &Event) -> std::io::Result<()> {
        let len = match self.len {
            Some(len) => len,
            None => {
                let len = whole_lines_len(&self.file)?;
                if len != self.file.metadata()?.len() {
                    self.file.set_len(len)?;
                    self.file.sync_data()?;
                }
                self.len = Some(len);
                len
            }
        };
        let mut line = serde_json::to_vec(&LetterLine::of(event)).map_err(std::io::Error::other)?;
        line.push(b'\n');
        let written = self
            .file
            .write_all(&line)
            .and_then(|()| self.file.sync_data());
        match written {
            Ok(()) => {
                self.len = Some(len + line.len() as u64);
                Ok(())
            }
            Err(e) => {
                if self.file.set_len(len).is_err() {
                    // Found again before the next append.
                    self.len = None;
                }
                Err(e)
            }
        }
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }
}

/// The length of `file` up to and including its last newline.
fn whole_lines_len(file: &File) -> std::io::Result<u64> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = file;
    let mut end = f.metadata()?.len();
    let mut buf = [0u8; 4096];
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let chunk = &mut buf[..usize::try_from(end - start).unwrap_or(0)];
        f.seek(SeekFrom::Start(start))?;
        f.read_exact(chunk)?;
        if let Some(i) = chunk.iter().rposition(|b| *b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

/// Makes the creation of `path` durable: fsyncs its directory.
fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

/// The dead letters in `path`, each with its line number (from 0); none when
/// the file does not exist. A last line cut short (a crash while it was
/// written, before it was reported) is left out; any other line that is not a
/// letter is an error, never skipped in silence.
pub fn read_letters(path: &Path) -> Result<Vec<(u64, LetterLine)>, SinkError> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(SinkError::Io(e)),
    };
    let mut out = Vec::new();
    let whole = text.ends_with(b"\n");
    let lines: Vec<&[u8]> = text.split(|b| *b == b'\n').collect();
    // After the last newline: empty, or the line cut short.
    let count = lines.len() - 1;
    for (n, line) in lines.into_iter().enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<LetterLine>(line) {
            Ok(letter) => out.push((n as u64, letter)),
            Err(_) if n == count && !whole => {}
            Err(e) => {
                return Err(SinkError::Read {
                    topic: path.display().to_string(),
                    reason: format!("line {} is not a dead letter: {e}", n + 1),
                });
            }
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
            origin: walbox_outbox::Origin::Stream,
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

    #[test]
    fn a_line_cut_short_by_a_crash_does_not_swallow_the_next_letter() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dl.jsonl");
        let mut event = Event {
            event_id: "e1".into(),
            topic: "t.dlq".into(),
            key: Some(Bytes::from_static(b"k1")),
            value: Bytes::from_static(b"{}"),
            json_value: true,
            headers: vec![],
            position: Position {
                commit_lsn: walbox_pgoutput::Lsn(1),
                index: 0,
                xid: 1,
            },
            origin: walbox_outbox::Origin::Stream,
        };
        LetterFile::open(&path).unwrap().append(&event).unwrap();
        // kill -9 while the second letter was written: never reported.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"topic\":\"t.dl")
            .unwrap();
        // The next start appends the letter the position then passes.
        event.event_id = "e2".into();
        event.key = Some(Bytes::from_static(b"k2"));
        LetterFile::open(&path).unwrap().append(&event).unwrap();
        let read = read_letters(&path).unwrap();
        let keys: Vec<_> = read.iter().map(|(_, l)| l.key.clone().unwrap()).collect();
        assert_eq!(keys, ["k1", "k2"]);
        // A line in the middle that is no letter is an error, not skipped.
        std::fs::write(
            &path,
            b"{\"topic\":\n{\"topic\":\"t\",\"headers\":[],\"value\":\"\"}\n",
        )
        .unwrap();
        assert!(read_letters(&path).is_err());
    }
}
