//! Crash safety for the `kvm-qemu` backend: the undo of every change to a vCPU thread
//! (original nice, affinity, cgroup weight) is written to
//! `<state_dir>/journal.json` before the change is made, in the change ledger both programs
//! share (crates/ledger: fsync'd atomic writes, an unreadable file kept aside as
//! `.corrupt`). A clean exit restores everything and removes the file; after SIGKILL, an
//! OOM kill or a panic, the next start finds the file and puts back what the dead agent
//! left behind. Entries carry the thread's start time, so a recycled thread id is never
//! touched, and a mask is put back only while it is still one this agent sets (a single
//! host CPU): a mask somebody else set since is theirs.
//!
//! What is not checked after a crash: nice is written every period, too often to journal
//! each value, so recovery cannot tell ours from a later one of somebody else's
//! and restores the original whenever the thread is the same. A clean exit does check
//! (the backend remembers what it last set).

use anyhow::{Context, Result};
use ledger::{Format, Keyed, Ledger};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tracing::{info, warn};

use crate::cgroup::{self, Touched};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub tid: u32,
    /// `/proc/<tid>/stat` field 22, in clock ticks since boot.
    pub start_time: u64,
    pub nice: Option<i32>,
    /// The original EEVDF slice, in entries of agents that could set one: still put back
    /// after such an agent died, never written now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_ns: Option<u64>,
    pub mask: Option<Vec<usize>>,
    pub cgroup: Option<Touched>,
}

impl Keyed for Entry {
    fn tid(&self) -> u32 {
        self.tid
    }
}

const FORMAT: Format<Entry> = Format {
    version: 1,
    what: "change journal",
    legacy: Some(unversioned),
};

/// The layout agents wrote before the shared ledger: a bare map from tid to entry.
fn unversioned(bytes: &[u8]) -> Option<Vec<Entry>> {
    let map: BTreeMap<u32, serde_json::Map<String, serde_json::Value>> =
        serde_json::from_slice(bytes).ok()?;
    map.into_iter()
        .map(|(tid, mut fields)| {
            fields.insert("tid".into(), tid.into());
            serde_json::from_value(fields.into()).ok()
        })
        .collect()
}

pub struct Journal {
    ledger: Ledger<Entry>,
}

/// A thread's start time: with the tid, what tells it from a later thread with its tid.
pub fn start_time(tid: u32) -> Option<u64> {
    os_layer::TaskStat::of_tid(tid).map(|s| s.start_time)
}

impl Journal {
    /// Writes nothing until the first change (a dry run leaves no file).
    pub fn new(path: PathBuf) -> Journal {
        Journal {
            ledger: Ledger::fresh(path, &FORMAT),
        }
    }

    /// Adds to `tid`'s undo (only what is not recorded yet: the first original wins) and
    /// persists it before returning; each newly recorded original is logged once with
    /// `reason`, the change it is the undo of.
    pub fn record(&mut self, tid: u32, reason: &str, add: impl FnOnce(&mut Entry)) -> Result<()> {
        let start_time = start_time(tid).with_context(|| format!("thread {tid} is gone"))?;
        let fresh_entry = || Entry {
            tid,
            start_time,
            ..Entry::default()
        };
        let before = self.ledger.get(tid).cloned();
        let mut e = before.clone().unwrap_or_else(fresh_entry);
        let mut fresh = fresh_entry();
        add(&mut fresh);
        e.nice = e.nice.or(fresh.nice);
        e.mask = e.mask.take().or(fresh.mask);
        e.cgroup = e.cgroup.take().or(fresh.cgroup);
        if before.as_ref() == Some(&e) {
            return Ok(());
        }
        // On failure the ledger keeps what it had: memory never holds an undo the file
        // lacks, so the next call tries again instead of letting the change through.
        self.ledger.insert(e.clone())?;
        info!(tid, original = ?e, "journal: {reason}: the original is on disk");
        Ok(())
    }

    pub fn forget(&mut self, tid: u32) {
        if let Err(e) = self.ledger.remove(tid) {
            warn!("journal: {e}");
        }
    }

    /// Everything was restored: nothing left to undo.
    pub fn clear(&mut self) {
        if let Err(e) = self.ledger.clear() {
            warn!("journal: {e}");
        }
    }
}

/// Undoes what a previous agent left in `path`; returns how many threads were restored.
pub fn recover(path: &Path) -> Result<usize> {
    let Some(entries) = Ledger::previous(path, &FORMAT)? else {
        return Ok(0);
    };
    let hierarchy = cgroup::Hierarchy::detect();
    let mut restored = 0;
    for e in entries {
        let tid = e.tid;
        let same = start_time(tid) == Some(e.start_time);
        if same {
            restore_thread(tid, &e);
        }
        // A child group is ours whatever became of the thread; an in-place weight belongs
        // to someone else's group and is only put back for the very same thread.
        match (&e.cgroup, &hierarchy) {
            (Some(t @ Touched::Child { .. }), Some(h)) => {
                cgroup::undo(h, tid, t.clone());
            }
            (Some(t @ Touched::InPlace { .. }), Some(h)) if same => {
                cgroup::undo(h, tid, t.clone());
            }
            _ => {}
        }
        if same {
            restored += 1;
            info!(tid, entry = ?e, "journal: restored a vCPU thread a previous agent changed");
        }
    }
    Ledger::fresh(path, &FORMAT).clear()?;
    Ok(restored)
}

