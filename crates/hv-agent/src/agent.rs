//! The period loop: every `period_ms`, for every VM, sample each vCPU thread (host
//! schedstat), take the guest's latest report (or, without one, the thread's own
//! wake-ups), run the credit core per host run queue, apply the settings through the
//! backend, move I/O-intensive vCPU threads between the VM's host CPUs (Algorithm 2), tell
//! each guest what was applied, and publish a status snapshot. On stop, the backend
//! restores everything it changed. A VM of the testbed's host model (`model_slot`) has no
//! threads: the backend says how many vCPUs it has and samples them, and its vCPU n is on
//! model CPU n.

use anyhow::Result;
use proto::{Applied, Message, VcpuReport, VcpuWeight};
use sched_core::CreditParams;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

use crate::backend::{self, Backend};
use crate::cgroup::CgroupWeights;
use crate::config::{BackendKind, Config, VmConfig, WeightKind};
use crate::discovery;
use crate::guest::{self, GuestState};
use crate::journal::Journal;
use crate::observe::{self, ThreadSample, WakeupEma};
use crate::placement::{self, Placed};
use crate::status::{AgentStatus, Origin, Source, VcpuStatus, VmStatus};
use crate::weights::{self, Setting, VcpuFigures};

/// At SIGHUP a running agent takes up, at its next period, the keys each period's plan
/// and observation read. The others shape the backend, the journal, the guests' channels
/// and rate limits, the credit period, the sockets or the VM list at start, and need a
/// restart.
impl control::Reloadable for Config {
    const UNIT: &'static str = "vmigrater-hv-agent";
    const APPLIED_WHEN: &'static str = " from the next period";
    const LIVE_KEYS: &'static [&'static str] = &[
        "share",
        "max_nice_delta",
        "io_boost_nice",
        "observe_schedstat",
        "observe_kicks",
    ];
    fn with_live_keys(&self, new: &Self) -> Self {
        let mut next = self.clone();
        next.share = new.share;
        next.max_nice_delta = new.max_nice_delta;
        next.io_boost_nice = new.io_boost_nice;
        next.observe_schedstat = new.observe_schedstat;
        next.observe_kicks = new.observe_kicks;
        next
    }
}

/// How often VMs without known threads are resolved again, and libvirt rescanned.
const RESCAN: Duration = Duration::from_secs(2);
/// Periods a vCPU thread stays where Algorithm 2 put it before it may move again: moves
/// cost the guest cache warmth, and ping-pong would cost more than it gains.
const MOVE_COOLDOWN_PERIODS: u64 = 10;

/// A vCPU runnable this share of its last `RUNNABLE_PERIODS` or more did not halt in
/// them: a CPU-bound vCPU (a guest's hog, a batch job) reads ~1.0, a database client's
/// vCPU between requests less (benches/RESULTS.md "a payer that halts").
const RUNNABLE_SHARE: f64 = 0.95;
/// What `schedstat` may lag behind a thread's real run and wait time: run time is added
/// at ticks (4 ms at HZ=250), wait time when the thread gets the CPU (a slice of the other
/// threads' later), so that a hog read between them is not taken for a halt. Judged over
/// the window, not per period, so that the lag is counted once.
const SCHEDSTAT_LAG: Duration = Duration::from_millis(10);
/// The periods over which a payer must have been runnable.
const RUNNABLE_PERIODS: usize = 4;

#[derive(Default)]
struct Track {
    tid: Option<u32>,
    prev: Option<ThreadSample>,
    ema: WakeupEma,
    run_total: u64,
    wait_total: u64,
    moves: u64,
    /// Period from which the thread may move again.
    movable_from: u64,
    /// One bit per recent period (newest lowest): did it show I/O?
    io_history: u8,
    /// One bit per recent period (newest lowest): did the guest report an I/O-bound task,
    /// or a partner of one, on it?
    task_history: u8,
    /// The last `RUNNABLE_PERIODS` periods: (ns runnable, running or waiting for a CPU;
    /// ns the period covered).
    runnable_window: VecDeque<(u64, u64)>,
    /// When `prev` was read: the period each delta covers.
    sampled_at: Option<Instant>,
    status: VcpuStatus,
}

impl Track {
    /// Adds a period's runnable time to `runnable_window`; a period without a delta to
    /// judge (`covered` None) starts the window afresh.
    fn note_runnable(&mut self, covered: Option<Duration>, runnable_ns: u64) {
        match covered {
            Some(c) => {
                if self.runnable_window.len() == RUNNABLE_PERIODS {
                    self.runnable_window.pop_front();
                }
                self.runnable_window
                    .push_back((runnable_ns, c.as_nanos() as u64));
            }
            None => self.runnable_window.clear(),
        }
    }
}

