//! `vmigrater explain`: why a thread is or is not moved, in the engine's own terms. The
//! daemon's status report says what the engine decided (the move gate, what the detector
//! found, who is managed, kept, beside a partner or hands off); /proc says what the thread
//! is (its process, mask, class). `explain` joins the two without asking anything else of
//! the daemon, and is pure: the tests give it reports and threads.

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::fmt::Write as _;

use crate::status::{GateReport, SeenStatus, StatusReport};

/// What /proc says about a thread.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Thread {
    pub tid: u32,
    pub tgid: u32,
    pub comm: String,
    pub kernel: bool,
    /// The CPUs its mask allows (a cpuset narrows the mask too).
    pub allowed: Vec<usize>,
    /// Scheduling class: `other`, `batch`, `idle`, `fifo`, `rr` or `deadline`.
    pub class: String,
}

/// The rule that decides a thread's fate, first match in the order of `explain`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Managed by the planner: moved to a running vCPU when its own goes out.
    Managed,
    /// Managed, but its own mask allows one vCPU: nowhere to move it.
    OneVcpu,
    /// Pinned to the vCPU that takes its requests' completions.
    KeptWithCompletions,
    /// A partner of an I/O-bound task: it follows that task where the task is kept.
    Partner,
    /// One of the daemon's own threads.
    Daemon,
    /// A kernel thread: only user threads are measured and moved.
    KernelThread,
    /// Someone else changed its mask after the daemon: left alone while it lives.
    HandsOff,
    /// Found I/O-bound, but its command is in `migration.exclude_comm`.
    Excluded,
    /// The host agent favours the vCPUs that hold the I/O: tasks stay where they are.
    HostHolds,
    /// The daemon moves tasks only where the host agent holds vCPUs (`follow_host`).
    FollowsHost,
    /// No vCPU is out while another runs often enough for a move to pay.
    NotContended,
    /// The move guard measured that moves did not pay; none until its next probe.
    GuardHolding,
    /// The move guard is measuring, and this epoch runs without moves.
    GuardProbing,
    /// vCPUs go out all at once: only tasks whose completions land on one vCPU are kept.
    OutTogether,
    /// Found in the detector's last window; the next step takes it over.
    Pending,
    /// The block programs are detached: no thread's I/O is measured now.
    BlockDetached,
    /// The detector did not find it I/O-bound in its last window.
    NotIoBound,
}

/// One thread, explained.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Explanation {
    pub thread: Thread,
    /// What the detector saw in its last window (`None`: not I/O-bound there).
    pub detector: Option<SeenStatus>,
    /// The vCPU the daemon has it on, where it placed or kept it.
    pub placed_on: Option<usize>,
    pub reason: Reason,
    pub why: String,
    pub would_change: String,
}

fn percent(f: f64) -> String {
    format!("{:.0}%", f * 100.0)
}

/// A rule's verdict: the reason, where the daemon has the thread, why, what would change it.
type Verdict = (Reason, Option<usize>, String, String);

/// Why `t` is or is not moved by the daemon that wrote `r`.
pub fn explain(r: &StatusReport, t: &Thread) -> Explanation {
    let seen = r.seen.iter().find(|s| s.tid == t.tid).cloned();
    let (reason, placed_on, why, would_change) = if t.tgid == r.pid {
        (
            Reason::Daemon,
            None,
            "one of the daemon's own threads: it never manages itself".into(),
            "nothing".into(),
        )
    } else if t.kernel {
        (
            Reason::KernelThread,
            None,
            "a kernel thread: only user threads are measured and moved".into(),
            "nothing".into(),
        )
    } else if r.hands_off.contains(&t.tid) {
        // Before the placement lists: the hook lets go at once, while the engine's list
        // of managed tasks still names the thread until its next tick.
        hands_off()
    } else {
        placed(r, t).unwrap_or_else(|| left(r, seen.as_ref()))
    };
    Explanation {
        thread: t.clone(),
        detector: seen,
        placed_on,
        reason,
        why,
        would_change,
    }
}

fn found(s: &SeenStatus) -> String {
    format!(
        "the detector found it I/O-bound (a request in flight {} of its last window, {:.0} requests/s, {} on a CPU)",
        percent(s.io_fraction),
        s.iops,
        percent(s.cpu_fraction)
    )
}

