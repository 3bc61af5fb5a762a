//! The migration planner: decides which I/O-bound task should run on which vCPU
//! (vMigrater §2.4.3: PUSH, PULL and a weighted global balance).
//!
//! It owns only the policy. It is pure and deterministic: plain values in, a list of
//! moves out, no clock, no syscall, no hidden state between calls, so the same inputs
//! always give the same moves and every decision can be replayed from a trace. It runs on
//! the SCHED_FIFO monitor thread of the vCPU whose state just changed, so it must never
//! block, and it allocates only a few small vectors per call.
//!
//! Policy, in one pass over the tasks in order of (priority, load):
//! - A vCPU is a *target* when it is running and its estimated remaining slice is at least
//!   `push_threshold_ns`; its weight is that remaining slice.
//! - Each task goes to the allowed target where it can expect the largest share of
//!   remaining slice, `weight × load / (load already given + load)`. With nothing given
//!   yet this is the highest weight, so the heaviest task lands on the longest slice, and
//!   later tasks spread out so I/O progresses concurrently (the paper's two objections to
//!   "everything to the longest slice").
//! - `max_load_per_vcpu` is a cap that holds while another target still has room.
//! - A task stays where it is when its vCPU is a target and the best alternative gains
//!   less than `min_gain_ns`: moves are cheap but not free, and re-planning every
//!   millisecond must not ping-pong tasks between near-equal vCPUs.
//! - A task on a descheduled vCPU that has no allowed target may still go to any running
//!   vCPU (running now beats stopped now, even with a short slice left).
//! - A task on a vCPU ending its slice, with no target anywhere, is handed to the
//!   descheduled vCPU expected back first, if that one is back before its own would be:
//!   it waits there instead of on a vCPU about to go out for longer (where requests
//!   complete on the submitting vCPU, its requests are issued where they can complete).
//! - With no running vCPU at all, nothing moves.

/// One vCPU as the monitor sees it at planning time.
#[derive(Clone, Debug)]
pub struct VcpuView {
    pub cpu: usize,
    /// Running right now (not descheduled by the hypervisor).
    pub active: bool,
    /// Estimated remaining slice if active, in ns.
    pub remaining_ns: u64,
    /// How long it has been descheduled if inactive, in ns.
    pub inactive_for_ns: u64,
    /// Current slice length estimate, in ns.
    pub est_slice_ns: u64,
    /// If descheduled: how long until it is expected back, in ns (`None`: unknown).
    pub back_in_ns: Option<u64>,
    /// How long its last deschedule lasted, in ns: how long it is expected out once its
    /// slice ends.
    pub last_inactive_ns: u64,
}

/// One I/O-bound task the planner may move.
#[derive(Clone, Debug)]
pub struct TaskView {
    pub tid: u32,
    /// I/O load level; the weight of the task in the balance.
    pub load: f64,
    /// From user config: higher wins, 0 by default.
    pub priority: i32,
    /// The CPU we pinned it to; `None` while we have not placed it.
    pub placed_on: Option<usize>,
    /// Where it last ran (where it is, when we have not placed it).
    pub last_cpu: usize,
    /// CPUs it may use: its original mask ∩ its cpuset.
    pub allowed: Vec<usize>,
}

/// What made the daemon plan now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// This vCPU just came back after a gap.
    Resumed { cpu: usize },
    /// Periodic check on a running vCPU.
    Tick { cpu: usize },
}

/// Why a task moves; also the metrics label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Off a vCPU that is descheduled or about to end its slice.
    Push,
    /// Onto the vCPU that just resumed.
    Pull,
    /// Between two running vCPUs, for the weighted balance or the load cap.
    Balance,
    /// Onto a vCPU the host agent favours for our I/O (`anchor`).
    Held,
    /// Onto the vCPU that takes its requests' completions (`completion`).
    Completion,
    /// Beside a task kept with its completions, which it wakes and is woken by.
    Partner,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Push => "push",
            Reason::Pull => "pull",
            Reason::Balance => "balance",
            Reason::Held => "held",
            Reason::Completion => "completion",
            Reason::Partner => "partner",
        }
    }
}

