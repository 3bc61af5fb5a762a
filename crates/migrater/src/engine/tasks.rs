//! The engine's second half: which tasks the monitor threads may move. The host's hold
//! first (anchor, no other moves), then the move guard (probe, trust, hold), then
//! admission of this window's I/O-bound tasks, and the release of every task that is
//! neither managed nor anchored any more. Never moves a task for the planner's reasons:
//! that is the hook's, on the monitor threads.

use std::sync::Arc;
use task_detector::IoTaskInfo;
use tracing::{debug, info};
use vcpu_monitor::Demand;

use super::{Actuator, Anchored, BlockTracking, Engine, KeptTask, TaskPlacement, KEEP_GRACE};
use crate::admission::{self, Admission};
use crate::completion::Home;
use crate::guard::Burden;
use crate::hook::{FoundTask, TaskEntry};
use crate::planner::Reason;

/// What the step decided about tasks, for its nap.
pub(super) struct Decided {
    pub moves_allowed: bool,
    /// Tasks are managed (the monitor tracks slices for them).
    pub active: bool,
}

fn found_task(i: &IoTaskInfo) -> FoundTask {
    FoundTask {
        tid: i.task.tid,
        tgid: i.task.tgid,
        start_time: i.start_time,
        last_cpu: i.task.last_cpu as usize,
    }
}

impl Engine {
    pub(super) fn decide_tasks(
        &mut self,
        now: u64,
        progress: u64,
        held: &[usize],
        act: &mut impl Actuator,
    ) -> Decided {
        let found = std::mem::take(&mut self.found);
        let eligible = admission::eligible(&found, self.cfg.own_pid, &self.cfg.exclude_comm);
        let candidates = eligible.len();
        let found_tasks: Vec<FoundTask> = eligible.iter().map(|i| found_task(i)).collect();
        let host_holds = self.note_host_hold(held);
        // With vCPUs out all at once only keeps can pay: tasks are taken only once their
        // completions are known to land on one vCPU (the planner gets none).
        let together = self.out_together();
        // Moves that only keep tasks with their completions need not win, only not lose.
        let all_homed = together
            || (self.cfg.follow_completions
                && !eligible.is_empty()
                && eligible
                    .iter()
                    .all(|i| matches!(self.homes.home(i.task.tid), Home::Fixed(_))));
        if let Some(g) = self.guard.as_mut() {
            g.set_burden(if all_homed {
                Burden::NotLose
            } else {
                Burden::Win
            });
        }
        let moves_allowed = !host_holds && self.moves_allowed(now, progress, candidates > 0);
        self.snap.moves_allowed = moves_allowed;
        let mut next = if moves_allowed {
            let keepable: Vec<IoTaskInfo>;
            let admissible = if together {
                keepable = found
                    .iter()
                    .filter(|i| {
                        matches!(self.homes.home(i.task.tid), Home::Fixed(_))
                            && !self.unkept.contains(&i.task.tid)
                    })
                    .cloned()
                    .collect();
                &keepable
            } else {
                &found
            };
            let mut next = self.admit(admissible, act.placement());
            self.carry_kept(now, &mut next, act.placement());
            next
        } else {
            Vec::new()
        };
        let (homed, kept_tasks) = self.keep_with_completions(now, &found, &next, act.placement());
        if together {
            next.retain(|e| homed.iter().any(|h| h.tid == e.tid));
        }
        let managed: Vec<u32> = next.iter().map(|e| e.tid).collect();
        let partners = self.keep_partners(now, &kept_tasks, &managed, act.placement());
        let kept: Vec<u32> = homed.iter().chain(&partners).map(|h| h.tid).collect();
        act.placement().keep_short_slices(&kept);
        let mut anchored_now: Vec<Anchored> = if host_holds {
            let on_held = act.placement().anchor(&found_tasks, held, Reason::Held);
            eligible
                .iter()
                .filter(|i| on_held.contains(&i.task.tid))
                .map(|i| Anchored {
                    tid: i.task.tid,
                    comm: i.comm.clone(),
                })
                .collect()
        } else {
            Vec::new()
        };
        // The planner moves the managed tasks that are not kept with their completions.
        let free: Vec<TaskEntry> = next
            .iter()
            .filter(|e| !homed.iter().any(|h| h.tid == e.tid))
            .cloned()
            .collect();
        anchored_now.extend(homed);
        anchored_now.extend(partners);
        // Found and not kept: with vCPUs out together, a task the planner had.
        let unkeepable: Vec<u32> = if together {
            eligible.iter().map(|i| i.task.tid).collect()
        } else {
            Vec::new()
        };
        self.release_left(
            &next,
            &anchored_now,
            moves_allowed,
            &unkeepable,
            act.placement(),
        );
        let active = !free.is_empty();
        // On hold the I/O-bound tasks still exist; they are only left alone.
        self.snap.io_bound_tasks = if moves_allowed {
            next.len()
        } else {
            candidates
        };
        let placed = next
            .iter()
            .any(|e| !self.current.iter().any(|c| c.tid == e.tid))
            || anchored_now
                .iter()
                .any(|a| !self.anchored.iter().any(|b| b.tid == a.tid));
        self.placed_in_sample |= placed && act.blocks().tracking();
        act.placement().publish_tasks(Arc::new(free));
        self.snap.found = found_tasks;
        self.snap.kept_with_completions = kept_tasks;
        self.current = Arc::new(next);
        self.anchored = anchored_now;
        let demand = if active { Demand::Active } else { Demand::Idle };
        self.snap.demand = demand;
        act.placement().set_demand(demand);
        self.found = found;
        Decided {
            moves_allowed,
            active,
        }
    }

