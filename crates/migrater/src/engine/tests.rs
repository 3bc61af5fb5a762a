//! The engine driven by synthetic boards, detector windows and a fake clock, one test per
//! behaviour. The fake actuator records what the engine asked of it.

use super::*;
use crate::planner::Reason;
use crate::sampling::Schedule;
use os_layer::Mono;
use std::collections::{BTreeMap, BTreeSet};
use task_detector::{CompletionSite, DetectorOutput, ForkSample, IoTask};

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;

/// Block programs and placement in memory.
#[derive(Default)]
struct Fake {
    tracking: bool,
    attached: bool,
    /// What the next polls return.
    window: Vec<IoTaskInfo>,
    polls: usize,
    pauses: usize,
    resumes: usize,
    detaches: usize,
    /// Managed tasks and the CPU each is pinned to (if any).
    managed: BTreeMap<u32, Option<usize>>,
    released: Vec<u32>,
    published: Arc<Vec<TaskEntry>>,
    demand: Option<Demand>,
    dry_run: bool,
    /// Every anchor asked for: (tid, vCPU, why).
    anchors: Vec<(u32, usize, Reason)>,
    /// What `entering` says.
    entering: bool,
    /// The tasks the last step wanted on a short slice.
    short_slices: Vec<u32>,
    /// What `take_doorbell` says next (then false).
    doorbell: bool,
    /// The partners the next polls report.
    partners: Vec<task_detector::Partner>,
    /// The forks the next poll reports (once), and every fork handed to `undo_inherited`.
    forks: Vec<ForkSample>,
    forks_seen: Vec<ForkSample>,
    /// Operations that fail: "poll", "pause", "resume", "detach".
    failing: BTreeSet<&'static str>,
    /// The vCPUs' out times the last poll was told.
    polled_out_ns: Vec<(usize, u64)>,
    /// Tasks whose mask someone else changed.
    hands_off: HashSet<TaskId>,
    /// Tasks whose mask someone else changes before the next audit.
    changed_outside: Vec<TaskId>,
    /// Tasks the placement cannot pin (gone, or their mask changed since the decision).
    unpinnable: BTreeSet<u32>,
    /// Every switch, poll and placement act asked for, in order (reads left out).
    calls: Vec<String>,
}

impl Fake {
    fn new() -> Self {
        Fake {
            tracking: true,
            attached: true,
            ..Fake::default()
        }
    }
    fn published_tids(&self) -> Vec<u32> {
        self.published.iter().map(|t| t.tid).collect()
    }
    fn fails(&self, op: &str) -> anyhow::Result<()> {
        if self.failing.contains(op) {
            anyhow::bail!("{op} failed (fake)");
        }
        Ok(())
    }
}

impl BlockTracking for Fake {
    fn tracking(&self) -> bool {
        self.tracking
    }
    fn attached(&self) -> bool {
        self.attached
    }
    fn pause(&mut self) -> anyhow::Result<()> {
        self.calls.push("pause".into());
        self.fails("pause")?;
        self.pauses += 1;
        self.tracking = false;
        Ok(())
    }
    fn resume(&mut self) -> anyhow::Result<()> {
        self.calls.push("resume".into());
        self.fails("resume")?;
        self.resumes += 1;
        self.tracking = true;
        self.attached = true;
        Ok(())
    }
    fn detach(&mut self) -> anyhow::Result<()> {
        self.calls.push("detach".into());
        self.fails("detach")?;
        self.detaches += 1;
        self.tracking = false;
        self.attached = false;
        Ok(())
    }
    fn entering(&self) -> bool {
        self.entering
    }
    fn take_doorbell(&mut self) -> bool {
        self.calls.push("doorbell".into());
        std::mem::take(&mut self.doorbell)
    }
    fn poll(&mut self, cpu_out_ns: &[(usize, u64)]) -> anyhow::Result<DetectorOutput> {
        self.calls.push("poll".into());
        self.fails("poll")?;
        self.polls += 1;
        self.polled_out_ns = cpu_out_ns.to_vec();
        Ok(DetectorOutput {
            tasks: self.window.clone(),
            cpus: Vec::new(),
            partners: self.partners.clone(),
            forks: std::mem::take(&mut self.forks),
        })
    }
}

impl Actuator for Fake {
    type Blocks = Fake;
    type Placement = Fake;
    fn blocks(&mut self) -> &mut Fake {
        self
    }
    fn placement(&mut self) -> &mut Fake {
        self
    }
}

impl TaskPlacement for Fake {
    fn hands_off(&self) -> HashSet<TaskId> {
        self.hands_off.clone()
    }
    fn manage(&mut self, task: TaskId, _: u32) -> anyhow::Result<Vec<usize>> {
        self.calls.push(format!("manage {}", task.tid));
        self.managed.entry(task.tid).or_insert(None);
        Ok(vec![0, 1])
    }
    fn priority_of(&self, _: &IoTaskInfo) -> i32 {
        0
    }
    fn anchor(&mut self, tasks: &[FoundTask], on: &[usize], reason: Reason) -> Vec<u32> {
        self.calls.push(format!("anchor {reason:?}"));
        let pinnable = tasks.iter().filter(|t| !self.unpinnable.contains(&t.tid));
        for t in pinnable.clone() {
            self.managed.insert(t.tid, Some(on[0]));
            self.anchors.push((t.tid, on[0], reason));
        }
        pinnable.map(|t| t.tid).collect()
    }
    fn keep_short_slices(&mut self, kept: &[u32]) {
        self.calls.push("short slices".into());
        self.short_slices = kept.to_vec();
    }
    fn release(&mut self, tid: u32) -> Option<Outcome> {
        self.calls.push(format!("release {tid}"));
        self.released.push(tid);
        let was = self.managed.remove(&tid);
        (!self.dry_run).then_some(if was.is_some() {
            Outcome::Restored { latency_ns: 1 }
        } else {
            Outcome::Rejected
        })
    }
    fn release_all(&mut self) -> Option<usize> {
        let n = self.managed.len();
        self.released.extend(self.managed.keys().copied());
        self.managed.clear();
        (!self.dry_run).then_some(n)
    }
    fn undo_inherited(&mut self, forks: &[ForkSample]) -> usize {
        self.calls.push("undo inherited".into());
        self.forks_seen.extend_from_slice(forks);
        // Set back: the children of the tasks pinned now.
        forks
            .iter()
            .filter(|f| self.managed.get(&f.parent).is_some_and(|p| p.is_some()))
            .count()
    }
    fn hand_off_changed(&mut self) -> usize {
        let changed = std::mem::take(&mut self.changed_outside);
        let n = changed.len();
        self.hands_off.extend(changed);
        n
    }
    fn publish_tasks(&mut self, tasks: Arc<Vec<TaskEntry>>) {
        self.calls.push("publish".into());
        self.published = tasks;
    }
    fn set_demand(&mut self, demand: Demand) {
        self.calls.push("demand".into());
        self.demand = Some(demand);
    }
}

