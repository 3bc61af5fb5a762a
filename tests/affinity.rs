//! Real-kernel tests of the affinity executor and its journal: real threads of this test
//! process, real `sched_setaffinity`, real `/proc`. Needs root (it changes masks through
//! the same privileged path the daemon uses, and creates a cpuset); built by another user
//! the tests are reported ignored, and run by another user they fail (`assert_root`).

use migrater::affinity::TaskId;
use migrater::affinity::{get_cpus, set_cpus, AffinityExecutor, Outcome};
use migrater::journal::{AffinityJournal, JournalEntry, JournalError, SliceChange};
use os_layer::TaskStat;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use vmigrater_testbed::{assert_root, gettid};

/// A real thread of this process that waits (or spins) until dropped or `exit()`ed.
struct Worker {
    tid: u32,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Worker {
    fn parked() -> Worker {
        Self::spawn(false)
    }

    fn spinning() -> Worker {
        Self::spawn(true)
    }

    fn spawn(spin: bool) -> Worker {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            tx.send(gettid()).unwrap();
            while !flag.load(Ordering::Relaxed) {
                if spin {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
        Worker {
            tid: rx.recv().unwrap(),
            stop,
            handle: Some(handle),
        }
    }

    fn start_time(&self) -> u64 {
        start_time(self.tid)
    }

    /// Ends the thread and waits until the kernel has reaped it.
    fn exit(mut self) -> u32 {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.take().unwrap().join().unwrap();
        let path = format!("/proc/self/task/{}", self.tid);
        let deadline = Instant::now() + Duration::from_secs(2);
        while Path::new(&path).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.tid
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn start_time(tid: u32) -> u64 {
    TaskStat::of_tid(tid)
        .expect("stat of a live thread")
        .start_time
}

fn tgid() -> u32 {
    std::process::id()
}

/// The two CPUs a test moves a task between. Such a test carries
/// `#[cfg_attr(not(all(vmigrater_root, vmigrater_2cpus)), ignore = "needs root and 2 CPUs")]`
/// (build.rs): it fails here, loudly, only when run with a narrower mask than it was built for.
fn two_cpus() -> (Vec<usize>, usize, usize) {
    let cpus = get_cpus(gettid()).unwrap();
    assert!(
        cpus.len() >= 2,
        "needs at least 2 CPUs in the test's mask, has {cpus:?}"
    );
    let (a, b) = (cpus[0], cpus[1]);
    (cpus, a, b)
}

fn executor(dir: &Path) -> (AffinityExecutor, PathBuf) {
    let path = dir.join("journal.json");
    (
        AffinityExecutor::new(AffinityJournal::open(&path).unwrap()),
        path,
    )
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn manage_move_and_release() {
    assert_root();
    let (cpus, a, b) = two_cpus();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, path) = executor(dir.path());
    let w = Worker::parked();

    let allowed = ex
        .manage(
            TaskId {
                tid: w.tid,
                start_time: w.start_time(),
            },
            tgid(),
        )
        .unwrap();
    assert_eq!(allowed, cpus);
    assert!(ex.is_managed(w.tid));
    // The original mask is on disk before any change.
    let on_disk = AffinityJournal::open(&path).unwrap();
    let e = on_disk.get(w.tid).expect("journaled at manage time");
    assert_eq!(
        (e.original.clone(), e.last_set.clone()),
        (cpus.clone(), None)
    );
    drop(on_disk);

    assert!(matches!(ex.move_to(w.tid, b), Outcome::Moved { .. }));
    assert_eq!(get_cpus(w.tid).unwrap(), vec![b]);
    assert_eq!(ex.placed_on(w.tid), Some(b));
    assert_eq!(ex.move_to(w.tid, b), Outcome::Unchanged);
    assert!(matches!(ex.move_to(w.tid, a), Outcome::Moved { .. }));
    assert_eq!(get_cpus(w.tid).unwrap(), vec![a]);
    // Only the first move was journaled: the hot path does no file I/O afterwards.
    let journaled = AffinityJournal::open(&path)
        .unwrap()
        .get(w.tid)
        .unwrap()
        .last_set
        .clone();
    assert_eq!(journaled, Some(vec![b]));
    assert_eq!(ex.managed().collect::<Vec<_>>(), vec![(w.tid, Some(a))]);

    // Outside the allowed set, or a task we do not manage: refused, nothing changes.
    assert_eq!(ex.move_to(w.tid, 4000), Outcome::Rejected);
    assert_eq!(ex.move_to(gettid(), a), Outcome::Rejected);
    assert_eq!(get_cpus(w.tid).unwrap(), vec![a]);

    assert!(matches!(ex.release(w.tid), Outcome::Restored { .. }));
    assert_eq!(get_cpus(w.tid).unwrap(), cpus);
    assert!(!ex.is_managed(w.tid));
    assert!(AffinityJournal::open(&path).unwrap().is_empty());
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn refuses_kernel_threads_and_wrong_identities() {
    assert_root();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, _) = executor(dir.path());
    let w = Worker::parked();
    let err = ex
        .manage(
            TaskId {
                tid: w.tid,
                start_time: w.start_time() + 1,
            },
            tgid(),
        )
        .unwrap_err();
    assert!(format!("{err:#}").contains("another task"), "{err:#}");

    let kthread = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find_map(|pid| {
            let s = TaskStat::of_tid(pid)?;
            s.is_kernel_thread().then_some((pid, s.start_time))
        })
        .expect("a kernel thread in /proc");
    let before = get_cpus(kthread.0).unwrap();
    let err = ex
        .manage(
            TaskId {
                tid: kthread.0,
                start_time: kthread.1,
            },
            kthread.0,
        )
        .unwrap_err();
    assert!(format!("{err:#}").contains("kernel thread"), "{err:#}");
    assert_eq!(get_cpus(kthread.0).unwrap(), before);
    assert!(ex.journal().is_empty());
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn external_change_stops_management_and_is_never_restored() {
    assert_root();
    let (cpus, a, b) = two_cpus();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, path) = executor(dir.path());
    let w = Worker::parked();
    ex.manage(
        TaskId {
            tid: w.tid,
            start_time: w.start_time(),
        },
        tgid(),
    )
    .unwrap();
    assert!(matches!(ex.move_to(w.tid, a), Outcome::Moved { .. }));

    // An administrator (taskset) pins it elsewhere.
    set_cpus(w.tid, &[b]).unwrap();
    assert_eq!(ex.move_to(w.tid, a), Outcome::External);
    assert!(!ex.is_managed(w.tid));
    assert_eq!(ex.managed_count(), 0);
    assert_eq!(get_cpus(w.tid).unwrap(), vec![b], "their mask stays");
    assert!(
        AffinityJournal::open(&path).unwrap().get(w.tid).is_none(),
        "no longer ours to restore"
    );
    assert_eq!(ex.move_to(w.tid, a), Outcome::External);
    assert_eq!(ex.release(w.tid), Outcome::External);
    assert_eq!(
        get_cpus(w.tid).unwrap(),
        vec![b],
        "release does not restore"
    );

    // Also before our first move: a changed original mask is theirs.
    let w2 = Worker::parked();
    ex.manage(
        TaskId {
            tid: w2.tid,
            start_time: w2.start_time(),
        },
        tgid(),
    )
    .unwrap();
    set_cpus(w2.tid, &[b]).unwrap();
    assert_eq!(ex.release(w2.tid), Outcome::External);
    assert_eq!(get_cpus(w2.tid).unwrap(), vec![b]);
    set_cpus(w.tid, &cpus).unwrap();
    set_cpus(w2.tid, &cpus).unwrap();
}

/// A task the daemon keeps where it is gets no next move: the audit finds the outside
/// change without one, and leaves the tasks nobody touched managed.
#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn an_outside_change_is_found_without_a_next_move() {
    assert_root();
    let (cpus, a, b) = two_cpus();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, path) = executor(dir.path());
    let changed = Worker::parked();
    let kept = Worker::parked();
    let unmoved = Worker::parked();
    for w in [&changed, &kept, &unmoved] {
        ex.manage(
            TaskId {
                tid: w.tid,
                start_time: w.start_time(),
            },
            tgid(),
        )
        .unwrap();
    }
    assert!(matches!(ex.move_to(changed.tid, a), Outcome::Moved { .. }));
    assert!(matches!(ex.move_to(kept.tid, a), Outcome::Moved { .. }));
    assert!(
        ex.hand_off_changed().is_empty(),
        "nobody changed a mask yet"
    );

    // Their owner gives the pinned task its whole mask back, and pins the one never moved.
    set_cpus(changed.tid, &cpus).unwrap();
    set_cpus(unmoved.tid, &[b]).unwrap();
    let mut found: Vec<u32> = ex.hand_off_changed().iter().map(|t| t.tid).collect();
    found.sort_unstable();
    let mut want = vec![changed.tid, unmoved.tid];
    want.sort_unstable();
    assert_eq!(found, want);
    assert!(!ex.is_managed(changed.tid) && !ex.is_managed(unmoved.tid));
    assert!(ex.is_managed(kept.tid), "its mask is still ours");
    assert_eq!(ex.placed_on(kept.tid), Some(a));
    let journal = AffinityJournal::open(&path).unwrap();
    assert!(journal.get(changed.tid).is_none() && journal.get(unmoved.tid).is_none());
    assert!(journal.get(kept.tid).is_some(), "still ours to restore");
    assert!(ex.hand_off_changed().is_empty(), "each is handed off once");
    assert_eq!(get_cpus(changed.tid).unwrap(), cpus, "their mask stays");
    assert!(matches!(ex.release(kept.tid), Outcome::Restored { .. }));
    assert_eq!(get_cpus(kept.tid).unwrap(), cpus);
    set_cpus(unmoved.tid, &cpus).unwrap();
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn exited_task_is_gone_not_an_error() {
    assert_root();
    let (_, a, _) = two_cpus();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, path) = executor(dir.path());
    let w = Worker::parked();
    ex.manage(
        TaskId {
            tid: w.tid,
            start_time: w.start_time(),
        },
        tgid(),
    )
    .unwrap();
    let tid = w.exit();
    assert_eq!(ex.move_to(tid, a), Outcome::Gone);
    assert_eq!(ex.release(tid), Outcome::Gone);
    assert!(AffinityJournal::open(&path).unwrap().is_empty());
    assert!(
        ex.manage(TaskId { tid, start_time: 1 }, tgid()).is_err(),
        "an exited task cannot be managed"
    );
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn release_all_restores_every_original_mask() {
    assert_root();
    let (cpus, a, b) = two_cpus();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, path) = executor(dir.path());
    let workers: Vec<Worker> = (0..3).map(|_| Worker::parked()).collect();
    // One starts with a narrower mask of its own: that, not "all CPUs", is its original.
    set_cpus(workers[2].tid, &[a]).unwrap();
    for (i, w) in workers.iter().enumerate() {
        let allowed = ex
            .manage(
                TaskId {
                    tid: w.tid,
                    start_time: w.start_time(),
                },
                tgid(),
            )
            .unwrap();
        let target = if i % 2 == 0 { a } else { b };
        if allowed.contains(&target) && i != 2 {
            assert!(matches!(ex.move_to(w.tid, target), Outcome::Moved { .. }));
        }
    }
    assert_eq!(
        ex.move_to(workers[2].tid, b),
        Outcome::Rejected,
        "outside its original mask"
    );
    assert_eq!(
        ex.release_all(),
        2,
        "two were moved; the third was never changed"
    );
    assert_eq!(get_cpus(workers[0].tid).unwrap(), cpus);
    assert_eq!(get_cpus(workers[1].tid).unwrap(), cpus);
    assert_eq!(get_cpus(workers[2].tid).unwrap(), vec![a]);
    assert_eq!(ex.managed_count(), 0);
    assert!(AffinityJournal::open(&path).unwrap().is_empty());
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn journal_of_a_crashed_run_is_recovered() {
    assert_root();
    let (cpus, a, b) = two_cpus();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, path) = executor(dir.path());
    let moved_once = Worker::parked();
    let moved_twice = Worker::parked();
    let never_moved = Worker::parked();
    let exited = Worker::parked();
    for w in [&moved_once, &moved_twice, &never_moved, &exited] {
        ex.manage(
            TaskId {
                tid: w.tid,
                start_time: w.start_time(),
            },
            tgid(),
        )
        .unwrap();
    }
    assert!(matches!(
        ex.move_to(moved_once.tid, b),
        Outcome::Moved { .. }
    ));
    assert!(matches!(
        ex.move_to(moved_twice.tid, a),
        Outcome::Moved { .. }
    ));
    // The second move is not journaled: recovery must still recognise it as ours.
    assert!(matches!(
        ex.move_to(moved_twice.tid, b),
        Outcome::Moved { .. }
    ));
    assert!(matches!(ex.move_to(exited.tid, a), Outcome::Moved { .. }));
    // kill -9: no release, no destructor.
    std::mem::forget(ex);
    let exited = exited.exit();

    let report = AffinityJournal::recover(&path).unwrap();
    let mut restored = report.restored.clone();
    restored.sort_unstable();
    let mut expect = vec![moved_once.tid, moved_twice.tid];
    expect.sort_unstable();
    assert_eq!(restored, expect, "{report:?}");
    assert_eq!(report.untouched, vec![never_moved.tid]);
    assert_eq!(report.gone, vec![exited]);
    assert!(report.failed.is_empty() && report.external.is_empty() && report.reused.is_empty());
    for w in [&moved_once, &moved_twice, &never_moved] {
        assert_eq!(get_cpus(w.tid).unwrap(), cpus);
    }
    assert!(
        AffinityJournal::open(&path).unwrap().is_empty(),
        "cleared after recovery"
    );
    assert_eq!(
        AffinityJournal::recover(&path).unwrap().restored,
        Vec::<u32>::new()
    );
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn recovery_leaves_reused_tids_and_foreign_masks_alone() {
    assert_root();
    let (cpus, a, b) = two_cpus();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.json");
    let reused = Worker::parked();
    let foreign = Worker::parked();
    let mut j = AffinityJournal::open(&path).unwrap();
    // Same tid, but the journal's task started at another time: a different task now.
    j.record(JournalEntry {
        tid: reused.tid,
        tgid: tgid(),
        start_time: reused.start_time() + 1,
        original: cpus.clone(),
        allowed: cpus.clone(),
        last_set: Some(vec![a]),
        slice: None,
    })
    .unwrap();
    // Same task, but its mask is none we could have set (b is outside what we pinned to).
    j.record(JournalEntry {
        tid: foreign.tid,
        tgid: tgid(),
        start_time: foreign.start_time(),
        original: cpus.clone(),
        allowed: vec![a],
        last_set: Some(vec![a]),
        slice: None,
    })
    .unwrap();
    drop(j);
    set_cpus(reused.tid, &[a]).unwrap();
    set_cpus(foreign.tid, &[b]).unwrap();

    let report = AffinityJournal::recover(&path).unwrap();
    assert_eq!(report.reused, vec![reused.tid], "{report:?}");
    assert_eq!(report.external, vec![foreign.tid], "{report:?}");
    assert!(report.restored.is_empty());
    assert_eq!(get_cpus(reused.tid).unwrap(), vec![a]);
    assert_eq!(get_cpus(foreign.tid).unwrap(), vec![b]);
    assert!(AffinityJournal::open(&path).unwrap().is_empty());
    set_cpus(reused.tid, &cpus).unwrap();
    set_cpus(foreign.tid, &cpus).unwrap();
}

fn slice_of(tid: u32) -> u64 {
    os_layer::sched::fair_slice(tid)
        .expect("sched_getattr of a live thread")
        .expect("a fair thread")
}

/// The slice change the journal on disk holds for a task it has.
fn journaled_slice(path: &Path, tid: u32) -> Option<SliceChange> {
    AffinityJournal::open(path)
        .unwrap()
        .get(tid)
        .expect("journaled")
        .slice
}

/// The slice of a thread that never had one of its own (Linux >= 6.12).
fn base_slice() -> u64 {
    os_layer::sched::base_slice_ns()
        .unwrap()
        .expect("custom slices need Linux >= 6.12")
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_kept_task_gets_a_short_slice_journaled_first_and_its_own_back() {
    assert_root();
    let base = base_slice();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, path) = executor(dir.path());
    let w = Worker::parked();
    os_layer::sched::set_fair_slice(w.tid, 0).unwrap();
    assert_eq!(slice_of(w.tid), base);
    // Not managed: never touched.
    assert_eq!(ex.set_short_slices(&[w.tid], 100_000), (0, 0));
    assert_eq!(slice_of(w.tid), base);

    ex.manage(
        TaskId {
            tid: w.tid,
            start_time: w.start_time(),
        },
        tgid(),
    )
    .unwrap();
    assert_eq!(ex.set_short_slices(&[w.tid], 100_000), (1, 0));
    assert_eq!(slice_of(w.tid), 100_000);
    assert!(ex.has_short_slice(w.tid));
    let journaled = journaled_slice(&path, w.tid);
    assert_eq!(
        journaled,
        Some(SliceChange {
            original_ns: None,
            set_ns: 100_000
        }),
        "its own (the base slice) journaled as such before the change"
    );
    // Asked again: nothing to do.
    assert_eq!(ex.set_short_slices(&[w.tid], 100_000), (0, 0));
    // A reload asks for another slice: the new one, still journaled as its own the base.
    assert_eq!(ex.set_short_slices(&[w.tid], 300_000), (1, 0));
    assert_eq!(slice_of(w.tid), 300_000);
    assert_eq!(
        journaled_slice(&path, w.tid),
        Some(SliceChange {
            original_ns: None,
            set_ns: 300_000
        })
    );
    // No longer kept, still managed: its slice back, the kernel's default again.
    assert_eq!(ex.set_short_slices(&[], 100_000), (0, 1));
    assert_eq!(slice_of(w.tid), base);
    assert!(ex.is_managed(w.tid) && !ex.has_short_slice(w.tid));
    assert_eq!(journaled_slice(&path, w.tid), None);
    // Kept again, then released: mask and slice back.
    ex.set_short_slices(&[w.tid], 100_000);
    assert!(matches!(ex.release(w.tid), Outcome::Unchanged));
    assert_eq!(slice_of(w.tid), base, "release gives the slice back too");
    assert!(AffinityJournal::open(&path).unwrap().is_empty());
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn slices_of_their_own_and_slices_someone_else_changed_are_respected() {
    assert_root();
    let base = base_slice();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, _) = executor(dir.path());
    let own = Worker::parked();
    let shorter = Worker::parked();
    let changed = Worker::parked();
    os_layer::sched::set_fair_slice(own.tid, 3_000_000).unwrap();
    os_layer::sched::set_fair_slice(shorter.tid, 100_000).unwrap();
    os_layer::sched::set_fair_slice(changed.tid, 0).unwrap();
    for w in [&own, &shorter, &changed] {
        ex.manage(
            TaskId {
                tid: w.tid,
                start_time: w.start_time(),
            },
            tgid(),
        )
        .unwrap();
    }
    let all = [own.tid, shorter.tid, changed.tid];
    assert_eq!(ex.set_short_slices(&all, 200_000), (2, 0));
    assert_eq!(
        slice_of(shorter.tid),
        100_000,
        "already shorter: left alone"
    );
    assert!(!ex.has_short_slice(shorter.tid));
    // An administrator sets a slice of theirs after us: never overridden.
    os_layer::sched::set_fair_slice(changed.tid, 500_000).unwrap();
    // A reload asks for another slice: ours is replaced, theirs stays theirs.
    assert_eq!(ex.set_short_slices(&all, 300_000), (1, 0));
    assert_eq!(slice_of(own.tid), 300_000);
    assert_eq!(slice_of(changed.tid), 500_000);
    assert_eq!(ex.release_all(), 0, "no mask was changed");
    assert_eq!(
        slice_of(own.tid),
        3_000_000,
        "its own custom slice back exactly"
    );
    assert_eq!(slice_of(changed.tid), 500_000, "theirs, not ours");
    assert_eq!(slice_of(shorter.tid), 100_000);
    os_layer::sched::set_fair_slice(changed.tid, 0).unwrap();
    assert_eq!(slice_of(changed.tid), base);
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_crashed_run_s_short_slices_are_given_back_by_recovery() {
    assert_root();
    let base = base_slice();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, path) = executor(dir.path());
    let ours = Worker::parked();
    let theirs = Worker::parked();
    for w in [&ours, &theirs] {
        os_layer::sched::set_fair_slice(w.tid, 0).unwrap();
        ex.manage(
            TaskId {
                tid: w.tid,
                start_time: w.start_time(),
            },
            tgid(),
        )
        .unwrap();
    }
    assert_eq!(
        ex.set_short_slices(&[ours.tid, theirs.tid], 100_000),
        (2, 0)
    );
    // kill -9: no release, no destructor; then someone changes one slice.
    std::mem::forget(ex);
    os_layer::sched::set_fair_slice(theirs.tid, 700_000).unwrap();

    let report = AffinityJournal::recover(&path).unwrap();
    assert_eq!(report.slices_restored, vec![ours.tid], "{report:?}");
    assert!(report.failed.is_empty(), "{report:?}");
    assert_eq!(slice_of(ours.tid), base);
    assert_eq!(slice_of(theirs.tid), 700_000);
    // The masks were never changed: both untouched on that side.
    assert_eq!(report.untouched.len(), 2);
    assert!(AffinityJournal::open(&path).unwrap().is_empty());
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn corrupt_journal_is_a_clear_error_and_kept_aside() {
    assert_root();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.json");
    std::fs::write(&path, "{\"version\": 1, \"entries\": [ {\"tid\": 12,").unwrap();
    let err = AffinityJournal::recover(&path).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, JournalError::Corrupt { .. }), "{msg}");
    assert!(
        msg.contains(&path.display().to_string()),
        "names the file: {msg}"
    );
    let aside = dir.path().join("journal.json.corrupt");
    assert!(aside.exists() && !path.exists());
    assert!(
        std::fs::read_to_string(aside)
            .unwrap()
            .contains("\"tid\": 12"),
        "kept, not deleted"
    );
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus, vmigrater_cgroup_v1_cpuset)),
    ignore = "needs root, 2 CPUs and a cgroup v1 cpuset hierarchy"
)]
fn cpuset_limits_the_allowed_cpus() {
    assert_root();
    let (_, a, b) = two_cpus();
    let root = Path::new("/sys/fs/cgroup/cpuset");
    assert!(
        root.join("tasks").exists(),
        "no cgroup v1 cpuset hierarchy at {}, though the build found one",
        root.display()
    );
    let cg = root.join(format!("vmigrater-test-{}", std::process::id()));
    std::fs::create_dir(&cg).unwrap();
    let mems = std::fs::read_to_string(root.join("cpuset.mems")).unwrap();
    std::fs::write(cg.join("cpuset.cpus"), a.to_string()).unwrap();
    std::fs::write(cg.join("cpuset.mems"), mems.trim()).unwrap();

    let w = Worker::parked();
    std::fs::write(cg.join("tasks"), w.tid.to_string()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, _) = executor(dir.path());
    let allowed = ex
        .manage(
            TaskId {
                tid: w.tid,
                start_time: w.start_time(),
            },
            tgid(),
        )
        .unwrap();
    assert_eq!(allowed, vec![a]);
    assert_eq!(
        ex.move_to(w.tid, b),
        Outcome::Rejected,
        "the cpuset forbids it: refused, no panic"
    );
    assert!(ex.is_managed(w.tid));
    let _ = ex.release_all();

    // Back to the root cpuset, then remove ours.
    std::fs::write(root.join("tasks"), w.tid.to_string()).unwrap();
    drop(w);
    std::fs::remove_dir(&cg).unwrap();
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn measure(ex: &mut AffinityExecutor, tid: u32, a: usize, b: usize, n: usize) -> (u64, u64, u64) {
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        match ex.move_to(tid, if i % 2 == 0 { a } else { b }) {
            Outcome::Moved { latency_ns } => lat.push(latency_ns),
            other => panic!("move {i}: {other:?}"),
        }
    }
    lat.sort_unstable();
    (
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        *lat.last().unwrap(),
    )
}

