//! `vmigrater run`: wires monitor → detector → migrater together, serves metrics and status,
//! and on SIGTERM/SIGINT hands every task back with its original mask. Owns start-up order
//! (crash recovery first, before anything can be moved) and shutdown order (stop moving,
//! then restore). It must never leave a task pinned on any exit path it controls; for the
//! ones it does not (kill -9), the journal is recovered at the next start.

use anyhow::{anyhow, Context, Result};
use arc_swap::ArcSwap;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use task_detector::{
    ClassifierConfig, CpuIoSample, Detector, IoTracker, TrackerOptions, TrackerStorage,
};
use tracing::{debug, info, warn};
use vcpu_monitor::{monotonic_ns, AnyMonitor, Demand, MonitorConfig, VcpuBoard};

use crate::channel::{self, ChannelStats, VcpuSample};
use crate::config::Config;
use crate::sampling;
use crate::status::{self, StatusReport, TaskStatus, VcpuStatus};
use migrater::admission::{self, Admission};
use migrater::affinity::AffinityExecutor;
use migrater::guard::{Contention, GuardConfig, MoveGuard, VcpuOut};
use migrater::hook::{
    lock_placement, try_lock_placement, LatencyRing, MigrationHook, Placement, Shared, TaskEntry,
};
use migrater::journal::AffinityJournal;
use migrater::metrics::{CpuLabel, Metrics};
use migrater::planner::{Planner, PlannerConfig};

pub fn journal_path(state_dir: &Path) -> std::path::PathBuf {
    state_dir.join("journal.json")
}

pub fn monitor_config(cfg: &Config) -> Result<MonitorConfig> {
    let m = &cfg.monitor;
    let mut mc = MonitorConfig::default();
    if !m.cpus.is_empty() {
        mc.cpus = m.cpus.clone();
    }
    mc.period = Duration::from_micros(m.period_us);
    mc.probe_period = Duration::from_micros(m.probe_period_us);
    mc.idle_period = Duration::from_micros(m.idle_period_us);
    mc.min_gap_threshold = Duration::from_micros(m.min_gap_threshold_us);
    mc.default_slice = Duration::from_micros(m.default_slice_us);
    mc.rt_priority = (m.rt_priority > 0).then_some(m.rt_priority);
    anyhow::ensure!(!mc.cpus.is_empty(), "no CPUs to monitor");
    Ok(mc)
}

fn classifier_config(cfg: &Config) -> ClassifierConfig {
    ClassifierConfig {
        window_ns: cfg.detector.window_ms * 1_000_000,
        ..ClassifierConfig::default()
    }
}

/// Context of the daemon that the control plane needs to answer status requests.
struct Running {
    shared: Arc<Shared>,
    board: Arc<VcpuBoard>,
    cpu_io: Arc<ArcSwap<Vec<CpuIoSample>>>,
    attach_mode: String,
    monitor_source: &'static str,
    dry_run: bool,
    started: Instant,
    channel: Arc<ChannelStats>,
    /// Every I/O-bound task found, managed or not: (tid, CPU it last ran on).
    io_seen: Arc<ArcSwap<Vec<(u32, usize)>>>,
}

impl Running {
    /// Cumulative per-vCPU figures for the host channel.
    fn channel_sample(&self) -> Vec<VcpuSample> {
        let now = monotonic_ns();
        // Every I/O-bound task counts, also while moves are on hold: the host favours
        // the vCPUs that hold them, whoever placed them there.
        let tasks = self.io_seen.load();
        let cpu_io = self.cpu_io.load();
        // try_lock: the channel must never hold up the planner; a busy lock only means
        // this period's per-vCPU task counts use the tasks' last CPU instead.
        let placement = try_lock_placement(&self.shared.placement);
        let on = |&(tid, last_cpu): &(u32, usize)| {
            placement
                .as_ref()
                .and_then(|p| p.placed_on(tid))
                .unwrap_or(last_cpu)
        };
        self.board
            .snapshot(now)
            .iter()
            .map(|s| {
                let io = cpu_io.iter().find(|c| c.cpu as usize == s.cpu);
                VcpuSample {
                    cpu: s.cpu as u32,
                    completions: io.map_or(0, |c| c.completions),
                    ema_interval_ns: io.map_or(0, |c| c.ema_interval_ns),
                    io_bound_tasks: tasks.iter().filter(|t| on(t) == s.cpu).count() as u32,
                    inactive_total_ns: s.inactive_total_ns,
                    est_slice_ns: s.est_slice_ns,
                }
            })
            .collect()
    }

