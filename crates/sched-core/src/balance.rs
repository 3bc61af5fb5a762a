//! ISACS Algorithm 2: after a run queue (the source, s) reallocates, move one
//! I/O-intensive vCPU to a run queue with fewer I/O events (d) when that lowers the
//! larger of the two I/O loads: `d.IOload + IV < s.IOload − IV`.
//!
//! Where the algorithm's loops keep the last match, this picks deterministically: the
//! destination with the fewest I/O events (ties: lowest id) and the vCPU with the largest
//! IVCredit that satisfies the condition (ties: lowest id), which moves the most load.

#[derive(Clone, Debug, PartialEq)]
pub struct RunQueueLoad {
    pub id: usize,
    /// Σ I/O events received by its vCPUs (RunQ.IOevent).
    pub io_events: u64,
    /// Σ IVCredit (RunQ.IOload).
    pub io_load: f64,
    /// (vCPU id, IVCredit) of its vCPUs that may move.
    pub vcpus: Vec<(u32, f64)>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Migration {
    pub vcpu: u32,
    pub from: usize,
    pub to: usize,
}

pub fn balance_io_load(source: usize, queues: &[RunQueueLoad]) -> Option<Migration> {
    let s = queues.iter().find(|q| q.id == source)?;
    let d = queues
        .iter()
        .filter(|q| q.id != s.id && q.io_events < s.io_events)
        .min_by(|a, b| a.io_events.cmp(&b.io_events).then(a.id.cmp(&b.id)))?;
    let m = s
        .vcpus
        .iter()
        .filter(|&&(_, iv)| iv > 0.0 && d.io_load + iv < s.io_load - iv)
        .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))?;
    Some(Migration {
        vcpu: m.0,
        from: s.id,
        to: d.id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(id: usize, io_events: u64, vcpus: &[(u32, f64)]) -> RunQueueLoad {
        RunQueueLoad {
            id,
            io_events,
            io_load: vcpus.iter().map(|v| v.1).sum(),
            vcpus: vcpus.to_vec(),
        }
    }

    #[test]
    fn moves_the_largest_fitting_io_vcpu_to_the_quietest_queue() {
        let qs = [
            q(0, 900, &[(1, 5.0), (2, 3.0), (3, 0.0)]),
            q(1, 100, &[(4, 1.0)]),
            q(2, 50, &[(5, 0.5)]),
        ];
        // d = queue 2 (fewest events, load 0.5). vCPU 1: 0.5 + 5 < 8 − 5? 5.5 < 3 no.
        // vCPU 2: 0.5 + 3 < 8 − 3: 3.5 < 5 yes.
        assert_eq!(
            balance_io_load(0, &qs),
            Some(Migration {
                vcpu: 2,
                from: 0,
                to: 2
            })
        );
    }

    #[test]
    fn no_move_when_it_would_not_lower_the_load() {
        let qs = [q(0, 500, &[(1, 2.0)]), q(1, 100, &[(2, 1.5)])];
        // 1.5 + 2 < 2 − 2 is false.
        assert_eq!(balance_io_load(0, &qs), None);
    }

    #[test]
    fn no_move_to_a_busier_queue_or_of_a_cpu_bound_vcpu() {
        let qs = [q(0, 100, &[(1, 4.0)]), q(1, 900, &[])];
        assert_eq!(balance_io_load(0, &qs), None);
        let qs = [q(0, 900, &[(1, 0.0), (2, 0.0)]), q(1, 0, &[])];
        assert_eq!(balance_io_load(0, &qs), None);
        assert_eq!(balance_io_load(7, &qs), None);
    }
}
