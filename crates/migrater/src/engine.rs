//! The detector loop's policy as one step: observe (the vCPU board, the disk's completion
//! count, the host's hints, the clock) → decide (contention gate, block tracking, move
//! guard, admission, anchoring, release) → act (through `Actuator`: the block programs and
//! the placement) → publish (an `EngineSnapshot` for status and metrics) → say how long to
//! nap. It owns the loop's state and nothing else: threads, sleeping, signals, BPF and
//! `/proc` stay with the caller, so that every rule is driven by plain values in tests. It
//! must never move a task itself: the monitor threads' hook moves the tasks the engine
//! publishes; the engine only takes tasks over, anchors them while the host holds vCPUs,
//! and hands them back.
//!
//! The window of the block programs is read through the actuator, not passed in: the step
//! first decides whether they track (pause, resume, detach) and reads what they saw after.

mod beside;
mod decision;
mod tasks;
mod tracking;

use os_layer::Mono;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use task_detector::{CpuIoSample, ForkSample, IoTaskInfo, Partner};
use vcpu_monitor::{Demand, VcpuSnapshot};

use crate::affinity::{Outcome, TaskId};
use crate::completion::{CompletionHomes, Home, HomeConfig};
use crate::guard::{Contention, GuardConfig, MoveGuard};
use crate::hook::{FoundTask, TaskEntry};
use crate::planner::Reason;
use crate::sampling::{CompletionEstimate, Schedule};
use decision::UndoInherited;

/// How often the contention gate judges the vCPUs' out time.
pub const CONTENTION_WINDOW: Duration = Duration::from_secs(2);
/// How long before a hold ends block tracking resumes: two contention checks (the loop
/// looks every window while paused) and a sample, so the probe finds the I/O-bound tasks.
pub const HOLD_LEAD: Duration = Duration::from_secs(5);

/// How long a task kept with its completions stays kept after the classifier last found
/// it I/O-bound: a sampling period and some. Pinned to a vCPU that is taken away, a task
/// shows neither I/O nor CPU of its own for a while (or, where the kernel charges the lost
/// time to whatever ran, CPU it never used), and one such sample must not send it back to
/// a vCPU whose requests complete elsewhere. A task that really stopped is handed back
/// this much later; one whose mask someone else changed, at once.
pub const KEEP_GRACE: Duration = Duration::from_secs(3);
/// A partner stays beside its kept task this long after a sample last saw them wake each
/// other: longer than the sampling period, so that one sample without it does not undo it.
pub const PARTNER_GRACE: Duration = Duration::from_secs(6);

/// The settings of the loop, fixed for a run.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The detector's window: the nap while tasks are moved.
    pub window: Duration,
    /// The nap while nothing is decided per window.
    pub idle: Duration,
    /// Our own process: never a task to move.
    pub own_pid: u32,
    /// Commands the user excluded from management.
    pub exclude_comm: Vec<String>,
    /// Sampled tracking; `None` tracks all the time (while anything can gain).
    pub schedule: Option<Schedule>,
    /// With nothing to gain this long (at once while nothing could gain since start), the
    /// block programs come off their tracepoints.
    pub detach_after: Option<Duration>,
    /// Where nothing is descheduled there is nothing to gain: no probe and no move there.
    /// Only where the monitor's out times measure contention (and the guard is on).
    pub gate_on_contention: bool,
    /// The move guard; `None` moves whenever the gate allows (guard off, or dry run).
    pub guard: Option<GuardConfig>,
    /// Where tasks' completions land before their own say (`completion::prior`).
    pub completion_prior: Home,
    /// Whether tasks whose completions land on one fixed vCPU are kept there (else every
    /// managed task is the planner's).
    pub follow_completions: bool,
    /// Whether the threads a kept task wakes and is woken by are kept beside it
    /// (`engine::beside`).
    pub keep_partners: bool,
    /// Whether the daemon moves tasks on its own judgement; without, only onto the vCPUs
    /// the host agent holds (`migration.follow_host`).
    pub own_moves: bool,
}

/// What the host agent says, as the channel last heard it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostHints {
    /// vCPUs the host keeps running for our I/O now.
    pub held: Vec<usize>,
    /// Whether a host agent answers at all (it wants per-vCPU I/O figures).
    pub agent_answers: bool,
}