    fn report(&self) -> StatusReport {
        let now = monotonic_ns();
        let tasks = self.shared.tasks.load();
        let cpu_io = self.cpu_io.load();
        let placement = lock_placement(&self.shared.placement);
        let placed: Vec<Option<usize>> = tasks.iter().map(|t| placement.placed_on(t.tid)).collect();
        let vcpus = self
            .board
            .snapshot(now)
            .iter()
            .map(|s| {
                let io = cpu_io.iter().find(|c| c.cpu as usize == s.cpu);
                VcpuStatus {
                    cpu: s.cpu,
                    active: s.active,
                    deschedules: s.deschedules,
                    inactive_total_ms: s.inactive_total_ns as f64 / 1e6,
                    covered_total_ms: s.covered_total_ns as f64 / 1e6,
                    last_inactive_ms: s.last_inactive_ns as f64 / 1e6,
                    est_slice_ms: s.est_slice_ns as f64 / 1e6,
                    remaining_ms: s.remaining_ns as f64 / 1e6,
                    gap_threshold_us: s.gap_threshold_ns as f64 / 1e3,
                    io_completions: io.map_or(0, |c| c.completions),
                    io_interval_ema_us: io.map_or(0.0, |c| c.ema_interval_ns as f64 / 1e3),
                    tasks_placed: placed.iter().filter(|p| **p == Some(s.cpu)).count(),
                }
            })
            .collect();
        StatusReport {
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            dry_run: self.dry_run,
            attach_mode: self.attach_mode.clone(),
            monitor_source: self.monitor_source.into(),
            moves_allowed: self.shared.metrics.moves_allowed.get() != 0,
            host_holds: self.shared.metrics.host_holds.get() != 0,
            block_tracking: self.shared.metrics.block_tracking.get() != 0,
            block_attached: self.shared.metrics.block_attached.get() != 0,
            guard_pays: self.shared.metrics.guard_verdicts().0,
            guard_holds: self.shared.metrics.guard_verdicts().1,
            demand: if tasks.is_empty() { "idle" } else { "active" }.into(),
            io_tasks: tasks.len() as u64,
            managed_tasks: placement.executor.as_ref().map_or(0, |e| e.managed_count()) as u64,
            migrations: self.shared.migrations.load(Ordering::Relaxed),
            hands_off_tasks: placement.hands_off.len() as u64,
            journal_errors: placement
                .executor
                .as_ref()
                .map_or(0, |e| e.journal_errors()),
            channel_connected: self.channel.connected.load(Ordering::Relaxed),
            channel_reports_sent: self.channel.reports_sent.load(Ordering::Relaxed),
            channel_reports_dropped: self.channel.reports_dropped.load(Ordering::Relaxed),
            channel_replies: self.channel.replies.load(Ordering::Relaxed),
            migration_latency_us: status::summarize(
                &placement.latencies.values(),
                placement.latencies.total,
            ),
            vcpus,
            tasks: tasks
                .iter()
                .zip(&placed)
                .map(|(t, p)| TaskStatus {
                    tid: t.tid,
                    tgid: t.tgid,
                    comm: t.comm.clone(),
                    load: t.load,
                    priority: t.priority,
                    placed_on: *p,
                    allowed: t.allowed.clone(),
                })
                .collect(),
        }
    }

    fn refresh_metrics(&self) {
        let now = monotonic_ns();
        let m = &self.shared.metrics;
        if let Some(errors) = lock_placement(&self.shared.placement)
            .executor
            .as_ref()
            .map(|e| e.journal_errors())
        {
            m.journal_errors.inner().store(errors, Ordering::Relaxed);
        }
        for s in self.board.snapshot(now) {
            let l = CpuLabel { cpu: s.cpu as u32 };
            m.deschedules
                .get_or_create(&l)
                .inner()
                .store(s.deschedules, Ordering::Relaxed);
            m.inactive_seconds.get_or_create(&l).inner().store(
                (s.inactive_total_ns as f64 / 1e9).to_bits(),
                Ordering::Relaxed,
            );
            m.covered_seconds.get_or_create(&l).inner().store(
                (s.covered_total_ns as f64 / 1e9).to_bits(),
                Ordering::Relaxed,
            );
            m.slice_estimate_seconds
                .get_or_create(&l)
                .set(s.est_slice_ns as f64 / 1e9);
            m.remaining_slice_seconds
                .get_or_create(&l)
                .set(s.remaining_ns as f64 / 1e9);
            m.vcpu_active.get_or_create(&l).set(i64::from(s.active));
        }
        for c in self.cpu_io.load().iter() {
            let l = CpuLabel { cpu: c.cpu };
            m.io_completions
                .get_or_create(&l)
                .inner()
                .store(c.completions, Ordering::Relaxed);
            m.io_interval_ema_seconds
                .get_or_create(&l)
                .set(c.ema_interval_ns as f64 / 1e9);
        }
    }
}

