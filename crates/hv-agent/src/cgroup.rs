//! vCPU-thread share through the cgroup `cpu` controller instead of nice.
//! - A thread that already has a cgroup of its own (libvirt's `vcpuN` layout; any
//!   cgroup whose only task is this thread) gets that group's `cpu.shares` (v1) or
//!   `cpu.weight` (v2) scaled in place; the original value is restored at exit.
//! - Otherwise, on v1, the agent gives the thread a child group of the one it is in,
//!   `vmigrater-vcpu-<tid>`, and at exit moves it back and removes the group. v2 allows
//!   moving single threads only inside threaded subtrees, so there this is an error that
//!   says to use per-vCPU cgroups or `weight = "nice"`.
//!
//! A setting's weight factor scales the thread's weight, so the total per host CPU stays
//! where the plan put it (whole nice steps only approach that; see `weights::exchange_weights`).

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tracing::{debug, warn};

#[derive(Clone, Debug, PartialEq)]
pub enum Hierarchy {
    /// Mount point of the v1 hierarchy that has the `cpu` controller.
    V1(PathBuf),
    /// The unified v2 mount.
    V2(PathBuf),
}

impl Hierarchy {
    pub fn detect() -> Option<Hierarchy> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        Self::from_mountinfo(&mountinfo)
    }

    /// v1's `cpu` hierarchy when mounted, else the v2 mount.
    fn from_mountinfo(mountinfo: &str) -> Option<Hierarchy> {
        let mut v2 = None;
        for line in mountinfo.lines() {
            let (left, right) = line.split_once(" - ")?;
            let mount_point = left.split_whitespace().nth(4)?;
            let mut r = right.split_whitespace();
            let (fstype, _source, options) = (r.next()?, r.next()?, r.next().unwrap_or(""));
            match fstype {
                "cgroup" if options.split(',').any(|o| o == "cpu") => {
                    return Some(Hierarchy::V1(mount_point.into()))
                }
                "cgroup2" => v2 = Some(Hierarchy::V2(mount_point.into())),
                _ => {}
            }
        }
        v2
    }

    fn weight_file(&self) -> &'static str {
        match self {
            Hierarchy::V1(_) => "cpu.shares",
            Hierarchy::V2(_) => "cpu.weight",
        }
    }

    fn default_weight(&self) -> u64 {
        match self {
            Hierarchy::V1(_) => 1024,
            Hierarchy::V2(_) => 100,
        }
    }

    fn bounds(&self) -> (u64, u64) {
        match self {
            Hierarchy::V1(_) => (2, 262_144),
            Hierarchy::V2(_) => (1, 10_000),
        }
    }

    /// The directory of `tid`'s group in this hierarchy.
    fn group_of(&self, tid: u32) -> Result<PathBuf> {
        let text = std::fs::read_to_string(format!("/proc/{tid}/cgroup"))
            .with_context(|| format!("reading /proc/{tid}/cgroup"))?;
        let rel = text.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_id, controllers, path) = (f.next()?, f.next()?, f.next()?);
            let wanted = match self {
                Hierarchy::V1(_) => controllers.split(',').any(|c| c == "cpu"),
                Hierarchy::V2(_) => controllers.is_empty(),
            };
            wanted.then(|| path.to_string())
        });
        let rel = rel.with_context(|| format!("thread {tid} is in no cpu cgroup"))?;
        let (Hierarchy::V1(root) | Hierarchy::V2(root)) = self;
        Ok(root.join(rel.trim_start_matches('/')))
    }

    fn members(&self, group: &Path) -> Vec<u32> {
        let file = match self {
            Hierarchy::V1(_) => "tasks",
            Hierarchy::V2(_) => "cgroup.threads",
        };
        std::fs::read_to_string(group.join(file))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

/// `base × factor`, within the hierarchy's bounds.
pub fn scaled(base: u64, factor: f64, bounds: (u64, u64)) -> u64 {
    ((base as f64) * factor)
        .round()
        .clamp(bounds.0 as f64, bounds.1 as f64) as u64
}

/// What undoes the agent's change to one thread's cgroup weight.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Touched {
    InPlace { group: PathBuf, original: u64 },
    Child { group: PathBuf, parent: PathBuf },
}

pub struct CgroupWeights {
    hierarchy: Hierarchy,
    touched: HashMap<u32, Touched>,
    applied: HashMap<u32, u64>,
}

fn write(path: &Path, value: impl ToString) -> Result<()> {
    std::fs::write(path, value.to_string()).with_context(|| format!("writing {}", path.display()))
}

fn read_u64(path: &Path) -> Result<u64> {
    let t = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    t.trim()
        .parse()
        .with_context(|| format!("{}: not a number: {:?}", path.display(), t.trim()))
}

impl CgroupWeights {
    pub fn new() -> Result<CgroupWeights> {
        let hierarchy = Hierarchy::detect().context("no cgroup cpu controller is mounted")?;
        Ok(CgroupWeights {
            hierarchy,
            touched: HashMap::new(),
            applied: HashMap::new(),
        })
    }

    pub fn hierarchy(&self) -> &Hierarchy {
        &self.hierarchy
    }

