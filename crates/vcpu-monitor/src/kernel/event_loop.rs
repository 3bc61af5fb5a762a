//! The event thread ("vcpu-events"): opens the timer programs, serves their gap events
//! and the push points until stopped, then switches the events and heartbeats off.

use anyhow::Result;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, info, warn};

use super::load::{open, Bpf};
use super::prepare_thread;
use super::push::PushPoints;
use super::rescue::{Rescue, UNPINNED};
use super::ring::{wait_for_events, GapEvent};
use super::slices::Slices;
use super::state::{publish_task_cpus, set_emit, BoardView};
use super::{TimerAttach, MAX_CPUS, MIN_KERNEL_GAP_THRESHOLD};
use crate::board::{Demand, VcpuBoard};
use crate::config::MonitorConfig;
use crate::monitor::{TickEvent, TickHook};
use crate::monotonic_ns;

/// What the event thread reports besides the board.
pub(super) struct Outputs {
    pub(super) stop: Arc<AtomicBool>,
    pub(super) beats: Arc<AtomicU64>,
}

/// Tells `started` whether the programs loaded, and with them serves until `out.stop`.
pub(super) fn event_thread(
    cfg: &MonitorConfig,
    board: &VcpuBoard,
    hook: &dyn TickHook,
    push_threshold: Duration,
    out: &Outputs,
    started: SyncSender<Result<TimerAttach>>,
) {
    let threshold_ns = cfg
        .min_gap_threshold
        .max(MIN_KERNEL_GAP_THRESHOLD)
        .as_nanos() as u64;
    // One backing object per attempt: a failed attempt's skeleton still borrows its own.
    let mut storage = [
        MaybeUninit::uninit(),
        MaybeUninit::uninit(),
        MaybeUninit::uninit(),
    ];
    let mut loaded = None;
    let bpf = match open(&mut storage, &mut loaded, board, threshold_ns) {
        Ok(bpf) => bpf,
        Err(e) => {
            let _ = started.send(Err(e));
            return;
        }
    };
    prepare_thread(cfg.rt_priority);
    let attach = bpf.attach;
    let _ = started.send(Ok(attach));
    info!(%attach, threshold_us = threshold_ns / 1000, "vCPU deschedules watched from kernel timers");

    let cpus: Vec<usize> = board.cpus().filter(|&c| c < MAX_CPUS).collect();
    let view = BoardView::new(
        &cpus,
        bpf.bss,
        cfg.default_slice,
        threshold_ns,
        push_threshold,
    );
    serve(&bpf, &view, cfg, board, hook, out);
    close(&bpf, &view);
    debug!("vCPU event thread stopped");
}

/// Serves gap events and push points until `out.stop`, a rescuer per vCPU beside it.
fn serve(
    bpf: &Bpf<'_>,
    view: &BoardView<'_>,
    cfg: &MonitorConfig,
    board: &VcpuBoard,
    hook: &dyn TickHook,
    out: &Outputs,
) {
    let asleep_on = AtomicUsize::new(UNPINNED);
    let rescue = Rescue::new(&asleep_on, &bpf.rb, bpf.ring_fd, &out.stop, cfg.rt_priority);
    let mut event_loop = EventLoop {
        cfg,
        board,
        hook,
        out,
        bpf,
        view,
        asleep_on: &asleep_on,
        slices: Slices::new(view.cpus.len()),
        points: PushPoints::new(view.cpus.len(), view.push_ns),
        emitting: false,
    };
    std::thread::scope(|scope| {
        rescue.spawn_all(scope, view.cpus);
        event_loop.run();
        rescue.quit();
    });
    rescue.close();
}

/// Turns the gap events and every heartbeat off before the programs are detached.
fn close(bpf: &Bpf<'_>, view: &BoardView<'_>) {
    set_emit(bpf.bss.emit, false);
    view.heartbeat_off();
}

/// What the event thread keeps while it serves.
struct EventLoop<'a, 'r> {
    cfg: &'a MonitorConfig,
    board: &'a VcpuBoard,
    hook: &'a dyn TickHook,
    out: &'a Outputs,
    bpf: &'a Bpf<'r>,
    view: &'a BoardView<'a>,
    /// Where the event thread sleeps (a CPU id, or `UNPINNED`): the rescuers read it.
    asleep_on: &'a AtomicUsize,
    slices: Slices,
    points: PushPoints,
    emitting: bool,
}

impl EventLoop<'_, '_> {
    fn run(&mut self) {
        while !self.out.stop.load(Relaxed) {
            let now = monotonic_ns();
            let active = self.board.demand() == Demand::Active;
            self.switch_events(active);
            self.publish(now);
            if !active {
                self.idle(now);
                continue;
            }
            publish_task_cpus(self.bpf.bss.task_cpus, self.view.cpus, self.hook);
            self.sleep(now);
            self.handle_events();
        }
    }

    fn switch_events(&mut self, active: bool) {
        if active != self.emitting {
            set_emit(self.bpf.bss.emit, active);
            self.emitting = active;
            debug!(active, "gap events switched");
        }
    }

    fn publish(&mut self, now: u64) {
        let beats = self.view.publish(self.board, &mut self.slices, now);
        self.out.beats.store(beats, Relaxed);
    }

    fn idle(&self, now: u64) {
        // Events raised just before the switch went off are stale by the next demand.
        let _ = self.bpf.rb.consume();
        self.bpf.events.borrow_mut().clear();
        if self.asleep_on.swap(UNPINNED, Relaxed) != UNPINNED {
            unpin_self(self.view.cpus);
        }
        self.board
            .idle_sleep_until(now + self.cfg.idle_period.as_nanos() as u64);
    }

    /// Sleeps until the earliest push point of a vCPU holding tasks, or an event, on the
    /// vCPU that wake-up comes from.
    fn sleep(&self, now: u64) {
        let (board, cpus, hook) = (self.board, self.view.cpus, self.hook);
        let (wait, on) = self
            .points
            .next_wake(board, cpus, now, &self.slices.timed, hook);
        if let Some(cpu) = on {
            if cpu != self.asleep_on.load(Relaxed) && os_layer::sched::pin_self(cpu).is_ok() {
                self.asleep_on.store(cpu, Relaxed);
            }
        }
        if wait > 0 {
            wait_for_events(self.bpf.rb.epoll_fd(), wait);
        }
    }

    /// Tells the hook of every vCPU back (`TickEvent::Resumed`), then of every push point
    /// due.
    fn handle_events(&mut self) {
        if let Err(e) = self.bpf.rb.consume() {
            warn!("reading the gap ring buffer failed: {e}");
            std::thread::sleep(Duration::from_millis(10));
        }
        let now = monotonic_ns();
        let drained: Vec<GapEvent> = std::mem::take(&mut *self.bpf.events.borrow_mut());
        self.publish(now);
        for e in &drained {
            tracing::trace!(
                cpu = e.cpu,
                late_us = now.saturating_sub(e.ts) / 1000,
                asleep_on = self.asleep_on.load(Relaxed),
                "back"
            );
            self.hook.on_tick(
                e.cpu as usize,
                TickEvent::Resumed {
                    inactive_ns: e.inactive_ns,
                    back_ns: e.ts,
                },
                self.board,
                now,
            );
        }
        let (board, cpus, hook) = (self.board, self.view.cpus, self.hook);
        self.points
            .run_due(board, cpus, now, &self.slices.timed, hook);
    }
}

/// Lets the event thread run on every monitored vCPU again.
fn unpin_self(cpus: &[usize]) {
    let mut set = nix::sched::CpuSet::new();
    for &c in cpus {
        let _ = set.set(c);
    }
    let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
}
