//! The decision point: runs on the monitor thread of the vCPU whose state just changed
//! (vMigrater: act where the information is fresh). Owns the placement state behind a
//! mutex that the hot path only ever `try_lock`s, so a SCHED_FIFO sleeper never waits on
//! a normal thread. It must never do file I/O or allocate much per tick, and never touch a
//! task that the detector has not handed over (journaled) first.

use arc_swap::ArcSwap;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use tracing::debug;
use vcpu_monitor::{TickEvent, TickHook, VcpuBoard, VcpuSnapshot};

use crate::affinity::{AffinityExecutor, Outcome, TaskId};
use crate::anchor::{self, Placed};
use crate::planner::{Move, Planner, Reason, TaskView, Trigger, VcpuView};

/// An I/O-bound task the daemon is allowed to move (already journaled unless dry-run).
#[derive(Clone, Debug, PartialEq)]
pub struct TaskEntry {
    pub tid: u32,
    pub tgid: u32,
    pub start_time: u64,
    pub comm: String,
    pub load: f64,
    pub priority: i32,
    pub last_cpu: usize,
    pub allowed: Vec<usize>,
}

impl TaskEntry {
    pub fn id(&self) -> TaskId {
        TaskId {
            tid: self.tid,
            start_time: self.start_time,
        }
    }
}

impl FoundTask {
    pub fn id(&self) -> TaskId {
        TaskId {
            tid: self.tid,
            start_time: self.start_time,
        }
    }
}

/// An I/O-bound task the detector found, whether or not it may be moved: what anchoring
/// and the host's per-vCPU figures need of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FoundTask {
    pub tid: u32,
    pub tgid: u32,
    /// Tells a reused tid apart.
    pub start_time: u64,
    /// The CPU it last ran on.
    pub last_cpu: usize,
}

/// Where every move attempt is counted: the daemon's metrics. The hot path calls it with
/// the placement held, so it must only bump counters.
pub trait MoveLog: Send + Sync {
    /// A move was attempted through the executor.
    fn attempted(&self, reason: Reason, outcome: &Outcome);
    /// A move was decided in dry-run (nothing changed).
    fn dry_run(&self, reason: Reason);
}

/// Recent migration latencies, for the status percentiles.
pub struct LatencyRing {
    buf: VecDeque<u64>,
    cap: usize,
    pub total: u64,
}

impl LatencyRing {
    pub fn new(cap: usize) -> Self {
        LatencyRing {
            buf: VecDeque::with_capacity(cap),
            cap,
            total: 0,
        }
    }
    pub fn push(&mut self, ns: u64) {
        if self.buf.len() == self.cap {
            self.buf.pop_front();
        }
        self.buf.push_back(ns);
        self.total += 1;
    }
    pub fn values(&self) -> Vec<u64> {
        self.buf.iter().copied().collect()
    }
}

/// Where tasks are, and the executor that changes it.
pub struct Placement {
    /// `None` in dry-run: then `simulated` plays the executor's role for the planner.
    pub executor: Option<AffinityExecutor>,
    pub simulated: HashMap<u32, usize>,
    pub latencies: LatencyRing,
    /// Tasks whose mask someone else changed: never managed again.
    pub hands_off: HashSet<TaskId>,
}

/// The placement for a thread that must get it. A panic elsewhere while it was held
/// (a poisoned lock) must not stop migrations or, at exit, the restoring of every mask:
/// each executor call leaves the journal and the kernel consistent on its own.
pub fn lock_placement(m: &Mutex<Placement>) -> MutexGuard<'_, Placement> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The placement unless another thread holds it right now (poison as in `lock_placement`).
pub fn try_lock_placement(m: &Mutex<Placement>) -> Option<MutexGuard<'_, Placement>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

impl Placement {
    pub fn placed_on(&self, tid: u32) -> Option<usize> {
        match &self.executor {
            Some(ex) => ex.placed_on(tid),
            None => self.simulated.get(&tid).copied(),
        }
    }
}

/// State shared by the monitor threads (hook), the detector loop and the control plane.
pub struct Shared {
    pub tasks: ArcSwap<Vec<TaskEntry>>,
    pub placement: Mutex<Placement>,
    pub moves: Arc<dyn MoveLog>,
    pub migrations: AtomicU64,
}

pub struct MigrationHook {
    shared: Arc<Shared>,
    planner: Planner,
    push_threshold_ns: u64,
    /// Per vCPU slot: when its thread last planned, so a running vCPU re-plans at most
    /// every `replan_ns` unless its slice is ending.
    last_plan_ns: Vec<AtomicU64>,
    cpu_slot: HashMap<usize, usize>,
    replan_ns: u64,
}

impl MigrationHook {
    pub fn new(
        shared: Arc<Shared>,
        planner: Planner,
        push_threshold_ns: u64,
        cpus: &[usize],
    ) -> Self {
        MigrationHook {
            shared,
            planner,
            push_threshold_ns,
            last_plan_ns: cpus.iter().map(|_| AtomicU64::new(0)).collect(),
            cpu_slot: cpus.iter().enumerate().map(|(i, &c)| (c, i)).collect(),
            replan_ns: 1_000_000,
        }
    }

    fn due(&self, cpu: usize, me: Option<&VcpuSnapshot>, now_ns: u64) -> bool {
        let Some(&slot) = self.cpu_slot.get(&cpu) else {
            return false;
        };
        let last = self.last_plan_ns[slot].load(Ordering::Relaxed);
        let ending = me.is_some_and(|s| s.remaining_ns < self.push_threshold_ns);
        ending || now_ns.saturating_sub(last) >= self.replan_ns
    }
}

