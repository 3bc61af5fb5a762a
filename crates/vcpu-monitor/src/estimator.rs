//! The slice estimator: turns one vCPU's sleeper wake-ups into deschedules, time slices
//! and predictions. Pure: it is fed (expected, actual) wake-up times and keeps its own
//! state, with no clock and no syscall, so synthetic traces test it exactly.
//!
//! A wake-up later than the gap threshold means the vCPU was descheduled (its sleeper
//! could not run). The run between two gaps is a time slice. The threshold adapts to the
//! measured wake-up latency of this vCPU (mean + k·deviation, never below a floor), so a
//! noisy guest does not report phantom gaps and a quiet one catches short ones.

/// Tunables of the estimator.
#[derive(Clone, Debug)]
pub struct EstimatorConfig {
    /// Floor of the adaptive threshold.
    pub min_gap_threshold_ns: u64,
    /// Ceiling of the adaptive threshold: a wake-up this late is always a gap.
    pub max_gap_threshold_ns: u64,
    /// Slice length assumed before one has been measured (paper: 11 ms).
    pub default_slice_ns: u64,
    /// Slices are only measured from sleeps at most this long: a gap found after a long
    /// (idle-mode) sleep could have started anywhere in it.
    pub max_precise_sleep_ns: u64,
}

impl Default for EstimatorConfig {
    fn default() -> Self {
        EstimatorConfig {
            min_gap_threshold_ns: 200_000,
            max_gap_threshold_ns: 2_000_000,
            default_slice_ns: 11_000_000,
            max_precise_sleep_ns: 2_500_000,
        }
    }
}

/// What one wake-up meant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observation {
    /// On time: the vCPU kept running.
    Running,
    /// Late: the vCPU was descheduled for about `inactive_ns` and just came back.
    Resumed { inactive_ns: u64 },
}

const SLICE_HISTORY: usize = 8;
/// Wake-up latencies kept for the percentile.
const LATENCY_WINDOW: usize = 256;
/// The threshold is recomputed every this many wake-ups.
const RECOMPUTE_EVERY: u64 = 32;
/// Threshold = this × p90 of recent latencies (then clamped).
const P90_FACTOR: u64 = 3;

#[derive(Clone, Debug)]
pub struct SliceEstimator {
    cfg: EstimatorConfig,
    latencies: [u32; LATENCY_WINDOW],
    samples: u64,
    threshold_ns: u64,
    last_wake_ns: Option<u64>,
    slice_start_ns: Option<u64>,
    slices: [u64; SLICE_HISTORY],
    n_slices: usize,
    est_slice_ns: u64,
    pub deschedules: u64,
    pub inactive_total_ns: u64,
    pub last_inactive_ns: u64,
}

impl SliceEstimator {
    pub fn new(cfg: EstimatorConfig) -> Self {
        SliceEstimator {
            est_slice_ns: cfg.default_slice_ns,
            latencies: [0; LATENCY_WINDOW],
            samples: 0,
            threshold_ns: cfg.min_gap_threshold_ns,
            last_wake_ns: None,
            slice_start_ns: None,
            slices: [0; SLICE_HISTORY],
            n_slices: 0,
            deschedules: 0,
            inactive_total_ns: 0,
            last_inactive_ns: 0,
            cfg,
        }
    }

    /// The current gap threshold.
    pub fn threshold_ns(&self) -> u64 {
        self.threshold_ns
    }

    /// Predicted length of the current slice: the median of the recent ones.
    pub fn est_slice_ns(&self) -> u64 {
        self.est_slice_ns
    }

    /// Start of the current slice (the end of the last gap), if a gap was seen.
    pub fn slice_start_ns(&self) -> Option<u64> {
        self.slice_start_ns
    }

    /// Estimated slice left at `now_ns`.
    pub fn remaining_ns(&self, now_ns: u64) -> u64 {
        match self.slice_start_ns {
            Some(start) => (start + self.est_slice_ns).saturating_sub(now_ns),
            // No gap seen yet: the vCPU may well be dedicated; report a full slice.
            None => self.est_slice_ns,
        }
    }

    /// Feeds one wake-up: the sleeper asked for `expected_ns` and ran at `actual_ns`.
    pub fn observe(&mut self, expected_ns: u64, actual_ns: u64) -> Observation {
        let late = actual_ns.saturating_sub(expected_ns);
        let prev = self.last_wake_ns.replace(actual_ns);
        let is_gap = late > self.threshold_ns && prev.is_some();
        self.learn_latency(late);
        if !is_gap {
            return Observation::Running;
        }
        let prev = prev.unwrap_or(expected_ns);
        let slept = expected_ns.saturating_sub(prev);
        // The vCPU stopped somewhere between our last wake-up and the deadline; the middle
        // halves the worst-case error.
        let gap_start = prev + slept / 2;
        let inactive = actual_ns.saturating_sub(gap_start);
        if let Some(start) = self.slice_start_ns {
            if slept <= self.cfg.max_precise_sleep_ns && gap_start > start {
                self.push_slice(gap_start - start);
            }
        }
        self.slice_start_ns = Some(actual_ns);
        self.deschedules += 1;
        self.inactive_total_ns += inactive;
        self.last_inactive_ns = inactive;
        Observation::Resumed {
            inactive_ns: inactive,
        }
    }

