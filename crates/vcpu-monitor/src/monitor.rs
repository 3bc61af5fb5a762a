//! The sleepers: one OS thread per vCPU, pinned to it, SCHED_FIFO (below any steal
//! emulator), 1 ns timer slack, absolute CLOCK_MONOTONIC deadlines. Each wake-up is fed
//! to that vCPU's `SliceEstimator`, published on the `VcpuBoard`, and handed to the
//! caller's `TickHook` on the same thread. The sleep period follows demand: short while
//! I/O-bound tasks need slice information, longer while no deschedule has been seen for a
//! while (dedicated vCPUs), long when nothing needs it.
//!
//! A sleeper must never take a lock, allocate or block anywhere but in its timed sleep
//! (it runs SCHED_FIFO on the vCPU it measures), and must never burst catch-up ticks
//! after a gap: a deadline that fell behind is re-based to the latest wake-up.

use anyhow::{Context, Result};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use tracing::{debug, warn};

use crate::board::{Demand, Slot, VcpuBoard};
use crate::config::MonitorConfig;
use crate::estimator::{EstimatorConfig, Observation, SliceEstimator};
use crate::{monotonic_ns, sleep_until};

/// What a wake-up was, for the hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TickEvent {
    /// This vCPU came back from a gap of about `inactive_ns` at `back_ns` (monotonic):
    /// the hook may run later than that, when its thread gets a CPU.
    Resumed { inactive_ns: u64, back_ns: u64 },
    /// An on-time wake-up.
    Running,
}

/// Called on the sleeper's own thread after every wake-up; must be cheap and must never
/// block (it runs SCHED_FIFO). A call longer than the gap threshold (≥ 200 µs) cannot be
/// told from a deschedule during it and is reported as a gap at the next wake-up.
pub trait TickHook: Send + Sync + 'static {
    fn on_tick(&self, cpu: usize, event: TickEvent, board: &VcpuBoard, now_ns: u64);

    /// Whether tasks the hook manages are on `cpu`, so that a push check at the end of its
    /// slice can matter (the kernel source wakes for those only). Must not block.
    fn holds_tasks(&self, _cpu: usize) -> bool {
        true
    }
}

pub struct Monitor {
    stop: Arc<AtomicBool>,
    board: Arc<VcpuBoard>,
    threads: Vec<JoinHandle<()>>,
}

impl Monitor {
    pub fn start(
        cfg: MonitorConfig,
        board: Arc<VcpuBoard>,
        hook: Arc<dyn TickHook>,
    ) -> Result<Monitor> {
        for &cpu in &cfg.cpus {
            anyhow::ensure!(board.slot(cpu).is_some(), "CPU {cpu} is not on the board");
        }
        let warned = Arc::new(AtomicBool::new(false));
        // Built first so that a failed spawn drops it, which stops the sleepers already
        // running.
        let mut mon = Monitor {
            stop: Arc::new(AtomicBool::new(false)),
            board: board.clone(),
            threads: Vec::new(),
        };
        for &cpu in &cfg.cpus {
            let (cfg, board, hook, stop, warned) = (
                cfg.clone(),
                board.clone(),
                hook.clone(),
                mon.stop.clone(),
                warned.clone(),
            );
            let t = std::thread::Builder::new()
                .name(format!("vcpu-mon-{cpu}"))
                .spawn(move || sleeper(cpu, &cfg, &board, &*hook, &stop, &warned))
                .context("spawning a sleeper thread")?;
            mon.threads.push(t);
        }
        Ok(mon)
    }

    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Relaxed);
        // Idle sleepers would otherwise finish their long sleep first.
        self.board.wake_sleepers();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn prepare_thread(cpu: usize, rt_priority: Option<i32>, warned: &AtomicBool) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_err()
        || nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).is_err()
    {
        warn!(
            cpu,
            "could not pin the sleeper to its vCPU; its gaps are meaningless"
        );
    }
    // SAFETY: prctl with integer arguments on the calling thread.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1, 0, 0, 0) };
    if let Some(prio) = rt_priority {
        let param = libc::sched_param {
            sched_priority: prio,
        };
        // SAFETY: valid param for the calling thread.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0
            && !warned.swap(true, Relaxed)
        {
            warn!(
                "sleepers run as normal tasks ({}): expect false gaps under CPU load; run as root or grant CAP_SYS_NICE",
                std::io::Error::last_os_error()
            );
        }
    }
}