    /// The group whose weight file now carries `tid`'s share.
    pub fn group(&self, tid: u32) -> Option<&Path> {
        self.touched.get(&tid).map(|t| match t {
            Touched::InPlace { group, .. } | Touched::Child { group, .. } => group.as_path(),
        })
    }

    /// Where `tid`'s weight will live; reads only, so the caller can journal the undo
    /// before anything changes.
    fn prepare(&self, tid: u32) -> Result<Touched> {
        let h = &self.hierarchy;
        let group = h.group_of(tid)?;
        let (Hierarchy::V1(root) | Hierarchy::V2(root)) = h;
        if group != *root && h.members(&group) == [tid] {
            let original = read_u64(&group.join(h.weight_file()))?;
            return Ok(Touched::InPlace { group, original });
        }
        if let Hierarchy::V2(_) = h {
            bail!(
                "cgroup v2: vCPU thread {tid} shares {} with other threads; give each vCPU \
                 thread its own cgroup (libvirt does) or set weight = \"nice\"",
                group.display()
            );
        }
        Ok(Touched::Child {
            group: group.join(format!("vmigrater-vcpu-{tid}")),
            parent: group,
        })
    }

    fn enter(&self, tid: u32, t: &Touched) -> Result<()> {
        let Touched::Child { group, .. } = t else {
            return Ok(());
        };
        match std::fs::create_dir(group) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("creating {}", group.display())),
        }
        write(&group.join("tasks"), tid)?;
        debug!(tid, group = %group.display(), "vCPU thread moved to its own cgroup");
        Ok(())
    }

    /// Gives `tid` its original weight times `factor`. Returns whether a file was written.
    /// `first_touch` sees the undo of a thread's first change before it is made.
    pub fn set(
        &mut self,
        tid: u32,
        factor: f64,
        first_touch: impl FnOnce(&Touched) -> Result<()>,
    ) -> Result<bool> {
        let touched = match self.touched.get(&tid) {
            Some(t) => t.clone(),
            None => {
                let t = self.prepare(tid)?;
                first_touch(&t)?;
                self.enter(tid, &t)?;
                self.touched.insert(tid, t.clone());
                t
            }
        };
        let (group, base) = match &touched {
            Touched::InPlace { group, original } => (group, *original),
            Touched::Child { group, .. } => (group, self.hierarchy.default_weight()),
        };
        let value = scaled(base, factor, self.hierarchy.bounds());
        if self.applied.get(&tid) == Some(&value) {
            return Ok(false);
        }
        write(&group.join(self.hierarchy.weight_file()), value)?;
        self.applied.insert(tid, value);
        Ok(true)
    }

    /// Forgets a thread that exited (its child group, if any, is removed).
    pub fn forget(&mut self, tid: u32) {
        if let Some(t) = self.touched.remove(&tid) {
            self.undo(tid, t);
        }
        self.applied.remove(&tid);
    }

    fn undo(&self, tid: u32, t: Touched) -> bool {
        undo(&self.hierarchy, tid, t)
    }

    /// Puts every thread back where it was; returns how many were restored.
    pub fn restore(&mut self) -> usize {
        self.applied.clear();
        std::mem::take(&mut self.touched)
            .into_iter()
            .filter(|(tid, t)| self.undo(*tid, t.clone()))
            .count()
    }
}

/// Puts one thread's cgroup weight back (also used by crash recovery).
pub fn undo(h: &Hierarchy, tid: u32, t: Touched) -> bool {
    match t {
        Touched::InPlace { group, original } => {
            match write(&group.join(h.weight_file()), original) {
                Ok(()) => true,
                Err(e) => {
                    warn!(tid, "could not restore the cgroup weight: {e:#}");
                    false
                }
            }
        }
        Touched::Child { group, parent } => {
            // A thread that already exited is simply not there to move back.
            let _ = write(&parent.join("tasks"), tid);
            match std::fs::remove_dir(&group) {
                Ok(()) => true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
                Err(e) => {
                    warn!(tid, group = %group.display(), "could not remove the cgroup: {e}");
                    false
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_cpu_hierarchy() {
        let v1 = "35 25 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:15 - cgroup cgroup rw,cpu,cpuacct\n\
                  36 25 0:31 / /sys/fs/cgroup/memory rw shared:16 - cgroup cgroup rw,memory\n";
        assert_eq!(
            Hierarchy::from_mountinfo(v1),
            Some(Hierarchy::V1("/sys/fs/cgroup/cpu,cpuacct".into()))
        );
        let v2 = "30 25 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            Hierarchy::from_mountinfo(v2),
            Some(Hierarchy::V2("/sys/fs/cgroup".into()))
        );
        assert_eq!(Hierarchy::from_mountinfo(""), None);
    }

    #[test]
    fn weights_scale_within_bounds() {
        assert_eq!(scaled(1024, 1.0, (2, 262_144)), 1024);
        assert_eq!(scaled(1024, 1.25f64.powi(-3), (2, 262_144)), 524);
        assert_eq!(scaled(1024, 1.25f64.powi(3), (2, 262_144)), 2000);
        assert_eq!(scaled(100, 1e-3, (1, 10_000)), 1);
        assert_eq!(scaled(10_000, 3.0, (1, 10_000)), 10_000);
    }
}
