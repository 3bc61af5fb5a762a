//! The kernel's steal governor ("steal-driven vCPU backoff", `cpu_preferred_mask`, tip
//! `sched/core` for Linux 7.4) emulated in user space, as a baseline for the benchmarks:
//! neither this machine's kernel nor a stock guest kernel has it, and the benchmarks must
//! compare with what it would do, not with a guess at its gains.
//!
//! What it does, as its cover letters describe it: every interval (1 s) it samples the
//! guest's aggregate steal, all CPUs' steal over the interval as a share of interval ×
//! CPUs; above `high` (5%) the set of preferred CPUs loses one CPU, below `low` (2%) it gets
//! one back; it never empties and never exceeds the online CPUs. Fair-class tasks on a CPU
//! that left are pushed off, and their wake-ups and load balancing stay inside the set;
//! user affinities are never broken.
//!
//! [`Governor`] is that policy alone, fed samples. [`GovernorRun`] applies it from a thread
//! of its own to the threads of given processes with `sched_setaffinity`, the only lever a
//! user-space emulation has: each managed thread gets (preferred ∩ its own mask), or its own
//! mask where that is empty. Its steal comes from the caller (the benchmarks' host model
//! publishes it), never from /proc/stat.

use nix::errno::Errno;
use nix::sched::{sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;
use os_layer::TaskStat;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The kernel's sampling interval (`interval_ms` = 1000).
pub const INTERVAL: Duration = Duration::from_secs(1);

/// The thresholds, in percent of interval × CPUs: steal above `high_pct` shrinks the set,
/// below `low_pct` grows it, in between (either bound included) leaves it alone.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hysteresis {
    pub high_pct: f64,
    pub low_pct: f64,
}

impl Hysteresis {
    /// The series' defaults.
    pub const KERNEL: Hysteresis = Hysteresis {
        high_pct: 5.0,
        low_pct: 2.0,
    };

    pub fn verdict(&self, steal_pct: f64) -> Verdict {
        if steal_pct > self.high_pct {
            Verdict::Shrink
        } else if steal_pct < self.low_pct {
            Verdict::Grow
        } else {
            Verdict::Hold
        }
    }
}

impl Default for Hysteresis {
    fn default() -> Hysteresis {
        Hysteresis::KERNEL
    }
}

/// What one interval's steal asks of the set (whether the set could follow is
/// [`Step::changed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Shrink,
    Hold,
    Grow,
}

/// One judged interval.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// Aggregate steal over the interval, percent of interval × CPUs.
    pub steal_pct: f64,
    pub verdict: Verdict,
    /// The preferred CPUs from now on, ascending.
    pub preferred: Vec<usize>,
    /// False when the verdict found the set at its bound (one CPU, or all of them).
    pub changed: bool,
}

/// The policy: the preferred set from cumulative per-CPU steal, one CPU per interval.
///
/// The set is always the lowest-numbered CPUs: the highest-numbered CPU still in it leaves
/// first (the series takes CPUs off the top of the mask), the lowest-numbered one outside
/// comes back first. A shrink and a grow therefore undo each other, and the CPU that stays
/// last is the lowest-numbered one.
#[derive(Clone, Debug)]
pub struct Governor {
    hysteresis: Hysteresis,
    cpus: Vec<usize>,
    /// The preferred set is `cpus[..keep]`.
    keep: usize,
    /// Time and cumulative steal (per entry of `cpus`) of the last sample; `None` for a
    /// CPU no sample has reported yet.
    last: Option<(Duration, Vec<Option<u64>>)>,
}

impl Governor {
    /// A governor over `cpus` (the online CPUs; duplicates and order do not matter), all of
    /// them preferred. Panics on an empty set or thresholds that are not finite or where
    /// `low_pct` > `high_pct`: a benchmark configured so measures nothing.
    pub fn new(cpus: &[usize], hysteresis: Hysteresis) -> Governor {
        let mut cpus = cpus.to_vec();
        cpus.sort_unstable();
        cpus.dedup();
        assert!(!cpus.is_empty(), "a steal governor needs at least one CPU");
        let Hysteresis { high_pct, low_pct } = hysteresis;
        assert!(
            high_pct.is_finite() && low_pct.is_finite() && low_pct <= high_pct,
            "hysteresis low {low_pct}% / high {high_pct}%: needs finite bounds, low <= high"
        );
        Governor {
            hysteresis,
            keep: cpus.len(),
            cpus,
            last: None,
        }
    }

    pub fn hysteresis(&self) -> Hysteresis {
        self.hysteresis
    }

