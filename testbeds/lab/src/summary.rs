//! What `make bench-lab` reports, computed from the measured runs: per mode the median of
//! the clean repetitions, speedups against `vanilla`, the ratio to `no_sharing`, and the
//! co-located VM's share of the host CPUs. Pure, so the arithmetic is tested on its own.

use serde::{Deserialize, Serialize};

/// One measured run of one mode.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct Run {
    pub mode: String,
    pub rep: u32,
    /// Length of VM A's workload, seconds.
    pub secs: f64,
    /// 4 KiB random O_DIRECT reads per second.
    pub iops_4k: f64,
    pub p50_4k_us: f64,
    pub p99_4k_us: f64,
    /// 4 KiB reads in each whole second of the run: where in the run a cost falls.
    #[serde(default)]
    pub reads_4k_per_s: Vec<u64>,
    /// 1 MiB sequential O_DIRECT reads, MB/s.
    pub seq_mbps: f64,
    /// CPU hog progress inside VM A and inside the co-located VMs (work units per second).
    pub hog_a_units_s: f64,
    pub hog_b_units_s: f64,
    /// Host-measured CPU of the co-located VMs' vCPU threads over the run, as a share of the
    /// host CPUs they are pinned to (0.5 = their fair half in a 1:1 sharing).
    pub b_cpu_share: f64,
    pub a_cpu_share: f64,
    /// Host CPU seconds spent by anything but the VMs and the agent during the run.
    pub foreign_cpu_s: f64,
    /// CPU seconds this machine's own hypervisor took from the host CPUs during the run
    /// (`/proc/stat` steal; counted in `foreign_cpu_s` before this field existed).
    #[serde(default)]
    pub machine_steal_s: f64,
    /// Foreign CPU above the noise limit: kept in the JSON, left out of the medians.
    pub noisy: bool,
    /// Guest daemon's migrations during the run (modes with the daemon).
    pub migrations: u64,
    /// Guest CPU the daemon used during the run, in total and per thread name.
    pub daemon_cpu_s: f64,
    pub daemon_threads_cpu_s: Vec<(String, f64)>,
    /// The guest daemon's per-vCPU view at the end of the run (`vmigrater status`).
    pub guest_vcpus: serde_json::Value,
    /// The guest daemon's move guard at the end of the run: moves allowed, probes that
    /// found moves paying and not paying.
    #[serde(default)]
    pub guest_guard: serde_json::Value,
    /// CPU seconds the host-side steal spinners took (scenarios with `host_steal`).
    #[serde(default)]
    pub host_stolen_s: f64,
    /// Oracle runs: how far the guest clock moved against the host's over the run, and
    /// the uncertainty of the offset before (the one the oracle used) and after, in µs.
    #[serde(default)]
    pub oracle_clock_drift_us: Option<(f64, f64, f64)>,
    /// What the host agent did to each vCPU (modes with the agent).
    pub agent: Vec<AgentVcpu>,
    /// VM A's two readers at the end of the run, as the workload saw them: the vCPU each
    /// last ran on and how often the guest moved it (which vCPU carried the 4 KiB reads
    /// tells whether the agent favoured the right one).
    #[serde(default)]
    pub readers: Vec<ReaderPlace>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct ReaderPlace {
    pub pattern: String,
    pub last_cpu: Option<u64>,
    pub migrations: Option<u64>,
}

/// One vCPU as the host agent treated it during a run, from its status once a second.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct AgentVcpu {
    pub vm: String,
    pub vcpu: u32,
    /// Where its I/O figures came from: `guest` reports or host `schedstat`.
    pub source: String,
    pub samples: u32,
    /// Samples in the CPU-BOOST state, with IVCredit.
    pub boosted: u32,
    pub iv_credited: u32,
    /// Sum of the nice values seen (mean = nice_sum / samples).
    pub nice_sum: i64,
    /// Sums over the samples of the period's I/O events (E_n), CPU and wait time (ms).
    #[serde(default)]
    pub events_sum: u64,
    #[serde(default)]
    pub cpu_ms_sum: f64,
    #[serde(default)]
    pub wait_ms_sum: f64,
    /// Algorithm 2: moves of its thread by the last sample, and the host CPUs it was
    /// pinned to at some sample (empty: never pinned by the agent or the lab's own pin).
    #[serde(default)]
    pub moves: u64,
    #[serde(default)]
    pub host_cpus: Vec<usize>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct ModeSummary {
    pub mode: String,
    pub runs: usize,
    pub clean_runs: usize,
    pub iops_4k: f64,
    pub p99_4k_us: f64,
    pub seq_mbps: f64,
    pub hog_a_units_s: f64,
    pub hog_b_units_s: f64,
    pub b_cpu_share: f64,
    /// Against `vanilla` in the same scenario (1.0 for vanilla itself; None without it).
    pub iops_speedup: Option<f64>,
    pub seq_speedup: Option<f64>,
    /// The co-located VMs' hog progress against `vanilla` (CPU fairness: ~1.0 expected).
    pub hog_b_vs_vanilla: Option<f64>,
    /// VM A's own hogs against `vanilla` (what the cure costs the VM's CPU work).
    pub hog_a_vs_vanilla: Option<f64>,
    /// 95% bootstrap intervals of the ratios of medians to `vanilla` (see `bootstrap_ratio`).
    pub iops_speedup_ci95: Option<[f64; 2]>,
    pub seq_speedup_ci95: Option<[f64; 2]>,
    pub hog_a_vs_vanilla_ci95: Option<[f64; 2]>,
    /// 4 KiB IOPS as a fraction of `no_sharing` (the VM alone on its CPUs).
    pub iops_vs_no_sharing: Option<f64>,
}