/// What the step observes, read by the caller just before it.
#[derive(Clone, Debug)]
pub struct Observation {
    /// The monotonic clock.
    pub now: Mono,
    /// The monitor's board.
    pub vcpus: Vec<VcpuSnapshot>,
    /// The kernel's count of completed block requests; only needed where
    /// `Engine::reads_disk` says so (`None` elsewhere, or where it cannot be read).
    pub disk_completed: Option<u64>,
    /// Each vCPU's steal time as the host reports it, `(cpu, ns)` cumulative; empty where
    /// it is not read. It may lag the board by a read period.
    pub steal_ns: Vec<(usize, u64)>,
    pub host: HostHints,
}

/// The block programs of the detector (`task_detector::Detector`, or a test's fake).
pub use task_detector::BlockTracking;

/// The placement: the affinity executor (journaled) and the set the monitor threads move.
pub trait TaskPlacement {
    /// Tasks whose mask someone else changed after us.
    fn hands_off(&self) -> HashSet<TaskId>;
    /// Takes a task over (journals its mask); returns the CPUs it may run on. `tgid` finds
    /// it under `/proc`; the id tells it from a task that reuses its tid.
    fn manage(&mut self, task: TaskId, tgid: u32) -> anyhow::Result<Vec<usize>>;
    /// The user's priority for a task.
    fn priority_of(&self, task: &IoTaskInfo) -> i32;
    /// Gathers `tasks` on the `on` vCPUs (for `reason`: a host hold, or where their
    /// completions land); returns the tids that sit on one now.
    fn anchor(&mut self, tasks: &[FoundTask], on: &[usize], reason: Reason) -> Vec<u32>;
    /// Gives the tasks kept with their completions a short scheduler slice, and every other
    /// managed task its own slice back (`AffinityExecutor::set_short_slices`).
    fn keep_short_slices(&mut self, kept: &[u32]);
    /// Hands a task back its original mask (and slice); `None` where nothing was changed
    /// (dry run).
    fn release(&mut self, tid: u32) -> Option<Outcome>;
    /// Hands every task back; `None` in dry run.
    fn release_all(&mut self) -> Option<usize>;
    /// Sets back the children that inherited a pin of ours (`AffinityExecutor::undo_inherited`);
    /// returns how many.
    fn undo_inherited(&mut self, forks: &[ForkSample]) -> usize;
    /// Lets go of the managed tasks whose mask someone else changed since our last set
    /// (`AffinityExecutor::hand_off_changed`); returns how many.
    fn hand_off_changed(&mut self) -> usize;
    /// The tasks the monitor threads may move from now on.
    fn publish_tasks(&mut self, tasks: Arc<Vec<TaskEntry>>);
    /// Whether the monitor must track slices precisely.
    fn set_demand(&mut self, demand: Demand);
}

/// Everything the step acts through: the block programs and the placement, each reached
/// as itself (a test's fake may be both).
pub trait Actuator {
    type Blocks: BlockTracking;
    type Placement: TaskPlacement;
    fn blocks(&mut self) -> &mut Self::Blocks;
    fn placement(&mut self) -> &mut Self::Placement;
}

/// Probes of the move guard concluded, by verdict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuardVerdicts {
    pub pays: u64,
    pub holds: u64,
}

/// The engine's state after a step, for status and metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineSnapshot {
    /// False while the guard or a host hold keeps tasks on their own masks, or nothing
    /// is contended.
    pub moves_allowed: bool,
    pub host_holds: bool,
    pub block_tracking: bool,
    pub block_attached: bool,
    pub guard_verdicts: GuardVerdicts,
    /// The move guard's probe epochs without moves, in total (ms).
    pub guard_without_moves_ms: u64,
    pub demand: Demand,
    /// The I/O-bound tasks: managed ones while moves are allowed, every candidate on hold.
    pub io_bound_tasks: usize,
    /// Every I/O-bound task found, managed or not (the host's per-vCPU figures).
    pub found: Vec<FoundTask>,
    /// The partners of `found` seen within `PARTNER_GRACE` (a database's client): the host
    /// must not make their vCPUs pay for a favour to the I/O's.
    pub partners: Vec<Partner>,
    /// What the detector's last window found I/O-bound, excluded tasks included, with
    /// whether the user excluded each (`vmigrater explain`).
    pub seen: Vec<SeenTask>,
    /// The first rule that kept the planner from moving tasks in the last step.
    pub gate: MoveGate,
    /// vCPUs were out all at once lately: only tasks kept with their completions stay
    /// managed.
    pub out_together: bool,
    /// Per-vCPU completions (estimated between samples).
    pub cpu_io: Vec<CpuIoSample>,
    /// Tasks handed back, cumulative.
    pub releases: u64,
    /// Failed operations of the block programs, cumulative.
    pub detector_errors: u64,
    /// Tasks kept on the vCPU that takes their completions.
    pub kept_with_completions: Vec<KeptTask>,
    /// Samples started before their period, cumulative: by the doorbell, or as a
    /// follow-up of a sample that placed tasks.
    pub early_samples: u64,
    /// Threads that inherited a pin from a task we pinned, set back, cumulative.
    pub inherited_pins_undone: u64,
}