    /// All CPUs governed, ascending.
    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }

    /// The preferred CPUs, ascending.
    pub fn preferred(&self) -> &[usize] {
        &self.cpus[..self.keep]
    }

    /// Takes the sample at `t` (any fixed origin) where `steal_ns[c]` is CPU `c`'s
    /// cumulative steal, and judges the interval since the previous one.
    ///
    /// `None` when there is no interval to judge: the first sample (it only sets the
    /// baseline) and one no later than the previous. Entries for CPUs not governed are
    /// ignored; a CPU without an entry counts as not stolen and keeps its baseline; a
    /// counter that went backwards (a reset) counts as not stolen and restarts from there.
    /// The share is of the time that really passed, not of the nominal interval.
    pub fn sample(&mut self, t: Duration, steal_ns: &[u64]) -> Option<Step> {
        let now: Vec<Option<u64>> = self
            .cpus
            .iter()
            .map(|&c| steal_ns.get(c).copied())
            .collect();
        let Some((t0, before)) = self.last.take() else {
            self.last = Some((t, now));
            return None;
        };
        let dt = match t.checked_sub(t0) {
            Some(dt) if !dt.is_zero() => dt,
            _ => {
                self.last = Some((t0, before));
                return None;
            }
        };
        let mut stolen_ns: u64 = 0;
        let next = before
            .iter()
            .zip(&now)
            .map(|(&b, &n)| match (b, n) {
                (Some(b), Some(n)) => {
                    stolen_ns = stolen_ns.saturating_add(n.saturating_sub(b));
                    Some(n)
                }
                (b, None) => b,
                (None, n) => n,
            })
            .collect();
        self.last = Some((t, next));
        let steal_pct = stolen_ns as f64 * 100.0 / (dt.as_nanos() as f64 * self.cpus.len() as f64);
        let verdict = self.hysteresis.verdict(steal_pct);
        let keep = match verdict {
            Verdict::Shrink => self.keep.saturating_sub(1).max(1),
            Verdict::Grow => (self.keep + 1).min(self.cpus.len()),
            Verdict::Hold => self.keep,
        };
        let changed = keep != self.keep;
        self.keep = keep;
        Some(Step {
            steal_pct,
            verdict,
            preferred: self.preferred().to_vec(),
            changed,
        })
    }
}

/// The mask a thread whose own mask is `own` gets while `preferred` are the preferred CPUs:
/// their intersection, or `own` where they do not meet (a user's affinity outranks the
/// governor, as in the kernel).
pub fn target_mask(own: &[usize], preferred: &[usize]) -> Vec<usize> {
    let both: Vec<usize> = own
        .iter()
        .copied()
        .filter(|c| preferred.contains(c))
        .collect();
    if both.is_empty() {
        own.to_vec()
    } else {
        both
    }
}

/// The online CPUs (`/sys/devices/system/cpu/online`), else 0..[`crate::ncpus`].
pub fn online_cpus() -> Vec<usize> {
    os_layer::Root::real()
        .online_cpus()
        .unwrap_or_else(|_| (0..crate::ncpus()).collect())
}

/// How a [`GovernorRun`] governs.
#[derive(Clone, Debug)]
pub struct GovernorConfig {
    /// Between samples; the kernel's is [`INTERVAL`], tests use shorter ones.
    pub interval: Duration,
    pub hysteresis: Hysteresis,
    /// The CPUs governed: the online ones, as the kernel governs. A subset also restricts
    /// every managed thread to it from the first sample on.
    pub cpus: Vec<usize>,
}

impl Default for GovernorConfig {
    fn default() -> GovernorConfig {
        GovernorConfig {
            interval: INTERVAL,
            hysteresis: Hysteresis::KERNEL,
            cpus: online_cpus(),
        }
    }
}

/// One judged interval of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// When the sample was taken, seconds since the run started.
    pub t_s: f64,
    /// Aggregate steal of the interval that ended then, percent of interval × CPUs.
    pub steal_pct: f64,
    /// The preferred CPUs from then on.
    pub preferred: Vec<usize>,
    /// Threads whose mask this interval's pass changed (threads first seen included).
    pub threads_moved: u64,
}

/// What a run did to threads, over the whole run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Steal samples taken, the first (baseline) one included.
    pub samples: u64,
    /// Intervals that took a CPU out of the set, and that gave one back.
    pub shrinks: u64,
    pub grows: u64,
    /// Fair-class threads managed (tid and start time distinct).
    pub threads_managed: u64,
    /// Threads left alone: kernel threads and real-time or deadline ones.
    pub threads_skipped: u64,
    /// Threads first seen with a mask this run had written to another thread of their
    /// process: created by a restricted thread, so their own mask is that thread's own.
    pub threads_born_restricted: u64,
    /// Masks changed by the governor while running (`sched_setaffinity` calls that took).
    pub moves: u64,
    /// Managed threads whose mask somebody else changed: from then on that is their own.
    pub own_mask_changes: u64,
    /// Threads that exited between being listed and being set.
    pub vanished: u64,
    /// `sched_{get,set}affinity` or `sched_getattr` failures other than ESRCH.
    pub errors: u64,
    /// Threads given their own mask back when released (at stop, or when they left the
    /// fair class or the processes governed).
    pub restored: u64,
    /// Threads not given it back because somebody else had changed their mask since.
    pub restore_skipped: u64,
}

