//! What a step decided, as values, and the one place that carries them out: the switch
//! of the block programs through `BlockTracking` (`switch_tracking`), the tasks through
//! the placement (`apply`). The decision about tasks is whole before anything is pinned,
//! released or published; a pin the placement cannot make (the task is gone, or someone
//! else changed its mask since) carries in the decision what happens to its task then, so
//! `apply` itself decides nothing. What was done comes back (the switch's result,
//! `Applied`) for the engine to note.

use std::sync::Arc;
use std::time::Duration;
use vcpu_monitor::Demand;

use super::{BlockTracking, TaskPlacement};
use crate::affinity::Outcome;
use crate::hook::{FoundTask, TaskEntry};
use crate::planner::Reason;
use crate::sampling::Schedule;
use task_detector::ForkSample;

/// A switch of the block programs, with what noting its outcome needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum TrackingSwitch {
    None,
    /// Nothing to gain for long enough: off their tracepoints (how long it was quiet,
    /// and whether the guard holds, for the log).
    Detach {
        quiet: Duration,
        guard_holds: bool,
    },
    /// Unsampled tracking: the programs track exactly while something can gain.
    Follow {
        track: bool,
    },
    /// The sample is over: pause (`into` it, and whether tracking is wanted, say the nap).
    EndSample {
        schedule: Schedule,
        into: Duration,
        wants: bool,
    },
    /// The next sample starts: resume, after clearing a ring from before it.
    StartSample {
        schedule: Schedule,
        clear_doorbell: bool,
    },
}

/// Carries a switch out; its result is for the engine to note.
pub(super) fn switch_tracking(
    switch: TrackingSwitch,
    act: &mut impl BlockTracking,
) -> anyhow::Result<()> {
    match switch {
        TrackingSwitch::None => Ok(()),
        TrackingSwitch::Detach { .. } => act.detach(),
        TrackingSwitch::Follow { track: true } => act.resume(),
        TrackingSwitch::Follow { track: false } | TrackingSwitch::EndSample { .. } => act.pause(),
        TrackingSwitch::StartSample { clear_doorbell, .. } => {
            if clear_doorbell {
                act.take_doorbell();
            }
            act.resume()
        }
    }
}

/// Why a task is handed back its own mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Why {
    Excluded,
    OnHold,
    OutTogether,
    NotIoBound,
}

impl Why {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Why::Excluded => "its command is excluded (migration.exclude_comm)",
            Why::OnHold => "moves on hold",
            Why::OutTogether => {
                "vCPUs are out all at once: only tasks kept with their completions stay managed"
            }
            Why::NotIoBound => "task no longer I/O-bound",
        }
    }
}

/// What happens to a task whose pin the placement could not make.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Otherwise {
    /// The planner moves it (it is managed).
    Planner(TaskEntry),
    /// It is handed back.
    Release(Why),
    /// Nothing: it was not ours before.
    Nothing,
}

/// A task to pin, with its command (for the logs).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Pin {
    pub task: FoundTask,
    pub comm: String,
    pub otherwise: Otherwise,
}

/// A task kept on the vCPU that takes its completions.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Keep {
    pub pin: Pin,
    pub tgid: u32,
    pub cpu: usize,
}

/// A thread kept beside the kept task `of`: only if that one sits.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Beside {
    pub pin: Pin,
    pub of: u32,
    pub cpu: usize,
    pub wakes: u64,
}

/// A task handed back its own mask.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Release {
    pub tid: u32,
    pub comm: String,
    pub why: Why,
}

/// Everything a step decided about tasks, in the order `apply` carries it out.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Decision {
    /// Tasks kept with their completions; each that sits gets the short slice.
    pub keep: Vec<Keep>,
    /// Threads kept beside a kept task; each that sits gets the short slice.
    pub beside: Vec<Beside>,
    /// Tasks gathered on the vCPUs the host holds (`held`).
    pub hold: Vec<Pin>,
    pub held: Vec<usize>,
    pub release: Vec<Release>,
    /// The managed tasks the monitor threads move (the planner's); the monitor tracks
    /// slices precisely while there is one.
    pub publish: Vec<TaskEntry>,
}

/// What `apply` did.
#[derive(Debug)]
pub(super) struct Applied {
    /// Tasks that sit where the decision pinned them, by kind.
    pub kept: Vec<u32>,
    pub beside: Vec<u32>,
    pub held: Vec<u32>,
    /// Tasks handed back, with what the executor said (none in dry run).
    pub released: Vec<(Release, Outcome)>,
    /// Tasks a failed keep sent back out of the managed set (`Otherwise::Release`).
    pub dropped: Vec<u32>,
    pub demand: Demand,
}

/// The threads a poll saw started, to set back where they inherited a pin of ours.
/// Apart from `Decision`: it is carried out before any task is taken over or asked again
/// what it may use, so that the executor answers with the thread's own mask, not our pin.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct UndoInherited {
    /// `None` where nothing was polled.
    pub forks: Option<Vec<ForkSample>>,
}

/// Sets back the threads that inherited a pin of ours; returns how many.
pub(super) fn undo_inherited(u: &UndoInherited, act: &mut impl TaskPlacement) -> usize {
    u.forks
        .as_ref()
        .map_or(0, |forks| act.undo_inherited(forks))
}

/// Carries a decision out: pins, short slices, host-hold pins, releases, the planner's
/// tasks and the monitor's demand, in that order.
pub(super) fn apply(d: &Decision, act: &mut impl TaskPlacement) -> Applied {
    let mut kept = Vec::new();
    let mut beside = Vec::new();
    let mut held = Vec::new();
    let mut dropped = Vec::new();
    let mut publish = d.publish.clone();
    let mut release = d.release.clone();
    // A task handed back here leaves the managed set (only keeps were in it).
    let mut otherwise = |pin: &Pin| match &pin.otherwise {
        Otherwise::Planner(entry) => publish.push(entry.clone()),
        Otherwise::Release(why) => {
            dropped.push(pin.task.tid);
            release.push(Release {
                tid: pin.task.tid,
                comm: pin.comm.clone(),
                why: *why,
            });
        }
        Otherwise::Nothing => {}
    };
    for k in &d.keep {
        let tid = k.pin.task.tid;
        if act
            .anchor(&[k.pin.task], &[k.cpu], Reason::Completion)
            .contains(&tid)
        {
            kept.push(tid);
        } else {
            otherwise(&k.pin);
        }
    }
    for b in &d.beside {
        let tid = b.pin.task.tid;
        if kept.contains(&b.of)
            && act
                .anchor(&[b.pin.task], &[b.cpu], Reason::Partner)
                .contains(&tid)
        {
            beside.push(tid);
        } else {
            otherwise(&b.pin);
        }
    }
    let short: Vec<u32> = kept.iter().chain(&beside).copied().collect();
    act.keep_short_slices(&short);
    if !d.hold.is_empty() {
        let tasks: Vec<FoundTask> = d.hold.iter().map(|p| p.task).collect();
        let on = act.anchor(&tasks, &d.held, Reason::Held);
        for pin in &d.hold {
            if on.contains(&pin.task.tid) {
                held.push(pin.task.tid);
            } else {
                otherwise(pin);
            }
        }
    }
    let mut released = Vec::new();
    for r in release {
        if let Some(outcome) = act.release(r.tid) {
            released.push((r, outcome));
        }
    }
    let demand = if publish.is_empty() {
        Demand::Idle
    } else {
        Demand::Active
    };
    act.publish_tasks(Arc::new(publish));
    act.set_demand(demand);
    Applied {
        kept,
        beside,
        held,
        released,
        dropped,
        demand,
    }
}
