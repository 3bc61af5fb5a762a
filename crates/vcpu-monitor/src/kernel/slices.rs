//! A vCPU's slice history and what it allows: the slice the planner counts from, whether
//! push points can be timed, whether the heartbeat runs. Pure: `state` feeds it the
//! slices the BPF program measured.

/// Slices kept per vCPU for the median estimate (as `SliceEstimator`).
const SLICE_HISTORY: usize = 8;

/// Median of a vCPU's last slices, the estimate the planner's remaining slice counts from.
#[derive(Default)]
pub(super) struct SliceHistory {
    slices: [u64; SLICE_HISTORY],
    n: usize,
    next: usize,
}

impl SliceHistory {
    pub(super) fn push(&mut self, ns: u64) {
        self.slices[self.next] = ns;
        self.next = (self.next + 1) % SLICE_HISTORY;
        self.n = (self.n + 1).min(SLICE_HISTORY);
    }

    pub(super) fn median(&self) -> Option<u64> {
        if self.n == 0 {
            return None;
        }
        let mut v = self.slices;
        let v = &mut v[..self.n];
        v.sort_unstable();
        Some(v[self.n / 2])
    }

    /// The shortest and the longest slice kept, one outlier off each side (their
    /// difference is how far apart the slices end). `None` until four slices are known.
    fn kept(&self) -> Option<(u64, u64)> {
        if self.n < 4 {
            return None;
        }
        let mut v = self.slices;
        let v = &mut v[..self.n];
        v.sort_unstable();
        Some((v[1], v[self.n - 2]))
    }
}

/// What a vCPU's slice history allows (`timing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Timing {
    /// A push can be timed by the slice the planner counts from.
    pub(super) timed: bool,
    /// The heartbeat brackets the median slice end.
    pub(super) heartbeat: bool,
    /// The slice the planner counts from: where pushes are timed, the shortest kept slice
    /// (a push after the slice ended waits out the whole deschedule, one before it only
    /// the lead), else the median.
    pub(super) est_ns: u64,
}

/// How a vCPU's slices can be used. Slices that stable (a hypervisor's fixed quantum, a
/// KVM slice drawn ±10% around 11 ms: 8 of them spread ~2 ms) are timed by their
/// shortest kept slice: the push then comes that much early on a long slice, and rarely
/// after a short one ended, which would cost the whole deschedule. Past a third of the
/// median the early pushes would cost more than the late ones they avoid (a random phase
/// spreads slices over 0-20 ms): no push is timed there. The heartbeat runs where slices
/// are that stable give or take a tick (ticks alone scatter a slice's measured end by up
/// to one), so that what it measures can time them.
pub(super) fn timing(
    history: &SliceHistory,
    slicing: bool,
    push_ns: u64,
    tick_ns: u64,
    default_ns: u64,
) -> Timing {
    let median = history.median().unwrap_or(default_ns);
    let Some((low, high)) = history.kept().filter(|_| slicing) else {
        return Timing {
            timed: false,
            heartbeat: false,
            est_ns: median,
        };
    };
    let tolerance = (2 * push_ns).max(median / 3);
    let timed = high - low <= tolerance;
    Timing {
        timed,
        heartbeat: high - low <= tolerance + tick_ns,
        est_ns: if timed { low } else { median },
    }
}

/// What the event thread keeps per monitored vCPU between looks at the BPF state.
pub(super) struct Slices {
    pub(super) history: Vec<SliceHistory>,
    /// `gaps` of the BPF state when its last slice was taken into `history`.
    pub(super) gaps: Vec<u64>,
    /// Whether its push point can be timed: a deschedule within `QUIET_NS`, and slices
    /// within twice the lead.
    pub(super) timed: Vec<bool>,
}

