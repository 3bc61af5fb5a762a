//! The vCPU board: each vCPU's latest state in atomics, written only by that vCPU's
//! sleeper and read by anyone (other sleepers, the detector, metrics, status) without a
//! lock. Fields are individually atomic, not a consistent group: a reader may combine
//! values from two consecutive ticks, which is harmless at 300 µs granularity.
//!
//! The board must never take a lock. The one wait it offers is the idle sleep on the
//! demand word (a futex), so that demand turning active wakes every sleeper at once
//! instead of after a long idle period.

use std::sync::atomic::{
    AtomicU32, AtomicU64,
    Ordering::{Acquire, Relaxed},
};

use crate::config::MonitorConfig;

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
    /// The part of `inactive_total_ns` during which another vCPU was seen running (kernel
    /// source only; 0 from sleepers): time a move had somewhere to go.
    pub covered_total_ns: u64,
    pub last_seen_ns: u64,
    pub gap_threshold_ns: u64,
    /// The sleep period its sleeper currently uses.
    pub period_ns: u64,
    /// Late wake-ups judged too short to be deschedules (see `SliceEstimator`): a sign of
    /// CPU contention inside the guest rather than of the hypervisor.
    pub hiccups: u64,
}

impl VcpuSnapshot {
    /// How long until a descheduled vCPU is expected back, if its gaps last as its last one
    /// did (it went out about a period before it was judged overdue); `None` while it runs.
    pub fn back_in_ns(&self) -> Option<u64> {
        (!self.active).then(|| {
            self.last_inactive_ns
                .saturating_sub(self.inactive_for_ns + self.period_ns)
        })
    }
}

/// A vCPU as a source that knows the schedule says it is (`VcpuBoard::publish_known`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownVcpu {
    /// While running: now; while out: when it went out.
    pub last_seen_ns: u64,
    /// While running: the current run's start and length.
    pub run: Option<(u64, u64)>,
    pub deschedules: u64,
    pub inactive_total_ns: u64,
    pub last_inactive_ns: u64,
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
    pub covered_total_ns: AtomicU64,
    pub gap_threshold_ns: AtomicU64,
    pub hiccups: AtomicU64,
    /// In the guest's idle loop (kernel source only): halted, not descheduled, and free
    /// to take work the moment it is given some.
    pub idle: std::sync::atomic::AtomicBool,
    /// When a source that copies its state in batches (the kernel one) last copied this
    /// slot; 0 for sleepers, which write `last_seen_ns` live. A copy is as of its own
    /// time: judged against a later clock, a vCPU seen every tick would look out for as
    /// long as the copy is old (up to the idle period while nothing is managed).
    pub published_ns: AtomicU64,
}

const DEMAND_IDLE: u32 = 0;
const DEMAND_ACTIVE: u32 = 1;

