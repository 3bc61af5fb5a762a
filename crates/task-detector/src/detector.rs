//! The detector: the BPF counters plus the /proc facts the classifier needs (on-CPU time,
//! kernel-thread flag, comm, start time), read only for threads that did block I/O
//! lately. It never changes a task.

use anyhow::Result;
use os_layer::Root;
use std::collections::HashMap;
use std::path::PathBuf;

use crate::classifier::{ClassifierConfig, IoClassifier, IoTask, ThreadObservation};
use crate::hooks::AttachMode;
use crate::tracker::{CpuIoSample, ForkSample, IoTracker, ThreadIoSample};

/// An I/O-bound thread with what the daemon needs to manage it safely.
#[derive(Clone, Debug, PartialEq)]
pub struct IoTaskInfo {
    pub task: IoTask,
    pub comm: String,
    /// Field 22 of /proc/<tid>/stat: tells a reused tid apart.
    pub start_time: u64,
}

/// A user thread that the I/O-bound thread `of` wakes and is woken by (`partners`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partner {
    pub of: u32,
    pub tid: u32,
    pub tgid: u32,
    pub comm: String,
    pub start_time: u64,
    /// Wake-ups both ways in this sample so far.
    pub wakes: u64,
}

#[derive(Clone, Debug, Default)]
pub struct DetectorOutput {
    pub tasks: Vec<IoTaskInfo>,
    pub cpus: Vec<CpuIoSample>,
    /// The partners of `tasks`.
    pub partners: Vec<Partner>,
    /// Threads born with a narrowed mask since the last poll (inherited pins among them).
    pub forks: Vec<ForkSample>,
}

#[derive(Clone, Debug)]
struct Identity {
    comm: String,
    start_time: u64,
    is_kernel: bool,
}

/// Reads the per-thread facts the classifier needs from /proc (a fake tree in tests).
/// Read-only.
#[derive(Clone, Debug)]
pub struct ProcReader {
    root: Root,
}

impl ProcReader {
    pub fn new(root: Root) -> Self {
        ProcReader { root }
    }

    fn task_dir(&self, tgid: u32, tid: u32) -> PathBuf {
        self.root.task(tgid, tid)
    }

    /// comm, start time and the kernel-thread flag from <root>/<tgid>/task/<tid>/stat.
    fn identity(&self, tgid: u32, tid: u32) -> Option<Identity> {
        let stat = os_layer::TaskStat::read(&self.task_dir(tgid, tid).join("stat"))?;
        Some(Identity {
            is_kernel: stat.is_kernel_thread(),
            comm: stat.comm,
            start_time: stat.start_time,
        })
    }

    /// Cumulative on-CPU ns, field 1 of <root>/<tgid>/task/<tid>/schedstat.
    pub fn cpu_ns(&self, tgid: u32, tid: u32) -> Option<u64> {
        os_layer::SchedStat::read(&self.task_dir(tgid, tid).join("schedstat")).map(|s| s.run_ns)
    }
}

pub struct Detector<'obj> {
    tracker: IoTracker<'obj>,
    classifier: IoClassifier,
    proc: ProcReader,
    identities: HashMap<u32, Identity>,
    /// Per untracked thread: its request count and the time it was taken, kept until
    /// the thread has enough new requests to be classified or the classifier's longest
    /// window passed, so a thread with a request every few ms is seen too.
    last_ios: HashMap<u32, (u64, u64)>,
    last_completions: u64,
    /// Sampled tracking: the classifier lives on the clock of tracked time only, so the
    /// pauses in between are neither "no I/O" nor "on CPU". Time and each thread's CPU
    /// time spent while paused are taken off what it is fed.
    paused_at: Option<u64>,
    untracked_ns: u64,
    /// Per thread: on-CPU ns at the pause (while paused), and on-CPU ns spent paused.
    cpu_at_pause: HashMap<u32, u64>,
    untracked_cpu: HashMap<u32, u64>,
    /// Wake-ups per (waker, wakee) in the current sample, and each thread's tgid.
    wakes: HashMap<(u32, u32), u64>,
    tgids: HashMap<u32, u32>,
    /// When each thread was last found I/O-bound (real clock): its partners are still
    /// looked for a while after (`RECENT_IO_NS`).
    recent_io: HashMap<u32, u64>,
}