/// A run is noisy when the host spent more than this share of the run's CPU capacity on
/// something else than the lab (other users of a shared machine).
pub const NOISE_LIMIT: f64 = 0.05;

pub fn is_noisy(foreign_cpu_s: f64, secs: f64, host_cpus: usize) -> bool {
    foreign_cpu_s > NOISE_LIMIT * secs * host_cpus as f64
}

pub fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Resamples drawn for each bootstrap interval.
pub const BOOTSTRAP_RESAMPLES: usize = 4000;

/// The 95% percentile-bootstrap interval of median(a) / median(b): both samples are
/// resampled with replacement, independently, `BOOTSTRAP_RESAMPLES` times. The generator
/// is seeded, so the same runs always give the same interval. None with fewer than two
/// values on either side (no spread to resample).
pub fn bootstrap_ratio(a: &[f64], b: &[f64]) -> Option<[f64; 2]> {
    if a.len() < 2 || b.len() < 2 {
        return None;
    }
    // splitmix64: a fixed, dependency-free generator is all a resampling needs.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: usize| -> usize {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n as u64) as usize
    };
    let mut ratios = Vec::with_capacity(BOOTSTRAP_RESAMPLES);
    for _ in 0..BOOTSTRAP_RESAMPLES {
        let ra = median((0..a.len()).map(|_| a[next(a.len())]).collect());
        let rb = median((0..b.len()).map(|_| b[next(b.len())]).collect());
        if rb > 0.0 && ra.is_finite() {
            ratios.push(ra / rb);
        }
    }
    if ratios.is_empty() {
        return None;
    }
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| ratios[((ratios.len() - 1) as f64 * q).round() as usize];
    Some([at(0.025), at(0.975)])
}

