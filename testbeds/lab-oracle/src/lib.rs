//! The oracle source, for the nested-VM lab only: the host deschedules this VM's vCPUs on
//! a schedule it drives itself (a SCHED_FIFO spinner per host CPU) and tells the guest
//! that schedule and its epoch in the guest's CLOCK_MONOTONIC. The board then holds the
//! truth: which vCPU is out right now and when each current run ends. Measured beside the
//! real sources, it says how much migration can gain on real interrupts with perfect
//! knowledge; the gap to the kernel source is the cost and error of detecting it.
//!
//! One thread wakes at each resume (hook `Resumed`) and at each push point (run end −
//! push threshold, hook `Running`) of a vCPU holding tasks. It must never be used outside
//! the lab: on a real hypervisor nobody knows the schedule. So it lives here, beside the
//! lab's build of the daemon (`vmigrater-oracle`), and the product's crates carry none of
//! it: the daemon takes it as a `vcpu_monitor::ExternalSource`.

use anyhow::{Context, Result};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use vcpu_monitor::{
    monotonic_ns, parse_cpu_schedule, sleep_until, ExternalSource, KnownVcpu, StartExternal,
    TickEvent, TickHook, VcpuBoard,
};

/// One vCPU's known steal schedule: out for `out_ns`, then running for `run_ns`, the first
/// outage `phase_ns` after the epoch (the steal emulator's `CPU:BUSY_US:IDLE_US:PHASE_US`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StealSchedule {
    pub cpu: usize,
    pub out_ns: u64,
    pub run_ns: u64,
    pub phase_ns: u64,
}

impl FromStr for StealSchedule {
    type Err = anyhow::Error;

    /// `CPU:OUT_US:RUN_US[:PHASE_US]`.
    fn from_str(s: &str) -> Result<Self> {
        let (cpu, out_us, run_us, phase_us) =
            parse_cpu_schedule(s, "schedule", ["OUT_US", "RUN_US"])?;
        Ok(StealSchedule {
            cpu,
            out_ns: out_us * 1_000,
            run_ns: run_us * 1_000,
            phase_ns: phase_us * 1_000,
        })
    }
}

/// Where a vCPU stands at a moment, times relative to the epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    Running {
        since: u64,
        until: u64,
        outages: u64,
    },
    Out {
        since: u64,
        until: u64,
        outages: u64,
    },
}

impl StealSchedule {
    /// The window containing `t` (ns after the epoch). Before the first outage the vCPU
    /// runs from the epoch on.
    pub fn at(&self, t: u64) -> Window {
        if t < self.phase_ns {
            return Window::Running {
                since: 0,
                until: self.phase_ns,
                outages: 0,
            };
        }
        let period = self.out_ns + self.run_ns;
        let k = (t - self.phase_ns) / period;
        let start = self.phase_ns + k * period;
        if t < start + self.out_ns {
            Window::Out {
                since: start,
                until: start + self.out_ns,
                outages: k + 1,
            }
        } else {
            Window::Running {
                since: start + self.out_ns,
                until: start + period,
                outages: k + 1,
            }
        }
    }
}

/// Starts the oracle on the daemon's board and hook: `schedules` from `epoch_ns` (the
/// guest's CLOCK_MONOTONIC).
pub fn start_external(schedules: Vec<StealSchedule>, epoch_ns: u64) -> StartExternal {
    Box::new(move |board, hook, push_threshold| {
        let m = ScheduleMonitor::start(board, hook, push_threshold, schedules, epoch_ns)?;
        Ok(Box::new(m) as Box<dyn ExternalSource>)
    })
}

impl ExternalSource for ScheduleMonitor {
    fn stop(self: Box<Self>) {
        ScheduleMonitor::stop(*self)
    }
}