/// One decision: pin `tid` to the single CPU `to`.
#[derive(Clone, Debug, PartialEq)]
pub struct Move {
    pub tid: u32,
    /// Where we had pinned it (`None`: not pinned by us yet).
    pub from: Option<usize>,
    pub to: usize,
    pub reason: Reason,
}

#[derive(Clone, Debug)]
pub struct PlannerConfig {
    /// Push tasks off a vCPU whose remaining slice is below this; such a vCPU is never a
    /// target either.
    pub push_threshold_ns: u64,
    /// Never give one vCPU more I/O load than this while another target has room.
    pub max_load_per_vcpu: f64,
    /// Hysteresis: a task on a running vCPU moves only if it gains at least this much
    /// expected remaining slice.
    pub min_gain_ns: u64,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            push_threshold_ns: 1_000_000,
            max_load_per_vcpu: 2.0,
            min_gain_ns: 2_000_000,
        }
    }
}

/// Loads at or below zero would make every share 0/0; a floor keeps them comparable.
const MIN_LOAD: f64 = 1e-6;
/// `cpu_index` value for a CPU that is not among the views.
const NO_VCPU: u32 = u32::MAX;
/// CPUs above this are ignored as placement targets, bounding the lookup table.
const MAX_CPU: usize = 8192;

pub struct Planner {
    cfg: PlannerConfig,
}

impl Planner {
    pub fn new(cfg: PlannerConfig) -> Self {
        Planner { cfg }
    }

    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }

    /// The moves that bring the I/O-bound tasks to the running vCPUs, in the order they
    /// should be applied (most important task first). Empty when nothing should change.
    pub fn plan(&self, trigger: Trigger, vcpus: &[VcpuView], tasks: &[TaskView]) -> Vec<Move> {
        if tasks.is_empty() || !vcpus.iter().any(|v| v.active) {
            return Vec::new();
        }
        let cfg = &self.cfg;
        let table = VcpuTable::new(vcpus);

        let mut order: Vec<usize> = (0..tasks.len()).collect();
        order.sort_by(|&a, &b| {
            let (ta, tb) = (&tasks[a], &tasks[b]);
            tb.priority
                .cmp(&ta.priority)
                .then(tb.load.total_cmp(&ta.load))
                .then(ta.tid.cmp(&tb.tid))
        });

        let mut given = vec![0.0f64; vcpus.len()];
        let mut moves = Vec::new();
        for &ti in &order {
            let task = &tasks[ti];
            let load = task.load.max(MIN_LOAD);
            let current = task.placed_on.unwrap_or(task.last_cpu);
            let cur_idx = table
                .index_of(current)
                .filter(|_| task.allowed.contains(&current));
            let Some(dest) = destination(cfg, &table, &task.allowed, cur_idx, &given, load) else {
                continue;
            };
            given[dest] += load;
            let to = vcpus[dest].cpu;
            // An unplaced task already running on its destination is left to the kernel:
            // pinning it would gain nothing now.
            if Some(to) == task.placed_on || (task.placed_on.is_none() && Some(dest) == cur_idx) {
                continue;
            }
            let cur_target = cur_idx.filter(|&i| is_target(cfg, &vcpus[i]));
            let reason = match trigger {
                Trigger::Resumed { cpu } if cpu == to => Reason::Pull,
                _ if cur_target.is_none() => Reason::Push,
                _ => Reason::Balance,
            };
            moves.push(Move {
                tid: task.tid,
                from: task.placed_on,
                to,
                reason,
            });
        }
        moves
    }
}

/// The vCPU views with a lookup from CPU id to their index.
struct VcpuTable<'a> {
    views: &'a [VcpuView],
    /// Per CPU id up to the largest one seen: its index in `views`, or `NO_VCPU`.
    by_cpu: Vec<u32>,
}

