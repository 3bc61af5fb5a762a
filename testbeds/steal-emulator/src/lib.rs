//! The steal emulator: takes CPUs away on a schedule, the way a hypervisor deschedules a
//! vCPU. Per CPU, a thread pinned to it runs as SCHED_FIFO and busy-spins for `busy`,
//! then sleeps for `idle`, offset by `phase`; while it spins no normal task (and no
//! lower-priority RT task) runs on that CPU. It records what it actually stole, as ground
//! truth for tests and benchmarks. It must never run unbounded: every burst is bounded and
//! the RT throttle (95% per second) stays in force.
//!
//! Unlike a real hypervisor, the kernel sees the spinning thread, so its load balancer may
//! move tasks away by itself; benchmarks report that honestly.

use anyhow::{bail, Context, Result};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// One CPU's schedule: busy (stolen) for `busy`, then idle (given back) for `idle`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    pub cpu: usize,
    pub busy: Duration,
    pub idle: Duration,
    pub phase: Duration,
}

impl FromStr for Pattern {
    type Err = anyhow::Error;

    /// `CPU:BUSY_US:IDLE_US[:PHASE_US]`, e.g. `1:10000:10000:10000`.
    fn from_str(s: &str) -> Result<Pattern> {
        let (cpu, busy, idle, phase) =
            vcpu_monitor::parse_cpu_schedule(s, "pattern", ["BUSY_US", "IDLE_US"])?;
        Ok(Pattern {
            cpu,
            busy: Duration::from_micros(busy),
            idle: Duration::from_micros(idle),
            phase: Duration::from_micros(phase),
        })
    }
}

/// What one CPU's thread actually stole: `[start, end)` CLOCK_MONOTONIC ns of every burst.
#[derive(Clone, Debug, Default)]
pub struct StealRecord {
    pub cpu: usize,
    pub intervals: Vec<(u64, u64)>,
}

impl StealRecord {
    pub fn stolen_ns(&self) -> u64 {
        self.intervals.iter().map(|(a, b)| b - a).sum()
    }
}

pub struct Emulator {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Result<StealRecord>>>,
    epoch: u64,
}

pub use os_layer::{monotonic_ns, sleep_until};

fn become_fifo_on(cpu: usize, priority: i32) -> Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu)
        .with_context(|| format!("CPU {cpu} out of range"))?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .with_context(|| format!("pinning to CPU {cpu} (is it online?)"))?;
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: valid param for the calling thread (pid 0).
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EPERM) {
            bail!("SCHED_FIFO on CPU {cpu} needs root (CAP_SYS_NICE): {err}; run it as root");
        }
        bail!("sched_setscheduler(SCHED_FIFO, {priority}): {err}");
    }
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1, 0, 0, 0) };
    Ok(())
}

impl Emulator {
    /// Starts one thread per pattern; all share one epoch so phases line up.
    pub fn start(patterns: &[Pattern], rt_priority: i32) -> Result<Emulator> {
        anyhow::ensure!(!patterns.is_empty(), "no pattern: nothing to steal");
        anyhow::ensure!(
            (1..=99).contains(&rt_priority),
            "SCHED_FIFO priority {rt_priority} is outside 1..=99"
        );
        for (i, p) in patterns.iter().enumerate() {
            // Two spinners of one priority on one CPU would take turns, not follow either
            // schedule, and the ground truth would be wrong.
            anyhow::ensure!(
                !patterns[..i].iter().any(|q| q.cpu == p.cpu),
                "CPU {} has two patterns; give each CPU one",
                p.cpu
            );
        }
        let stop = Arc::new(AtomicBool::new(false));
        // Start slightly in the future so every thread is pinned and FIFO before its phase.
        let epoch = monotonic_ns() + 20_000_000;
        let mut threads = Vec::new();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
        for p in patterns.iter().cloned() {
            let stop = stop.clone();
            let ready = ready_tx.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("steal-cpu{}", p.cpu))
                    .spawn(move || -> Result<StealRecord> {
                        if let Err(e) = become_fifo_on(p.cpu, rt_priority) {
                            let msg = format!("{e:#}");
                            let _ = ready.send(Err(e));
                            bail!(msg);
                        }
                        let _ = ready.send(Ok(()));
                        Ok(steal_loop(&p, epoch, &stop))
                    })?,
            );
        }
        drop(ready_tx);
        let mut emu = Emulator {
            stop,
            threads,
            epoch,
        };
        for _ in 0..patterns.len() {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    emu.stop_threads();
                    return Err(e);
                }
                Err(_) => {
                    emu.stop_threads();
                    bail!("a steal thread died before starting");
                }
            }
        }
        Ok(emu)
    }

    fn stop_threads(&mut self) -> Vec<StealRecord> {
        self.stop.store(true, Ordering::Relaxed);
        self.threads
            .drain(..)
            .filter_map(|t| t.join().ok().and_then(|r| r.ok()))
            .collect()
    }

    /// CLOCK_MONOTONIC ns from which every pattern's phase counts.
    pub fn epoch_ns(&self) -> u64 {
        self.epoch
    }

    /// Stops every thread and returns what each actually stole.
    pub fn stop(mut self) -> Vec<StealRecord> {
        self.stop_threads()
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

fn steal_loop(p: &Pattern, epoch: u64, stop: &AtomicBool) -> StealRecord {
    let busy = p.busy.as_nanos() as u64;
    let period = busy + p.idle.as_nanos() as u64;
    let mut rec = StealRecord {
        cpu: p.cpu,
        intervals: Vec::new(),
    };
    let mut start = epoch + p.phase.as_nanos() as u64;
    while !stop.load(Ordering::Relaxed) {
        sleep_until(start);
        let begun = monotonic_ns();
        let end = start.max(begun) + busy;
        while monotonic_ns() < end {
            std::hint::spin_loop();
        }
        rec.intervals.push((begun, monotonic_ns()));
        start += period;
        // Fell behind (e.g. RT throttling): skip missed periods instead of bursting.
        let now = monotonic_ns();
        while start + busy < now {
            start += period;
        }
    }
    rec
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_full_and_short_patterns() {
        let p: Pattern = "1:10000:10000:10000".parse().unwrap();
        assert_eq!(
            p,
            Pattern {
                cpu: 1,
                busy: Duration::from_millis(10),
                idle: Duration::from_millis(10),
                phase: Duration::from_millis(10)
            }
        );
        let p: Pattern = "0:500:1500".parse().unwrap();
        assert_eq!(p.phase, Duration::ZERO);
    }

    #[test]
    fn refuses_what_it_cannot_honour_before_touching_the_scheduler() {
        let p: Pattern = "0:1000:1000".parse().unwrap();
        assert!(Emulator::start(&[], 50).is_err());
        assert!(Emulator::start(std::slice::from_ref(&p), 0).is_err());
        let e = Emulator::start(&[p.clone(), p], 50)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("two patterns"), "{e}");
    }

    #[test]
    fn rejects_bad_patterns_with_the_field() {
        let e = "0:abc:10".parse::<Pattern>().unwrap_err().to_string();
        assert!(e.contains("BUSY_US"), "{e}");
        assert!("0:10".parse::<Pattern>().is_err());
        assert!("0:0:10".parse::<Pattern>().is_err());
    }
}