/// Per mode, in the order the modes first appear in `runs`.
pub fn summarize(runs: &[Run]) -> Vec<ModeSummary> {
    let mut modes: Vec<&str> = Vec::new();
    for r in runs {
        if !modes.contains(&r.mode.as_str()) {
            modes.push(&r.mode);
        }
    }
    let mut out: Vec<ModeSummary> = modes
        .iter()
        .map(|&m| {
            let all: Vec<&Run> = runs.iter().filter(|r| r.mode == m).collect();
            let clean: Vec<&Run> = all.iter().copied().filter(|r| !r.noisy).collect();
            // With no clean run at all, the noisy ones are still better than nothing; the
            // clean_runs count says so.
            let used = if clean.is_empty() { &all } else { &clean };
            let med = |f: fn(&Run) -> f64| median(used.iter().map(|r| f(r)).collect());
            ModeSummary {
                mode: m.to_string(),
                runs: all.len(),
                clean_runs: clean.len(),
                iops_4k: med(|r| r.iops_4k),
                p99_4k_us: med(|r| r.p99_4k_us),
                seq_mbps: med(|r| r.seq_mbps),
                hog_a_units_s: med(|r| r.hog_a_units_s),
                hog_b_units_s: med(|r| r.hog_b_units_s),
                b_cpu_share: med(|r| r.b_cpu_share),
                ..Default::default()
            }
        })
        .collect();
    // The runs behind each median, for the intervals.
    let values = |mode: &str, f: fn(&Run) -> f64| -> Vec<f64> {
        let all: Vec<&Run> = runs.iter().filter(|r| r.mode == mode).collect();
        let clean: Vec<f64> = all.iter().filter(|r| !r.noisy).map(|r| f(r)).collect();
        if clean.is_empty() {
            all.iter().map(|r| f(r)).collect()
        } else {
            clean
        }
    };
    let find = |name: &str| out.iter().find(|s| s.mode == name).cloned();
    let (vanilla, alone) = (find("vanilla"), find("no_sharing"));
    let ratio = |a: f64, b: f64| (b > 0.0 && a.is_finite() && b.is_finite()).then(|| a / b);
    for s in &mut out {
        if let Some(v) = &vanilla {
            s.iops_speedup = ratio(s.iops_4k, v.iops_4k);
            s.seq_speedup = ratio(s.seq_mbps, v.seq_mbps);
            s.hog_b_vs_vanilla = ratio(s.hog_b_units_s, v.hog_b_units_s);
            s.hog_a_vs_vanilla = ratio(s.hog_a_units_s, v.hog_a_units_s);
            let ci =
                |f: fn(&Run) -> f64| bootstrap_ratio(&values(&s.mode, f), &values("vanilla", f));
            s.iops_speedup_ci95 = ci(|r| r.iops_4k);
            s.seq_speedup_ci95 = ci(|r| r.seq_mbps);
            s.hog_a_vs_vanilla_ci95 = ci(|r| r.hog_a_units_s);
        }
        if let Some(a) = &alone {
            s.iops_vs_no_sharing = ratio(s.iops_4k, a.iops_4k);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(mode: &str, iops: f64, noisy: bool) -> Run {
        Run {
            mode: mode.into(),
            iops_4k: iops,
            seq_mbps: iops / 10.0,
            hog_b_units_s: 100.0,
            noisy,
            ..Default::default()
        }
    }

    #[test]
    fn medians_skip_noisy_runs_and_ratios_use_vanilla_and_no_sharing() {
        let runs = vec![
            run("no_sharing", 1000.0, false),
            run("vanilla", 400.0, false),
            run("vanilla", 500.0, false),
            run("vanilla", 9000.0, true),
            run("vmigrater", 700.0, false),
            run("vmigrater", 800.0, true),
        ];
        let s = summarize(&runs);
        assert_eq!(
            s.iter().map(|m| m.mode.as_str()).collect::<Vec<_>>(),
            ["no_sharing", "vanilla", "vmigrater"]
        );
        assert_eq!(s[1].iops_4k, 450.0);
        assert_eq!((s[1].runs, s[1].clean_runs), (3, 2));
        assert_eq!(s[2].iops_4k, 700.0);
        assert!((s[2].iops_speedup.unwrap() - 700.0 / 450.0).abs() < 1e-12);
        assert_eq!(s[1].iops_speedup, Some(1.0));
        assert_eq!(s[2].iops_vs_no_sharing, Some(0.7));
        assert_eq!(s[2].hog_b_vs_vanilla, Some(1.0));
    }

    #[test]
    fn all_noisy_falls_back_to_every_run_and_says_so() {
        let s = summarize(&[run("vanilla", 100.0, true), run("vanilla", 300.0, true)]);
        assert_eq!((s[0].iops_4k, s[0].clean_runs), (200.0, 0));
        assert_eq!(s[0].iops_vs_no_sharing, None);
    }

    #[test]
    fn bootstrap_interval_brackets_the_ratio_and_separates_a_clear_speedup() {
        let vanilla = [100.0, 110.0, 95.0, 105.0, 98.0, 102.0];
        let faster = [150.0, 160.0, 140.0, 155.0, 148.0, 152.0];
        let [lo, hi] = bootstrap_ratio(&faster, &vanilla).unwrap();
        let point = median(faster.to_vec()) / median(vanilla.to_vec());
        assert!(lo <= point && point <= hi, "{lo} {point} {hi}");
        assert!(lo > 1.0, "a clear speedup's interval excludes 1.0: {lo}");
        // Overlapping samples: the interval straddles 1.0.
        let same = [99.0, 111.0, 96.0, 104.0, 97.0, 103.0];
        let [lo, hi] = bootstrap_ratio(&same, &vanilla).unwrap();
        assert!(lo < 1.0 && hi > 1.0, "{lo} {hi}");
        // Deterministic, and undefined without spread to resample.
        assert_eq!(bootstrap_ratio(&same, &vanilla), Some([lo, hi]));
        assert_eq!(bootstrap_ratio(&[1.0], &vanilla), None);
    }

    #[test]
    fn noise_limit_scales_with_the_run() {
        assert!(!is_noisy(1.9, 20.0, 2));
        assert!(is_noisy(2.1, 20.0, 2));
        assert!(median(vec![]).is_nan());
    }
}