/// A thread the detector found I/O-bound.
#[derive(Clone, Debug, PartialEq)]
pub struct SeenTask {
    pub info: IoTaskInfo,
    /// Its command is in `exclude_comm` (or it is one of the daemon's own threads).
    pub excluded: bool,
}

/// Why the planner may not move tasks: the first rule that stops it, in the order the
/// step applies them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum MoveGate {
    /// Moves are allowed.
    #[default]
    Open,
    /// The host agent favours the vCPUs that hold the tasks: they stay there.
    HostHolds,
    /// The daemon moves tasks only where the host agent holds vCPUs, and it holds none.
    FollowsHost,
    /// No vCPU was out while another ran, often enough for a move to pay (the contention
    /// gate), and vCPUs were not out all at once either.
    NotContended,
    /// The move guard found that moves did not pay: none for `for_s` more seconds.
    GuardHolding { for_s: f64 },
    /// The move guard is measuring, and this epoch runs without moves.
    GuardProbing,
}

/// A task pinned to the vCPU that takes its requests' completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeptTask {
    pub tid: u32,
    pub tgid: u32,
    pub cpu: usize,
}

impl Default for EngineSnapshot {
    /// Before the first step: moves allowed and the programs tracking, as they start.
    fn default() -> Self {
        EngineSnapshot {
            moves_allowed: true,
            host_holds: false,
            block_tracking: true,
            block_attached: true,
            guard_verdicts: GuardVerdicts::default(),
            guard_without_moves_ms: 0,
            demand: Demand::Idle,
            io_bound_tasks: 0,
            found: Vec::new(),
            partners: Vec::new(),
            seen: Vec::new(),
            gate: MoveGate::Open,
            out_together: false,
            cpu_io: Vec::new(),
            releases: 0,
            detector_errors: 0,
            early_samples: 0,
            inherited_pins_undone: 0,
            kept_with_completions: Vec::new(),
        }
    }
}

/// A task the engine pinned itself, to hand back when that ends.
#[derive(Clone, Debug, PartialEq)]
struct Anchored {
    tid: u32,
    comm: String,
}

pub struct Engine {
    cfg: EngineConfig,
    /// Whether anything can gain, and so whether the block programs track (`tracking.rs`).
    tracking: Tracking,
    /// What the block programs saw.
    window: Window,
    guard: Option<MoveGuard>,
    /// The tasks managed, kept and anchored (`tasks.rs`).
    tasks: Tasks,
    snap: EngineSnapshot,
}

/// The contention gate and the block programs' tracking and sampling.
struct Tracking {
    contention: Contention,
    contended: bool,
    wanted_tracking: bool,
    /// Whether tracking was wanted at any time since start.
    ever_wanted: bool,
    /// Since when nothing could gain (`None` while something could).
    quiet_since: Option<Mono>,
    sample_start: Mono,
    /// Follow-up samples (see `sampling::FOLLOW_UPS`): whether this sample placed a
    /// task or set back an inherited pin, the next one's time, and how many in a row.
    placed_in_sample: bool,
    follow_up_at: Option<Mono>,
    follow_ups: u32,
}

