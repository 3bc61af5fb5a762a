//! The engine's second half: which tasks the monitor threads may move. The host's hold
//! first (anchor, no other moves), then the move guard (probe, trust, hold), then
//! admission of this window's I/O-bound tasks, the tasks kept with their completions and
//! their partners, and the release of every task that is neither managed nor anchored
//! any more. Taking a task over is the one act the decision waits for (it journals the
//! task's mask and says which CPUs it may use); the rest is decided as a `Decision`, then
//! carried out by `decision::apply`, then noted. Never moves a task for the planner's
//! reasons: that is the hook's, on the monitor threads.

use os_layer::Mono;
use std::collections::HashSet;
use std::sync::Arc;
use task_detector::{BlockTracking, IoTaskInfo, Partner};
use tracing::{debug, info};
use vcpu_monitor::Demand;

use super::decision::{self, Applied, Decision, Keep, Otherwise, Pin, Release, Why};
use super::{Actuator, Anchored, Engine, KeptTask, MoveGate, SeenTask, TaskPlacement, KEEP_GRACE};
use crate::admission::{self, Admission};
use crate::affinity::TaskId;
use crate::completion::Home;
use crate::guard::{Burden, Phase};
use crate::hook::{FoundTask, TaskEntry};

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

fn task_id(i: &IoTaskInfo) -> TaskId {
    TaskId {
        tid: i.task.tid,
        start_time: i.start_time,
    }
}

/// What the decision is made from, besides the engine's own state.
pub(super) struct Facts<'a> {
    pub now: Mono,
    pub found: &'a [IoTaskInfo],
    pub eligible: &'a [&'a IoTaskInfo],
    /// The vCPUs the host holds (empty when it holds none).
    pub held: &'a [usize],
    pub hands_off: &'a HashSet<TaskId>,
    pub moves_allowed: bool,
    /// vCPUs out all at once: only keeps stay managed.
    pub together: bool,
}