pub fn vcpu_view(s: &VcpuSnapshot) -> VcpuView {
    VcpuView {
        cpu: s.cpu,
        active: s.active,
        remaining_ns: s.remaining_ns,
        inactive_for_ns: s.inactive_for_ns,
        est_slice_ns: s.est_slice_ns,
        back_in_ns: s.back_in_ns(),
        last_inactive_ns: s.last_inactive_ns,
    }
}

impl TickHook for MigrationHook {
    fn holds_tasks(&self, cpu: usize) -> bool {
        let tasks = self.shared.tasks.load();
        if tasks.is_empty() {
            return false;
        }
        // Busy lock: another thread is placing tasks; assume they may be here.
        let Some(placement) = try_lock_placement(&self.shared.placement) else {
            return true;
        };
        tasks
            .iter()
            .any(|t| placement.placed_on(t.tid).unwrap_or(t.last_cpu) == cpu)
    }

    fn on_tick(&self, cpu: usize, event: TickEvent, board: &VcpuBoard, now_ns: u64) {
        let tasks = self.shared.tasks.load();
        if tasks.is_empty() {
            return;
        }
        let snapshot = board.snapshot(now_ns);
        let trigger = match event {
            TickEvent::Resumed { .. } => Trigger::Resumed { cpu },
            TickEvent::Running => {
                if !self.due(cpu, snapshot.iter().find(|s| s.cpu == cpu), now_ns) {
                    return;
                }
                Trigger::Tick { cpu }
            }
        };
        // Another vCPU's thread is planning right now with the same information.
        let Some(mut placement) = try_lock_placement(&self.shared.placement) else {
            return;
        };
        if let Some(&slot) = self.cpu_slot.get(&cpu) {
            self.last_plan_ns[slot].store(now_ns, Ordering::Relaxed);
        }
        let vcpus: Vec<VcpuView> = snapshot.iter().map(vcpu_view).collect();
        let views: Vec<TaskView> = tasks
            .iter()
            .map(|t| TaskView {
                tid: t.tid,
                load: t.load,
                priority: t.priority,
                placed_on: placement.placed_on(t.tid),
                last_cpu: t.last_cpu,
                allowed: t.allowed.clone(),
            })
            .collect();
        let moves = self.planner.plan(trigger, &vcpus, &views);
        for mv in moves {
            let start_time = tasks.iter().find(|t| t.tid == mv.tid).map(|t| t.start_time);
            apply(&self.shared, &mut placement, start_time, mv);
        }
    }
}

/// While the host agent favours the `held` vCPUs: `tasks` gathered on them
/// (`anchor::moves`; taken over through the executor like any move, so journaled and
/// restored the same way). Returns the tids that sit on a held vCPU now.
pub fn anchor_on_held(
    shared: &Shared,
    placement: &mut Placement,
    tasks: &[FoundTask],
    held: &[usize],
    reason: Reason,
) -> Vec<u32> {
    let own: Vec<FoundTask> = tasks
        .iter()
        .copied()
        .filter(|t| !placement.hands_off.contains(&t.id()))
        .collect();
    let now: Vec<Placed> = own
        .iter()
        .map(|t| Placed {
            tid: t.tid,
            pinned: placement.placed_on(t.tid),
        })
        .collect();
    for a in anchor::moves(&now, held) {
        let Some(t) = own.iter().find(|t| t.tid == a.tid) else {
            continue;
        };
        if let Some(ex) = placement.executor.as_mut() {
            if !ex.is_managed(t.tid) {
                if let Err(e) = ex.manage(t.id(), t.tgid) {
                    debug!(tid = t.tid, "not anchoring: {e:#}");
                    continue;
                }
            }
        }
        let from = placement.placed_on(t.tid);
        let mv = Move {
            tid: t.tid,
            from,
            to: a.cpu,
            reason,
        };
        apply(shared, placement, Some(t.start_time), mv);
    }
    own.iter()
        .map(|t| t.tid)
        .filter(|&tid| placement.placed_on(tid).is_some_and(|c| held.contains(&c)))
        .collect()
}

fn apply(shared: &Shared, placement: &mut Placement, start_time: Option<u64>, mv: Move) {
    let Move {
        tid,
        from,
        to,
        reason,
    } = mv;
    let Some(executor) = placement.executor.as_mut() else {
        debug!(
            tid,
            ?from,
            to,
            reason = reason.as_str(),
            "dry-run: would migrate"
        );
        placement.simulated.insert(tid, to);
        shared.moves.dry_run(reason);
        return;
    };
    let outcome = executor.move_to(tid, to);
    shared.moves.attempted(reason, &outcome);
    match outcome {
        Outcome::Moved { latency_ns } => {
            placement.latencies.push(latency_ns);
            shared.migrations.fetch_add(1, Ordering::Relaxed);
            debug!(
                tid,
                ?from,
                to,
                reason = reason.as_str(),
                latency_ns,
                "migrated"
            );
        }
        Outcome::External => {
            if let Some(start_time) = start_time {
                placement.hands_off.insert(TaskId { tid, start_time });
            }
            debug!(tid, "mask changed by someone else: no longer managed");
        }
        _ => {
            debug!(
                tid,
                to,
                reason = reason.as_str(),
                result = outcome.as_str(),
                "migration not done"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_placement_still_serves() {
        let m = Arc::new(Mutex::new(Placement {
            executor: None,
            simulated: HashMap::new(),
            latencies: LatencyRing::new(4),
            hands_off: HashSet::new(),
        }));
        let m2 = Arc::clone(&m);
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("a sleeper panics holding the placement");
        })
        .join();
        assert!(m.is_poisoned());
        lock_placement(&m).simulated.insert(7, 1);
        assert_eq!(try_lock_placement(&m).unwrap().placed_on(7), Some(1));
        let _held = lock_placement(&m);
        assert!(try_lock_placement(&m).is_none(), "held means busy");
    }
}