/// The result of a run, for the benchmarks' JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GovernorRecord {
    pub interval_ms: u64,
    pub hysteresis: Hysteresis,
    pub cpus: Vec<usize>,
    pub decisions: Vec<Decision>,
    pub counters: Counters,
}

/// The governor at work on a thread of its own, until [`GovernorRun::stop`] or drop.
///
/// Every interval it samples the caller's steal, steps the [`Governor`] and then sets
/// every fair-class thread of the governed processes (re-listed each interval from
/// `/proc/PID/task`) to (preferred ∩ own mask). A thread's own mask is the one it had when
/// first seen, or whatever somebody else set since: a current mask that is not the one
/// last written here is taken as the thread's new own mask and never overwritten back.
/// A thread created by a thread this run restricted inherits the restricted mask; it is
/// recognised by that (the mask was written here to another thread of its process, and
/// no thread of the process has it as its own) and gets its creator's own mask as its own.
///
/// Stopping or dropping gives every thread it restricted its own mask back, unless
/// somebody else changed it since; so does a panic of the steal closure.
///
/// Child processes are not followed: a process forked by a restricted thread starts
/// restricted and is governed only if the pid source lists it ([`GovernorRun::start_with`]).
pub struct GovernorRun {
    shared: Arc<Shared>,
    handle: Option<JoinHandle<GovernorRecord>>,
}

struct Shared {
    stopped: Mutex<bool>,
    wake: Condvar,
    preferred: Mutex<Vec<usize>>,
}