/// What the block programs' last window said.
struct Window {
    /// The I/O-bound tasks found; they stand between samples.
    found: Vec<IoTaskInfo>,
    /// Whether `found` came from this step's poll (not one that stands from before).
    fresh: bool,
    /// The threads this step's poll saw started, to set back where they inherited a pin
    /// of ours.
    undo: UndoInherited,
    last_completions: u64,
    estimate: CompletionEstimate,
    sampled_cpus: Vec<CpuIoSample>,
}

/// The tasks the engine answers for.
struct Tasks {
    host_held: bool,
    /// The managed tasks (the monitor threads move those not kept with their
    /// completions).
    current: Arc<Vec<TaskEntry>>,
    /// Tasks pinned by the engine itself (kept with their completions, beside them, or on
    /// held vCPUs), to hand back when that ends.
    anchored: Vec<Anchored>,
    /// Where each I/O-bound task's completions land.
    homes: CompletionHomes,
    /// Tasks kept with their completions: when the classifier last found each.
    kept_found: HashMap<TaskId, Mono>,
    /// Managed tasks said once not to be keepable with their completions.
    unkept: HashSet<TaskId>,
    /// Partners of I/O-bound tasks, with when a sample last saw each.
    partners: HashMap<TaskId, (Partner, Mono)>,
}

impl Engine {
    pub fn new(cfg: EngineConfig, now: Mono) -> Self {
        Engine {
            tracking: Tracking {
                contention: Contention::new(
                    CONTENTION_WINDOW,
                    Contention::DEFAULT_MIN_FRACTION,
                    Contention::DEFAULT_MIN_COVERED,
                ),
                contended: false,
                wanted_tracking: true,
                ever_wanted: false,
                quiet_since: None,
                sample_start: now,
                placed_in_sample: false,
                follow_up_at: None,
                follow_ups: 0,
            },
            window: Window {
                found: Vec::new(),
                fresh: false,
                undo: UndoInherited::default(),
                last_completions: 0,
                estimate: CompletionEstimate::default(),
                sampled_cpus: Vec::new(),
            },
            guard: cfg.guard.clone().map(MoveGuard::new),
            tasks: Tasks {
                host_held: false,
                current: Arc::new(Vec::new()),
                anchored: Vec::new(),
                homes: CompletionHomes::new(HomeConfig::default(), cfg.completion_prior),
                kept_found: HashMap::new(),
                unkept: HashSet::new(),
                partners: HashMap::new(),
            },
            snap: EngineSnapshot::default(),
            cfg,
        }
    }

    /// Commands never migrated, changed in a running daemon (a configuration reload): a
    /// managed task whose command is newly excluded is released by the next step.
    pub fn set_exclude_comm(&mut self, comm: Vec<String>) {
        self.cfg.exclude_comm = comm;
    }

    /// Whether the step needs `Observation::disk_completed`: the guard judges progress
    /// by it, and sampled tracking estimates per-vCPU completions from it.
    pub fn reads_disk(&self) -> bool {
        self.guard.is_some() || self.cfg.schedule.is_some()
    }

    pub fn snapshot(&self) -> &EngineSnapshot {
        &self.snap
    }

    /// One round of the loop; returns how long to nap before the next.
    pub fn step(&mut self, obs: Observation, act: &mut impl Actuator) -> Duration {
        let now = obs.now;
        self.judge_contention(now, &obs.vcpus, &obs.steal_ns);
        let (wants_tracking, mut nap_limit) =
            self.steer_tracking(now, obs.host.agent_answers, act.blocks());
        if !wants_tracking {
            // Paused for want of contention: look again a window later.
            nap_limit = nap_limit.min(CONTENTION_WINDOW);
        }
        self.snap.block_tracking = act.blocks().tracking();
        self.snap.block_attached = act.blocks().attached();
        let disk = obs.disk_completed.filter(|_| self.reads_disk());
        let Some(io_seen) = self.read_window(now, &obs.vcpus, disk, act) else {
            return self.cfg.idle;
        };
        self.undo_inherited(act.placement());
        let handed_off = act.placement().hand_off_changed();
        if handed_off > 0 {
            tracing::info!(
                handed_off,
                "a task's CPU mask was changed by someone else: no longer managed"
            );
        }
        // The kernel's own count of completed requests: what the guard judges progress
        // by (it moves whether or not our programs are attached).
        let progress = disk.unwrap_or(self.window.last_completions);
        let decided = self.decide_tasks(now, progress, &obs.host.held, act);
        let facts = NapFacts {
            tracking: act.blocks().tracking(),
            managing: decided.active,
            io_seen,
            moves_allowed: decided.moves_allowed,
            contended: self.tracking.contended || self.out_together(),
            probing: self.guard.as_ref().is_some_and(|g| g.probing()),
        };
        nap(&facts, self.cfg.window, self.cfg.idle, nap_limit)
    }