fn sleeper(
    cpu: usize,
    cfg: &MonitorConfig,
    board: &VcpuBoard,
    hook: &dyn TickHook,
    stop: &AtomicBool,
    warned: &AtomicBool,
) {
    prepare_thread(cpu, cfg.rt_priority, warned);
    let slot = board.slot(cpu).expect("checked in start");
    let mut est = SliceEstimator::new(EstimatorConfig {
        min_gap_threshold_ns: cfg.min_gap_threshold.as_nanos() as u64,
        default_slice_ns: cfg.default_slice.as_nanos() as u64,
        max_precise_sleep_ns: cfg.probe_period.as_nanos() as u64 * 5 / 4,
        ..EstimatorConfig::default()
    });
    let quiet_ns = cfg.quiet_after.as_nanos() as u64;
    let mut next = monotonic_ns();
    // Where the next deadline counts from (see the end of the loop).
    let mut base = next;
    // Start precise: "no deschedule for `quiet_after`" has to be observed, not assumed.
    let mut last_gap_ns = next;
    debug!(cpu, "sleeper started");
    while !stop.load(Relaxed) {
        let now = base;
        let demand = board.demand();
        let period = match demand {
            Demand::Idle => cfg.idle_period,
            Demand::Active if now.saturating_sub(last_gap_ns) > quiet_ns => cfg.probe_period,
            Demand::Active => cfg.period,
        }
        .as_nanos() as u64;
        // Re-base a deadline that fell behind instead of bursting catch-up ticks.
        next = (next + period).max(now + period / 2);
        slot.period_ns.store(period, Relaxed);
        match demand {
            Demand::Idle => board.idle_sleep_until(next),
            Demand::Active => sleep_until(next),
        }
        let woke = monotonic_ns();
        let event = if woke < next {
            // Woken early by a demand change or stop: not a timing sample, and a zero
            // latency would drag the baseline down.
            TickEvent::Running
        } else {
            match est.observe(next, woke) {
                Observation::Resumed { inactive_ns } => {
                    last_gap_ns = woke;
                    TickEvent::Resumed {
                        inactive_ns,
                        back_ns: woke,
                    }
                }
                Observation::Running => TickEvent::Running,
            }
        };
        let quiet = woke.saturating_sub(last_gap_ns) > quiet_ns;
        publish(slot, &est, event, woke, quiet);
        hook.on_tick(cpu, event, board, woke);
        // A vCPU can be descheduled while this thread runs, not only while it sleeps.
        // Counting the next deadline from after a hook that took longer than the gap
        // threshold would push that deadline past such a gap and hide it (emulated
        // bursts went unseen so); counting from the wake-up keeps it visible. A
        // hook that is merely that slow then reads as a gap: hooks must stay well under
        // the threshold.
        let after = monotonic_ns();
        base = if after - woke <= est.threshold_ns() {
            after
        } else {
            woke
        };
    }
    debug!(cpu, "sleeper stopped");
}

/// Publishes what the estimator knows after the wake-up at `woke`; `quiet`: no
/// deschedule seen for `quiet_after`.
fn publish(slot: &Slot, est: &SliceEstimator, event: TickEvent, woke: u64, quiet: bool) {
    slot.last_seen_ns.store(woke, Relaxed);
    slot.gap_threshold_ns.store(est.threshold_ns(), Relaxed);
    slot.est_slice_ns.store(est.est_slice_ns(), Relaxed);
    if quiet {
        // No descheduling seen lately: as far as we know the slice never ends.
        slot.slice_start_ns.store(woke, Relaxed);
    } else if let Some(start) = est.slice_start_ns() {
        slot.slice_start_ns.store(start, Relaxed);
    }
    slot.hiccups.store(est.hiccups, Relaxed);
    if let TickEvent::Resumed { .. } = event {
        slot.deschedules.store(est.deschedules, Relaxed);
        slot.inactive_total_ns.store(est.inactive_total_ns, Relaxed);
        slot.last_inactive_ns.store(est.last_inactive_ns, Relaxed);
    }
}