impl Engine {
    pub(super) fn decide_tasks(
        &mut self,
        now: Mono,
        progress: u64,
        held: &[usize],
        act: &mut impl Actuator,
    ) -> Decided {
        let found = std::mem::take(&mut self.window.found);
        let hands_off = act.placement().hands_off();
        let eligible = admission::eligible(&found, self.cfg.own_pid, &self.cfg.exclude_comm);
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
                    .all(|i| matches!(self.tasks.homes.home(task_id(i)), Home::Fixed(_))));
        if let Some(g) = self.guard.as_mut() {
            g.set_burden(if all_homed {
                Burden::NotLose
            } else {
                Burden::Win
            });
        }
        let moves_allowed = self.cfg.own_moves
            && !host_holds
            && self.moves_allowed(now, progress, !eligible.is_empty());
        self.snap.moves_allowed = moves_allowed;
        self.snap.gate = self.gate(now, moves_allowed, host_holds, together);
        self.snap.out_together = together;
        self.snap.seen = found
            .iter()
            .map(|i| SeenTask {
                info: i.clone(),
                excluded: !eligible.iter().any(|e| e.task.tid == i.task.tid),
            })
            .collect();
        let next = if moves_allowed {
            let admissible: Vec<IoTaskInfo> = found
                .iter()
                .filter(|i| {
                    !together
                        || (matches!(self.tasks.homes.home(task_id(i)), Home::Fixed(_))
                            && !self.tasks.unkept.contains(&task_id(i)))
                })
                .cloned()
                .collect();
            let mut next = self.admit(&admissible, &hands_off, act.placement());
            self.carry_kept(now, &mut next, &hands_off);
            next
        } else {
            Vec::new()
        };
        let facts = Facts {
            now,
            found: &found,
            eligible: &eligible,
            held: if host_holds { held } else { &[] },
            hands_off: &hands_off,
            moves_allowed,
            together,
        };
        let (managed, d) = self.decide(&facts, next);
        let done = decision::apply(&d, act.placement());
        let tracking = act.blocks().tracking();
        let active = done.demand == Demand::Active;
        self.note(&facts, managed, &d, done, tracking);
        self.window.found = found;
        Decided {
            moves_allowed,
            active,
        }
    }

    /// The decision: which managed tasks are kept with their completions, which threads
    /// beside them, which tasks gather on the host's held vCPUs, which are handed back and
    /// which the planner moves. Returns the managed tasks with it.
    pub(super) fn decide(
        &mut self,
        f: &Facts,
        mut next: Vec<TaskEntry>,
    ) -> (Vec<TaskEntry>, Decision) {
        self.learn_homes(f.found, &next);
        self.forget_partners(f.now);
        let excluded = self.cfg.exclude_comm.clone();
        let why = |tid: u32, comm: &str| {
            if excluded.iter().any(|c| c == comm) {
                Why::Excluded
            } else if !f.moves_allowed {
                Why::OnHold
            } else if f.together && f.eligible.iter().any(|i| i.task.tid == tid) {
                Why::OutTogether
            } else {
                Why::NotIoBound
            }
        };
        let keep = self.plan_keeps(&next, |e: &TaskEntry| {
            if f.together {
                Otherwise::Release(why(e.tid, &e.comm))
            } else {
                Otherwise::Planner(e.clone())
            }
        });
        if f.together {
            next.retain(|e| keep.iter().any(|k| k.pin.task.tid == e.tid));
        }
        // A task pinned before and not managed now is handed back if its pin fails.
        let was_ours = |tid: u32, comm: &str| {
            let before = self.tasks.current.iter().any(|e| e.tid == tid)
                || self.tasks.anchored.iter().any(|a| a.tid == tid);
            if before && !next.iter().any(|e| e.tid == tid) {
                Otherwise::Release(why(tid, comm))
            } else {
                Otherwise::Nothing
            }
        };
        let managed: Vec<u32> = next.iter().map(|e| e.tid).collect();
        let beside = self.plan_partners(f, &keep, &managed, &was_ours);
        let hold: Vec<Pin> = if f.held.is_empty() {
            Vec::new()
        } else {
            f.eligible
                .iter()
                .map(|i| Pin {
                    task: found_task(i),
                    comm: i.comm.clone(),
                    otherwise: was_ours(i.task.tid, &i.comm),
                })
                .collect()
        };
        let pinned = |tid: u32| {
            keep.iter().any(|k| k.pin.task.tid == tid)
                || beside.iter().any(|b| b.pin.task.tid == tid)
                || hold.iter().any(|p| p.task.tid == tid)
        };
        let release = self.plan_releases(&next, &pinned, &why);
        // The planner moves the managed tasks that are not kept with their completions.
        let publish = next
            .iter()
            .filter(|e| !keep.iter().any(|k| k.pin.task.tid == e.tid))
            .cloned()
            .collect();
        let d = Decision {
            keep,
            beside,
            hold,
            held: f.held.to_vec(),
            release,
            publish,
        };
        (next, d)
    }

    /// Learns where each found task's completions land, once per poll's window (between
    /// samples the last one stands; a task carried through its grace keeps what was learnt
    /// of it).
    fn learn_homes(&mut self, found: &[IoTaskInfo], next: &[TaskEntry]) {
        if !self.cfg.follow_completions || !self.window.fresh {
            return;
        }
        for i in found {
            let was = self.tasks.homes.home(task_id(i));
            let home = self.tasks.homes.observe(task_id(i), &i.task.completion);
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
        self.tasks.homes.retain(|id| {
            found.iter().any(|i| task_id(i) == id) || next.iter().any(|e| e.id() == id)
        });
    }

    /// The managed tasks whose completions land on one fixed vCPU, pinned there, running
    /// or not: elsewhere each request would wait for two vCPUs' windows, and no move
    /// brings a completion sooner. They stay managed (admission keeps them) but are not
    /// the planner's to move. `otherwise`: what happens to one the placement cannot pin.
    fn plan_keeps(
        &mut self,
        next: &[TaskEntry],
        otherwise: impl Fn(&TaskEntry) -> Otherwise,
    ) -> Vec<Keep> {
        if !self.cfg.follow_completions {
            return Vec::new();
        }
        let mut keep = Vec::new();
        for e in next {
            let Home::Fixed(cpu) = self.tasks.homes.home(e.id()) else {
                continue;
            };
            if !e.allowed.contains(&cpu) {
                if self.tasks.unkept.insert(e.id()) {
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
            keep.push(Keep {
                pin: Pin {
                    task: FoundTask {
                        tid: e.tid,
                        tgid: e.tgid,
                        start_time: e.start_time,
                        last_cpu: e.last_cpu,
                    },
                    comm: e.comm.clone(),
                    otherwise: otherwise(e),
                },
                tgid: e.tgid,
                cpu,
            });
        }
        keep
    }

    /// The tasks managed or pinned before and neither now: no longer I/O-bound, moves on
    /// hold, the host stopped holding, or (still I/O-bound) vCPUs out all at once, where
    /// only keeps stay.
    fn plan_releases(
        &self,
        next: &[TaskEntry],
        pinned: &impl Fn(u32) -> bool,
        why: &impl Fn(u32, &str) -> Why,
    ) -> Vec<Release> {
        let stays = |tid: u32| next.iter().any(|n| n.tid == tid) || pinned(tid);
        let unanchored = self
            .tasks
            .anchored
            .iter()
            .filter(|a| !stays(a.tid) && !self.tasks.current.iter().any(|e| e.tid == a.tid))
            .map(|a| (a.tid, a.comm.as_str()));
        admission::leaving(&self.tasks.current, next)
            .into_iter()
            .filter(|e| !stays(e.tid))
            .map(|e| (e.tid, e.comm.as_str()))
            .chain(unanchored)
            .map(|(tid, comm)| Release {
                tid,
                comm: comm.to_string(),
                why: why(tid, comm),
            })
            .collect()
    }

    /// Notes what was done: the tasks kept and pinned, the ones handed back (logged with
    /// why), the managed set, and the snapshot.
    fn note(
        &mut self,
        f: &Facts,
        mut managed: Vec<TaskEntry>,
        d: &Decision,
        done: Applied,
        tracking: bool,
    ) {
        let (kept_tasks, mut anchored_now) = self.note_keeps(f, d, &done);
        anchored_now.extend(self.note_beside(d, &done));
        anchored_now.extend(
            d.hold
                .iter()
                .filter(|p| done.held.contains(&p.task.tid))
                .map(|p| Anchored {
                    tid: p.task.tid,
                    comm: p.comm.clone(),
                }),
        );
        managed.retain(|e| !done.dropped.contains(&e.tid));
        // Remembered while it is found, so that one not keepable is not taken again each
        // window that only keeps.
        self.tasks.unkept.retain(|id| {
            managed.iter().any(|e| e.id() == *id) || f.found.iter().any(|i| task_id(i) == *id)
        });
        self.note_releases(&done);
        self.note_snapshot(f, &managed, &anchored_now, tracking);
        self.snap.kept_with_completions = kept_tasks;
        self.snap.demand = done.demand;
        self.tasks.current = Arc::new(managed);
        self.tasks.anchored = anchored_now;
    }

    /// The tasks kept with their completions that the placement did pin (logged the first
    /// time), and the same as anchored; remembers the ones it could not pin as unkept.
    fn note_keeps(
        &mut self,
        f: &Facts,
        d: &Decision,
        done: &Applied,
    ) -> (Vec<KeptTask>, Vec<Anchored>) {
        let mut kept_tasks = Vec::new();
        let mut anchored_now = Vec::new();
        for k in &d.keep {
            let (tid, cpu) = (k.pin.task.tid, k.cpu);
            let comm = &k.pin.comm;
            if !done.kept.contains(&tid) {
                if self.tasks.unkept.insert(k.pin.task.id()) {
                    info!(
                        tid,
                        comm = %comm,
                        cpu,
                        "could not be kept on vCPU {cpu}: its mask was changed by someone else, or it is gone"
                    );
                }
                continue;
            }
            if !self.tasks.anchored.iter().any(|a| a.tid == tid) {
                info!(
                    tid,
                    comm = %comm,
                    cpu,
                    "its requests complete on vCPU {cpu} wherever it submits: kept there"
                );
            }
            if f.found.iter().any(|i| i.task.tid == tid) {
                self.tasks.kept_found.insert(k.pin.task.id(), f.now);
            }
            kept_tasks.push(KeptTask {
                tid,
                tgid: k.tgid,
                cpu,
            });
            anchored_now.push(Anchored {
                tid,
                comm: comm.clone(),
            });
        }
        self.tasks
            .kept_found
            .retain(|id, _| done.kept.contains(&id.tid));
        (kept_tasks, anchored_now)
    }

    /// The partners the placement did pin beside their kept task (logged the first time),
    /// as anchored.
    fn note_beside(&self, d: &Decision, done: &Applied) -> Vec<Anchored> {
        let mut anchored = Vec::new();
        for b in d
            .beside
            .iter()
            .filter(|b| done.beside.contains(&b.pin.task.tid))
        {
            let tid = b.pin.task.tid;
            if !self.tasks.anchored.iter().any(|a| a.tid == tid) {
                info!(
                    tid,
                    comm = %b.pin.comm,
                    of = b.of,
                    cpu = b.cpu,
                    wakes = b.wakes,
                    "wakes and is woken by a task kept on vCPU {}: kept beside it",
                    b.cpu
                );
            }
            anchored.push(Anchored {
                tid,
                comm: b.pin.comm.clone(),
            });
        }
        anchored
    }

    /// Logs the tasks handed back and counts them.
    fn note_releases(&mut self, done: &Applied) {
        for (r, outcome) in &done.released {
            info!(
                tid = r.tid,
                comm = %r.comm,
                result = outcome.as_str(),
                "{}: original affinity restored",
                r.why.as_str()
            );
        }
        self.snap.releases += done.released.len() as u64;
    }

    /// The snapshot's view of the tasks, and whether this sample placed a task anew. Runs
    /// before `tasks.current` and `tasks.anchored` take the new sets, which it compares
    /// against.
    fn note_snapshot(
        &mut self,
        f: &Facts,
        managed: &[TaskEntry],
        anchored_now: &[Anchored],
        tracking: bool,
    ) {
        // On hold the I/O-bound tasks still exist; they are only left alone.
        self.snap.io_bound_tasks = if f.moves_allowed {
            managed.len()
        } else {
            f.eligible.len()
        };
        let placed = managed
            .iter()
            .any(|e| !self.tasks.current.iter().any(|c| c.tid == e.tid))
            || anchored_now
                .iter()
                .any(|a| !self.tasks.anchored.iter().any(|b| b.tid == a.tid));
        self.tracking.placed_in_sample |= placed && tracking;
        self.snap.found = f.eligible.iter().map(|i| found_task(i)).collect();
        let mut partners: Vec<Partner> = self
            .tasks
            .partners
            .values()
            .filter(|(p, _)| f.eligible.iter().any(|i| i.task.tid == p.of))
            .map(|(p, _)| p.clone())
            .collect();
        partners.sort_by_key(|p| p.tid);
        self.snap.partners = partners;
    }

    /// Keeps managing the tasks kept with their completions that this window did not
    /// find, for `KEEP_GRACE` after it last did (unless someone else changed their mask).
    fn carry_kept(&mut self, now: Mono, next: &mut Vec<TaskEntry>, hands_off: &HashSet<TaskId>) {
        if !self.cfg.follow_completions {
            return;
        }
        let mut carried: Vec<TaskEntry> = self
            .tasks
            .current
            .iter()
            .filter(|e| !next.iter().any(|n| n.tid == e.tid))
            .filter(|e| {
                self.tasks
                    .kept_found
                    .get(&e.id())
                    .is_some_and(|&at| now.since(at) < KEEP_GRACE)
            })
            .cloned()
            .collect();
        if carried.is_empty() {
            return;
        }
        // Someone else's mask, or a command the user now excludes (a reload): at once.
        carried
            .retain(|e| !hands_off.contains(&e.id()) && !self.cfg.exclude_comm.contains(&e.comm));
        for e in &carried {
            if self.window.fresh {
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
        if host_holds != self.tasks.host_held {
            self.tasks.host_held = host_holds;
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
    fn moves_allowed(&mut self, now: Mono, progress: u64, has_candidates: bool) -> bool {
        let may_pay = self.tracking.contended || self.out_together();
        let Some(g) = self.guard.as_mut() else {
            // Guard off: always; dry run with the guard on: where it would move.
            return may_pay;
        };
        let verdict = g.observe(now, progress, has_candidates && may_pay);
        self.snap.guard_without_moves_ms = g.time_without_moves().as_millis() as u64;
        if let Some(v) = verdict {
            if v.pays {
                self.snap.guard_verdicts.pays += 1;
            } else {
                self.snap.guard_verdicts.holds += 1;
            }
            info!(
                pays = v.pays,
                with_moves = format!("{:.0}/s", v.with_moves),
                without_moves = format!("{:.0}/s", v.without_moves),
                for_s = v.lasts.as_secs(),
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

    /// The first rule that kept moves off in this step (`MoveGate`).
    fn gate(&self, now: Mono, moves_allowed: bool, host_holds: bool, together: bool) -> MoveGate {
        if moves_allowed {
            return MoveGate::Open;
        }
        if host_holds {
            return MoveGate::HostHolds;
        }
        if !self.cfg.own_moves {
            return MoveGate::FollowsHost;
        }
        if !(self.tracking.contended || together) {
            return MoveGate::NotContended;
        }
        match self.guard.as_ref().map(|g| g.phase()) {
            Some(Phase::Holding { until }) => MoveGate::GuardHolding {
                for_s: until.since(now).as_secs_f64(),
            },
            Some(Phase::Probing { .. }) => MoveGate::GuardProbing,
            // Trusting without candidates: nothing to move.
            _ => MoveGate::Open,
        }
    }

    /// This window's managed tasks: the ones managed before keep their entry, new ones
    /// are taken over (their mask journaled first).
    fn admit(
        &self,
        found: &[IoTaskInfo],
        hands_off: &HashSet<TaskId>,
        act: &mut impl TaskPlacement,
    ) -> Vec<TaskEntry> {
        let ex = admission::Exclusions {
            own_pid: self.cfg.own_pid,
            comm: &self.cfg.exclude_comm,
            hands_off,
        };
        let mut next = Vec::with_capacity(found.len());
        for verdict in admission::admit(found, &self.tasks.current, ex) {
            let (info, allowed, priority) = match verdict {
                Admission::Keep { managed, now } => {
                    // Asked again: the executor may have corrected what it may use (a pin
                    // it inherited from a task of ours, `undo_inherited`).
                    let allowed = act
                        .manage(task_id(now), now.task.tgid)
                        .unwrap_or_else(|_| managed.allowed.clone());
                    (now, allowed, managed.priority)
                }
                Admission::New(info) => {
                    let t = &info.task;
                    let allowed = match act.manage(task_id(info), t.tgid) {
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
}
