//! vCPU time-slice detection inside a guest (vMigrater §2.4.1). One sleeper thread per
//! vCPU, pinned to it, sleeps on absolute CLOCK_MONOTONIC deadlines; a wake-up much later
//! than asked means the hypervisor had that vCPU descheduled. The pure `SliceEstimator`
//! turns wake-ups into slices; the lock-free `VcpuBoard` publishes each vCPU's state to
//! every other thread; a `TickHook` lets the caller decide on the sleeper's own thread,
//! where the information is freshest.
//!
//! This crate must never block a sleeper on a lock, and never spin: the only waits are
//! the timed sleeps.

mod board;
mod estimator;
mod monitor;

pub use board::{Demand, VcpuBoard, VcpuSnapshot};
pub use estimator::{EstimatorConfig, Observation, SliceEstimator};
pub use monitor::{online_cpus, sleep_until, Monitor, MonitorConfig, TickEvent, TickHook};

/// CLOCK_MONOTONIC in nanoseconds: the one clock of the sleepers, the board and callers.
pub fn monotonic_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always available");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}