/// A thread the daemon has: kept, managed, or a partner of an I/O-bound task.
fn placed(r: &StatusReport, t: &Thread) -> Option<Verdict> {
    let sim = if r.dry_run {
        " (dry run: the placement is simulated, no mask is changed)"
    } else {
        ""
    };
    if let Some(k) = r.kept_with_completions.iter().find(|k| k.tid == t.tid) {
        return Some((
            Reason::KeptWithCompletions,
            Some(k.cpu),
            format!(
                "kept on vCPU {}, which takes its requests' completions: each completion wakes it where it runs{sim}",
                k.cpu
            ),
            "its completions moving to another vCPU, or its I/O ending (it is then handed back with its own mask)".into(),
        ));
    }
    if let Some(m) = r.tasks.iter().find(|m| m.tid == t.tid) {
        return Some(if m.allowed.len() <= 1 {
            (
                Reason::OneVcpu,
                m.placed_on,
                format!(
                    "managed, but its own mask allows only {}: the planner has no other vCPU to move it to",
                    cpus(&m.allowed)
                ),
                "allowing it more vCPUs (taskset, or the cpuset of its cgroup)".into(),
            )
        } else {
            (
                Reason::Managed,
                m.placed_on,
                format!(
                    "managed: when its vCPU goes out, the planner moves it to a running one among {}{}{sim}",
                    cpus(&m.allowed),
                    m.placed_on
                        .map_or(String::new(), |c| format!("; now on vCPU {c}"))
                ),
                "its I/O ending, or moves going on hold (the move guard, the host agent's hold, no contention)".into(),
            )
        });
    }
    let p = r.partners.iter().find(|p| p.tid == t.tid)?;
    let beside = r.kept_with_completions.iter().find(|k| k.tid == p.of);
    Some((
        Reason::Partner,
        beside.map(|k| k.cpu),
        match beside {
            Some(k) => format!(
                "a partner of I/O-bound thread {} (they wake each other): kept beside it on vCPU {}{sim}",
                p.of, k.cpu
            ),
            None => format!(
                "a partner of I/O-bound thread {} (they wake each other); it follows that thread only while the thread is kept with its completions, which it is not now",
                p.of
            ),
        },
        format!(
            "thread {} being kept with its completions (with migration.keep_partners on), or the two no longer waking each other",
            p.of
        ),
    ))
}

fn hands_off() -> Verdict {
    (
        Reason::HandsOff,
        None,
        "someone else changed its CPU mask after the daemon did: the daemon leaves it alone for as long as it lives".into(),
        "nothing while it lives (a restarted process is a new task)".into(),
    )
}

/// A thread the daemon leaves where it is: the rule that leaves it.
fn left(r: &StatusReport, seen: Option<&SeenStatus>) -> Verdict {
    if let Some(s) = seen {
        if s.excluded {
            return (
                Reason::Excluded,
                None,
                format!(
                    "{}, but its command `{}` is in migration.exclude_comm",
                    found(s),
                    s.comm
                ),
                "removing it from migration.exclude_comm (`systemctl reload vmigrater` applies it)"
                    .into(),
            );
        }
        return gated(r, &found(s));
    }
    if !r.block_attached {
        return (
            Reason::BlockDetached,
            None,
            "the block programs are detached (after a long time with nothing to gain, or while the move guard holds): no thread's I/O is measured now".into(),
            "vCPUs being descheduled while others run: the programs attach again".into(),
        );
    }
    match r.move_gate {
        // Found or not, nothing would move it: that is what the operator must know first.
        GateReport::FollowsHost => (
            Reason::FollowsHost,
            None,
            "this daemon moves tasks only onto the vCPUs the host agent holds (migration.follow_host), and it holds none".into(),
            "the host agent holding a vCPU for the guest's I/O (its replies saying `held`)".into(),
        ),
        GateReport::NotContended => (
            Reason::NotContended,
            None,
            format!(
                "no vCPU is out while another runs often enough for a move to pay{}",
                if r.block_tracking {
                    "; nor did the detector find it I/O-bound in its last window"
                } else {
                    ", so the block programs do not track: no thread's I/O is measured now"
                }
            ),
            "the hypervisor descheduling vCPUs while others run (steal time)".into(),
        ),
        GateReport::GuardHolding if !r.block_tracking => (
            Reason::GuardHolding,
            None,
            format!(
                "the move guard measured fewer block completions with moves than without and holds moves for {:.0} s more; until shortly before its next probe no thread's I/O is measured",
                r.guard_hold_remaining_s
            ),
            "the guard's next probe finding that moves pay".into(),
        ),
        _ => (
            Reason::NotIoBound,
            None,
            format!(
                "the detector did not find it I/O-bound in its last window: that takes block requests in flight for a quarter of the window or more, or a high request rate, two windows in a row{}",
                if r.block_tracking {
                    ""
                } else {
                    " (the programs sample: they track for a while, then pause)"
                }
            ),
            "the thread waiting on block I/O (reads served from the page cache are not)".into(),
        ),
    }
}

