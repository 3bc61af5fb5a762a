//! Shared pieces of the real-kernel integration tests and the benchmarks: the root gate,
//! the workloads (O_DIRECT reader, CPU hog) that stand in for a guest's tasks, where a
//! disk completes its requests, and the benchmarks' statistics.
//! Nothing here may pretend to be the kernel: workloads do real I/O and burn real CPU.

pub mod apps;
pub mod backoff;
pub mod completion;
pub mod daemon;
pub mod governor;
pub mod host;
pub mod loopdisk;
pub mod oracle;
pub mod placement;
pub mod report;
pub mod seeds;
pub mod signals;
pub mod stats;
pub mod workload;

use std::path::PathBuf;

/// Draws `json` into `png` with `benches/<script>`; a missing chart is a warning, never
/// an error: the numbers printed and written stand without it.
pub fn plot(script: &str, json: &std::path::Path, png: &std::path::Path) {
    let plot = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("benches")
        .join(script);
    match std::process::Command::new("/usr/bin/python3")
        .arg(&plot)
        .arg(json)
        .arg(png)
        .status()
    {
        Ok(st) if st.success() => println!("wrote {}", png.display()),
        other => eprintln!(
            "WARNING: no chart ({other:?}); the numbers above stand. Install python3-matplotlib for {}",
            png.display()
        ),
    }
}

/// The CPUs online, not this process's mask: the daemon may keep a benchmark's own process
/// on one CPU while it starts a server or plans a schedule (`available_parallelism()` then
/// says 1: a server was once started pinned to CPU 0, out of the daemon's reach).
pub fn ncpus() -> usize {
    nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
        .ok()
        .flatten()
        .map_or(1, |n| n.max(1) as usize)
}

/// True when running as root; otherwise prints a loud line. For the benchmarks, which
/// have no harness to report a skip: a skip must never look like a result in the log.
pub fn require_root(what: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    // Straight to fd 2: nothing in between may swallow it.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "\n******** SKIPPED {what}: needs root (BPF, SCHED_FIFO, sched_setaffinity on other \
         tasks). Run it as root; CI does. ********\n"
    );
    false
}

/// First line of every root-only test. Such a test also carries
/// `#[cfg_attr(not(vmigrater_root), ignore = "needs root")]`, so a build by another user
/// reports it as ignored (cargo's summary counts it, CI's "skipped" column too) instead of
/// passing it; `build.rs` sets `vmigrater_root` when the build runs as root. This catches
/// the rest: a binary built as root but run by another user, or `--ignored`.
pub fn assert_root() {
    let uid = nix::unistd::geteuid();
    assert!(
        uid.is_root(),
        "needs root (BPF, SCHED_FIFO, sched_setaffinity on other tasks), running as uid \
         {uid}: run the test suite as root; CI does"
    );
}

/// Tests that move a task between CPUs need this many online; a machine with fewer fails
/// them rather than passing them unseen.
pub fn assert_cpus(n: usize) {
    use nix::unistd::{sysconf, SysconfVar};
    let have = sysconf(SysconfVar::_NPROCESSORS_ONLN)
        .ok()
        .flatten()
        .unwrap_or(1) as usize;
    assert!(have >= n, "needs {n} online CPUs, this machine has {have}");
}

/// Path of a workspace binary built into the same target profile directory as the running
/// test or bench executable (`target/<profile>/deps/..` → `target/<profile>/NAME`).
///
/// `VMIGRATER_TEST_BIN_DIR` points the tests at binaries elsewhere: an older build, to see
/// that a new test fails on the code it was written against.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    if let Some(d) = std::env::var_os("VMIGRATER_TEST_BIN_DIR") {
        dir = PathBuf::from(d);
    }
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not found: build the workspace binaries first (`cargo build --workspace --bins`, \
         or `make test`, which does)",
        path.display()
    );
    path
}

/// Where the benchmarks keep their data file and write their results: `target/bench`,
/// or `$VMIGRATER_BENCH_DIR` (the CI smoke runs write elsewhere, so that they never
/// replace a real measurement).
pub fn bench_dir() -> PathBuf {
    std::env::var_os("VMIGRATER_BENCH_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench"),
        PathBuf::from,
    )
}

/// Each CPU's steal time so far as this machine's own hypervisor reports it
/// (`/proc/stat`, in 10 ms ticks), ns: deschedules nobody in a test planned.
pub fn host_steal_ns(cpus: &[usize]) -> Vec<u64> {
    let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
    cpus.iter()
        .map(|c| {
            let line = stat
                .lines()
                .find(|l| l.split_whitespace().next() == Some(&format!("cpu{c}")))
                .expect("cpu line");
            let ticks: u64 = line
                .split_whitespace()
                .nth(8)
                .and_then(|f| f.parse().ok())
                .unwrap_or(0);
            ticks * 10_000_000
        })
        .collect()
}

