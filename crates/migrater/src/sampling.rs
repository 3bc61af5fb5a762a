//! Sampled block-I/O tracking: when the detector's BPF programs run, and what the daemon
//! reports of per-vCPU I/O while they do not.
//!
//! The block programs run on the path of every request and add to its latency, while
//! I/O-bound tasks stay I/O-bound for seconds: so the detector looks in short samples and
//! the requests in between pay nothing. Pure: the caller gives the clock and the counters.

use std::time::Duration;
use task_detector::CpuIoSample;

/// How often a paused loop that could act on it looks at the doorbell (a thread quiet for
/// seconds issued block I/O: it may have just become I/O-bound). A new I/O-bound task
/// waits this, not the rest of the period, for its sample.
pub const DOORBELL_POLL: Duration = Duration::from_millis(50);

/// Samples that follow a sample which placed a task (kept it with its completions, kept
/// its partner, managed it, or set back a pin its child inherited), one sample's length
/// after it, at most this many in a row. A task placed is often the first of several:
/// the database's backend starts after its postmaster, the second worker and its
/// client's thread after the first; at the next period they would wait up to a whole
/// period (2.5 s; `benches/RESULTS.md` "follow-up samples"). A sample
/// that places nothing ends the run.
pub const FOLLOW_UPS: u32 = 4;

/// `length` of tracking at the start of every `every`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub length: Duration,
    pub every: Duration,
}

/// What the loop should do at `into` past the start of the current sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Tracking, and the sample lasts this much longer.
    Track(Duration),
    /// The sample is over: pause tracking.
    Pause,
    /// Paused; the next sample starts in this much.
    Wait(Duration),
    /// Time for the next sample: resume tracking.
    Resume,
}

impl Schedule {
    /// `rung`: the doorbell rang while paused, so the next sample starts now rather than
    /// at the next period (never while one runs: a sample is never cut short).
    pub fn step(&self, tracking: bool, into: Duration, rung: bool) -> Step {
        match (tracking, into >= self.length, into >= self.every || rung) {
            (true, false, _) => Step::Track(self.length - into),
            (true, true, _) => Step::Pause,
            (false, _, true) => Step::Resume,
            (false, _, false) => Step::Wait(self.every - into),
        }
    }
}

/// Per-vCPU completions while tracking is sampled: the BPF counts only grow in samples,
/// but a consumer (the host agent, `/metrics`) reads them as the vCPU's I/O rate. Each
/// vCPU's sampled count is scaled by all the requests the kernel completed (diskstats)
/// over those the samples saw, and never goes backwards.
#[derive(Debug, Default)]
pub struct CompletionEstimate {
    /// Kernel's count at start, to count from there.
    disk_base: Option<u64>,
    last: Vec<CpuIoSample>,
}

impl CompletionEstimate {
    pub fn update(&mut self, sampled: &[CpuIoSample], disk_completed: u64) -> Vec<CpuIoSample> {
        let base = *self.disk_base.get_or_insert(disk_completed);
        let seen: u64 = sampled.iter().map(|c| c.completions).sum();
        let all = disk_completed.saturating_sub(base);
        // Never scale down: other devices' requests or flushes may differ a little from
        // the kernel's count, and an estimate is only needed where samples miss requests.
        let scale = if seen == 0 {
            1.0
        } else {
            (all as f64 / seen as f64).max(1.0)
        };
        let out: Vec<CpuIoSample> = sampled
            .iter()
            .map(|c| {
                let prev = self
                    .last
                    .iter()
                    .find(|p| p.cpu == c.cpu)
                    .map_or(0, |p| p.completions);
                CpuIoSample {
                    cpu: c.cpu,
                    completions: ((c.completions as f64 * scale) as u64).max(prev),
                    ema_interval_ns: c.ema_interval_ns,
                }
            })
            .collect();
        self.last = out.clone();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_sample_then_a_pause_then_the_next() {
        let s = Schedule {
            length: 250 * MS,
            every: 2500 * MS,
        };
        assert_eq!(s.step(true, Duration::ZERO, false), Step::Track(250 * MS));
        assert_eq!(s.step(true, 200 * MS, false), Step::Track(50 * MS));
        assert_eq!(s.step(true, 250 * MS, false), Step::Pause);
        assert_eq!(s.step(false, 250 * MS, false), Step::Wait(2250 * MS));
        assert_eq!(s.step(false, 2500 * MS, false), Step::Resume);
        // A late loop (a long poll) still pauses, never tracks on.
        assert_eq!(s.step(true, 9000 * MS, false), Step::Pause);
    }

    #[test]
    fn the_doorbell_starts_the_next_sample_at_once_but_never_cuts_one_short() {
        let s = Schedule {
            length: 250 * MS,
            every: 2500 * MS,
        };
        assert_eq!(s.step(false, 300 * MS, true), Step::Resume);
        assert_eq!(s.step(false, 300 * MS, false), Step::Wait(2200 * MS));
        assert_eq!(s.step(true, 100 * MS, true), Step::Track(150 * MS));
        assert_eq!(s.step(true, 250 * MS, true), Step::Pause);
    }

    fn cpu(cpu: u32, completions: u64) -> CpuIoSample {
        CpuIoSample {
            cpu,
            completions,
            ema_interval_ns: 7,
        }
    }

    #[test]
    fn sampled_counts_are_scaled_to_the_kernels_total_and_never_go_back() {
        let mut e = CompletionEstimate::default();
        assert_eq!(
            e.update(&[cpu(0, 0), cpu(1, 0)], 1000),
            [cpu(0, 0), cpu(1, 0)]
        );
        // A sample saw 30 + 10 of the 40 completed: exact.
        assert_eq!(
            e.update(&[cpu(0, 30), cpu(1, 10)], 1040),
            [cpu(0, 30), cpu(1, 10)]
        );
        // Paused: the kernel completed 360 more, split as the samples saw them (3:1).
        assert_eq!(
            e.update(&[cpu(0, 30), cpu(1, 10)], 1400),
            [cpu(0, 300), cpu(1, 100)]
        );
        // The next sample sees only vCPU 1: vCPU 0 stays, vCPU 1 grows.
        let next = e.update(&[cpu(0, 30), cpu(1, 50)], 1440);
        assert_eq!(next[0], cpu(0, 300), "a counter never goes backwards");
        assert_eq!(next[1], cpu(1, 275), "80 seen of 440: x5.5");
    }
}
