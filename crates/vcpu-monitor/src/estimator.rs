//! The slice estimator: turns one vCPU's sleeper wake-ups into deschedules, time slices
//! and predictions. Pure: it is fed (expected, actual) wake-up times and keeps its own
//! state, with no clock and no syscall, so synthetic traces test it exactly. It must never
//! read a clock or allocate per tick: it runs on every 300 µs wake-up of a SCHED_FIFO
//! thread.
//!
//! A wake-up later than the gap threshold means the vCPU was descheduled (its sleeper
//! could not run). The run between two gaps is a time slice. The threshold adapts to the
//! measured wake-up latency of this vCPU (a multiple of its high percentiles, never below
//! a floor nor above a ceiling), so a noisy guest does not report phantom gaps and a quiet
//! one catches short ones. Only on-time wake-ups teach the baseline: were gaps learnt, a
//! vCPU with short slices (1 ms on / 1 ms off gives a gap every ~4 ticks) would push the
//! p90 up to the gap size and stop seeing its own gaps. Over-threshold wake-ups are learnt
//! only when they look like the baseline rather than a vCPU: a streak of them (a real
//! deschedule is followed by on-time ticks, so a streak means the baseline moved, e.g. the
//! sleeper lost its RT priority), or half of the recent ticks (slices shorter than the gaps
//! between them are noise nobody can act on; 1 ms on / 1 ms off still stays below that).
//!
//! A late wake-up far shorter than the vCPU's recent gaps (under a quarter of their median)
//! is a hiccup, not a deschedule: on a non-preemptible kernel a busy neighbour delays even
//! a SCHED_FIFO sleeper by up to a few milliseconds, and taking those for slice ends cuts
//! long slices into tiny ones and drags the prediction down.
//! A hiccup is counted, but neither ends the slice nor reports a resume. It still enters
//! the gap history, so a host that really moves to shorter deschedules is followed after a
//! handful of them.

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

/// Slices kept for the median: enough to shrug off one odd slice, few enough to follow a
/// host that changes its slice within ~5 slices.
const SLICE_HISTORY: usize = 8;
/// On-time wake-up latencies kept for the percentiles (~77 ms at 300 µs).
const LATENCY_WINDOW: usize = 256;
/// The threshold is recomputed every this many learnt wake-ups.
const RECOMPUTE_EVERY: u64 = 32;
/// Threshold ≥ this × p90: the bulk of the baseline, with a wide margin.
const P90_FACTOR: u64 = 3;
/// Threshold ≥ this / 2 × p99: the tail (non-preemptible kernel sections under load)
/// that p90 does not see.
const P99_FACTOR_HALVES: u64 = 3;
/// Consecutive over-threshold wake-ups that mean the baseline moved, not the vCPU.
const SHIFT_STREAK: u32 = 3;
/// Over-threshold wake-ups among the last 16 that mean the same.
const SHIFT_OF_16: u32 = 8;
/// Gap lengths kept to judge what a hiccup is; a burst of hiccups shorter than half of it
/// cannot redefine "typical".
const GAP_HISTORY: usize = 16;
/// A gap shorter than typical / this is a hiccup.
const HICCUP_FRACTION: u64 = 4;
/// Gaps needed before any is judged a hiccup.
const HICCUP_MIN_HISTORY: usize = 4;

#[derive(Clone, Debug)]
pub struct SliceEstimator {
    cfg: EstimatorConfig,
    latencies: [u32; LATENCY_WINDOW],
    samples: u64,
    threshold_ns: u64,
    streak: u32,
    /// One bit per recent wake-up, newest lowest: set when it was over the threshold.
    recent_over: u16,
    last_wake_ns: Option<u64>,
    slice_start_ns: Option<u64>,
    slices: [u64; SLICE_HISTORY],
    n_slices: usize,
    gap_lens: [u64; GAP_HISTORY],
    n_gaps: usize,
    est_slice_ns: u64,
    /// Gaps seen.
    pub deschedules: u64,
    /// Sum of the estimated inactive time of every gap.
    pub inactive_total_ns: u64,
    /// Estimated inactive time of the latest gap.
    pub last_inactive_ns: u64,
    /// Gaps that were learnt as a baseline shift; they still count as gaps.
    pub baseline_shifts: u64,
    /// Late wake-ups too short, against the recent gaps, to be a deschedule.
    pub hiccups: u64,
}