/// For a thread found I/O-bound, eligible and not managed: the step's gate.
fn gated(r: &StatusReport, found: &str) -> Verdict {
    match r.move_gate {
        GateReport::HostHolds => (
            Reason::HostHolds,
            None,
            format!("{found}, but the host agent favours the vCPUs that hold the I/O: tasks stay where they are"),
            "the host ending its hold (its replies stop saying `held`)".into(),
        ),
        GateReport::FollowsHost => (
            Reason::FollowsHost,
            None,
            format!("{found}, but this daemon moves tasks only onto the vCPUs the host agent holds (migration.follow_host), and it holds none"),
            "the host agent holding a vCPU for the guest's I/O (its replies saying `held`)".into(),
        ),
        GateReport::NotContended => (
            Reason::NotContended,
            None,
            format!("{found}, but no vCPU is out while another runs often enough for a move to pay"),
            "the hypervisor descheduling vCPUs while others run (steal time)".into(),
        ),
        GateReport::GuardHolding => (
            Reason::GuardHolding,
            None,
            format!(
                "{found}, but the move guard measured fewer block completions with moves than without: no moves for {:.0} s more",
                r.guard_hold_remaining_s
            ),
            "the guard's next probe finding that moves pay".into(),
        ),
        GateReport::GuardProbing => (
            Reason::GuardProbing,
            None,
            format!("{found}; the move guard is measuring with and without moves, and this epoch runs without"),
            "the probe's end: moves resume if they paid".into(),
        ),
        GateReport::Open if r.out_together => (
            Reason::OutTogether,
            None,
            format!("{found}, but vCPUs go out all at once: only tasks whose completions are known to land on one vCPU are kept there, and no other moves pay"),
            "its completions settling on one vCPU, or vCPUs going out one at a time".into(),
        ),
        GateReport::Open => (
            Reason::Pending,
            None,
            format!("{found} in its last window; the next step takes it over"),
            "nothing: wait a second".into(),
        ),
    }
}

fn cpus(c: &[usize]) -> String {
    match c {
        [] => "no vCPU".into(),
        [one] => format!("vCPU {one}"),
        many => format!(
            "vCPUs {}",
            many.iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ),
    }
}

/// The daemon as a whole: whether it moves tasks now and what stops it.
pub fn overall(r: &StatusReport) -> Vec<String> {
    let mut out = Vec::new();
    out.push(format!(
        "vmigrater {} (pid {}), up {:.0} s{}",
        r.version,
        r.pid,
        r.uptime_s,
        if r.dry_run {
            ", DRY RUN: plans and logs moves, changes no mask"
        } else {
            ""
        }
    ));
    out.push(if r.block_attached {
        format!(
            "block programs attached ({}), {}",
            crate::status::name_of(&r.attach_mode),
            if r.block_tracking {
                "tracking now"
            } else {
                "not tracking now (between samples, or nothing to gain)"
            }
        )
    } else {
        "block programs detached: no thread's I/O is measured (they attach again when vCPUs are descheduled while others run)".into()
    });
    let gate = match r.move_gate {
        GateReport::Open if r.out_together => {
            "moves: vCPUs go out all at once, so only tasks kept with their completions are managed"
                .to_string()
        }
        GateReport::Open => "moves: allowed".into(),
        GateReport::HostHolds => {
            "moves: on hold, the host agent favours the vCPUs that hold the I/O".into()
        }
        GateReport::FollowsHost => {
            "moves: only where the host agent holds vCPUs (migration.follow_host); it holds none"
                .into()
        }
        GateReport::NotContended => {
            "moves: none, no vCPU is out while another runs often enough for a move to pay".into()
        }
        GateReport::GuardHolding => format!(
            "moves: held by the move guard (moves did not pay), {:.0} s until its next probe",
            r.guard_hold_remaining_s
        ),
        GateReport::GuardProbing => {
            "moves: the move guard is measuring with and without moves".into()
        }
    };
    out.push(gate);
    out.push(format!(
        "guard verdicts: {} paid, {} did not",
        r.guard_pays, r.guard_holds
    ));
    let seen: Vec<String> = r
        .seen
        .iter()
        .map(|s| {
            format!(
                "{} ({}){}",
                s.tid,
                s.comm,
                if s.excluded { " excluded" } else { "" }
            )
        })
        .collect();
    out.push(format!(
        "I/O-bound in the last window: {}",
        if seen.is_empty() {
            "none".to_string()
        } else {
            seen.join(", ")
        }
    ));
    out.push(format!(
        "managed {}, kept with completions {}, partners {}, hands off {}",
        r.tasks.len(),
        r.kept_with_completions.len(),
        r.partners.len(),
        r.hands_off.len()
    ));
    out.push(format!(
        "host channel: {}",
        if r.channel_connected {
            "connected"
        } else {
            "not connected"
        }
    ));
    out
}

