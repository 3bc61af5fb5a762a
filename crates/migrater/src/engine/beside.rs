//! Partners kept beside the tasks kept with their completions: the user threads such a
//! task wakes and is woken by (`task_detector::partners`). A database backend kept on the
//! vCPU that takes its completions, with its client on another vCPU, waits for that
//! vCPU's window at every reply; beside it, the pair runs a request in one window. Never
//! keeps a partner whose own task is not kept, nor one the user excluded or someone else
//! placed.

use super::decision::{Beside, Keep, Otherwise, Pin};
use super::tasks::Facts;
use super::{Engine, PARTNER_GRACE};
use crate::affinity::TaskId;
use crate::hook::FoundTask;
use os_layer::Mono;

impl Engine {
    /// Each partner seen within `PARTNER_GRACE`, beside the kept task it serves (`keep`:
    /// this step's keeps). `managed`: tids managed on their own (an I/O-bound partner is
    /// placed by its own completions). `was_ours`: what happens if its pin fails.
    pub(super) fn plan_partners(
        &self,
        f: &Facts,
        keep: &[Keep],
        managed: &[u32],
        was_ours: &impl Fn(u32, &str) -> Otherwise,
    ) -> Vec<Beside> {
        if !self.cfg.keep_partners || keep.is_empty() {
            return Vec::new();
        }
        let mut partners: Vec<_> = self
            .tasks
            .partners
            .values()
            .map(|(p, _)| p.clone())
            .collect();
        partners.sort_by_key(|p| p.tid);
        let mut beside: Vec<Beside> = Vec::new();
        for p in partners {
            let Some(of) = keep.iter().find(|k| k.pin.task.tid == p.of) else {
                continue;
            };
            if managed.contains(&p.tid)
                || beside.iter().any(|b| b.pin.task.tid == p.tid)
                || p.tgid == self.cfg.own_pid
                || self.cfg.exclude_comm.contains(&p.comm)
                || f.hands_off.contains(&TaskId {
                    tid: p.tid,
                    start_time: p.start_time,
                })
            {
                continue;
            }
            let otherwise = was_ours(p.tid, &p.comm);
            beside.push(Beside {
                pin: Pin {
                    task: FoundTask {
                        tid: p.tid,
                        tgid: p.tgid,
                        start_time: p.start_time,
                        last_cpu: of.cpu,
                    },
                    comm: p.comm,
                    otherwise,
                },
                of: p.of,
                cpu: of.cpu,
                wakes: p.wakes,
            });
        }
        beside
    }

    /// Forgets the partners no sample has seen for `PARTNER_GRACE`.
    pub(super) fn forget_partners(&mut self, now: Mono) {
        self.tasks
            .partners
            .retain(|_, (_, seen)| now.since(*seen) < PARTNER_GRACE);
    }
}
