//! What the host sees of a vCPU thread without asking the guest: run and wait time
//! (`/proc/<tid>/schedstat`), wake-ups (voluntary context switches in `/proc/<tid>/status`:
//! a vCPU thread blocks when its guest halts, typically to wait for I/O), device kicks
//! (write system calls in `/proc/<tid>/io`), the CPU it last ran on (`/proc/<tid>/stat`
//! field 39), and the Eq. 1 EMA built from those events for VMs that send no reports.
//!
//! Kicks: where the VMM handles a guest's virtqueue notification in the vCPU thread's user
//! space (QEMU under TCG, or KVM without ioeventfd), each I/O request the guest submits
//! from that vCPU is one `write` to an eventfd by that thread, on top of a steady floor of
//! QEMU's own writes (kicks of its main loop) that every vCPU thread shares. That names the
//! vCPU that submits the VM's I/O; wake-ups do not when every vCPU also computes (it never
//! halts), and then they can favour the wrong vCPU (a sequential reader's over a random
//! reader's). With in-kernel
//! ioeventfd (KVM's usual path) the vCPU thread makes no such call, kicks stay flat, and
//! wake-ups are used as before.

use sched_core::ema::{MAX_INTERVAL_NS, SMOOTHING};

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ThreadSample {
    pub run_ns: u64,
    pub wait_ns: u64,
    pub wakeups: u64,
    /// Write system calls so far (`syscw`), None where `/proc/<tid>/io` is unreadable.
    pub kicks: Option<u64>,
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
    let kicks = std::fs::read_to_string(format!("/proc/{tid}/io"))
        .ok()
        .as_deref()
        .and_then(syscw);
    Some(ThreadSample {
        run_ns,
        wait_ns,
        wakeups,
        kicks,
        last_cpu: std::fs::read_to_string(format!("/proc/{tid}/stat"))
            .ok()
            .as_deref()
            .and_then(last_cpu),
    })
}

/// What a thread did between two samples.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Delta {
    pub run_ns: u64,
    pub wait_ns: u64,
    pub wakeups: u64,
    /// None unless both samples could read `/proc/<tid>/io`.
    pub kicks: Option<u64>,
}

impl ThreadSample {
    pub fn since(&self, prev: &ThreadSample) -> Delta {
        Delta {
            run_ns: self.run_ns.saturating_sub(prev.run_ns),
            wait_ns: self.wait_ns.saturating_sub(prev.wait_ns),
            wakeups: self.wakeups.saturating_sub(prev.wakeups),
            kicks: self.kicks.zip(prev.kicks).map(|(s, p)| s.saturating_sub(p)),
        }
    }
}

fn syscw(io: &str) -> Option<u64> {
    io.lines()
        .find_map(|l| l.strip_prefix("syscw:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Kicks per second a vCPU must submit above its VM's quietest vCPU to count as carrying
/// I/O: well above how much the VMM's own writes differ between the threads of one VM, so
/// that floor's noise never names a vCPU.
pub const KICK_MARGIN_PER_S: u64 = 100;

/// This period's host-side I/O events of a VM's vCPUs, and whether they are kicks: each
/// vCPU's kicks above the VM's quietest vCPU (the VMM's own writes are a floor every vCPU
/// thread shares; a VM that does I/O from every vCPU alike has no vCPU to favour, which is
/// what `vm-funded` needs to know), below `KICK_MARGIN_PER_S` none. A one-vCPU VM, or a VM
/// whose threads show no kicks above the margin at all, falls back to its wake-ups.
pub fn host_io_events(kicks: &[Option<u64>], wakeups: &[u64], period_ns: u64) -> (Vec<u64>, bool) {
    let margin = KICK_MARGIN_PER_S * period_ns / 1_000_000_000;
    let all: Option<Vec<u64>> = kicks.iter().copied().collect();
    if let Some(k) = all.filter(|k| k.len() >= 2) {
        let floor = k.iter().copied().min().unwrap_or(0);
        let above: Vec<u64> = k
            .iter()
            .map(|&x| x - floor)
            .map(|x| if x < margin.max(1) { 0 } else { x })
            .collect();
        if above.iter().any(|&x| x > 0) {
            return (above, true);
        }
    }
    (wakeups.to_vec(), false)
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
    fn this_threads_writes_count_as_kicks() {
        use std::io::Write;
        let tid = nix::unistd::gettid().as_raw() as u32;
        let a = sample(tid)
            .unwrap()
            .kicks
            .expect("own /proc/<tid>/io is readable");
        let mut null = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .unwrap();
        for _ in 0..100 {
            null.write_all(b"x").unwrap();
        }
        let b = sample(tid).unwrap().kicks.unwrap();
        assert!(b - a >= 100, "{a} -> {b}");
        assert_eq!(syscw("rchar: 1\nsyscr: 2\nsyscw: 37\n"), Some(37));
        assert_eq!(syscw("garbage"), None);
    }

    #[test]
    fn kicks_above_the_quietest_vcpu_name_the_io_vcpu() {
        let p = 100_000_000; // 100 ms: margin 10 kicks
                             // The lab's figures per 100 ms: the reader's vCPU 300, the other 25.
        assert_eq!(
            host_io_events(&[Some(300), Some(25)], &[7, 9], p),
            (vec![275, 0], true)
        );
        // Two readers: the busier submitter stands out, the other's surplus too if large.
        assert_eq!(
            host_io_events(&[Some(150), Some(60), Some(20)], &[0, 0, 0], p),
            (vec![130, 40, 0], true)
        );
        // Only the VMM's floor, ±noise: nobody carries I/O by kicks -> wake-ups.
        assert_eq!(
            host_io_events(&[Some(25), Some(31)], &[4, 0], p),
            (vec![4, 0], false)
        );
        // KVM with ioeventfd: flat kicks -> wake-ups.
        assert_eq!(
            host_io_events(&[Some(0), Some(0)], &[12, 3], p),
            (vec![12, 3], false)
        );
        // Unreadable io (no permission), or one vCPU: wake-ups.
        assert_eq!(
            host_io_events(&[None, Some(500)], &[1, 2], p),
            (vec![1, 2], false)
        );
        assert_eq!(host_io_events(&[Some(500)], &[3], p), (vec![3], false));
        // Every vCPU submits alike: no kick singles one out, so wake-ups decide (under
        // vm-funded a VM whose vCPUs all carry I/O has no payer either way).
        assert_eq!(
            host_io_events(&[Some(300), Some(295)], &[40, 40], p),
            (vec![40, 40], false)
        );
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
