//! Each CPU's steal time from `/proc/stat`: how long the host ran something else while
//! this guest's vCPU was runnable, as the paravirtual steal clock reports it. It stays 0
//! on bare metal, on hosts that report no steal, and where a vCPU is taken away in a way
//! the host does not account (an interrupt that spins). procfs' `KernelStats` drops the
//! CPU numbers (offline CPUs have no line), so the lines are read here.

use std::io;

use crate::root::{located, Root};

/// `(cpu, steal ns)` from the text of `/proc/stat`; `ticks_per_s` is USER_HZ.
pub fn parse_steal(text: &str, ticks_per_s: u64) -> Vec<(usize, u64)> {
    let ns_per_tick = 1_000_000_000 / ticks_per_s.max(1);
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let cpu = fields.next()?.strip_prefix("cpu")?.parse().ok()?;
            // user nice system idle iowait irq softirq steal
            let steal: u64 = fields.nth(7)?.parse().ok()?;
            Some((cpu, steal * ns_per_tick))
        })
        .collect()
}

impl Root {
    /// Every online CPU's cumulative steal time; the error names the file.
    pub fn steal_ns(&self) -> io::Result<Vec<(usize, u64)>> {
        let path = self.proc().join("stat");
        let text = std::fs::read_to_string(&path).map_err(|e| located(&path, e))?;
        let tps = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .map_or(100, |t| t as u64);
        Ok(parse_steal(&text, tps))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_per_cpu_in_ns_with_gaps_for_offline_cpus() {
        let text = "cpu  1298114 9278 171113 339942 11487 0 22533 1044 0 0\n\
                    cpu0 659153 4065 67872 188795 3033 0 269 527 0 0\n\
                    cpu2 638960 5212 103241 151147 8453 0 22263 517 0 0\n\
                    intr 1 2 3\nctxt 99\n";
        assert_eq!(
            parse_steal(text, 100),
            [(0, 5_270_000_000), (2, 5_170_000_000)]
        );
        // A line cut short (an old kernel without the steal column) is skipped.
        assert!(parse_steal("cpu0 1 2 3 4 5 6 7\n", 100).is_empty());
    }

    #[test]
    fn the_real_proc_stat_has_a_line_per_online_cpu() {
        let root = Root::real();
        let steal = root.steal_ns().expect("/proc/stat");
        let online = root.online_cpus().expect("online CPUs");
        assert_eq!(
            steal.iter().map(|s| s.0).collect::<Vec<_>>(),
            online,
            "{steal:?}"
        );
    }
}