fn io_task(tid: u32) -> IoTaskInfo {
    IoTaskInfo {
        task: IoTask {
            tid,
            tgid: tid,
            io_fraction: 0.9,
            cpu_fraction: 0.1,
            iops: 1000.0,
            load: 0.9,
            last_cpu: 0,
            completion: Default::default(),
        },
        comm: "fio".into(),
        start_time: 1,
    }
}

/// A vCPU as the board shows it: only the cumulative out times matter to the engine.
fn vcpu(cpu: usize, inactive_ns: u64, covered_ns: u64) -> VcpuSnapshot {
    VcpuSnapshot {
        cpu,
        active: true,
        slice_start_ns: 0,
        est_slice_ns: 11 * MS,
        remaining_ns: 5 * MS,
        last_inactive_ns: 0,
        inactive_for_ns: 0,
        deschedules: 0,
        inactive_total_ns: inactive_ns,
        covered_total_ns: covered_ns,
        last_seen_ns: 0,
        gap_threshold_ns: 0,
        period_ns: 0,
        hiccups: 0,
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        window: Duration::from_millis(5),
        idle: Duration::from_millis(40),
        own_pid: 99,
        exclude_comm: Vec::new(),
        schedule: None,
        detach_after: None,
        gate_on_contention: false,
        guard: None,
        completion_prior: crate::completion::Home::Unknown,
        follow_completions: true,
        keep_partners: true,
        own_moves: true,
    }
}

/// A synthetic VM: a clock, two vCPUs whose out times grow as `out_per_s` says, a disk
/// whose completion count grows at `rate(moves allowed)` per second, and the host's hints.
struct Vm {
    now: u64,
    out_per_s: u64,
    covered_per_s: u64,
    inactive: u64,
    covered: u64,
    disk: u64,
    held: Vec<usize>,
    agent_answers: bool,
}

impl Vm {
    fn new() -> Self {
        Vm {
            now: 1_000 * S,
            out_per_s: 0,
            covered_per_s: 0,
            inactive: 0,
            covered: 0,
            disk: 0,
            held: Vec::new(),
            agent_answers: false,
        }
    }

    /// Advances the clock by `dt_ns` and runs one step.
    fn step(&mut self, e: &mut Engine, f: &mut Fake, dt_ns: u64, rate_per_s: u64) -> Duration {
        self.now += dt_ns;
        self.inactive += self.out_per_s * dt_ns / S;
        self.covered += self.covered_per_s * dt_ns / S;
        self.disk += rate_per_s * dt_ns / S;
        let obs = Observation {
            now: Mono::from_ns(self.now),
            vcpus: vec![vcpu(0, self.inactive, self.covered), vcpu(1, 0, 0)],
            disk_completed: Some(self.disk),
            steal_ns: Vec::new(),
            host: HostHints {
                held: self.held.clone(),
                agent_answers: self.agent_answers,
            },
        };
        e.step(obs, f)
    }

    /// Runs `secs` seconds in 100 ms steps, the disk rate set by whether moves are allowed.
    fn run(&mut self, e: &mut Engine, f: &mut Fake, secs: u64, rate: impl Fn(bool) -> u64) {
        for _ in 0..secs * 10 {
            let r = rate(e.snapshot().moves_allowed);
            self.step(e, f, 100 * MS, r);
        }
    }
}

fn contended(vm: &mut Vm) {
    // vCPU 0 out half the time, another vCPU running through all of it.
    vm.out_per_s = S / 2;
    vm.covered_per_s = S / 2;
}

fn gated() -> EngineConfig {
    EngineConfig {
        gate_on_contention: true,
        ..config()
    }
}

#[test]
fn the_contention_gate_opens_when_vcpus_are_out_while_others_run_and_closes_when_they_run() {
    let mut e = Engine::new(gated(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task(10)];
    let mut vm = Vm::new();
    // No vCPU out: nothing to gain, nothing managed, tracking paused.
    vm.run(&mut e, &mut f, 5, |_| 0);
    assert!(!e.snapshot().moves_allowed);
    assert!(f.published.is_empty());
    assert!(!f.tracking, "paused for want of contention");
    contended(&mut vm);
    vm.run(&mut e, &mut f, 5, |_| 0);
    assert!(e.snapshot().moves_allowed, "contended: moves may pay");
    assert_eq!(f.published_tids(), [10]);
    assert!(f.tracking);
    // Out all at once (nothing running through it): closes again, the task handed back.
    vm.covered_per_s = 0;
    vm.run(&mut e, &mut f, 5, |_| 0);
    assert!(f.published.is_empty());
    assert_eq!(f.released, [10]);
    assert!(f.tracking, "out together: tracking for tasks to keep");
    // vCPUs running all the time again: nothing to gain, tracking paused.
    vm.out_per_s = 0;
    vm.run(&mut e, &mut f, 5, |_| 0);
    assert!(!f.tracking);
    assert!(!e.snapshot().moves_allowed);
}

#[test]
fn with_vcpus_out_all_at_once_only_a_task_whose_completions_land_on_one_vcpu_is_kept_there() {
    let mut e = Engine::new(gated(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0), io_task(11)];
    let mut vm = Vm::new();
    // vCPU 0 out half the time and no vCPU running through it: no contention.
    vm.out_per_s = S / 2;
    vm.run(&mut e, &mut f, 5, |_| 0);
    assert_eq!(f.managed.get(&10), Some(&Some(1)), "kept on vCPU 1");
    assert!(!f.managed.contains_key(&11), "the other task is not taken");
    assert!(f.published.is_empty(), "the planner moves nothing");
    assert_eq!(f.short_slices, [10]);
    assert!(f.released.is_empty());
    // Contended now: the other task is the planner's, the kept one stays.
    contended(&mut vm);
    vm.run(&mut e, &mut f, 5, |_| 0);
    assert_eq!(f.published_tids(), [11]);
    assert_eq!(f.managed.get(&10), Some(&Some(1)));
    // Out together again: the planner's task is handed back, the kept one stays.
    vm.covered_per_s = 0;
    vm.run(&mut e, &mut f, 5, |_| 0);
    assert!(f.published.is_empty());
    assert_eq!(f.released, [11]);
    assert_eq!(f.managed.get(&10), Some(&Some(1)));
    // Without following completions there is nothing to keep: no tracking, nothing taken.
    let mut e = Engine::new(
        EngineConfig {
            gate_on_contention: true,
            follow_completions: false,
            ..config()
        },
        Mono::default(),
    );
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0)];
    let mut vm = Vm::new();
    vm.out_per_s = S / 2;
    vm.run(&mut e, &mut f, 5, |_| 0);
    assert!(f.managed.is_empty());
    assert!(!f.tracking);
}