/// The build under test, as `git describe` names it (`-dirty` when the tree has changes):
/// recorded in every results file, so that a table says which code it measured.
pub fn commit() -> String {
    git(&["describe", "--always", "--dirty", "--abbrev=12"])
}

/// `git ARGS` in this tree, its output trimmed, or "unknown".
fn git(args: &[&str]) -> String {
    std::process::Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// The commit a daemon binary was built from, as its `--version` says (`vmigrater 0.1.0
/// (commit 0123456789ab)`), or why it is not known.
pub fn daemon_build(bin: &std::path::Path) -> String {
    let out = match std::process::Command::new(bin).arg("--version").output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).to_string(),
        Ok(o) => return format!("unknown: {} --version exited {}", bin.display(), o.status),
        Err(e) => return format!("unknown: {}: {e}", bin.display()),
    };
    out.split_once("(commit ")
        .and_then(|(_, rest)| rest.split([')', ';']).next())
        .map_or_else(
            || format!("unknown: {}", out.trim()),
            |c| c.trim().to_string(),
        )
}

/// The commit this tree's HEAD names (without `-dirty`: compare with `daemon_build`).
pub fn head_commit() -> String {
    git(&["rev-parse", "--short=12", "HEAD"])
}

/// The calling thread's kernel thread id.
pub fn gettid() -> u32 {
    nix::unistd::gettid().as_raw() as u32
}

/// A small tmpfs mounted over a directory, so a test can fill it up or make it read-only
/// under a running daemon (root). Unmounted on drop.
pub struct Tmpfs {
    pub path: PathBuf,
    filler: PathBuf,
}

impl Tmpfs {
    pub fn mount(path: &std::path::Path, size_kb: u64) -> Tmpfs {
        std::fs::create_dir_all(path).expect("mount point");
        run_mount(&[
            "-t",
            "tmpfs",
            "-o",
            &format!("size={size_kb}k"),
            "tmpfs",
            path.to_str().expect("utf-8 path"),
        ]);
        Tmpfs {
            path: path.to_path_buf(),
            filler: path.join("filler"),
        }
    }

    /// Writes until the kernel says ENOSPC: the file system is full afterwards.
    pub fn fill(&self) {
        use std::io::Write;
        let mut f = std::fs::File::create(&self.filler).expect("filler");
        let block = vec![0u8; 4096];
        loop {
            match f.write_all(&block).and_then(|_| f.sync_all()) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("filling {}: {e}", self.path.display()),
            }
        }
    }

    pub fn make_room(&self) {
        std::fs::remove_file(&self.filler).expect("remove filler");
    }

    pub fn read_only(&self, ro: bool) {
        let opt = if ro { "remount,ro" } else { "remount,rw" };
        run_mount(&["-o", opt, self.path.to_str().expect("utf-8 path")]);
    }
}

fn run_mount(args: &[&str]) {
    let out = std::process::Command::new("mount")
        .args(args)
        .output()
        .expect("run mount");
    assert!(
        out.status.success(),
        "mount {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.path)
            .status();
    }
}

/// A child process that is killed and reaped when dropped, so a test that panics between
/// spawn and its own kill leaves nothing running (a reader left behind once held a pipe
/// and a CPU for twenty minutes).
pub struct Reaped(pub std::process::Child);

impl std::ops::Deref for Reaped {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// System-wide CPU time from /proc/stat, in seconds summed over all CPUs.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemCpu {
    pub total: f64,
    pub busy: f64,
    pub irq: f64,
    /// Time the hypervisor under this VM ran something else (the `steal` column).
    pub host_steal: f64,
}

impl SystemCpu {
    pub fn read() -> SystemCpu {
        let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        // SAFETY: sysconf has no preconditions.
        let ticks_per_s = (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64;
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        let f: Vec<f64> = text
            .lines()
            .next()
            .unwrap_or("")
            .split_whitespace()
            .skip(1)
            .take(8)
            .filter_map(|x| x.parse().ok())
            .collect();
        let at = |i: usize| f.get(i).copied().unwrap_or(0.0) / ticks_per_s;
        let total: f64 = (0..8).map(at).sum();
        SystemCpu {
            total,
            busy: total - at(3) - at(4) - at(7),
            irq: at(5) + at(6),
            host_steal: at(7),
        }
    }

    pub fn since(self, earlier: SystemCpu) -> SystemCpu {
        SystemCpu {
            total: self.total - earlier.total,
            busy: self.busy - earlier.busy,
            irq: self.irq - earlier.irq,
            host_steal: self.host_steal - earlier.host_steal,
        }
    }
}

/// On-CPU seconds of every live thread of a process, from schedstat (ns resolution).
pub fn process_cpu_s(pid: u32) -> f64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum::<u64>() as f64
        / 1e9
}
