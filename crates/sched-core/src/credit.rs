//! ISACS credit reallocation for one run queue (Algorithm 1, lines 13–27):
//! - Eq. 2: `IVCredit = E_n × Ī_e × consumed / Σ cc_i` — I/O strength weighted by the
//!   share of the run queue's CPU the vCPU actually used.
//! - Eq. 3: a vCPU joins the CPU-BOOST group when `(Σ IVCredit / k) × 1/(IVCredit_c + 1) > 1`
//!   (k = vCPUs with IVCredit > 0): its I/O strength is well below the average.
//! - Eq. 4: `CVCredit = (Σ IVCredit / j) × consumed / default` for the j group members.
//! - Concealing: `credit = default + IVCredit`, `endcredit = IVCredit`, so every vCPU burns
//!   exactly `default` before the CPU-BOOST state; IVCredit only orders who runs first.
//!
//! Guests are untrusted: `E_n × Ī_e` is the time the vCPU's I/O events span and can
//! never exceed the reallocation period, so it is clamped to `period_ns` here, whatever a
//! guest reports.

/// Tunables of one run queue.
#[derive(Clone, Debug, PartialEq)]
pub struct CreditParams {
    /// Credit every vCPU gets per reallocation (Credit2: 10 ms).
    pub default_credit_ns: u64,
    /// Length of a reallocation period: the most I/O time a vCPU can have had.
    pub period_ns: u64,
}

impl Default for CreditParams {
    fn default() -> Self {
        CreditParams {
            default_credit_ns: 10_000_000,
            period_ns: 30_000_000,
        }
    }
}

/// What the core needs about one vCPU at reallocation.
#[derive(Clone, Debug, PartialEq)]
pub struct VcpuInput {
    pub id: u32,
    /// E_n: I/O response events since the last reallocation.
    pub events: u64,
    /// Ī_e: EMA of their intervals (Eq. 1), ns.
    pub ema_interval_ns: f64,
    /// Credit consumed since the last reallocation, ns.
    pub consumed_ns: u64,
}

/// One vCPU's credits after reallocation.
#[derive(Clone, Debug, PartialEq)]
pub struct VcpuCredit {
    pub id: u32,
    pub iv_credit: f64,
    /// 0 unless in the CPU-BOOST group.
    pub cv_credit: f64,
    pub boost: bool,
    /// default + IVCredit.
    pub credit: f64,
    /// IVCredit: the CPU-BOOST state starts when credit falls to this.
    pub endcredit: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Allocation {
    pub vcpus: Vec<VcpuCredit>,
    /// RunQ.IOload: Σ IVCredit.
    pub io_load: f64,
}

impl Allocation {
    pub fn boost_group(&self) -> impl Iterator<Item = u32> + '_ {
        self.vcpus.iter().filter(|v| v.boost).map(|v| v.id)
    }
}

/// Eq. 2 for one vCPU, with the guest's figures clamped to what is physically possible.
pub fn iv_credit(params: &CreditParams, v: &VcpuInput, total_consumed_ns: u64) -> f64 {
    if total_consumed_ns == 0
        || v.events == 0
        || !v.ema_interval_ns.is_finite()
        || v.ema_interval_ns <= 0.0
    {
        return 0.0;
    }
    let io_time = (v.events as f64 * v.ema_interval_ns).min(params.period_ns as f64);
    io_time * v.consumed_ns as f64 / total_consumed_ns as f64
}