#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn move_latency() {
    assert_root();
    let (_, a, b) = two_cpus();
    let dir = tempfile::tempdir().unwrap();
    let (mut ex, _) = executor(dir.path());
    // An I/O-bound task mostly sleeps: that is the common case.
    let sleeper = Worker::parked();
    ex.manage(
        TaskId {
            tid: sleeper.tid,
            start_time: sleeper.start_time(),
        },
        tgid(),
    )
    .unwrap();
    let (p50, p99, max) = measure(&mut ex, sleeper.tid, a, b, 2000);
    eprintln!(
        "move_to latency, sleeping thread, 2000 moves: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
        p50 as f64 / 1e3,
        p99 as f64 / 1e3,
        max as f64 / 1e3
    );
    // A running task has to be migrated by the stopper thread before the call returns.
    let spinner = Worker::spinning();
    ex.manage(
        TaskId {
            tid: spinner.tid,
            start_time: spinner.start_time(),
        },
        tgid(),
    )
    .unwrap();
    let (s50, s99, smax) = measure(&mut ex, spinner.tid, a, b, 2000);
    eprintln!(
        "move_to latency, running thread, 2000 moves: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
        s50 as f64 / 1e3,
        s99 as f64 / 1e3,
        smax as f64 / 1e3
    );
    assert_eq!(ex.release_all(), 2);
    assert!(p50 <= 50_000, "sched_setaffinity move p50 {p50} ns > 50 µs");
}