fn guarded() -> EngineConfig {
    EngineConfig {
        guard: Some(crate::guard::GuardConfig::default()),
        ..config()
    }
}

#[test]
fn the_guard_probes_then_trusts_moves_that_raise_the_io_rate() {
    let mut e = Engine::new(guarded(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task(10)];
    let mut vm = Vm::new();
    let mut allowed_in_probe = BTreeSet::new();
    while e.snapshot().guard_verdicts == GuardVerdicts::default() && vm.now < 1_010 * S {
        let moves = e.snapshot().moves_allowed;
        allowed_in_probe.insert(moves);
        vm.step(&mut e, &mut f, 100 * MS, if moves { 2000 } else { 1000 });
    }
    assert_eq!(
        allowed_in_probe.len(),
        2,
        "a probe alternates with and without moves"
    );
    assert_eq!(
        e.snapshot().guard_verdicts,
        GuardVerdicts { pays: 1, holds: 0 }
    );
    // Trusted: moves stay allowed through the trust period.
    vm.run(&mut e, &mut f, 20, |_| 1000);
    assert!(e.snapshot().moves_allowed);
    assert_eq!(f.published_tids(), [10]);
}

#[test]
fn the_guard_holds_moves_that_do_not_pay_and_backs_off_doubling_each_hold() {
    let mut e = Engine::new(guarded(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task(10)];
    let mut vm = Vm::new();
    // The rate does not depend on moves: after the epoch the task's start settles in, the
    // first pair decides.
    vm.run(&mut e, &mut f, 4, |_| 1000);
    assert_eq!(e.snapshot().guard_verdicts.holds, 1);
    assert!(!e.snapshot().moves_allowed);
    assert!(
        f.published.is_empty(),
        "on hold the tasks go back to their own masks"
    );
    assert_eq!(f.released, [10]);
    assert_eq!(
        e.snapshot().io_bound_tasks,
        1,
        "on hold the task is still I/O-bound"
    );
    // The first hold lasts 30 s, the next 60 s.
    let held_for = |e: &mut Engine, f: &mut Fake, vm: &mut Vm| {
        let mut t = 0;
        while !e.snapshot().moves_allowed {
            vm.step(e, f, 100 * MS, 1000);
            t += 100;
        }
        let probe_start = t;
        vm.run(e, f, 3, |_| 1000);
        assert!(!e.snapshot().moves_allowed, "lost the probe again");
        probe_start
    };
    let first = held_for(&mut e, &mut f, &mut vm);
    let second = held_for(&mut e, &mut f, &mut vm);
    assert!((29_000..=31_000).contains(&first), "first hold {first} ms");
    assert!(
        (59_000..=61_000).contains(&second),
        "second hold {second} ms"
    );
    assert_eq!(e.snapshot().guard_verdicts.holds, 3);
}

/// A guarded engine whose programs come off after 10 s of nothing to gain, run until its
/// guard holds moves (a task at a steady I/O rate; vCPU 0 out `out_per_s`).
fn guard_holding(out_per_s: u64) -> (Engine, Fake, Vm) {
    let mut e = Engine::new(
        EngineConfig {
            detach_after: Some(Duration::from_secs(10)),
            ..guarded()
        },
        Mono::default(),
    );
    let mut f = Fake::new();
    f.window = vec![io_task(10)];
    let mut vm = Vm::new();
    vm.out_per_s = out_per_s;
    while e.snapshot().guard_verdicts.holds == 0 {
        vm.step(&mut e, &mut f, 100 * MS, 1000);
    }
    (e, f, vm)
}

#[test]
fn the_block_programs_detach_while_the_guard_holds_and_come_back_a_lead_before_its_end() {
    let (mut e, mut f, mut vm) = guard_holding(0);
    let verdict_at = vm.now;
    vm.step(&mut e, &mut f, 100 * MS, 1000);
    assert!(!f.tracking, "paused at once while the guard holds");
    assert!(f.attached);
    vm.run(&mut e, &mut f, 11, |_| 1000);
    assert_eq!(f.detaches, 1, "detached after detach_after");
    assert!(!e.snapshot().block_attached);
    assert!(e.snapshot().found.is_empty(), "what was found goes stale");
    // Back on HOLD_LEAD before the hold (30 s) ends, not later.
    while !f.attached && vm.now < verdict_at + 60 * S {
        vm.step(&mut e, &mut f, 100 * MS, 1000);
    }
    let back_after_ms = (vm.now - verdict_at) / MS;
    let due = 30_000 - HOLD_LEAD.as_millis() as u64;
    assert!(
        (due..=due + 100).contains(&back_after_ms),
        "re-attached {back_after_ms} ms after the verdict"
    );
    assert!(f.tracking);
}

#[test]
fn while_vcpus_are_descheduled_the_programs_pause_and_never_come_off() {
    // Out all at once without following completions: nothing to gain, vCPUs out.
    let mut e = Engine::new(
        EngineConfig {
            gate_on_contention: true,
            follow_completions: false,
            detach_after: Some(Duration::from_secs(10)),
            ..config()
        },
        Mono::default(),
    );
    let mut f = Fake::new();
    f.window = vec![io_task(10)];
    let mut vm = Vm::new();
    vm.out_per_s = S / 2;
    vm.run(&mut e, &mut f, 30, |_| 0);
    assert!(!f.tracking, "nothing to gain: paused");
    assert!(
        f.attached,
        "no kernel text patched while vCPUs are taken away"
    );
    assert_eq!(f.detaches, 0);
    // The deschedules end: off after the wait.
    vm.out_per_s = 0;
    vm.run(&mut e, &mut f, 3, |_| 0);
    assert!(!f.attached);
    // The guard holding where vCPUs are out: paused, attached.
    let (mut e, mut f, mut vm) = guard_holding(S / 2);
    vm.run(&mut e, &mut f, 20, |_| 1000);
    assert!(!f.tracking && f.attached, "paused, not detached");
}

/// An engine gated on contention whose programs come off after 10 s of nothing to gain.
fn gated_detaching_after_10s() -> Engine {
    Engine::new(
        EngineConfig {
            gate_on_contention: true,
            detach_after: Some(Duration::from_secs(10)),
            ..config()
        },
        Mono::default(),
    )
}

#[test]
fn with_nothing_to_gain_since_start_the_programs_come_off_at_once_and_later_only_after_the_wait() {
    let mut e = gated_detaching_after_10s();
    let mut f = Fake::new();
    f.window = vec![io_task(10)];
    let mut vm = Vm::new();
    vm.step(&mut e, &mut f, 100 * MS, 0);
    assert!(f.attached, "nothing judged yet: on until a window says");
    vm.run(&mut e, &mut f, 2, |_| 0);
    assert!(
        !f.attached,
        "nothing could gain since start: off once the first window is judged"
    );
    assert_eq!(f.detaches, 1);
    contended(&mut vm);
    vm.run(&mut e, &mut f, 5, |_| 0);
    assert!(f.attached && f.tracking, "contended: back on");
    assert_eq!(f.published_tids(), [10]);
    // Quiet again after something could gain: the programs wait `detach_after`.
    vm.out_per_s = 0;
    vm.covered_per_s = 0;
    vm.run(&mut e, &mut f, 9, |_| 0);
    assert!(
        f.attached,
        "a quiet spell shorter than detach_after keeps them on"
    );
    vm.run(&mut e, &mut f, 6, |_| 0);
    assert!(!f.attached);
    assert_eq!(f.detaches, 2);
}

#[test]
fn the_poll_is_told_each_vcpus_out_time_from_the_board() {
    // The classifier must not judge a thread CPU-bound on time its vCPU was out.
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    let mut vm = Vm::new();
    contended(&mut vm);
    vm.step(&mut e, &mut f, 100 * MS, 0);
    vm.step(&mut e, &mut f, 100 * MS, 0);
    assert_eq!(f.polls, 2);
    assert_eq!(f.polled_out_ns, [(0, vm.inactive), (1, 0)]);
    assert!(vm.inactive > 0);
}

#[test]
fn new_tasks_are_taken_over_and_tasks_that_leave_are_handed_back() {
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    let mut vm = Vm::new();
    f.window = vec![io_task(10), io_task(11)];
    let nap = vm.step(&mut e, &mut f, 5 * MS, 0);
    assert_eq!(f.published_tids(), [10, 11]);
    assert_eq!(f.managed.len(), 2, "both journaled before they may move");
    assert_eq!(f.demand, Some(Demand::Active));
    assert_eq!(
        nap,
        Duration::from_millis(5),
        "a window while tasks are moved"
    );
    // Our own threads are never taken over.
    let mut own = io_task(12);
    own.task.tgid = 99;
    f.window = vec![io_task(11), own];
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert_eq!(f.published_tids(), [11]);
    assert_eq!(f.released, [10]);
    f.window = Vec::new();
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert!(f.published.is_empty());
    assert_eq!(f.released, [10, 11]);
    assert_eq!(f.demand, Some(Demand::Idle));
    assert_eq!(e.snapshot().releases, 2);
}

#[test]
fn a_host_hold_anchors_the_io_bound_tasks_and_its_end_hands_them_back() {
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    let mut vm = Vm::new();
    f.window = vec![io_task(10)];
    vm.held = vec![1];
    vm.step(&mut e, &mut f, 5 * MS, 0);
    let s = e.snapshot();
    assert!(s.host_holds);
    assert!(!s.moves_allowed, "nothing else moves them");
    assert!(
        f.published.is_empty(),
        "the monitor threads leave them alone"
    );
    assert_eq!(
        f.managed.get(&10),
        Some(&Some(1)),
        "anchored on the held vCPU"
    );
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert!(
        f.released.is_empty(),
        "anchored tasks stay while the hold lasts"
    );
    vm.held = Vec::new();
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert!(!e.snapshot().host_holds);
    assert!(e.snapshot().moves_allowed);
    assert_eq!(f.published_tids(), [10], "managed again as moves allow");
    assert!(f.released.is_empty(), "kept: managed now");
    // The same end of a hold for a task that is not I/O-bound any more: handed back.
    vm.held = vec![1];
    vm.step(&mut e, &mut f, 5 * MS, 0);
    f.window = Vec::new();
    vm.held = Vec::new();
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert_eq!(f.released, [10]);
}

#[test]
fn a_follower_moves_only_onto_what_the_host_holds() {
    let mut e = Engine::new(
        EngineConfig {
            own_moves: false,
            ..config()
        },
        Mono::default(),
    );
    let mut f = Fake::new();
    let mut vm = Vm::new();
    // Its completions land on vCPU 1: a daemon of its own judgement keeps it there.
    f.window = vec![io_task_completing_on(10, 1, 1.0)];
    vm.step(&mut e, &mut f, 5 * MS, 0);
    vm.step(&mut e, &mut f, 5 * MS, 0);
    let s = e.snapshot();
    assert!(!s.moves_allowed);
    assert_eq!(s.gate, MoveGate::FollowsHost);
    assert!(f.managed.is_empty(), "nothing taken over: {:?}", f.managed);
    assert!(f.published.is_empty());
    vm.held = vec![1];
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert_eq!(
        f.managed.get(&10),
        Some(&Some(1)),
        "anchored where the host holds"
    );
    assert_eq!(e.snapshot().gate, MoveGate::HostHolds);
    vm.held = Vec::new();
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert_eq!(f.released, [10], "the hold over: handed back, not moved on");
    assert!(f.published.is_empty());
    assert_eq!(e.snapshot().gate, MoveGate::FollowsHost);
}

/// The default sampled tracking: 250 ms of every 2.5 s.
fn sampled() -> EngineConfig {
    EngineConfig {
        schedule: Some(Schedule {
            length: Duration::from_millis(250),
            every: Duration::from_millis(2_500),
        }),
        ..config()
    }
}

#[test]
fn sampled_tracking_pauses_after_a_sample_and_resumes_for_the_next() {
    let mut e = Engine::new(sampled(), Mono::from_ns(1_000 * S));
    let mut f = Fake::new();
    let mut vm = Vm::new();
    let nap = vm.step(&mut e, &mut f, 100 * MS, 0);
    assert!(f.tracking);
    assert_eq!(
        nap,
        Duration::from_millis(40).min(Duration::from_millis(150))
    );
    let nap = vm.step(&mut e, &mut f, 200 * MS, 0);
    assert_eq!(f.pauses, 1);
    assert!(!e.snapshot().block_tracking);
    assert_eq!(
        nap,
        crate::sampling::DOORBELL_POLL,
        "the step that pauses looks at the doorbell at the next poll, not the next period"
    );
    let nap = vm.step(&mut e, &mut f, 1_000 * MS, 0);
    assert_eq!(
        nap,
        crate::sampling::DOORBELL_POLL,
        "paused where moves may pay: looking at the doorbell every poll"
    );
    vm.step(&mut e, &mut f, 1_150 * MS, 0);
    assert_eq!(f.resumes, 0, "no ring, no sample before the period");
    vm.step(&mut e, &mut f, 50 * MS, 0);
    assert_eq!(f.resumes, 1);
    assert!(f.tracking);
    assert_eq!(e.snapshot().early_samples, 0);
}

#[test]
fn the_doorbell_starts_a_whole_sample_between_periods() {
    let mut e = Engine::new(sampled(), Mono::from_ns(1_000 * S));
    let mut f = Fake::new();
    let mut vm = Vm::new();
    vm.step(&mut e, &mut f, 100 * MS, 0);
    vm.step(&mut e, &mut f, 200 * MS, 0);
    assert_eq!(f.pauses, 1);
    vm.step(&mut e, &mut f, 400 * MS, 0);
    assert_eq!(f.resumes, 0);
    // A quiet thread issues block I/O 700 ms into the period.
    f.doorbell = true;
    vm.step(&mut e, &mut f, 50 * MS, 0);
    assert_eq!(f.resumes, 1, "sampling at the next poll");
    assert!(f.tracking);
    assert_eq!(e.snapshot().early_samples, 1);
    vm.step(&mut e, &mut f, 200 * MS, 0);
    assert_eq!(f.pauses, 1, "the early sample runs its whole length");
    vm.step(&mut e, &mut f, 60 * MS, 0);
    assert_eq!(f.pauses, 2);
}

/// From a pause, how long (ms, in 50 ms polls) until the next sample starts.
fn ms_to_next_sample(e: &mut Engine, f: &mut Fake, vm: &mut Vm) -> u64 {
    let (resumes, mut waited) = (f.resumes, 0);
    while f.resumes == resumes && waited < 10_000 {
        vm.step(e, f, 50 * MS, 0);
        waited += 50;
    }
    waited
}

#[test]
fn a_sample_that_places_a_task_is_followed_by_another_a_sample_later_at_most_four_in_a_row() {
    let mut e = Engine::new(sampled(), Mono::from_ns(1_000 * S));
    let mut f = Fake::new();
    let mut vm = Vm::new();
    let mut gaps = Vec::new();
    // Each sample finds one task: a new one is placed, the same one again is not.
    for tid in [20, 21, 22, 23, 24, 25, 25, 26, 26] {
        f.window = vec![io_task(tid)];
        vm.step(&mut e, &mut f, 100 * MS, 0);
        assert!(f.managed.contains_key(&tid));
        vm.step(&mut e, &mut f, 200 * MS, 0);
        assert!(!f.tracking, "the sample ended");
        gaps.push(ms_to_next_sample(&mut e, &mut f, &mut vm));
    }
    assert_eq!(
        gaps,
        [250, 250, 250, 250, 2_200, 2_200, 2_200, 250, 2_200],
        "four follow-ups, then the period until a sample places nothing"
    );
    assert_eq!(e.snapshot().early_samples, 5);
}

#[test]
fn a_sample_runs_on_while_a_task_is_half_way_in_up_to_twice_its_length() {
    let mut e = Engine::new(sampled(), Mono::from_ns(1_000 * S));
    let mut f = Fake::new();
    f.entering = true;
    let mut vm = Vm::new();
    vm.step(&mut e, &mut f, 100 * MS, 0);
    vm.step(&mut e, &mut f, 200 * MS, 0);
    assert_eq!(f.pauses, 0, "still tracking 300 ms into the sample");
    vm.step(&mut e, &mut f, 150 * MS, 0);
    assert_eq!(f.pauses, 0);
    vm.step(&mut e, &mut f, 100 * MS, 0);
    assert_eq!(f.pauses, 1, "paused at twice the sample's length");
    // Decided: the next sample ends on time.
    f.entering = false;
    vm.step(&mut e, &mut f, 2_000 * MS, 0);
    assert_eq!(f.resumes, 1);
    vm.step(&mut e, &mut f, 260 * MS, 0);
    assert_eq!(f.pauses, 2);
}

/// An engine that manages tasks 10 and 11 (default configuration, one step).
fn managing_10_and_11() -> (Engine, Fake, Vm) {
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    let mut vm = Vm::new();
    f.window = vec![io_task(10), io_task(11)];
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert_eq!(f.published_tids(), [10, 11]);
    (e, f, vm)
}

#[test]
fn a_failed_poll_is_counted_and_leaves_the_managed_tasks_as_they_were() {
    let (mut e, mut f, mut vm) = managing_10_and_11();
    f.failing.insert("poll");
    f.window = Vec::new();
    for n in 1..=3 {
        let nap = vm.step(&mut e, &mut f, 5 * MS, 0);
        assert_eq!(e.snapshot().detector_errors, n);
        assert_eq!(nap, config().idle, "a failed poll waits an idle poll");
    }
    assert_eq!(
        f.published_tids(),
        [10, 11],
        "nothing decided on a failed poll"
    );
    assert!(f.released.is_empty(), "and nothing handed back for it");
    // The programs answer again: what they see now is decided on.
    f.failing.clear();
    f.window = vec![io_task(10)];
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert_eq!(f.published_tids(), [10]);
    assert_eq!(f.released, [11]);
}

#[test]
fn a_failed_pause_or_detach_is_counted_and_tried_again_at_the_next_step() {
    let mut e = gated_detaching_after_10s();
    let mut f = Fake::new();
    let mut vm = Vm::new();
    f.failing.extend(["pause", "detach"]);
    // Nothing contended: the programs should pause, and (nothing could gain since start)
    // detach at once.
    vm.run(&mut e, &mut f, 12, |_| 0);
    assert!(f.tracking && f.attached, "neither switch took");
    assert_eq!((f.pauses, f.detaches), (0, 0));
    let errors = e.snapshot().detector_errors;
    assert!(
        errors >= 100,
        "every step tries again: {errors} errors in 12 s of steps"
    );
    f.failing.remove("pause");
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert!(!f.tracking, "paused once pausing works");
    assert!(f.attached);
    f.failing.clear();
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert!(!f.attached, "detached once detaching works");
    assert_eq!(f.detaches, 1);
}

#[test]
fn a_task_whose_mask_someone_else_changed_is_handed_off_and_never_taken_again() {
    let (mut e, mut f, mut vm) = managing_10_and_11();
    // Someone else set task 10's mask: it is theirs from now on, found by the step's
    // audit (not by a next move: none may come).
    f.changed_outside.push(TaskId {
        tid: 10,
        start_time: 1,
    });
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert_eq!(
        f.published_tids(),
        [11],
        "no longer the monitor threads' to move"
    );
    assert_eq!(
        f.released,
        [10],
        "the executor is asked, and decides what is left to restore"
    );
    vm.run(&mut e, &mut f, 2, |_| 0);
    assert!(!f.managed.contains_key(&10), "never taken over again");
    assert!(!f.anchors.iter().any(|a| a.0 == 10), "nor kept anywhere");
    // A new task that reuses its tid (another start time) is a task like any other.
    let mut again = io_task(10);
    again.start_time = 2;
    f.window = vec![again, io_task(11)];
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert_eq!(f.published_tids(), [10, 11]);
}

#[test]
fn shutdown_hands_every_task_back_and_publishes_none() {
    let (_, mut f, _) = managing_10_and_11();
    assert_eq!(f.managed.len(), 2);
    release_everything(&mut f);
    assert!(f.published.is_empty());
    assert!(f.managed.is_empty());
    assert_eq!(f.released, [10, 11]);
}

/// An I/O-bound task whose last window's completions all landed on `cpu`, away from the
/// vCPU it submitted from (`remote` 1.0), or where it submitted (`remote` 0.0).
fn io_task_completing_on(tid: u32, cpu: u32, remote: f64) -> IoTaskInfo {
    let mut t = io_task(tid);
    t.task.completion = CompletionSite {
        cpu,
        remote_fraction: remote,
        count: 500,
        remote: (remote * 500.0) as u64,
    };
    t
}

#[test]
fn a_task_whose_completions_land_on_another_vcpu_is_pinned_there_and_not_given_to_the_planner() {
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0), io_task(11)];
    let mut vm = Vm::new();
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert_eq!(f.anchors.first(), Some(&(10, 1, Reason::Completion)));
    assert_eq!(f.managed.get(&10), Some(&Some(1)), "pinned to vCPU 1");
    assert_eq!(
        f.published_tids(),
        [11],
        "the planner moves only the other task"
    );
    assert!(f.released.is_empty());
    assert_eq!(
        e.snapshot().kept_with_completions,
        [KeptTask {
            tid: 10,
            tgid: 10,
            cpu: 1
        }],
        "status shows it"
    );
    assert_eq!(
        f.short_slices,
        [10],
        "only the kept task gets a short slice"
    );
    // Pinned there it submits and completes on vCPU 1: it stays, nothing is re-managed.
    let managed_before = f.anchors.len();
    f.window = vec![io_task_completing_on(10, 1, 0.0), io_task(11)];
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert_eq!(f.published_tids(), [11]);
    assert!(f.released.is_empty(), "kept, not handed back");
    assert!(
        f.anchors[managed_before..]
            .iter()
            .all(|a| *a == (10, 1, Reason::Completion)),
        "kept on vCPU 1 and nothing else anchored: {:?}",
        &f.anchors[managed_before..]
    );
    // No longer I/O-bound: handed back like any managed task, after the grace.
    f.window = vec![io_task(11)];
    vm.run(&mut e, &mut f, KEEP_GRACE.as_secs() + 1, |_| 0);
    assert_eq!(f.released, [10]);
    assert!(f.short_slices.is_empty(), "no task is kept any more");
}

