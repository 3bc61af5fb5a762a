//! The detector's thread: observes (board, disk count, host hints, clock), runs the
//! engine's step and naps as it says, and publishes the engine's snapshot. Owns the real
//! actuator: the block programs (`Detector`) and the placement shared with the monitor
//! threads (`migrater::live::LivePlacement`, which reads the configuration in effect).
//! Decides nothing itself: every rule is the engine's.
//!
//! It opens the block programs itself: libbpf's objects stay on the thread that opened
//! them (the skeleton is not `Send`) and borrow storage on its stack, the way sched-ext/scx
//! keeps its own. Start-up takes two steps so that the attach mode is known before the
//! metrics are made: the thread says how loading went, then waits for the rest of the
//! daemon before it loops.

use anyhow::{anyhow, Context, Result};
use arc_swap::ArcSwap;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use task_detector::{
    AttachMode, ClassifierConfig, Detector, IoTracker, TrackerOptions, TrackerStorage,
};
use tracing::{info, warn};
use vcpu_monitor::{monotonic_ns, VcpuBoard};

use crate::channel::ChannelStats;
use crate::config::Config;
use migrater::engine::{Actuator, Engine, EngineConfig, EngineSnapshot, HostHints, Observation};
use migrater::hook::Shared;
use migrater::live::{LivePlacement, PlacementSettings};

impl PlacementSettings for Config {
    fn priority_of(&self, comm: &str, tgid: u32, cgroup: &str) -> i32 {
        Config::priority_of(self, comm, tgid, cgroup)
    }
    fn kept_slice_us(&self) -> u64 {
        self.advanced.migration.kept_slice_us
    }
}

/// The engine's actuator: the block programs and the placement.
struct Live<'a, 'obj> {
    detector: Detector<'obj>,
    placement: LivePlacement<'a, Config>,
}

impl<'a, 'obj> Actuator for Live<'a, 'obj> {
    type Blocks = Detector<'obj>;
    type Placement = LivePlacement<'a, Config>;
    fn blocks(&mut self) -> &mut Detector<'obj> {
        &mut self.detector
    }
    fn placement(&mut self) -> &mut LivePlacement<'a, Config> {
        &mut self.placement
    }
}

pub struct DetectorThread {
    handle: std::thread::JoinHandle<()>,
    go: mpsc::Sender<DetectStart>,
    pub mode: AttachMode,
}

/// What the detector thread gets once the rest of the daemon is wired.
pub struct DetectStart {
    pub shared: Arc<Shared>,
    pub board: Arc<VcpuBoard>,
    pub engine: EngineConfig,
    /// Where the engine's snapshot is published after every step.
    pub snapshot: Arc<ArcSwap<EngineSnapshot>>,
    pub stop: Arc<control::Stop>,
    /// The host's hints.
    pub channel: Arc<ChannelStats>,
    /// The configuration in effect; SIGHUP stores a new one (its live keys, see
    /// `reload`), which the loop takes up at its next step.
    pub cfg: Arc<ArcSwap<Config>>,
}

impl DetectorThread {
    /// `None` when the programs do not load. Without them nothing can be found or moved,
    /// but the vCPU monitor, status, metrics and channel still tell the operator what they
    /// see: a degraded run, said once, rather than a restart loop under systemd.
    pub fn spawn(opts: TrackerOptions, classifier: ClassifierConfig) -> Result<Option<Self>> {
        let (loaded_tx, loaded) = mpsc::channel::<Result<AttachMode>>();
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
                let _ = loaded_tx.send(Ok(tracker.mode()));
                // No start when the daemon failed to start after this: nothing to do.
                let Ok(s) = wait.recv() else { return };
                detect_loop(Detector::new(tracker, classifier), &s);
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
    pub fn start(self, s: DetectStart) -> std::thread::JoinHandle<()> {
        // A thread that has ended (a panic) shows at the join.
        let _ = self.go.send(s);
        self.handle
    }
}

/// The detector loop (a normal-priority OS thread): observe, step, publish, nap.
fn detect_loop(detector: Detector<'_>, s: &DetectStart) {
    let board = &*s.board;
    let all_cpus: Vec<usize> = board
        .snapshot(monotonic_ns())
        .iter()
        .map(|v| v.cpu)
        .collect();
    let mut live = Live {
        detector,
        placement: LivePlacement {
            shared: &s.shared,
            board,
            settings: s.cfg.load_full(),
            all_cpus,
        },
    };
    let mut engine = Engine::new(s.engine.clone(), os_layer::Mono::now());
    let mut diskstats = task_detector::diskstats::DiskStats::default();
    let mut steal = StealReader::default();
    while !s.stop.is_set() {
        let cfg = s.cfg.load_full();
        if !Arc::ptr_eq(&cfg, &live.placement.settings) {
            engine.set_exclude_comm(cfg.migration.exclude_comm.clone());
            live.placement.settings = cfg;
        }
        let now = monotonic_ns();
        let obs = Observation {
            now: os_layer::Mono::from_ns(now),
            vcpus: board.snapshot(now),
            disk_completed: if engine.reads_disk() {
                diskstats.requests_completed()
            } else {
                None
            },
            steal_ns: steal.read(now),
            host: HostHints {
                held: s.channel.held_vcpus(now),
                agent_answers: s.channel.replies.load(Ordering::Relaxed) > 0,
            },
        };
        let nap = engine.step(obs, &mut live);
        s.snapshot.store(Arc::new(engine.snapshot().clone()));
        s.stop.nap(nap);
    }
}

/// The host's steal time per vCPU, read from /proc/stat at most every `EVERY_NS`: the
/// contention gate judges 2 s windows, and a read per detector window would cost more
/// than it tells. A failed read is said once and leaves the gate to the monitor.
#[derive(Default)]
struct StealReader {
    last: Option<(u64, Vec<(usize, u64)>)>,
    failed: bool,
}

impl StealReader {
    const EVERY_NS: u64 = 250_000_000;

    fn read(&mut self, now: u64) -> Vec<(usize, u64)> {
        if self.failed {
            return Vec::new();
        }
        match &self.last {
            Some((at, steal)) if now.saturating_sub(*at) < Self::EVERY_NS => steal.clone(),
            _ => match os_layer::Root::real().steal_ns() {
                Ok(steal) => {
                    self.last = Some((now, steal.clone()));
                    steal
                }
                Err(e) => {
                    self.failed = true;
                    warn!("the host's steal time is not readable ({e}): vCPU deschedules are judged by the monitor alone");
                    Vec::new()
                }
            },
        }
    }
}
