//! The operating-system layer both programs share: one parser for a task's
//! `/proc/<pid>/task/<tid>/stat` (on `procfs`), one for kernel CPU lists, one conversion
//! between CPU sets and lists, the affinity and `sched_{get,set}attr` calls, and the clock,
//! absolute sleeps and futex of the monitor's sleepers, and each CPU's steal time. Leaf crate: it knows nothing of
//! vCPUs, credits or plans.

pub mod cpus;
pub mod root;
pub mod sched;
pub mod stat;
pub mod task;
pub mod time;

pub use cpus::{cpus_of, get_cpus, parse_cpu_list, set_cpus, to_cpuset, CpuListError};
pub use root::Root;
pub use task::{fake_stat_line, SchedStat, TaskStat, PF_KTHREAD};
pub use time::{futex_wait_until, futex_wake_all, monotonic_ns, sleep_until, Mono};