impl Shared {
    /// Sleeps until `deadline` or a stop; true on a stop.
    fn sleep_until(&self, deadline: Instant) -> bool {
        let mut stopped = lock(&self.stopped);
        loop {
            if *stopped {
                return true;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            stopped = self
                .wake
                .wait_timeout(stopped, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A poisoned lock here only means a panic elsewhere; the data (a flag, a CPU list) is whole.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl GovernorRun {
    /// Governs the threads of the processes `pids`. Returns once the first sample is taken
    /// and every thread then present has been seen (their own masks are what they had at
    /// this call). Panics on a configuration [`Governor::new`] refuses or a zero interval.
    pub fn start(
        config: GovernorConfig,
        pids: Vec<u32>,
        steal: impl Fn() -> Vec<u64> + Send + 'static,
    ) -> std::io::Result<GovernorRun> {
        Self::start_with(config, move || pids.clone(), steal)
    }

    /// [`GovernorRun::start`] with the processes asked of `pids` every interval (a
    /// cgroup's `cgroup.procs`, say). Threads of a process no longer listed are released:
    /// given their own mask back and forgotten.
    pub fn start_with(
        config: GovernorConfig,
        pids: impl Fn() -> Vec<u32> + Send + 'static,
        steal: impl Fn() -> Vec<u64> + Send + 'static,
    ) -> std::io::Result<GovernorRun> {
        assert!(
            !config.interval.is_zero(),
            "a steal governor needs an interval"
        );
        let governor = Governor::new(&config.cpus, config.hysteresis);
        let shared = Arc::new(Shared {
            stopped: Mutex::new(false),
            wake: Condvar::new(),
            preferred: Mutex::new(governor.preferred().to_vec()),
        });
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let handle = std::thread::Builder::new()
            .name("steal-governor".into())
            .spawn({
                let shared = shared.clone();
                move || govern(governor, config.interval, &shared, pids, steal, ready_tx)
            })?;
        let run = GovernorRun {
            shared,
            handle: Some(handle),
        };
        if ready_rx.recv().is_err() {
            drop(run);
            return Err(std::io::Error::other(
                "the steal governor's thread panicked before its first sample",
            ));
        }
        Ok(run)
    }

    /// The preferred CPUs now, ascending.
    pub fn preferred(&self) -> Vec<usize> {
        lock(&self.shared.preferred).clone()
    }

    /// Stops within the interval under way (at once unless a pass is running), gives back
    /// every mask it restricted and returns what it did. A panic of the governor's thread
    /// (the steal or pid closure) is resumed here, after the masks are given back.
    pub fn stop(mut self) -> GovernorRecord {
        let handle = self.handle.take().expect("joined only by stop or drop");
        self.signal_stop();
        match handle.join() {
            Ok(record) => record,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    fn signal_stop(&self) {
        *lock(&self.shared.stopped) = true;
        self.shared.wake.notify_all();
    }
}

impl Drop for GovernorRun {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            self.signal_stop();
            let _ = handle.join();
        }
    }
}

/// The governor's thread.
fn govern(
    mut governor: Governor,
    interval: Duration,
    shared: &Shared,
    pids: impl Fn() -> Vec<u32>,
    steal: impl Fn() -> Vec<u64>,
    ready: mpsc::SyncSender<()>,
) -> GovernorRecord {
    // Declared first so that it is dropped last: its drop gives the masks back, also when
    // a closure panics.
    let mut threads = Threads::default();
    let mut ready = Some(ready);
    let mut decisions = Vec::new();
    let start = Instant::now();
    let mut next = start;
    loop {
        let t = start.elapsed();
        let sample = steal();
        threads.counters.samples += 1;
        let step = governor.sample(t, &sample);
        if let Some(s) = step.as_ref().filter(|s| s.changed) {
            match s.verdict {
                Verdict::Shrink => threads.counters.shrinks += 1,
                Verdict::Grow => threads.counters.grows += 1,
                Verdict::Hold => {}
            }
        }
        *lock(&shared.preferred) = governor.preferred().to_vec();
        let moved = threads.pass(&pids(), governor.preferred());
        if let Some(s) = step {
            decisions.push(Decision {
                t_s: t.as_secs_f64(),
                steal_pct: s.steal_pct,
                preferred: s.preferred,
                threads_moved: moved,
            });
        }
        if let Some(r) = ready.take() {
            let _ = r.send(());
        }
        // Fixed rate; a pass that overran skips the ticks it missed rather than bunching
        // samples (the share is of the time that really passed either way).
        let now = Instant::now();
        next += interval;
        while next <= now {
            next += interval;
        }
        if shared.sleep_until(next) {
            break;
        }
    }
    threads.release_all();
    GovernorRecord {
        interval_ms: interval.as_millis() as u64,
        hysteresis: governor.hysteresis(),
        cpus: governor.cpus().to_vec(),
        decisions,
        counters: std::mem::take(&mut threads.counters),
    }
}

/// A fair-class thread under management.
#[derive(Clone, Debug)]
struct Managed {
    /// With the tid, tells the thread from a later one that reuses its tid.
    start_time: u64,
    tgid: u32,
    own: Vec<usize>,
    /// The mask last written here while it differs from `own`.
    written: Option<Vec<usize>>,
}

impl Managed {
    /// The mask the thread has unless somebody else changed it.
    fn expected(&self) -> &[usize] {
        self.written.as_deref().unwrap_or(&self.own)
    }
}

/// The governed threads and what was done to them.
#[derive(Default)]
struct Threads {
    managed: HashMap<u32, Managed>,
    /// Threads left alone, tid → start time: counted once, re-examined every pass (a
    /// thread may join or leave the fair class).
    skipped: HashMap<u32, u64>,
    /// Per process, every mask written here → the own mask of the thread it restricted:
    /// how a thread born of a restricted one is recognised.
    written_masks: HashMap<u32, HashMap<Vec<usize>, Vec<usize>>>,
    counters: Counters,
}

/// Whether `policy` is one the fair class runs (SCHED_IDLE is fair class too); the
/// governor leaves real-time, deadline and sched_ext threads alone.
fn fair_class(policy: u32) -> bool {
    [libc::SCHED_OTHER, libc::SCHED_BATCH, libc::SCHED_IDLE]
        .iter()
        .any(|&p| p as u32 == policy)
}

fn get_mask(tid: u32) -> Result<Vec<usize>, Errno> {
    sched_getaffinity(Pid::from_raw(tid as i32)).map(|s| os_layer::cpus_of(&s))
}

fn set_mask(tid: u32, cpus: &[usize]) -> Result<(), Errno> {
    let set = os_layer::to_cpuset(cpus).ok_or(Errno::EINVAL)?;
    sched_setaffinity(Pid::from_raw(tid as i32), &set)
}

/// The threads of processes `pids`, ascending and distinct; a process gone lists none.
fn list_threads(pids: &[u32]) -> Vec<u32> {
    let mut tids: Vec<u32> = pids
        .iter()
        .flat_map(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
        })
        .collect();
    tids.sort_unstable();
    tids.dedup();
    tids
}

/// (Tgid, PPid) of a thread, from `/proc/TID/status`.
fn ids(tid: u32) -> Option<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
    };
    Some((field("Tgid:")?, field("PPid:")?))
}

impl Threads {
    /// Brings every thread of `pids` to (preferred ∩ own); releases the threads no longer
    /// listed. Returns how many masks it changed.
    fn pass(&mut self, pids: &[u32], preferred: &[usize]) -> u64 {
        let tids = list_threads(pids);
        let listed: HashSet<u32> = tids.iter().copied().collect();
        let unlisted: Vec<u32> = self
            .managed
            .keys()
            .copied()
            .filter(|t| !listed.contains(t))
            .collect();
        for tid in unlisted {
            if let Some(m) = self.managed.remove(&tid) {
                self.release(tid, m);
            }
        }
        self.skipped.retain(|t, _| listed.contains(t));
        let moved = tids
            .into_iter()
            .filter(|&tid| self.visit(tid, preferred))
            .count() as u64;
        let live: HashSet<u32> = self.managed.values().map(|m| m.tgid).collect();
        self.written_masks.retain(|g, _| live.contains(g));
        moved
    }

    /// Brings one thread to (preferred ∩ own); true when its mask was changed.
    fn visit(&mut self, tid: u32, preferred: &[usize]) -> bool {
        let Some(stat) = TaskStat::of_tid(tid) else {
            self.vanished(tid);
            return false;
        };
        if self
            .managed
            .get(&tid)
            .is_some_and(|m| m.start_time != stat.start_time)
        {
            // The tid's old thread is gone: nothing of it to give back.
            self.managed.remove(&tid);
        }
        let fair = !stat.is_kernel_thread()
            && match os_layer::sched::get_attr(tid) {
                Ok(a) => fair_class(a.sched_policy),
                Err(e) => {
                    self.failed(tid, e.raw_os_error());
                    return false;
                }
            };
        if !fair {
            if let Some(m) = self.managed.remove(&tid) {
                self.release(tid, m);
            }
            if self.skipped.insert(tid, stat.start_time) != Some(stat.start_time) {
                self.counters.threads_skipped += 1;
            }
            return false;
        }
        self.skipped.remove(&tid);
        let cur = match get_mask(tid) {
            Ok(cur) => cur,
            Err(e) => {
                self.failed(tid, Some(e as i32));
                return false;
            }
        };
        if !self.managed.contains_key(&tid) {
            let Some((tgid, ppid)) = ids(tid) else {
                self.vanished(tid);
                return false;
            };
            let (own, written) = self.origin(tgid, ppid, &cur);
            self.counters.threads_managed += 1;
            self.counters.threads_born_restricted += u64::from(written.is_some());
            self.managed.insert(
                tid,
                Managed {
                    start_time: stat.start_time,
                    tgid,
                    own,
                    written,
                },
            );
        }
        let m = self.managed.get_mut(&tid).expect("inserted above");
        if cur != m.expected() {
            m.own = cur.clone();
            m.written = None;
            self.counters.own_mask_changes += 1;
        }
        let target = target_mask(&m.own, preferred);
        if target == cur {
            return false;
        }
        match set_mask(tid, &target) {
            Ok(()) => {
                self.counters.moves += 1;
                if target == m.own {
                    m.written = None;
                } else {
                    self.written_masks
                        .entry(m.tgid)
                        .or_default()
                        .insert(target.clone(), m.own.clone());
                    m.written = Some(target);
                }
                true
            }
            Err(e) => {
                self.failed(tid, Some(e as i32));
                false
            }
        }
    }

    /// Own mask and mask written of a thread first seen with mask `cur`. A thread is born
    /// with its creator's mask; when that is a mask written here to a thread of its process
    /// (of its parent process, for a process's first thread seen), the creator was
    /// restricted and the thread's own mask is the creator's. When a thread of the process
    /// has `cur` as its own mask, the creator may as well have been that one: the mask is
    /// taken as the thread's own, which never breaks an affinity somebody chose.
    fn origin(&self, tgid: u32, ppid: u32, cur: &[usize]) -> (Vec<usize>, Option<Vec<usize>>) {
        let kin = |g: u32| self.managed.values().filter(move |m| m.tgid == g);
        let group = if kin(tgid).next().is_some() || self.written_masks.contains_key(&tgid) {
            tgid
        } else {
            ppid
        };
        if kin(group).any(|m| m.own == cur) {
            return (cur.to_vec(), None);
        }
        match self.written_masks.get(&group).and_then(|w| w.get(cur)) {
            Some(own) => (own.clone(), Some(cur.to_vec())),
            None => (cur.to_vec(), None),
        }
    }

    /// A listed thread that is gone (ESRCH or its /proc entry missing): forgotten.
    fn vanished(&mut self, tid: u32) {
        self.managed.remove(&tid);
        self.counters.vanished += 1;
    }

    fn failed(&mut self, tid: u32, errno: Option<i32>) {
        if errno == Some(libc::ESRCH) {
            self.vanished(tid);
        } else {
            self.counters.errors += 1;
        }
    }

    /// Gives a thread no longer governed its own mask back if it still has the one
    /// written here. Between the check and the write somebody else may set it: that
    /// window is the same as for any two tools setting one thread's affinity.
    fn release(&mut self, tid: u32, m: Managed) {
        let Some(written) = m.written else {
            return;
        };
        if TaskStat::of_tid(tid).map(|s| s.start_time) != Some(m.start_time) {
            return;
        }
        match get_mask(tid) {
            Ok(cur) if cur == written => match set_mask(tid, &m.own) {
                Ok(()) => self.counters.restored += 1,
                Err(Errno::ESRCH) => {}
                Err(_) => self.counters.errors += 1,
            },
            Ok(_) => self.counters.restore_skipped += 1,
            Err(Errno::ESRCH) => {}
            Err(_) => self.counters.errors += 1,
        }
    }

    fn release_all(&mut self) {
        for (tid, m) in std::mem::take(&mut self.managed) {
            self.release(tid, m);
        }
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        self.release_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    /// Feeds `g` one sample per second, every CPU stolen `pct[i]` percent in second i,
    /// after a baseline at t = 0; returns the preferred set after each second.
    fn feed(g: &mut Governor, pct: &[f64]) -> Vec<Vec<usize>> {
        let n = g.cpus().iter().max().map_or(0, |&c| c + 1);
        let mut cum = vec![0u64; n];
        assert_eq!(g.sample(Duration::ZERO, &cum), None);
        pct.iter()
            .enumerate()
            .map(|(i, &p)| {
                for c in &mut cum {
                    *c += (p * 1e7) as u64;
                }
                let step = g.sample(S * (i as u32 + 1), &cum).expect("an interval");
                assert_eq!(step.preferred, g.preferred());
                step.preferred
            })
            .collect()
    }

    fn four() -> Governor {
        Governor::new(&[0, 1, 2, 3], Hysteresis::KERNEL)
    }

    #[test]
    fn shrinks_above_high_holds_between_grows_below_low() {
        let mut g = four();
        assert_eq!(
            feed(&mut g, &[6.0, 3.0, 1.0]),
            vec![vec![0, 1, 2], vec![0, 1, 2], vec![0, 1, 2, 3]]
        );
    }

    #[test]
    fn the_bounds_themselves_hold() {
        let mut g = four();
        assert_eq!(feed(&mut g, &[5.0, 2.0]), vec![vec![0, 1, 2, 3]; 2]);
        let v = |p| Hysteresis::KERNEL.verdict(p);
        assert_eq!(
            [v(5.01), v(5.0), v(2.0), v(1.99)],
            [Verdict::Shrink, Verdict::Hold, Verdict::Hold, Verdict::Grow]
        );
    }

    #[test]
    fn one_cpu_per_interval_and_never_below_one() {
        let mut g = four();
        assert_eq!(
            feed(&mut g, &[60.0, 60.0, 60.0, 60.0, 60.0, 0.0, 0.0, 0.0, 0.0]),
            vec![
                vec![0, 1, 2],
                vec![0, 1],
                vec![0],
                vec![0],
                vec![0],
                vec![0, 1],
                vec![0, 1, 2],
                vec![0, 1, 2, 3],
                vec![0, 1, 2, 3],
            ]
        );
    }

    #[test]
    fn a_step_at_a_bound_says_so() {
        let mut g = Governor::new(&[0, 1], Hysteresis::KERNEL);
        g.sample(Duration::ZERO, &[0, 0]);
        let s = g.sample(S, &[0, 0]).unwrap();
        assert_eq!((s.verdict, s.changed), (Verdict::Grow, false));
        let s = g.sample(2 * S, &[100_000_000, 100_000_000]).unwrap();
        assert_eq!((s.verdict, s.changed), (Verdict::Shrink, true));
        assert!((s.steal_pct - 10.0).abs() < 1e-9, "{}", s.steal_pct);
    }

    #[test]
    fn the_first_sample_only_sets_the_baseline() {
        let mut g = four();
        // Hours of steal before the governor started count for nothing.
        assert_eq!(g.sample(S, &[u64::MAX / 8; 4]), None);
        assert_eq!(g.preferred(), &[0, 1, 2, 3]);
        let s = g.sample(2 * S, &[u64::MAX / 8; 4]).unwrap();
        assert_eq!((s.steal_pct, s.verdict), (0.0, Verdict::Grow));
    }

    #[test]
    fn a_single_cpu_stays() {
        let mut g = Governor::new(&[0], Hysteresis::KERNEL);
        assert_eq!(feed(&mut g, &[50.0, 0.0, 50.0]), vec![vec![0]; 3]);
    }

    #[test]
    fn steal_is_aggregate_over_all_cpus() {
        // One CPU of four stolen 24% is 6% of the guest: a shrink. 7% on one is 1.75%: a grow.
        let mut g = four();
        g.sample(Duration::ZERO, &[0; 4]);
        let s = g.sample(S, &[0, 0, 0, 240_000_000]).unwrap();
        assert!((s.steal_pct - 6.0).abs() < 1e-9, "{}", s.steal_pct);
        assert_eq!(s.preferred, vec![0, 1, 2]);
        let s = g.sample(2 * S, &[70_000_000, 0, 0, 240_000_000]).unwrap();
        assert!((s.steal_pct - 1.75).abs() < 1e-9, "{}", s.steal_pct);
        assert_eq!(s.preferred, vec![0, 1, 2, 3]);
    }

    #[test]
    fn the_share_is_of_the_time_that_passed() {
        // 120 ms stolen per CPU over 2 s is 6%, over 1 s it would be 12%; either shrinks,
        // but 60 ms over 2 s (3%) holds where over 1 s (6%) it would shrink.
        let mut g = four();
        g.sample(Duration::ZERO, &[0; 4]);
        let s = g.sample(2 * S, &[60_000_000; 4]).unwrap();
        assert!((s.steal_pct - 3.0).abs() < 1e-9, "{}", s.steal_pct);
        assert_eq!(s.verdict, Verdict::Hold);
        // No time passed: nothing to judge, the baseline stays.
        assert_eq!(g.sample(2 * S, &[u64::MAX; 4]), None);
        assert_eq!(g.sample(S, &[u64::MAX; 4]), None);
        let s = g.sample(3 * S, &[70_000_000; 4]).unwrap();
        assert!((s.steal_pct - 1.0).abs() < 1e-9, "{}", s.steal_pct);
    }

    #[test]
    fn highest_numbered_leaves_first_and_lowest_returns_first() {
        let mut g = Governor::new(&[5, 0, 2, 2], Hysteresis::KERNEL);
        assert_eq!(g.cpus(), &[0, 2, 5]);
        assert_eq!(
            feed(&mut g, &[10.0, 10.0, 0.0, 0.0]),
            vec![vec![0, 2], vec![0], vec![0, 2], vec![0, 2, 5]]
        );
    }

    #[test]
    fn missing_entries_and_reset_counters_count_as_not_stolen() {
        let mut g = Governor::new(&[0, 1], Hysteresis::KERNEL);
        g.sample(Duration::ZERO, &[1_000_000_000, 0]);
        // CPU 1 unreported, CPU 0 reset: no steal at all.
        let s = g.sample(S, &[5]).unwrap();
        assert_eq!(s.steal_pct, 0.0);
        // CPU 1 reported again: measured from its last report, CPU 0 from its reset.
        let s = g.sample(2 * S, &[200_000_005, 0, 99]).unwrap();
        assert!((s.steal_pct - 10.0).abs() < 1e-9, "{}", s.steal_pct);
    }

    #[test]
    #[should_panic(expected = "at least one CPU")]
    fn no_cpus_is_refused() {
        Governor::new(&[], Hysteresis::KERNEL);
    }

    #[test]
    #[should_panic(expected = "low <= high")]
    fn inverted_thresholds_are_refused() {
        Governor::new(
            &[0],
            Hysteresis {
                high_pct: 2.0,
                low_pct: 5.0,
            },
        );
    }

    #[test]
    fn own_mask_outranks_the_preferred_set() {
        assert_eq!(target_mask(&[0, 1, 2, 3], &[0, 1]), vec![0, 1]);
        assert_eq!(target_mask(&[1, 3], &[0, 1]), vec![1]);
        assert_eq!(target_mask(&[3], &[0, 1]), vec![3]);
    }

    #[test]
    fn decisions_serialize_as_the_benchmarks_write_them() {
        let d = Decision {
            t_s: 1.5,
            steal_pct: 6.25,
            preferred: vec![0, 1],
            threads_moved: 3,
        };
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"t_s": 1.5, "steal_pct": 6.25, "preferred": [0, 1], "threads_moved": 3})
        );
        assert_eq!(serde_json::from_value::<Decision>(v).unwrap(), d);
    }