struct Vm {
    cfg: VmConfig,
    origin: Origin,
    tids: Vec<u32>,
    resolved_at: Option<Instant>,
    guest: Arc<GuestState>,
    stop: Arc<control::Stop>,
    thread: Option<JoinHandle<()>>,
    tracks: Vec<Track>,
    /// The guest-announced vCPUs were credited once without their guest: their neutral
    /// settings reached the backend before they went.
    neutralised: bool,
}

impl Vm {
    fn new(cfg: VmConfig, origin: Origin, min_interval: Duration) -> Result<Vm> {
        let guest = Arc::new(GuestState::default());
        let stop = Arc::new(control::Stop::default());
        let thread = match cfg.hint_socket.clone() {
            Some(sock) => {
                let (name, state, stop) = (cfg.name.clone(), guest.clone(), stop.clone());
                Some(
                    std::thread::Builder::new()
                        .name(format!("guest-{name}"))
                        .spawn(move || guest::run(name, sock, min_interval, state, stop))?,
                )
            }
            None => None,
        };
        Ok(Vm {
            cfg,
            origin,
            tids: Vec::new(),
            resolved_at: None,
            guest,
            stop,
            thread,
            tracks: Vec::new(),
            neutralised: false,
        })
    }

    /// Tells the guest thread to stop and wakes it: from a back-off nap, and from a read
    /// (the socket is shut down), so stopping takes no period or timeout.
    fn signal_stop(&self) {
        self.stop.set();
        if let Some(w) = self
            .guest
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }

    fn shut(&mut self) {
        self.signal_stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Sizes `tracks` to the vCPUs the VM has this period.
    fn fit_tracks(&mut self, backend: &dyn Backend, unmapped_cap: usize) {
        // A VM has the vCPUs the host knows of: its vCPU threads (a guest cannot invent
        // more, nor the series and state that would come with them); see `vcpu_count`.
        // A modelled VM has the entities the model runs for it, whatever its guest says.
        let mut n = if self.cfg.model_slot.is_some() {
            backend.vcpus(&self.cfg).unwrap_or(0)
        } else {
            vcpu_count(
                self.tids.len(),
                self.guest.vcpus.load(Ordering::Relaxed),
                unmapped_cap,
            )
        };
        // When a guest that alone said how many vCPUs its VM has leaves, they stay for
        // one period without reports, so the credit core turns them neutral and that
        // reaches the backend (Xen weighs the whole domain, and a domain left with no
        // vCPU would keep the weight its guest earned); then they go, series and all.
        if n == 0 && !self.tracks.is_empty() && !self.neutralised {
            self.neutralised = true;
            n = self.tracks.len();
        } else if n > 0 {
            self.neutralised = false;
        }
        self.tracks.truncate(n);
        self.tracks.resize_with(n, Track::default);
    }

    /// Samples every vCPU's thread (a modelled VM's: the backend's entity), in vCPU order.
    fn sample_tracks(&mut self, backend: &dyn Backend) -> Vec<Sampled> {
        let modelled = self.cfg.model_slot.is_some();
        let mut deltas = Vec::with_capacity(self.tracks.len());
        for (cpu, track) in self.tracks.iter_mut().enumerate() {
            track.tid = self.tids.get(cpu).copied();
            let sample = if modelled {
                backend.sample(&self.cfg, cpu as u32)
            } else {
                track.tid.and_then(observe::sample)
            };
            let d = match (&track.prev, &sample) {
                (Some(p), Some(s)) => s.since(p),
                _ => observe::Delta::default(),
            };
            let first = track.prev.is_none();
            let at = Instant::now();
            let covered = track.sampled_at.replace(at).map(|p| at - p);
            track.prev = sample;
            deltas.push((d, first, covered));
        }
        deltas
    }

    /// Settles, across the VM's vCPUs (`figures`, in vCPU order), who is free of its I/O
    /// and who carries it (`io_free`, `favour_dominant`).
    fn mark_carriers(&mut self, figures: &mut [VcpuFigures]) {
        let mut carries: Vec<bool> = figures.iter().map(|f| f.carries_io).collect();
        let events: Vec<u64> = figures.iter().map(|f| f.events).collect();
        for (f, free) in figures.iter_mut().zip(io_free(&events)) {
            f.io_free &= free;
            self.tracks[f.key.1 as usize].status.io_free = f.io_free;
        }
        if favour_dominant(&mut carries, &events) {
            for (f, c) in figures.iter_mut().zip(carries) {
                f.carries_io = c;
                self.tracks[f.key.1 as usize].status.carries_io = c;
            }
        }
    }
}

/// One vCPU's sample: its delta since the last one, whether this was its first sample,
/// and the time the delta covers.
type Sampled = (observe::Delta, bool, Option<Duration>);

/// What one VM's period gives every one of its vCPUs.
struct VmPeriod<'a> {
    /// The VM's place in `Agent::vms`.
    index: usize,
    modelled: bool,
    reports: &'a BTreeMap<u32, VcpuReport>,
    /// Kicks single out vCPUs this period.
    by_kicks: bool,
    observe_schedstat: bool,
    period_ns: u64,
    /// Its guest moves I/O-bound tasks only where the host holds vCPUs.
    follows_host: bool,
}