impl<'a> VcpuTable<'a> {
    fn new(views: &'a [VcpuView]) -> Self {
        let max_cpu = views
            .iter()
            .map(|v| v.cpu)
            .filter(|&c| c < MAX_CPU)
            .max()
            .unwrap_or(0);
        let mut by_cpu = vec![NO_VCPU; max_cpu + 1];
        for (i, v) in views.iter().enumerate() {
            // First view wins on duplicates, so a malformed input still plans deterministically.
            if v.cpu <= max_cpu && by_cpu[v.cpu] == NO_VCPU {
                by_cpu[v.cpu] = i as u32;
            }
        }
        VcpuTable { views, by_cpu }
    }

    fn index_of(&self, cpu: usize) -> Option<usize> {
        self.by_cpu
            .get(cpu)
            .copied()
            .filter(|&i| i != NO_VCPU)
            .map(|i| i as usize)
    }
}

/// A vCPU a task may be moved onto for its slice: running, with at least
/// `push_threshold_ns` left.
fn is_target(cfg: &PlannerConfig, v: &VcpuView) -> bool {
    v.active && v.remaining_ns >= cfg.push_threshold_ns
}

/// Where one task should run, as an index into `table`'s views; `None` leaves it where it
/// is. `allowed`: the CPUs it may use; `current`: the index of the vCPU it is on, only if
/// that one is allowed; `given`: the load each vCPU took from tasks placed earlier in this
/// plan; `load`: the task's own, floored at `MIN_LOAD`.
fn destination(
    cfg: &PlannerConfig,
    table: &VcpuTable,
    allowed: &[usize],
    current: Option<usize>,
    given: &[f64],
    load: f64,
) -> Option<usize> {
    let vcpus = table.views;
    let candidate = |i: usize| Candidate {
        index: i,
        fits: given[i] + load <= cfg.max_load_per_vcpu,
        share_ns: vcpus[i].remaining_ns as f64 * load / (given[i] + load),
    };
    let allowed_indices = || allowed.iter().filter_map(|&cpu| table.index_of(cpu));
    let best = allowed_indices()
        .filter(|&i| is_target(cfg, &vcpus[i]))
        .map(candidate);
    match (
        current.filter(|&i| is_target(cfg, &vcpus[i])),
        best_candidate(best, vcpus),
    ) {
        (Some(c), Some(b)) => {
            let c = candidate(c);
            let must_leave = !c.fits && b.fits;
            let gain = b.share_ns - c.share_ns;
            if must_leave
                || (b.index != c.index && gain >= cfg.min_gain_ns as f64 && (b.fits || !c.fits))
            {
                Some(b.index)
            } else {
                Some(c.index)
            }
        }
        (Some(c), None) => Some(c),
        (None, Some(b)) => Some(b.index),
        (None, None) => {
            // No target allowed. A task on a stopped vCPU moves to the running vCPU
            // with the most slice left: anything running beats stopped. A task on
            // a vCPU ending its slice goes to where it runs again soonest.
            match current.filter(|&i| vcpus[i].active) {
                None => {
                    let running = allowed_indices()
                        .filter(|&i| vcpus[i].active)
                        .map(candidate);
                    best_candidate(running, vcpus).map(|c| c.index)
                }
                Some(ending) => next_back(vcpus, allowed, ending),
            }
        }
    }
}

/// The candidate that beats the others (`Candidate::beats`), the first one among equals.
fn best_candidate(
    candidates: impl Iterator<Item = Candidate>,
    vcpus: &[VcpuView],
) -> Option<Candidate> {
    candidates.reduce(|b, c| if c.beats(&b, vcpus) { c } else { b })
}

/// The descheduled vCPU among `allowed` expected back first, if it is back before `ending`
/// (running, its slice about to end) would be after its next deschedule.
fn next_back(vcpus: &[VcpuView], allowed: &[usize], ending: usize) -> Option<usize> {
    let e = &vcpus[ending];
    let own_back = e.remaining_ns.saturating_add(e.last_inactive_ns);
    vcpus
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.active && allowed.contains(&v.cpu))
        .filter_map(|(i, v)| v.back_in_ns.map(|b| (b, v.cpu, i)))
        .filter(|&(b, _, _)| b < own_back)
        .min()
        .map(|(_, _, i)| i)
}

