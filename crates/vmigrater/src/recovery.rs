//! The journal of original CPU masks under the state directory: where it lives, and the
//! recovery of a previous run that ended without restoring them (kill -9, a crash). Must
//! run before anything can be moved, and never start a daemon that cannot journal.

use anyhow::{Context, Result};
use migrater::journal::{AffinityJournal, JournalError};
use std::path::{Path, PathBuf};
use tracing::info;

pub fn journal_path(state_dir: &Path) -> PathBuf {
    state_dir.join("journal.json")
}

/// Hands every journaled task of a crashed previous run back its original mask.
pub fn recover_journal(state_dir: &Path) -> Result<()> {
    let path = journal_path(state_dir);
    if !path.exists() {
        return Ok(());
    }
    let report = match AffinityJournal::recover(&path) {
        Ok(r) => r,
        // Not a writing problem: the file is unreadable, and was kept aside. The next start
        // begins with an empty journal; this one stops so that somebody looks.
        Err(e @ JournalError::Corrupt { .. }) => {
            anyhow::bail!(
                "{e}. No task was restored from it (put back by hand the masks it lists if a \
                 task is still pinned); the next start begins with an empty journal"
            )
        }
        Err(e) => {
            return Err(anyhow::Error::new(e)
                .context(format!("recovering {}", path.display()))
                .context(unwritable(state_dir)))
        }
    };
    info!(?report, "recovered the journal of a previous run");
    Ok(())
}

/// The journal for this run.
pub fn open_journal(state_dir: &Path) -> Result<AffinityJournal> {
    AffinityJournal::open(journal_path(state_dir)).with_context(|| unwritable(state_dir))
}

/// Why a daemon that cannot write its state directory does not start.
fn unwritable(state_dir: &Path) -> String {
    format!(
        "the state directory {} must be writable: every CPU mask the daemon changes is \
         journaled there first (state_dir in the config, or --state-dir)",
        state_dir.display()
    )
}