/// How long a thread found I/O-bound still has its partners looked for: a backend whose
/// client waits on another vCPU spends its time waiting for the client, reads as no
/// longer I/O-bound, and only the partner beside it brings its rate (and itself) back. The
/// daemon keeps such a task a few seconds more (`KEEP_GRACE`), and finds its partner then.
const RECENT_IO_NS: u64 = 10_000_000_000;

/// What the engine asks of the block programs (`migrater::engine`): a test gives it a fake.
pub trait BlockTracking {
    /// Whether the programs track requests now.
    fn tracking(&self) -> bool;
    /// Whether they sit on their tracepoints (tracking or paused).
    fn attached(&self) -> bool;
    /// Stops tracking until `resume`; the programs stay on their tracepoints.
    fn pause(&mut self) -> Result<()>;
    /// Tracks again after `pause` or `detach`.
    fn resume(&mut self) -> Result<()>;
    /// `pause`, and the programs off their tracepoints until `resume`.
    fn detach(&mut self) -> Result<()>;
    /// The I/O-bound tasks and per-vCPU completions of the window that just ended, told
    /// each vCPU's cumulative time seen taken away (`(cpu, ns)`, the vCPU monitor's): a
    /// thread is not judged CPU-bound on time its vCPU was out.
    fn poll(&mut self, cpu_out_ns: &[(usize, u64)]) -> Result<DetectorOutput>;
    /// Whether a thread is half-way to being found I/O-bound (a sample may run on).
    fn entering(&self) -> bool;
    /// Whether, while paused, a thread quiet for seconds issued block I/O since the last
    /// call (it may have just become I/O-bound: sample now). Reading clears it.
    fn take_doorbell(&mut self) -> bool;
}

impl<'obj> Detector<'obj> {
    pub fn new(tracker: IoTracker<'obj>, cfg: ClassifierConfig) -> Self {
        Detector {
            tracker,
            classifier: IoClassifier::new(cfg),
            proc: ProcReader::new(Root::real()),
            identities: HashMap::new(),
            last_ios: HashMap::new(),
            last_completions: u64::MAX,
            paused_at: None,
            untracked_ns: 0,
            cpu_at_pause: HashMap::new(),
            untracked_cpu: HashMap::new(),
            wakes: HashMap::new(),
            tgids: HashMap::new(),
            recent_io: HashMap::new(),
        }
    }

    pub fn mode(&self) -> AttachMode {
        self.tracker.mode()
    }

    fn identity(&mut self, tgid: u32, tid: u32) -> Option<Identity> {
        if let Some(id) = self.identities.get(&tid) {
            return Some(id.clone());
        }
        let id = self.proc.identity(tgid, tid)?;
        self.identities.insert(tid, id.clone());
        Some(id)
    }

    /// The partners of `tasks`, and of the threads found I/O-bound lately, in this sample,
    /// with their /proc identity (exited and kernel threads left out).
    fn partners_of(&mut self, tasks: &[IoTaskInfo]) -> Vec<Partner> {
        if self.wakes.is_empty() || (tasks.is_empty() && self.recent_io.is_empty()) {
            return Vec::new();
        }
        let now = vcpu_clock();
        for t in tasks {
            self.recent_io.insert(t.task.tid, now);
        }
        self.recent_io
            .retain(|_, at| now.saturating_sub(*at) < RECENT_IO_NS);
        let io: Vec<u32> = self.recent_io.keys().copied().collect();
        crate::partners::partners(&io, &self.wakes)
            .into_iter()
            .filter_map(|(of, tid, wakes)| {
                let tgid = *self.tgids.get(&tid)?;
                // Read afresh, not from the I/O threads' cache: a partner's tid is
                // never forgotten there, and a reused tid must not inherit its identity.
                let id = self.proc.identity(tgid, tid)?;
                (!id.is_kernel).then_some(Partner {
                    of,
                    tid,
                    tgid,
                    comm: id.comm,
                    start_time: id.start_time,
                    wakes,
                })
            })
            .collect()
    }

    /// Adds the wake-ups since the last poll to this sample's, with each thread's tgid.
    fn count_wakes(&mut self) -> Result<()> {
        for w in self.tracker.take_wakes()? {
            *self.wakes.entry((w.waker, w.wakee)).or_default() += w.wakes;
            self.tgids.insert(w.waker, w.waker_tgid);
            self.tgids.insert(w.wakee, w.wakee_tgid);
        }
        Ok(())
    }

