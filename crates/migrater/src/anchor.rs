//! Placement while the host agent favours vCPUs (pure). When the host agent says it keeps
//! some of our vCPUs running for our I/O (`held` in its `applied` replies), the daemon stops
//! chasing running vCPUs and anchors each I/O-bound task on a held vCPU instead: moving
//! tasks away from the vCPU the host favours would undo the host's help, and leaving them
//! to the guest kernel's balancer lets them drift onto a vCPU the host is not favouring.
//! The guest's next report then names the held vCPU as the one carrying its I/O, so host
//! and guest agree. Never decides for tasks it is not given (admission is the caller's).

/// Where each task must go so that every task sits on a held vCPU: `(tid, cpu)` for the
/// tasks that are not on one yet. `tasks` are `(tid, CPU it is pinned to now, if any)`.
/// A task already on a held vCPU stays (no move for nothing); the others go to the held
/// vCPU with the fewest tasks so far (lowest number on ties), so several held vCPUs share
/// the tasks. Nothing moves when nothing is held.
pub fn moves(tasks: &[(u32, Option<usize>)], held: &[usize]) -> Vec<(u32, usize)> {
    if held.is_empty() {
        return Vec::new();
    }
    let mut load: Vec<usize> = held
        .iter()
        .map(|h| tasks.iter().filter(|(_, on)| *on == Some(*h)).count())
        .collect();
    let mut out = Vec::new();
    for &(tid, on) in tasks {
        if on.is_some_and(|c| held.contains(&c)) {
            continue;
        }
        let i = (0..held.len())
            .min_by_key(|&i| (load[i], held[i]))
            .expect("held is not empty");
        load[i] += 1;
        out.push((tid, held[i]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_held_nothing_moves() {
        assert!(moves(&[(1, Some(0)), (2, None)], &[]).is_empty());
    }

    #[test]
    fn a_task_on_a_held_vcpu_stays() {
        assert!(moves(&[(1, Some(1))], &[1]).is_empty());
    }

    #[test]
    fn the_others_go_to_a_held_vcpu() {
        assert_eq!(
            moves(&[(1, Some(0)), (2, None)], &[1]),
            vec![(1, 1), (2, 1)]
        );
    }

    #[test]
    fn several_held_vcpus_share_the_tasks() {
        // vCPU 2 already has one; the newcomers fill vCPU 3 first, then alternate.
        let m = moves(&[(1, Some(2)), (2, None), (3, Some(0)), (4, None)], &[2, 3]);
        assert_eq!(m, vec![(2, 3), (3, 2), (4, 3)]);
    }
}
