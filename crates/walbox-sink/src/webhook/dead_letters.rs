//! The webhook sink's dead letters: an append-only file of JSON lines on the
//! machine walbox runs on, so that a refused event's letter never depends on
//! the receiver that refused it. Each line is one record as a broker would
//! hold it: `{"topic", "key", "key_base64", "headers": [[name, value], ...],
//! "value"}` (text as text, anything else in base64); a line is written and
//! fsynced before its delivery is reported, so the position never passes a
//! letter that is not on disk. [`read_letters`] and [`DeadLetterFile`] read
//! them back for `walbox dlq replay`, which keeps its progress beside the file
//! ([`replayed_path`]).
//!
//! Rotation. Letters always go to the file the configured path names: before
//! each append walbox compares the path's device and inode with the open
//! file's, and opens the path again when the file was moved away or removed
//! (a letter written while its file was moved is written again at the path).
//! A file cut in place (`copytruncate`) is appended to at its new end.
//!
//! The progress says which file and which bytes it counts: one JSON line with
//! the lines replayed, the byte offset they end at, the file's device and
//! inode, and the SHA-256 of the file's bytes up to that offset. It applies
//! only to the same file (device and inode) that still holds those same bytes
//! (at least that long, the same hash); otherwise the replay starts from the
//! file's first letter and says why. The hash is of the whole replayed prefix,
//! not of one line: a replay reads the whole file anyway, so it costs one pass
//! over bytes already in memory, and it tells a file cut and grown again past
//! the offset from the one replayed even when the same letter recurs (the
//! same event refused again after a restart writes the same line), which a
//! hash of the first or the last line would not. A copy of the same letters
//! under another inode is another file: replayed again (under the same ids),
//! never skipped.
//!
//! A progress of the form written before (a bare count of lines) applies only
//! when the file holds at least that many lines and was created (its birth
//! time) no later than the progress was last written, so a file started anew
//! after it, or cut to fewer lines, is replayed from its start; where the
//! creation time cannot be read it does not apply. A file cut in place and
//! grown past the count again since cannot be told from it: that is the one
//! case the old form can still skip, until the next replay records the new
//! form.

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
///
/// Letters always go to the file the configured path names: before each
/// append, the path's device and inode are compared with the open file's, and
/// a file moved away or removed (a rotation) is left alone and the path opened
/// again, created when nothing is there. A file cut in place (logrotate's
/// `copytruncate`) is appended to at its new end.
#[derive(Debug)]
pub(super) struct LetterFile {
    path: PathBuf,
    file: File,
    /// The length of the whole lines, once known (at the first append, and
    /// again when the file was opened anew or its length changed under it).
    len: Option<u64>,
}