impl VmPeriod<'_> {
    /// A vCPU's source, I/O events and their interval EMA (ns): the guest's `report`, else
    /// what the host observed where it sees the thread, else nothing.
    fn figures_from(
        &self,
        report: Option<&VcpuReport>,
        seen: bool,
        observed: (u64, f64),
    ) -> (Source, u64, f64) {
        match report {
            Some(r) => (Source::Guest, r.io_completions, r.io_interval_ema_us * 1e3),
            None if seen => {
                let source = if self.by_kicks {
                    Source::Kicks
                } else {
                    Source::Schedstat
                };
                (source, observed.0, observed.1)
            }
            None => (Source::None, 0, 0.0),
        }
    }

    /// vCPU `cpu`'s figures for this period, with its track and status brought up to date.
    fn vcpu_figures(
        &self,
        cpu: usize,
        track: &mut Track,
        sampled: Sampled,
        host_events: u64,
    ) -> VcpuFigures {
        let (d, first, covered) = sampled;
        let (run, wait) = (d.run_ns, d.wait_ns);
        track.note_runnable(covered.filter(|_| !first), run + wait);
        track.run_total += run;
        track.wait_total += wait;
        let observed = track.ema.on_period(host_events, self.period_ns);
        let seen = self.observe_schedstat && !first && (track.tid.is_some() || self.modelled);
        // Kicks that single out vCPUs outrank the guest's report: they are this
        // period's requests as the device saw them, while the guest's figures come
        // from sampled tracking (on them the agent favoured nobody, or a vCPU the
        // reader had already left), and a guest cannot claim them.
        // Where kicks single out no vCPU, the guest's report decides, then wake-ups.
        let report = self
            .reports
            .get(&(cpu as u32))
            .filter(|_| !(self.by_kicks && seen));
        let (source, events, ema_ns) = self.figures_from(report, seen, observed);
        track.io_history = (track.io_history << 1) | u8::from(events > 0);
        let carries_io = carries_io(report.map(|r| r.io_bound_tasks), track.io_history);
        let reported = self.reports.get(&(cpu as u32));
        // A partner of an I/O-bound task (a database's client) is on the I/O's
        // path: its vCPU paying for the favour slowed the I/O (PostgreSQL in the
        // loop, benches/RESULTS.md "the applications in the loop").
        track.task_history = (track.task_history << 1)
            | u8::from(reported.is_some_and(|r| r.io_bound_tasks > 0 || r.io_partner_tasks > 0));
        let no_tasks_lately = match reported {
            Some(_) => track.task_history == 0,
            None => !carries_io,
        };
        // The model runs vCPU n on its CPU n: that is the run queue `fund` exchanges
        // weight on between the VMs sharing it.
        let host_cpu = if self.modelled {
            Some(cpu)
        } else {
            track.tid.and_then(pinned_cpu)
        };
        track.status = VcpuStatus {
            vcpu: cpu as u32,
            tid: track.tid,
            host_cpu,
            source,
            events,
            ema_us: ema_ns / 1e3,
            cpu_ms: run as f64 / 1e6,
            wait_ms: wait as f64 / 1e6,
            run_ns_total: track.run_total,
            wait_ns_total: track.wait_total,
            moves: track.moves,
            weight: 1.0,
            carries_io,
            always_runnable: always_runnable(&track.runnable_window),
            ..Default::default()
        };
        VcpuFigures {
            key: (self.index, cpu as u32),
            run_queue: host_cpu.unwrap_or(usize::MAX),
            events,
            ema_ns,
            consumed_ns: run,
            carries_io,
            io_free: no_tasks_lately,
            always_runnable: track.status.always_runnable,
            follows_host: self.follows_host,
        }
    }
}

/// vCPU threads in vCPU order: configured ids, else QEMU's thread names under its pid
/// file, else QMP.
fn resolve_threads(vm: &VmConfig) -> Result<Vec<u32>> {
    if !vm.vcpu_threads.is_empty() {
        return Ok(vm.vcpu_threads.clone());
    }
    if let Some(pid) = vm.pid {
        return discovery::threads_by_comm(pid);
    }
    if let Some(p) = &vm.pid_file {
        return discovery::threads_by_comm(discovery::read_pid_file(p)?);
    }
    if let Some(q) = &vm.qmp_socket {
        return qmp::vcpu_threads(q);
    }
    Ok(Vec::new())
}

