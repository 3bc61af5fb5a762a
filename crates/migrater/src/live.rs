//! The placement the engine acts on in the daemon: the affinity executor (journaled) and
//! the tasks published for the monitor threads, shared with them (`hook::Shared`), and the
//! board's demand. The engine's tests fake `TaskPlacement`; this is the real one. What it
//! reads from the user's configuration comes through `PlacementSettings`, which the
//! daemon implements for its configuration.

use anyhow::Result;
use std::collections::HashSet;
use std::sync::Arc;
use task_detector::{ForkSample, IoTaskInfo};
use vcpu_monitor::{Demand, VcpuBoard};

use crate::affinity::Outcome;
use crate::affinity::TaskId;
use crate::engine::TaskPlacement;
use crate::hook::{anchor_on_held, lock_placement, FoundTask, Shared, TaskEntry};
use crate::planner::Reason;

/// What the placement reads from the user's configuration.
pub trait PlacementSettings {
    /// The priority of a task under the user's rules.
    fn priority_of(&self, comm: &str, tgid: u32, cgroup: &str) -> i32;
    /// The scheduler slice of a task kept with its completions, in µs; 0 gives every
    /// slice back.
    fn kept_slice_us(&self) -> u64;
}

/// The placement as the engine acts on it: the executor (journaled; `None` in dry run,
/// where `simulated` stands in), the tasks published for the monitor threads, the board's
/// demand.
pub struct LivePlacement<'a, S> {
    pub shared: &'a Shared,
    pub board: &'a VcpuBoard,
    /// The configuration in effect: a reload swaps it between steps.
    pub settings: Arc<S>,
    /// Every monitored CPU: what a task may run on in dry run.
    pub all_cpus: Vec<usize>,
}

impl<S: PlacementSettings> TaskPlacement for LivePlacement<'_, S> {
    fn hands_off(&self) -> HashSet<TaskId> {
        lock_placement(&self.shared.placement).hands_off.clone()
    }
    fn manage(&mut self, task: TaskId, tgid: u32) -> Result<Vec<usize>> {
        match lock_placement(&self.shared.placement).executor.as_mut() {
            Some(ex) => ex.manage(task, tgid),
            None => Ok(self.all_cpus.clone()),
        }
    }
    fn priority_of(&self, info: &IoTaskInfo) -> i32 {
        let tgid = info.task.tgid;
        let cgroup = std::fs::read_to_string(format!("/proc/{tgid}/cgroup")).unwrap_or_default();
        self.settings.priority_of(&info.comm, tgid, &cgroup)
    }
    fn anchor(&mut self, tasks: &[FoundTask], on: &[usize], reason: Reason) -> Vec<u32> {
        let mut placement = lock_placement(&self.shared.placement);
        anchor_on_held(self.shared, &mut placement, tasks, on, reason)
    }
    fn keep_short_slices(&mut self, kept: &[u32]) {
        let ns = self.settings.kept_slice_us() * 1_000;
        // Set to 0 by a reload: every slice given goes back.
        let kept = if ns == 0 { &[][..] } else { kept };
        let mut placement = lock_placement(&self.shared.placement);
        if let Some(ex) = placement.executor.as_mut() {
            ex.set_short_slices(kept, ns);
        }
    }
    fn release(&mut self, tid: u32) -> Option<Outcome> {
        let mut placement = lock_placement(&self.shared.placement);
        placement.simulated.remove(&tid);
        placement.executor.as_mut().map(|ex| ex.release(tid))
    }
    fn release_all(&mut self) -> Option<usize> {
        let mut placement = lock_placement(&self.shared.placement);
        placement.executor.as_mut().map(|ex| ex.release_all())
    }
    fn undo_inherited(&mut self, forks: &[ForkSample]) -> usize {
        if forks.is_empty() {
            return 0;
        }
        let mut placement = lock_placement(&self.shared.placement);
        placement
            .executor
            .as_mut()
            .map_or(0, |ex| ex.undo_inherited(forks))
    }
    fn hand_off_changed(&mut self) -> usize {
        let mut placement = lock_placement(&self.shared.placement);
        let Some(ex) = placement.executor.as_mut() else {
            return 0;
        };
        let changed = ex.hand_off_changed();
        let n = changed.len();
        placement.hands_off.extend(changed);
        n
    }
    fn publish_tasks(&mut self, tasks: Arc<Vec<TaskEntry>>) {
        self.shared.tasks.store(tasks);
    }
    fn set_demand(&mut self, demand: Demand) {
        self.board.set_demand(demand);
    }
}
