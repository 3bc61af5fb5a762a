//! The affinity executor: the only code that changes another task's CPU mask
//! (`sched_setaffinity`), a thin adapter between the planner's moves and the kernel.
//!
//! It owns the set of tasks we manage and where we pinned each one. It must never:
//! change a task before its original mask is in the journal; touch a kernel thread or a
//! task whose identity (tgid, start time) is not the one handed to it; pin outside the
//! task's original mask ∩ cpuset; or fight an administrator: when a task's mask is not the
//! one we last set, someone else changed it, and we stop managing it and never restore it.
//! ESRCH (the task exited) and EINVAL (e.g. a CPU the cpuset forbids) are normal outcomes,
//! not errors.
//!
//! Hot path (`move_to`, on a SCHED_FIFO monitor thread): one `sched_getaffinity` to
//! detect outside changes, one `sched_setaffinity`, no allocation, and no file I/O except
//! on the rare state changes: the first move of a task (the journal's `last_set`, written
//! before the syscall so a crash right after it is still recoverable) and the discovery of
//! an outside change (the entry leaves the journal). Later moves are not journaled; see
//! `journal` for why recovery still recognises every single-CPU mask we may have set.
//!
//! Linux copies a parent's mask to its children, so a task we pinned passes the pin on to
//! what it starts; `undo_inherited` sets those back to the parent's own mask.
//!
//! It also owns the one other attribute we change: the scheduler slice of a task kept with
//! its completions (`set_short_slices`), journaled before the change like a mask and given
//! back on release unless someone else changed it after us.

use anyhow::{bail, Context};
use nix::errno::Errno;
use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};
use task_detector::ForkSample;
use tracing::{debug, info, warn};

use os_layer::{cpus_of, parse_cpu_list, to_cpuset, Root, TaskStat};

use crate::journal::{
    mask_is_ours, restore_slice, AffinityJournal, JournalEntry, JournalError, SliceChange,
};

/// A task as the daemon tells it apart: a tid may be reused by another task, its start
/// time (clock ticks since boot, `/proc/<tid>/stat` field 22) may not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId {
    pub tid: u32,
    pub start_time: u64,
}

/// What became of one requested change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The mask was set to the target CPU; `latency_ns` covers the check and the change.
    Moved { latency_ns: u64 },
    /// What we changed (the mask, or the scheduler slice) was given back.
    Restored { latency_ns: u64 },
    /// The task was given our short scheduler slice.
    SliceShortened,
    /// Already there (or never changed, on release): nothing to do.
    Unchanged,
    /// ESRCH: the task exited. Normal.
    Gone,
    /// EINVAL/EPERM, a CPU outside the task's allowed set, or a task we do not manage
    /// (not journaled). Normal; the task keeps its mask.
    Rejected,
    /// Someone else changed the mask since our last set: no longer managed, never restored.
    External,
}

impl Outcome {
    /// The result as a log field and metric label value.
    pub fn as_str(&self) -> &'static str {
        match self {
            Outcome::Moved { .. } => "moved",
            Outcome::Restored { .. } => "restored",
            Outcome::SliceShortened => "slice_shortened",
            Outcome::Unchanged => "unchanged",
            Outcome::Gone => "gone",
            Outcome::Rejected => "rejected",
            Outcome::External => "external",
        }
    }
}

pub use os_layer::{get_cpus, set_cpus};

/// A single-CPU set.
fn single(cpu: usize) -> Result<CpuSet, Errno> {
    os_layer::to_cpuset(&[cpu]).ok_or(Errno::EINVAL)
}

/// One task we manage.
#[derive(Debug)]
struct Managed {
    start_time: u64,
    original: CpuSet,
    allowed: Vec<usize>,
    /// Where we pinned it; `None`: still its original mask.
    placed: Option<usize>,
    /// The journal has a `last_set`, so later moves need no write.
    journaled_move: bool,
    /// Outside change seen: hands off until released.
    external: bool,
    /// The slice we gave it; `None`: its own.
    slice: Option<SliceChange>,
}

impl Managed {
    fn expected(&self) -> Result<CpuSet, Errno> {
        match self.placed {
            Some(c) => single(c),
            None => Ok(self.original),
        }
    }
}

/// Journal writes that fail (a full or read-only state directory): counted, said once when
/// they start failing and once when a write works again, never once per task. While the
/// journal cannot be written no task is taken over or moved for the first time; tasks
/// already moved stay managed, and every mask is still restored on exit.
#[derive(Debug, Default)]
struct JournalHealth {
    failing: bool,
    errors: u64,
    /// While failing, the next write is tried no earlier than this: a full disk must not
    /// cost a file write per tick on the monitor's hot path.
    retry_at: Option<Instant>,
}