/// How many vCPUs a VM has: its vCPU threads, which the host knows. Only where they are
/// unknown (a Xen domain, a VM not resolved yet) does the connected guest's hello say, and
/// then never more than `cap` (the host's CPUs): a hello is guest input, and each vCPU
/// brings state, work every period and a dozen metric series. Without threads and without
/// a guest, none: what only the guest said leaves with it.
fn vcpu_count(threads: usize, hello: u32, cap: usize) -> usize {
    match (threads, hello) {
        (0, hello) => (hello as usize).min(cap),
        (threads, _) => threads,
    }
}

/// Whether a vCPU carries its VM's I/O now: where the guest reports, it says which vCPUs
/// hold I/O-bound tasks (its classifier has hysteresis of its own); where the host only sees
/// the thread, I/O wake-ups in 3 of the last 4 periods (a computing vCPU's stray wake-ups
/// come in ones and twos, a reader's vCPU wakes in nearly every period).
fn carries_io(guest_io_tasks: Option<u32>, io_history: u8) -> bool {
    match guest_io_tasks {
        Some(n) => n > 0,
        None => (io_history & 0b1111).count_ones() >= 3,
    }
}

/// Whether a thread was runnable `RUNNABLE_SHARE` of its last `RUNNABLE_PERIODS`
/// periods (`Track::runnable_window`), schedstat's lag allowed once.
fn always_runnable(window: &VecDeque<(u64, u64)>) -> bool {
    let (runnable, covered) = window
        .iter()
        .fold((0u64, 0u64), |(r, c), &(wr, wc)| (r + wr, c + wc));
    window.len() == RUNNABLE_PERIODS
        && (runnable + SCHEDSTAT_LAG.as_nanos() as u64) as f64 >= RUNNABLE_SHARE * covered as f64
}

/// Per vCPU of a VM, whether hardly any of the VM's I/O events land there (under a tenth
/// of its busiest vCPU's). With `Track::task_history` this decides who may pay under
/// `vm-funded`: the reader that runs on one vCPU while its completions land on another
/// needs both, and a favour paid by either slowed it (a reader left on the paying vCPU
/// read 0.56–0.62x vanilla in the loop, benches/RESULTS.md "the agent alone").
fn io_free(events: &[u64]) -> Vec<bool> {
    let most = events.iter().copied().max().unwrap_or(0);
    events
        .iter()
        .map(|&e| e.saturating_mul(10) <= most)
        .collect()
}

/// When every vCPU of a VM carries I/O, `vm-funded` has nobody to pay for a favour and
/// does nothing. With the guest reporting that is the usual case: a VM with a random reader
/// on one vCPU and a sequential reader on another has both vCPUs I/O-bound, so the agent
/// favoured nobody and the VM gained nothing, where the agent alone, judging by kicks,
/// favoured one vCPU and the VM gained. So a vCPU that completes at least twice the I/O
/// events of the VM's quietest one carries the VM's I/O and the others do not (they may
/// pay). I/O spread evenly, or claimed everywhere alike,
/// still favours nobody. Returns whether `carries` changed.
fn favour_dominant(carries: &mut [bool], events: &[u64]) -> bool {
    if carries.len() < 2 || !carries.iter().all(|&c| c) {
        return false;
    }
    let least = events.iter().copied().min().unwrap_or(0);
    let dominant: Vec<bool> = events
        .iter()
        .map(|&e| e > 0 && e >= least.saturating_mul(2))
        .collect();
    if dominant.iter().all(|&d| d) || !dominant.iter().any(|&d| d) {
        return false;
    }
    carries.copy_from_slice(&dominant);
    true
}

/// The host's online CPUs (at least one).
fn host_cpus() -> usize {
    os_layer::Root::real()
        .online_cpus()
        .map_or(1, |c| c.len())
        .max(1)
}

fn alive(tid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{tid}")).exists()
}

/// The CPU a thread is pinned to, if exactly one.
fn pinned_cpu(tid: u32) -> Option<usize> {
    let cpus = os_layer::get_cpus(tid).ok()?;
    (cpus.len() == 1).then(|| cpus[0])
}

pub struct Agent {
    cfg: Config,
    backend: Box<dyn Backend>,
    params: CreditParams,
    vms: Vec<Vm>,
    status: Arc<Mutex<AgentStatus>>,
    started: Instant,
    periods: u64,
    apply_errors: u64,
    /// Applying failed in the last period that applied anything (said once).
    applying_fails: bool,
    last_scan: Option<Instant>,
    /// The most vCPUs a VM whose vCPU threads are unknown may have: the host's CPUs.
    unmapped_cap: usize,
}