    /// Learns where each found task's completions land, and pins the managed tasks whose
    /// completions land on one fixed vCPU there, running or not: elsewhere each request
    /// would wait for two vCPUs' windows, and no move brings a completion sooner. Returns
    /// the tasks so kept, and where; they stay managed (admission keeps them) but are not
    /// the planner's to move.
    fn keep_with_completions(
        &mut self,
        now: u64,
        found: &[IoTaskInfo],
        next: &[TaskEntry],
        act: &mut impl TaskPlacement,
    ) -> (Vec<Anchored>, Vec<KeptTask>) {
        if !self.cfg.follow_completions {
            return (Vec::new(), Vec::new());
        }
        // Each poll's window once: between samples the last one stands. A task carried
        // through its grace keeps what was learnt of it.
        if self.fresh {
            for i in found {
                let was = self.homes.home(i.task.tid);
                let home = self.homes.observe(i.task.tid, &i.task.completion);
                if home != was && next.iter().any(|e| e.tid == i.task.tid) {
                    let c = &i.task.completion;
                    info!(
                        tid = i.task.tid,
                        comm = %i.comm,
                        ?was,
                        ?home,
                        on_cpu = c.cpu,
                        completions = c.count,
                        remote = c.remote,
                        "where its requests complete changed"
                    );
                }
            }
            self.homes.retain(|tid| {
                found.iter().any(|i| i.task.tid == tid) || next.iter().any(|e| e.tid == tid)
            });
        }
        let mut homed = Vec::new();
        let mut kept = Vec::new();
        for e in next {
            let Home::Fixed(cpu) = self.homes.home(e.tid) else {
                continue;
            };
            if !e.allowed.contains(&cpu) {
                if self.unkept.insert(e.tid) {
                    info!(
                        tid = e.tid,
                        comm = %e.comm,
                        cpu,
                        allowed = ?e.allowed,
                        "its requests complete on vCPU {cpu}, outside the CPUs it may use: not kept"
                    );
                }
                continue;
            }
            let task = FoundTask {
                tid: e.tid,
                tgid: e.tgid,
                start_time: e.start_time,
                last_cpu: e.last_cpu,
            };
            if !act
                .anchor(&[task], &[cpu], Reason::Completion)
                .contains(&e.tid)
            {
                if self.unkept.insert(e.tid) {
                    info!(
                        tid = e.tid,
                        comm = %e.comm,
                        cpu,
                        "could not be kept on vCPU {cpu}: its mask was changed by someone else, or it is gone"
                    );
                }
                continue;
            }
            if !self.anchored.iter().any(|a| a.tid == e.tid) {
                info!(
                    tid = e.tid,
                    comm = %e.comm,
                    cpu,
                    "its requests complete on vCPU {cpu} wherever it submits: kept there"
                );
            }
            if found.iter().any(|i| i.task.tid == e.tid) {
                self.kept_found_ns.insert(e.tid, now);
            }
            kept.push(KeptTask {
                tid: e.tid,
                tgid: e.tgid,
                cpu,
            });
            homed.push(Anchored {
                tid: e.tid,
                comm: e.comm.clone(),
            });
        }
        self.kept_found_ns
            .retain(|tid, _| homed.iter().any(|h| h.tid == *tid));
        // Remembered while it is found, so that one not keepable is not taken again each
        // window that only keeps.
        self.unkept.retain(|tid| {
            next.iter().any(|e| e.tid == *tid) || found.iter().any(|i| i.task.tid == *tid)
        });
        (homed, kept)
    }

    /// Keeps managing the tasks kept with their completions that this window did not
    /// find, for `KEEP_GRACE` after it last did (unless someone else changed their mask).
    fn carry_kept(&mut self, now: u64, next: &mut Vec<TaskEntry>, act: &impl TaskPlacement) {
        if !self.cfg.follow_completions {
            return;
        }
        let grace = KEEP_GRACE.as_nanos() as u64;
        let mut carried: Vec<TaskEntry> = self
            .current
            .iter()
            .filter(|e| !next.iter().any(|n| n.tid == e.tid))
            .filter(|e| {
                self.kept_found_ns
                    .get(&e.tid)
                    .is_some_and(|&at| now.saturating_sub(at) < grace)
            })
            .cloned()
            .collect();
        if carried.is_empty() {
            return;
        }
        // Someone else's mask, or a command the user now excludes (a reload): at once.
        let hands_off = act.hands_off();
        carried
            .retain(|e| !hands_off.contains(&e.id()) && !self.cfg.exclude_comm.contains(&e.comm));
        for e in &carried {
            if self.fresh {
                debug!(
                    tid = e.tid,
                    comm = %e.comm,
                    "not found I/O-bound in this window: kept with its completions a while"
                );
            }
        }
        next.extend(carried);
    }

