//! ISACS Algorithm 2 over host CPUs (pure): which vCPU threads to move this period.
//!
//! Every host CPU that holds a placed vCPU thread, or that some movable thread may go to,
//! is a run queue. Sources are taken busiest first (most I/O events); each may give away
//! one vCPU per period (the paper moves at most one per reallocation), and a move updates
//! the model before the next source is looked at, so two sources never pile onto the same
//! quiet CPU on stale figures. A vCPU only goes to a CPU it is allowed on.

use sched_core::balance::{balance_io_load, RunQueueLoad};
use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq)]
pub struct Placed {
    /// Host CPU the thread is pinned to now.
    pub cpu: usize,
    pub events: u64,
    pub iv_credit: f64,
    /// CPUs it may be placed on.
    pub allowed: Vec<usize>,
    /// False while cooling down after a move (or not managed at all).
    pub movable: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Move {
    /// Index into the input slice.
    pub index: usize,
    pub from: usize,
    pub to: usize,
}

pub fn plan_moves(vcpus: &[Placed]) -> Vec<Move> {
    let mut queues: BTreeMap<usize, RunQueueLoad> = BTreeMap::new();
    let empty = |id| RunQueueLoad {
        id,
        io_events: 0,
        io_load: 0.0,
        vcpus: Vec::new(),
    };
    for (i, v) in vcpus.iter().enumerate() {
        for &c in &v.allowed {
            queues.entry(c).or_insert_with(|| empty(c));
        }
        let q = queues.entry(v.cpu).or_insert_with(|| empty(v.cpu));
        q.io_events += v.events;
        q.io_load += v.iv_credit;
        if v.movable {
            q.vcpus.push((i as u32, v.iv_credit));
        }
    }
    let mut order: Vec<(u64, usize)> = queues
        .values()
        .filter(|q| q.io_events > 0)
        .map(|q| (q.io_events, q.id))
        .collect();
    order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut moves = Vec::new();
    for (_, source) in order {
        let Some(s) = queues.get(&source) else {
            continue;
        };
        // Only CPUs that some movable vCPU of this queue may use are destinations.
        let mut reach: Vec<usize> = s
            .vcpus
            .iter()
            .flat_map(|&(i, _)| vcpus[i as usize].allowed.iter().copied())
            .collect();
        reach.sort_unstable();
        reach.dedup();
        let reachable: Vec<RunQueueLoad> = std::iter::once(s.clone())
            .chain(
                reach
                    .iter()
                    .filter(|&&c| c != source)
                    .filter_map(|c| queues.get(c).cloned()),
            )
            .collect();
        let Some(m) = balance_io_load(source, &reachable) else {
            continue;
        };
        let i = m.vcpu as usize;
        if !vcpus[i].allowed.contains(&m.to) {
            continue;
        }
        // Keep the model current for the next source; the moved vCPU rests where it lands.
        let (events, iv) = (vcpus[i].events, vcpus[i].iv_credit);
        let s = queues.get_mut(&m.from).expect("source queue");
        s.io_events -= events;
        s.io_load -= iv;
        s.vcpus.retain(|&(x, _)| x != m.vcpu);
        let d = queues.get_mut(&m.to).expect("destination queue");
        d.io_events += events;
        d.io_load += iv;
        moves.push(Move {
            index: i,
            from: m.from,
            to: m.to,
        });
    }
    moves
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(cpu: usize, events: u64, iv: f64, allowed: &[usize]) -> Placed {
        Placed {
            cpu,
            events,
            iv_credit: iv,
            allowed: allowed.to_vec(),
            movable: true,
        }
    }

    #[test]
    fn spreads_io_vcpus_over_idle_allowed_cpus() {
        // Three equally I/O-intensive vCPUs on CPU 0, CPU 1 empty: one moves (one per
        // source per period), and it goes to CPU 1.
        let vs = [
            v(0, 100, 4.0, &[0, 1]),
            v(0, 100, 4.0, &[0, 1]),
            v(0, 100, 4.0, &[0, 1]),
        ];
        let m = plan_moves(&vs);
        assert_eq!(m.len(), 1, "{m:?}");
        assert_eq!((m[0].from, m[0].to), (0, 1));
        // The next period (after the move) does not move back: 4 + 4 < 8 − 4 is false.
        let mut after = vs.to_vec();
        after[m[0].index].cpu = 1;
        assert!(plan_moves(&after).is_empty());
    }

    #[test]
    fn respects_allowed_cpus_and_cooldown() {
        let vs = [
            v(0, 100, 4.0, &[0]),
            v(0, 100, 4.0, &[0]),
            v(0, 100, 4.0, &[0]),
        ];
        assert!(plan_moves(&vs).is_empty(), "no CPU other than 0 is allowed");
        let mut vs = [
            v(0, 100, 4.0, &[0, 1]),
            v(0, 100, 4.0, &[0, 1]),
            v(0, 100, 4.0, &[0, 1]),
        ];
        for x in &mut vs {
            x.movable = false;
        }
        assert!(plan_moves(&vs).is_empty(), "cooling down");
    }

    #[test]
    fn cpu_bound_vcpus_stay() {
        let vs = [v(0, 0, 0.0, &[0, 1]), v(0, 0, 0.0, &[0, 1])];
        assert!(plan_moves(&vs).is_empty());
    }

    #[test]
    fn two_sources_do_not_pile_onto_one_cpu() {
        // CPUs 0 and 1 each hold three I/O vCPUs; CPU 2 is empty. On stale figures both
        // sources would send one to CPU 2; with the model updated after the first move,
        // the second fails the condition (4 + 4 < 12 − 4 is false).
        let vs = [
            v(0, 100, 4.0, &[0, 1, 2]),
            v(0, 100, 4.0, &[0, 1, 2]),
            v(0, 100, 4.0, &[0, 1, 2]),
            v(1, 100, 4.0, &[0, 1, 2]),
            v(1, 100, 4.0, &[0, 1, 2]),
            v(1, 100, 4.0, &[0, 1, 2]),
        ];
        let m = plan_moves(&vs);
        assert_eq!(m.len(), 1, "{m:?}");
        assert_eq!(m[0].to, 2);
        let mut after = vs.to_vec();
        for mv in &m {
            after[mv.index].cpu = mv.to;
        }
        assert!(plan_moves(&after).is_empty(), "{:?}", plan_moves(&after));
    }
}