impl LetterFile {
    pub(super) fn open(path: &Path) -> Result<Self, SinkError> {
        let file = open_at(path).map_err(|e| {
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

    /// Makes sure the open file is the one the path names, and that its
    /// length is known. A file moved away (a rotation) or removed gets no
    /// more letters: the path is opened (created) again. A file cut in place
    /// (copytruncate) is appended to at its new end, and its length is taken
    /// again.
    fn follow_path(&mut self) -> std::io::Result<()> {
        let named = match std::fs::metadata(&self.path) {
            Ok(meta) => Some(identity(&meta)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        let open = self.file.metadata()?;
        let moved = match named {
            None => true,
            Some(named) => named.is_some() && named != identity(&open),
        };
        if moved {
            self.file = open_at(&self.path)?;
            self.len = None;
        } else if self.len != Some(open.len()) {
            self.len = None;
        }
        Ok(())
    }

    /// Whether the path still names the open file.
    fn path_names_file(&self) -> std::io::Result<bool> {
        match std::fs::metadata(&self.path) {
            Ok(meta) => {
                let named = identity(&meta);
                Ok(named.is_none() || named == identity(&self.file.metadata()?))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Appends `event` as one line at the path and waits until it is on
    /// disk. On an error the file is cut back to the lines before it. Before
    /// the first append to a file, a line an earlier run left cut short is
    /// cut off (not when the file is only opened: `walbox dlq replay` opens it
    /// while `walbox run` may be appending).
    ///
    /// A file moved away while the letter was written keeps that copy, and
    /// the letter is written again at the path, so that it is always in the
    /// file the path names once this returns.
    pub(super) fn append(&mut self, event: &Event) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(&LetterLine::of(event)).map_err(std::io::Error::other)?;
        line.push(b'\n');
        for _ in 0..MOVES {
            self.follow_path()?;
            self.append_line(&line)?;
            if self.path_names_file()? {
                return Ok(());
            }
        }
        Err(std::io::Error::other(format!(
            "the file was moved away {MOVES} times while a letter was written to it"
        )))
    }

    fn append_line(&mut self, line: &[u8]) -> std::io::Result<()> {
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
        let written = self
            .file
            .write_all(line)
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

/// How many times a letter is written again when its file keeps being moved
/// away while it is written.
const MOVES: usize = 3;

/// Opens the file at `path` for appending, creating it (and making its name
/// durable) when there is none.
fn open_at(path: &Path) -> std::io::Result<File> {
    let existed = path.exists();
    let file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)?;
    if !existed {
        // The new file's name must survive a crash as its lines do.
        sync_dir(path)?;
    }
    Ok(file)
}

/// Which file `meta` is about: its device and inode (none where the platform
/// has no such thing).
#[cfg(unix)]
fn identity(meta: &std::fs::Metadata) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    Some((meta.dev(), meta.ino()))
}

#[cfg(not(unix))]
fn identity(_meta: &std::fs::Metadata) -> Option<(u64, u64)> {
    None
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
    Ok(DeadLetterFile::read(path)?.letters)
}

/// Where `walbox dlq replay` records how far it replayed `path`.
#[must_use]
pub fn replayed_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".replayed");
    PathBuf::from(p)
}

/// A dead-letter file as `walbox dlq replay` reads it: its letters, and what
/// tells whether the progress recorded beside it ([`replayed_path`]) is about
/// it.
#[derive(Debug)]
pub struct DeadLetterFile {
    path: PathBuf,
    letters: Vec<(u64, LetterLine)>,
    /// The file's bytes as read.
    bytes: Vec<u8>,
    /// Where each whole line ends (the offset after its newline).
    ends: Vec<u64>,
    /// The file's metadata, read from the handle its bytes were read from
    /// (none: there is no file).
    meta: Option<std::fs::Metadata>,
}

/// Where a replay of a dead-letter file starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayStart {
    /// The first line not replayed yet.
    pub line: u64,
    /// Why the recorded progress does not apply to the file, when it does
    /// not (the replay then starts from the file's first letter).
    pub not_applied: Option<String>,
}

impl ReplayStart {
    fn from_start(why: String) -> Self {
        ReplayStart {
            line: 0,
            not_applied: Some(why),
        }
    }
}

/// The progress `walbox dlq replay` records beside a dead-letter file: the
/// lines replayed, the offset they end at, the file they are in, and the
/// SHA-256 of the file's bytes up to that offset.
#[derive(Debug, Serialize, Deserialize)]
struct Progress {
    lines: u64,
    offset: u64,
    #[serde(default)]
    dev: Option<u64>,
    #[serde(default)]
    ino: Option<u64>,
    sha256: String,
}

impl DeadLetterFile {
    /// Reads the file at `path` (none there: no letters).
    pub fn read(path: &Path) -> Result<Self, SinkError> {
        use std::io::Read;
        let (bytes, meta) = match File::open(path) {
            Ok(mut f) => {
                let meta = f.metadata()?;
                let mut bytes = Vec::new();
                f.read_to_end(&mut bytes)?;
                (bytes, Some(meta))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Vec::new(), None),
            Err(e) => return Err(SinkError::Io(e)),
        };
        let mut letters = Vec::new();
        let mut ends = Vec::new();
        let whole = bytes.ends_with(b"\n");
        let lines: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
        // After the last newline: empty, or the line cut short.
        let count = lines.len() - 1;
        let mut end = 0u64;
        for (n, line) in lines.into_iter().enumerate() {
            if n < count {
                end += line.len() as u64 + 1;
                ends.push(end);
            }
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match serde_json::from_slice::<LetterLine>(line) {
                Ok(letter) => letters.push((n as u64, letter)),
                Err(_) if n == count && !whole => {}
                Err(e) => {
                    return Err(SinkError::Read {
                        topic: path.display().to_string(),
                        reason: format!("line {} is not a dead letter: {e}", n + 1),
                    });
                }
            }
        }
        Ok(DeadLetterFile {
            path: path.to_owned(),
            letters,
            bytes,
            ends,
            meta,
        })
    }

    /// The letters, each with its line number (from 0).
    #[must_use]
    pub fn letters(&self) -> &[(u64, LetterLine)] {
        &self.letters
    }

    /// Where a replay starts: after the lines the recorded progress counts as
    /// replayed when it is about this file as it is now, else at the first
    /// line, saying why. Never after a letter that was not replayed.
    pub fn replay_start(&self) -> Result<ReplayStart, SinkError> {
        let progress = replayed_path(&self.path);
        let text = match std::fs::read_to_string(&progress) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(ReplayStart {
                    line: 0,
                    not_applied: None,
                });
            }
            Err(e) => return Err(SinkError::Io(e)),
        };
        let text = text.trim();
        if let Ok(lines) = text.parse::<u64>() {
            return Ok(self.bare_count(lines, &progress));
        }
        match serde_json::from_str::<Progress>(text) {
            Ok(p) => Ok(self.applies(&p)),
            Err(_) => Ok(ReplayStart::from_start(
                "it is not a progress walbox wrote (cut short?)".into(),
            )),
        }
    }

    /// Whether `p` is about this file: the same file (device and inode), at
    /// least as long as the offset replayed, and the same bytes up to there.
    fn applies(&self, p: &Progress) -> ReplayStart {
        if p.offset == 0 {
            return ReplayStart {
                line: 0,
                not_applied: None,
            };
        }
        let Some(meta) = &self.meta else {
            return ReplayStart::from_start("the file does not exist".into());
        };
        let recorded = p.dev.zip(p.ino);
        let now = identity(meta);
        if recorded.is_some() && now.is_some() && recorded != now {
            return ReplayStart::from_start(
                "it is another file than the one replayed (another inode): moved away and \
                 started anew"
                    .into(),
            );
        }
        let len = self.bytes.len() as u64;
        if len < p.offset {
            return ReplayStart::from_start(format!(
                "it was cut: it holds {len} bytes, fewer than the {} replayed",
                p.offset
            ));
        }
        let Ok(end) = usize::try_from(p.offset) else {
            return ReplayStart::from_start("the offset recorded is past the file's end".into());
        };
        if sha256_hex(&self.bytes[..end]) != p.sha256 {
            return ReplayStart::from_start(format!(
                "its first {} bytes are not the ones replayed: it was cut or rewritten",
                p.offset
            ));
        }
        // The same bytes: the offset is where line `lines` starts.
        let lines = self.ends.iter().take_while(|e| **e <= p.offset).count() as u64;
        ReplayStart {
            line: lines,
            not_applied: None,
        }
    }

    /// A progress of the form walbox wrote before it recorded the file: a
    /// bare count of lines. It applies only when the file holds at least that
    /// many lines and was created before the progress was written (a file
    /// started anew after it is another file); without the file's creation
    /// time, it does not apply.
    fn bare_count(&self, lines: u64, progress: &Path) -> ReplayStart {
        if lines == 0 {
            return ReplayStart {
                line: 0,
                not_applied: None,
            };
        }
        let Some(meta) = &self.meta else {
            return ReplayStart::from_start("the file does not exist".into());
        };
        let held = self.ends.len() as u64;
        if held < lines {
            return ReplayStart::from_start(format!(
                "it holds {held} lines, fewer than the {lines} replayed: it was cut or replaced"
            ));
        }
        let written = std::fs::metadata(progress).and_then(|m| m.modified());
        match (meta.created(), written) {
            (Ok(created), Ok(written)) if created <= written => ReplayStart {
                line: lines,
                not_applied: None,
            },
            (Ok(_), Ok(_)) => ReplayStart::from_start(
                "the file was created after its progress was written: it was started anew".into(),
            ),
            _ => ReplayStart::from_start(
                "the progress is a bare count of lines, and the file's creation time, which \
                 would show it was there when the count was written, cannot be read"
                    .into(),
            ),
        }
    }

    /// Records beside the file that its lines before `line` are replayed:
    /// their count, the offset they end at, the file's device and inode, and
    /// the SHA-256 of its bytes up to that offset.
    pub fn record_replayed(&self, line: u64) -> Result<(), SinkError> {
        let done = usize::try_from(line).map_or(self.ends.len(), |l| l.min(self.ends.len()));
        let offset = done.checked_sub(1).map_or(0, |i| self.ends[i]);
        let end = usize::try_from(offset).unwrap_or(self.bytes.len());
        let identity = self.meta.as_ref().and_then(identity);
        let progress = Progress {
            lines: done as u64,
            offset,
            dev: identity.map(|(d, _)| d),
            ino: identity.map(|(_, i)| i),
            sha256: sha256_hex(&self.bytes[..end]),
        };
        let mut text = serde_json::to_string(&progress).map_err(std::io::Error::other)?;
        text.push('\n');
        std::fs::write(replayed_path(&self.path), text).map_err(SinkError::Io)
    }
}

/// The SHA-256 of `bytes`, in lowercase hexadecimal.
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    use std::fmt::Write as _;
    sha2::Sha256::digest(bytes)
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
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

    fn event(id: &str) -> Event {
        Event {
            event_id: id.into(),
            topic: "t.dlq".into(),
            key: Some(Bytes::from(id.to_owned())),
            value: Bytes::from_static(b"{}"),
            json_value: true,
            headers: vec![],
            position: Position {
                commit_lsn: walbox_pgoutput::Lsn(1),
                index: 0,
                xid: 1,
            },
            origin: walbox_outbox::Origin::Stream,
        }
    }

    fn keys(path: &Path) -> Vec<String> {
        read_letters(path)
            .unwrap()
            .into_iter()
            .map(|(_, l)| l.key.unwrap())
            .collect()
    }

    /// `walbox dlq replay`'s steps: where it starts, then (all sent) its
    /// progress recorded up to the last line.
    fn replay(path: &Path) -> (ReplayStart, Vec<String>) {
        let read = DeadLetterFile::read(path).unwrap();
        let start = read.replay_start().unwrap();
        let sent = read
            .letters()
            .iter()
            .filter(|(n, _)| *n >= start.line)
            .map(|(_, l)| l.key.clone().unwrap())
            .collect();
        let next = read.letters().last().map_or(start.line, |(n, _)| n + 1);
        read.record_replayed(next).unwrap();
        (start, sent)
    }

    #[test]
    fn a_replay_after_copytruncate_starts_from_the_file_s_first_letter() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dl.jsonl");
        let mut f = LetterFile::open(&path).unwrap();
        f.append(&event("k1")).unwrap();
        f.append(&event("k2")).unwrap();
        assert_eq!(replay(&path).1, ["k1", "k2"]);
        f.append(&event("k3")).unwrap();
        let (start, sent) = replay(&path);
        assert_eq!(sent, ["k3"], "the progress applies to the same file grown");
        assert_eq!(start.not_applied, None);
        // logrotate's copytruncate: copied, cut in place, then new letters,
        // more of them than the lines replayed before.
        let copytruncate = || {
            std::fs::copy(&path, dir.path().join("dl.jsonl.1")).unwrap();
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(0)
                .unwrap();
        };
        copytruncate();
        for k in ["k4", "k5", "k6", "k7"] {
            f.append(&event(k)).unwrap();
        }
        let (start, sent) = replay(&path);
        assert_eq!(sent, ["k4", "k5", "k6", "k7"], "no letter skipped");
        assert!(start.not_applied.is_some());
        // Cut again, fewer letters than replayed before.
        copytruncate();
        f.append(&event("k8")).unwrap();
        let (start, sent) = replay(&path);
        assert_eq!(sent, ["k8"]);
        let why = start.not_applied.unwrap();
        assert!(why.contains("cut"), "{why}");
        assert_eq!(
            replay(&path),
            (
                ReplayStart {
                    line: 1,
                    not_applied: None
                },
                vec![]
            )
        );
    }