    /// What the classifier is fed of the sampled threads, with their identity; threads
    /// that exited, or stayed idle long untracked, are forgotten here and in the kernel map.
    fn observe_threads(
        &mut self,
        samples: &[ThreadIoSample],
        real_now: u64,
        cpu_out_ns: &[(usize, u64)],
    ) -> Vec<(ThreadObservation, Identity)> {
        let mut obs = Vec::new();
        let mut gone = Vec::new();
        for s in samples {
            if !self.worth_observing(s, real_now) {
                // Idle for long and not tracked: drop it from the kernel map too.
                if real_now.saturating_sub(s.last_ts) > 10_000_000_000 {
                    gone.push(s.tid);
                }
                continue;
            }
            match self.observe(s, cpu_out_ns) {
                Some(o) => obs.push(o),
                None => gone.push(s.tid), // exited
            }
        }
        for tid in gone {
            self.tracker.forget_thread(tid);
            self.identities.remove(&tid);
            self.last_ios.remove(&tid);
            self.untracked_cpu.remove(&tid);
        }
        obs
    }

    /// Whether a sampled thread has fresh I/O or is being classified; notes its request
    /// count when fresh, or when the last one noted is older than the longest window.
    fn worth_observing(&mut self, s: &ThreadIoSample, real_now: u64) -> bool {
        // A thread starts being classified only with enough requests within the
        // classifier's longest window to possibly qualify; a lone background write
        // costs no /proc read.
        let cfg = self.classifier.config();
        let (min_ios, longest) = (cfg.min_ios_per_window, cfg.max_window_ns);
        let prev = self.last_ios.get(&s.tid).copied();
        let new_ios = s.ios.saturating_sub(prev.map_or(s.ios, |(ios, _)| ios));
        let fresh = new_ios >= min_ios || (prev.is_none() && s.in_flight > 0);
        if fresh || prev.is_none_or(|(_, at)| real_now.saturating_sub(at) >= longest) {
            self.last_ios.insert(s.tid, (s.ios, real_now));
        }
        fresh || self.classifier.tracks(s.tid)
    }

    /// One thread's observation from its sample and /proc; `None` once it exited.
    fn observe(
        &mut self,
        s: &ThreadIoSample,
        cpu_out_ns: &[(usize, u64)],
    ) -> Option<(ThreadObservation, Identity)> {
        let (Some(id), Some(cpu_ns)) = (
            self.identity(s.tgid, s.tid),
            self.proc.cpu_ns(s.tgid, s.tid),
        ) else {
            return None;
        };
        let cpu_ns = cpu_ns.saturating_sub(self.untracked_cpu.get(&s.tid).copied().unwrap_or(0));
        let o = ThreadObservation {
            tid: s.tid,
            tgid: s.tgid,
            busy_ns: s.busy_ns,
            ios: s.ios,
            bytes: s.bytes,
            cpu_ns,
            cpu_out_ns: cpu_out_ns
                .iter()
                .find(|c| c.0 == s.last_cpu as usize)
                .map_or(0, |c| c.1),
            is_kernel: id.is_kernel,
            last_cpu: s.last_cpu,
            completions: s.completions,
        };
        Some((o, id))
    }

    /// Feeds the classifier this window's observations; the I/O-bound tasks, named.
    fn classify(&mut self, now: u64, obs: &[(ThreadObservation, Identity)]) -> Vec<IoTaskInfo> {
        let plain: Vec<ThreadObservation> = obs.iter().map(|(o, _)| o.clone()).collect();
        let tasks = self.classifier.observe(now, &plain);
        tasks
            .into_iter()
            .filter_map(|task| {
                let id = obs.iter().find(|(o, _)| o.tid == task.tid)?.1.clone();
                Some(IoTaskInfo {
                    task,
                    comm: id.comm,
                    start_time: id.start_time,
                })
            })
            .collect()
    }
}

