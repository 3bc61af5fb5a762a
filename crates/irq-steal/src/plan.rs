//! The one representation of every schedule: per CPU, a sorted list of windows
//! `[start_ns, end_ns)` relative to the run's start, during which that CPU is taken away.
//! The BPF program steals exactly these windows and user space (a schedule-aware oracle,
//! the benchmark's records) reads the same plan to know when each CPU is out.
//!
//! Owns the bounds that keep the machine usable (`validate`). Must never touch the kernel:
//! pure values in, pure values out.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// The longest window: one BPF invocation never spins longer (bpf/irqsteal.h).
pub const MAX_WINDOW_NS: u64 = 50_000_000;
/// Windows per CPU that the BPF map holds (bpf/irqsteal.h IS_MAX_WINDOWS).
pub const MAX_WINDOWS_PER_CPU: usize = 16_384;
/// No CPU may be out more than this share of any one-second interval: the rest of the
/// machine (the controller, sshd, the kernel's own workers) must keep running.
pub const MAX_OUT_PERCENT: u64 = 60;
const SECOND_NS: u64 = 1_000_000_000;

/// One deschedule: the CPU is out during `[start_ns, end_ns)`, relative to the run start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    pub start_ns: u64,
    pub end_ns: u64,
}

impl Window {
    pub fn len_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

impl std::fmt::Display for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "[{:.3} ms, {:.3} ms)",
            self.start_ns as f64 / 1e6,
            self.end_ns as f64 / 1e6
        )
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuPlan {
    pub cpu: usize,
    pub windows: Vec<Window>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub cpus: Vec<CpuPlan>,
    pub length_ns: u64,
}

impl Plan {
    fn cpu(&self, cpu: usize) -> Option<&CpuPlan> {
        self.cpus.iter().find(|c| c.cpu == cpu)
    }

    /// Refuses a plan that could wedge the machine or that the BPF side cannot hold:
    /// every window non-empty, at most `MAX_WINDOW_NS`, inside the run, sorted and
    /// disjoint; no CPU out more than `MAX_OUT_PERCENT` of any one-second interval; each CPU
    /// once, at most `MAX_WINDOWS_PER_CPU` windows. The error names the CPU and window.
    pub fn validate(&self) -> Result<()> {
        for (i, c) in self.cpus.iter().enumerate() {
            if self.cpus[..i].iter().any(|o| o.cpu == c.cpu) {
                bail!("the plan names CPU {} twice", c.cpu);
            }
            if c.windows.len() > MAX_WINDOWS_PER_CPU {
                bail!(
                    "CPU {}: {} windows, more than the {MAX_WINDOWS_PER_CPU} the BPF map holds \
                     per CPU (shorten the run or lengthen the windows)",
                    c.cpu,
                    c.windows.len()
                );
            }
            for (k, w) in c.windows.iter().enumerate() {
                let at = || format!("CPU {} window {k} {w}", c.cpu);
                if w.end_ns <= w.start_ns {
                    bail!("{}: empty or reversed", at());
                }
                if w.len_ns() > MAX_WINDOW_NS {
                    bail!(
                        "{}: {:.3} ms long, more than the {} ms one window may last",
                        at(),
                        w.len_ns() as f64 / 1e6,
                        MAX_WINDOW_NS / 1_000_000
                    );
                }
                if w.end_ns > self.length_ns {
                    bail!(
                        "{}: ends after the run ({:.3} ms)",
                        at(),
                        self.length_ns as f64 / 1e6
                    );
                }
                if k > 0 && c.windows[k - 1].end_ns > w.start_ns {
                    bail!(
                        "{}: starts before the previous window {} ends (windows must be \
                         sorted and disjoint)",
                        at(),
                        c.windows[k - 1]
                    );
                }
            }
            // The most out-time in a one-second interval is reached by an interval that
            // ends at some window's end: slide one over the windows with two cursors.
            let budget = SECOND_NS / 100 * MAX_OUT_PERCENT;
            let (mut first, mut inside) = (0usize, 0u64);
            for (k, w) in c.windows.iter().enumerate() {
                inside += w.len_ns();
                let from = w.end_ns.saturating_sub(SECOND_NS);
                while c.windows[first].end_ns <= from {
                    inside -= c.windows[first].len_ns();
                    first += 1;
                }
                let clipped = from.saturating_sub(c.windows[first].start_ns);
                let out = inside - clipped.min(c.windows[first].len_ns());
                if out > budget {
                    bail!(
                        "CPU {} window {k} {w}: the CPU would be out {:.1}% of the second \
                         before its end, more than the {MAX_OUT_PERCENT}% allowed",
                        c.cpu,
                        out as f64 / SECOND_NS as f64 * 100.0,
                    );
                }
            }
        }
        Ok(())
    }

    /// Whether `cpu` is out at `t_ns` (relative to the run start).
    pub fn is_out(&self, cpu: usize, t_ns: u64) -> bool {
        self.window_at(cpu, t_ns).is_some()
    }

