//! A task kept on the vCPU that takes its completions must not sit there waiting for its
//! turn: pinned, the kernel's balancer cannot move it to a vCPU with less to run. Where it
//! spends most of a span runnable but not running (a CPU-bound task on that vCPU that the
//! scheduler favours, for instance one charged less of the time the vCPU was taken away),
//! it is let go: its own mask back, so the kernel may move it, for a while that doubles
//! each time it is found waiting again soon after it was kept once more. A task that is
//! runnable while its vCPU is taken away waits too (the run queue's clock runs on); that
//! time is not the vCPU's to give, so the rule judges only the time the vCPU ran.
//!
//! Pure: the run-queue figures come in as plain values (the caller reads
//! `/proc/<pid>/task/<tid>/schedstat`).

use std::collections::HashMap;
use std::time::Duration;

use super::{KeptTask, RunWait};

/// The span a kept task's run-queue wait is judged over.
pub const WAIT_SPAN: Duration = Duration::from_millis(300);
/// Waiting at least this share of the time its vCPU ran, and `WAIT_OVER_RUN` times what
/// it ran itself, is starved. Measured on the hard-IRQ testbed (a reader pinned with a
/// CPU hog on its vCPU, the vCPU out 10 of every 20 ms): such a reader waits 20–55% of a
/// 300 ms span while it reads at full rate, and 80–95% in the spells where it reads 200
/// times a second.
pub const STARVED_SHARE: f64 = 0.6;
/// A span in which its vCPU ran less than this share is not judged.
pub const MIN_RAN_SHARE: f64 = 0.1;
pub const WAIT_OVER_RUN: u64 = 3;
/// How long a starved task is let go the first time; doubled (up to `MAX_LET_GO`) when
/// it starves again within `REPEAT_WITHIN` of being kept again.
pub const LET_GO: Duration = Duration::from_secs(2);
pub const MAX_LET_GO: Duration = Duration::from_secs(32);
pub const REPEAT_WITHIN: Duration = Duration::from_secs(30);

fn ns(d: Duration) -> u64 {
    d.as_nanos() as u64
}

/// A kept task found waiting on its vCPU, for the log.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Starved {
    pub tid: u32,
    pub cpu: usize,
    /// Share of the time its vCPU ran that it was runnable and not running.
    pub wait_share: f64,
    /// Share of the span it ran.
    pub run_share: f64,
    pub span_ns: u64,
    /// How long it is let go.
    pub for_ns: u64,
}

#[derive(Clone, Copy, Debug)]
struct Mark {
    at_ns: u64,
    run_ns: u64,
    wait_ns: u64,
    /// Its vCPU's time out (`vcpu_out`), cumulative.
    out_ns: u64,
}

#[derive(Clone, Copy, Debug)]
struct LetGo {
    until_ns: u64,
    for_ns: u64,
}

#[derive(Debug, Default)]
pub(super) struct Waiting {
    marks: HashMap<u32, Mark>,
    let_go: HashMap<u32, LetGo>,
    /// Tasks let go, cumulative.
    pub count: u64,
}

impl Waiting {
    /// Judges the kept tasks' run-queue figures; `vcpu_out(cpu)` is a vCPU's cumulative
    /// time taken away. Returns the ones let go from now.
    pub fn judge(
        &mut self,
        now_ns: u64,
        kept: &[KeptTask],
        runs: &[RunWait],
        vcpu_out: impl Fn(usize) -> u64,
    ) -> Vec<Starved> {
        self.marks
            .retain(|tid, _| kept.iter().any(|k| k.tid == *tid));
        self.let_go
            .retain(|_, g| now_ns < g.until_ns + ns(REPEAT_WITHIN));
        let mut starved = Vec::new();
        for k in kept {
            let Some(r) = runs.iter().find(|r| r.tid == k.tid) else {
                continue;
            };
            let here = Mark {
                at_ns: now_ns,
                run_ns: r.run_ns,
                wait_ns: r.wait_ns,
                out_ns: vcpu_out(k.cpu),
            };
            let m = *self.marks.entry(k.tid).or_insert(here);
            let span = now_ns.saturating_sub(m.at_ns);
            if span < ns(WAIT_SPAN) {
                continue;
            }
            self.marks.insert(k.tid, here);
            let out = here.out_ns.saturating_sub(m.out_ns).min(span);
            let vcpu_ran = span - out;
            let waited = r.wait_ns.saturating_sub(m.wait_ns).saturating_sub(out);
            let ran = r.run_ns.saturating_sub(m.run_ns);
            if (vcpu_ran as f64) < MIN_RAN_SHARE * span as f64
                || (waited as f64) < STARVED_SHARE * vcpu_ran as f64
                || waited < WAIT_OVER_RUN * ran
            {
                continue;
            }
            let for_ns = match self.let_go.get(&k.tid) {
                Some(g) => (2 * g.for_ns).min(ns(MAX_LET_GO)),
                None => ns(LET_GO),
            };
            self.let_go.insert(
                k.tid,
                LetGo {
                    until_ns: now_ns + for_ns,
                    for_ns,
                },
            );
            self.marks.remove(&k.tid);
            self.count += 1;
            starved.push(Starved {
                tid: k.tid,
                cpu: k.cpu,
                wait_share: waited as f64 / vcpu_ran as f64,
                run_share: ran as f64 / span as f64,
                span_ns: span,
                for_ns,
            });
        }
        starved
    }

