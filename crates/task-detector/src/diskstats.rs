//! Block requests completed on this machine, from /proc/diskstats: the kernel's own
//! count, free to read and independent of our BPF programs (which only run while the
//! detector samples). The move guard measures I/O progress with it.

use std::collections::HashSet;

/// Reads /proc/diskstats; knows which devices are whole disks (the entries of /sys/block)
/// and looks again only when a device it has not seen appears.
#[derive(Debug, Default)]
pub struct DiskStats {
    disks: HashSet<String>,
    partitions: HashSet<String>,
}

impl DiskStats {
    /// Reads and writes completed on whole disks (partitions are already counted in
    /// their disk), or None when /proc/diskstats cannot be read.
    pub fn requests_completed(&mut self) -> Option<u64> {
        let text = std::fs::read_to_string("/proc/diskstats").ok()?;
        let unknown = text.lines().any(|l| {
            l.split_whitespace()
                .nth(2)
                .is_some_and(|n| !self.disks.contains(n) && !self.partitions.contains(n))
        });
        if unknown {
            self.disks = std::fs::read_dir("/sys/block")
                .map(|d| {
                    d.filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().to_string()))
                        .collect()
                })
                .unwrap_or_default();
            self.partitions = text
                .lines()
                .filter_map(|l| l.split_whitespace().nth(2))
                .filter(|n| !self.disks.contains(*n))
                .map(str::to_string)
                .collect();
        }
        Some(sum_completed(&text, |name| !self.disks.contains(name)))
    }
}

/// Fields 4 (reads completed) and 8 (writes completed) of every line whose device is not
/// a partition; malformed lines count nothing.
pub fn sum_completed(text: &str, is_partition: impl Fn(&str) -> bool) -> u64 {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let name = *f.get(2)?;
            if is_partition(name) {
                return None;
            }
            let reads: u64 = f.get(3)?.parse().ok()?;
            let writes: u64 = f.get(7)?.parse().ok()?;
            Some(reads + writes)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_disks_only() {
        let text = "\
 254       0 vda 5336 10 410730 3150 1200 0 9600 800 0 5000 3950 0 0 0 0 0 0
 254       1 vda1 5000 10 400000 3000 1100 0 9000 700 0 4800 3700 0 0 0 0 0 0
   7       0 loop0 3 0 8 0 0 0 0 0 0 4 0 0 0 0 0 0 0
 broken line
";
        assert_eq!(sum_completed(text, |n| n == "vda1"), 5336 + 1200 + 3);
    }
}
