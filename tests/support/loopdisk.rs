//! A disk whose requests complete on the CPU that submitted them, on a machine whose only
//! disk has one interrupt: a loop device over a file in memory (tmpfs), its queue set to
//! `rq_affinity = 2`. The block layer then completes every request on its submitter's
//! CPU (an IPI to it when the loop worker finished elsewhere, `blk_mq_complete_need_ipi`
//! with `QUEUE_FLAG_SAME_FORCE`), and a CPU that `irq-steal` holds takes no IPI until its
//! window ends: while the submitter's vCPU is out, its completion waits, as on a disk with
//! a queue per vCPU. Nothing here involves the root disk's interrupt.
//!
//! The loop device serves its requests in a kernel worker of an unbound workqueue, and by
//! default (`workqueue.default_affinity_scope = cache`, one pod for this machine's shared
//! cache) that worker may run on the other vCPU: a request would then need that vCPU too,
//! and a reader kept on one vCPU loses a window per request (measured: 155–794 IOPS
//! against 5–24k for readers moved with the plan). With the scope set to `cpu` a request
//! is served on the vCPU that submitted it: it needs that vCPU alone, as on a disk whose
//! queue belongs to the submitter (the service time is the worker's copy, ~20 µs, on that
//! vCPU instead of a device's). The scope is set back on drop.
//!
//! Root only (losetup, sysfs). The device and its file are removed on drop.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// What `rq_affinity` must read for completions to follow their submitter.
pub const FORCE_SUBMITTER: &str = "2";
/// Where unbound workqueues (the loop worker's) take their default affinity scope.
const WQ_SCOPE: &str = "/sys/module/workqueue/parameters/default_affinity_scope";

/// A loop device over a tmpfs file, completing on the submitting CPU.
pub struct LoopDisk {
    /// `/dev/loopN`.
    pub device: PathBuf,
    /// `loopN`.
    pub name: String,
    backing: PathBuf,
    /// The workqueue scope before ours, set back on drop.
    scope_before: Option<String>,
    /// The queue's `rq_affinity` before ours: a loop device keeps it once detached.
    rq_affinity_before: Option<String>,
}

impl LoopDisk {
    /// Fills `backing` (on a tmpfs) with `size` bytes, attaches a loop device to it and
    /// forces completions onto the submitting CPU.
    pub fn create(backing: &Path, size: u64) -> Result<LoopDisk> {
        crate::workload::prepare_file(backing, size)?;
        let out = Command::new("losetup")
            .args(["--find", "--show", "--direct-io=off"])
            .arg(backing)
            .output()
            .context("running losetup (util-linux)");
        if !out.as_ref().is_ok_and(|o| o.status.success()) {
            // Nothing attached: the file in memory is all there is to undo.
            let _ = std::fs::remove_file(backing);
        }
        let out = out?;
        anyhow::ensure!(
            out.status.success(),
            "losetup --find --show {}: {}",
            backing.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let device = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let name = device
            .file_name()
            .and_then(|n| n.to_str())
            .with_context(|| format!("losetup printed {device:?}"))?
            .to_string();
        // From here on, drop undoes what was done.
        let mut disk = LoopDisk {
            device,
            name,
            backing: backing.to_path_buf(),
            scope_before: None,
            rq_affinity_before: None,
        };
        let scope = std::fs::read_to_string(WQ_SCOPE)
            .with_context(|| format!("reading {WQ_SCOPE}"))?
            .trim()
            .to_string();
        std::fs::write(WQ_SCOPE, "cpu").with_context(|| format!("writing cpu to {WQ_SCOPE}"))?;
        disk.scope_before = Some(scope);
        let knob = disk.sysfs("queue/rq_affinity");
        disk.rq_affinity_before = Some(std::fs::read_to_string(&knob)?.trim().to_string());
        std::fs::write(&knob, FORCE_SUBMITTER)
            .with_context(|| format!("writing {FORCE_SUBMITTER} to {}", knob.display()))?;
        let read = std::fs::read_to_string(&knob)?;
        anyhow::ensure!(
            read.trim() == FORCE_SUBMITTER,
            "{} reads {:?} after writing {FORCE_SUBMITTER}",
            knob.display(),
            read.trim()
        );
        Ok(disk)
    }

    fn sysfs(&self, rel: &str) -> PathBuf {
        Path::new("/sys/block").join(&self.name).join(rel)
    }

    /// What the benchmark records of the construction.
    pub fn describe(&self) -> serde_json::Value {
        let read = |rel: &str| {
            std::fs::read_to_string(self.sysfs(rel))
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        serde_json::json!({
            "device": self.device,
            "backing": self.backing,
            "rq_affinity": read("queue/rq_affinity"),
            "scheduler": read("queue/scheduler"),
            "hw_queues": std::fs::read_dir(self.sysfs("mq")).map(|d| d.count()).unwrap_or(0),
            "completes_on": "the submitting CPU (rq_affinity = 2)",
            "workqueue_scope": std::fs::read_to_string(WQ_SCOPE).map(|s| s.trim().to_string()).unwrap_or_default(),
        })
    }
}

impl Drop for LoopDisk {
    fn drop(&mut self) {
        if let Some(v) = &self.rq_affinity_before {
            let _ = std::fs::write(self.sysfs("queue/rq_affinity"), v);
        }
        let detached = Command::new("losetup")
            .arg("-d")
            .arg(&self.device)
            .status()
            .is_ok_and(|s| s.success());
        if !detached {
            eprintln!("WARNING: could not detach {}", self.device.display());
        }
        let _ = std::fs::remove_file(&self.backing);
        if let Some(scope) = &self.scope_before {
            if let Err(e) = std::fs::write(WQ_SCOPE, scope) {
                eprintln!("WARNING: could not set {WQ_SCOPE} back to {scope}: {e}");
            }
        }
    }
}
