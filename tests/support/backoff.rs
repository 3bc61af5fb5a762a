//! The steal-driven backoff baseline of the hard-IRQ benchmarks: the policy proposed for
//! Linux guests, where a vCPU whose steal time is high is treated as slow and tasks are
//! kept off the vCPUs stolen most. Every `PERIOD` it takes each vCPU's steal over the period
//! just ended (from the plan: what a host that reports steal time shows its guest, one
//! period late as any accounting is) and allows the application's tasks only on the vCPUs
//! stolen within `MARGIN_PERCENT` of the least stolen one, while that one's steal is
//! `THRESHOLD_PERCENT` or more below the most stolen; on every vCPU otherwise. It knows
//! nothing of completions or of the plan ahead.

use anyhow::Result;
use irq_steal::Plan;
use os_layer::time::{monotonic_ns, sleep_until};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How often steal is read and the placement revised.
pub const PERIOD: Duration = Duration::from_millis(100);
/// Steal points (of the period) between the most and the least stolen vCPU above which
/// the most stolen ones are avoided.
pub const THRESHOLD_PERCENT: u64 = 10;
/// vCPUs stolen within this many points of the least stolen one stay allowed.
pub const MARGIN_PERCENT: u64 = 5;

/// What the baseline did in one run.
#[derive(Default)]
pub struct BackoffLog {
    revisions: AtomicU64,
    narrowed: AtomicU64,
    errors: AtomicU64,
}

impl BackoffLog {
    pub fn to_json(&self) -> Value {
        json!({
            "periods": self.revisions.load(Ordering::Relaxed),
            "periods_narrowed": self.narrowed.load(Ordering::Relaxed),
            "setaffinity_errors": self.errors.load(Ordering::Relaxed),
            "period_ms": PERIOD.as_millis() as u64,
            "threshold_percent": THRESHOLD_PERCENT,
            "margin_percent": MARGIN_PERCENT,
        })
    }
}

/// The vCPUs allowed after a period in which each of `cpus` was out `out_ns[i]` of `period_ns`.
pub fn allowed(cpus: &[usize], out_ns: &[u64], period_ns: u64) -> Vec<usize> {
    let pct = |ns: u64| ns * 100 / period_ns.max(1);
    let (Some(&least), Some(&most)) = (out_ns.iter().min(), out_ns.iter().max()) else {
        return cpus.to_vec();
    };
    if pct(most) < pct(least) + THRESHOLD_PERCENT {
        return cpus.to_vec();
    }
    cpus.iter()
        .zip(out_ns)
        .filter(|&(_, &o)| pct(o) <= pct(least) + MARGIN_PERCENT)
        .map(|(&c, _)| c)
        .collect()
}

/// Revises where every task that `tasks()` names may run, every `PERIOD` until `stop`.
pub fn run(
    plan: &Plan,
    start_ns: u64,
    cpus: &[usize],
    mut tasks: impl FnMut() -> Vec<u32>,
    stop: &AtomicBool,
    log: &BackoffLog,
) -> Result<()> {
    let period = PERIOD.as_nanos() as u64;
    let mut next = monotonic_ns() + period;
    while !stop.load(Ordering::Relaxed) {
        sleep_until(next);
        let t = monotonic_ns().saturating_sub(start_ns);
        let out: Vec<u64> = cpus
            .iter()
            .map(|&c| plan.out_between(c, t.saturating_sub(period), t))
            .collect();
        let to = allowed(cpus, &out, period);
        if to.len() < cpus.len() {
            log.narrowed.fetch_add(1, Ordering::Relaxed);
        }
        for tid in tasks() {
            if os_layer::cpus::set_cpus(tid, &to).is_err() {
                log.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        log.revisions.fetch_add(1, Ordering::Relaxed);
        next += period;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_stolen_vcpus_are_avoided_only_past_the_threshold() {
        let p = 100_000_000;
        // Both stolen alike (anti-phase): nothing to avoid.
        assert_eq!(allowed(&[0, 1], &[33_000_000, 34_000_000], p), vec![0, 1]);
        // One stolen 40%, the other 10%: the first is avoided.
        assert_eq!(allowed(&[0, 1], &[40_000_000, 10_000_000], p), vec![1]);
        // Under the threshold apart: both stay.
        assert_eq!(allowed(&[0, 1], &[18_000_000, 10_000_000], p), vec![0, 1]);
        // Of three, the two within the margin of the least stolen stay.
        assert_eq!(
            allowed(&[0, 1, 2], &[12_000_000, 50_000_000, 10_000_000], p),
            vec![0, 2]
        );
    }
}