#[test]
fn a_task_kept_with_its_completions_outlasts_a_window_that_misses_it() {
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0)];
    let mut vm = Vm::new();
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert_eq!(f.managed.get(&10), Some(&Some(1)));
    // Its vCPU taken away through a whole sample: the classifier lets it go for a while.
    f.window = Vec::new();
    vm.run(&mut e, &mut f, KEEP_GRACE.as_secs() - 1, |_| 0);
    assert!(f.released.is_empty(), "handed back at the first miss");
    assert_eq!(f.managed.get(&10), Some(&Some(1)), "still pinned");
    assert_eq!(
        e.snapshot().kept_with_completions,
        [KeptTask {
            tid: 10,
            tgid: 10,
            cpu: 1
        }]
    );
    assert!(
        f.published_tids().is_empty(),
        "never the planner's meanwhile"
    );
    // Found again within the grace: the grace starts over.
    f.window = vec![io_task_completing_on(10, 1, 0.0)];
    vm.run(&mut e, &mut f, 1, |_| 0);
    f.window = Vec::new();
    vm.run(&mut e, &mut f, KEEP_GRACE.as_secs() - 1, |_| 0);
    assert!(f.released.is_empty());
    // Gone for longer than the grace: handed back.
    vm.run(&mut e, &mut f, 2, |_| 0);
    assert_eq!(f.released, [10]);
    assert!(e.snapshot().kept_with_completions.is_empty());
    // Excluded by a reload while missing from a window: handed back at once.
    f.window = vec![io_task_completing_on(11, 1, 1.0)];
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert_eq!(f.managed.get(&11), Some(&Some(1)));
    f.window = Vec::new();
    e.set_exclude_comm(vec!["fio".into()]);
    vm.step(&mut e, &mut f, 100 * MS, 0);
    assert_eq!(f.released, [10, 11]);
}

