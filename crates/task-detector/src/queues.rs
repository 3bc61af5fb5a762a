//! Where each vCPU's block requests complete, from the kernel's own maps: blk-mq's
//! hardware queues per disk (`/sys/block/D/mq/Q/cpu_list`: the vCPUs that submit to queue
//! Q) and each queue's interrupt (`/proc/irq/N/effective_affinity_list` of the handler
//! named for it: `virtioK-req.Q` for virtio-blk, `nvmeXqQ+1` for NVMe). A request
//! completes on the vCPU that takes its queue's interrupt, so this says, before any I/O is
//! seen, whether a task's completions follow it (a queue per vCPU) or land on one vCPU
//! wherever it runs (one queue, one interrupt vCPU). A queue set to `rq_affinity = 2` has
//! the block layer finish every request on its submitting vCPU (an IPI there after the
//! interrupt, or after a loop device's worker): it needs that vCPU as well. Read-only; a
//! disk whose interrupts cannot be named and that does not force completions onto the
//! submitter is left out (its tasks' completions are learned from the block programs).

use anyhow::{Context, Result};
use os_layer::Root;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

/// One hardware queue of a disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HwQueue {
    pub index: usize,
    /// vCPUs that submit to it.
    pub submit_cpus: Vec<usize>,
    /// vCPUs its interrupt is delivered to (none for a disk without one, a loop device).
    pub completion_cpus: Vec<usize>,
    /// `rq_affinity = 2`: each request also completes on the vCPU that submitted it.
    pub on_submitter: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskQueues {
    pub disk: String,
    pub queues: Vec<HwQueue>,
}

/// Every disk whose queues and interrupts could be named.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueMap {
    pub disks: Vec<DiskQueues>,
}

impl QueueMap {
    /// Reads every blk-mq disk under `root`'s /sys/block.
    pub fn read(root: &Root) -> Result<QueueMap> {
        let block = root.sys().join("block");
        let handlers = irq_handlers(&root.proc().join("irq"))?;
        let mut disks = Vec::new();
        let mut names: Vec<String> = std::fs::read_dir(&block)
            .with_context(|| format!("reading {}", block.display()))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        for disk in names {
            let dir = block.join(&disk);
            if let Some(queues) = disk_queues(&dir, &handlers)? {
                disks.push(DiskQueues { disk, queues });
            }
        }
        Ok(QueueMap { disks })
    }

    /// For each submitting vCPU, the vCPUs its requests complete on, over every disk.
    pub fn completion_cpus(&self) -> BTreeMap<usize, BTreeSet<usize>> {
        let mut map: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
        for q in self.disks.iter().flat_map(|d| &d.queues) {
            for &c in &q.submit_cpus {
                let on = map.entry(c).or_default();
                on.extend(&q.completion_cpus);
                if q.on_submitter {
                    on.insert(c);
                }
            }
        }
        map
    }
}

/// Handler name → the vCPUs its interrupt is delivered to.
fn irq_handlers(irq_dir: &Path) -> Result<HashMap<String, Vec<usize>>> {
    let mut out = HashMap::new();
    let Ok(entries) = std::fs::read_dir(irq_dir) else {
        return Ok(out);
    };
    for e in entries.flatten() {
        if e.file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
            .is_none()
        {
            continue;
        }
        let list = e.path().join("effective_affinity_list");
        // A handler's name is a subdirectory of its irq's directory.
        for h in std::fs::read_dir(e.path()).into_iter().flatten().flatten() {
            if !h.path().is_dir() {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&list) else {
                continue;
            };
            let cpus = os_layer::parse_cpu_list(&text)
                .with_context(|| format!("parsing {}", list.display()))?;
            out.insert(h.file_name().to_string_lossy().into_owned(), cpus);
        }
    }
    Ok(out)
}

