//! The kernel source of vCPU state: bpf/vcputick.bpf.c watches the timers the guest kernel
//! fires anyway (the scheduler tick of every busy vCPU, the next timer of an idle one); a
//! timer that fires late with no sign of life since its expiry means the vCPU was
//! descheduled. One thread ("vcpu-events") copies the per-vCPU state from the mmapped
//! .bss onto the `VcpuBoard` and calls the `TickHook`:
//! - `Resumed` when a vCPU comes back (the BPF program wakes it through a ring buffer,
//!   only while demand is active),
//! - `Running` once per slice, at the predicted push point (slice start + estimated slice
//!   − push threshold) of a vCPU the hook says holds tasks, where that vCPU's slices are
//!   regular enough to time a push by (`timing`).
//!
//! The thread sleeps on the vCPU its next wake-up comes from (the one whose push point is
//! next, else the descheduled one whose return raises the next event): a thread asleep
//! on a vCPU that is out wakes only when that vCPU runs again. Where that vCPU goes out
//! before another comes back, a rescuer thread per vCPU (`Rescue`) moves it onto the vCPU
//! that raised the event. Where slices are regular, the BPF heartbeat brackets each
//! expected slice end so that the end is known to within its step.
//!
//! So the daemon wakes about twice per hypervisor slice while I/O-bound tasks exist, and
//! never while none do: no sleeper per vCPU, no timer of its own per tick. It must never
//! spin or wake on a timer other than those two, and never write the BPF state but the
//! words that steer the program (the `emit_events` switch, the vCPUs holding tasks, the
//! slice each heartbeat brackets: `state`).

mod event_loop;
mod load;
mod push;
mod rescue;
mod ring;
mod slices;
mod state;

use anyhow::{anyhow, Context, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::board::VcpuBoard;
use crate::config::MonitorConfig;
use crate::monitor::TickHook;
use event_loop::{event_thread, Outputs};
use tracing::warn;

/// bpf/vcputick.h VT_MAX_CPUS.
const MAX_CPUS: usize = 1024;
/// A timer later than this is a deschedule. Interrupts-off sections of a guest kernel
/// last microseconds to a few hundred; hypervisor slices last milliseconds.
pub const MIN_KERNEL_GAP_THRESHOLD: Duration = Duration::from_millis(1);
/// No deschedule for this long: the vCPU is treated as dedicated (no slice end ahead).
const QUIET_NS: u64 = 1_000_000_000;

/// How the programs are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimerAttach {
    /// tp_btf, with the heartbeat timer.
    Heartbeat,
    TpBtf,
    RawTp,
}

impl TimerAttach {
    /// Whether a program of the BPF object belongs to this way of attaching.
    fn loads(self, prog: &str) -> bool {
        match self {
            TimerAttach::Heartbeat => prog == "hb_hrtimer_expire_entry" || prog == "btf_cpu_idle",
            TimerAttach::TpBtf => prog.starts_with("btf_"),
            TimerAttach::RawTp => prog.starts_with("raw_"),
        }
    }
}

impl std::fmt::Display for TimerAttach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TimerAttach::Heartbeat => "tp_btf with the heartbeat",
            TimerAttach::TpBtf => "tp_btf",
            TimerAttach::RawTp => "raw_tp",
        })
    }
}

pub struct KernelMonitor {
    stop: Arc<AtomicBool>,
    board: Arc<VcpuBoard>,
    thread: Option<JoinHandle<()>>,
    attach: TimerAttach,
    heartbeats: Arc<AtomicU64>,
}

impl KernelMonitor {
    /// Loads and attaches the timer programs (tp_btf, else raw_tp) and starts the event
    /// thread. Fails, with everything undone, when neither loads.
    pub fn start(
        cfg: MonitorConfig,
        board: Arc<VcpuBoard>,
        hook: Arc<dyn TickHook>,
        push_threshold: Duration,
    ) -> Result<KernelMonitor> {
        let stop = Arc::new(AtomicBool::new(false));
        let heartbeats = Arc::new(AtomicU64::new(0));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let thread = {
            let (board, stop, beats) = (board.clone(), stop.clone(), heartbeats.clone());
            std::thread::Builder::new()
                .name("vcpu-events".into())
                .spawn(move || {
                    let out = Outputs { stop, beats };
                    event_thread(&cfg, &board, &*hook, push_threshold, &out, tx);
                })
                .context("spawning the vCPU event thread")?
        };
        match rx.recv() {
            Ok(Ok(attach)) => Ok(KernelMonitor {
                stop,
                board,
                thread: Some(thread),
                attach,
                heartbeats,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(anyhow!(
                    "the vCPU event thread died while loading its programs"
                ))
            }
        }
    }

    pub fn attach(&self) -> TimerAttach {
        self.attach
    }

    /// Heartbeat firings on all vCPUs so far (as of the event thread's last look).
    pub fn heartbeats(&self) -> u64 {
        self.heartbeats.load(Relaxed)
    }

    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Relaxed);
        self.board.wake_sleepers();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for KernelMonitor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The kernel source's threads (the event thread and the rescuers) wake on time: the
/// least timer slack and, where allowed, SCHED_FIFO above the tasks they move.
fn prepare_thread(rt_priority: Option<i32>) {
    // SAFETY: prctl with integer arguments on the calling thread.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1, 0, 0, 0) };
    if let Some(prio) = rt_priority {
        let param = libc::sched_param {
            sched_priority: prio,
        };
        // SAFETY: valid param for the calling thread.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
            warn!(
                "the vCPU event thread runs as a normal task ({}): decisions may wait behind CPU hogs",
                std::io::Error::last_os_error()
            );
        }
    }
}