impl SliceEstimator {
    pub fn new(cfg: EstimatorConfig) -> Self {
        SliceEstimator {
            est_slice_ns: cfg.default_slice_ns,
            latencies: [0; LATENCY_WINDOW],
            samples: 0,
            threshold_ns: cfg.min_gap_threshold_ns,
            streak: 0,
            recent_over: 0,
            last_wake_ns: None,
            slice_start_ns: None,
            slices: [0; SLICE_HISTORY],
            n_slices: 0,
            gap_lens: [0; GAP_HISTORY],
            n_gaps: 0,
            deschedules: 0,
            inactive_total_ns: 0,
            last_inactive_ns: 0,
            baseline_shifts: 0,
            hiccups: 0,
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
        let over = late > self.threshold_ns;
        self.recent_over = self.recent_over << 1 | over as u16;
        let Some(prev) = prev.filter(|_| over) else {
            self.streak = 0;
            self.learn_latency(late, false);
            return Observation::Running;
        };
        self.streak += 1;
        if self.streak >= SHIFT_STREAK || self.recent_over.count_ones() >= SHIFT_OF_16 {
            self.baseline_shifts += 1;
            self.learn_latency(late, true);
        }
        // The sleeper would have woken at the deadline had the vCPU run, so it stopped
        // somewhere between our last wake-up and the deadline; the middle halves the
        // worst-case error.
        let slept = expected_ns.saturating_sub(prev);
        let gap_start = prev + slept / 2;
        let inactive = actual_ns.saturating_sub(gap_start);
        let typical = self.typical_gap_ns();
        self.gap_lens[self.n_gaps % GAP_HISTORY] = inactive;
        self.n_gaps += 1;
        if inactive * HICCUP_FRACTION < typical {
            self.hiccups += 1;
            return Observation::Running;
        }
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

    /// Median of the recent gaps (hiccups included); 0 until there are enough.
    fn typical_gap_ns(&self) -> u64 {
        let n = self.n_gaps.min(GAP_HISTORY);
        if n < HICCUP_MIN_HISTORY {
            return 0;
        }
        let mut recent = self.gap_lens;
        *recent[..n].select_nth_unstable(n / 2).1
    }

    fn learn_latency(&mut self, late: u64, now: bool) {
        self.latencies[(self.samples % LATENCY_WINDOW as u64) as usize] =
            late.min(u32::MAX as u64) as u32;
        self.samples += 1;
        if now || self.samples.is_multiple_of(RECOMPUTE_EVERY) {
            let n = (self.samples as usize).min(LATENCY_WINDOW);
            let mut recent = self.latencies;
            let recent = &mut recent[..n];
            let k99 = n * 99 / 100;
            let p99 = *recent.select_nth_unstable(k99).1 as u64;
            // Everything left of k99 is now ≤ p99, so p90 is found among those alone.
            let p90 = *recent[..=k99].select_nth_unstable(n * 9 / 10).1 as u64;
            self.threshold_ns = (p90 * P90_FACTOR)
                .max(p99 * P99_FACTOR_HALVES / 2)
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
        // Continue from the last wake-up, so that consecutive drives form one timeline.
        let mut t = est.last_wake_ns.unwrap_or(1_000 * MS);
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

    fn gaps(obs: &[Observation]) -> usize {
        obs.iter()
            .filter(|o| matches!(o, Observation::Resumed { .. }))
            .count()
    }

    #[test]
    fn short_slices_keep_a_low_threshold() {
        // 1 ms on / 1 ms off puts a gap on every ~4th tick: learning those would lift the
        // p90 to ~1 ms and the threshold to the cap, hiding every later gap.
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        let obs = drive(&mut est, |_| MS, MS, 500, |n| 10 * US + (n % 5) * US);
        assert_eq!(gaps(&obs), 500);
        assert_eq!(est.threshold_ns(), 200 * US);
        assert_eq!(est.baseline_shifts, 0);
        // One sleep period of resolution, halved by taking the middle of the last sleep.
        let err = est.est_slice_ns().abs_diff(MS);
        assert!(err <= 200 * US, "slice estimate {} ns", est.est_slice_ns());
    }

    #[test]
    fn slowly_drifting_baseline_is_followed_without_false_gaps() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        // Latency drifts from 10 µs to ~500 µs over 60 cycles of 10 ms on / 10 ms off.
        let obs = drive(&mut est, |_| 10 * MS, 10 * MS, 60, |n| 10 * US + n * 250);
        assert_eq!(gaps(&obs), 60, "exactly the real gaps");
        let th = est.threshold_ns();
        assert!(th > 500 * US && th <= 2 * MS, "threshold {th}");
        assert!(est.est_slice_ns().abs_diff(10 * MS) < 600 * US);
    }

    #[test]
    fn a_step_in_the_baseline_is_learnt_from_the_streak() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        let mut t = 0u64;
        let mut late_ones = Vec::new();
        for i in 0..1_000u64 {
            t += 300 * US;
            let late = if i < 500 { 15 * US } else { 600 * US };
            let o = est.observe(t, t + late);
            late_ones.push(matches!(o, Observation::Resumed { .. }));
            t += late;
        }
        let false_gaps = late_ones.iter().filter(|&&g| g).count();
        assert!(
            late_ones[900..].iter().all(|&g| !g),
            "still flagging after 400 ticks"
        );
        assert!(false_gaps <= 40, "{false_gaps} false gaps before adapting");
        assert!(est.threshold_ns() > 600 * US, "{}", est.threshold_ns());
    }

    #[test]
    fn rare_tail_latency_raises_the_threshold_above_it() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        let mut t = 0u64;
        for i in 0..2_000u64 {
            t += 300 * US;
            // 2% of wake-ups 180 µs late (kernel sections under load), the rest 15 µs.
            let late = if i % 50 == 7 { 180 * US } else { 15 * US };
            assert_eq!(est.observe(t, t + late), Observation::Running, "tick {i}");
            t += late;
        }
        assert!(est.threshold_ns() >= 270 * US, "{}", est.threshold_ns());
    }

    #[test]
    fn hiccups_neither_end_slices_nor_count_as_deschedules() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        drive(&mut est, |_| 10 * MS, 10 * MS, 10, |_| 10 * US);
        let (slices, desched) = (est.est_slice_ns(), est.deschedules);
        let start = est.slice_start_ns().unwrap();
        // A busy neighbour in a non-preemptible section: six 0.5–1.5 ms delays in 4 ms.
        let mut t = start;
        for late in [500, 1500, 600, 700, 900, 550] {
            t += 300 * US;
            assert_eq!(est.observe(t, t + late * US), Observation::Running);
            t += late * US;
        }
        // The first ones are hiccups; then the streak is taken for a baseline shift and
        // lifts the threshold over the rest.
        assert!(est.hiccups >= 3, "{} hiccups", est.hiccups);
        assert_eq!(est.deschedules, desched);
        assert_eq!(est.slice_start_ns(), Some(start), "the slice goes on");
        // The next real gap measures the whole slice.
        drive(&mut est, |_| 10 * MS, 10 * MS, 3, |_| 10 * US);
        assert_eq!(est.est_slice_ns(), slices);
        assert_eq!(est.deschedules, desched + 3);
    }

    #[test]
    fn a_host_moving_to_shorter_deschedules_is_followed() {
        let mut est = SliceEstimator::new(EstimatorConfig::default());
        drive(&mut est, |_| 10 * MS, 10 * MS, 20, |_| 10 * US);
        // Now 2 ms out (under a quarter of 10 ms), 10 ms in: hiccups until the gap history
        // has more short gaps than long ones.
        let transition = gaps(&drive(&mut est, |_| 10 * MS, 2 * MS, 20, |_| 10 * US));
        let after = gaps(&drive(&mut est, |_| 10 * MS, 2 * MS, 20, |_| 10 * US));
        assert!(
            transition >= 10,
            "{transition} of 20 reported in the transition"
        );
        assert_eq!(after, 20);
        assert!(est.est_slice_ns().abs_diff(10 * MS) < 400 * US);
        assert!(est.last_inactive_ns.abs_diff(2 * MS) < 400 * US);
    }
}