    #[test]
    fn a_replay_of_a_new_file_started_where_the_old_one_was_moved_starts_from_its_first_letter() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dl.jsonl");
        let moved = dir.path().join("dl.jsonl.1");
        let mut f = LetterFile::open(&path).unwrap();
        f.append(&event("k1")).unwrap();
        f.append(&event("k2")).unwrap();
        assert_eq!(replay(&path).1, ["k1", "k2"]);
        // Archived without its `.replayed`; the new file gets more letters
        // than the old one had replayed.
        std::fs::rename(&path, &moved).unwrap();
        for k in ["k3", "k4", "k5"] {
            f.append(&event(k)).unwrap();
        }
        let (start, sent) = replay(&path);
        assert_eq!(sent, ["k3", "k4", "k5"], "no letter skipped");
        let why = start.not_applied.unwrap();
        assert!(why.contains("another file"), "{why}");
        // Fewer letters than replayed before.
        std::fs::rename(&path, &moved).unwrap();
        f.append(&event("k6")).unwrap();
        assert_eq!(replay(&path).1, ["k6"]);
        // A copy of the same letters is another file too: sent again (under
        // the same ids), never skipped.
        std::fs::copy(&path, &moved).unwrap();
        std::fs::rename(&moved, &path).unwrap();
        let (start, sent) = replay(&path);
        assert_eq!(sent, ["k6"]);
        assert!(start.not_applied.is_some());
    }

    #[test]
    fn a_bare_count_of_lines_applies_only_to_a_file_that_holds_them_and_was_there_before_it() {
        use std::time::{Duration, SystemTime};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dl.jsonl");
        let progress = replayed_path(&path);
        // As walbox wrote its progress before it recorded the file.
        let bare = |n: u64, written: SystemTime| {
            std::fs::write(&progress, format!("{n}\n")).unwrap();
            File::options()
                .write(true)
                .open(&progress)
                .unwrap()
                .set_modified(written)
                .unwrap();
        };
        let start = || DeadLetterFile::read(&path).unwrap().replay_start().unwrap();
        let mut f = LetterFile::open(&path).unwrap();
        for k in ["k1", "k2", "k3"] {
            f.append(&event(k)).unwrap();
        }
        let later = SystemTime::now() + Duration::from_secs(60);
        bare(2, later);
        let birth = std::fs::metadata(&path).unwrap().created();
        if birth.is_ok() {
            assert_eq!(
                start(),
                ReplayStart {
                    line: 2,
                    not_applied: None
                }
            );
        } else {
            // No creation time to check it against: never applied.
            assert_eq!(start().line, 0);
        }
        bare(4, later);
        assert_eq!(start().line, 0, "more lines than the file holds");
        // Written before the file was made: about another file.
        bare(2, SystemTime::now() - Duration::from_secs(3600));
        assert_eq!(start().line, 0);
        assert!(start().not_applied.is_some());
        // Cut (copytruncate) to fewer lines.
        bare(2, later);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0)
            .unwrap();
        f.append(&event("k4")).unwrap();
        assert_eq!(start().line, 0);
        // The progress is written in the new form from then on.
        let read = DeadLetterFile::read(&path).unwrap();
        read.record_replayed(1).unwrap();
        let recorded = std::fs::read_to_string(&progress).unwrap();
        assert!(recorded.contains("sha256"), "{recorded}");
        assert_eq!(
            read.replay_start().unwrap(),
            ReplayStart {
                line: 1,
                not_applied: None
            }
        );
    }

    #[test]
    fn a_letter_file_moved_away_while_open_gets_no_more_letters_the_path_does() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dl.jsonl");
        let moved = dir.path().join("dl.jsonl.1");
        let mut f = LetterFile::open(&path).unwrap();
        f.append(&event("k1")).unwrap();
        // logrotate without copytruncate: the file is renamed, and (with
        // `create`) a new one may or may not be made at the path.
        std::fs::rename(&path, &moved).unwrap();
        f.append(&event("k2")).unwrap();
        assert_eq!(keys(&path), ["k2"], "the letter is at the configured path");
        assert_eq!(keys(&moved), ["k1"]);
        std::fs::rename(&path, &moved).unwrap();
        std::fs::write(&path, b"").unwrap();
        f.append(&event("k3")).unwrap();
        assert_eq!(keys(&path), ["k3"]);
        assert_eq!(keys(&moved), ["k2"]);
    }

    #[test]
    fn a_letter_file_truncated_in_place_is_appended_to_from_its_new_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dl.jsonl");
        let mut f = LetterFile::open(&path).unwrap();
        f.append(&event("k1")).unwrap();
        f.append(&event("k2")).unwrap();
        // logrotate's copytruncate.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0)
            .unwrap();
        f.append(&event("k3")).unwrap();
        assert_eq!(keys(&path), ["k3"]);
        // The length a failed append would cut the file back to is the
        // file's, not the one before the truncation (that would pad the file
        // with zeros that are no letter).
        assert_eq!(f.len, Some(std::fs::metadata(&path).unwrap().len()));
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