/// Hands every journaled task of a crashed previous run back its original mask.
fn recover_journal(state_dir: &Path) -> Result<()> {
    let path = journal_path(state_dir);
    if !path.exists() {
        return Ok(());
    }
    let report = AffinityJournal::recover(&path)
        .with_context(|| format!("recovering {}", path.display()))
        .with_context(|| unwritable(state_dir))?;
    info!(?report, "recovered the journal of a previous run");
    Ok(())
}

/// Why a daemon that cannot write its state directory does not start.
fn unwritable(state_dir: &Path) -> String {
    format!(
        "the state directory {} must be writable: every CPU mask the daemon changes is \
         journaled there first (state_dir in the config, or --state-dir)",
        state_dir.display()
    )
}

/// Two daemons on one machine would fight over the same tasks' masks (each would see the
/// other's change as an administrator's and give up), so only one may run at a time.
const INSTANCE_LOCK: &str = "/run/lock/vmigrater.lock";

fn lock_instance() -> Result<nix::fcntl::Flock<std::fs::File>> {
    let path = Path::new(INSTANCE_LOCK);
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {INSTANCE_LOCK}"))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
        anyhow::anyhow!(
            "another vmigrater is already running on this machine ({INSTANCE_LOCK} is locked: {e})"
        )
    })
}

pub fn run(cfg: Config) -> Result<()> {
    let _instance = lock_instance()?;
    let state_dir = cfg.state_dir.clone();
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating state dir {}", state_dir.display()))?;
    recover_journal(&state_dir)?;

    let detector = DetectorThread::spawn(
        TrackerOptions {
            force_mode: cfg.detector.attach_mode.forced(),
        },
        classifier_config(&cfg),
    )?;
    let attach_mode = detector
        .as_ref()
        .map_or_else(|| "none".to_string(), |d| d.mode.clone());

    let mon_cfg = monitor_config(&cfg)?;
    let cpus = mon_cfg.cpus.clone();
    let board = Arc::new(VcpuBoard::new(&cpus, &mon_cfg));
    let executor = if cfg.dry_run {
        info!("dry-run: migrations are planned and logged, no mask is changed");
        None
    } else {
        Some(AffinityExecutor::new(
            AffinityJournal::open(journal_path(&state_dir))
                .with_context(|| unwritable(&state_dir))?,
        ))
    };
    let shared = Arc::new(Shared {
        tasks: ArcSwap::from_pointee(Vec::new()),
        placement: Mutex::new(Placement {
            executor,
            simulated: HashMap::new(),
            latencies: LatencyRing::new(4096),
            hands_off: HashSet::new(),
        }),
        metrics: Metrics::new(&attach_mode, cfg.dry_run),
        migrations: AtomicU64::new(0),
    });
    let planner = Planner::new(PlannerConfig {
        push_threshold_ns: cfg.migration.push_threshold_us * 1_000,
        max_load_per_vcpu: cfg.migration.max_load_per_vcpu,
        ..PlannerConfig::default()
    });
    let hook = Arc::new(MigrationHook::new(
        shared.clone(),
        planner,
        cfg.migration.push_threshold_us * 1_000,
        &cpus,
    ));
    let (monitor, fallback) = AnyMonitor::start(
        cfg.monitor.wanted(),
        mon_cfg,
        board.clone(),
        hook,
        Duration::from_micros(cfg.migration.push_threshold_us),
    )
    .context("starting the vCPU monitor")?;
    if let Some(why) = fallback {
        warn!("kernel-timer vCPU monitor unavailable, using sleepers: {why}");
    }
    let monitor_kind = monitor.source();
    let monitor_source = monitor_kind.as_str();
    shared.metrics.set_monitor_source(monitor_source);
    info!(cpus = ?cpus, source = monitor_source, period_us = cfg.monitor.period_us, "vCPU monitor started");

    // Every sleep of the detector and channel threads is a nap on this: shutdown wakes
    // them at once, whatever the configured periods.
    let stop = Arc::new(control::Stop::default());
    let cpu_io = Arc::new(ArcSwap::from_pointee(Vec::new()));
    let io_seen = Arc::new(ArcSwap::from_pointee(Vec::new()));
    let channel_stats = Arc::new(ChannelStats::default());
    let detect_thread = detector.map(|d| {
        d.start(DetectStart {
            shared: shared.clone(),
            board: board.clone(),
            cpu_io: cpu_io.clone(),
            io_seen: io_seen.clone(),
            stop: stop.clone(),
            channel: channel_stats.clone(),
            cfg: cfg.clone(),
            // Only the kernel source sees deschedules while idle; sleepers at their idle
            // period catch a fraction of them, so there the guard judges by I/O alone.
            measures_contention: monitor_kind == vcpu_monitor::Source::Kernel,
        })
    });

    let running = Arc::new(Running {
        shared: shared.clone(),
        board,
        cpu_io,
        attach_mode,
        monitor_source,
        dry_run: cfg.dry_run,
        started: Instant::now(),
        channel: channel_stats,
        io_seen,
    });
    let channel_thread = if cfg.channel.enabled {
        let (running, stop, path) = (running.clone(), stop.clone(), cfg.channel.path.clone());
        let period = Duration::from_millis(cfg.channel.period_ms);
        Some(
            std::thread::Builder::new()
                .name("vmigrater-chan".into())
                .spawn(move || {
                    channel::run(
                        &path,
                        period,
                        || running.channel_sample(),
                        &running.channel,
                        &stop,
                    )
                })?,
        )
    } else {
        None
    };
    let served = control_plane(&cfg, running);

    // Shutdown: stop deciding first, then hand every task back.
    stop.set();
    monitor.stop();
    if detect_thread.is_some_and(|t| t.join().is_err()) {
        warn!("detector thread panicked");
    }
    if channel_thread.is_some_and(|t| t.join().is_err()) {
        warn!("channel thread panicked");
    }
    shared.tasks.store(Arc::new(Vec::new()));
    let mut placement = lock_placement(&shared.placement);
    if let Some(ex) = placement.executor.as_mut() {
        let restored = ex.release_all();
        info!(restored, "restored original affinity of every managed task");
    }
    let _ = std::fs::remove_file(status::socket_path(&state_dir));
    served
}

