//! Partners kept beside the tasks kept with their completions: the user threads such a
//! task wakes and is woken by (`task_detector::partners`). A database backend kept on the
//! vCPU that takes its completions, with its client on another vCPU, waits for that
//! vCPU's window at every reply; beside it, the pair runs a request in one window. Never
//! keeps a partner whose own task is not kept, nor one the user excluded or someone else
//! placed.

use tracing::info;

use super::{Anchored, Engine, KeptTask, TaskPlacement, PARTNER_GRACE};
use crate::hook::{FoundTask, TaskId};
use crate::planner::Reason;

impl Engine {
    /// Anchors each partner seen within `PARTNER_GRACE` on the vCPU of the kept task it
    /// serves (`homed`: this step's tasks kept with their completions); returns those
    /// anchored now. `managed`: tids managed on their own (an I/O-bound partner is placed
    /// by its own completions).
    pub(super) fn keep_partners(
        &mut self,
        now: u64,
        homed: &[KeptTask],
        managed: &[u32],
        act: &mut impl TaskPlacement,
    ) -> Vec<Anchored> {
        let grace = PARTNER_GRACE.as_nanos() as u64;
        self.partners
            .retain(|_, (_, seen)| now.saturating_sub(*seen) < grace);
        if !self.cfg.keep_partners || homed.is_empty() {
            return Vec::new();
        }
        let hands_off = act.hands_off();
        let mut partners: Vec<_> = self.partners.values().map(|(p, _)| p.clone()).collect();
        partners.sort_by_key(|p| p.tid);
        let mut kept = Vec::new();
        for p in partners {
            let Some(of) = homed.iter().find(|k| k.tid == p.of).copied() else {
                continue;
            };
            if managed.contains(&p.tid)
                || kept.iter().any(|a: &Anchored| a.tid == p.tid)
                || p.tgid == self.cfg.own_pid
                || self.cfg.exclude_comm.contains(&p.comm)
                || hands_off.contains(&TaskId {
                    tid: p.tid,
                    start_time: p.start_time,
                })
            {
                continue;
            }
            let task = FoundTask {
                tid: p.tid,
                tgid: p.tgid,
                start_time: p.start_time,
                last_cpu: of.cpu,
            };
            if !act
                .anchor(&[task], &[of.cpu], Reason::Partner)
                .contains(&p.tid)
            {
                continue;
            }
            if !self.anchored.iter().any(|a| a.tid == p.tid) {
                info!(
                    tid = p.tid,
                    comm = %p.comm,
                    of = p.of,
                    cpu = of.cpu,
                    wakes = p.wakes,
                    "wakes and is woken by a task kept on vCPU {}: kept beside it",
                    of.cpu
                );
            }
            kept.push(Anchored {
                tid: p.tid,
                comm: p.comm,
            });
        }
        kept
    }
}
