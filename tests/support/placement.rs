//! The schedule-aware oracle's choice of CPU for the I/O threads, given which CPUs a
//! deschedule plan has out at a moment: the disk's completion CPU while it runs, else a
//! running CPU. Pure: the plan is a closure, so the choice is tested without a kernel; it
//! never moves anything itself.

/// Where the oracle puts every I/O thread when `out(cpu)` says which of `cpus` are
/// descheduled and `back_at(cpu)` when an out CPU runs again: `completion` when it runs,
/// else the first running CPU, else (all out) `completion`, where the thread at least
/// completes its own requests, or, where requests complete on the submitting CPU, the
/// CPU back first.
pub fn oracle_cpu(
    cpus: &[usize],
    completion: Option<usize>,
    out: impl Fn(usize) -> bool,
    back_at: impl Fn(usize) -> Option<u64>,
) -> usize {
    if let Some(c) = completion.filter(|&c| cpus.contains(&c) && !out(c)) {
        return c;
    }
    cpus.iter()
        .copied()
        .find(|&c| !out(c))
        .or(completion)
        .or_else(|| {
            cpus.iter()
                .filter_map(|&c| back_at(c).map(|t| (t, c)))
                .min()
                .map(|(_, c)| c)
        })
        .or_else(|| cpus.first().copied())
        .unwrap_or(0)
}

/// The earliest of the per-CPU next changes, as `next(cpu)` gives them.
pub fn next_change(cpus: &[usize], next: impl Fn(usize) -> Option<u64>) -> Option<u64> {
    cpus.iter().filter_map(|&c| next(c)).min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_cpu_while_it_runs() {
        assert_eq!(oracle_cpu(&[0, 1], Some(1), |_| false, never), 1);
        assert_eq!(oracle_cpu(&[0, 1], Some(1), |c| c == 0, never), 1);
    }

    #[test]
    fn a_running_cpu_when_the_completion_cpu_is_out() {
        assert_eq!(oracle_cpu(&[0, 1], Some(1), |c| c == 1, never), 0);
        assert_eq!(oracle_cpu(&[0, 1, 2], Some(0), |c| c < 2, never), 2);
    }

    fn never(_: usize) -> Option<u64> {
        None
    }

    #[test]
    fn all_out_without_a_completion_cpu_waits_where_the_first_cpu_comes_back() {
        // 3:1 windows: both out, CPU 1 back at 5 ms, CPU 0 at 20.
        let back = |c: usize| Some([20, 5][c]);
        assert_eq!(oracle_cpu(&[0, 1], None, |_| true, back), 1);
        assert_eq!(oracle_cpu(&[0, 1], Some(0), |_| true, back), 0);
    }

    #[test]
    fn all_out_keeps_the_completion_cpu() {
        assert_eq!(oracle_cpu(&[0, 1], Some(1), |_| true, never), 1);
        assert_eq!(oracle_cpu(&[0, 1], None, |_| true, never), 0);
        assert_eq!(oracle_cpu(&[0, 1], None, |c| c == 0, never), 1);
    }

    #[test]
    fn a_completion_cpu_outside_the_plan_is_ignored_while_others_run() {
        assert_eq!(oracle_cpu(&[0, 1], Some(5), |c| c == 0, never), 1);
    }

    #[test]
    fn next_change_is_the_earliest() {
        assert_eq!(next_change(&[0, 1], |c| [Some(20), Some(10)][c]), Some(10));
        assert_eq!(next_change(&[0, 1], |c| [None, Some(7)][c]), Some(7));
        assert_eq!(next_change(&[0, 1], |_| None), None);
    }
}
