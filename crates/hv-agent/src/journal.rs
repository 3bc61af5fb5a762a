//! Crash safety for the `kvm-qemu` backend: the undo of every change to a vCPU thread
//! (original nice and slice, affinity, cgroup weight) is written to
//! `<state_dir>/journal.json` before the change is made. A clean exit restores everything
//! and removes the file; after SIGKILL, an OOM kill or a panic, the next start finds the
//! file and puts back what the dead agent left behind. Entries carry the thread's start
//! time, so a recycled thread id is never touched.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tracing::{info, warn};

use crate::cgroup::{self, Touched};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// `/proc/<tid>/stat` field 22, in clock ticks since boot.
    pub start_time: u64,
    pub nice: Option<i32>,
    pub runtime_ns: Option<u64>,
    pub mask: Option<Vec<usize>>,
    pub cgroup: Option<Touched>,
}

pub struct Journal {
    path: PathBuf,
    entries: BTreeMap<u32, Entry>,
}

/// A thread's start time: with the tid, what tells it from a later thread with its tid.
pub fn start_time(tid: u32) -> Option<u64> {
    os_layer::TaskStat::of_tid(tid).map(|s| s.start_time)
}

impl Journal {
    pub fn new(path: PathBuf) -> Journal {
        Journal {
            path,
            entries: BTreeMap::new(),
        }
    }

    /// Adds to `tid`'s undo (only what is not recorded yet: the first original wins) and
    /// persists it before returning.
    pub fn record(&mut self, tid: u32, add: impl FnOnce(&mut Entry)) -> Result<()> {
        let start_time = start_time(tid).with_context(|| format!("thread {tid} is gone"))?;
        let existed = self.entries.contains_key(&tid);
        let e = self.entries.entry(tid).or_insert_with(|| Entry {
            start_time,
            ..Entry::default()
        });
        let before = e.clone();
        let mut fresh = Entry {
            start_time,
            ..Entry::default()
        };
        add(&mut fresh);
        e.nice = e.nice.or(fresh.nice);
        e.runtime_ns = e.runtime_ns.or(fresh.runtime_ns);
        e.mask = e.mask.take().or(fresh.mask);
        e.cgroup = e.cgroup.take().or(fresh.cgroup);
        if *e != before {
            if let Err(err) = self.persist() {
                // Memory must not hold an undo the file lacks: the next call would find
                // it "recorded" and let the change through unjournaled.
                if existed {
                    self.entries.insert(tid, before);
                } else {
                    self.entries.remove(&tid);
                }
                return Err(err);
            }
        }
        Ok(())
    }

    pub fn forget(&mut self, tid: u32) {
        if self.entries.remove(&tid).is_some() {
            if let Err(e) = self.persist() {
                warn!("journal: {e:#}");
            }
        }
    }

    /// Everything was restored: nothing left to undo.
    pub fn clear(&mut self) {
        self.entries.clear();
        let _ = std::fs::remove_file(&self.path);
    }

    fn persist(&self) -> Result<()> {
        if self.entries.is_empty() {
            let _ = std::fs::remove_file(&self.path);
            return Ok(());
        }
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&self.entries)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &self.path)
            .with_context(|| format!("renaming {} into place", tmp.display()))
    }
}

/// Undoes what a previous agent left in `path`; returns how many threads were restored.
pub fn recover(path: &Path) -> Result<usize> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let entries: BTreeMap<u32, Entry> = match serde_json::from_slice(&text) {
        Ok(e) => e,
        Err(e) => {
            // Kept for a person to read; the next journal must not overwrite it.
            let _ = std::fs::rename(path, path.with_extension("json.bad"));
            return Err(e).with_context(|| format!("{}: not a journal", path.display()));
        }
    };
    let hierarchy = cgroup::Hierarchy::detect();
    let mut restored = 0;
    for (tid, e) in entries {
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
    std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
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
                    warn!(tid, "journal: could not restore nice/slice: {err}");
                }
            }
            Err(err) => warn!(tid, "journal: sched_getattr: {err}"),
        }
    }
    if let Some(cpus) = &e.mask {
        let mut set = nix::sched::CpuSet::new();
        for &c in cpus {
            let _ = set.set(c);
        }
        if let Err(err) =
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(tid as i32), &set)
        {
            warn!(tid, "journal: could not restore the affinity: {err}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_original_wins_and_file_follows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.json");
        let tid = nix::unistd::gettid().as_raw() as u32;
        let mut j = Journal::new(path.clone());
        j.record(tid, |e| e.nice = Some(3)).unwrap();
        j.record(tid, |e| {
            e.nice = Some(-5);
            e.mask = Some(vec![0]);
        })
        .unwrap();
        let on_disk: BTreeMap<u32, Entry> =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(on_disk[&tid].nice, Some(3), "the first original must win");
        assert_eq!(on_disk[&tid].mask, Some(vec![0]));
        assert_eq!(on_disk[&tid].start_time, start_time(tid).unwrap());
        j.forget(tid);
        assert!(!path.exists(), "an empty journal leaves no file");
    }

    #[test]
    fn an_undo_that_cannot_be_written_is_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let me = nix::unistd::gettid().as_raw() as u32;
        let mut j = Journal::new(dir.path().join("gone/journal.json"));
        assert!(j.record(me, |e| e.nice = Some(0)).is_err());
        // Asked again, it must try (and fail) again, not find the entry already there.
        assert!(j.record(me, |e| e.nice = Some(0)).is_err());
        std::fs::create_dir(dir.path().join("gone")).unwrap();
        j.record(me, |e| e.nice = Some(0)).unwrap();
        assert!(dir.path().join("gone/journal.json").exists());
    }

    #[test]
    fn recovery_skips_recycled_threads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.json");
        let tid = nix::unistd::gettid().as_raw() as u32;
        let entries = BTreeMap::from([(
            tid,
            Entry {
                // Not this thread's start time: a different thread with a recycled id.
                start_time: start_time(tid).unwrap() + 1,
                nice: Some(19),
                ..Entry::default()
            },
        )]);
        std::fs::write(&path, serde_json::to_vec(&entries).unwrap()).unwrap();
        assert_eq!(recover(&path).unwrap(), 0);
        assert_eq!(os_layer::sched::get_attr(tid).unwrap().sched_nice, 0);
        assert!(!path.exists());
        std::fs::write(&path, "{ nope").unwrap();
        let e = recover(&path).unwrap_err();
        assert!(format!("{e:#}").contains("not a journal"), "{e:#}");
        assert!(path.with_extension("json.bad").exists());
    }
}
