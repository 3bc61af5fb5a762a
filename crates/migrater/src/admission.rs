//! Which I/O-bound tasks the daemon manages in a detector window: pure, so that its rules
//! are unit-tested like the planner's. The daemon applies the verdicts (the executor checks
//! each new task's identity and journals its mask) and releases the tasks that leave.
//!
//! Rules: never our own threads, never a command the user excluded, never a task whose
//! mask someone else changed after us (hands off, by tid and start time, for as long as it
//! lives); a task already managed keeps its entry (allowed CPUs, priority); a tid reused by
//! another task is a new task.

use std::collections::HashSet;
use task_detector::IoTaskInfo;

use crate::affinity::TaskId;
use crate::hook::TaskEntry;

/// What the user and the daemon itself exclude from management.
#[derive(Clone, Copy, Debug)]
pub struct Exclusions<'a> {
    pub own_pid: u32,
    pub comm: &'a [String],
    /// Tasks whose mask someone else changed after us.
    pub hands_off: &'a HashSet<TaskId>,
}

/// A verdict for one I/O-bound task.
#[derive(Debug, PartialEq)]
pub enum Admission<'a> {
    /// Already managed: its allowed CPUs and priority stay; load and CPU are `now`'s.
    Keep {
        managed: &'a TaskEntry,
        now: &'a IoTaskInfo,
    },
    /// Not managed yet: take it over.
    New(&'a IoTaskInfo),
}

/// The I/O-bound tasks the user lets us move (the guard's "candidates": they exist even
/// while moves are on hold).
pub fn eligible<'a>(
    found: &'a [IoTaskInfo],
    own_pid: u32,
    exclude_comm: &[String],
) -> Vec<&'a IoTaskInfo> {
    found
        .iter()
        .filter(|i| i.task.tgid != own_pid && !exclude_comm.contains(&i.comm))
        .collect()
}

/// The verdicts for this window's I/O-bound tasks against the ones managed now.
pub fn admit<'a>(
    found: &'a [IoTaskInfo],
    current: &'a [TaskEntry],
    ex: Exclusions<'_>,
) -> Vec<Admission<'a>> {
    eligible(found, ex.own_pid, ex.comm)
        .into_iter()
        .filter(|i| {
            !ex.hands_off.contains(&TaskId {
                tid: i.task.tid,
                start_time: i.start_time,
            })
        })
        .map(|i| {
            match current
                .iter()
                .find(|e| e.tid == i.task.tid && e.start_time == i.start_time)
            {
                Some(managed) => Admission::Keep { managed, now: i },
                None => Admission::New(i),
            }
        })
        .collect()
}

/// The managed tasks that are not managed any more in `next` (released by the daemon).
pub fn leaving<'a>(current: &'a [TaskEntry], next: &[TaskEntry]) -> Vec<&'a TaskEntry> {
    current
        .iter()
        .filter(|e| !next.iter().any(|n| n.tid == e.tid))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use task_detector::IoTask;

    fn found(tid: u32, tgid: u32, comm: &str, start_time: u64) -> IoTaskInfo {
        IoTaskInfo {
            task: IoTask {
                tid,
                tgid,
                io_fraction: 0.9,
                cpu_fraction: 0.1,
                iops: 1000.0,
                load: 0.9,
                last_cpu: 0,
                completion: Default::default(),
            },
            comm: comm.into(),
            start_time,
        }
    }

    fn managed(tid: u32, start_time: u64, allowed: Vec<usize>) -> TaskEntry {
        TaskEntry {
            tid,
            tgid: tid,
            start_time,
            comm: "fio".into(),
            load: 0.5,
            priority: 3,
            last_cpu: 0,
            allowed,
        }
    }

    #[test]
    fn our_own_threads_and_excluded_commands_are_never_candidates() {
        let f = [
            found(10, 10, "fio", 1),
            found(20, 99, "vmigrater", 1),
            found(30, 30, "backup", 1),
        ];
        let exclude = vec!["backup".to_string()];
        let e = eligible(&f, 99, &exclude);
        assert_eq!(e.iter().map(|i| i.task.tid).collect::<Vec<_>>(), [10]);
    }

    #[test]
    fn managed_tasks_keep_their_entry_and_new_ones_are_taken_over() {
        let f = [found(10, 10, "fio", 1), found(11, 10, "fio", 1)];
        let current = [managed(10, 1, vec![1])];
        let hands_off = HashSet::new();
        let ex = Exclusions {
            own_pid: 99,
            comm: &[],
            hands_off: &hands_off,
        };
        let v = admit(&f, &current, ex);
        assert_eq!(
            v,
            [
                Admission::Keep {
                    managed: &current[0],
                    now: &f[0]
                },
                Admission::New(&f[1])
            ]
        );
    }

    #[test]
    fn a_reused_tid_is_a_new_task_and_hands_off_is_per_task() {
        // tid 10 now belongs to a task started later; tid 11's mask was changed by
        // someone else (hands off), while tid 12, same tid space, is untouched.
        let f = [
            found(10, 10, "fio", 2),
            found(11, 11, "fio", 1),
            found(12, 12, "fio", 1),
        ];
        let current = [managed(10, 1, vec![1])];
        let id = |tid, start_time| TaskId { tid, start_time };
        let hands_off = HashSet::from([id(11, 1), id(12, 7)]);
        let ex = Exclusions {
            own_pid: 99,
            comm: &[],
            hands_off: &hands_off,
        };
        let v = admit(&f, &current, ex);
        assert_eq!(v, [Admission::New(&f[0]), Admission::New(&f[2])]);
    }

    #[test]
    fn tasks_that_leave_are_the_ones_not_managed_any_more() {
        let current = [managed(1, 1, vec![0]), managed(2, 1, vec![0])];
        let next = [managed(2, 1, vec![0]), managed(3, 1, vec![0])];
        let gone: Vec<_> = leaving(&current, &next).iter().map(|e| e.tid).collect();
        assert_eq!(gone, [1]);
        assert!(leaving(&current, &current).is_empty());
    }
}
