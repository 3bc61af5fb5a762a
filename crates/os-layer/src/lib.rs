//! The operating-system layer both programs share: one parser for a task's
//! `/proc/<pid>/task/<tid>/stat` (on `procfs`), one for kernel CPU lists, one conversion
//! between CPU sets and lists. Leaf crate: it knows nothing of vCPUs, credits or plans.

pub mod cpus;
pub mod task;

pub use cpus::{cpus_of, get_cpus, parse_cpu_list, set_cpus, to_cpuset, CpuListError};
pub use task::{fake_stat_line, TaskStat, PF_KTHREAD};