/// A table of explanations, one block per thread.
pub fn render(r: &StatusReport, all: &[Explanation]) -> String {
    let mut s = String::new();
    for line in overall(r) {
        let _ = writeln!(s, "{line}");
    }
    for e in all {
        let t = &e.thread;
        let _ = writeln!(
            s,
            "\n{} {} (pid {}, {}, allowed {})",
            t.tid,
            t.comm,
            t.tgid,
            t.class,
            cpus(&t.allowed)
        );
        let _ = writeln!(s, "  {}: {}", crate::status::name_of(&e.reason), e.why);
        let _ = writeln!(s, "  would change: {}", e.would_change);
    }
    s
}

/// The threads `target` names: every thread of process PID (or thread PID alone when it
/// is not a process), or every thread whose command or whose process's command is COMM.
pub fn threads(target: &str) -> Result<Vec<Thread>> {
    let proc = std::path::Path::new("/proc");
    let mut out = Vec::new();
    if let Ok(pid) = target.parse::<u32>() {
        let task_dir = proc.join(pid.to_string()).join("task");
        let tids: Vec<u32> = match std::fs::read_dir(&task_dir) {
            Ok(d) if tgid_of(pid) == Some(pid) => d
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect(),
            _ => vec![pid],
        };
        for tid in tids {
            if let Some(t) = thread(tid) {
                out.push(t);
            }
        }
        if out.is_empty() {
            bail!("no thread or process {pid} (is it still running?)");
        }
    } else {
        // Names first (one read each); the facts only of the threads that match.
        let comm = |dir: &std::path::Path| {
            std::fs::read_to_string(dir.join("comm"))
                .map(|c| c.trim_end_matches('\n').to_string())
                .ok()
        };
        for e in std::fs::read_dir(proc).context("reading /proc")? {
            let Some(pid) = e
                .ok()
                .and_then(|e| e.file_name().to_str()?.parse::<u32>().ok())
            else {
                continue;
            };
            let pdir = proc.join(pid.to_string());
            let whole = comm(&pdir).as_deref() == Some(target);
            let Ok(tasks) = std::fs::read_dir(pdir.join("task")) else {
                continue;
            };
            for te in tasks.flatten() {
                let Some(tid) = te.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                if whole || comm(&te.path()).as_deref() == Some(target) {
                    out.extend(thread(tid));
                }
            }
        }
        if out.is_empty() {
            bail!("no thread or process named `{target}`");
        }
    }
    out.sort_by_key(|t| t.tid);
    Ok(out)
}