/// Tokio runs only the control plane: metrics HTTP, the status socket and signals.
fn control_plane(cfg: &Config, running: Arc<Running>) -> Result<()> {
    let endpoints = control::Endpoints {
        status_socket: status::socket_path(&cfg.state_dir),
        metrics: cfg.metrics.enabled.then_some(cfg.metrics.listen),
    };
    let for_metrics = running.clone();
    control::serve(
        "vmigrater-ctl",
        &endpoints,
        move || serde_json::to_vec(&running.report()).unwrap_or_default(),
        move || {
            for_metrics.refresh_metrics();
            for_metrics.shared.metrics.encode()
        },
        // The signal is awaited outside the log macro: a macro whose level is off does not
        // evaluate its arguments, and the daemon would "shut down" at once (exit 0).
        async {
            let signal = control::terminated().await;
            info!("{signal}: shutting down");
        },
    )
}

fn read_cgroup(tgid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{tgid}/cgroup")).unwrap_or_default()
}

/// The detector's thread. It opens the block programs itself: libbpf's objects stay on
/// the thread that opened them (the skeleton is not `Send`) and borrow storage on its
/// stack, the way sched-ext/scx keeps its own. Start-up takes two steps so that the
/// attach mode is known before the metrics are made: the thread says how loading went,
/// then waits for the rest of the daemon before it loops.
struct DetectorThread {
    handle: std::thread::JoinHandle<()>,
    go: mpsc::Sender<DetectStart>,
    mode: String,
}

/// What the detector thread gets once the rest of the daemon is wired.
struct DetectStart {
    shared: Arc<Shared>,
    board: Arc<VcpuBoard>,
    cpu_io: Arc<ArcSwap<Vec<CpuIoSample>>>,
    io_seen: Arc<ArcSwap<Vec<(u32, usize)>>>,
    stop: Arc<control::Stop>,
    channel: Arc<ChannelStats>,
    cfg: Config,
    measures_contention: bool,
}

