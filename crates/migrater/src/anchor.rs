//! Placement while the host agent favours vCPUs (pure). When the host agent says it keeps
//! some of our vCPUs running for our I/O (`held` in its `applied` replies), the daemon stops
//! chasing running vCPUs and anchors I/O-bound tasks on held vCPUs instead: moving tasks
//! away from the vCPU the host favours would undo the host's help, and leaving them to the
//! guest kernel's balancer lets them drift onto a vCPU the host is not favouring. Never
//! decides for tasks it is not given (admission is the caller's).

/// How I/O-bound tasks are anchored while the host holds vCPUs. Measured against each
/// other in the lab (`both`, 4 KiB reads vs vanilla, README session 16): `Gather` 1.10x in
/// main (18 runs), 1.00x in four, 1.09x in quad (12 runs each); `Stay` 1.00x, 1.08x and
/// 1.14x (6 runs each). Neither is better everywhere; `Gather` is the one measured most.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// Every task goes to a held vCPU: the vCPU the host favours carries all of the VM's
    /// I/O, and the others, computing only, pay for it.
    #[default]
    Gather,
    /// A task found on a held vCPU is pinned there; the others are left where the guest
    /// kernel puts them (with four vCPUs per host CPU, gathering piles both readers and a
    /// hog onto one vCPU that still runs less than half the time).
    Stay,
}

/// Where each task must go: `(tid, cpu)` for the tasks to pin now. `tasks` are `(tid, CPU it
/// is pinned to now, if any, CPU it last ran on)`. A task already pinned to a held vCPU
/// stays (no move for nothing). `Stay` pins a task that is not pinned and last ran on a
/// held vCPU, there; `Gather` sends every other task to the held vCPU with the fewest tasks
/// so far (lowest number on ties), so several held vCPUs share them. Nothing moves when
/// nothing is held.
pub fn moves(
    tasks: &[(u32, Option<usize>, usize)],
    held: &[usize],
    policy: Policy,
) -> Vec<(u32, usize)> {
    if held.is_empty() {
        return Vec::new();
    }
    let pinned_on_held = |on: Option<usize>| on.is_some_and(|c| held.contains(&c));
    if policy == Policy::Stay {
        return tasks
            .iter()
            .filter(|(_, on, last)| on.is_none() && held.contains(last))
            .map(|&(tid, _, last)| (tid, last))
            .collect();
    }
    let mut load: Vec<usize> = held
        .iter()
        .map(|h| tasks.iter().filter(|(_, on, _)| *on == Some(*h)).count())
        .collect();
    let mut out = Vec::new();
    for &(tid, on, _) in tasks {
        if pinned_on_held(on) {
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
        for p in [Policy::Stay, Policy::Gather] {
            assert!(moves(&[(1, Some(0), 0), (2, None, 1)], &[], p).is_empty());
        }
    }

    #[test]
    fn a_task_on_a_held_vcpu_stays() {
        for p in [Policy::Stay, Policy::Gather] {
            assert!(moves(&[(1, Some(1), 1)], &[1], p).is_empty());
        }
    }

    #[test]
    fn the_others_go_to_a_held_vcpu() {
        assert_eq!(
            moves(&[(1, Some(0), 0), (2, None, 0)], &[1], Policy::Gather),
            vec![(1, 1), (2, 1)]
        );
    }

    #[test]
    fn several_held_vcpus_share_the_tasks() {
        // vCPU 2 already has one; the newcomers fill vCPU 3 first, then alternate.
        let m = moves(
            &[(1, Some(2), 2), (2, None, 0), (3, Some(0), 0), (4, None, 1)],
            &[2, 3],
            Policy::Gather,
        );
        assert_eq!(m, vec![(2, 3), (3, 2), (4, 3)]);
    }

    #[test]
    fn stay_pins_only_what_already_runs_on_a_held_vcpu() {
        // Task 1 last ran on held vCPU 1: pinned there. Task 2 ran on vCPU 0: left alone,
        // not piled onto vCPU 1. Task 3 is already pinned elsewhere: left to the caller.
        let m = moves(
            &[(1, None, 1), (2, None, 0), (3, Some(0), 1)],
            &[1],
            Policy::Stay,
        );
        assert_eq!(m, vec![(1, 1)]);
    }
}
