//! The affinity journal: the on-disk record of every managed task's ORIGINAL CPU mask,
//! written before we first change it, so the mask is given back on exit and, after a
//! crash or `kill -9`, on the next start (`AffinityJournal::recover`).
//!
//! It owns the file format and its atomic replacement (temp file in the same directory,
//! fsync, rename, fsync the directory): a reader sees the old or the new journal, never a
//! half-written one. It must never lose a record it has not restored: it does not delete
//! a journal it cannot parse (that is renamed aside as `<name>.corrupt`), it never
//! restores a task whose identity (tid + tgid + start time) changed, and never overrides a
//! mask someone else set after us.
//!
//! What "a mask we set" means after a crash: the executor pins tasks to single CPUs from
//! the entry's `allowed` list and, to keep file I/O off the migration hot path, writes
//! `last_set` only on the first move of a task, not on every move. Recovery therefore
//! treats the current mask as ours when it equals `last_set` or, once `last_set` exists,
//! when it is any single CPU from `allowed`. The one case this misjudges: someone else
//! pinned a task we were moving to a single CPU of its allowed set, and we crashed before
//! noticing (the executor checks the mask before every move and drops the task at once
//! when it differs). We then restore the original mask over theirs.
//!
//! A task kept with its completions also gets a short scheduler slice: the entry's
//! `slice` is written before that change, and recovery gives the old slice back when the
//! task still has the one we set (whatever became of its mask).

use ledger::{Format, Keyed, Ledger};
use os_layer::Root;
use serde::{Deserialize, Serialize};
use std::path::Path;

const FORMAT: Format<JournalEntry> = Format {
    version: 1,
    what: "affinity journal",
    legacy: None,
};

/// Everything needed to give one task its mask back, and to be sure it is the same task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    pub tid: u32,
    pub tgid: u32,
    /// Field 22 of `/proc/<tid>/stat` (clock ticks since boot): a reused tid differs here.
    pub start_time: u64,
    /// The CPU list before our first change.
    pub original: Vec<usize>,
    /// The CPUs we may pin it to: `original` ∩ its cpuset, at the time we took it over.
    pub allowed: Vec<usize>,
    /// The mask we last wrote to the journal as set by us; `None`: never changed.
    pub last_set: Option<Vec<usize>>,
    /// The scheduler slice we gave it, if any (absent in journals of older versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slice: Option<SliceChange>,
}

/// A fair task's custom slice (`sched_attr.sched_runtime`) as we changed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceChange {
    /// Its slice before: `None` when it had none of its own (the kernel's base slice).
    pub original_ns: Option<u64>,
    /// The slice we set.
    pub set_ns: u64,
}

impl Keyed for JournalEntry {
    fn tid(&self) -> u32 {
        self.tid
    }
}

/// The file and its errors are the shared change ledger's (crates/ledger).
pub type JournalError = ledger::LedgerError;
pub type Result<T> = std::result::Result<T, JournalError>;

/// What `recover` did with each entry of the previous run's journal (tids).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Given their original mask back.
    pub restored: Vec<u32>,
    /// Still carried their original mask: nothing to do.
    pub untouched: Vec<u32>,
    /// No longer exist.
    pub gone: Vec<u32>,
    /// The tid now belongs to another task (different tgid or start time): left alone.
    pub reused: Vec<u32>,
    /// Someone else changed the mask after us: left alone.
    pub external: Vec<u32>,
    /// Restoring failed (e.g. the cpuset no longer allows the original CPUs).
    pub failed: Vec<(u32, String)>,
    /// Given their scheduler slice back.
    pub slices_restored: Vec<u32>,
}

/// The journal in memory, mirrored to its file on every change.
#[derive(Debug)]
pub struct AffinityJournal {
    ledger: Ledger<JournalEntry>,
}

