//! vCPU time-slice detection inside a guest (vMigrater §2.4.1), from one of two sources:
//! - `kernel` (preferred): a BPF program watches the timers the guest kernel fires anyway;
//!   a timer that fires late means the vCPU was descheduled (`KernelMonitor`).
//! - `sleepers` (the paper's mechanism, the fallback): one sleeper thread per vCPU,
//!   pinned to it, sleeps on absolute CLOCK_MONOTONIC deadlines; a wake-up much later
//!   than asked means the hypervisor had that vCPU descheduled (`Monitor`).
//!
//! A source from outside this crate (`ExternalSource`) can feed the same board and hook:
//! the nested-VM lab's oracle (the host's known steal schedule, crate `lab-oracle`) is
//! one. The product has none: on a real hypervisor nobody knows the schedule.
//!
//! Every source feeds the same board and hook. The pure `SliceEstimator`
//! turns wake-ups into slices; the lock-free `VcpuBoard` publishes each vCPU's state to
//! every other thread; a `TickHook` lets the caller decide on the sleeper's own thread,
//! where the information is freshest.
//!
//! This crate must never block a sleeper on a lock, and never spin: the only waits are
//! the timed sleeps.

mod board;
mod bpf_skel;
mod config;
mod cpu_schedule;
mod estimator;
mod kernel;
mod monitor;

pub use board::{Demand, KnownVcpu, VcpuBoard, VcpuSnapshot};
pub use config::{
    online_cpus, MonitorConfig, DEFAULT_IDLE_PERIOD, DEFAULT_MIN_GAP_THRESHOLD, DEFAULT_PERIOD,
    DEFAULT_PROBE_PERIOD, DEFAULT_RT_PRIORITY, DEFAULT_SLICE,
};
pub use cpu_schedule::parse_cpu_schedule;
pub use estimator::{EstimatorConfig, Observation, SliceEstimator};
pub use kernel::{KernelMonitor, TimerAttach, MIN_KERNEL_GAP_THRESHOLD};
pub use monitor::{Monitor, TickEvent, TickHook};

/// CLOCK_MONOTONIC: the one clock of the sleepers, the board and callers.
pub use os_layer::{monotonic_ns, sleep_until};

/// Where vCPU deschedules are learnt from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Late kernel timers seen by BPF: no wake-up of our own per tick.
    Kernel,
    /// Timed sleeps of a SCHED_FIFO thread per vCPU.
    Sleepers,
    /// A source linked in from outside this crate (the nested-VM lab's oracle).
    External,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Kernel => "kernel",
            Source::Sleepers => "sleepers",
            Source::External => "external",
        }
    }
}

/// The running monitor of either source.
pub enum AnyMonitor {
    Kernel(KernelMonitor),
    Sleepers(Monitor),
    External(Box<dyn ExternalSource>),
}

/// A tick source from outside this crate: it feeds the board and the hook as the kernel
/// and sleeper sources do (the nested-VM lab's oracle, which knows the host's schedule).
pub trait ExternalSource: Send {
    /// Stops its threads; the board keeps what it last said.
    fn stop(self: Box<Self>);
}

/// Starts an external source on the board and the hook, with the push threshold.
pub type StartExternal = Box<
    dyn FnOnce(
            std::sync::Arc<VcpuBoard>,
            std::sync::Arc<dyn TickHook>,
            std::time::Duration,
        ) -> anyhow::Result<Box<dyn ExternalSource>>
        + Send,
>;

/// What `AnyMonitor::start` should run.
pub enum Wanted {
    /// The kernel source, the sleepers where it does not load.
    Auto,
    Kernel,
    Sleepers,
    External(StartExternal),
}

impl std::fmt::Debug for Wanted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Wanted::Auto => "Auto",
            Wanted::Kernel => "Kernel",
            Wanted::Sleepers => "Sleepers",
            Wanted::External(_) => "External",
        })
    }
}

impl AnyMonitor {
    /// Starts `wanted`; with `Auto` the kernel source, or the sleepers where it does not
    /// load (the reason is returned for the log, once).
    pub fn start(
        wanted: Wanted,
        cfg: MonitorConfig,
        board: std::sync::Arc<VcpuBoard>,
        hook: std::sync::Arc<dyn TickHook>,
        push_threshold: std::time::Duration,
    ) -> anyhow::Result<(AnyMonitor, Option<String>)> {
        use anyhow::Context;
        match wanted {
            Wanted::External(start) => Ok((
                AnyMonitor::External(start(board, hook, push_threshold)?),
                None,
            )),
            Wanted::Sleepers => Ok((
                AnyMonitor::Sleepers(Monitor::start(cfg, board, hook)?),
                None,
            )),
            Wanted::Kernel => Ok((
                AnyMonitor::Kernel(
                    KernelMonitor::start(cfg, board, hook, push_threshold)
                        .context("starting the kernel-timer vCPU monitor")?,
                ),
                None,
            )),
            Wanted::Auto => {
                match KernelMonitor::start(cfg.clone(), board.clone(), hook.clone(), push_threshold)
                {
                    Ok(k) => Ok((AnyMonitor::Kernel(k), None)),
                    Err(e) => Ok((
                        AnyMonitor::Sleepers(Monitor::start(cfg, board, hook)?),
                        Some(format!("{e:#}")),
                    )),
                }
            }
        }
    }

    pub fn source(&self) -> Source {
        match self {
            AnyMonitor::Kernel(_) => Source::Kernel,
            AnyMonitor::Sleepers(_) => Source::Sleepers,
            AnyMonitor::External(_) => Source::External,
        }
    }

    pub fn stop(self) {
        match self {
            AnyMonitor::Kernel(k) => k.stop(),
            AnyMonitor::Sleepers(m) => m.stop(),
            AnyMonitor::External(o) => o.stop(),
        }
    }
}