impl DetectorThread {
    /// `None` when the programs do not load. Without them nothing can be found or moved,
    /// but the vCPU monitor, status, metrics and channel still tell the operator what they
    /// see: a degraded run, said once, rather than a restart loop under systemd.
    fn spawn(opts: TrackerOptions, classifier: ClassifierConfig) -> Result<Option<Self>> {
        let (loaded_tx, loaded) = mpsc::channel::<Result<String>>();
        let (go, wait) = mpsc::channel::<DetectStart>();
        let handle = std::thread::Builder::new()
            .name("vmigrater-detect".into())
            .spawn(move || {
                let mut storage = TrackerStorage::new();
                let tracker = match IoTracker::open(&opts, &mut storage) {
                    Ok(t) => t,
                    Err(e) => {
                        let _ = loaded_tx.send(Err(e));
                        return;
                    }
                };
                let _ = loaded_tx.send(Ok(tracker.mode().to_string()));
                // No start when the daemon failed to start after this: nothing to do.
                let Ok(s) = wait.recv() else { return };
                let env = DetectEnv {
                    shared: &s.shared,
                    board: &s.board,
                    cpu_io: &s.cpu_io,
                    io_tasks: &s.io_seen,
                    stop: &s.stop,
                    channel: &s.channel,
                    measures_contention: s.measures_contention,
                };
                detect_loop(Detector::new(tracker, classifier), &s.cfg, &env);
            })
            .context("starting the detector thread")?;
        let loaded = loaded
            .recv()
            .unwrap_or_else(|_| Err(anyhow!("the detector thread ended while loading")));
        match loaded {
            Ok(mode) => {
                info!(attach_mode = %mode, "block I/O tracking attached");
                Ok(Some(DetectorThread { handle, go, mode }))
            }
            Err(e) => {
                let _ = handle.join();
                warn!(
                    "degraded: the block I/O BPF programs do not load, so no task is found or \
                     moved; vCPU monitoring, status and metrics go on ({e:#}; `vmigrater \
                     check` says more)"
                );
                Ok(None)
            }
        }
    }

    /// Lets the thread loop; its handle is joined at shutdown.
    fn start(self, s: DetectStart) -> std::thread::JoinHandle<()> {
        // A thread that has ended (a panic) shows at the join.
        let _ = self.go.send(s);
        self.handle
    }
}

/// What the detector loop shares with the rest of the daemon.
struct DetectEnv<'a> {
    shared: &'a Shared,
    board: &'a VcpuBoard,
    cpu_io: &'a ArcSwap<Vec<CpuIoSample>>,
    /// Every I/O-bound task found (for the host's per-vCPU figures).
    io_tasks: &'a ArcSwap<Vec<(u32, usize)>>,
    stop: &'a control::Stop,
    /// Whether a host agent answers (it wants per-vCPU I/O figures).
    channel: &'a ChannelStats,
    /// Whether the monitor's inactive times tell how contended the vCPUs are.
    measures_contention: bool,
}

/// How often the contention gate judges the vCPUs' out time.
const CONTENTION_WINDOW: Duration = Duration::from_secs(2);
/// How long before a hold ends block tracking resumes: two contention checks (the loop
/// looks every window while paused) and a sample, so the probe finds the I/O-bound tasks.
const HOLD_LEAD: Duration = Duration::from_secs(5);

