//! Whether a server's timeline history still contains walbox's checkpoint.
//!
//! A promoted standby starts a new timeline; its history file says where each
//! earlier timeline ended (`parent timeline`, `switch point`, `reason` per line).
//! WAL that walbox read on the old timeline after that switch point is not on the
//! new one, so a checkpoint past it names events this server never had, and a
//! stream started there would skip the new timeline's transactions below it.

use walbox_pgoutput::Lsn;

/// Why a server's history does not contain the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimelineProblem {
    /// The server is on an earlier timeline than the checkpoint's.
    #[error(
        "the server is on timeline {server}, earlier than timeline {checkpoint} of walbox's \
         checkpoint (restored from an older copy?)"
    )]
    Earlier {
        /// The server's timeline.
        server: u32,
        /// The checkpoint's timeline.
        checkpoint: u32,
    },
    /// The checkpoint's timeline ended before the checkpoint's position.
    #[error(
        "the server left timeline {checkpoint} at {switch} (promoted to timeline {server}), \
         before walbox's checkpoint at {at}: WAL walbox read from {switch} to {at} is not on \
         this server"
    )]
    SwitchedBefore {
        /// The checkpoint's timeline.
        checkpoint: u32,
        /// Where it ended.
        switch: Lsn,
        /// The checkpoint's position.
        at: Lsn,
        /// The server's timeline.
        server: u32,
    },
    /// The history does not mention the checkpoint's timeline.
    #[error(
        "timeline {checkpoint} of walbox's checkpoint is not in the history of the server's \
         timeline {server}"
    )]
    NotAnAncestor {
        /// The checkpoint's timeline.
        checkpoint: u32,
        /// The server's timeline.
        server: u32,
    },
}

/// Checks a checkpoint at `at` on timeline `checkpoint` against a server on
/// timeline `server` whose history file is `history` (needed only when the
/// server's timeline is later).
///
/// # Errors
/// When the server's history does not contain the checkpoint's position.
pub fn check_timeline(
    checkpoint: u32,
    at: Lsn,
    server: u32,
    history: Option<&str>,
) -> Result<(), TimelineProblem> {
    if server == checkpoint {
        return Ok(());
    }
    if server < checkpoint {
        return Err(TimelineProblem::Earlier { server, checkpoint });
    }
    let switch = history.and_then(|h| {
        h.lines().find_map(|line| {
            let mut fields = line.split_whitespace();
            let tli: u32 = fields.next()?.parse().ok()?;
            let lsn: Lsn = fields.next()?.parse().ok()?;
            (tli == checkpoint).then_some(lsn)
        })
    });
    match switch {
        None => Err(TimelineProblem::NotAnAncestor { checkpoint, server }),
        Some(switch) if switch < at => Err(TimelineProblem::SwitchedBefore {
            checkpoint,
            switch,
            at,
            server,
        }),
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HISTORY: &str = "1\t0/3000000\tno recovery target specified\n\
                           \n\
                           2\t0/5000060\tno recovery target specified\n";

    fn lsn(s: &str) -> Lsn {
        s.parse().unwrap()
    }

    #[test]
    fn the_same_timeline_passes() {
        assert_eq!(check_timeline(1, lsn("9/0"), 1, None), Ok(()));
    }

    #[test]
    fn a_promotion_after_the_checkpoint_passes() {
        assert_eq!(
            check_timeline(1, lsn("0/2FFFFFF"), 3, Some(HISTORY)),
            Ok(())
        );
        assert_eq!(
            check_timeline(1, lsn("0/3000000"), 3, Some(HISTORY)),
            Ok(())
        );
        assert_eq!(
            check_timeline(2, lsn("0/5000000"), 3, Some(HISTORY)),
            Ok(())
        );
    }

    #[test]
    fn a_promotion_before_the_checkpoint_is_refused_with_the_range() {
        let e = check_timeline(1, lsn("0/3000100"), 3, Some(HISTORY)).unwrap_err();
        assert_eq!(
            e,
            TimelineProblem::SwitchedBefore {
                checkpoint: 1,
                switch: lsn("0/3000000"),
                at: lsn("0/3000100"),
                server: 3
            }
        );
        assert!(e.to_string().contains("from 0/3000000 to 0/3000100"), "{e}");
    }

    #[test]
    fn an_earlier_or_unrelated_timeline_is_refused() {
        assert!(matches!(
            check_timeline(3, lsn("0/1"), 2, None),
            Err(TimelineProblem::Earlier { .. })
        ));
        assert!(matches!(
            check_timeline(4, lsn("0/1"), 5, Some(HISTORY)),
            Err(TimelineProblem::NotAnAncestor { .. })
        ));
        assert!(matches!(
            check_timeline(1, lsn("0/1"), 2, None),
            Err(TimelineProblem::NotAnAncestor { .. })
        ));
    }
}