impl AffinityJournal {
    /// Opens (or starts) the journal at `path`, creating its directory. Entries already in
    /// the file are kept, never dropped, so a later `recover` still sees them. It is
    /// written once now, so a read-only or missing state dir fails at start, not mid-run.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Ok(AffinityJournal {
            ledger: Ledger::open(path, &FORMAT)?,
        })
    }

    pub fn path(&self) -> &Path {
        self.ledger.path()
    }

    /// Records a task before its first change (replaces an entry with the same tid).
    pub fn record(&mut self, entry: JournalEntry) -> Result<()> {
        self.ledger.insert(entry).map(drop)
    }

    /// Notes the mask we are about to set (or have set) for `tid`; a no-op for unknown
    /// tids or an unchanged mask.
    pub fn update_last_set(&mut self, tid: u32, mask: &[usize]) -> Result<()> {
        self.edit(tid, |e| e.last_set = Some(mask.to_vec()))
    }

    /// Corrects what `tid`'s original mask was (`AffinityExecutor::undo_inherited`: a
    /// child taken over with the pin it inherited from a task of ours); a no-op for unknown
    /// tids or no change.
    pub fn update_original(
        &mut self,
        tid: u32,
        original: &[usize],
        allowed: &[usize],
    ) -> Result<()> {
        self.edit(tid, |e| {
            e.original = original.to_vec();
            e.allowed = allowed.to_vec();
        })
    }

    /// Notes the slice we are about to give `tid` (`None`: its own is back); a no-op for
    /// unknown tids or no change.
    pub fn update_slice(&mut self, tid: u32, slice: Option<SliceChange>) -> Result<()> {
        self.edit(tid, |e| e.slice = slice)
    }

    /// Rewrites `tid`'s entry as `change` leaves it; no write for unknown tids or no change.
    fn edit(&mut self, tid: u32, change: impl FnOnce(&mut JournalEntry)) -> Result<()> {
        let Some(e) = self.ledger.get(tid) else {
            return Ok(());
        };
        let mut changed = e.clone();
        change(&mut changed);
        if &changed == e {
            return Ok(());
        }
        self.ledger.insert(changed).map(drop)
    }

    /// Forgets a task (its mask was restored, or is no longer ours to restore).
    pub fn remove(&mut self, tid: u32) -> Result<Option<JournalEntry>> {
        self.ledger.remove(tid)
    }

    pub fn get(&self, tid: u32) -> Option<&JournalEntry> {
        self.ledger.get(tid)
    }

    /// All entries, by tid.
    pub fn entries(&self) -> impl Iterator<Item = &JournalEntry> {
        self.ledger.entries()
    }

    pub fn len(&self) -> usize {
        self.ledger.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ledger.is_empty()
    }

    /// At daemon start: gives every task of a previous run its original mask back when it
    /// is still the same task and still carries a mask we set, then empties the journal.
    /// A missing journal is an empty one.
    pub fn recover(path: impl AsRef<Path>) -> Result<RecoveryReport> {
        Self::recover_in(path, &Root::real())
    }

    /// `recover` with `/proc` elsewhere (tests and containers). Every mask is put back
    /// before the file is rewritten, so a state directory that became read-only or full
    /// still gets its tasks restored (and the error says the journal could not be emptied).
    pub fn recover_in(path: impl AsRef<Path>, root: &Root) -> Result<RecoveryReport> {
        let path = path.as_ref();
        let mut report = RecoveryReport::default();
        let Some(previous) = Ledger::previous(path, &FORMAT)? else {
            return Ok(report);
        };
        for e in previous {
            recover_entry(&e, root, &mut report);
        }
        Ledger::empty_file(path, &FORMAT)?;
        Ok(report)
    }
}

fn recover_entry(e: &JournalEntry, root: &Root, report: &mut RecoveryReport) {
    let stat = root.task(e.tgid, e.tid).join("stat");
    let Ok(text) = std::fs::read_to_string(&stat) else {
        report.gone.push(e.tid);
        return;
    };
    match os_layer::TaskStat::parse(&text) {
        Some(s) if s.start_time == e.start_time => {}
        _ => {
            report.reused.push(e.tid);
            return;
        }
    }
    if let Some(change) = e.slice {
        recover_slice(e.tid, change, report);
    }
    let current = match os_layer::get_cpus(e.tid) {
        Ok(c) => c,
        Err(nix::errno::Errno::ESRCH) => {
            report.gone.push(e.tid);
            return;
        }
        Err(err) => {
            report
                .failed
                .push((e.tid, format!("reading the mask: {err}")));
            return;
        }
    };
    if current == e.original {
        report.untouched.push(e.tid);
        return;
    }
    if !mask_is_ours(e, &current) {
        report.external.push(e.tid);
        return;
    }
    match os_layer::set_cpus(e.tid, &e.original) {
        Ok(()) => report.restored.push(e.tid),
        Err(nix::errno::Errno::ESRCH) => report.gone.push(e.tid),
        Err(err) => report
            .failed
            .push((e.tid, format!("restoring {:?}: {err}", e.original))),
    }
}

/// Gives a task its slice back when it still has the one we set (else someone else
/// changed it after us, or the task is gone: left alone).
fn recover_slice(tid: u32, change: SliceChange, report: &mut RecoveryReport) {
    match restore_slice(tid, change) {
        Ok(true) => report.slices_restored.push(tid),
        Ok(false) => {}
        Err(err) if err.raw_os_error() == Some(nix::libc::ESRCH) => {}
        Err(err) => report
            .failed
            .push((tid, format!("restoring its scheduler slice: {err}"))),
    }
}

/// Writes `change.original_ns` back (0: the kernel's base slice) if `tid` still has
/// `change.set_ns`, keeping its policy and nice; returns whether it did.
pub fn restore_slice(tid: u32, change: SliceChange) -> std::io::Result<bool> {
    if os_layer::sched::fair_slice(tid)? != Some(change.set_ns) {
        return Ok(false);
    }
    os_layer::sched::set_fair_slice(tid, change.original_ns.unwrap_or(0))?;
    Ok(true)
}

