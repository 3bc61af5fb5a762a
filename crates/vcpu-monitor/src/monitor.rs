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
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tracing::{debug, warn};

use crate::board::{Demand, VcpuBoard};
use crate::estimator::{EstimatorConfig, Observation, SliceEstimator};
use crate::monotonic_ns;

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
/// A wake-up from idle costs 15–50 µs of CPU on this project's VMs, a bare C sleeper too:
/// 10 ms on 2 vCPUs measured 0.38–0.46% of a CPU and 50 ms up to 0.20%, against a 0.2%
/// budget. 100 ms keeps half of it spare, and loses no reaction time: turning demand
/// active wakes the sleepers through the board.
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

/// Online CPUs from sysfs (`VMIGRATER_SYSFS_ROOT` redirects `/sys` for tests).
pub fn online_cpus() -> Result<Vec<usize>> {
    let root = std::env::var_os("VMIGRATER_SYSFS_ROOT")
        .map_or_else(|| PathBuf::from("/sys"), PathBuf::from);
    let path = root.join("devices/system/cpu/online");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    os_layer::parse_cpu_list(&text).with_context(|| format!("parsing {}", path.display()))
}

/// What a wake-up was, for the hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TickEvent {
    /// This vCPU just came back from a gap of about `inactive_ns`.
    Resumed { inactive_ns: u64 },
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

/// Sleeps until an absolute CLOCK_MONOTONIC deadline. A signal does not cut it short: with
/// an absolute deadline the retry is exact, and an early wake-up would read as "on time"
/// while the deadline was never reached.
pub fn sleep_until(deadline_ns: u64) {
    let ts = libc::timespec {
        tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
    };
    loop {
        // SAFETY: valid timespec, no remainder wanted with TIMER_ABSTIME.
        let rc = unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &ts,
                std::ptr::null_mut(),
            )
        };
        if rc != libc::EINTR {
            return;
        }
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
                    TickEvent::Resumed { inactive_ns }
                }
                Observation::Running => TickEvent::Running,
            }
        };
        slot.last_seen_ns.store(woke, Relaxed);
        slot.gap_threshold_ns.store(est.threshold_ns(), Relaxed);
        slot.est_slice_ns.store(est.est_slice_ns(), Relaxed);
        if woke.saturating_sub(last_gap_ns) > quiet_ns {
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
        hook.on_tick(cpu, event, board, woke);
        // A vCPU can be descheduled while this thread runs, not only while it sleeps.
        // Counting the next deadline from after a hook that took longer than the gap
        // threshold would push that deadline past such a gap and hide it (1 of 280
        // emulated bursts went unseen so); counting from the wake-up keeps it visible. A
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn online_cpus_honours_the_sysfs_root() {
        let dir = std::env::temp_dir().join(format!("vmon-sysfs-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("devices/system/cpu")).unwrap();
        std::fs::write(dir.join("devices/system/cpu/online"), "0-2,4\n").unwrap();
        std::env::set_var("VMIGRATER_SYSFS_ROOT", &dir);
        let cpus = online_cpus();
        std::env::remove_var("VMIGRATER_SYSFS_ROOT");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(cpus.unwrap(), vec![0, 1, 2, 4]);
    }
}