impl Agent {
    pub fn new(cfg: Config, status: Arc<Mutex<AgentStatus>>) -> Result<Agent> {
        let journal_path = cfg.state_dir.join("journal.json");
        match crate::journal::recover(&journal_path) {
            Ok(0) => {}
            Ok(n) => info!(
                restored = n,
                "journal: put back what a previous agent left changed"
            ),
            Err(e) => warn!("journal: {e:#}"),
        }
        let journal = (cfg.backend == BackendKind::KvmQemu)
            .then(|| crate::journal::Journal::new(journal_path));
        let backend = backend_for(&cfg, journal)?;
        let params = CreditParams {
            period_ns: cfg.period_ms * 1_000_000,
            ..CreditParams::default()
        };
        let min = Duration::from_millis(cfg.min_report_interval_ms);
        let vms = cfg
            .vms
            .iter()
            .map(|v| Vm::new(v.clone(), Origin::Config, min))
            .collect::<Result<Vec<_>>>()?;
        Ok(Agent {
            cfg,
            backend,
            params,
            vms,
            status,
            started: Instant::now(),
            periods: 0,
            apply_errors: 0,
            applying_fails: false,
            last_scan: None,
            unmapped_cap: host_cpus(),
        })
    }

    /// VMs libvirt started or stopped since the last scan.
    fn scan_libvirt(&mut self) {
        let l = &self.cfg.libvirt;
        if !l.enabled || !(l.containers || l.channel_dir.is_dir()) {
            return;
        }
        let found = discovery::libvirt_all(l);
        let min = Duration::from_millis(self.cfg.min_report_interval_ms);
        // A VM found again under its name but another QEMU (a pod that restarted it) is
        // gone and new: its pid and socket path are the old process's.
        let mut gone = Vec::new();
        self.vms.retain_mut(|vm| {
            let keep = vm.origin != Origin::Libvirt || found.contains(&vm.cfg);
            if !keep {
                info!(vm = %vm.cfg.name, "libvirt VM gone");
                vm.shut();
                gone.extend(vm.tids.iter().copied());
            }
            keep
        });
        for tid in gone {
            self.backend.forget(tid);
        }
        for v in &found {
            if !self.vms.iter().any(|vm| vm.cfg.name == v.name) {
                info!(vm = %v.name, "libvirt VM found");
                match Vm::new(v.clone(), Origin::Libvirt, min) {
                    Ok(vm) => self.vms.push(vm),
                    Err(e) => warn!(vm = %v.name, "cannot follow libvirt VM: {e:#}"),
                }
            }
        }
    }

    fn refresh_threads(&mut self) {
        let now = Instant::now();
        for vm in &mut self.vms {
            let stale = vm.tids.is_empty() || !vm.tids.iter().all(|&t| alive(t));
            if !stale || vm.resolved_at.is_some_and(|t| now - t < RESCAN) {
                continue;
            }
            vm.resolved_at = Some(now);
            match resolve_threads(&vm.cfg) {
                Ok(tids) if tids != vm.tids => {
                    for &old in vm.tids.iter().filter(|t| !tids.contains(t)) {
                        self.backend.forget(old);
                    }
                    info!(vm = %vm.cfg.name, ?tids, "vCPU threads");
                    vm.tids = tids;
                    vm.tracks.clear();
                }
                Ok(_) => {}
                Err(e) => debug!(vm = %vm.cfg.name, "vCPU threads unknown yet: {e:#}"),
            }
        }
    }

    /// One period: observe, credit, apply, place, reply, publish.
    pub fn period(&mut self) {
        if self.last_scan.is_none_or(|t| t.elapsed() >= RESCAN) {
            self.last_scan = Some(Instant::now());
            self.scan_libvirt();
        }
        self.refresh_threads();
        self.periods += 1;
        let figures = self.observe();
        let rules = weights::Rules {
            share: self.cfg.share,
            max_nice_delta: self.cfg.max_nice_delta,
            io_boost_nice: self.cfg.io_boost_nice,
        };
        let settings = weights::plan(&self.params, &rules, &figures);
        let applied = self.apply(&settings);
        if self.cfg.balance_io {
            self.place();
        }
        self.reply(applied);
        self.publish();
    }