#[test]
fn a_keep_the_placement_cannot_make_is_the_planners_at_once_or_handed_back_where_only_keeps_stay() {
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0)];
    f.unpinnable.insert(10);
    let mut vm = Vm::new();
    vm.step(&mut e, &mut f, 100 * MS, 0);
    assert_eq!(f.published_tids(), [10], "the planner's in the same step");
    assert_eq!(f.demand, Some(Demand::Active));
    assert!(f.short_slices.is_empty());
    assert!(e.snapshot().kept_with_completions.is_empty());
    f.unpinnable.clear();
    vm.step(&mut e, &mut f, 100 * MS, 0);
    assert_eq!(f.managed.get(&10), Some(&Some(1)), "kept once it can be");
    assert!(f.published.is_empty());
    // With vCPUs out all at once only keeps stay: the task taken over is handed back at
    // once, and not taken again while it is found.
    let mut e = Engine::new(gated(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0)];
    f.unpinnable.insert(10);
    let mut vm = Vm::new();
    vm.out_per_s = S / 2;
    vm.run(&mut e, &mut f, 5, |_| 0);
    assert_eq!(f.released, [10]);
    assert!(!f.managed.contains_key(&10));
    assert!(f.published.is_empty());
    assert_eq!(e.snapshot().io_bound_tasks, 0);
}