impl Slices {
    pub(super) fn new(n: usize) -> Slices {
        Slices {
            history: (0..n).map(|_| SliceHistory::default()).collect(),
            gaps: vec![0; n],
            timed: vec![false; n],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_history_is_a_median_of_the_last_eight() {
        let mut h = SliceHistory::default();
        assert_eq!(h.median(), None);
        for ms in [11, 12, 10] {
            h.push(ms * 1_000_000);
        }
        assert_eq!(h.median(), Some(11_000_000));
        for _ in 0..8 {
            h.push(3_000_000);
        }
        assert_eq!(h.median(), Some(3_000_000), "old slices age out");
    }

    #[test]
    fn the_kept_slices_leave_one_outlier_off_each_side() {
        let spread = |h: &SliceHistory| h.kept().map(|(low, high)| high - low);
        let mut h = SliceHistory::default();
        for ms in [10, 10, 11] {
            h.push(ms * 1_000_000);
        }
        assert_eq!(h.kept(), None, "three slices say nothing of their spread");
        h.push(30_000_000);
        assert_eq!(h.kept(), Some((10_000_000, 11_000_000)), "10, [10, 11], 30");
        for ms in [2, 10, 10, 11] {
            h.push(ms * 1_000_000);
        }
        assert_eq!(
            spread(&h),
            Some(1_000_000),
            "one short and one long slice are off"
        );
        for ms in [4, 16, 7, 13] {
            h.push(ms * 1_000_000);
        }
        assert_eq!(
            spread(&h),
            Some(9_000_000),
            "wandering slices: 2, [4 .. 13], 16"
        );
    }

    fn history(us: &[u64]) -> SliceHistory {
        let mut h = SliceHistory::default();
        for &u in us {
            h.push(u * 1_000);
        }
        h
    }

    const PUSH: u64 = 1_000_000;
    const TICK: u64 = 4_000_000;

    #[test]
    fn a_fixed_quantum_is_timed_by_its_shortest_kept_slice() {
        let h = history(&[
            10_180, 10_220, 10_200, 10_210, 10_190, 10_230, 10_200, 10_250,
        ]);
        let t = timing(&h, true, PUSH, TICK, 11_000_000);
        assert!(t.timed && t.heartbeat);
        assert_eq!(t.est_ns, 10_190_000, "10.18, [10.19 .. 10.23], 10.25");
    }

    #[test]
    fn slices_ten_percent_apart_are_timed_early_enough_for_most() {
        // KVM's 11 ms drawn with a 1.1 ms standard deviation (benches/traces/generate.py).
        let h = history(&[
            11_400, 9_700, 12_300, 10_900, 11_800, 10_300, 11_100, 12_900,
        ]);
        let t = timing(&h, true, PUSH, TICK, 11_000_000);
        assert!(t.timed, "{t:?}");
        assert_eq!(t.est_ns, 10_300_000, "9.7, [10.3 .. 12.3], 12.9");
    }

    #[test]
    fn a_random_phase_is_not_timed_and_the_planner_counts_from_the_median() {
        let h = history(&[3_000, 17_500, 9_000, 12_000, 6_500, 19_000, 11_000, 1_200]);
        let t = timing(&h, true, PUSH, TICK, 11_000_000);
        assert_eq!(
            t,
            Timing {
                timed: false,
                heartbeat: false,
                est_ns: 11_000_000
            }
        );
    }

    #[test]
    fn slices_scattered_by_the_tick_get_the_heartbeat_before_a_timed_push() {
        // A regular 11 ms slice whose ends only the 4 ms tick saw: up to a tick short.
        let h = history(&[11_000, 7_100, 9_800, 11_200, 8_200, 10_400, 7_000, 9_000]);
        let t = timing(&h, true, PUSH, TICK, 11_000_000);
        assert!(!t.timed && t.heartbeat, "{t:?}");
        assert_eq!(t.est_ns, 9_800_000, "untimed: the median");
    }

    #[test]
    fn no_deschedule_for_a_while_times_nothing() {
        let h = history(&[10_200; 8]);
        let t = timing(&h, false, PUSH, TICK, 11_000_000);
        assert!(!t.timed && !t.heartbeat);
        assert_eq!(t.est_ns, 10_200_000);
        let t = timing(&SliceHistory::default(), true, PUSH, TICK, 11_000_000);
        assert!(!t.timed && !t.heartbeat);
        assert_eq!(t.est_ns, 11_000_000, "nothing known: the default");
    }
}