    /// Each vCPU's figures for this period: the guest's report where a fresh one came,
    /// else what the host sees of its thread (schedstat), else nothing.
    fn observe(&mut self) -> Vec<VcpuFigures> {
        let period = Duration::from_millis(self.cfg.period_ms);
        let period_ns = self.params.period_ns;
        let backend = &*self.backend;
        let mut figures = Vec::new();
        for (i, vm) in self.vms.iter_mut().enumerate() {
            let reports = vm.guest.fresh(period * 3);
            vm.fit_tracks(backend, self.unmapped_cap);
            let first_figure = figures.len();
            // First every thread's deltas: kicks are judged against the VM's other vCPUs.
            let deltas = vm.sample_tracks(backend);
            let kicks: Vec<Option<u64>> = deltas
                .iter()
                .map(|(d, _, _)| d.kicks.filter(|_| self.cfg.observe_kicks))
                .collect();
            let wakeups: Vec<u64> = deltas.iter().map(|(d, _, _)| d.wakeups).collect();
            let (host_events, by_kicks) = observe::host_io_events(&kicks, &wakeups, period_ns);
            let vm_period = VmPeriod {
                index: i,
                modelled: vm.cfg.model_slot.is_some(),
                reports: &reports,
                by_kicks,
                observe_schedstat: self.cfg.observe_schedstat,
                period_ns,
                follows_host: vm.guest.connected.load(Ordering::Relaxed)
                    && vm.guest.follows_host.load(Ordering::Relaxed),
            };
            for (cpu, track) in vm.tracks.iter_mut().enumerate() {
                figures.push(vm_period.vcpu_figures(cpu, track, deltas[cpu], host_events[cpu]));
            }
            vm.mark_carriers(&mut figures[first_figure..]);
        }
        figures
    }

    /// Applies the plan through the backend and records it per vCPU; returns, per VM, the
    /// weights to tell its guest.
    fn apply(&mut self, settings: &[Setting]) -> BTreeMap<usize, Vec<VcpuWeight>> {
        let mut applied: BTreeMap<usize, Vec<VcpuWeight>> = BTreeMap::new();
        let errors_before = self.apply_errors;
        for s in settings {
            let vm = &mut self.vms[s.key.0];
            let track = &mut vm.tracks[s.key.1 as usize];
            if let Err(e) = self
                .backend
                .apply(&vm.cfg.name, vm.cfg.domain.as_deref(), track.tid, s)
            {
                self.apply_errors += 1;
                // Said when applying starts failing (e.g. a full or read-only state
                // directory: nothing is changed without its undo journaled), not every
                // period for every vCPU; the count is in status and metrics.
                if self.applying_fails {
                    debug!(vm = %vm.cfg.name, vcpu = s.key.1, "applying failed: {e:#}");
                } else {
                    warn!(vm = %vm.cfg.name, vcpu = s.key.1, "applying failed: {e:#} (said once until it works again; apply_errors counts)");
                    self.applying_fails = true;
                }
            }
            let weight = s.weight;
            let st = &mut track.status;
            st.iv_credit = s.iv_credit;
            st.cv_credit = s.cv_credit;
            st.boost = s.boost;
            st.nice = s.nice;
            st.weight = weight;
            st.held = s.held;
            applied.entry(s.key.0).or_default().push(VcpuWeight {
                cpu: s.key.1,
                weight,
                held: s.held,
            });
        }
        if let Err(e) = self.backend.flush() {
            self.apply_errors += 1;
            warn!("backend flush failed: {e:#}");
        }
        if self.applying_fails && self.apply_errors == errors_before && !settings.is_empty() {
            self.applying_fails = false;
            info!(apply_errors = self.apply_errors, "applying works again");
        }
        applied
    }

    /// Tells each reporting guest what was applied to its vCPUs (never blocks: a guest
    /// that does not read is disconnected, see `guest`).
    fn reply(&self, applied: BTreeMap<usize, Vec<VcpuWeight>>) {
        for (i, vcpus) in applied {
            let (g, vm) = (&self.vms[i].guest, &self.vms[i].cfg.name);
            // One answer per report: a guest that reports seldom (it does while it has
            // nothing to say) is not woken every period for nothing.
            let reports = g.reports.load(Ordering::Relaxed);
            let unanswered = g.answered.swap(reports, Ordering::Relaxed) != reports;
            if g.connected.load(Ordering::Relaxed) && unanswered {
                g.reply(
                    vm,
                    &Message::Applied(Applied {
                        seq: g.last_seq.load(Ordering::Relaxed),
                        vcpus,
                    }),
                );
            }
        }
    }