/// Algorithm 1, lines 13–27: new credits for every vCPU of a run queue.
pub fn reallocate(params: &CreditParams, inputs: &[VcpuInput]) -> Allocation {
    let total_consumed: u64 = inputs.iter().map(|v| v.consumed_ns).sum();
    let ivs: Vec<f64> = inputs
        .iter()
        .map(|v| iv_credit(params, v, total_consumed))
        .collect();
    let io_load: f64 = ivs.iter().sum();
    let k = ivs.iter().filter(|&&iv| iv > 0.0).count();
    // Eq. 3 (no I/O at all: no group, nothing to compensate).
    let boost: Vec<bool> = ivs
        .iter()
        .map(|&iv| k > 0 && (io_load / k as f64) * (1.0 / (iv + 1.0)) > 1.0)
        .collect();
    let j = boost.iter().filter(|&&b| b).count();
    let default = params.default_credit_ns as f64;
    let vcpus = inputs
        .iter()
        .zip(ivs.iter().zip(&boost))
        .map(|(v, (&iv, &b))| VcpuCredit {
            id: v.id,
            iv_credit: iv,
            // Eq. 4.
            cv_credit: if b {
                io_load / j as f64 * v.consumed_ns as f64 / default
            } else {
                0.0
            },
            boost: b,
            credit: default + iv,
            endcredit: iv,
        })
        .collect();
    Allocation { vcpus, io_load }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn input(id: u32, events: u64, ema_ms: f64, consumed_ms: u64) -> VcpuInput {
        VcpuInput {
            id,
            events,
            ema_interval_ns: ema_ms * 1e6,
            consumed_ns: consumed_ms * MS,
        }
    }

    #[test]
    fn worked_example_of_equations_2_to_4() {
        let p = CreditParams::default();
        // Two I/O vCPUs and two CPU-bound ones on a run queue that consumed 40 ms.
        let a = reallocate(
            &p,
            &[
                input(0, 20, 0.5, 5),
                input(1, 10, 0.5, 5),
                input(2, 0, 0.0, 15),
                input(3, 0, 0.0, 15),
            ],
        );
        // Eq. 2: 20 × 0.5 ms × 5/40 = 1.25 ms; 10 × 0.5 ms × 5/40 = 0.625 ms.
        assert!((a.vcpus[0].iv_credit - 1.25e6).abs() < 1e-3);
        assert!((a.vcpus[1].iv_credit - 0.625e6).abs() < 1e-3);
        assert!((a.io_load - 1.875e6).abs() < 1e-3);
        // Eq. 3: average over k = 2 is 0.9375 ms; vCPU 1 (0.625 ms) is below it and joins
        // the CPU-BOOST group with the CPU-bound ones (the paper's vCPU3 case).
        assert_eq!(a.boost_group().collect::<Vec<_>>(), vec![1, 2, 3]);
        // Eq. 4: Σ IV / j × consumed / default = 1.875 / 3 × 15 / 10 ms, and × 5 / 10.
        assert!((a.vcpus[2].cv_credit - 0.9375e6).abs() < 1e-3);
        assert!((a.vcpus[1].cv_credit - 0.3125e6).abs() < 1e-3);
        assert_eq!(a.vcpus[0].cv_credit, 0.0);
        // Concealing.
        assert_eq!(a.vcpus[0].credit, 10e6 + a.vcpus[0].iv_credit);
        assert_eq!(a.vcpus[0].endcredit, a.vcpus[0].iv_credit);
        assert_eq!(a.vcpus[2].credit, 10e6);
    }

    #[test]
    fn no_io_means_no_boost_group() {
        let a = reallocate(
            &CreditParams::default(),
            &[input(0, 0, 0.0, 10), input(1, 0, 0.0, 10)],
        );
        assert_eq!(a.io_load, 0.0);
        assert!(a.vcpus.iter().all(|v| !v.boost && v.credit == 10e6));
    }

    #[test]
    fn a_lying_guest_is_clamped_to_the_period() {
        let p = CreditParams::default();
        let a = reallocate(&p, &[input(0, u64::MAX, 1e9, 10), input(1, 0, 0.0, 10)]);
        // At most period × consumed share = 30 ms × 1/2.
        assert!(
            a.vcpus[0].iv_credit <= 15e6 + 1.0,
            "{}",
            a.vcpus[0].iv_credit
        );
        let nan = reallocate(
            &p,
            &[VcpuInput {
                id: 0,
                events: 5,
                ema_interval_ns: f64::NAN,
                consumed_ns: MS,
            }],
        );
        assert_eq!(nan.vcpus[0].iv_credit, 0.0);
    }

    #[test]
    fn nothing_consumed_gives_no_iv_credit() {
        let a = reallocate(&CreditParams::default(), &[input(0, 50, 0.2, 0)]);
        assert_eq!(a.vcpus[0].iv_credit, 0.0);
    }
}