/// A vCPU a task could go to.
#[derive(Clone, Copy)]
struct Candidate {
    /// Into the planner's `vcpus`.
    index: usize,
    /// The task fits there under `max_load_per_vcpu`.
    fits: bool,
    /// The part of that vCPU's remaining slice the task can expect, in ns.
    share_ns: f64,
}

impl Candidate {
    /// Room first, then the larger share, the longer slice left, the lower CPU id.
    fn beats(&self, other: &Candidate, vcpus: &[VcpuView]) -> bool {
        let (a, b) = (&vcpus[self.index], &vcpus[other.index]);
        self.fits
            .cmp(&other.fits)
            .then(self.share_ns.total_cmp(&other.share_ns))
            .then(a.remaining_ns.cmp(&b.remaining_ns))
            .then(b.cpu.cmp(&a.cpu))
            .is_gt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn running(cpu: usize, remaining_ms: u64) -> VcpuView {
        VcpuView {
            cpu,
            active: true,
            remaining_ns: remaining_ms * MS,
            inactive_for_ns: 0,
            est_slice_ns: 10 * MS,
            back_in_ns: None,
            last_inactive_ns: 10 * MS,
        }
    }

    fn stopped(cpu: usize, for_ms: u64) -> VcpuView {
        VcpuView {
            cpu,
            active: false,
            remaining_ns: 0,
            inactive_for_ns: for_ms * MS,
            est_slice_ns: 10 * MS,
            back_in_ns: None,
            last_inactive_ns: 10 * MS,
        }
    }

    /// Out, and expected back in `back_ms`.
    fn back_in(cpu: usize, back_ms: u64) -> VcpuView {
        VcpuView {
            back_in_ns: Some(back_ms * MS),
            ..stopped(cpu, 1)
        }
    }

    #[test]
    fn a_task_on_an_ending_slice_waits_where_it_runs_again_first() {
        // Anti-phase: vCPU 0 ends in 0.5 ms and is then out ~10 ms; vCPU 1 is back in 0.3.
        let ending = VcpuView {
            remaining_ns: 500_000,
            ..running(0, 0)
        };
        let t = [task(4, 1.0, Some(0), 0, &[0, 1])];
        assert_eq!(
            planner().plan(
                Trigger::Tick { cpu: 0 },
                &[ending.clone(), back_in(1, 0)],
                &t
            ),
            vec![mv(4, Some(0), 1, Reason::Push)]
        );
        // 3:1, the other way round: vCPU 1 is back in 14 ms, vCPU 0 in 10.5: stay.
        assert!(planner()
            .plan(
                Trigger::Tick { cpu: 0 },
                &[ending.clone(), back_in(1, 14)],
                &t
            )
            .is_empty());
        // The first back of several, and only where the task may go.
        let v = [ending.clone(), back_in(1, 6), back_in(2, 2), back_in(3, 1)];
        let t = [task(4, 1.0, Some(0), 0, &[0, 1, 2])];
        assert_eq!(
            planner().plan(Trigger::Tick { cpu: 0 }, &v, &t),
            vec![mv(4, Some(0), 2, Reason::Push)]
        );
        // Unknown return: stay.
        assert!(planner()
            .plan(Trigger::Tick { cpu: 0 }, &[ending, stopped(1, 2)], &t)
            .is_empty());
    }

    fn task(tid: u32, load: f64, on: Option<usize>, last: usize, allowed: &[usize]) -> TaskView {
        TaskView {
            tid,
            load,
            priority: 0,
            placed_on: on,
            last_cpu: last,
            allowed: allowed.to_vec(),
        }
    }

    fn planner() -> Planner {
        Planner::new(PlannerConfig::default())
    }

    fn mv(tid: u32, from: Option<usize>, to: usize, reason: Reason) -> Move {
        Move {
            tid,
            from,
            to,
            reason,
        }
    }

    #[test]
    fn no_tasks_no_moves() {
        let v = [running(0, 5), stopped(1, 3)];
        assert!(planner().plan(Trigger::Tick { cpu: 0 }, &v, &[]).is_empty());
    }

    #[test]
    fn anti_phase_pull_then_push() {
        // Two vCPUs taking turns (10 ms on / 10 ms off): the reader follows the running one.
        let p = planner();
        let t = [task(7, 1.0, Some(0), 0, &[0, 1])];
        // vCPU 1 comes back while 0 is descheduled: PULL onto 1.
        let v = [stopped(0, 1), running(1, 10)];
        assert_eq!(
            p.plan(Trigger::Resumed { cpu: 1 }, &v, &t),
            vec![mv(7, Some(0), 1, Reason::Pull)]
        );
        // Half a cycle later, vCPU 0 resumed and 1 was seen stopped first by a tick on 0.
        let t = [task(7, 1.0, Some(1), 1, &[0, 1])];
        let v = [running(0, 10), stopped(1, 1)];
        assert_eq!(
            p.plan(Trigger::Tick { cpu: 0 }, &v, &t),
            vec![mv(7, Some(1), 0, Reason::Push)]
        );
    }

    #[test]
    fn pushes_off_a_vcpu_about_to_end_its_slice() {
        let v = [running(0, 0), running(1, 6)];
        let v = [
            VcpuView {
                remaining_ns: 400_000,
                ..v[0].clone()
            },
            v[1].clone(),
        ];
        let t = [task(3, 0.8, None, 0, &[0, 1])];
        assert_eq!(
            planner().plan(Trigger::Tick { cpu: 0 }, &v, &t),
            vec![mv(3, None, 1, Reason::Push)]
        );
    }

    #[test]
    fn all_inactive_leaves_tasks_alone() {
        let v = [stopped(0, 4), stopped(1, 9)];
        let t = [
            task(1, 1.0, Some(0), 0, &[0, 1]),
            task(2, 1.0, None, 1, &[0, 1]),
        ];
        assert!(planner().plan(Trigger::Tick { cpu: 0 }, &v, &t).is_empty());
    }

    #[test]
    fn running_beats_stopped_even_with_a_short_slice() {
        // Only a nearly finished vCPU runs: a task stuck on a stopped vCPU still goes there,
        // but a task already on the running vCPU is not pushed into nothing.
        let v = [
            VcpuView {
                remaining_ns: 300_000,
                ..running(0, 0)
            },
            stopped(1, 2),
        ];
        let t = [
            task(1, 1.0, Some(1), 1, &[0, 1]),
            task(2, 1.0, Some(0), 0, &[0, 1]),
        ];
        assert_eq!(
            planner().plan(Trigger::Tick { cpu: 0 }, &v, &t),
            vec![mv(1, Some(1), 0, Reason::Push)]
        );
    }

    #[test]
    fn heaviest_task_gets_the_longest_slice_and_work_spreads() {
        let v = [running(0, 4), running(1, 9), running(2, 6), stopped(3, 1)];
        let t = [
            task(10, 0.3, Some(3), 3, &[0, 1, 2, 3]),
            task(11, 0.9, Some(3), 3, &[0, 1, 2, 3]),
            task(12, 0.6, Some(3), 3, &[0, 1, 2, 3]),
        ];
        let m = planner().plan(Trigger::Tick { cpu: 1 }, &v, &t);
        assert_eq!(
            m,
            vec![
                mv(11, Some(3), 1, Reason::Push),
                mv(12, Some(3), 2, Reason::Push),
                mv(10, Some(3), 0, Reason::Push),
            ]
        );
    }

    #[test]
    fn priority_wins_over_load() {
        // One target: the prioritised light task is served first and takes the room.
        let cfg = PlannerConfig {
            max_load_per_vcpu: 1.0,
            ..PlannerConfig::default()
        };
        let v = [running(0, 9), running(1, 2)];
        let mut light = task(1, 0.5, Some(5), 5, &[0, 1]);
        light.priority = 10;
        let heavy = task(2, 0.9, Some(5), 5, &[0, 1]);
        let m = Planner::new(cfg).plan(Trigger::Tick { cpu: 0 }, &v, &[heavy, light]);
        assert_eq!(
            m,
            vec![
                mv(1, Some(5), 0, Reason::Push),
                mv(2, Some(5), 1, Reason::Push)
            ]
        );
    }

    #[test]
    fn respects_allowed_sets() {
        let v = [running(0, 10), running(1, 3), stopped(2, 1)];
        let t = [task(4, 1.0, Some(2), 2, &[1, 2])];
        assert_eq!(
            planner().plan(Trigger::Tick { cpu: 0 }, &v, &t),
            vec![mv(4, Some(2), 1, Reason::Push)]
        );
        // Nothing allowed is running: stay.
        let t = [task(4, 1.0, Some(2), 2, &[2])];
        assert!(planner().plan(Trigger::Tick { cpu: 0 }, &v, &t).is_empty());
        // A placement outside the allowed set is corrected.
        let t = [task(4, 1.0, Some(0), 0, &[1])];
        assert_eq!(
            planner().plan(Trigger::Tick { cpu: 0 }, &v, &t),
            vec![mv(4, Some(0), 1, Reason::Push)]
        );
    }

    #[test]
    fn never_overloads_one_vcpu_while_another_has_room() {
        let cfg = PlannerConfig {
            max_load_per_vcpu: 1.0,
            ..PlannerConfig::default()
        };
        // vCPU 0 has by far the longest slice, but only room for one full task.
        let v = [running(0, 30), running(1, 2), stopped(2, 1)];
        let t = [
            task(1, 1.0, Some(2), 2, &[0, 1, 2]),
            task(2, 1.0, Some(2), 2, &[0, 1, 2]),
        ];
        let m = Planner::new(cfg.clone()).plan(Trigger::Tick { cpu: 0 }, &v, &t);
        assert_eq!(
            m,
            vec![
                mv(1, Some(2), 0, Reason::Push),
                mv(2, Some(2), 1, Reason::Push)
            ]
        );
        // Already stacked on vCPU 0: the second one leaves even though 0 still has more slice.
        let t = [
            task(1, 1.0, Some(0), 0, &[0, 1, 2]),
            task(2, 1.0, Some(0), 0, &[0, 1, 2]),
        ];
        let m = Planner::new(cfg.clone()).plan(Trigger::Tick { cpu: 0 }, &v, &t);
        assert_eq!(m, vec![mv(2, Some(0), 1, Reason::Balance)]);
        // No room anywhere: the cap yields, everything still runs somewhere.
        let t = [
            task(1, 1.0, Some(2), 2, &[0, 1, 2]),
            task(2, 1.0, Some(2), 2, &[0, 1, 2]),
            task(3, 1.0, Some(2), 2, &[0, 1, 2]),
        ];
        let m = Planner::new(cfg).plan(Trigger::Tick { cpu: 0 }, &v, &t);
        assert_eq!(m.len(), 3);
        assert!(m.iter().all(|m| m.to != 2));
    }

    #[test]
    fn balanced_placement_is_a_no_op() {
        let v = [running(0, 6), running(1, 7)];
        let t = [
            task(1, 1.0, Some(0), 0, &[0, 1]),
            task(2, 1.0, Some(1), 1, &[0, 1]),
        ];
        assert!(planner().plan(Trigger::Tick { cpu: 0 }, &v, &t).is_empty());
        // An unplaced task running on a good vCPU is not pinned for nothing.
        let t = [task(3, 1.0, None, 1, &[0, 1])];
        assert!(planner().plan(Trigger::Tick { cpu: 1 }, &v, &t).is_empty());
    }

    #[test]
    fn hysteresis_ignores_small_gains_but_pulls_for_large_ones() {
        let p = planner();
        let t = [task(1, 1.0, Some(0), 0, &[0, 1])];
        // 1 ms more elsewhere: below the 2 ms gain, stay.
        let v = [running(0, 6), running(1, 7)];
        assert!(p.plan(Trigger::Resumed { cpu: 1 }, &v, &t).is_empty());
        // A fresh slice of 10 ms against 3 ms left: pull.
        let v = [running(0, 3), running(1, 10)];
        assert_eq!(
            p.plan(Trigger::Resumed { cpu: 1 }, &v, &t),
            vec![mv(1, Some(0), 1, Reason::Pull)]
        );
    }

    #[test]
    fn ties_break_deterministically() {
        let v = [running(3, 5), running(1, 5), running(2, 5)];
        let t = [
            task(9, 0.5, Some(7), 7, &[1, 2, 3]),
            task(8, 0.5, Some(7), 7, &[1, 2, 3]),
        ];
        let m = planner().plan(Trigger::Tick { cpu: 3 }, &v, &t);
        // Same load: lower tid first; same share: lower cpu first.
        assert_eq!(
            m,
            vec![
                mv(8, Some(7), 1, Reason::Push),
                mv(9, Some(7), 2, Reason::Push)
            ]
        );
        for _ in 0..10 {
            assert_eq!(planner().plan(Trigger::Tick { cpu: 3 }, &v, &t), m);
        }
    }

    /// `destination` for a task with `load` that may use `allowed` and sits on the vCPU at
    /// index `current`, after earlier tasks gave each vCPU `given`.
    fn dest(
        cfg: &PlannerConfig,
        v: &[VcpuView],
        allowed: &[usize],
        current: Option<usize>,
        given: &[f64],
        load: f64,
    ) -> Option<usize> {
        destination(cfg, &VcpuTable::new(v), allowed, current, given, load)
    }

    fn capped(max_load_per_vcpu: f64) -> PlannerConfig {
        PlannerConfig {
            max_load_per_vcpu,
            ..PlannerConfig::default()
        }
    }

    #[test]
    fn destination_stays_on_its_target_for_a_small_gain() {
        let cfg = PlannerConfig::default();
        let v = [running(0, 6), running(1, 7)];
        assert_eq!(dest(&cfg, &v, &[0, 1], Some(0), &[0.0, 0.0], 1.0), Some(0));
        // Its own vCPU is the best one.
        let v = [running(0, 9), running(1, 7)];
        assert_eq!(dest(&cfg, &v, &[0, 1], Some(0), &[0.0, 0.0], 1.0), Some(0));
    }

    #[test]
    fn destination_leaves_its_target_for_a_large_gain() {
        let cfg = PlannerConfig::default();
        let v = [running(0, 3), running(1, 10)];
        assert_eq!(dest(&cfg, &v, &[0, 1], Some(0), &[0.0, 0.0], 1.0), Some(1));
        // The share counts the load already given: 10 ms shared with as much again is 5.
        let v = [running(0, 4), running(1, 10)];
        assert_eq!(dest(&cfg, &v, &[0, 1], Some(0), &[0.0, 1.0], 1.0), Some(0));
    }

    #[test]
    fn destination_leaves_a_full_target_for_one_with_room() {
        // Far less slice on vCPU 1, but vCPU 0 is already full.
        let v = [running(0, 30), running(1, 2)];
        assert_eq!(
            dest(&capped(1.0), &v, &[0, 1], Some(0), &[1.0, 0.0], 1.0),
            Some(1)
        );
    }

    #[test]
    fn destination_with_no_room_anywhere_moves_only_for_a_large_gain() {
        let v = [running(0, 6), running(1, 7)];
        assert_eq!(
            dest(&capped(1.0), &v, &[0, 1], Some(0), &[1.0, 1.0], 1.0),
            Some(0)
        );
        let v = [running(0, 2), running(1, 20)];
        assert_eq!(
            dest(&capped(1.0), &v, &[0, 1], Some(1), &[1.0, 1.0], 1.0),
            Some(1)
        );
        assert_eq!(
            dest(&capped(1.0), &v, &[0, 1], Some(0), &[1.0, 1.0], 1.0),
            Some(1)
        );
    }

    #[test]
    fn destination_off_a_non_target_is_the_best_allowed_target() {
        let cfg = PlannerConfig::default();
        let v = [running(0, 4), running(1, 9), stopped(2, 1)];
        // Unplaced elsewhere, on a stopped vCPU, on one ending its slice.
        assert_eq!(dest(&cfg, &v, &[0, 1, 2], None, &[0.0; 3], 1.0), Some(1));
        assert_eq!(dest(&cfg, &v, &[0, 1, 2], Some(2), &[0.0; 3], 1.0), Some(1));
        let ending = VcpuView {
            remaining_ns: 500_000,
            ..running(2, 0)
        };
        let v = [running(0, 4), running(1, 9), ending];
        assert_eq!(dest(&cfg, &v, &[0, 1, 2], Some(2), &[0.0; 3], 1.0), Some(1));
        // Only among the allowed ones, and CPUs without a view are skipped.
        assert_eq!(dest(&cfg, &v, &[0, 2, 7], Some(2), &[0.0; 3], 1.0), Some(0));
        // Room first: the longer slice is full.
        assert_eq!(
            dest(&capped(2.0), &v, &[0, 1, 2], Some(2), &[0.0, 1.5, 0.0], 1.0),
            Some(0)
        );
        // Same share: the lower CPU id.
        let v = [running(3, 5), running(1, 5), stopped(2, 1)];
        assert_eq!(dest(&cfg, &v, &[1, 2, 3], Some(2), &[0.0; 3], 1.0), Some(1));
    }

    #[test]
    fn destination_off_a_stopped_vcpu_without_target_is_any_running_one() {
        let cfg = PlannerConfig::default();
        let short = |cpu, ns| VcpuView {
            remaining_ns: ns,
            ..running(cpu, 0)
        };
        let v = [short(0, 300_000), stopped(1, 2), short(2, 600_000)];
        assert_eq!(dest(&cfg, &v, &[0, 1, 2], Some(1), &[0.0; 3], 1.0), Some(2));
        assert_eq!(dest(&cfg, &v, &[0, 1, 2], None, &[0.0; 3], 1.0), Some(2));
        // Nothing allowed runs: it stays.
        let v = [running(0, 10), stopped(1, 2)];
        assert_eq!(dest(&cfg, &v, &[1], Some(1), &[0.0; 2], 1.0), None);
        assert_eq!(dest(&cfg, &v, &[1], None, &[0.0; 2], 1.0), None);
    }

    #[test]
    fn destination_off_an_ending_slice_without_target_is_the_first_back() {
        let cfg = PlannerConfig::default();
        let ending = VcpuView {
            remaining_ns: 500_000,
            ..running(0, 0)
        };
        let v = [ending.clone(), back_in(1, 6), back_in(2, 2), back_in(3, 1)];
        assert_eq!(dest(&cfg, &v, &[0, 1, 2], Some(0), &[0.0; 4], 1.0), Some(2));
        // Back later than its own vCPU would be, or unknown: it stays (nor does another
        // running vCPU with a short slice take it).
        let v = [ending.clone(), back_in(1, 14)];
        assert_eq!(dest(&cfg, &v, &[0, 1], Some(0), &[0.0; 2], 1.0), None);
        let short = VcpuView {
            remaining_ns: 900_000,
            ..running(2, 0)
        };
        let v = [ending, stopped(1, 2), short];
        assert_eq!(dest(&cfg, &v, &[0, 1, 2], Some(0), &[0.0; 3], 1.0), None);
    }

    #[test]
    fn vcpu_table_first_view_wins_and_unknown_cpus_have_no_index() {
        let v = [
            running(4, 1),
            running(2, 1),
            running(4, 9),
            running(MAX_CPU, 1),
        ];
        let t = VcpuTable::new(&v);
        assert_eq!(t.index_of(4), Some(0));
        assert_eq!(t.index_of(2), Some(1));
        assert_eq!(t.index_of(3), None);
        assert_eq!(t.index_of(MAX_CPU), None);
    }

    #[test]
    fn reason_labels() {
        assert_eq!(Reason::Push.as_str(), "push");
        assert_eq!(Reason::Pull.as_str(), "pull");
        assert_eq!(Reason::Balance.as_str(), "balance");
    }
}
