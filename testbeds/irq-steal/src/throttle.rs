//! `kernel.perf_cpu_time_max_percent` for the time of a run: perf throttles sampling
//! events whose handlers run long, which the stealing program's spins do by design, so a
//! run sets it to 0 (no throttling) and must give the old value back however it ends.
//!
//! Owns the sysctl's save/restore, the one-run-at-a-time lock and the watchdog process.
//! Must never leave the sysctl at 0 after the run: restored on drop; if the controlling
//! process dies without dropping (SIGKILL), a watchdog process restores it when the pipe
//! from its parent closes. The lock (shared with the watchdog) keeps a next run from
//! saving the 0 that a dead run's watchdog has not yet restored.

use anyhow::{anyhow, bail, Context, Result};
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const PERF_CPU_TIME_MAX_PERCENT: &str = "/proc/sys/kernel/perf_cpu_time_max_percent";
/// One hard-IRQ stealing run at a time on the machine: two would fight over the sysctl and
/// over the CPUs.
pub const LOCK_PATH: &str = "/run/irq-steal.lock";
/// How long a start waits for a previous run (or its watchdog) to let go of the lock.
const LOCK_WAIT: Duration = Duration::from_secs(3);

/// Reads the sysctl's current value (trimmed).
pub fn read_perf_cpu_time_max_percent() -> Result<String> {
    Ok(std::fs::read_to_string(PERF_CPU_TIME_MAX_PERCENT)
        .with_context(|| format!("reading {PERF_CPU_TIME_MAX_PERCENT}"))?
        .trim()
        .to_string())
}

fn write(path: &str, value: &str) -> Result<()> {
    std::fs::write(path, format!("{value}\n")).with_context(|| format!("writing {value} to {path}"))
}

fn lock(path: &Path) -> Result<File> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening the lock {}", path.display()))?;
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(file);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(anyhow!(e).context(format!("locking {}", path.display())));
        }
        if Instant::now() > deadline {
            bail!(
                "another irq-steal run holds {} (or its watchdog is still restoring \
                 {PERF_CPU_TIME_MAX_PERCENT}): one run at a time",
                path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Perf throttling off until dropped.
pub struct ThrottleOff {
    old: String,
    watchdog: Option<Child>,
    _lock: File,
}

impl ThrottleOff {
    pub fn new() -> Result<ThrottleOff> {
        let lock = lock(Path::new(LOCK_PATH))?;
        let old = read_perf_cpu_time_max_percent()?;
        // The shell ignores the terminal's signals (its own process group, traps) and
        // restores unless told "done": EOF on stdin means the parent died. Its stdout is the
        // lock file's open description, so the lock lives until the shell has finished.
        let watchdog = Command::new("/bin/sh")
            .arg("-c")
            .arg(format!(
                "trap '' INT TERM HUP; read line; [ \"$line\" = done ] || \
                 printf '%s\\n' \"$0\" > {PERF_CPU_TIME_MAX_PERCENT}"
            ))
            .arg(&old)
            .stdin(Stdio::piped())
            .stdout(Stdio::from(lock.try_clone().context("sharing the lock")?))
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting the sysctl watchdog (/bin/sh)")?;
        let guard = ThrottleOff {
            old,
            watchdog: Some(watchdog),
            _lock: lock,
        };
        // A failed write drops the guard, which restores.
        write(PERF_CPU_TIME_MAX_PERCENT, "0")?;
        Ok(guard)
    }

    /// The value restored at the end.
    pub fn old_value(&self) -> &str {
        &self.old
    }

    /// Restores the old value and retires the watchdog.
    pub fn restore(mut self) -> Result<()> {
        self.restore_inner()
    }

    fn restore_inner(&mut self) -> Result<()> {
        let Some(mut child) = self.watchdog.take() else {
            return Ok(());
        };
        let restored = write(PERF_CPU_TIME_MAX_PERCENT, &self.old);
        if restored.is_ok() {
            if let Some(mut stdin) = child.stdin.take() {
                let _ = stdin.write_all(b"done\n");
            }
        }
        // Without "done" (the write failed) the watchdog tries the restore itself.
        drop(child.stdin.take());
        let _ = child.wait();
        restored
    }
}

impl Drop for ThrottleOff {
    fn drop(&mut self) {
        if let Err(e) = self.restore_inner() {
            eprintln!("irq-steal: restoring {PERF_CPU_TIME_MAX_PERCENT}: {e:#}");
        }
    }
}