/// Whether a task's current mask is one we may have set (see the module comment).
pub fn mask_is_ours(e: &JournalEntry, current: &[usize]) -> bool {
    match &e.last_set {
        None => false,
        Some(last) if last.as_slice() == current => true,
        Some(_) => current.len() == 1 && e.allowed.contains(&current[0]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn entry(tid: u32) -> JournalEntry {
        JournalEntry {
            tid,
            tgid: tid,
            start_time: 42,
            original: vec![0, 1],
            allowed: vec![0, 1],
            last_set: None,
            slice: None,
        }
    }

    #[test]
    fn survives_reopen_and_tracks_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/journal.json");
        let mut j = AffinityJournal::open(&path).unwrap();
        j.record(entry(1)).unwrap();
        j.record(entry(2)).unwrap();
        j.update_last_set(1, &[1]).unwrap();
        j.remove(2).unwrap();
        drop(j);
        let j = AffinityJournal::open(&path).unwrap();
        let all: Vec<_> = j.entries().cloned().collect();
        assert_eq!(
            all,
            vec![JournalEntry {
                last_set: Some(vec![1]),
                ..entry(1)
            }]
        );
        // No temp file is left next to it.
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("journal.json")]);
    }

    #[test]
    fn corrupt_journal_is_moved_aside_with_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.json");
        fs::write(&path, b"{\"version\":1,\"entries\":[{\"tid\":").unwrap();
        let err = AffinityJournal::open(&path).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains("corrupt"), "{msg}");
        assert!(dir.path().join("journal.json.corrupt").exists());
        // Second corruption does not overwrite the first.
        fs::write(&path, b"garbage").unwrap();
        let err = AffinityJournal::recover(&path).unwrap_err();
        assert!(matches!(err, JournalError::Corrupt { .. }));
        assert!(dir.path().join("journal.json.corrupt.1").exists());
    }

    #[test]
    fn recovery_reads_identity_from_the_given_root() {
        // A fake /proc: tid 1 is gone, tid 2 was reused by a task started later. Neither
        // may be touched; both leave the journal, which ends empty.
        let dir = tempfile::tempdir().unwrap();
        let root = Root::at(dir.path().join("fake"));
        root.write_fake_task(2, 2, "other", 0, 43, 0).unwrap();
        let path = dir.path().join("journal.json");
        let mut j = AffinityJournal::open(&path).unwrap();
        j.record(entry(1)).unwrap();
        j.record(entry(2)).unwrap();
        drop(j);
        let report = AffinityJournal::recover_in(&path, &root).unwrap();
        assert_eq!((report.gone, report.reused), (vec![1], vec![2]));
        assert!(report.restored.is_empty() && report.failed.is_empty());
        assert!(AffinityJournal::open(&path).unwrap().is_empty());
    }

    #[test]
    fn which_masks_count_as_ours() {
        let mut e = entry(1);
        assert!(
            !mask_is_ours(&e, &[1]),
            "never moved: any change is someone else's"
        );
        e.last_set = Some(vec![0]);
        assert!(mask_is_ours(&e, &[0]));
        assert!(
            mask_is_ours(&e, &[1]),
            "a later single-CPU move that was not journaled"
        );
        assert!(!mask_is_ours(&e, &[0, 1]));
        e.allowed = vec![0];
        assert!(!mask_is_ours(&e, &[1]));
    }

    #[test]
    fn a_record_that_cannot_be_written_leaves_nothing_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let mut j = AffinityJournal::open(dir.path().join("state/journal.json")).unwrap();
        j.record(entry(1)).unwrap();
        // The directory goes away under it: every write fails from now on.
        std::fs::remove_dir_all(dir.path().join("state")).unwrap();
        assert!(j.record(entry(2)).is_err());
        assert!(j.get(2).is_none(), "an unwritten entry stayed in memory");
        let mut changed = entry(1);
        changed.original = vec![3];
        assert!(j.record(changed).is_err());
        assert_eq!(
            j.get(1),
            Some(&entry(1)),
            "the written entry was not put back"
        );
    }

    #[test]
    fn an_entry_written_before_slices_were_journaled_still_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.json");
        let mut j = AffinityJournal::open(&path).unwrap();
        j.record(entry(1)).unwrap();
        drop(j);
        let text = fs::read_to_string(&path).unwrap();
        assert!(!text.contains("slice"), "no slice, no field: {text}");
        let mut j = AffinityJournal::open(&path).unwrap();
        assert_eq!(j.get(1), Some(&entry(1)));
        let change = SliceChange {
            original_ns: Some(3_000_000),
            set_ns: 100_000,
        };
        j.update_slice(1, Some(change)).unwrap();
        j.update_slice(2, Some(change)).unwrap();
        drop(j);
        let j = AffinityJournal::open(&path).unwrap();
        assert_eq!(j.get(1).unwrap().slice, Some(change));
        assert!(j.get(2).is_none(), "unknown tids are not recorded");
    }

    #[test]
    fn missing_journal_recovers_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let r = AffinityJournal::recover(dir.path().join("none.json")).unwrap();
        assert_eq!(r, RecoveryReport::default());
    }
}