/// Between two tries of a journal that cannot be written.
const JOURNAL_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

impl JournalHealth {
    fn may_try(&self) -> bool {
        !self.failing || self.retry_at.is_none_or(|t| Instant::now() >= t)
    }

    /// A journal write worked.
    fn wrote(&mut self) {
        if self.failing {
            self.failing = false;
            info!("the affinity journal can be written again: taking tasks over again");
        }
    }

    fn failed(&mut self, e: &JournalError) {
        self.errors += 1;
        self.retry_at = Some(Instant::now() + JOURNAL_RETRY);
        if !self.failing {
            self.failing = true;
            warn!(
                "{e}: no task is taken over or moved for the first time until the journal can \
                 be written again (tasks already moved stay managed; every mask is still \
                 restored on exit)"
            );
        }
    }
}

/// How long a released task's own mask is remembered (`undo_inherited`): the threads it
/// started while pinned are reported at the next poll of the block programs, which may come
/// after its release (one sample period, 2.5 s by default).
const ORIGIN_KEPT: Duration = Duration::from_secs(30);

pub struct AffinityExecutor {
    journal: AffinityJournal,
    health: JournalHealth,
    tasks: BTreeMap<u32, Managed>,
    /// By tid: the own mask of a task released lately, or of a thread set back by
    /// `undo_inherited` (its own children inherited the same pin), and when it was noted.
    origins: HashMap<u32, (CpuSet, Instant)>,
    root: Root,
    /// What a fair thread without a slice of its own reads (asked once, when first needed).
    base_slice: Option<Option<u64>>,
}

impl AffinityExecutor {
    pub fn new(journal: AffinityJournal) -> Self {
        Self::with_root(journal, Root::real())
    }

    /// `new` reading `/proc` and `/sys` elsewhere (fake trees in tests, containers).
    pub fn with_root(journal: AffinityJournal, root: Root) -> Self {
        AffinityExecutor {
            journal,
            health: JournalHealth::default(),
            tasks: BTreeMap::new(),
            origins: HashMap::new(),
            root,
            base_slice: None,
        }
    }

    /// Takes a task over: checks it is the expected, non-kernel task, journals its
    /// original mask (before any change), and returns the CPUs it may be pinned to
    /// (original mask ∩ cpuset). Calling it again for a managed task returns the same list.
    pub fn manage(&mut self, task: TaskId, tgid: u32) -> anyhow::Result<Vec<usize>> {
        let TaskId { tid, start_time } = task;
        if let Some(m) = self.tasks.get(&tid) {
            if m.start_time == start_time && !m.external {
                return Ok(m.allowed.clone());
            }
            if m.start_time == start_time {
                bail!("tid {tid}: its mask was changed by someone else; not managing it again");
            }
            // The tid was reused: the task we managed is gone, forget it.
            self.tasks.remove(&tid);
            self.journal_remove(tid);
        }
        let stat_path = self.root.task(tgid, tid).join("stat");
        let text = std::fs::read_to_string(&stat_path)
            .with_context(|| format!("reading {} (task gone?)", stat_path.display()))?;
        let stat =
            TaskStat::parse(&text).with_context(|| format!("parsing {}", stat_path.display()))?;
        if stat.start_time != start_time {
            bail!(
                "tid {tid}: start time {} is not the expected {start_time}: another task",
                stat.start_time
            );
        }
        if stat.is_kernel_thread() {
            bail!("tid {tid} is a kernel thread: never managed");
        }
        let current = sched_getaffinity(Pid::from_raw(tid as i32))
            .with_context(|| format!("sched_getaffinity({tid})"))?;

        // A journal entry for this very task survives from an earlier run that was not
        // recovered: its original mask is the real one, the current one may be ours.
        let known = self
            .journal
            .get(tid)
            .filter(|e| e.tgid == tgid && e.start_time == start_time)
            .cloned();
        let known_slice = known.as_ref().and_then(|e| e.slice);
        let (original, placed, journaled_move) = match &known {
            Some(e) => {
                let cur = cpus_of(&current);
                let original = to_cpuset(&e.original).context("journaled CPU list")?;
                if cur == e.original {
                    (original, None, false)
                } else if mask_is_ours(e, &cur) && cur.len() == 1 {
                    (original, Some(cur[0]), true)
                } else {
                    bail!("tid {tid}: mask {cur:?} was changed by someone else since the journal was written");
                }
            }
            None => (current, None, false),
        };
        let original_list = cpus_of(&original);
        let mut allowed = original_list.clone();
        for limit in [self.status_cpus(tgid, tid), self.cpuset_cpus(tgid, tid)]
            .into_iter()
            .flatten()
        {
            allowed.retain(|c| limit.contains(c));
        }
        if allowed.is_empty() {
            bail!("tid {tid}: no CPU in its mask {original_list:?} is allowed by its cpuset");
        }
        let entry = JournalEntry {
            tid,
            tgid,
            start_time,
            original: original_list,
            allowed: allowed.clone(),
            last_set: known.and_then(|e| e.last_set),
            slice: known_slice,
        };
        if !self.health.may_try() {
            bail!("the affinity journal cannot be written; trying again in a moment");
        }
        match self.journal.record(entry) {
            Ok(()) => self.health.wrote(),
            Err(e) => {
                self.health.failed(&e);
                return Err(e).context("journaling the original CPU mask");
            }
        }
        self.tasks.insert(
            tid,
            Managed {
                start_time,
                original,
                allowed: allowed.clone(),
                placed,
                journaled_move,
                external: false,
                slice: known_slice,
            },
        );
        Ok(allowed)
    }