    /// Algorithm 2 for VMs with `host_cpus`: their vCPU threads are pinned one CPU each
    /// (first round-robin over `host_cpus`), then moved when that evens out I/O load.
    fn place(&mut self) {
        let mut placed = Vec::new();
        let mut who = Vec::new();
        for (i, vm) in self.vms.iter_mut().enumerate() {
            if vm.cfg.host_cpus.len() < 2 {
                continue;
            }
            for (cpu, track) in vm.tracks.iter_mut().enumerate() {
                let Some(tid) = track.tid else { continue };
                let host = match track.status.host_cpu {
                    Some(c) if vm.cfg.host_cpus.contains(&c) => c,
                    _ => {
                        let c = vm.cfg.host_cpus[cpu % vm.cfg.host_cpus.len()];
                        match self.backend.place(tid, c) {
                            Ok(true) => {
                                info!(vm = %vm.cfg.name, vcpu = cpu, tid, host_cpu = c, "vCPU thread placed")
                            }
                            Ok(false) => continue,
                            Err(e) => {
                                warn!(vm = %vm.cfg.name, vcpu = cpu, "placing failed: {e:#}");
                                continue;
                            }
                        }
                        track.status.host_cpu = Some(c);
                        c
                    }
                };
                placed.push(Placed {
                    cpu: host,
                    events: track.status.events,
                    iv_credit: track.status.iv_credit,
                    allowed: vm.cfg.host_cpus.clone(),
                    movable: self.periods >= track.movable_from,
                });
                who.push((i, cpu));
            }
        }
        for m in placement::plan_moves(&placed) {
            let (i, cpu) = who[m.index];
            let vm = &mut self.vms[i];
            let track = &mut vm.tracks[cpu];
            let Some(tid) = track.tid else { continue };
            match self.backend.place(tid, m.to) {
                Ok(_) => {
                    track.moves += 1;
                    track.movable_from = self.periods + MOVE_COOLDOWN_PERIODS;
                    track.status.host_cpu = Some(m.to);
                    track.status.moves = track.moves;
                    info!(
                        vm = %vm.cfg.name,
                        vcpu = cpu,
                        tid,
                        from = m.from,
                        to = m.to,
                        iv = track.status.iv_credit,
                        "I/O load balancing: vCPU thread moved"
                    );
                }
                Err(e) => warn!(vm = %vm.cfg.name, vcpu = cpu, "moving failed: {e:#}"),
            }
        }
    }

    fn publish(&self) {
        let snapshot = AgentStatus {
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            backend: self.cfg.backend,
            weight: self.cfg.weight,
            period_ms: self.cfg.period_ms,
            periods: self.periods,
            apply_errors: self.apply_errors,
            vms: self
                .vms
                .iter()
                .map(|vm| VmStatus {
                    name: vm.cfg.name.clone(),
                    origin: vm.origin,
                    connected: vm.guest.connected.load(Ordering::Relaxed),
                    reports: vm.guest.reports.load(Ordering::Relaxed),
                    rejected: vm.guest.rejected.load(Ordering::Relaxed),
                    disconnects: vm.guest.disconnects.load(Ordering::Relaxed),
                    connections: vm.guest.connections.load(Ordering::Relaxed),
                    log_suppressed: vm.guest.log_suppressed.load(Ordering::Relaxed),
                    vcpus: vm.tracks.iter().map(|t| t.status.clone()).collect(),
                })
                .collect(),
        };
        *self.status.lock().unwrap_or_else(PoisonError::into_inner) = snapshot;
    }

    /// Runs periods until `stop`, then restores every change. A configuration put in
    /// `reloaded` (live keys only changed, see `control::Reloadable`) is taken up between
    /// periods.
    pub fn run(mut self, stop: &control::Stop, reloaded: &Mutex<Option<Config>>) {
        info!(
            backend = self.backend.name(),
            weight = %self.cfg.weight,
            vms = self.vms.len(),
            period_ms = self.cfg.period_ms,
            "hv-agent running"
        );
        self.publish();
        let period = Duration::from_millis(self.cfg.period_ms);
        let mut next = Instant::now() + period;
        while !stop.is_set() {
            let now = Instant::now();
            if now < next {
                stop.nap(next - now);
                continue;
            }
            next += period;
            if next < now {
                next = now + period;
            }
            if let Some(cfg) = reloaded
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
            {
                self.cfg = cfg;
            }
            self.period();
        }
        let restored = self.backend.restore();
        info!(
            restored,
            backend = self.backend.name(),
            "restored every scheduling change"
        );
        // All guest threads told first: they stop together, not one after another.
        for vm in &self.vms {
            vm.signal_stop();
        }
        for vm in &mut self.vms {
            vm.shut();
        }
    }
}

/// The backend `cfg` asks for (here, not in `backend`, which the model backend builds on);
/// `journal`: where `kvm-qemu` writes the undo of each change
/// before making it.
pub(crate) fn backend_for(cfg: &Config, journal: Option<Journal>) -> Result<Box<dyn Backend>> {
    Ok(match cfg.backend {
        BackendKind::KvmQemu => Box::new(backend::KvmQemu::new(
            match cfg.weight {
                WeightKind::Cgroup => backend::Share::Cgroup(CgroupWeights::new()?),
                WeightKind::Nice => backend::Share::Nice,
            },
            journal,
        )),
        BackendKind::Xen => Box::new(backend::Xen::new(Box::new(backend::RealRunner))),
        BackendKind::Model => Box::new(crate::model::Model::open(&cfg.model_dir, &cfg.vms)?),
        BackendKind::DryRun => Box::new(backend::DryRun),
    })
}

