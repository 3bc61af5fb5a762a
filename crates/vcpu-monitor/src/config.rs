//! The monitor's settings and their defaults: one source for both vCPU sources, the
//! board and the daemon's configuration.

use anyhow::Result;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct MonitorConfig {
    /// vCPUs to watch; default: every online CPU.
    pub cpus: Vec<usize>,
    /// Sleep period while tasks need slice information.
    pub period: Duration,
    /// Period while tasks need it but no deschedule was seen for `quiet_after`.
    pub probe_period: Duration,
    /// Period while nothing needs slice information.
    pub idle_period: Duration,
    pub quiet_after: Duration,
    /// Floor of the adaptive gap threshold.
    pub min_gap_threshold: Duration,
    /// Slice assumed before one is measured (paper: 11 ms).
    pub default_slice: Duration,
    /// SCHED_FIFO priority of the sleepers; `None` runs them as normal tasks.
    pub rt_priority: Option<i32>,
}

/// The defaults, one source for the monitor and the daemon's configuration.
pub const DEFAULT_PERIOD: Duration = Duration::from_micros(300);
pub const DEFAULT_PROBE_PERIOD: Duration = Duration::from_millis(2);
/// Every wake-up from idle costs tens of µs of CPU (a bare C sleeper's too), so an idle
/// period of a few tens of ms already spends the whole 0.2% budget of a CPU that an idle
/// daemon may use. 100 ms keeps half of it spare, and loses no reaction time: turning
/// demand active wakes the sleepers through the board.
pub const DEFAULT_IDLE_PERIOD: Duration = Duration::from_millis(100);
pub const DEFAULT_MIN_GAP_THRESHOLD: Duration = Duration::from_micros(200);
/// The vMigrater paper's hypervisor slice.
pub const DEFAULT_SLICE: Duration = Duration::from_millis(11);
pub const DEFAULT_RT_PRIORITY: i32 = 1;

impl Default for MonitorConfig {
    fn default() -> Self {
        MonitorConfig {
            cpus: online_cpus().unwrap_or_else(|_| vec![0]),
            period: DEFAULT_PERIOD,
            probe_period: DEFAULT_PROBE_PERIOD,
            idle_period: DEFAULT_IDLE_PERIOD,
            quiet_after: Duration::from_secs(1),
            min_gap_threshold: DEFAULT_MIN_GAP_THRESHOLD,
            default_slice: DEFAULT_SLICE,
            rt_priority: Some(DEFAULT_RT_PRIORITY),
        }
    }
}

/// Online CPUs from sysfs.
pub fn online_cpus() -> Result<Vec<usize>> {
    Ok(os_layer::Root::real().online_cpus()?)
}
