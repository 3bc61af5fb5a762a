//! A task's identity and scheduling facts from `/proc/<pid>/task/<tid>/stat`.

use procfs::FromRead;
use std::path::Path;

/// `PF_KTHREAD` from include/linux/sched.h: the task is a kernel thread.
pub const PF_KTHREAD: u64 = 0x0020_0000;

/// The fields of `stat` the programs use. A tid is reused after its task exits; `comm`
/// and `start_time` together tell the same task from a new one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskStat {
    /// Field 2, without the parentheses (may hold spaces and parentheses itself).
    pub comm: String,
    /// Field 9, `PF_*` flags.
    pub flags: u64,
    /// Field 22, start time in clock ticks since boot.
    pub start_time: u64,
    /// Field 39, the CPU it last ran on (absent on very old kernels).
    pub last_cpu: Option<u32>,
}

impl TaskStat {
    /// Parses the text of a `stat` file; `None` when it is not one.
    pub fn parse(text: &str) -> Option<TaskStat> {
        let s = procfs::process::Stat::from_read(text.as_bytes()).ok()?;
        Some(TaskStat {
            comm: s.comm,
            flags: u64::from(s.flags),
            start_time: s.starttime,
            last_cpu: s.processor.and_then(|c| u32::try_from(c).ok()),
        })
    }

    /// Reads and parses a `stat` file; `None` when the task is gone or the file is not one.
    pub fn read(path: &Path) -> Option<TaskStat> {
        Self::parse(&std::fs::read_to_string(path).ok()?)
    }

    /// Thread `tid`'s stat from the real /proc (any thread is reachable as /proc/<tid>).
    pub fn of_tid(tid: u32) -> Option<TaskStat> {
        Self::read(Path::new(&format!("/proc/{tid}/stat")))
    }

    pub fn is_kernel_thread(&self) -> bool {
        self.flags & PF_KTHREAD != 0
    }
}

/// A thread's `schedstat`: cumulative ns on a CPU, ns runnable waiting for one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedStat {
    pub run_ns: u64,
    pub wait_ns: u64,
}

impl SchedStat {
    /// Parses `schedstat` text (`run_ns wait_ns timeslices`); `None` when it is not one.
    pub fn parse(text: &str) -> Option<SchedStat> {
        let mut f = text.split_whitespace().map(str::parse::<u64>);
        Some(SchedStat {
            run_ns: f.next()?.ok()?,
            wait_ns: f.next()?.ok()?,
        })
    }

    /// Reads and parses a `schedstat` file; `None` when the task is gone.
    pub fn read(path: &Path) -> Option<SchedStat> {
        Self::parse(&std::fs::read_to_string(path).ok()?)
    }
}

/// A whole `stat` line as the kernel writes it, for fake /proc trees in tests: every
/// field present, the ones not given zero.
pub fn fake_stat_line(tid: u32, comm: &str, flags: u64, start_time: u64, last_cpu: u32) -> String {
    // Fields 3..=21, 22 = start time, 23..=38, 39 = processor, 40..=52.
    let before: String = (4..=21)
        .map(|f| {
            if f == 9 {
                format!(" {flags}")
            } else {
                " 0".to_string()
            }
        })
        .collect();
    format!(
        "{tid} ({comm}) S{before} {start_time}{} {last_cpu}{}\n",
        " 0".repeat(38 - 22),
        " 0".repeat(52 - 39)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_is_run_then_wait() {
        assert_eq!(
            SchedStat::parse("1200 340 7\n"),
            Some(SchedStat {
                run_ns: 1200,
                wait_ns: 340
            })
        );
        assert_eq!(SchedStat::parse("1200\n"), None);
        assert_eq!(SchedStat::parse("x 1 2"), None);
    }

    #[test]
    fn our_own_thread_has_a_schedstat_on_this_kernel() {
        let tid = nix::unistd::gettid().as_raw();
        // Run a little and sleep: the figures are brought up to date when a thread leaves
        // the CPU.
        let t0 = std::time::Instant::now();
        while t0.elapsed() < std::time::Duration::from_millis(2) {}
        std::thread::sleep(std::time::Duration::from_millis(1));
        let s = SchedStat::read(Path::new(&format!("/proc/self/task/{tid}/schedstat")))
            .expect("schedstat of this thread (CONFIG_SCHED_INFO)");
        assert!(s.run_ns > 0, "{s:?}");
    }

    const KTHREAD: &str = "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 \
        3 0 0 18446744073709551615 0 0 0 0 0 0 0 2147483647 0 0 0 0 0 1 0 0 0 0 0 0 0 0 0 0 \
        0 0 0";

    #[test]
    fn comm_with_spaces_and_parentheses() {
        let text = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 \
            987654 0 0 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 \
            0 0 0";
        let s = TaskStat::parse(text).expect("parses");
        assert_eq!(s.comm, "a (b) c");
        assert_eq!(s.start_time, 987654);
        assert_eq!(s.flags, 4194560);
        assert_eq!(s.last_cpu, Some(1));
        assert!(!s.is_kernel_thread());
    }

    #[test]
    fn kernel_threads_are_told() {
        let s = TaskStat::parse(KTHREAD).expect("parses");
        assert!(s.is_kernel_thread());
        assert_eq!(s.start_time, 3);
    }

    #[test]
    fn a_truncated_line_is_not_a_stat() {
        assert_eq!(TaskStat::parse("12 (x) S 1 2"), None);
        assert_eq!(TaskStat::parse(""), None);
        assert_eq!(TaskStat::parse("no parentheses at all"), None);
    }

    #[test]
    fn fake_lines_parse_like_real_ones() {
        let s = TaskStat::parse(&fake_stat_line(7, "w) x", PF_KTHREAD, 4242, 3)).expect("parses");
        assert_eq!(
            s,
            TaskStat {
                comm: "w) x".into(),
                flags: PF_KTHREAD,
                start_time: 4242,
                last_cpu: Some(3)
            }
        );
        let real = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let fake = fake_stat_line(1, "x", 0, 1, 0);
        assert_eq!(
            fake.split(' ').count(),
            real.split(' ').count(),
            "as many fields as this kernel writes:\n{fake}{real}"
        );
    }

    #[test]
    fn this_thread_reads_as_itself() {
        let tid = nix::unistd::gettid().as_raw() as u32;
        let s = TaskStat::of_tid(tid).expect("own stat");
        assert!(!s.is_kernel_thread());
        assert!(s.start_time > 0);
        assert!(s.last_cpu.is_some());
        let again = TaskStat::read(Path::new("/proc/thread-self/stat")).expect("thread-self");
        assert_eq!(again.start_time, s.start_time);
    }
}