    /// The host agent favours vCPUs for our I/O: chasing running vCPUs would undo its
    /// help, so the I/O-bound tasks are anchored on the held vCPUs instead and nothing
    /// else moves them. Returns whether the host holds now.
    fn note_host_hold(&mut self, held: &[usize]) -> bool {
        let host_holds = !held.is_empty();
        if host_holds != self.host_held {
            self.host_held = host_holds;
            self.snap.host_holds = host_holds;
            if host_holds {
                info!(?held, "the host agent favours these vCPUs for our I/O: I/O-bound tasks anchored there, no other moves");
            } else {
                info!("the host agent no longer favours vCPUs: moves as the guard and the contention gate allow");
            }
        }
        host_holds
    }

    /// Whether the contention gate (or vCPUs out together, for keeps) and the move guard
    /// let tasks move; feeds the guard this round's progress (only while it has I/O-bound
    /// tasks to judge by).
    fn moves_allowed(&mut self, now: u64, progress: u64, has_candidates: bool) -> bool {
        let may_pay = self.contended || self.out_together();
        let Some(g) = self.guard.as_mut() else {
            // Guard off: always; dry run with the guard on: where it would move.
            return may_pay;
        };
        if let Some(v) = g.observe(now, progress, has_candidates && may_pay) {
            if v.pays {
                self.snap.guard_verdicts.pays += 1;
            } else {
                self.snap.guard_verdicts.holds += 1;
            }
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
        may_pay && g.moves_allowed()
    }

    /// This window's managed tasks: the ones managed before keep their entry, new ones
    /// are taken over (their mask journaled first).
    fn admit(&self, found: &[IoTaskInfo], act: &mut impl TaskPlacement) -> Vec<TaskEntry> {
        let hands_off = act.hands_off();
        let ex = admission::Exclusions {
            own_pid: self.cfg.own_pid,
            comm: &self.cfg.exclude_comm,
            hands_off: &hands_off,
        };
        let mut next = Vec::with_capacity(found.len());
        for verdict in admission::admit(found, &self.current, ex) {
            let (info, allowed, priority) = match verdict {
                Admission::Keep { managed, now } => {
                    // Asked again: the executor may have corrected what it may use (a pin
                    // it inherited from a task of ours, `undo_inherited`).
                    let allowed = act.manage(now).unwrap_or_else(|_| managed.allowed.clone());
                    (now, allowed, managed.priority)
                }
                Admission::New(info) => {
                    let t = &info.task;
                    let allowed = match act.manage(info) {
                        Ok(a) => a,
                        Err(e) => {
                            debug!(tid = t.tid, "not managing: {e:#}");
                            continue;
                        }
                    };
                    let priority = act.priority_of(info);
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
        next
    }

    /// Hands back the tasks managed or anchored before and neither now: no longer
    /// I/O-bound, moves on hold, the host stopped holding, or (`unkeepable`: still
    /// I/O-bound) vCPUs out all at once, where only keeps stay.
    fn release_left(
        &mut self,
        next: &[TaskEntry],
        anchored_now: &[Anchored],
        moves_allowed: bool,
        unkeepable: &[u32],
        act: &mut impl TaskPlacement,
    ) {
        let kept = |tid: u32| {
            next.iter().any(|n| n.tid == tid) || anchored_now.iter().any(|a| a.tid == tid)
        };
        let current = &self.current;
        let unanchored = self
            .anchored
            .iter()
            .filter(|a| !kept(a.tid) && !current.iter().any(|e| e.tid == a.tid))
            .map(|a| (a.tid, a.comm.as_str()));
        let leaving = admission::leaving(current, next)
            .into_iter()
            .filter(|e| !kept(e.tid))
            .map(|e| (e.tid, e.comm.as_str()));
        let mut released = 0;
        for (tid, comm) in leaving.chain(unanchored) {
            if let Some(outcome) = act.release(tid) {
                released += 1;
                let why = if self.cfg.exclude_comm.iter().any(|c| c == comm) {
                    "its command is excluded (migration.exclude_comm)"
                } else if !moves_allowed {
                    "moves on hold"
                } else if unkeepable.contains(&tid) {
                    "vCPUs are out all at once: only tasks kept with their completions stay managed"
                } else {
                    "task no longer I/O-bound"
                };
                info!(
                    tid,
                    comm = %comm,
                    result = outcome.as_str(),
                    "{why}: original affinity restored"
                );
            }
        }
        self.snap.releases += released;
    }
}