    /// A thread of this process blocked until dropped.
    struct Parked {
        tid: u32,
        stop: Option<mpsc::Sender<()>>,
        handle: Option<JoinHandle<()>>,
    }

    impl Parked {
        fn spawn() -> Parked {
            let (tid_tx, tid_rx) = mpsc::channel();
            let (stop, stop_rx) = mpsc::channel::<()>();
            let handle = std::thread::spawn(move || {
                tid_tx.send(crate::gettid()).unwrap();
                let _ = stop_rx.recv();
            });
            Parked {
                tid: tid_rx.recv().unwrap(),
                stop: Some(stop),
                handle: Some(handle),
            }
        }
    }

    impl Drop for Parked {
        fn drop(&mut self) {
            self.stop.take();
            if let Some(h) = self.handle.take() {
                let _ = h.join();
            }
        }
    }

    /// Waits until the kernel has reaped `tid`, so that asking about it is ESRCH.
    fn reaped(tid: u32) {
        let t0 = Instant::now();
        while std::path::Path::new(&format!("/proc/self/task/{tid}")).exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "tid {tid} not reaped"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    // Our own threads' masks need no privilege.
    #[test]
    #[cfg_attr(not(vmigrater_2cpus), ignore = "needs 2 CPUs")]
    fn own_masks_are_kept_adopted_and_given_back() {
        let a = Parked::spawn();
        let before = get_mask(a.tid).unwrap();
        assert!(
            before.len() >= 2,
            "needs 2 CPUs in the test's mask: {before:?}"
        );
        let (low, top) = (before[0], *before.last().unwrap());
        let mut th = Threads::default();

        assert!(th.visit(a.tid, &[low]));
        assert_eq!(get_mask(a.tid).unwrap(), vec![low]);
        assert!(!th.visit(a.tid, &[low]), "already there");

        // Somebody widens it: that is its own mask now, restricted again.
        set_mask(a.tid, &before).unwrap();
        assert!(th.visit(a.tid, &[low]));
        assert_eq!(th.counters.own_mask_changes, 1);
        assert_eq!(get_mask(a.tid).unwrap(), vec![low]);

        // Somebody pins it outside the set: kept, and not given "back" at the end.
        set_mask(a.tid, &[top]).unwrap();
        assert!(!th.visit(a.tid, &[low]));
        assert_eq!(get_mask(a.tid).unwrap(), vec![top]);
        // Growing back leaves it where it was pinned too.
        assert!(!th.visit(a.tid, &before));
        th.release_all();
        assert_eq!(get_mask(a.tid).unwrap(), vec![top]);

        // Restricted, then released: its own mask again.
        let b = Parked::spawn();
        assert!(th.visit(b.tid, &[low]));
        th.release_all();
        assert_eq!(get_mask(b.tid).unwrap(), before);
        assert_eq!(th.counters.restored, 1);
        assert_eq!(th.counters.errors, 0);
    }

    #[test]
    #[cfg_attr(not(vmigrater_2cpus), ignore = "needs 2 CPUs")]
    fn a_thread_born_restricted_gets_its_creators_own_mask_back() {
        let mut th = Threads::default();
        let (go, go_rx) = mpsc::channel::<()>();
        let (tid_tx, tid_rx) = mpsc::channel();
        let creator = std::thread::spawn(move || {
            tid_tx.send(crate::gettid()).unwrap();
            go_rx.recv().unwrap();
            Parked::spawn()
        });
        let creator_tid = tid_rx.recv().unwrap();
        let before = get_mask(creator_tid).unwrap();
        assert!(
            before.len() >= 2,
            "needs 2 CPUs in the test's mask: {before:?}"
        );
        assert!(th.visit(creator_tid, &[before[0]]));
        go.send(()).unwrap();
        let child = creator.join().unwrap();
        reaped(creator_tid);
        assert_eq!(get_mask(child.tid).unwrap(), vec![before[0]], "inherited");

        assert!(!th.visit(child.tid, &[before[0]]));
        assert_eq!(th.counters.threads_born_restricted, 1);
        th.release_all();
        assert_eq!(get_mask(child.tid).unwrap(), before);
    }

    #[test]
    fn threads_that_exit_are_tolerated() {
        let gone = Parked::spawn();
        let tid = gone.tid;
        let mask = get_mask(tid).unwrap();
        drop(gone);
        reaped(tid);
        let mut th = Threads::default();
        assert!(!th.visit(tid, &[0]));
        assert_eq!(th.counters.vanished, 1);
        // One restricted, then gone before being given back: nothing to do, no error.
        th.managed.insert(
            tid,
            Managed {
                start_time: 0,
                tgid: std::process::id(),
                own: mask,
                written: Some(vec![0]),
            },
        );
        th.release_all();
        assert_eq!((th.counters.errors, th.counters.restored), (0, 0));
        assert_eq!(get_mask(tid), Err(Errno::ESRCH));
        assert_eq!(set_mask(tid, &[0]), Err(Errno::ESRCH));
    }
}