/// The detector loop (a normal-priority OS thread): polls the BPF maps every window,
/// hands newly I/O-bound tasks to the executor (journaling their mask first) and releases
/// tasks that stopped being I/O-bound, then publishes the set for the monitor threads.
/// With sampled tracking the programs return at once between samples; the last sample's
/// tasks stand until the next one.
fn detect_loop(mut detector: Detector<'_>, cfg: &Config, env: &DetectEnv<'_>) {
    let DetectEnv {
        shared,
        board,
        cpu_io,
        io_tasks,
        stop,
        channel,
        measures_contention,
    } = *env;
    let mut host_held = false;
    // I/O-bound tasks anchored on vCPUs the host agent holds: (tid, comm).
    let mut anchored: Vec<(u32, String)> = Vec::new();
    let own_pid = std::process::id();
    let window = Duration::from_millis(cfg.detector.window_ms);
    let idle = Duration::from_millis(cfg.detector.idle_poll_ms.max(cfg.detector.window_ms));
    let all_cpus: Vec<usize> = board
        .snapshot(monotonic_ns())
        .iter()
        .map(|s| s.cpu)
        .collect();
    let schedule = (cfg.detector.sample_every_ms > 0).then(|| sampling::Schedule {
        length: Duration::from_millis(cfg.detector.sample_ms),
        every: Duration::from_millis(cfg.detector.sample_every_ms),
    });
    let mut sample_start = Instant::now();
    let mut estimate = sampling::CompletionEstimate::default();
    let mut sampled_cpus: Vec<CpuIoSample> = Vec::new();
    let mut diskstats = task_detector::diskstats::DiskStats::default();
    let mut found: Vec<task_detector::IoTaskInfo> = Vec::new();
    let mut last_completions = 0u64;
    // Where nothing is descheduled there is nothing to gain: with the guard on (dry run
    // too, to show what would happen), no probe and no move there.
    let gate_on_contention = cfg.migration.guard && measures_contention;
    let mut contention = Contention::new(
        CONTENTION_WINDOW.as_nanos() as u64,
        Contention::DEFAULT_MIN_FRACTION,
        Contention::DEFAULT_MIN_COVERED,
    );
    let mut contended = false;
    let mut wanted_tracking = true;
    // With nothing to gain for `detach_after` the block programs come off their
    // tracepoints; the first window that could gain puts them back.
    let detach_after = (cfg.detector.detach_after_ms > 0)
        .then(|| Duration::from_millis(cfg.detector.detach_after_ms));
    // Since when nothing could gain (None while something could).
    let mut quiet_since: Option<Instant> = None;
    let mut guard = (cfg.migration.guard && !cfg.dry_run).then(|| {
        MoveGuard::new(GuardConfig {
            epoch_ns: cfg.migration.guard_epoch_ms * 1_000_000,
            ..GuardConfig::default()
        })
    });
    while !stop.is_set() {
        let was_contended = contended;
        let now = monotonic_ns();
        contended = !gate_on_contention || {
            let out: Vec<VcpuOut> = board
                .snapshot(now)
                .iter()
                .map(|v| VcpuOut {
                    inactive_ns: v.inactive_total_ns,
                    covered_ns: v.covered_total_ns,
                })
                .collect();
            contention.observe(now, &out)
        };
        if contended != was_contended && gate_on_contention {
            info!(
                most_out = format!("{:.0}%", contention.last_fraction * 100.0),
                others_running = format!("{:.0}%", contention.last_covered * 100.0),
                "{}",
                if contended {
                    "vCPUs are descheduled while others run: moves may pay, the guard will probe"
                } else if contention.last_fraction >= Contention::DEFAULT_MIN_FRACTION {
                    "vCPUs are descheduled all at once: nowhere to move to, no moves"
                } else {
                    "vCPUs run nearly all the time: nothing to gain, no moves"
                }
            );
        }
        // Finding I/O-bound tasks serves moves and the host agent's figures only: with
        // the gate on, the block programs stay paused (no sample) while nothing can gain,
        // and the first window that could resumes them at once. Moves need another vCPU
        // running while one is out (`contended`); an answering host agent can help
        // wherever a vCPU is out at all (it keeps the vCPU carrying our I/O running), but
        // where no vCPU is descheduled it has nothing to give either: measured in the lab
        // with one vCPU per host CPU, tracking for an agent that could do nothing cost
        // 4 KiB reads 10% (paired 0.90× [0.88, 0.94] of vanilla, 6 runs).
        //
        // While the guard holds (moves measured not to pay), nothing is moved or measured
        // until the next probe, so the programs pause and, after `detach_after`, come off
        // too: a daemon that cannot help must cost nothing where it stays for days. They
        // come back a lead before the probe, so that it finds the I/O-bound tasks.
        let agent_answers = channel.replies.load(Ordering::Relaxed) > 0;
        let descheduled = contention.last_fraction >= Contention::DEFAULT_MIN_FRACTION;
        let guard_holds = guard
            .as_ref()
            .is_some_and(|g| g.holds_past(now + HOLD_LEAD.as_nanos() as u64));
        let wants_tracking =
            ((!gate_on_contention || contended) && !guard_holds) || (agent_answers && descheduled);
        // The nap of this round is bounded by the sample's end or the next sample.
        let mut nap_limit = Duration::MAX;
        if wants_tracking && !wanted_tracking && !detector.tracking() {
            if let Some(s) = schedule {
                sample_start = Instant::now().checked_sub(s.every).unwrap_or(sample_start);
            }
        }
        wanted_tracking = wants_tracking;
        if wants_tracking {
            quiet_since = None;
            if !detector.attached() {
                info!("something to gain again: the block programs go back on their tracepoints");
            }
        } else if detach_after.is_some_and(|after| {
            detector.attached() && quiet_since.get_or_insert_with(Instant::now).elapsed() >= after
        }) {
            match detector.detach() {
                Ok(()) => {
                    // What the last sample found goes stale with no sample to come; the
                    // per-vCPU counts stand still too (below), so the host is told nothing
                    // and the channel goes quiet until something could gain.
                    found.clear();
                    info!(
                        after_ms = cfg.detector.detach_after_ms,
                        "{}: the block programs come off their tracepoints",
                        if guard_holds {
                            "moves do not pay here"
                        } else {
                            "nothing to gain"
                        }
                    )
                }
                Err(e) => {
                    shared.metrics.detector_errors.inc();
                    warn!("detaching the block programs failed: {e:#}");
                }
            }
        }
        if schedule.is_none() && wants_tracking != detector.tracking() {
            let switched = if wants_tracking {
                detector.resume()
            } else {
                detector.pause()
            };
            if let Err(e) = switched {
                shared.metrics.detector_errors.inc();
                warn!("switching block tracking failed: {e:#}");
            }
        }
        if let Some(s) = schedule {
            match s.step(detector.tracking(), sample_start.elapsed()) {
                sampling::Step::Track(left) => nap_limit = left,
                sampling::Step::Pause => match detector.pause() {
                    Ok(()) => {
                        debug!("sample over: block tracking paused");
                        nap_limit = s.every.saturating_sub(sample_start.elapsed());
                    }
                    Err(e) => {
                        shared.metrics.detector_errors.inc();
                        warn!("pausing block tracking failed: {e:#}");
                    }
                },
                sampling::Step::Wait(left) => nap_limit = left,
                sampling::Step::Resume if !wants_tracking => {
                    // Nothing to gain: skip this sample.
                    sample_start = Instant::now();
                    nap_limit = s.every;
                }
                sampling::Step::Resume => {
                    sample_start = Instant::now();
                    match detector.resume() {
                        Ok(()) => nap_limit = s.length,
                        Err(e) => {
                            shared.metrics.detector_errors.inc();
                            warn!("resuming block tracking failed: {e:#}");
                            nap_limit = s.every;
                        }
                    }
                }
            }
        }
        if !wants_tracking {
            // Paused for want of contention: look again a window later.
            nap_limit = nap_limit.min(CONTENTION_WINDOW);
        }
        shared
            .metrics
            .block_tracking
            .set(i64::from(detector.tracking()));
        shared
            .metrics
            .block_attached
            .set(i64::from(detector.attached()));
        // The kernel's own count of completed requests: what the guard judges progress
        // by (it moves whether or not our programs are attached).
        let disk = if guard.is_some() || schedule.is_some() {
            diskstats.requests_completed()
        } else {
            None
        };
        let mut io_seen = false;
        if detector.tracking() {
            let out = match detector.poll() {
                Ok(out) => out,
                Err(e) => {
                    shared.metrics.detector_errors.inc();
                    warn!("polling the BPF maps failed: {e:#}");
                    stop.nap(idle);
                    continue;
                }
            };
            let completions: u64 = out.cpus.iter().map(|c| c.completions).sum();
            io_seen = completions != last_completions;
            last_completions = completions;
            let cpus = match (schedule, disk) {
                (Some(_), Some(d)) => estimate.update(&out.cpus, d),
                _ => out.cpus.clone(),
            };
            cpu_io.store(Arc::new(cpus));
            sampled_cpus = out.cpus;
            found = out.tasks;
        } else if let Some(d) = disk.filter(|_| detector.attached()) {
            cpu_io.store(Arc::new(estimate.update(&sampled_cpus, d)));
        }
        let progress = disk.unwrap_or(last_completions);

        let current = shared.tasks.load();
        let mut next: Vec<TaskEntry> = Vec::with_capacity(found.len());
        let eligible = admission::eligible(&found, own_pid, &cfg.migration.exclude_comm);
        let candidates = eligible.len();
        io_tasks.store(Arc::new(
            eligible
                .iter()
                .map(|i| (i.task.tid, i.task.last_cpu as usize))
                .collect(),
        ));
        let now = monotonic_ns();
        // The host agent favours vCPUs for our I/O (issue 12): chasing running vCPUs
        // would undo its help, so the I/O-bound tasks are anchored on the held vCPUs
        // instead (below) and nothing else moves them.
        let held = channel.held_vcpus(now);
        let host_holds = !held.is_empty();
        if host_holds != host_held {
            host_held = host_holds;
            shared.metrics.host_holds.set(i64::from(host_holds));
            if host_holds {
                info!(?held, "the host agent favours these vCPUs for our I/O: I/O-bound tasks anchored there, no other moves");
            } else {
                info!("the host agent no longer favours vCPUs: moves as the guard and the contention gate allow");
            }
        }
        let moves_allowed = !host_holds
            && match guard.as_mut() {
                Some(g) => {
                    if let Some(v) =
                        g.observe(now, progress, candidates > 0 && contended && !host_holds)
                    {
                        shared.metrics.record_guard_verdict(v.pays);
                        info!(
                        pays = v.pays,
                        with_moves = format!("{:.0}/s", v.with_moves),
                        without_moves = format!("{:.0}/s", v.without_moves),
                        for_s = v.for_ns / 1_000_000_000,
                        "move guard: block requests completed per second with and without moves {}",
                        if v.pays {
                            "— moves pay, keeping them"
                        } else {
                            "— moves do not pay, holding tasks on their own masks"
                        }
                    );
                    }
                    contended && g.moves_allowed()
                }
                // Guard off: always; dry run with the guard on: where it would move.
                None => contended,
            };
        shared.metrics.moves_allowed.set(i64::from(moves_allowed));
        if moves_allowed {
            let mut placement = lock_placement(&shared.placement);
            let placement = &mut *placement;
            let ex = admission::Exclusions {
                own_pid,
                comm: &cfg.migration.exclude_comm,
                hands_off: &placement.hands_off,
            };
            for verdict in admission::admit(&found, &current, ex) {
                let (info, allowed, priority) = match verdict {
                    Admission::Keep { managed, now } => {
                        (now, managed.allowed.clone(), managed.priority)
                    }
                    Admission::New(info) => {
                        let t = &info.task;
                        let allowed = match placement.executor.as_mut() {
                            Some(ex) => match ex.manage(t.tid, t.tgid, info.start_time) {
                                Ok(a) => a,
                                Err(e) => {
                                    debug!(tid = t.tid, "not managing: {e:#}");
                                    continue;
                                }
                            },
                            None => all_cpus.clone(),
                        };
                        let priority = cfg.priority_of(&info.comm, t.tgid, &read_cgroup(t.tgid));
                        info!(
                            tid = t.tid,
                            pid = t.tgid,
                            comm = %info.comm,
                            io_fraction = format!("{:.2}", t.io_fraction),
                            load = format!("{:.2}", t.load),
                            priority,
                            "task is I/O-bound: managing it"
                        );
                        (info, allowed, priority)
                    }
                };
                let t = &info.task;
                next.push(TaskEntry {
                    tid: t.tid,
                    tgid: t.tgid,
                    start_time: info.start_time,
                    comm: info.comm.clone(),
                    load: t.load,
                    priority,
                    last_cpu: t.last_cpu as usize,
                    allowed,
                });
            }
        }
        let anchored_now: Vec<(u32, String)> = if host_holds {
            let mut placement = lock_placement(&shared.placement);
            let tasks: Vec<(u32, u32, u64, usize)> = eligible
                .iter()
                .map(|i| {
                    (
                        i.task.tid,
                        i.task.tgid,
                        i.start_time,
                        i.task.last_cpu as usize,
                    )
                })
                .collect();
            let on_held = migrater::hook::anchor_on_held(
                shared,
                &mut placement,
                &tasks,
                &held,
                cfg.migration.anchor.into(),
            );
            eligible
                .iter()
                .filter(|i| on_held.contains(&i.task.tid))
                .map(|i| (i.task.tid, i.comm.clone()))
                .collect()
        } else {
            Vec::new()
        };
        {
            let mut placement = lock_placement(&shared.placement);
            let kept = |tid: u32| {
                next.iter().any(|n| n.tid == tid) || anchored_now.iter().any(|a| a.0 == tid)
            };
            // Tasks anchored before and neither anchored nor managed now: the host stopped
            // holding, or they are no longer I/O-bound.
            let unanchored: Vec<(u32, String)> = anchored
                .iter()
                .filter(|(tid, _)| !kept(*tid) && !current.iter().any(|e| e.tid == *tid))
                .cloned()
                .collect();
            let leaving = admission::leaving(&current, &next)
                .into_iter()
                .filter(|e| !kept(e.tid))
                .map(|e| (e.tid, e.comm.clone()));
            for (tid, comm) in leaving.chain(unanchored) {
                placement.simulated.remove(&tid);
                if let Some(ex) = placement.executor.as_mut() {
                    let outcome = ex.release(tid);
                    shared.metrics.releases.inc();
                    info!(
                        tid,
                        comm = %comm,
                        result = migrater::metrics::outcome_label(&outcome),
                        "{}: original affinity restored",
                        if moves_allowed { "task no longer I/O-bound" } else { "moves on hold" }
                    );
                }
            }
            shared
                .metrics
                .managed_tasks
                .set(placement.executor.as_ref().map_or(0, |e| e.managed_count()) as i64);
        }
        let active = !next.is_empty();
        // On hold the I/O-bound tasks still exist; they are only left alone.
        let io_bound = if moves_allowed {
            next.len()
        } else {
            candidates
        };
        shared.metrics.io_bound_tasks.set(io_bound as i64);
        shared.tasks.store(Arc::new(next));
        anchored = anchored_now;
        board.set_demand(if active { Demand::Active } else { Demand::Idle });
        // On hold nothing is decided per window: the guard needs only an epoch's count.
        let nap = if detector.tracking() && (active || io_seen) && moves_allowed {
            window
        } else if !detector.tracking()
            && (!contended || guard.as_ref().is_none_or(|g| !g.probing()))
        {
            // Paused with nothing to measure (a guard probe needs contention too): wake
            // for the next sample or contention check only; the guard's 200 ms epochs
            // had woken this thread ~5 times a second in sweep1 for nothing.
            nap_limit
        } else {
            idle
        };
        stop.nap(nap.min(nap_limit));
    }
}