/// A disk's hardware queues with their interrupts; `None` where it has no blk-mq queues or
/// no capacity (a loop device with nothing attached takes no request), or its interrupts
/// cannot be named and its completions are not forced onto the submitter.
fn disk_queues(dir: &Path, handlers: &HashMap<String, Vec<usize>>) -> Result<Option<Vec<HwQueue>>> {
    let mq = dir.join("mq");
    let Ok(entries) = std::fs::read_dir(&mq) else {
        return Ok(None);
    };
    if std::fs::read_to_string(dir.join("size")).is_ok_and(|s| s.trim() == "0") {
        return Ok(None);
    }
    let on_submitter =
        std::fs::read_to_string(dir.join("queue/rq_affinity")).is_ok_and(|s| s.trim() == "2");
    // Virtual disks (loop) have no device and no interrupt.
    let device = std::fs::canonicalize(dir.join("device"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    let mut queues = Vec::new();
    for e in entries.flatten() {
        let Some(index) = e.file_name().to_str().and_then(|s| s.parse::<usize>().ok()) else {
            continue;
        };
        let list = e.path().join("cpu_list");
        let text = std::fs::read_to_string(&list)
            .with_context(|| format!("reading {}", list.display()))?;
        let submit_cpus = os_layer::parse_cpu_list(&text.replace(' ', ""))
            .with_context(|| format!("parsing {}", list.display()))?;
        // virtio-blk names its vectors `virtioK-req.Q`; NVMe `nvmeXqN` with the admin
        // queue at 0, so I/O queue Q is N = Q + 1.
        let irq = device.as_ref().and_then(|device| {
            [
                format!("{device}-req.{index}"),
                format!("{device}q{}", index + 1),
            ]
            .iter()
            .find_map(|n| handlers.get(n))
        });
        if irq.is_none() && !on_submitter {
            return Ok(None);
        }
        queues.push(HwQueue {
            index,
            submit_cpus,
            completion_cpus: irq.cloned().unwrap_or_default(),
            on_submitter,
        });
    }
    queues.sort_by_key(|q| q.index);
    Ok((!queues.is_empty()).then_some(queues))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    /// A disk `vda` on `virtio1` with `queues` (index, submit list, interrupt CPUs), and
    /// `zram0` with no queue interrupts.
    fn tree(base: &Path, queues: &[(usize, &str, &str)]) -> Root {
        let sys = base.join("sys");
        let dev = sys.join("devices/pci0000:00/0000:00:02.0/virtio1");
        let disk = dev.join("block/vda");
        fs::create_dir_all(&disk).unwrap();
        symlink(&dev, disk.join("device")).unwrap();
        fs::create_dir_all(sys.join("block")).unwrap();
        symlink(&disk, sys.join("block/vda")).unwrap();
        fs::create_dir_all(sys.join("block/zram0")).unwrap();
        for (i, (q, submit, irq_cpus)) in queues.iter().enumerate() {
            fs::create_dir_all(disk.join(format!("mq/{q}"))).unwrap();
            fs::write(disk.join(format!("mq/{q}/cpu_list")), format!("{submit}\n")).unwrap();
            let irq = base.join(format!("proc/irq/{}", 30 + i));
            fs::create_dir_all(irq.join(format!("virtio1-req.{q}"))).unwrap();
            fs::write(irq.join("effective_affinity_list"), format!("{irq_cpus}\n")).unwrap();
        }
        let other = base.join("proc/irq/29/virtio1-config");
        fs::create_dir_all(&other).unwrap();
        fs::write(base.join("proc/irq/29/effective_affinity_list"), "0\n").unwrap();
        Root::at(base)
    }

    #[test]
    fn one_queue_completes_every_vcpus_requests_on_its_interrupt_vcpu() {
        let t = tempfile::tempdir().unwrap();
        let m = QueueMap::read(&tree(t.path(), &[(0, "0, 1", "1")])).unwrap();
        assert_eq!(m.disks.len(), 1, "zram0 has no queue interrupts: left out");
        let c = m.completion_cpus();
        assert_eq!(c[&0], BTreeSet::from([1]));
        assert_eq!(c[&1], BTreeSet::from([1]));
    }

    /// A loop device `loop0` (no device, no interrupt) of `sectors`, one queue for
    /// `submit`, with `rq_affinity`.
    fn add_loop(base: &Path, submit: &str, rq_affinity: &str, sectors: &str) {
        let dir = base.join("sys/devices/virtual/block/loop0");
        fs::create_dir_all(dir.join("mq/0")).unwrap();
        fs::create_dir_all(dir.join("queue")).unwrap();
        fs::write(dir.join("mq/0/cpu_list"), format!("{submit}\n")).unwrap();
        fs::write(dir.join("queue/rq_affinity"), format!("{rq_affinity}\n")).unwrap();
        fs::write(dir.join("size"), format!("{sectors}\n")).unwrap();
        symlink(&dir, base.join("sys/block/loop0")).unwrap();
    }

    #[test]
    fn a_queue_per_vcpu_or_one_forced_onto_the_submitter_completes_where_submitted() {
        let (per_vcpu, forced) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let roots = [
            (
                tree(per_vcpu.path(), &[(0, "0", "0"), (1, "1", "1")]),
                "vda",
            ),
            (tree(forced.path(), &[]), "loop0"),
        ];
        add_loop(forced.path(), "0, 1", "2", "131072");
        for (root, disk) in roots {
            let m = QueueMap::read(&root).unwrap();
            assert_eq!(m.disks.len(), 1, "{m:?}");
            assert_eq!(m.disks[0].disk, disk);
            let c = m.completion_cpus();
            assert_eq!(c[&0], BTreeSet::from([0]), "{disk}");
            assert_eq!(c[&1], BTreeSet::from([1]), "{disk}");
        }
    }

    #[test]
    fn forced_completions_after_one_interrupt_need_both_vcpus() {
        let t = tempfile::tempdir().unwrap();
        let root = tree(t.path(), &[(0, "0, 1", "1")]);
        fs::create_dir_all(t.path().join("sys/block/vda/queue")).unwrap();
        fs::write(t.path().join("sys/block/vda/queue/rq_affinity"), "2\n").unwrap();
        let c = QueueMap::read(&root).unwrap().completion_cpus();
        assert_eq!(c[&0], BTreeSet::from([0, 1]));
        assert_eq!(c[&1], BTreeSet::from([1]));
    }

    #[test]
    fn loop_devices_that_complete_anywhere_or_take_nothing_are_left_out() {
        // Left to its worker (rq_affinity 1), or detached (no capacity: it keeps its queue
        // settings but takes no request).
        for (rq_affinity, sectors) in [("1", "131072"), ("2", "0")] {
            let t = tempfile::tempdir().unwrap();
            let root = tree(t.path(), &[(0, "0, 1", "1")]);
            add_loop(t.path(), "0, 1", rq_affinity, sectors);
            let m = QueueMap::read(&root).unwrap();
            assert_eq!(
                m.disks.len(),
                1,
                "rq_affinity {rq_affinity}, size {sectors}: {m:?}"
            );
            assert_eq!(m.disks[0].disk, "vda");
        }
    }

    #[test]
    fn a_disk_whose_interrupts_cannot_be_named_is_left_out() {
        let t = tempfile::tempdir().unwrap();
        let root = tree(t.path(), &[(0, "0,1", "1")]);
        fs::remove_dir_all(t.path().join("proc/irq/30")).unwrap();
        assert_eq!(QueueMap::read(&root).unwrap(), QueueMap::default());
    }
}
