//! From ISACS credits to Linux scheduling settings for vCPU threads (pure).
//!
//! Per host run queue (the CPU a vCPU thread is pinned to; unpinned threads share one):
//! - CVCredit → share: weight ∝ default + CVCredit, expressed as a nice offset
//!   `round(−log₁.₂₅(w / geometric mean))`, clamped to ±max_nice_delta. Normalising by the
//!   geometric mean keeps Σ nice = 0 per run queue (before clamping), so the queue's
//!   total weight stays where it was: CPU fairness between VMs holds.
//! - IVCredit → latency only: a short EEVDF slice for the vCPU thread, which lets it
//!   preempt sooner after a wake-up without any extra share — the Linux counterpart of
//!   ISACS's concealed credit. A guest lying about its I/O therefore gains no CPU.

use sched_core::{reallocate, CreditParams, VcpuInput};
use std::collections::BTreeMap;

/// A vCPU: (VM index, guest vCPU number).
pub type VcpuKey = (usize, u32);

#[derive(Clone, Debug, PartialEq)]
pub struct VcpuFigures {
    pub key: VcpuKey,
    /// Host run queue (pinned CPU), or `usize::MAX` for threads allowed on several CPUs.
    pub run_queue: usize,
    /// E_n from the guest's report (0 without one).
    pub events: u64,
    /// Ī_e (ns) from the guest's report.
    pub ema_ns: f64,
    /// CPU time the thread got in the period (host schedstat).
    pub consumed_ns: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Setting {
    pub key: VcpuKey,
    pub nice: i32,
    /// `None`: the kernel's default slice.
    pub slice_ns: Option<u64>,
    pub iv_credit: f64,
    pub cv_credit: f64,
    pub boost: bool,
}

/// One nice step is a factor 1.25 of CFS weight (the kernel's prio_to_weight table).
const NICE_STEP: f64 = 1.25;

pub fn plan(
    params: &CreditParams,
    max_nice_delta: i32,
    io_slice_ns: u64,
    vcpus: &[VcpuFigures],
) -> Vec<Setting> {
    let mut queues: BTreeMap<usize, Vec<&VcpuFigures>> = BTreeMap::new();
    for v in vcpus {
        queues.entry(v.run_queue).or_default().push(v);
    }
    let mut out = Vec::with_capacity(vcpus.len());
    for members in queues.values() {
        let inputs: Vec<VcpuInput> = members
            .iter()
            .enumerate()
            .map(|(i, v)| VcpuInput {
                id: i as u32,
                events: v.events,
                ema_interval_ns: v.ema_ns,
                consumed_ns: v.consumed_ns,
            })
            .collect();
        let alloc = reallocate(params, &inputs);
        let default = params.default_credit_ns as f64;
        let logs: Vec<f64> = alloc
            .vcpus
            .iter()
            .map(|c| (default + c.cv_credit).ln())
            .collect();
        let mean_log = logs.iter().sum::<f64>() / logs.len().max(1) as f64;
        for ((v, c), l) in members.iter().zip(&alloc.vcpus).zip(&logs) {
            let steps = ((l - mean_log) / NICE_STEP.ln()).round() as i32;
            out.push(Setting {
                key: v.key,
                nice: (-steps).clamp(-max_nice_delta, max_nice_delta),
                slice_ns: (c.iv_credit > 0.0 && io_slice_ns > 0).then_some(io_slice_ns),
                iv_credit: c.iv_credit,
                cv_credit: c.cv_credit,
                boost: c.boost,
            });
        }
    }
    out.sort_by_key(|s| s.key);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn fig(vm: usize, rq: usize, events: u64, ema_ns: f64, consumed_ms: u64) -> VcpuFigures {
        VcpuFigures {
            key: (vm, 0),
            run_queue: rq,
            events,
            ema_ns,
            consumed_ns: consumed_ms * MS,
        }
    }

    #[test]
    fn io_vcpus_get_latency_not_share() {
        let p = CreditParams::default();
        let s = plan(
            &p,
            3,
            500_000,
            &[fig(0, 0, 200, 50_000.0, 10), fig(1, 0, 0, 0.0, 10)],
        );
        // vm 0 does I/O: short slice, and no more weight than the CPU-bound vm 1.
        assert_eq!(s[0].slice_ns, Some(500_000));
        assert!(s[0].nice >= s[1].nice, "{s:?}");
        assert_eq!(s[1].slice_ns, None);
        assert!(s[1].boost && s[1].cv_credit > 0.0);
    }

    #[test]
    fn no_io_changes_nothing() {
        let s = plan(
            &CreditParams::default(),
            3,
            500_000,
            &[
                fig(0, 0, 0, 0.0, 10),
                fig(1, 0, 0, 0.0, 10),
                fig(2, 1, 0, 0.0, 5),
            ],
        );
        assert!(
            s.iter().all(|s| s.nice == 0 && s.slice_ns.is_none()),
            "{s:?}"
        );
    }

    #[test]
    fn nice_sums_to_zero_per_run_queue_within_the_clamp() {
        let p = CreditParams::default();
        let vcpus = [
            fig(0, 0, 500, 100_000.0, 30),
            fig(1, 0, 0, 0.0, 30),
            fig(2, 0, 0, 0.0, 30),
            fig(3, 0, 10, 20_000.0, 30),
        ];
        let s = plan(&p, 19, 0, &vcpus);
        let sum: i32 = s.iter().map(|s| s.nice).sum();
        assert!(sum.abs() <= 2, "rounding only: {s:?}");
        let clamped = plan(&p, 1, 0, &vcpus);
        assert!(clamped.iter().all(|s| s.nice.abs() <= 1));
    }

    #[test]
    fn a_liar_gets_no_share() {
        let p = CreditParams::default();
        let s = plan(
            &p,
            3,
            500_000,
            &[fig(0, 0, u64::MAX, 1e12, 10), fig(1, 0, 0, 0.0, 10)],
        );
        assert!(s[0].nice >= 0, "the liar must not gain weight: {s:?}");
    }
}
