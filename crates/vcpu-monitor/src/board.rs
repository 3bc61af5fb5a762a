//! The vCPU board: each vCPU's latest state in atomics, written only by that vCPU's
//! sleeper and read by anyone (other sleepers, the detector, metrics, status) without a
//! lock. Fields are individually atomic, not a consistent group: a reader may combine
//! values from two consecutive ticks, which is harmless at 300 µs granularity.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};

use crate::monitor::MonitorConfig;

/// Whether anybody needs slice information right now (I/O-bound tasks exist).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Demand {
    /// Nothing to migrate: sleep long, cost nothing.
    Idle,
    /// I/O-bound tasks exist: track slices precisely.
    Active,
}

/// One vCPU as seen at `now`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VcpuSnapshot {
    pub cpu: usize,
    /// Its sleeper was seen within one period plus the gap threshold: it runs now. A
    /// vCPU whose sleeper is overdue is descheduled right now — this is how a running
    /// vCPU's thread learns that another one is out.
    pub active: bool,
    pub slice_start_ns: u64,
    pub est_slice_ns: u64,
    /// 0 when inactive.
    pub remaining_ns: u64,
    pub last_inactive_ns: u64,
    /// How long it has been overdue; 0 when active.
    pub inactive_for_ns: u64,
    pub deschedules: u64,
    pub inactive_total_ns: u64,
    pub last_seen_ns: u64,
    pub gap_threshold_ns: u64,
    /// The sleep period its sleeper currently uses.
    pub period_ns: u64,
}

#[derive(Default)]
pub(crate) struct Slot {
    pub cpu: usize,
    pub last_seen_ns: AtomicU64,
    pub period_ns: AtomicU64,
    pub slice_start_ns: AtomicU64,
    pub est_slice_ns: AtomicU64,
    pub last_inactive_ns: AtomicU64,
    pub deschedules: AtomicU64,
    pub inactive_total_ns: AtomicU64,
    pub gap_threshold_ns: AtomicU64,
}

pub struct VcpuBoard {
    pub(crate) slots: Vec<Slot>,
    demand: AtomicU8,
}

impl VcpuBoard {
    pub fn new(cpus: &[usize], cfg: &MonitorConfig) -> Self {
        let now = crate::monotonic_ns();
        let slots = cpus
            .iter()
            .map(|&cpu| {
                let s = Slot {
                    cpu,
                    ..Default::default()
                };
                s.last_seen_ns.store(now, Relaxed);
                s.slice_start_ns.store(now, Relaxed);
                s.period_ns
                    .store(cfg.idle_period.as_nanos() as u64, Relaxed);
                s.est_slice_ns
                    .store(cfg.default_slice.as_nanos() as u64, Relaxed);
                s.gap_threshold_ns
                    .store(cfg.min_gap_threshold.as_nanos() as u64, Relaxed);
                s
            })
            .collect();
        VcpuBoard {
            slots,
            demand: AtomicU8::new(0),
        }
    }

    pub fn set_demand(&self, d: Demand) {
        self.demand
            .store(matches!(d, Demand::Active) as u8, Relaxed);
    }

    pub fn demand(&self) -> Demand {
        if self.demand.load(Relaxed) == 0 {
            Demand::Idle
        } else {
            Demand::Active
        }
    }

    pub fn cpus(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots.iter().map(|s| s.cpu)
    }

    pub(crate) fn slot(&self, cpu: usize) -> Option<&Slot> {
        self.slots.iter().find(|s| s.cpu == cpu)
    }

    fn read(s: &Slot, now_ns: u64) -> VcpuSnapshot {
        let last_seen = s.last_seen_ns.load(Relaxed);
        let period = s.period_ns.load(Relaxed);
        let threshold = s.gap_threshold_ns.load(Relaxed);
        let overdue = now_ns.saturating_sub(last_seen + period);
        let active = overdue <= threshold;
        let slice_start = s.slice_start_ns.load(Relaxed);
        let est = s.est_slice_ns.load(Relaxed);
        VcpuSnapshot {
            cpu: s.cpu,
            active,
            slice_start_ns: slice_start,
            est_slice_ns: est,
            remaining_ns: if active {
                (slice_start + est).saturating_sub(now_ns)
            } else {
                0
            },
            last_inactive_ns: s.last_inactive_ns.load(Relaxed),
            inactive_for_ns: if active { 0 } else { overdue },
            deschedules: s.deschedules.load(Relaxed),
            inactive_total_ns: s.inactive_total_ns.load(Relaxed),
            last_seen_ns: last_seen,
            gap_threshold_ns: threshold,
            period_ns: period,
        }
    }

    pub fn snapshot(&self, now_ns: u64) -> Vec<VcpuSnapshot> {
        self.slots.iter().map(|s| Self::read(s, now_ns)).collect()
    }

    pub fn cpu_snapshot(&self, cpu: usize, now_ns: u64) -> Option<VcpuSnapshot> {
        self.slot(cpu).map(|s| Self::read(s, now_ns))
    }
}
