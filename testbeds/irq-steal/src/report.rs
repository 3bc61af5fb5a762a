//! What a run stole, per CPU, as the BPF program measured it, against what its plan asked;
//! and the acceptance test of a run (a run off its schedule by more than the tolerance is
//! to be rejected and repeated by its caller).
//!
//! Owns the arithmetic of that judgement. Must never adjust the measured numbers: a window
//! entered late (the program runs once per sample period, so it enters a window at the
//! first sample inside it) shows up as stolen time short of asked, and is reported as
//! `late_ns` and `windows_missed` beside it, not hidden.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuSteal {
    pub cpu: usize,
    /// Planned out-time.
    pub asked_ns: u64,
    /// Time the program spun with interrupts off on this CPU.
    pub stolen_ns: u64,
    /// Windows in the plan.
    pub windows: u64,
    /// Windows the program entered.
    pub windows_hit: u64,
    /// Windows that fell between two samples and were never entered.
    pub windows_missed: u64,
    /// Sum over entered windows of the delay from the window's start to the first sample
    /// inside it: the part of the shortfall due to sampling.
    pub late_ns: u64,
    /// Samples that found the controller's heartbeat stale and stole nothing.
    pub watchdog_skips: u64,
    /// Program invocations on this CPU.
    pub samples: u64,
    /// The part of `stolen_ns` spun while the CPU's absorber was the task interrupted
    /// (`Accounting::Absorbed`), so charged to no guest task; 0 without an absorber.
    #[serde(default)]
    pub absorbed_ns: u64,
}

impl CpuSteal {
    /// The share of the stolen time the absorber took (0 when nothing was stolen).
    pub fn absorbed_fraction(&self) -> f64 {
        if self.stolen_ns == 0 {
            0.0
        } else {
            self.absorbed_ns as f64 / self.stolen_ns as f64
        }
    }

    /// |stolen − asked| / asked; 0 when nothing was asked and nothing stolen.
    pub fn error(&self) -> f64 {
        let diff = self.stolen_ns.abs_diff(self.asked_ns) as f64;
        match self.asked_ns {
            0 if self.stolen_ns == 0 => 0.0,
            0 => f64::INFINITY,
            a => diff / a as f64,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StealReport {
    pub cpus: Vec<CpuSteal>,
}

impl StealReport {
    /// The largest relative error of any CPU.
    pub fn worst_error(&self) -> f64 {
        self.cpus.iter().map(CpuSteal::error).fold(0.0, f64::max)
    }

    /// Every CPU stole within `tol` (0.05 = 5%) of what it was asked, late entries counted
    /// as the shortfall they are.
    pub fn within(&self, tol: f64) -> bool {
        self.worst_error() <= tol
    }
}

impl std::fmt::Display for StealReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:>4} {:>11} {:>11} {:>7} {:>8} {:>7} {:>7} {:>9} {:>8} {:>9}",
            "cpu",
            "asked_ms",
            "stolen_ms",
            "error",
            "windows",
            "hit",
            "missed",
            "late_ms",
            "wd_skips",
            "absorbed"
        )?;
        for c in &self.cpus {
            writeln!(
                f,
                "{:>4} {:>11.3} {:>11.3} {:>6.2}% {:>8} {:>7} {:>7} {:>9.3} {:>8} {:>8.1}%",
                c.cpu,
                c.asked_ns as f64 / 1e6,
                c.stolen_ns as f64 / 1e6,
                c.error() * 100.0,
                c.windows,
                c.windows_hit,
                c.windows_missed,
                c.late_ns as f64 / 1e6,
                c.watchdog_skips,
                c.absorbed_fraction() * 100.0
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(asked_ns: u64, stolen_ns: u64) -> CpuSteal {
        CpuSteal {
            cpu: 0,
            asked_ns,
            stolen_ns,
            windows: 1,
            windows_hit: 1,
            windows_missed: 0,
            late_ns: 0,
            watchdog_skips: 0,
            samples: 1,
            absorbed_ns: 0,
        }
    }

    #[test]
    fn the_worst_cpu_decides() {
        let r = StealReport {
            cpus: vec![cpu(1000, 990), cpu(1000, 940)],
        };
        assert!((r.worst_error() - 0.06).abs() < 1e-9);
        assert!(!r.within(0.05));
        assert!(r.within(0.07));
        assert!(StealReport::default().within(0.0));
    }

    #[test]
    fn stealing_unasked_is_an_error_too() {
        assert_eq!(cpu(0, 0).error(), 0.0);
        assert!(cpu(0, 5).error().is_infinite());
        assert!((cpu(1000, 1100).error() - 0.1).abs() < 1e-9);
    }
}