    /// Whether a task is let go at `now_ns` (not to be kept or managed).
    pub fn lets_go(&self, tid: u32, now_ns: u64) -> bool {
        self.let_go.get(&tid).is_some_and(|g| now_ns < g.until_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn kept(tid: u32) -> KeptTask {
        KeptTask {
            tid,
            tgid: tid,
            cpu: 1,
        }
    }

    fn rw(tid: u32, run_ns: u64, wait_ns: u64) -> RunWait {
        RunWait {
            tid,
            run_ns,
            wait_ns,
        }
    }

    #[test]
    fn a_kept_task_that_mostly_waits_for_its_vcpu_is_let_go_and_longer_each_time() {
        let mut w = Waiting::default();
        let k = [kept(7)];
        assert!(w.judge(0, &k, &[rw(7, 0, 0)], |_| 0).is_empty());
        // Reading at full rate: runs 25%, waits 40% of each span.
        assert!(w
            .judge(300 * MS, &k, &[rw(7, 75 * MS, 120 * MS)], |_| 0)
            .is_empty());
        // Shorter than a span: not judged yet, whatever it shows.
        assert!(w
            .judge(400 * MS, &k, &[rw(7, 76 * MS, 220 * MS)], |_| 0)
            .is_empty());
        // Waits 90% of the span, runs 3%.
        let s = w.judge(600 * MS, &k, &[rw(7, 84 * MS, 390 * MS)], |_| 0);
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!((s[0].tid, s[0].cpu, s[0].for_ns), (7, 1, 2_000 * MS));
        assert!((s[0].wait_share - 0.9).abs() < 1e-9);
        assert!(w.lets_go(7, 600 * MS) && w.lets_go(7, 2_599 * MS));
        assert!(!w.lets_go(7, 2_600 * MS) && !w.lets_go(8, 600 * MS));
        assert_eq!(w.count, 1);
        // Kept again and starved again soon after: let go twice as long.
        let t = 3_000 * MS;
        assert!(w
            .judge(t, &k, &[rw(7, 100 * MS, 500 * MS)], |_| 0)
            .is_empty());
        let s = w.judge(t + 300 * MS, &k, &[rw(7, 101 * MS, 790 * MS)], |_| 0);
        assert_eq!(s[0].for_ns, 4_000 * MS);
        // Long after: back to the first length.
        let t = t + 300 * MS + 4_000 * MS + ns(REPEAT_WITHIN);
        assert!(w
            .judge(t, &k, &[rw(7, 200 * MS, 900 * MS)], |_| 0)
            .is_empty());
        let s = w.judge(t + 300 * MS, &k, &[rw(7, 201 * MS, 1_190 * MS)], |_| 0);
        assert_eq!(s[0].for_ns, 2_000 * MS);
    }

    #[test]
    fn waiting_that_goes_with_running_is_not_starving() {
        let mut w = Waiting::default();
        let k = [kept(7)];
        w.judge(0, &k, &[rw(7, 0, 0)], |_| 0);
        // Waits 70% but runs 30% (a busy vCPU shared fairly): the kernel gives it its
        // share; moving it would not make its vCPU less busy for it.
        assert!(w
            .judge(300 * MS, &k, &[rw(7, 90 * MS, 210 * MS)], |_| 0)
            .is_empty());
        // A task no longer kept is forgotten; figures for tasks not kept are ignored.
        assert!(w
            .judge(600 * MS, &[], &[rw(7, 91 * MS, 500 * MS)], |_| 0)
            .is_empty());
        assert!(w
            .judge(900 * MS, &k, &[rw(7, 92 * MS, 790 * MS)], |_| 0)
            .is_empty());
        assert_eq!(w.count, 0);
    }

    #[test]
    fn time_its_vcpu_was_taken_away_is_not_waiting_for_a_turn() {
        let mut w = Waiting::default();
        let k = [kept(7)];
        let out = std::cell::Cell::new(0);
        w.judge(0, &k, &[rw(7, 0, 0)], |_| out.get());
        // vCPU 1 out 70% of the span, the task runnable through all of it and 20% more:
        // of the 90 ms the vCPU ran, it waited 60 (67%) and ran 10. Starved.
        out.set(210 * MS);
        let s = w.judge(300 * MS, &k, &[rw(7, 10 * MS, 270 * MS)], |_| out.get());
        assert_eq!(s.len(), 1);
        assert!((s[0].wait_share - 60.0 / 90.0).abs() < 1e-9, "{s:?}");
        // Out 70% again, runnable through it and 10% more: 30 of the 90 ms, not starved.
        let t = 3_000 * MS;
        w.judge(t, &k, &[rw(7, 100 * MS, 500 * MS)], |_| out.get());
        out.set(420 * MS);
        let s = w.judge(t + 300 * MS, &k, &[rw(7, 101 * MS, 740 * MS)], |_| {
            out.get()
        });
        assert!(s.is_empty(), "{s:?}");
        // Out 95%: too little of the span ran to judge it.
        out.set(705 * MS);
        let s = w.judge(t + 600 * MS, &k, &[rw(7, 101 * MS, 1_040 * MS)], |_| {
            out.get()
        });
        assert!(s.is_empty(), "{s:?}");
    }
}