pub struct VcpuBoard {
    pub(crate) slots: Vec<Slot>,
    /// 0 = idle, 1 = active; a futex word, hence 32 bits.
    demand: AtomicU32,
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
            demand: AtomicU32::new(DEMAND_IDLE),
        }
    }

    /// Sets what the sleepers should track. Turning active wakes idle sleepers now (one
    /// syscall, only on a change), so a long idle period costs no reaction time.
    pub fn set_demand(&self, d: Demand) {
        let v = match d {
            Demand::Idle => DEMAND_IDLE,
            Demand::Active => DEMAND_ACTIVE,
        };
        if self.demand.swap(v, Relaxed) != v {
            self.wake_sleepers();
        }
    }

    pub fn demand(&self) -> Demand {
        if self.demand.load(Relaxed) == DEMAND_IDLE {
            Demand::Idle
        } else {
            Demand::Active
        }
    }

    /// Wakes every sleeper blocked in `idle_sleep_until`.
    pub(crate) fn wake_sleepers(&self) {
        os_layer::futex_wake_all(&self.demand);
    }

    /// Sleeps until the absolute CLOCK_MONOTONIC `deadline_ns`, or until demand stops
    /// being idle, or until `wake_sleepers`. Returns early on purpose: the caller re-reads
    /// demand and its stop flag.
    pub(crate) fn idle_sleep_until(&self, deadline_ns: u64) {
        if self.demand.load(Relaxed) == DEMAND_IDLE {
            os_layer::futex_wait_until(&self.demand, DEMAND_IDLE, deadline_ns);
        }
    }

    pub fn cpus(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots.iter().map(|s| s.cpu)
    }

    pub(crate) fn slot(&self, cpu: usize) -> Option<&Slot> {
        self.slots.iter().find(|s| s.cpu == cpu)
    }

    /// Whether `cpu` is on the board.
    pub fn monitors(&self, cpu: usize) -> bool {
        self.slot(cpu).is_some()
    }

    /// Publishes what an `ExternalSource` knows of `cpu` rather than detects: no tolerance,
    /// out means not seen since `last_seen_ns`. Nothing happens for a CPU not on the board.
    pub fn publish_known(&self, cpu: usize, k: KnownVcpu) {
        let Some(slot) = self.slot(cpu) else {
            return;
        };
        slot.last_seen_ns.store(k.last_seen_ns, Relaxed);
        if let Some((start, len)) = k.run {
            slot.slice_start_ns.store(start, Relaxed);
            slot.est_slice_ns.store(len, Relaxed);
        }
        slot.period_ns.store(0, Relaxed);
        slot.gap_threshold_ns.store(0, Relaxed);
        slot.deschedules.store(k.deschedules, Relaxed);
        slot.inactive_total_ns.store(k.inactive_total_ns, Relaxed);
        slot.last_inactive_ns.store(k.last_inactive_ns, Relaxed);
    }

    fn read(s: &Slot, now_ns: u64) -> VcpuSnapshot {
        // Acquire pairs with the copy's Release: the state read is at least that copy's.
        let judged_at = match s.published_ns.load(Acquire) {
            0 => now_ns,
            at => at.min(now_ns),
        };
        let last_seen = s.last_seen_ns.load(Relaxed);
        let period = s.period_ns.load(Relaxed);
        let threshold = s.gap_threshold_ns.load(Relaxed);
        let overdue = judged_at.saturating_sub(last_seen + period);
        let active = overdue <= threshold || s.idle.load(Relaxed);
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
            covered_total_ns: s.covered_total_ns.load(Relaxed),
            last_seen_ns: last_seen,
            gap_threshold_ns: threshold,
            period_ns: period,
            hiccups: s.hiccups.load(Relaxed),
        }
    }

    pub fn snapshot(&self, now_ns: u64) -> Vec<VcpuSnapshot> {
        self.slots.iter().map(|s| Self::read(s, now_ns)).collect()
    }

    pub fn cpu_snapshot(&self, cpu: usize, now_ns: u64) -> Option<VcpuSnapshot> {
        self.slot(cpu).map(|s| Self::read(s, now_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn board() -> VcpuBoard {
        let b = VcpuBoard::new(&[0, 3], &MonitorConfig::default());
        let s = b.slot(3).unwrap();
        s.period_ns.store(300_000, Relaxed);
        s.gap_threshold_ns.store(200_000, Relaxed);
        s.last_seen_ns.store(1_000 * MS, Relaxed);
        s.slice_start_ns.store(996 * MS, Relaxed);
        s.est_slice_ns.store(10 * MS, Relaxed);
        b
    }

    #[test]
    fn a_sleeper_seen_on_time_is_active_with_its_remaining_slice() {
        let b = board();
        let s = b.cpu_snapshot(3, 1_000 * MS + 400_000).unwrap();
        assert!(s.active);
        assert_eq!(s.inactive_for_ns, 0);
        assert_eq!(s.remaining_ns, 6 * MS - 400_000);
        assert!(b.cpu_snapshot(1, 0).is_none());
        assert_eq!(
            b.snapshot(0).iter().map(|s| s.cpu).collect::<Vec<_>>(),
            [0, 3]
        );
    }

    #[test]
    fn an_overdue_sleeper_means_its_vcpu_is_out_now() {
        let b = board();
        // Due at 1000.3 ms; 0.2 ms of threshold later it is out.
        let s = b.cpu_snapshot(3, 1_000 * MS + 300_000 + 200_001).unwrap();
        assert!(!s.active);
        assert_eq!(s.remaining_ns, 0);
        assert_eq!(s.inactive_for_ns, 200_001);
        let s = b.cpu_snapshot(3, 1_005 * MS).unwrap();
        assert_eq!(s.inactive_for_ns, 5 * MS - 300_000);
    }

    #[test]
    fn an_out_vcpu_is_expected_back_when_a_gap_like_its_last_one_ends() {
        let b = board();
        b.slot(3).unwrap().last_inactive_ns.store(10 * MS, Relaxed);
        assert_eq!(b.cpu_snapshot(3, 1_000 * MS).unwrap().back_in_ns(), None);
        // Last seen at 1000 ms: out since then, 4 ms of its 10 gone.
        let s = b.cpu_snapshot(3, 1_004 * MS).unwrap();
        assert_eq!(s.back_in_ns(), Some(6 * MS));
        let s = b.cpu_snapshot(3, 1_012 * MS).unwrap();
        assert_eq!(s.back_in_ns(), Some(0), "overdue: back any moment");
    }

    #[test]
    fn a_copied_slot_is_judged_at_its_copy_not_at_the_reader_clock() {
        let b = board();
        let s = b.slot(3).unwrap();
        // Copied 0.1 ms after the vCPU was last seen: running then, whenever it is read.
        s.published_ns.store(1_000 * MS + 100_000, Relaxed);
        let late = b.cpu_snapshot(3, 1_900 * MS).unwrap();
        assert!(late.active, "a copy 900 ms old still says running");
        // Copied once it was overdue: out, by as much as it was at the copy.
        s.published_ns.store(1_002 * MS, Relaxed);
        let s = b.cpu_snapshot(3, 1_900 * MS).unwrap();
        assert!(!s.active);
        assert_eq!(s.inactive_for_ns, 2 * MS - 300_000);
    }

    #[test]
    fn demand_round_trips() {
        let b = board();
        assert_eq!(b.demand(), Demand::Idle);
        b.set_demand(Demand::Active);
        assert_eq!(b.demand(), Demand::Active);
        b.set_demand(Demand::Idle);
        assert_eq!(b.demand(), Demand::Idle);
        // With demand idle, an idle sleep lasts until its deadline (here: already past).
        b.idle_sleep_until(crate::monotonic_ns());
    }
}