    /// Managed and not handed off after an outside change.
    pub fn is_managed(&self, tid: u32) -> bool {
        self.tasks.get(&tid).is_some_and(|m| !m.external)
    }

    /// The CPU we pinned `tid` to, if any.
    pub fn placed_on(&self, tid: u32) -> Option<usize> {
        self.tasks
            .get(&tid)
            .filter(|m| !m.external)
            .and_then(|m| m.placed)
    }

    /// Number of tasks managed (outside-changed ones excluded).
    pub fn managed_count(&self) -> usize {
        self.tasks.values().filter(|m| !m.external).count()
    }

    /// (tid, where we pinned it) for every managed task, by tid.
    pub fn managed(&self) -> impl Iterator<Item = (u32, Option<usize>)> + '_ {
        self.tasks
            .iter()
            .filter(|(_, m)| !m.external)
            .map(|(&t, m)| (t, m.placed))
    }

    pub fn journal(&self) -> &AffinityJournal {
        &self.journal
    }

    /// Pins a managed task to the single CPU `cpu`.
    pub fn move_to(&mut self, tid: u32, cpu: usize) -> Outcome {
        let Some(m) = self.tasks.get_mut(&tid) else {
            return Outcome::Rejected;
        };
        if m.external {
            return Outcome::External;
        }
        if !m.allowed.contains(&cpu) {
            return Outcome::Rejected;
        }
        let (Ok(target), Ok(expected)) = (single(cpu), m.expected()) else {
            return Outcome::Rejected;
        };
        let pid = Pid::from_raw(tid as i32);
        let start = Instant::now();
        let current = match sched_getaffinity(pid) {
            Ok(c) => c,
            Err(e) => return errno_outcome(e),
        };
        if current != expected {
            m.external = true;
            // Hands off its mask; the slice is still ours to give back.
            if let Some(change) = m.slice.take() {
                give_back_slice(tid, change);
            }
            self.journal_remove(tid);
            return Outcome::External;
        }
        if m.placed == Some(cpu) {
            return Outcome::Unchanged;
        }
        if !m.journaled_move {
            // The first change of this task: after it, recovery must know a mask of ours
            // may be in place. Written before the syscall, so no crash window exists.
            if !self.health.may_try() {
                return Outcome::Rejected;
            }
            if let Err(e) = self.journal.update_last_set(tid, &[cpu]) {
                self.health.failed(&e);
                return Outcome::Rejected;
            }
            m.journaled_move = true;
            // Once per task, like every change a tuner makes to someone else's task: what,
            // why, and where the undo is. Later moves of the same task are the metrics'.
            info!(
                tid,
                cpu,
                original = ?cpus_of(&m.original),
                journal = %self.journal.path().display(),
                "I/O-bound task taken over: pinned to one vCPU, its original mask is journaled"
            );
        }
        match sched_setaffinity(pid, &target) {
            Ok(()) => {
                m.placed = Some(cpu);
                Outcome::Moved {
                    latency_ns: start.elapsed().as_nanos() as u64,
                }
            }
            Err(e) => errno_outcome(e),
        }
    }

    /// Gives a task its original mask back (unless someone else changed it since our last
    /// set) and forgets it.
    pub fn release(&mut self, tid: u32) -> Outcome {
        let Some(m) = self.tasks.remove(&tid) else {
            return Outcome::Unchanged;
        };
        if m.external {
            return Outcome::External;
        }
        self.origins.insert(tid, (m.original, Instant::now()));
        if let Some(change) = m.slice {
            give_back_slice(tid, change);
        }
        let pid = Pid::from_raw(tid as i32);
        let start = Instant::now();
        let outcome = match (sched_getaffinity(pid), m.expected()) {
            (Err(e), _) | (_, Err(e)) => errno_outcome(e),
            (Ok(current), Ok(expected)) if current != expected => Outcome::External,
            (Ok(_), Ok(_)) if m.placed.is_none() => Outcome::Unchanged,
            (Ok(_), Ok(_)) => match sched_setaffinity(pid, &m.original) {
                Ok(()) => Outcome::Restored {
                    latency_ns: start.elapsed().as_nanos() as u64,
                },
                Err(e) => {
                    warn!(tid, "restoring the original CPU mask failed: {e}");
                    errno_outcome(e)
                }
            },
        };
        self.journal_remove(tid);
        outcome
    }

    /// Gives the managed tasks in `keep` a scheduler slice of `ns` (where theirs is longer)
    /// and every other managed task its own slice back; returns how many changed each way.
    ///
    /// Why: a task kept on the vCPU that takes its completions shares it with whatever
    /// else runs there. Under EEVDF a task woken with the default slice may wait behind a
    /// CPU-bound task's whole slice, down to one run per timer tick for seconds under
    /// deschedules; with a short slice its deadline comes first at every wake-up
    /// (`benches/RESULTS.md`, the slice experiment).
    pub fn set_short_slices(&mut self, keep: &[u32], ns: u64) -> (usize, usize) {
        let mut shortened = 0;
        for &tid in keep {
            if matches!(self.shorten_slice(tid, ns), Outcome::SliceShortened) {
                shortened += 1;
            }
        }
        let back: Vec<u32> = self
            .tasks
            .iter()
            .filter(|(tid, m)| m.slice.is_some() && !keep.contains(tid))
            .map(|(&tid, _)| tid)
            .collect();
        let restored = back
            .into_iter()
            .filter(|&tid| matches!(self.restore_slice(tid), Outcome::Restored { .. }))
            .count();
        (shortened, restored)
    }

    /// Whether we gave `tid` a slice of its own.
    pub fn has_short_slice(&self, tid: u32) -> bool {
        self.tasks.get(&tid).is_some_and(|m| m.slice.is_some())
    }

    /// Gives a managed fair task a slice of `ns`, journaled first. `Unchanged` when it has
    /// that one of ours already or its own is as short; one of ours of another length (a
    /// reload) is given back first. `Rejected` for real-time and idle tasks.
    pub fn shorten_slice(&mut self, tid: u32, ns: u64) -> Outcome {
        let base = self.base_slice();
        let Some(m) = self.tasks.get_mut(&tid) else {
            return Outcome::Rejected;
        };
        if m.external {
            return Outcome::External;
        }
        if let Some(set) = m.slice.map(|c| c.set_ns) {
            if set == ns {
                return Outcome::Unchanged;
            }
            // A reload changed the slice to give: ours back first, then the new one (not
            // over a slice someone else set meanwhile).
            return match self.restore_slice(tid) {
                Outcome::Restored { .. } => self.shorten_slice(tid, ns),
                other => other,
            };
        }
        let current = match os_layer::sched::fair_slice(tid) {
            Ok(Some(s)) => s,
            Ok(None) => return Outcome::Rejected,
            Err(e) => return io_outcome(&e),
        };
        if current <= ns {
            return Outcome::Unchanged;
        }
        let change = SliceChange {
            original_ns: (Some(current) != base).then_some(current),
            set_ns: ns,
        };
        if !self.health.may_try() {
            return Outcome::Rejected;
        }
        if let Err(e) = self.journal.update_slice(tid, Some(change)) {
            self.health.failed(&e);
            return Outcome::Rejected;
        }
        match os_layer::sched::set_fair_slice(tid, ns) {
            Ok(()) => {
                m.slice = Some(change);
                info!(
                    tid,
                    slice_us = ns / 1_000,
                    was_us = current / 1_000,
                    journal = %self.journal.path().display(),
                    "kept with its completions: a short scheduler slice, so that it runs first \
                     when it wakes beside a CPU-bound task; its own is journaled"
                );
                Outcome::SliceShortened
            }
            Err(e) => {
                if let Err(e) = self.journal.update_slice(tid, None) {
                    self.health.failed(&e);
                }
                io_outcome(&e)
            }
        }
    }

    /// Gives a managed task its own slice back (unless someone else changed it after us).
    pub fn restore_slice(&mut self, tid: u32) -> Outcome {
        let Some(change) = self.tasks.get_mut(&tid).and_then(|m| m.slice.take()) else {
            return Outcome::Unchanged;
        };
        let outcome = give_back_slice(tid, change);
        if let Err(e) = self.journal.update_slice(tid, None) {
            // Harmless: recovery gives nothing back unless the slice is still ours.
            self.health.failed(&e);
        }
        outcome
    }

    fn base_slice(&mut self) -> Option<u64> {
        *self.base_slice.get_or_insert_with(|| {
            os_layer::sched::base_slice_ns().unwrap_or_else(|e| {
                warn!("reading the kernel's base slice: {e}; slices are given back as read");
                None
            })
        })
    }

    /// Journal writes that failed since the start (a full or read-only state directory).
    pub fn journal_errors(&self) -> u64 {
        self.health.errors
    }

    fn journal_remove(&mut self, tid: u32) {
        if let Err(e) = self.journal.remove(tid) {
            // The stale entry is harmless: recovery re-checks identity and mask.
            self.health.failed(&e);
        }
    }

    /// Sets back the threads that inherited a pin of ours: Linux gives a child its parent's
    /// mask, so a task we pinned passes the pin on to every thread and process it starts,
    /// and nothing would ever give it back (a server started by a task we kept would stay
    /// on one vCPU for good). A child is set to its parent's own mask when it still has
    /// the mask it was born with (CPUs 0-63: `ForkSample::mask`) and its parent is managed
    /// or was lately; a child that changed its mask since is left alone, and one we took
    /// over already gets its parent's mask as the one to restore (`adopt_own_mask`).
    /// Grandchildren follow their parent. Returns how many were set back.
    pub fn undo_inherited(&mut self, forks: &[ForkSample]) -> usize {
        let now = Instant::now();
        self.origins
            .retain(|_, (_, at)| now.duration_since(*at) < ORIGIN_KEPT);
        let mut pending: Vec<&ForkSample> = forks.iter().collect();
        let mut undone = 0;
        // A grandchild's parent is set back first: as many passes as that takes.
        loop {
            let before = pending.len();
            let mut rest = Vec::new();
            for f in pending {
                let own = self
                    .tasks
                    .get(&f.parent)
                    .filter(|m| !m.external)
                    .map(|m| m.original)
                    .or_else(|| self.origins.get(&f.parent).map(|(o, _)| *o));
                let Some(own) = own else {
                    rest.push(f);
                    continue;
                };
                if self.tasks.contains_key(&f.child) {
                    if self.adopt_own_mask(f, own) {
                        self.origins.insert(f.child, (own, now));
                        undone += 1;
                    }
                    continue;
                }
                let pid = Pid::from_raw(f.child as i32);
                let Ok(current) = sched_getaffinity(pid) else {
                    continue;
                };
                if cpus_of(&current) != f.born_cpus() || current == own {
                    continue;
                }
                match sched_setaffinity(pid, &own) {
                    Ok(()) => {
                        debug!(
                            tid = f.child,
                            parent = f.parent,
                            "started by a pinned task: its inherited pin set back"
                        );
                        self.origins.insert(f.child, (own, now));
                        undone += 1;
                    }
                    Err(e) => debug!(tid = f.child, "setting back an inherited pin: {e}"),
                }
            }
            // Forks of tasks we never pinned stay in `rest` until a pass changes nothing.
            if rest.len() == before {
                break;
            }
            pending = rest;
        }
        undone
    }

    /// A child we took over before its fork was reported: we journaled the pin it
    /// inherited as its own mask, and would restore that pin. Its own is its parent's:
    /// that becomes what we restore (journal first) and what we may place it on; where we
    /// never moved it, its mask too. Returns whether it was corrected.
    fn adopt_own_mask(&mut self, f: &ForkSample, own: CpuSet) -> bool {
        let Some(m) = self.tasks.get(&f.child) else {
            return false;
        };
        if m.external || cpus_of(&m.original) != f.born_cpus() || m.original == own {
            return false;
        }
        let own_list = cpus_of(&own);
        let mut allowed = own_list.clone();
        let tgid = self.journal.get(f.child).map_or(f.child_tgid, |e| e.tgid);
        if let Some(limit) = self.cpuset_cpus(tgid, f.child) {
            allowed.retain(|c| limit.contains(c));
        }
        if allowed.is_empty() {
            return false;
        }
        if let Err(e) = self.journal.update_original(f.child, &own_list, &allowed) {
            self.health.failed(&e);
            return false;
        }
        let Some(m) = self.tasks.get_mut(&f.child) else {
            return false;
        };
        if m.placed.is_none() {
            if let Err(e) = sched_setaffinity(Pid::from_raw(f.child as i32), &own) {
                debug!(tid = f.child, "setting back an inherited pin: {e}");
                return false;
            }
        }
        m.original = own;
        m.allowed = allowed;
        debug!(
            tid = f.child,
            parent = f.parent,
            "taken over with a pin it inherited from a task of ours: its own mask is its parent's"
        );
        true
    }

    /// Hands off every managed task whose mask someone else changed since our last set, and
    /// returns them. Why: the executor otherwise sees an outside change only at the task's
    /// next move or release, and a task the planner keeps where it is may never get one; the
    /// daemon would go on counting it as placed while its owner runs it on its own mask.
    /// One `sched_getaffinity` per managed task.
    pub fn hand_off_changed(&mut self) -> Vec<TaskId> {
        let mut changed = Vec::new();
        for (&tid, m) in self.tasks.iter_mut().filter(|(_, m)| !m.external) {
            let Ok(expected) = m.expected() else {
                continue;
            };
            // ESRCH and the like: the next move or release says it.
            let Ok(current) = sched_getaffinity(Pid::from_raw(tid as i32)) else {
                continue;
            };
            if current != expected {
                m.external = true;
                if let Some(change) = m.slice.take() {
                    give_back_slice(tid, change);
                }
                changed.push(TaskId {
                    tid,
                    start_time: m.start_time,
                });
            }
        }
        for t in &changed {
            self.journal_remove(t.tid);
        }
        changed
    }

    /// Releases every task (on exit); returns how many got their original mask back.
    pub fn release_all(&mut self) -> usize {
        let tids: Vec<u32> = self.tasks.keys().copied().collect();
        tids.into_iter()
            .filter(|&t| matches!(self.release(t), Outcome::Restored { .. }))
            .count()
    }

    /// `Cpus_allowed_list` of `/proc/<tid>/status`.
    fn status_cpus(&self, tgid: u32, tid: u32) -> Option<Vec<usize>> {
        let path = self.root.task(tgid, tid).join("status");
        let text = std::fs::read_to_string(path).ok()?;
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
        parse_cpu_list(line).ok()
    }

    /// The effective CPUs of the task's cpuset (cgroup v1 or v2), when readable.
    fn cpuset_cpus(&self, tgid: u32, tid: u32) -> Option<Vec<usize>> {
        let rel = std::fs::read_to_string(self.root.task(tgid, tid).join("cpuset")).ok()?;
        let rel = rel.trim().trim_start_matches('/');
        let cg = self.root.sys().join("fs/cgroup");
        [
            cg.join("cpuset").join(rel).join("cpuset.effective_cpus"),
            cg.join(rel).join("cpuset.cpus.effective"),
        ]
        .iter()
        .find_map(|p| read_list(p))
    }
}

fn read_list(path: &Path) -> Option<Vec<usize>> {
    let text = std::fs::read_to_string(path).ok()?;
    parse_cpu_list(&text).ok().filter(|l| !l.is_empty())
}

/// Puts back a slice we set, unless someone else changed it since.
fn give_back_slice(tid: u32, change: SliceChange) -> Outcome {
    let start = Instant::now();
    match restore_slice(tid, change) {
        Ok(true) => Outcome::Restored {
            latency_ns: start.elapsed().as_nanos() as u64,
        },
        Ok(false) => Outcome::External,
        Err(e) => {
            if e.raw_os_error() != Some(Errno::ESRCH as i32) {
                warn!(tid, "giving the scheduler slice back failed: {e}");
            }
            io_outcome(&e)
        }
    }
}

fn io_outcome(e: &std::io::Error) -> Outcome {
    match e.raw_os_error() {
        Some(n) if n == Errno::ESRCH as i32 => Outcome::Gone,
        _ => Outcome::Rejected,
    }
}

fn errno_outcome(e: Errno) -> Outcome {
    match e {
        Errno::ESRCH => Outcome::Gone,
        _ => Outcome::Rejected,
    }
}
