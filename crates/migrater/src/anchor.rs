//! Placement while the host agent favours vCPUs (pure). When the host agent says it keeps
//! some of our vCPUs running for our I/O (`held` in its `applied` replies), the daemon stops
//! chasing running vCPUs and gathers the I/O-bound tasks on held vCPUs instead: moving
//! tasks away from the vCPU the host favours would undo the host's help, and leaving them to
//! the guest kernel's balancer lets them drift onto a vCPU the host is not favouring. Never
//! decides for tasks it is not given (admission is the caller's).

/// A task as anchoring sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    pub tid: u32,
    /// The CPU it is pinned to now, if any.
    pub pinned: Option<usize>,
}

/// Anchor `tid` on the held vCPU `cpu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Anchor {
    pub tid: u32,
    pub cpu: usize,
}

/// The tasks to pin now. A task already pinned to a held vCPU stays (no move for
/// nothing); every other task goes to the held vCPU with the fewest tasks so far (lowest
/// number on ties), so several held vCPUs share them, and the vCPU the host favours
/// carries the VM's I/O. Nothing moves when nothing is held.
pub fn moves(tasks: &[Placed], held: &[usize]) -> Vec<Anchor> {
    if held.is_empty() {
        return Vec::new();
    }
    let pinned_on_held = |on: Option<usize>| on.is_some_and(|c| held.contains(&c));
    let mut load: Vec<usize> = held
        .iter()
        .map(|h| tasks.iter().filter(|t| t.pinned == Some(*h)).count())
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        if pinned_on_held(t.pinned) {
            continue;
        }
        let i = (0..held.len())
            .min_by_key(|&i| (load[i], held[i]))
            .expect("held is not empty");
        load[i] += 1;
        out.push(Anchor {
            tid: t.tid,
            cpu: held[i],
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(tid: u32, pinned: Option<usize>) -> Placed {
        Placed { tid, pinned }
    }

    fn anchors(p: &[(u32, usize)]) -> Vec<Anchor> {
        p.iter().map(|&(tid, cpu)| Anchor { tid, cpu }).collect()
    }

    #[test]
    fn nothing_held_nothing_moves() {
        assert!(moves(&[t(1, Some(0)), t(2, None)], &[]).is_empty());
    }

    #[test]
    fn a_task_on_a_held_vcpu_stays() {
        assert!(moves(&[t(1, Some(1))], &[1]).is_empty());
    }

    #[test]
    fn the_others_go_to_a_held_vcpu() {
        assert_eq!(
            moves(&[t(1, Some(0)), t(2, None)], &[1]),
            anchors(&[(1, 1), (2, 1)])
        );
    }

    #[test]
    fn several_held_vcpus_share_the_tasks() {
        // vCPU 2 already has one; the newcomers fill vCPU 3 first, then alternate.
        let m = moves(
            &[t(1, Some(2)), t(2, None), t(3, Some(0)), t(4, None)],
            &[2, 3],
        );
        assert_eq!(m, anchors(&[(2, 3), (3, 2), (4, 3)]));
    }
}
