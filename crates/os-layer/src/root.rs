//! Where /proc and /sys are. Every reader of either takes a `Root`: `Root::real()` in the
//! programs, `Root::at(dir)` over a fake tree (`dir/proc`, `dir/sys`) in tests. One way to
//! redirect both, passed explicitly (no environment variable a test must set and unset).

use std::io;
use std::path::{Path, PathBuf};

use crate::cpus::parse_cpu_list;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Root {
    base: PathBuf,
}

impl Root {
    /// The running kernel's /proc and /sys.
    pub fn real() -> Root {
        Root::at("/")
    }

    /// A tree with `proc/` and `sys/` under `dir`.
    pub fn at(dir: impl Into<PathBuf>) -> Root {
        Root { base: dir.into() }
    }

    pub fn proc(&self) -> PathBuf {
        self.base.join("proc")
    }

    pub fn sys(&self) -> PathBuf {
        self.base.join("sys")
    }

    /// `/proc/<tgid>/task/<tid>`.
    pub fn task(&self, tgid: u32, tid: u32) -> PathBuf {
        self.proc()
            .join(tgid.to_string())
            .join("task")
            .join(tid.to_string())
    }

    /// The online CPUs, `/sys/devices/system/cpu/online`; the error names the file.
    pub fn online_cpus(&self) -> io::Result<Vec<usize>> {
        let path = self.sys().join("devices/system/cpu/online");
        let text = std::fs::read_to_string(&path).map_err(|e| located(&path, e))?;
        parse_cpu_list(&text)
            .map_err(|e| located(&path, io::Error::new(io::ErrorKind::InvalidData, e)))
    }

    /// Writes a task's `stat` (and `schedstat`, `cpu_ns` on CPU) into a fake tree, the way
    /// the kernel lays them out; for tests.
    pub fn write_fake_task(
        &self,
        tgid: u32,
        tid: u32,
        comm: &str,
        flags: u64,
        start_time: u64,
        cpu_ns: u64,
    ) -> io::Result<()> {
        let dir = self.task(tgid, tid);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("stat"),
            crate::fake_stat_line(tid, comm, flags, start_time, 0),
        )?;
        std::fs::write(dir.join("schedstat"), format!("{cpu_ns} 1000 7\n"))
    }
}

pub(crate) fn located(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fake_root_holds_cpus_and_tasks() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::at(dir.path());
        let err = root.online_cpus().unwrap_err();
        assert!(
            err.to_string().contains("devices/system/cpu/online"),
            "{err}"
        );
        std::fs::create_dir_all(root.sys().join("devices/system/cpu")).unwrap();
        std::fs::write(root.sys().join("devices/system/cpu/online"), "0-2,4\n").unwrap();
        assert_eq!(root.online_cpus().unwrap(), vec![0, 1, 2, 4]);

        root.write_fake_task(7, 8, "a (b) c", 0, 99, 5).unwrap();
        let stat = crate::TaskStat::read(&root.task(7, 8).join("stat")).unwrap();
        assert_eq!((stat.comm.as_str(), stat.start_time), ("a (b) c", 99));
    }

    #[test]
    fn the_real_root_is_the_running_kernel() {
        let cpus = Root::real().online_cpus().unwrap();
        assert!(cpus.contains(&0));
        let me = std::process::id();
        assert!(Root::real().task(me, me).join("stat").exists());
    }
}
