//! The checkpoint writer: a thread of its own flushes checkpoints to disk, so the
//! relay never waits for a disk flush.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use walbox_core::{Checkpoint, CheckpointFile};
use walbox_pgoutput::Lsn;

/// What the checkpoint thread has flushed to disk.
#[derive(Debug, Clone)]
enum Saved {
    /// Submission `seq` is on disk: position `lsn`; `snapshot_done` is false
    /// while an initial snapshot is unfinished.
    Done {
        seq: u64,
        lsn: Lsn,
        snapshot_done: bool,
    },
    /// Nothing known yet.
    Nothing,
    /// A write failed; nothing after it is saved.
    Failed(String),
}

/// Writes checkpoints on a thread of its own, so the relay never waits for a
/// disk flush: it hands over the newest state and goes on, and only positions
/// the thread reports flushed are reported to the server. Submissions that
/// arrive while a write is under way are coalesced into the newest one.
pub(super) struct CheckpointWriter {
    requests: std::sync::mpsc::Sender<(u64, Checkpoint)>,
    saved: Arc<tokio::sync::watch::Sender<Saved>>,
    submitted: u64,
}

impl CheckpointWriter {
    pub(super) fn new(store: CheckpointFile) -> Self {
        let (requests, queue) = std::sync::mpsc::channel::<(u64, Checkpoint)>();
        let saved = Arc::new(tokio::sync::watch::Sender::new(Saved::Nothing));
        let report = Arc::clone(&saved);
        let spawned = std::thread::Builder::new()
            .name("walbox-checkpoint".into())
            .spawn(move || {
                while let Ok(mut next) = queue.recv() {
                    while let Ok(newer) = queue.try_recv() {
                        next = newer;
                    }
                    let (seq, cp) = next;
                    let state = match store.save(&cp) {
                        Ok(()) => Saved::Done {
                            seq,
                            lsn: cp.lsn,
                            snapshot_done: !cp.snapshot_interrupted(),
                        },
                        Err(e) => Saved::Failed(e.to_string()),
                    };
                    let failed = matches!(state, Saved::Failed(_));
                    report.send_replace(state);
                    if failed {
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            saved.send_replace(Saved::Failed(format!(
                "starting the checkpoint thread: {e}"
            )));
        }
        CheckpointWriter {
            requests,
            saved,
            submitted: 0,
        }
    }

    /// `cp` is on disk already (loaded, or written before streaming).
    pub(super) fn known(&mut self, cp: &Checkpoint) {
        self.submitted += 1;
        self.saved.send_replace(Saved::Done {
            seq: self.submitted,
            lsn: cp.lsn,
            snapshot_done: !cp.snapshot_interrupted(),
        });
    }

    pub(super) fn submit(&mut self, cp: Checkpoint) -> Result<()> {
        self.submitted += 1;
        self.requests
            .send((self.submitted, cp))
            .map_err(|_| anyhow!("the checkpoint thread stopped"))?;
        Ok(())
    }

    /// The flushed position and whether the snapshot (if any) is recorded done;
    /// an error once a write failed.
    pub(super) fn saved(&self) -> Result<Option<(Lsn, bool)>> {
        match &*self.saved.borrow() {
            Saved::Done {
                lsn, snapshot_done, ..
            } => Ok(Some((*lsn, *snapshot_done))),
            Saved::Nothing => Ok(None),
            Saved::Failed(e) => bail!("writing the checkpoint: {e}"),
        }
    }

    /// Waits until everything submitted is on disk.
    pub(super) async fn flushed(&self, timeout: Duration) -> Result<()> {
        let want = self.submitted;
        let mut rx = self.saved.subscribe();
        let waited = tokio::time::timeout(
            timeout,
            rx.wait_for(|s| match s {
                Saved::Done { seq, .. } => *seq >= want,
                Saved::Failed(_) => true,
                Saved::Nothing => want == 0,
            }),
        )
        .await;
        match waited {
            Err(_) => bail!(
                "the checkpoint was not written within {} s",
                timeout.as_secs()
            ),
            Ok(Err(_)) => bail!("the checkpoint thread stopped"),
            Ok(Ok(_)) => self.saved().map(drop),
        }
    }
}
