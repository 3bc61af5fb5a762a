//! Push points: when, within a vCPU's slice, the hook is told to move its tasks off
//! (`TickEvent::Running`), and so how long the event thread sleeps and on which vCPU.

use std::time::Duration;

use crate::board::VcpuBoard;
use crate::monitor::{TickEvent, TickHook};

/// The longest the event thread waits without looking at the board (metrics freshness,
/// stop flag); events and push points wake it sooner.
const MAX_WAIT: Duration = Duration::from_millis(100);
/// Push points are predicted only from slices at least this long: shorter "slices" are a
/// host's housekeeping chopping a vCPU's time (an emulating host such as QEMU TCG does so
/// constantly), too irregular to time a move by, and a wake-up each would cost more than it could save.
const MIN_PREDICTABLE_SLICE_NS: u64 = 5_000_000;
/// The shortest wait on a descheduled vCPU's return: it wakes when that vCPU runs, so a
/// wait already due costs a wake-up there, not a busy loop.
const MIN_WAIT_NS: u64 = 50_000;

/// The push points of the monitored vCPUs (`push_point`), one handled per slice.
pub(super) struct PushPoints {
    /// Slice start of the last push point handled, per vCPU.
    pushed: Vec<u64>,
    push_ns: u64,
}

impl PushPoints {
    pub(super) fn new(n: usize, push_ns: u64) -> PushPoints {
        PushPoints {
            pushed: vec![0; n],
            push_ns,
        }
    }

    /// How long to sleep and on which vCPU: until the earliest push point of a vCPU
    /// holding tasks, on that vCPU; or, while a vCPU holding tasks whose push points are
    /// timed is out, until it is expected back, on it (its return wakes nobody: the BPF
    /// program skips vCPUs that hold tasks); or, with neither, on the out vCPU without
    /// tasks expected back first, whose return is the next event. Never on an out vCPU
    /// whose return wakes nobody and is not waited for: the events of every other vCPU
    /// would wait for it. `MAX_WAIT` at most.
    pub(super) fn next_wake(
        &self,
        board: &VcpuBoard,
        cpus: &[usize],
        now: u64,
        timed: &[bool],
        hook: &dyn TickHook,
    ) -> (u64, Option<usize>) {
        let mut wait = MAX_WAIT.as_nanos() as u64;
        let mut on = None;
        let mut first_back: Option<(u64, usize)> = None;
        for (i, &cpu) in cpus.iter().enumerate() {
            if let Some((_, at)) = self.point(board, i, cpu, now, timed, hook) {
                let w = at.saturating_sub(now);
                if w < wait {
                    (wait, on) = (w, Some(cpu));
                }
                continue;
            }
            let Some(back) = board.cpu_snapshot(cpu, now).and_then(|s| s.back_in_ns()) else {
                continue;
            };
            if hook.holds_tasks(cpu) {
                let w = back.max(MIN_WAIT_NS);
                if timed[i] && w < wait {
                    (wait, on) = (w, Some(cpu));
                }
                continue;
            }
            if first_back.is_none_or(|(b, _)| back < b) {
                first_back = Some((back, cpu));
            }
        }
        (wait, on.or(first_back.map(|(_, cpu)| cpu)))
    }

    /// The push point of the `i`-th vCPU, `cpu` (`push_point`).
    fn point(
        &self,
        board: &VcpuBoard,
        i: usize,
        cpu: usize,
        now: u64,
        timed: &[bool],
        hook: &dyn TickHook,
    ) -> Option<(u64, u64)> {
        push_point(
            board,
            cpu,
            now,
            timed[i],
            self.pushed[i],
            self.push_ns,
            hook,
        )
    }

    /// Tells the hook of every push point due by `now` (`TickEvent::Running`).
    pub(super) fn run_due(
        &mut self,
        board: &VcpuBoard,
        cpus: &[usize],
        now: u64,
        timed: &[bool],
        hook: &dyn TickHook,
    ) {
        for (i, &cpu) in cpus.iter().enumerate() {
            match self.point(board, i, cpu, now, timed, hook) {
                Some((slice_start, at)) if at <= now => {
                    self.pushed[i] = slice_start;
                    hook.on_tick(cpu, TickEvent::Running, board, now);
                }
                _ => {}
            }
        }
    }
}

/// The push point (slice start, time) of `cpu`'s current run, if one is due at all: it
/// runs, its slices are regular (`timed`) and long enough to predict, this run's point
/// was not handled yet, and it holds tasks.
fn push_point(
    board: &VcpuBoard,
    cpu: usize,
    now: u64,
    timed: bool,
    pushed: u64,
    push_ns: u64,
    hook: &dyn TickHook,
) -> Option<(u64, u64)> {
    let s = board.cpu_snapshot(cpu, now)?;
    (timed
        && s.est_slice_ns >= MIN_PREDICTABLE_SLICE_NS
        && s.active
        && pushed != s.slice_start_ns
        && hook.holds_tasks(cpu))
    .then(|| {
        (
            s.slice_start_ns,
            (s.slice_start_ns + s.est_slice_ns).saturating_sub(push_ns),
        )
    })
}