#[test]
fn the_decision_is_a_value_made_without_the_placement() {
    let mut e = Engine::new(config(), Mono::default());
    e.window.fresh = true;
    let found = vec![io_task_completing_on(10, 1, 1.0), io_task(11)];
    let eligible: Vec<&IoTaskInfo> = found.iter().collect();
    let entry = |tid: u32| TaskEntry {
        tid,
        tgid: tid,
        start_time: 1,
        comm: "fio".into(),
        load: 0.9,
        priority: 0,
        last_cpu: 0,
        allowed: vec![0, 1],
    };
    e.tasks.current = Arc::new(vec![entry(12)]);
    let facts = tasks::Facts {
        now: Mono::from_ns(S),
        found: &found,
        eligible: &eligible,
        held: &[],
        hands_off: &HashSet::new(),
        moves_allowed: true,
        together: false,
    };
    let (managed, d) = e.decide(&facts, vec![entry(10), entry(11)]);
    assert_eq!(managed.len(), 2);
    assert_eq!(d.keep.len(), 1);
    assert_eq!((d.keep[0].pin.task.tid, d.keep[0].cpu), (10, 1));
    assert_eq!(
        d.keep[0].pin.otherwise,
        decision::Otherwise::Planner(entry(10)),
        "the planner's if it cannot be pinned"
    );
    assert_eq!(d.publish, [entry(11)]);
    assert_eq!(d.release.len(), 1);
    assert_eq!(
        (d.release[0].tid, d.release[0].why),
        (12, decision::Why::NotIoBound)
    );
}

