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
        let max_cpu = vcpus
            .iter()
            .map(|v| v.cpu)
            .filter(|&c| c < MAX_CPU)
            .max()
            .unwrap_or(0);
        let mut cpu_index = vec![NO_VCPU; max_cpu + 1];
        for (i, v) in vcpus.iter().enumerate() {
            // First view wins on duplicates, so a malformed input still plans deterministically.
            if v.cpu <= max_cpu && cpu_index[v.cpu] == NO_VCPU {
                cpu_index[v.cpu] = i as u32;
            }
        }
        let index_of = |cpu: usize| -> Option<usize> {
            cpu_index
                .get(cpu)
                .copied()
                .filter(|&i| i != NO_VCPU)
                .map(|i| i as usize)
        };
        let is_target = |v: &VcpuView| v.active && v.remaining_ns >= cfg.push_threshold_ns;

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
            let cur_idx = index_of(current).filter(|_| task.allowed.contains(&current));
            let share = |i: usize| vcpus[i].remaining_ns as f64 * load / (given[i] + load);
            let fits = |i: usize| given[i] + load <= cfg.max_load_per_vcpu;

            let candidate = |i: usize| Candidate {
                index: i,
                fits: fits(i),
                share_ns: share(i),
            };
            // The best allowed target, by `Candidate::beats`.
            let mut best: Option<Candidate> = None;
            for &cpu in &task.allowed {
                let Some(i) = index_of(cpu) else { continue };
                if !is_target(&vcpus[i]) {
                    continue;
                }
                let cand = candidate(i);
                best = match best {
                    None => Some(cand),
                    Some(b) if cand.beats(&b, vcpus) => Some(cand),
                    keep => keep,
                };
            }

            let cur_target = cur_idx.filter(|&i| is_target(&vcpus[i]));
            let dest = match (cur_target, best) {
                (Some(c), Some(b)) => {
                    let c_fits = fits(c);
                    let must_leave = !c_fits && b.fits;
                    let gain = b.share_ns - share(c);
                    if must_leave
                        || (b.index != c && gain >= cfg.min_gain_ns as f64 && (b.fits || !c_fits))
                    {
                        b.index
                    } else {
                        c
                    }
                }
                (Some(c), None) => c,
                (None, Some(b)) => b.index,
                (None, None) => {
                    // No target allowed. A task on a stopped vCPU moves to the running vCPU
                    // with the most slice left: anything running beats stopped. A task on
                    // a vCPU ending its slice goes to where it runs again soonest.
                    let stopped = cur_idx.is_none_or(|i| !vcpus[i].active);
                    let fallback = task
                        .allowed
                        .iter()
                        .filter_map(|&cpu| index_of(cpu))
                        .filter(|&i| vcpus[i].active)
                        .map(candidate)
                        .reduce(|b, c| if c.beats(&b, vcpus) { c } else { b });
                    match (fallback, cur_idx) {
                        (Some(c), _) if stopped => c.index,
                        (_, Some(c)) if !stopped => match next_back(vcpus, &task.allowed, c) {
                            Some(i) => i,
                            None => continue,
                        },
                        _ => continue,
                    }
                }
            };
            given[dest] += load;
            let to = vcpus[dest].cpu;
            // An unplaced task already running on its destination is left to the kernel:
            // pinning it would gain nothing now.
            if Some(to) == task.placed_on || (task.placed_on.is_none() && Some(dest) == cur_idx) {
                continue;
            }
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

    #[test]
    fn reason_labels() {
        assert_eq!(Reason::Push.as_str(), "push");
        assert_eq!(Reason::Pull.as_str(), "pull");
        assert_eq!(Reason::Balance.as_str(), "balance");
    }
}