/// The agent's threads' ids, for `check`: what each VM resolves to right now.
pub fn describe_threads(vm: &VmConfig) -> String {
    if let Some(slot) = vm.model_slot {
        return format!(
            "host model slot {slot}: no vCPU threads, vCPU n is the entity on model CPU n"
        );
    }
    match resolve_threads(vm) {
        Ok(t) if t.is_empty() => "no vCPU threads (xen domain or not running)".into(),
        Ok(t) => format!("vCPU threads {t:?}"),
        Err(e) => format!("vCPU threads unknown: {e:#}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_puts_into_effect_exactly_the_live_keys() {
        let running = Config::default();
        let new = Config::parse(
            "share = \"isacs\"\nmax_nice_delta = 5\nio_boost_nice = 1\n\
             observe_schedstat = false\nobserve_kicks = false\nperiod_ms = 50\n\
             balance_io = false\n",
            "t.toml",
        )
        .unwrap();
        use control::Reloadable;
        let (live, restart) =
            control::changed_keys(&running, &new, |k| Config::LIVE_KEYS.contains(&k));
        let mut sorted = Config::LIVE_KEYS.to_vec();
        sorted.sort_unstable();
        assert_eq!(live, sorted, "every live key changed in this file");
        assert_eq!(restart, ["balance_io", "period_ms"]);
        let next = running.with_live_keys(&new);
        let (applied, left) = control::changed_keys(&running, &next, |_| true);
        assert_eq!(applied, sorted, "with_live_keys and LIVE_KEYS disagree");
        assert!(left.is_empty());
    }

    #[test]
    fn a_vm_has_the_vcpus_the_host_knows_of() {
        // Threads known: the guest's hello cannot add series.
        assert_eq!(vcpu_count(2, 1024, 8), 2);
        assert_eq!(vcpu_count(2, 0, 8), 2);
        // Threads unknown: the hello says, up to the host's CPUs, also when it shrinks
        // after a reconnect.
        assert_eq!(vcpu_count(0, 1024, 8), 8);
        assert_eq!(vcpu_count(0, 2, 8), 2);
        // Neither threads nor a guest: no vCPUs.
        assert_eq!(vcpu_count(0, 0, 8), 0);
    }

    #[test]
    fn io_is_what_the_guest_says_else_what_keeps_showing() {
        assert_eq!(io_free(&[0, 300]), vec![true, false]);
        // A hog read between ticks: ~4 ms short in one period, made up in the next.
        let ms = |r: u64, c: u64| (r * 1_000_000, c * 1_000_000);
        let hog: VecDeque<_> = [ms(96, 100), ms(104, 100), ms(97, 100), ms(100, 100)].into();
        assert!(always_runnable(&hog));
        // A client's vCPU halting a tenth of the time, and a window not yet full.
        let client: VecDeque<_> = [ms(90, 100); 4].into();
        assert!(!always_runnable(&client));
        assert!(!always_runnable(&[ms(100, 100); 3].into()));
        assert_eq!(io_free(&[29, 300]), vec![true, false], "stray events");
        assert_eq!(
            io_free(&[100, 300]),
            vec![false, false],
            "both complete I/O"
        );
        assert_eq!(io_free(&[0, 0]), vec![true, true]);
        assert!(carries_io(Some(1), 0));
        assert!(!carries_io(Some(0), 0b1111), "the guest knows better");
        assert!(carries_io(None, 0b0111));
        assert!(carries_io(None, 0b1011));
        assert!(!carries_io(None, 0b0101), "stray wake-ups");
        assert!(!carries_io(None, 0b1111_0000), "older than four periods");
    }

    #[test]
    fn a_dominant_io_vcpu_carries_its_vms_io_when_every_vcpu_claims_some() {
        // The lab's main scenario per period: 4 KiB reader's vCPU 150, sequential 60.
        let mut c = vec![true, true];
        assert!(favour_dominant(&mut c, &[150, 60]));
        assert_eq!(c, [true, false]);
        // Even I/O, or I/O claimed everywhere alike: nobody is favoured.
        let mut c = vec![true, true];
        assert!(!favour_dominant(&mut c, &[200, 200]));
        assert!(!favour_dominant(&mut c, &[100, 150]));
        assert_eq!(c, [true, true]);
        // Some vCPU already pays: the rule is not needed.
        let mut c = vec![true, false, true];
        assert!(!favour_dominant(&mut c, &[150, 0, 10]));
        assert_eq!(c, [true, false, true]);
        // One vCPU, or tasks but no completions anywhere.
        assert!(!favour_dominant(&mut [true], &[5]));
        assert!(!favour_dominant(&mut [true, true], &[0, 0]));
        // Four vCPUs, two dominant.
        let mut c = vec![true; 4];
        assert!(favour_dominant(&mut c, &[300, 20, 39, 41]));
        assert_eq!(c, [true, false, false, true]);
    }
}
