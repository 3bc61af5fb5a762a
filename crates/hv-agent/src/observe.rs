//! What the host sees of a vCPU thread without asking the guest: run and wait time
//! (`/proc/<tid>/schedstat`), wake-ups (voluntary context switches in `/proc/<tid>/status`:
//! a vCPU thread blocks when its guest halts, typically to wait for I/O), the CPU it last
//! ran on (`/proc/<tid>/stat` field 39), and the Eq. 1 EMA built from those wake-ups for
//! VMs that send no reports.

use sched_core::ema::{MAX_INTERVAL_NS, SMOOTHING};

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ThreadSample {
    pub run_ns: u64,
    pub wait_ns: u64,
    pub wakeups: u64,
    pub last_cpu: Option<usize>,
}

pub fn sample(tid: u32) -> Option<ThreadSample> {
    let sched = std::fs::read_to_string(format!("/proc/{tid}/schedstat")).ok()?;
    let mut f = sched.split_whitespace().map(|x| x.parse::<u64>().ok());
    let (run_ns, wait_ns) = (f.next()??, f.next()??);
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    let wakeups = status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Some(ThreadSample {
        run_ns,
        wait_ns,
        wakeups,
        last_cpu: std::fs::read_to_string(format!("/proc/{tid}/stat"))
            .ok()
            .as_deref()
            .and_then(last_cpu),
    })
}

/// The CPU a thread last ran on, from its `stat` text.
fn last_cpu(stat: &str) -> Option<usize> {
    os_layer::TaskStat::parse(stat)?
        .last_cpu
        .map(|c| c as usize)
}

/// Host-side stand-in for a guest report: Eq. 1 over the mean interval between the
/// thread's wake-ups in each period. Intervals over 10 ms are not I/O (the paper's rule).
#[derive(Clone, Debug, Default)]
pub struct WakeupEma {
    ema_ns: f64,
}

impl WakeupEma {
    /// Feeds one period; returns (E_n, Ī_e in ns) for the credit core.
    pub fn on_period(&mut self, wakeups: u64, period_ns: u64) -> (u64, f64) {
        if wakeups == 0 {
            return (0, self.ema_ns);
        }
        let interval = period_ns / wakeups;
        if interval > MAX_INTERVAL_NS {
            return (0, self.ema_ns);
        }
        self.ema_ns = if self.ema_ns == 0.0 {
            interval as f64
        } else {
            SMOOTHING * self.ema_ns + (1.0 - SMOOTHING) * interval as f64
        };
        (wakeups, self.ema_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_field_39_survives_odd_names() {
        let stat = os_layer::fake_stat_line(42, "CPU 0/KVM) x", 0, 1, 7);
        assert_eq!(last_cpu(&stat), Some(7));
        assert_eq!(last_cpu("garbage"), None);
    }

    #[test]
    fn this_thread_is_observable() {
        let tid = nix::unistd::gettid().as_raw() as u32;
        let a = sample(tid).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let b = sample(tid).unwrap();
        assert!(b.wakeups > a.wakeups, "{a:?} {b:?}");
        assert!(b.last_cpu.is_some());
    }

    #[test]
    fn wakeup_ema_follows_eq_1() {
        let mut e = WakeupEma::default();
        // 100 wake-ups in 100 ms: 1 ms apart.
        assert_eq!(e.on_period(100, 100_000_000), (100, 1_000_000.0));
        // Then 200: 0.5 ms; EMA = 0.9 × 1 ms + 0.1 × 0.5 ms.
        let (n, ema) = e.on_period(200, 100_000_000);
        assert_eq!(n, 200);
        assert!((ema - 950_000.0).abs() < 1e-6, "{ema}");
        // Five wake-ups in 100 ms are 20 ms apart: not I/O, EMA kept.
        assert_eq!(e.on_period(5, 100_000_000), (0, ema));
        assert_eq!(e.on_period(0, 100_000_000), (0, ema));
    }
}