    /// The window `cpu` is out in at `t_ns`, if any.
    pub fn window_at(&self, cpu: usize, t_ns: u64) -> Option<Window> {
        let ws = &self.cpu(cpu)?.windows;
        let i = ws.partition_point(|w| w.end_ns <= t_ns);
        ws.get(i).filter(|w| w.start_ns <= t_ns).copied()
    }

    /// The first time after `t_ns` at which `cpu` goes out or comes back; `None` when its
    /// state never changes again.
    pub fn next_change(&self, cpu: usize, t_ns: u64) -> Option<u64> {
        let ws = &self.cpu(cpu)?.windows;
        let i = ws.partition_point(|w| w.end_ns <= t_ns);
        let w = ws.get(i)?;
        Some(if w.start_ns <= t_ns {
            w.end_ns
        } else {
            w.start_ns
        })
    }

    /// The time `cpu` is planned to be out in all.
    pub fn asked_ns(&self, cpu: usize) -> u64 {
        self.cpu(cpu)
            .map_or(0, |c| c.windows.iter().map(Window::len_ns).sum())
    }

    /// The time `cpu` is planned to be out within `[from_ns, to_ns)`.
    pub fn out_between(&self, cpu: usize, from_ns: u64, to_ns: u64) -> u64 {
        let Some(c) = self.cpu(cpu) else { return 0 };
        let i = c.windows.partition_point(|w| w.end_ns <= from_ns);
        c.windows[i..]
            .iter()
            .take_while(|w| w.start_ns < to_ns)
            .map(|w| w.end_ns.min(to_ns) - w.start_ns.max(from_ns))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn plan(windows: &[(u64, u64)], length_ms: u64) -> Plan {
        Plan {
            cpus: vec![CpuPlan {
                cpu: 1,
                windows: windows
                    .iter()
                    .map(|&(s, e)| Window {
                        start_ns: s * MS,
                        end_ns: e * MS,
                    })
                    .collect(),
            }],
            length_ns: length_ms * MS,
        }
    }

    #[test]
    fn queries_follow_the_windows() {
        let p = plan(&[(10, 20), (30, 40)], 100);
        assert!(!p.is_out(1, 0));
        assert!(p.is_out(1, 10 * MS));
        assert!(p.is_out(1, 20 * MS - 1));
        assert!(!p.is_out(1, 20 * MS));
        assert!(!p.is_out(0, 15 * MS), "a CPU not in the plan is never out");
        assert_eq!(p.next_change(1, 0), Some(10 * MS));
        assert_eq!(p.next_change(1, 15 * MS), Some(20 * MS));
        assert_eq!(p.next_change(1, 20 * MS), Some(30 * MS));
        assert_eq!(p.next_change(1, 40 * MS), None);
        assert_eq!(p.next_change(0, 0), None);
        assert_eq!(p.asked_ns(1), 20 * MS);
        assert_eq!(p.asked_ns(0), 0);
        assert_eq!(p.out_between(1, 15 * MS, 35 * MS), 10 * MS);
        assert_eq!(p.window_at(1, 35 * MS).map(|w| w.start_ns), Some(30 * MS));
    }

    #[test]
    fn a_sound_plan_passes() {
        plan(&[(0, 10), (20, 30), (40, 90)], 100)
            .validate()
            .unwrap();
        plan(&[], 100).validate().unwrap();
    }

    fn refused(p: Plan, words: &[&str]) {
        let e = p.validate().expect_err("refused").to_string();
        for w in words {
            assert!(e.contains(w), "error {e:?} lacks {w:?}");
        }
    }

    #[test]
    fn bad_windows_are_refused_by_name() {
        refused(
            plan(&[(0, 10), (20, 71)], 100),
            &["CPU 1 window 1", "51.000 ms long"],
        );
        refused(plan(&[(20, 30), (25, 35)], 100), &["window 1", "sorted"]);
        refused(plan(&[(20, 20)], 100), &["window 0", "empty"]);
        refused(plan(&[(90, 110)], 100), &["window 0", "ends after the run"]);
    }

    #[test]
    fn more_than_sixty_percent_of_a_second_is_refused() {
        // 30 ms out of every 40: 75%, caught once a second has been filled.
        let ws: Vec<(u64, u64)> = (0..50).map(|k| (k * 40, k * 40 + 30)).collect();
        let e = plan(&ws, 2000).validate().unwrap_err().to_string();
        assert!(e.contains("more than the 60% allowed"), "{e}");
        // 24 ms of every 40 is exactly 60%: allowed.
        let ws: Vec<(u64, u64)> = (0..50).map(|k| (k * 40, k * 40 + 24)).collect();
        plan(&ws, 2000).validate().unwrap();
        // A dense burst of 14 windows of 50 ms within one second (700 ms) is refused even
        // though the whole run averages far less.
        let mut ws: Vec<(u64, u64)> = (0..14).map(|k| (k * 60, k * 60 + 50)).collect();
        ws.push((5000, 5010));
        refused(plan(&ws, 10_000), &["window 12", "65.0%", "60% allowed"]);
    }

    #[test]
    fn a_cpu_named_twice_is_refused() {
        let mut p = plan(&[(0, 10)], 100);
        p.cpus.push(p.cpus[0].clone());
        refused(p, &["CPU 1 twice"]);
    }
}
