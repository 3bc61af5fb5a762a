//! CPU lists (`0-3,8,10-11`, as in /sys and cgroups) and CPU sets (`sched_*affinity`).

use nix::errno::Errno;
use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;
use std::fmt;

/// A CPU list that is not one; names the offending part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuListError {
    pub part: String,
    pub reason: &'static str,
}

impl fmt::Display for CpuListError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad CPU list entry {:?}: {}", self.part, self.reason)
    }
}

impl std::error::Error for CpuListError {}

/// Parses a kernel CPU list such as `0-3,8,10-11` into sorted, distinct CPUs. Every CPU
/// must fit a `CpuSet` (below `CpuSet::count()`), since each one may end up in one.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, CpuListError> {
    let bad = |part: &str, reason| CpuListError {
        part: part.to_string(),
        reason,
    };
    let cpu = |part: &str, n: &str| -> Result<usize, CpuListError> {
        let c: usize = n
            .trim()
            .parse()
            .map_err(|_| bad(part, "not a CPU number"))?;
        if c >= CpuSet::count() {
            return Err(bad(
                part,
                "CPU number beyond what the kernel's CPU sets hold",
            ));
        }
        Ok(c)
    };
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.trim().is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (cpu(part, a)?, cpu(part, b)?);
                if b < a {
                    return Err(bad(part, "range ends before it starts"));
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(cpu(part, part)?),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// The CPUs in `set`, ascending.
pub fn cpus_of(set: &CpuSet) -> Vec<usize> {
    (0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect()
}

/// A set of `cpus`; `None` when one does not fit a `CpuSet`.
pub fn to_cpuset(cpus: &[usize]) -> Option<CpuSet> {
    let mut set = CpuSet::new();
    for &c in cpus {
        set.set(c).ok()?;
    }
    Some(set)
}

/// The CPU list of a task (`sched_getaffinity`).
pub fn get_cpus(tid: u32) -> Result<Vec<usize>, Errno> {
    sched_getaffinity(Pid::from_raw(tid as i32)).map(|s| cpus_of(&s))
}

/// Sets the CPU list of a task (`sched_setaffinity`); EINVAL for a CPU no set can hold.
pub fn set_cpus(tid: u32, cpus: &[usize]) -> Result<(), Errno> {
    sched_setaffinity(
        Pid::from_raw(tid as i32),
        &to_cpuset(cpus).ok_or(Errno::EINVAL)?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_sorted_and_distinct() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n"),
            Ok(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("5,1-2,2"), Ok(vec![1, 2, 5]));
        assert_eq!(parse_cpu_list(" 0 , 1 "), Ok(vec![0, 1]));
        assert_eq!(parse_cpu_list(""), Ok(vec![]));
    }

    #[test]
    fn bad_lists_name_the_part() {
        let e = parse_cpu_list("0-1,3-2").unwrap_err();
        assert_eq!(e.part, "3-2");
        assert!(e.to_string().contains("\"3-2\""), "{e}");
        assert_eq!(parse_cpu_list("0,x").unwrap_err().part, "x");
        assert_eq!(parse_cpu_list("1-").unwrap_err().part, "1-");
        let beyond = format!("0-{}", CpuSet::count());
        assert_eq!(parse_cpu_list(&beyond).unwrap_err().part, beyond);
    }

    #[test]
    fn sets_and_lists_convert_both_ways() {
        let set = to_cpuset(&[0, 2, 5]).expect("fits");
        assert_eq!(cpus_of(&set), vec![0, 2, 5]);
        assert!(to_cpuset(&[CpuSet::count()]).is_none());
        assert!(cpus_of(&CpuSet::new()).is_empty());
    }

    #[test]
    fn this_threads_mask_reads_back_what_was_set() {
        let tid = nix::unistd::gettid().as_raw() as u32;
        let all = get_cpus(tid).expect("own mask");
        assert!(!all.is_empty());
        set_cpus(tid, &all[..1]).expect("narrow");
        assert_eq!(get_cpus(tid), Ok(all[..1].to_vec()));
        set_cpus(tid, &all).expect("restore");
        assert_eq!(get_cpus(tid), Ok(all));
        assert_eq!(set_cpus(tid, &[CpuSet::count()]), Err(Errno::EINVAL));
    }
}