impl BlockTracking for Detector<'_> {
    /// Whether a thread is half-way to being classified I/O-bound, or two threads have
    /// begun to wake each other in this sample but not yet often enough to be partners
    /// (the sample may run on to decide).
    fn entering(&self) -> bool {
        self.classifier.entering() || crate::partners::pending(&self.wakes)
    }

    /// Whether the BPF programs run on block requests now.
    fn tracking(&self) -> bool {
        self.paused_at.is_none()
    }

    /// Stops tracking block I/O until `resume` (the programs return at once: a request
    /// costs a few instructions). What the classifier knows stays: it is fed again after
    /// the pause as if no time had passed.
    fn pause(&mut self) -> Result<()> {
        if self.paused_at.is_some() {
            return Ok(());
        }
        let now = vcpu_clock();
        self.tracker.pause(now)?;
        self.paused_at = Some(now);
        self.cpu_at_pause.clear();
        for (tid, tgid) in self.classifier.tracked() {
            if let Some(cpu) = self.proc.cpu_ns(tgid, tid) {
                self.cpu_at_pause.insert(tid, cpu);
            }
        }
        Ok(())
    }

    /// Whether a thread quiet for seconds issued block I/O since the last call, while
    /// paused (`IoTracker::take_doorbell`).
    fn take_doorbell(&mut self) -> bool {
        self.tracker.take_doorbell()
    }

    /// Whether the programs are on their tracepoints (see `detach`).
    fn attached(&self) -> bool {
        self.tracker.attached()
    }

    /// `pause`, and the programs off their tracepoints until `resume`: for long pauses,
    /// where even a program that returns at once costs every request something.
    fn detach(&mut self) -> Result<()> {
        self.pause()?;
        self.tracker.detach(vcpu_clock())
    }

    /// Tracks block I/O again after `pause` or `detach`.
    fn resume(&mut self) -> Result<()> {
        let Some(at) = self.paused_at else {
            return Ok(());
        };
        self.tracker.resume()?;
        let now = vcpu_clock();
        self.untracked_ns += now.saturating_sub(at);
        self.paused_at = None;
        // Partners are judged per sample.
        self.wakes.clear();
        self.tgids.clear();
        for (tid, before) in std::mem::take(&mut self.cpu_at_pause) {
            let Some(tgid) = self.classifier.tgid_of(tid) else {
                continue;
            };
            if let Some(cpu) = self.proc.cpu_ns(tgid, tid) {
                *self.untracked_cpu.entry(tid).or_default() += cpu.saturating_sub(before);
            }
        }
        Ok(())
    }

    /// One window: read the maps, add /proc facts for threads with fresh I/O, classify.
    fn poll(&mut self, cpu_out_ns: &[(usize, u64)]) -> Result<DetectorOutput> {
        anyhow::ensure!(self.paused_at.is_none(), "polling a paused detector");
        // Tracked time: the classifier's clock (the same as CLOCK_MONOTONIC until the
        // first pause). The maps are read on the real clock.
        let real_now = vcpu_clock();
        let now = real_now - self.untracked_ns;
        self.count_wakes()?;
        let forks = self.tracker.take_forks()?;
        let cpus = self.tracker.sample_cpus()?;
        // Idle fast path: no completion anywhere since the last poll and nobody being
        // classified means no thread can have become I/O-bound; skip the thread map.
        let completions: u64 = cpus.iter().map(|c| c.completions).sum();
        let quiet = completions == self.last_completions && self.classifier.is_empty();
        self.last_completions = completions;
        if quiet {
            return Ok(DetectorOutput {
                tasks: Vec::new(),
                cpus,
                partners: Vec::new(),
                forks,
            });
        }
        let samples = self.tracker.sample_threads(real_now)?;
        let obs = self.observe_threads(&samples, real_now, cpu_out_ns);
        let tasks = self.classify(now, &obs);
        let partners = self.partners_of(&tasks);
        Ok(DetectorOutput {
            tasks,
            cpus,
            partners,
            forks,
        })
    }
}

/// CLOCK_MONOTONIC ns, the clock of bpf_ktime_get_ns.
fn vcpu_clock() -> u64 {
    let ts =
        nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_proc_tree_gives_identity_cpu_time_and_the_kernel_flag() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::at(dir.path());
        root.write_fake_task(100, 101, "w) worker", 0x40_4040, 4242, 123_456)
            .unwrap();
        root.write_fake_task(2, 2, "kthreadd", 0x20_8040, 4242, 9)
            .unwrap();
        let proc = ProcReader::new(root);
        let id = proc.identity(100, 101).unwrap();
        assert_eq!(id.comm, "w) worker");
        assert_eq!(id.start_time, 4242);
        assert!(!id.is_kernel);
        assert_eq!(proc.cpu_ns(100, 101), Some(123_456));
        assert!(proc.identity(2, 2).unwrap().is_kernel);
        assert!(proc.identity(100, 999).is_none(), "exited thread");
    }
}