    fn learn_latency(&mut self, late: u64) {
        self.latencies[(self.samples % LATENCY_WINDOW as u64) as usize] =
            late.min(u32::MAX as u64) as u32;
        self.samples += 1;
        if self.samples.is_multiple_of(RECOMPUTE_EVERY) {
            let n = (self.samples as usize).min(LATENCY_WINDOW);
            let mut recent = self.latencies;
            let recent = &mut recent[..n];
            let k = n * 9 / 10;
            let (_, p90, _) = recent.select_nth_unstable(k);
            self.threshold_ns = (*p90 as u64 * P90_FACTOR)
                .clamp(self.cfg.min_gap_threshold_ns, self.cfg.max_gap_threshold_ns);
        }
    }

    fn push_slice(&mut self, len: u64) {
        self.slices[self.n_slices % SLICE_HISTORY] = len;
        self.n_slices += 1;
        let n = self.n_slices.min(SLICE_HISTORY);
        let mut recent = self.slices;
        let recent = &mut recent[..n];
        recent.sort_unstable();
        self.est_slice_ns = recent[n / 2];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;
    const MS: u64 = 1_000_000;

    /// Drives the estimator with a 300 µs sleeper on a vCPU that runs `run` then is out
    /// for `out`, for `cycles` cycles; `jitter(i)` adds wake-up latency.
    fn drive(
        est: &mut SliceEstimator,
        run: impl Fn(usize) -> u64,
        out: u64,
        cycles: usize,
        jitter: impl Fn(u64) -> u64,
    ) -> Vec<Observation> {
        let period = 300 * US;
        let mut obs = Vec::new();
        let mut t = 1_000 * MS;
        let mut n = 0u64;
        for c in 0..cycles {
            let slice_end = t + run(c);
            let mut next = t + period;
            while next < slice_end {
                let actual = next + jitter(n);
                n += 1;
                obs.push(est.observe(next, actual));
                next = actual + period;
            }
            // Descheduled from slice_end for `out`: the pending wake-up runs at resume.
            let resume = slice_end + out;
            obs.push(est.observe(next, resume.max(next)));
            t = resume;
        }
        obs
    }

    #[test]
    fn regular_slices_are_detected_and_measured() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        let obs = drive(
            &mut est,
            |_| 10 * MS,
            10 * MS,
            50,
            |n| 10 * US + (n % 7) * US,
        );
        let gaps = obs
            .iter()
            .filter(|o| matches!(o, Observation::Resumed { .. }))
            .count();
        assert_eq!(gaps, 50);
        assert_eq!(est.deschedules, 50);
        let err = est.est_slice_ns().abs_diff(10 * MS);
        assert!(err < 400 * US, "slice estimate {} ns", est.est_slice_ns());
        let inactive = est.last_inactive_ns.abs_diff(10 * MS);
        assert!(inactive < 400 * US, "inactive {} ns", est.last_inactive_ns);
    }

    #[test]
    fn default_slice_before_any_gap() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        assert_eq!(est.est_slice_ns(), 11 * MS);
        assert_eq!(est.remaining_ns(5 * MS), 11 * MS);
        for i in 0..100u64 {
            let t = i * 300 * US;
            assert_eq!(est.observe(t, t + 20 * US), Observation::Running);
        }
        assert_eq!(est.deschedules, 0);
    }

    #[test]
    fn jitter_below_threshold_is_not_a_gap() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        let obs = drive(
            &mut est,
            |_| 30 * MS,
            5 * MS,
            20,
            |n| if n % 13 == 0 { 150 * US } else { 12 * US },
        );
        let gaps = obs
            .iter()
            .filter(|o| matches!(o, Observation::Resumed { .. }))
            .count();
        assert_eq!(gaps, 20, "only the real 5 ms gaps count");
    }

    #[test]
    fn threshold_adapts_to_a_noisy_baseline_but_stays_capped() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        for i in 0..2_000u64 {
            let t = i * 300 * US;
            // Latency alternating 50/450 µs: mean 250, dev 200.
            est.observe(t, t + if i % 2 == 0 { 50 * US } else { 450 * US });
        }
        let th = est.threshold_ns();
        assert!(
            th > 450 * US,
            "threshold {th} must exceed the normal latency"
        );
        assert!(th <= 2 * MS, "threshold {th} must stay under the cap");
    }

    #[test]
    fn estimate_follows_a_change_of_slice_length() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        drive(
            &mut est,
            |c| if c < 20 { 10 * MS } else { 30 * MS },
            10 * MS,
            40,
            |_| 10 * US,
        );
        assert!(
            est.est_slice_ns().abs_diff(30 * MS) < 400 * US,
            "{}",
            est.est_slice_ns()
        );
    }

    #[test]
    fn remaining_slice_counts_down_from_resume() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        drive(&mut est, |_| 10 * MS, 10 * MS, 10, |_| 10 * US);
        let start = est.slice_start_ns().unwrap();
        let rem = est.remaining_ns(start + 4 * MS);
        assert!(rem.abs_diff(6 * MS) < 400 * US, "{rem}");
        assert_eq!(est.remaining_ns(start + 50 * MS), 0);
    }

    #[test]
    fn gaps_after_long_sleeps_do_not_pollute_slices() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        drive(&mut est, |_| 10 * MS, 10 * MS, 10, |_| 10 * US);
        let before = est.est_slice_ns();
        // An idle-mode 10 ms sleep that ends 8 ms late.
        let t = est.slice_start_ns().unwrap() + 3 * MS;
        est.observe(t, t);
        est.observe(t + 10 * MS, t + 18 * MS);
        assert_eq!(est.est_slice_ns(), before);
        assert_eq!(est.deschedules, 11);
    }
}