fn tgid_of(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

fn thread(tid: u32) -> Option<Thread> {
    let stat = os_layer::TaskStat::of_tid(tid)?;
    let class = match os_layer::sched::get_attr(tid).map(|a| a.sched_policy as i32) {
        Ok(libc::SCHED_OTHER) => "other",
        Ok(libc::SCHED_BATCH) => "batch",
        Ok(libc::SCHED_IDLE) => "idle",
        Ok(libc::SCHED_FIFO) => "fifo",
        Ok(libc::SCHED_RR) => "rr",
        Ok(6) => "deadline",
        _ => "unknown",
    };
    Some(Thread {
        tid,
        tgid: tgid_of(tid)?,
        kernel: stat.is_kernel_thread(),
        comm: stat.comm,
        allowed: os_layer::get_cpus(tid).unwrap_or_default(),
        class: class.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{KeptStatus, PartnerStatus, TaskStatus};

    fn report() -> StatusReport {
        StatusReport {
            pid: 100,
            block_attached: true,
            block_tracking: true,
            ..Default::default()
        }
    }

    fn thread(tid: u32, comm: &str) -> Thread {
        Thread {
            tid,
            tgid: tid,
            comm: comm.into(),
            kernel: false,
            allowed: vec![0, 1],
            class: "other".into(),
        }
    }

    fn seen(tid: u32, excluded: bool) -> SeenStatus {
        SeenStatus {
            tid,
            tgid: tid,
            comm: "reader".into(),
            io_fraction: 0.8,
            excluded,
            ..Default::default()
        }
    }

    fn reason(r: &StatusReport, t: &Thread) -> Reason {
        explain(r, t).reason
    }

    #[test]
    fn each_rule_in_its_order() {
        let mut r = report();
        let reader = thread(7, "reader");
        assert_eq!(reason(&r, &reader), Reason::NotIoBound);
        // Not found while nothing can gain: that is the reason, not the thread.
        r.move_gate = GateReport::NotContended;
        assert_eq!(reason(&r, &reader), Reason::NotContended);
        r.move_gate = GateReport::Open;
        r.block_tracking = false;
        assert_eq!(reason(&r, &reader), Reason::NotIoBound, "between samples");
        r.move_gate = GateReport::NotContended;
        assert_eq!(reason(&r, &reader), Reason::NotContended);
        r.move_gate = GateReport::GuardHolding;
        assert_eq!(reason(&r, &reader), Reason::GuardHolding);
        r.block_attached = false;
        assert_eq!(reason(&r, &reader), Reason::BlockDetached);
        r.block_attached = true;
        r.block_tracking = true;
        r.move_gate = GateReport::Open;

        r.seen = vec![seen(7, false)];
        assert_eq!(reason(&r, &reader), Reason::Pending);
        for (gate, want) in [
            (GateReport::NotContended, Reason::NotContended),
            (GateReport::HostHolds, Reason::HostHolds),
            (GateReport::FollowsHost, Reason::FollowsHost),
            (GateReport::GuardHolding, Reason::GuardHolding),
            (GateReport::GuardProbing, Reason::GuardProbing),
        ] {
            r.move_gate = gate;
            assert_eq!(reason(&r, &reader), want, "{gate:?}");
        }
        r.move_gate = GateReport::Open;
        r.out_together = true;
        assert_eq!(reason(&r, &reader), Reason::OutTogether);
        r.seen = vec![seen(7, true)];
        assert_eq!(reason(&r, &reader), Reason::Excluded);
        r.hands_off = vec![7];
        assert_eq!(reason(&r, &reader), Reason::HandsOff);
        // The engine's list still naming it until its next tick does not outvote the hook.
        r.tasks = vec![TaskStatus {
            tid: 7,
            allowed: vec![0, 1],
            ..Default::default()
        }];
        assert_eq!(reason(&r, &reader), Reason::HandsOff);
        r.tasks.clear();
        r.hands_off.clear();

        r.partners = vec![PartnerStatus {
            tid: 7,
            tgid: 7,
            comm: "reader".into(),
            of: 9,
        }];
        assert_eq!(reason(&r, &reader), Reason::Partner);
        assert_eq!(explain(&r, &reader).placed_on, None);
        r.kept_with_completions = vec![KeptStatus { tid: 9, cpu: 1 }];
        assert_eq!(explain(&r, &reader).placed_on, Some(1), "beside its task");

        r.tasks = vec![TaskStatus {
            tid: 7,
            tgid: 7,
            comm: "reader".into(),
            placed_on: Some(1),
            allowed: vec![0, 1],
            ..Default::default()
        }];
        assert_eq!(reason(&r, &reader), Reason::Managed);
        r.tasks[0].allowed = vec![1];
        assert_eq!(reason(&r, &reader), Reason::OneVcpu);
        r.kept_with_completions.push(KeptStatus { tid: 7, cpu: 0 });
        let e = explain(&r, &reader);
        assert_eq!(
            (e.reason, e.placed_on),
            (Reason::KeptWithCompletions, Some(0))
        );

        let kthread = Thread {
            kernel: true,
            ..thread(2, "kthreadd")
        };
        assert_eq!(reason(&r, &kthread), Reason::KernelThread);
        let own = Thread {
            tgid: 100,
            ..thread(101, "vmigrater")
        };
        assert_eq!(reason(&r, &own), Reason::Daemon);
    }

    #[test]
    fn the_detectors_view_is_in_the_words() {
        let mut r = report();
        r.seen = vec![SeenStatus {
            iops: 1234.0,
            cpu_fraction: 0.1,
            ..seen(7, false)
        }];
        r.move_gate = GateReport::GuardHolding;
        r.guard_hold_remaining_s = 42.4;
        let e = explain(&r, &thread(7, "reader"));
        assert!(
            e.why.contains("80%") && e.why.contains("1234 requests/s"),
            "{}",
            e.why
        );
        assert!(e.why.contains("42 s more"), "{}", e.why);
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["reason"], "guard_holding");
        assert_eq!(json["detector"]["io_fraction"], 0.8);
        let text = render(&r, &[e]);
        assert!(
            text.contains("guard_holding: the detector found it"),
            "{text}"
        );
        assert!(
            text.contains("would change: the guard's next probe"),
            "{text}"
        );
    }
}