    /// Sets back the threads that inherited a pin of ours, as the last poll said: before
    /// the tasks are decided on (`decision::UndoInherited`).
    fn undo_inherited(&mut self, act: &mut impl TaskPlacement) {
        let undo = std::mem::take(&mut self.window.undo);
        let undone = decision::undo_inherited(&undo, act);
        if undone > 0 {
            tracing::info!(
                undone,
                "threads started by pinned tasks had inherited the pin: set back to their parents' own masks"
            );
            self.snap.inherited_pins_undone += undone as u64;
            self.tracking.placed_in_sample = true;
        }
    }

    /// Polls the block programs while they track, else carries the per-vCPU estimate
    /// forward; returns whether new completions were seen, `None` when the poll failed.
    fn read_window(
        &mut self,
        now: Mono,
        vcpus: &[VcpuSnapshot],
        disk: Option<u64>,
        act: &mut impl Actuator,
    ) -> Option<bool> {
        if act.blocks().tracking() {
            let out_ns: Vec<(usize, u64)> =
                vcpus.iter().map(|v| (v.cpu, v.inactive_total_ns)).collect();
            let out = match act.blocks().poll(&out_ns) {
                Ok(out) => out,
                Err(e) => {
                    self.snap.detector_errors += 1;
                    tracing::warn!("polling the BPF maps failed: {e:#}");
                    return None;
                }
            };
            let completions: u64 = out.cpus.iter().map(|c| c.completions).sum();
            let io_seen = completions != self.window.last_completions;
            self.window.last_completions = completions;
            self.snap.cpu_io = match (self.cfg.schedule, disk) {
                (Some(_), Some(d)) => self.window.estimate.update(&out.cpus, d),
                _ => out.cpus.clone(),
            };
            self.window.sampled_cpus = out.cpus;
            self.window.undo = UndoInherited {
                forks: Some(out.forks),
            };
            self.window.found = out.tasks;
            for p in out.partners {
                let id = TaskId {
                    tid: p.tid,
                    start_time: p.start_time,
                };
                self.tasks.partners.insert(id, (p, now));
            }
            self.window.fresh = true;
            Some(io_seen)
        } else {
            self.window.fresh = false;
            if let Some(d) = disk.filter(|_| act.blocks().attached()) {
                self.snap.cpu_io = self.window.estimate.update(&self.window.sampled_cpus, d);
            }
            Some(false)
        }
    }
}

/// What a step's nap depends on.
#[derive(Clone, Copy, Debug)]
struct NapFacts {
    /// The block programs track requests.
    tracking: bool,
    /// Tasks are managed (the planner moves some).
    managing: bool,
    /// The window saw block I/O.
    io_seen: bool,
    moves_allowed: bool,
    /// Moves (or keeps, with vCPUs out together) may pay.
    contended: bool,
    /// The move guard is probing (epochs with and without moves).
    probing: bool,
}

/// The nap rule: a window while tracking where tasks may move and there is I/O or a task
/// to manage (each window decides); the limit (the next sample or contention check) while
/// paused with nothing to measure, a guard probe needing contention too; the idle poll
/// otherwise (on hold the guard needs only an epoch's count). Never past the limit.
fn nap(f: &NapFacts, window: Duration, idle: Duration, limit: Duration) -> Duration {
    let nap = if f.tracking && (f.managing || f.io_seen) && f.moves_allowed {
        window
    } else if !f.tracking && (!f.contended || !f.probing) {
        limit
    } else {
        idle
    };
    nap.min(limit)
}

/// At shutdown: nothing more for the monitor threads to move, and every task back on its
/// original mask.
pub fn release_everything(act: &mut impl TaskPlacement) {
    act.publish_tasks(Arc::new(Vec::new()));
    if let Some(restored) = act.release_all() {
        tracing::info!(restored, "restored original affinity of every managed task");
    }
}

#[cfg(test)]
mod tests;
