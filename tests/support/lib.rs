//! Shared pieces of the real-kernel integration tests and the benchmarks: the root gate
//! and the workloads (O_DIRECT reader, CPU hog) that stand in for a guest's tasks.
//! Nothing here may pretend to be the kernel: workloads do real I/O and burn real CPU.

pub mod host;
pub mod workload;

use std::path::PathBuf;

/// True when running as root. Tests that need the real kernel's privileged paths call
/// this first and, when it is false, print a loud line and return: a skip must never look
/// like a pass in the log.
pub fn require_root(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    // Straight to fd 2: the test harness captures eprintln! of passing tests, and a skip
    // must be visible.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "\n******** SKIPPED {test}: needs root (BPF, SCHED_FIFO, sched_setaffinity on other \
         tasks). Run the test suite as root; CI does. ********\n"
    );
    false
}

/// Path of a workspace binary built into the same target profile directory as the running
/// test or bench executable (`target/<profile>/deps/..` → `target/<profile>/NAME`).
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
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