#[test]
fn a_pinned_partner_or_held_task_whose_pin_fails_is_handed_back_in_the_same_step() {
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0)];
    f.partners = vec![partner(10, 20, "pgbench")];
    let mut vm = Vm::new();
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert_eq!(f.managed.get(&20), Some(&Some(1)));
    f.unpinnable.insert(20);
    vm.step(&mut e, &mut f, 100 * MS, 0);
    assert_eq!(f.released, [20]);
    assert_eq!(f.short_slices, [10], "its short slice goes too");
    // A task anchored on a held vCPU that can no longer be pinned there.
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    let mut vm = Vm::new();
    f.window = vec![io_task(10)];
    vm.held = vec![1];
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert_eq!(f.managed.get(&10), Some(&Some(1)));
    f.unpinnable.insert(10);
    vm.step(&mut e, &mut f, 5 * MS, 0);
    assert_eq!(f.released, [10]);
}

#[test]
fn a_task_whose_completions_follow_it_is_left_to_the_planner() {
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 0, 0.0)];
    let mut vm = Vm::new();
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert!(f.anchors.is_empty(), "{:?}", f.anchors);
    assert_eq!(f.published_tids(), [10]);
}

#[test]
fn the_guard_keeps_completion_pins_that_do_not_lose_and_decides_after_one_pair() {
    let mut e = Engine::new(guarded(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0)];
    let mut vm = Vm::new();
    // 2% more with them: chasing moves would be held back (they must gain 3%), these
    // are kept at the first pair they win.
    let t0 = vm.now;
    while e.snapshot().guard_verdicts == GuardVerdicts::default() && vm.now < t0 + 10 * S {
        let moves = e.snapshot().moves_allowed;
        vm.step(&mut e, &mut f, 100 * MS, if moves { 1020 } else { 1000 });
    }
    assert_eq!(
        e.snapshot().guard_verdicts,
        GuardVerdicts { pays: 1, holds: 0 }
    );
    assert!(
        vm.now - t0 <= 3_300 * MS,
        "verdict after {} ms: a settling epoch and one pair of 1 s epochs",
        (vm.now - t0) / MS
    );
    vm.run(&mut e, &mut f, 5, |_| 1000);
    assert!(e.snapshot().moves_allowed);
    assert_eq!(f.managed.get(&10), Some(&Some(1)));
}

#[test]
fn the_guard_holds_completion_pins_that_lose_every_pair() {
    let mut e = Engine::new(guarded(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0)];
    let mut vm = Vm::new();
    let t0 = vm.now;
    while e.snapshot().guard_verdicts == GuardVerdicts::default() && vm.now < t0 + 20 * S {
        let moves = e.snapshot().moves_allowed;
        vm.step(&mut e, &mut f, 100 * MS, if moves { 500 } else { 1000 });
    }
    assert_eq!(
        e.snapshot().guard_verdicts,
        GuardVerdicts { pays: 0, holds: 1 }
    );
    vm.run(&mut e, &mut f, 1, |_| 1000);
    assert!(!e.snapshot().moves_allowed);
    assert!(f.released.contains(&10), "handed back while held");
}

fn partner(of: u32, tid: u32, comm: &str) -> task_detector::Partner {
    task_detector::Partner {
        of,
        tid,
        tgid: tid,
        comm: comm.into(),
        start_time: 7,
        wakes: 200,
    }
}

#[test]
fn a_kept_tasks_partner_is_kept_beside_it_and_handed_back_with_it() {
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0), io_task(11)];
    // 20 is the kept task's client; 21 partners the unkept task 11; 99's own thread is
    // never touched; an excluded command neither.
    f.partners = vec![
        partner(10, 20, "pgbench"),
        partner(11, 21, "other"),
        partner(10, 99, "vmigrater"),
    ];
    let mut vm = Vm::new();
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert!(
        f.anchors.contains(&(20, 1, Reason::Partner)),
        "{:?}",
        f.anchors
    );
    assert!(
        !f.anchors.iter().any(|a| a.0 == 21 || a.0 == 99),
        "only partners of kept tasks, never our own: {:?}",
        f.anchors
    );
    assert_eq!(f.managed.get(&20), Some(&Some(1)));
    let mut slices = f.short_slices.clone();
    slices.sort_unstable();
    assert_eq!(slices, [10, 20], "the partner shares the short slice");
    assert!(!f.published_tids().contains(&20), "not the planner's");
    // The kept task leaves: after its grace both are handed back.
    f.window = vec![io_task(11)];
    f.partners.clear();
    vm.run(&mut e, &mut f, KEEP_GRACE.as_secs() + 1, |_| 0);
    assert!(
        f.released.contains(&10) && f.released.contains(&20),
        "{:?}",
        f.released
    );
    assert!(!f.managed.contains_key(&20));
}

