//! Which CPUs take a disk's completion interrupts: the block device under a file, its
//! virtio device in sysfs, and the `effective_affinity_list` of that device's request-queue
//! interrupts in `/proc/irq`. For the benchmarks' pinned oracle, which must know where a
//! request completes. Reads only; it never writes an affinity (managed interrupts refuse it
//! anyway). Roots are injectable so the parsing is tested on a fake tree.

use anyhow::{Context, Result};
use std::path::Path;

/// The disk under a file and the CPUs its request queues' interrupts are delivered to.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct CompletionMap {
    /// Whole-disk name, e.g. `vda`.
    pub disk: String,
    /// Device the driver bound to, e.g. `virtio1`.
    pub device: String,
    /// (irq number, queue interrupt name, effective CPUs), by irq number.
    pub queues: Vec<(u32, String, Vec<usize>)>,
}

impl CompletionMap {
    /// Every CPU that takes a completion interrupt of this disk, ascending.
    pub fn cpus(&self) -> Vec<usize> {
        let mut c: Vec<usize> = self.queues.iter().flat_map(|q| q.2.clone()).collect();
        c.sort_unstable();
        c.dedup();
        c
    }

    /// The disk under `file` on this machine.
    pub fn for_file(file: &Path) -> Result<CompletionMap> {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(file)
            .with_context(|| format!("stat {}", file.display()))?
            .dev();
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        Self::read(Path::new("/sys"), Path::new("/proc"), major, minor)
    }

    /// The disk of block device `major:minor` (a partition resolves to its disk), read
    /// under `sys` and `proc`.
    pub fn read(sys: &Path, proc: &Path, major: u32, minor: u32) -> Result<CompletionMap> {
        let node = sys.join(format!("dev/block/{major}:{minor}"));
        let mut dir = std::fs::canonicalize(&node)
            .with_context(|| format!("{} (is the file on a block device?)", node.display()))?;
        if dir.join("partition").exists() {
            dir.pop();
        }
        let disk = file_name(&dir)?;
        let device_link = dir.join("device");
        let device = file_name(
            &std::fs::canonicalize(&device_link)
                .with_context(|| format!("resolving {}", device_link.display()))?,
        )?;
        let prefix = format!("{device}-req");
        let irq_dir = proc.join("irq");
        let mut queues = Vec::new();
        for e in
            std::fs::read_dir(&irq_dir).with_context(|| format!("reading {}", irq_dir.display()))?
        {
            let e = e?;
            let Some(irq) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            // A handler's name is a subdirectory of its irq's directory.
            for h in std::fs::read_dir(e.path())?.flatten() {
                let name = h.file_name().to_string_lossy().into_owned();
                if name.starts_with(&prefix) && h.path().is_dir() {
                    let list = e.path().join("effective_affinity_list");
                    let text = std::fs::read_to_string(&list)
                        .with_context(|| format!("reading {}", list.display()))?;
                    let cpus = parse_cpu_list(&text)
                        .with_context(|| format!("parsing {}", list.display()))?;
                    queues.push((irq, name, cpus));
                }
            }
        }
        anyhow::ensure!(
            !queues.is_empty(),
            "no request-queue interrupt named {prefix}* under {} for disk {disk}: only \
             virtio-blk disks are mapped; name the completion CPU yourself",
            irq_dir.display()
        );
        queues.sort();
        Ok(CompletionMap {
            disk,
            device,
            queues,
        })
    }
}

fn file_name(p: &Path) -> Result<String> {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .with_context(|| format!("{} has no file name", p.display()))
}

/// A kernel CPU list ("0-2,5", with a trailing newline) as CPU numbers.
pub fn parse_cpu_list(text: &str) -> Result<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse()?, b.trim().parse()?);
                anyhow::ensure!(a <= b, "range {part:?} runs backwards");
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse()?),
        }
    }
    Ok(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;
    use std::path::PathBuf;

    fn fake_roots(base: &Path) -> (PathBuf, PathBuf) {
        (base.join("sys"), base.join("proc"))
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("1\n").unwrap(), vec![1]);
        assert_eq!(parse_cpu_list("0-2,5").unwrap(), vec![0, 1, 2, 5]);
        assert_eq!(parse_cpu_list("\n").unwrap(), Vec::<usize>::new());
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("x").is_err());
    }

    /// sysfs and procfs as on a 2-CPU virtio guest: vda1 on vda on virtio1, whose one
    /// request queue's interrupt lands on CPU 1; another device's queue on CPU 0.
    fn tree(base: &Path, queues: &[(u32, &str, &str)]) {
        let (sys, proc) = fake_roots(base);
        let dev = sys.join("devices/pci0000:00/0000:00:02.0/virtio1");
        let disk = dev.join("block/vda");
        fs::create_dir_all(disk.join("vda1")).unwrap();
        fs::write(disk.join("vda1/partition"), "1\n").unwrap();
        symlink(&dev, disk.join("device")).unwrap();
        fs::create_dir_all(sys.join("dev/block")).unwrap();
        symlink(disk.join("vda1"), sys.join("dev/block/253:1")).unwrap();
        symlink(&disk, sys.join("dev/block/253:0")).unwrap();
        for (irq, name, cpus) in queues {
            let d = proc.join(format!("irq/{irq}"));
            fs::create_dir_all(d.join(name)).unwrap();
            fs::write(d.join("effective_affinity_list"), cpus).unwrap();
        }
        fs::create_dir_all(proc.join("irq/0")).unwrap();
    }

    #[test]
    fn a_partition_resolves_to_its_disks_request_queue() {
        let t = tempfile::tempdir().unwrap();
        tree(
            t.path(),
            &[
                (36, "virtio1-req.0", "1\n"),
                (35, "virtio1-config", "0\n"),
                (39, "virtio2-output.0", "0\n"),
            ],
        );
        let (sys, proc) = fake_roots(t.path());
        for minor in [0, 1] {
            let m = CompletionMap::read(&sys, &proc, 253, minor).unwrap();
            assert_eq!(m.disk, "vda");
            assert_eq!(m.device, "virtio1");
            assert_eq!(m.queues, vec![(36, "virtio1-req.0".to_string(), vec![1])]);
            assert_eq!(m.cpus(), vec![1]);
        }
    }

    #[test]
    fn one_queue_per_cpu_gives_every_cpu() {
        let t = tempfile::tempdir().unwrap();
        tree(
            t.path(),
            &[(41, "virtio1-req.1", "1\n"), (40, "virtio1-req.0", "0\n")],
        );
        let (sys, proc) = fake_roots(t.path());
        let m = CompletionMap::read(&sys, &proc, 253, 0).unwrap();
        assert_eq!(m.queues[0].0, 40);
        assert_eq!(m.cpus(), vec![0, 1]);
    }

    #[test]
    fn a_disk_without_request_interrupts_is_an_error_naming_it() {
        let t = tempfile::tempdir().unwrap();
        tree(t.path(), &[(35, "virtio1-config", "0\n")]);
        let (sys, proc) = fake_roots(t.path());
        let e = CompletionMap::read(&sys, &proc, 253, 0).unwrap_err();
        assert!(format!("{e:#}").contains("virtio1-req"), "{e:#}");
        assert!(CompletionMap::read(&sys, &proc, 8, 0).is_err());
    }
}