pub struct ScheduleMonitor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ScheduleMonitor {
    pub fn start(
        board: Arc<VcpuBoard>,
        hook: Arc<dyn TickHook>,
        push_threshold: Duration,
        schedules: Vec<StealSchedule>,
        epoch_ns: u64,
    ) -> Result<ScheduleMonitor> {
        for s in &schedules {
            anyhow::ensure!(
                board.monitors(s.cpu),
                "schedule for CPU {}, which is not monitored",
                s.cpu
            );
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("vcpu-oracle".into())
                .spawn(move || {
                    oracle_thread(&board, &*hook, push_threshold, &schedules, epoch_ns, &stop)
                })
                .context("spawning the oracle thread")?
        };
        Ok(ScheduleMonitor {
            stop,
            thread: Some(thread),
        })
    }

    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ScheduleMonitor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The longest the oracle sleeps (stop flag, status freshness).
const MAX_SLEEP_NS: u64 = 100_000_000;

fn oracle_thread(
    board: &VcpuBoard,
    hook: &dyn TickHook,
    push_threshold: Duration,
    schedules: &[StealSchedule],
    epoch_ns: u64,
    stop: &AtomicBool,
) {
    let push_ns = push_threshold.as_nanos() as u64;
    // Per schedule: the outage count last seen, and the run whose push point was handled.
    let mut seen_outages = vec![u64::MAX; schedules.len()];
    let mut was_out = vec![false; schedules.len()];
    let mut pushed = vec![u64::MAX; schedules.len()];
    while !stop.load(Relaxed) {
        let now = monotonic_ns();
        let t = now.saturating_sub(epoch_ns);
        let mut resumed = Vec::new();
        let mut next = now + MAX_SLEEP_NS;
        for (i, s) in schedules.iter().enumerate() {
            let w = s.at(t);
            let (last_seen_ns, run) = match w {
                Window::Running {
                    since,
                    until,
                    outages,
                } => {
                    // Back from an outage seen while out, or one that fell between wakes.
                    if seen_outages[i] != u64::MAX && (was_out[i] || outages > seen_outages[i]) {
                        resumed.push((s.cpu, s.out_ns));
                    }
                    was_out[i] = false;
                    let push_at = epoch_ns + until.saturating_sub(push_ns);
                    if now < push_at {
                        next = next.min(push_at);
                    } else if pushed[i] != since && hook.holds_tasks(s.cpu) {
                        pushed[i] = since;
                        hook.on_tick(s.cpu, TickEvent::Running, board, now);
                    }
                    next = next.min(epoch_ns + until + s.out_ns);
                    seen_outages[i] = outages;
                    (now, Some((epoch_ns + since, until - since)))
                }
                Window::Out {
                    since,
                    until,
                    outages,
                } => {
                    next = next.min(epoch_ns + until);
                    seen_outages[i] = outages;
                    was_out[i] = true;
                    (epoch_ns + since, None)
                }
            };
            let outages = seen_outages[i];
            board.publish_known(
                s.cpu,
                KnownVcpu {
                    last_seen_ns,
                    run,
                    deschedules: outages,
                    inactive_total_ns: outages * s.out_ns,
                    last_inactive_ns: s.out_ns,
                },
            );
        }
        for (cpu, inactive_ns) in resumed {
            hook.on_tick(
                cpu,
                TickEvent::Resumed {
                    inactive_ns,
                    back_ns: now,
                },
                board,
                now,
            );
        }
        sleep_until(next.max(monotonic_ns() + 50_000));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn parses_like_the_steal_emulator() {
        let s: StealSchedule = "1:11000:11000:5500".parse().unwrap();
        assert_eq!(
            s,
            StealSchedule {
                cpu: 1,
                out_ns: 11 * MS,
                run_ns: 11 * MS,
                phase_ns: 5_500_000
            }
        );
        assert!("1:0:5".parse::<StealSchedule>().is_err());
        assert!("x:1:1".parse::<StealSchedule>().is_err());
    }

    #[test]
    fn windows_follow_the_schedule() {
        let s: StealSchedule = "0:10000:20000:5000".parse().unwrap();
        assert_eq!(
            s.at(0),
            Window::Running {
                since: 0,
                until: 5 * MS,
                outages: 0
            }
        );
        assert_eq!(
            s.at(5 * MS),
            Window::Out {
                since: 5 * MS,
                until: 15 * MS,
                outages: 1
            }
        );
        assert_eq!(
            s.at(15 * MS),
            Window::Running {
                since: 15 * MS,
                until: 35 * MS,
                outages: 1
            }
        );
        assert_eq!(
            s.at(36 * MS),
            Window::Out {
                since: 35 * MS,
                until: 45 * MS,
                outages: 2
            }
        );
    }

    /// Counts the resumes the hook is told of, per vCPU.
    #[derive(Default)]
    struct Resumes(std::sync::Mutex<Vec<usize>>);

    impl TickHook for Resumes {
        fn on_tick(&self, cpu: usize, event: TickEvent, _: &VcpuBoard, _: u64) {
            if matches!(event, TickEvent::Resumed { .. }) {
                self.0.lock().unwrap().push(cpu);
            }
        }
    }

    #[test]
    fn the_daemons_monitor_runs_the_oracle_as_an_external_source() {
        let cfg = vcpu_monitor::MonitorConfig {
            cpus: vec![0, 1],
            ..Default::default()
        };
        let board = Arc::new(VcpuBoard::new(&cfg.cpus, &cfg));
        let hook = Arc::new(Resumes::default());
        let epoch = monotonic_ns();
        // vCPU 0 out 5 ms of every 10; vCPU 1 never within the test.
        let schedules = vec![
            "0:5000:5000".parse().unwrap(),
            "1:5000:5000:10000000".parse().unwrap(),
        ];
        let (monitor, fallback) = vcpu_monitor::AnyMonitor::start(
            vcpu_monitor::Wanted::External(start_external(schedules, epoch)),
            cfg,
            board.clone(),
            hook.clone(),
            Duration::from_micros(500),
        )
        .unwrap();
        assert!(fallback.is_none());
        assert_eq!(monitor.source(), vcpu_monitor::Source::External);
        std::thread::sleep(Duration::from_millis(200));
        monitor.stop();
        let now = monotonic_ns();
        let cpu0 = board.cpu_snapshot(0, now).unwrap();
        let cpu1 = board.cpu_snapshot(1, now).unwrap();
        // Written from the schedule, not detected: every outage up to the last wake (a
        // loaded machine may wake it late, never early).
        assert!(cpu0.deschedules >= 5, "{cpu0:?}");
        assert_eq!(cpu0.inactive_total_ns, cpu0.deschedules * 5 * MS);
        assert_eq!(cpu1.deschedules, 0, "{cpu1:?}");
        let resumes = hook.0.lock().unwrap();
        assert!(
            resumes.iter().filter(|&&c| c == 0).count() >= 8,
            "{resumes:?}"
        );
        assert!(!resumes.contains(&1));
    }
}