#[test]
fn partners_off_keeps_the_task_alone() {
    let mut e = Engine::new(
        EngineConfig {
            keep_partners: false,
            ..config()
        },
        Mono::default(),
    );
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0)];
    f.partners = vec![partner(10, 20, "pgbench")];
    let mut vm = Vm::new();
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert!(f.anchors.contains(&(10, 1, Reason::Completion)));
    assert!(!f.anchors.iter().any(|a| a.0 == 20), "{:?}", f.anchors);
}

#[test]
fn an_excluded_partner_or_an_io_bound_one_is_not_kept_as_a_partner() {
    let mut e = Engine::new(
        EngineConfig {
            exclude_comm: vec!["backup".into()],
            ..config()
        },
        Mono::default(),
    );
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0), io_task(11)];
    f.partners = vec![partner(10, 30, "backup"), partner(10, 11, "fio")];
    let mut vm = Vm::new();
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert!(!f.anchors.iter().any(|a| a.0 == 30), "{:?}", f.anchors);
    assert!(
        !f.anchors
            .iter()
            .any(|a| a.0 == 11 && a.2 == Reason::Partner),
        "an I/O-bound partner is placed by its own rule: {:?}",
        f.anchors
    );
}

#[test]
fn the_children_a_pinned_task_started_are_handed_to_the_placement_at_the_next_poll() {
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    f.window = vec![io_task_completing_on(10, 1, 1.0)];
    let mut vm = Vm::new();
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert_eq!(f.managed.get(&10), Some(&Some(1)), "pinned to vCPU 1");
    let fork = |child, parent| ForkSample {
        child,
        child_tgid: child,
        parent,
        mask: 0b10,
    };
    f.forks = vec![fork(20, 10), fork(30, 77)];
    vm.step(&mut e, &mut f, 100 * MS, 0);
    assert_eq!(
        f.forks_seen,
        [fork(20, 10), fork(30, 77)],
        "every fork, once"
    );
    assert_eq!(
        e.snapshot().inherited_pins_undone,
        1,
        "the pinned task's child only"
    );
    vm.run(&mut e, &mut f, 1, |_| 0);
    assert_eq!(f.forks_seen.len(), 2);
    assert_eq!(e.snapshot().inherited_pins_undone, 1);
}

#[test]
fn a_step_switches_the_programs_then_polls_sets_back_inherited_pins_then_decides_on_tasks() {
    let mut e = Engine::new(config(), Mono::default());
    let mut f = Fake::new();
    f.tracking = false;
    f.window = vec![io_task(10)];
    f.forks = vec![ForkSample {
        child: 20,
        child_tgid: 20,
        parent: 10,
        mask: 0b10,
    }];
    Vm::new().step(&mut e, &mut f, 100 * MS, 0);
    // Set back before any task is taken over: the executor then answers with a child's
    // own mask.
    assert_eq!(
        f.calls,
        [
            "resume",
            "poll",
            "undo inherited",
            "manage 10",
            "short slices",
            "publish",
            "demand"
        ]
    );
}

#[test]
fn a_detach_that_fails_is_followed_by_a_pause_in_the_same_step() {
    let mut e = gated_detaching_after_10s();
    let mut f = Fake::new();
    let mut vm = Vm::new();
    f.failing.extend(["pause", "detach"]);
    vm.run(&mut e, &mut f, 3, |_| 0);
    assert!(f.tracking && f.attached, "neither switch took");
    f.failing.remove("pause");
    f.calls.clear();
    vm.step(&mut e, &mut f, 100 * MS, 0);
    assert_eq!(f.calls[..2], ["detach", "pause"]);
    assert!(!f.tracking && f.attached);
}

#[test]
fn a_sample_that_starts_on_its_period_clears_the_doorbell_before_it_resumes() {
    let mut e = Engine::new(sampled(), Mono::from_ns(1_000 * S));
    let mut f = Fake::new();
    let mut vm = Vm::new();
    vm.step(&mut e, &mut f, 300 * MS, 0);
    assert!(!f.tracking, "the first sample is over");
    vm.step(&mut e, &mut f, 2_100 * MS, 0);
    f.calls.clear();
    vm.step(&mut e, &mut f, 100 * MS, 0);
    // Read (no ring), then cleared: a ring from before the sample is not an early one.
    assert_eq!(f.calls[..4], ["doorbell", "doorbell", "resume", "poll"]);
    assert_eq!(e.snapshot().early_samples, 0);
}

#[test]
fn the_nap_rule_as_a_table() {
    let (window, idle, limit) = (
        Duration::from_millis(5),
        Duration::from_millis(40),
        Duration::from_millis(2_000),
    );
    // (tracking, managing, io_seen, moves_allowed, contended, probing) → nap
    type Row = ((bool, bool, bool, bool, bool, bool), Duration);
    let rows: &[Row] = &[
        // Tracking where tasks may move, with a task or I/O: every window decides.
        ((true, true, false, true, true, false), window),
        ((true, false, true, true, true, false), window),
        // Tracking with nothing to move, or moves on hold: the idle poll.
        ((true, false, false, true, true, false), idle),
        ((true, true, true, false, true, true), idle),
        // Paused: nothing to measure without contention, or without a probe.
        ((false, false, false, false, false, false), limit),
        ((false, true, true, true, true, false), limit),
        // Paused while the guard probes under contention: its epochs need counting.
        ((false, false, false, false, true, true), idle),
    ];
    for &((tracking, managing, io_seen, moves_allowed, contended, probing), want) in rows {
        let f = NapFacts {
            tracking,
            managing,
            io_seen,
            moves_allowed,
            contended,
            probing,
        };
        assert_eq!(nap(&f, window, idle, limit), want, "{f:?}");
    }
    // Never past the limit (the next sample is sooner than a window).
    let f = NapFacts {
        tracking: true,
        managing: true,
        io_seen: true,
        moves_allowed: true,
        contended: true,
        probing: false,
    };
    let soon = Duration::from_millis(2);
    assert_eq!(nap(&f, window, idle, soon), soon);
    assert_eq!(
        nap(
            &NapFacts {
                tracking: false,
                ..f
            },
            window,
            idle,
            soon
        ),
        soon
    );
}