fn restore_thread(tid: u32, e: &Entry) {
    if e.nice.is_some() || e.runtime_ns.is_some() {
        match os_layer::sched::get_attr(tid) {
            Ok(mut a) => {
                if let Some(n) = e.nice {
                    a.sched_nice = n;
                }
                if let Some(r) = e.runtime_ns {
                    a.sched_runtime = r;
                }
                if let Err(err) = os_layer::sched::set_attr(tid, &a) {
                    warn!(tid, "journal: could not restore the nice or slice: {err}");
                }
            }
            Err(err) => warn!(tid, "journal: sched_getattr: {err}"),
        }
    }
    if let Some(cpus) = &e.mask {
        match os_layer::get_cpus(tid) {
            Ok(now) if now.len() == 1 && now != *cpus => {
                if let Err(err) = os_layer::set_cpus(tid, cpus) {
                    warn!(tid, "journal: could not restore the affinity: {err}");
                }
            }
            Ok(now) if now != *cpus => {
                info!(
                    tid,
                    ?now,
                    "journal: affinity changed by somebody else since: left as is"
                )
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_disk(path: &Path) -> Vec<Entry> {
        Ledger::previous(path, &FORMAT).unwrap().unwrap_or_default()
    }

    #[test]
    fn first_original_wins_and_file_follows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.json");
        let tid = nix::unistd::gettid().as_raw() as u32;
        let mut j = Journal::new(path.clone());
        assert!(!path.exists(), "nothing written before the first change");
        j.record(tid, "test", |e| e.nice = Some(3)).unwrap();
        j.record(tid, "test", |e| {
            e.nice = Some(-5);
            e.mask = Some(vec![0]);
        })
        .unwrap();
        let entries = on_disk(&path);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].nice, Some(3), "the first original must win");
        assert_eq!(entries[0].mask, Some(vec![0]));
        assert_eq!(entries[0].start_time, start_time(tid).unwrap());
        j.forget(tid);
        assert!(on_disk(&path).is_empty());
        j.clear();
        assert!(!path.exists(), "a clean exit leaves no file");
    }

    #[test]
    fn an_undo_that_cannot_be_written_is_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let me = nix::unistd::gettid().as_raw() as u32;
        let mut j = Journal::new(dir.path().join("gone/journal.json"));
        assert!(j.record(me, "test", |e| e.nice = Some(0)).is_err());
        // Asked again, it must try (and fail) again, not find the entry already there.
        assert!(j.record(me, "test", |e| e.nice = Some(0)).is_err());
        std::fs::create_dir(dir.path().join("gone")).unwrap();
        j.record(me, "test", |e| e.nice = Some(0)).unwrap();
        assert!(dir.path().join("gone/journal.json").exists());
    }

    #[test]
    fn recovery_skips_recycled_threads_and_reads_the_old_layout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.json");
        let tid = nix::unistd::gettid().as_raw() as u32;
        let nice = os_layer::sched::get_attr(tid).unwrap().sched_nice;
        // The layout of agents before the shared ledger: a bare map from tid to entry.
        let old_layout = serde_json::json!({
            tid.to_string(): {
                // Not this thread's start time: a different thread with a recycled id.
                "start_time": start_time(tid).unwrap() + 1,
                "nice": 19,
                "runtime_ns": null,
                "mask": null,
                "cgroup": null,
            }
        });
        std::fs::write(&path, old_layout.to_string()).unwrap();
        assert_eq!(on_disk(&path)[0].tid, tid, "the old layout is read");
        assert_eq!(recover(&path).unwrap(), 0);
        assert_eq!(
            os_layer::sched::get_attr(tid).unwrap().sched_nice,
            nice,
            "the recycled thread's nice is left as it was"
        );
        assert!(!path.exists());
        std::fs::write(&path, "{ nope").unwrap();
        let e = recover(&path).unwrap_err();
        assert!(format!("{e:#}").contains("change journal"), "{e:#}");
        assert!(format!("{e:#}").contains("corrupt"), "{e:#}");
        assert!(path.with_extension("json.corrupt").exists());
    }

    /// An agent that could set EEVDF slices journaled the original; after its crash the
    /// next agent must still put that slice back.
    #[test]
    fn recovery_puts_back_a_slice_an_older_agent_journaled() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.json");
        let tid = nix::unistd::gettid().as_raw() as u32;
        let mut attr = os_layer::sched::get_attr(tid).unwrap();
        let original = attr.sched_runtime;
        attr.sched_runtime = 7_000_000;
        os_layer::sched::set_attr(tid, &attr).unwrap();
        assert_eq!(
            os_layer::sched::get_attr(tid).unwrap().sched_runtime,
            7_000_000,
            "this kernel keeps no custom slice (Linux 6.12+ does)"
        );
        let mut ledger = Ledger::fresh(&path, &FORMAT);
        ledger
            .insert(Entry {
                tid,
                start_time: start_time(tid).unwrap(),
                runtime_ns: Some(original),
                ..Entry::default()
            })
            .unwrap();
        assert_eq!(recover(&path).unwrap(), 1);
        assert_eq!(
            os_layer::sched::get_attr(tid).unwrap().sched_runtime,
            original
        );
    }
}
