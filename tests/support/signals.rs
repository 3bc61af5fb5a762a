//! What the signal and limit tests of both programs share: a command run with a deadline
//! and a memory ceiling (a program that reads `/dev/zero` whole must not take the test
//! machine down with it), the moment a daemon has blocked its signals, and the list of
//! signals a user, logrotate or a shell may send.

use nix::sys::signal::Signal;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Every signal a user, systemd, logrotate or a shell may send a daemon.
pub const OPERATOR_SIGNALS: [Signal; 7] = [
    Signal::SIGHUP,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGPIPE,
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGQUIT,
];

/// Whether the signal asks a daemon to stop (the others leave it running).
pub fn stops(sig: Signal) -> bool {
    matches!(sig, Signal::SIGINT | Signal::SIGTERM | Signal::SIGQUIT)
}

/// Runs `cmd` with at most 1 GiB of address space; panics unless it exits within `limit`.
/// Returns its status and its stdout followed by its stderr.
pub fn run_within(cmd: &mut Command, limit: Duration) -> (ExitStatus, String) {
    let out = tempfile::tempdir().expect("tempdir");
    let (o, e) = (out.path().join("stdout"), out.path().join("stderr"));
    // SAFETY: setrlimit is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 1 << 30,
                rlim_max: 1 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&o).unwrap())
        .stderr(std::fs::File::create(&e).unwrap())
        .spawn()
        .expect("spawn");
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{cmd:?} still running after {limit:?}:\n{}",
                std::fs::read_to_string(&e).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let text = std::fs::read_to_string(&o).unwrap_or_default()
        + &std::fs::read_to_string(&e).unwrap_or_default();
    (status, text)
}

/// Waits (up to 2 s) until process `pid` has blocked SIGTERM (its `main` has run its
/// first lines): from then on, the programs promise that no signal ends them without
/// their restore. Before that the process is only the loader and the runtime's start,
/// which touch nothing. Returns whether it did (a build that never blocks them is then
/// signalled all the same, and its test fails on what the signal does to it).
pub fn wait_signals_blocked(pid: u32) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return false;
        };
        let blocked = status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .unwrap_or(0);
        if blocked & (1 << (libc::SIGTERM - 1)) != 0 {
            return true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    false
}

/// A journal (`<state_dir>/journal.json`) such as a daemon killed with `tid` pinned to
/// `pinned` leaves: its original mask `original`.
pub fn journal_of_a_pinned_task(
    state_dir: &std::path::Path,
    tid: u32,
    original: &[usize],
    pinned: &[usize],
) {
    let stat = std::fs::read_to_string(format!("/proc/{tid}/stat")).expect("stat");
    // Field 22, counted after the parenthesised comm (which may hold spaces).
    let start_time: u64 = stat
        .rsplit_once(')')
        .expect("comm")
        .1
        .split_whitespace()
        .nth(19)
        .and_then(|f| f.parse().ok())
        .expect("start time");
    let entry = serde_json::json!({
        "tid": tid, "tgid": tid, "start_time": start_time,
        "original": original, "allowed": original, "last_set": pinned,
    });
    std::fs::write(
        state_dir.join("journal.json"),
        serde_json::to_vec(&serde_json::json!({"version": 1, "entries": [entry]})).unwrap(),
    )
    .expect("write journal");
}

/// `vmigrater run` with `config` in the private `state_dir`, its info log written to
/// `log`, no metrics endpoint; guarded.
pub fn spawn_daemon(
    config: &std::path::Path,
    state_dir: &std::path::Path,
    log: &std::path::Path,
) -> Guarded {
    Guarded(
        Command::new(crate::workspace_bin("vmigrater"))
            .arg("--config")
            .arg(config)
            .args(["--log", "info", "run", "--no-metrics", "--state-dir"])
            .arg(state_dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).expect("daemon log"))
            .spawn()
            .expect("spawn vmigrater"),
    )
}

/// A child that a failing test does not leave behind: dropped while it runs, it gets
/// SIGTERM (a daemon restores what it changed), then SIGKILL after 5 s.
pub struct Guarded(pub Child);

impl Guarded {
    pub fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.0.id() as i32),
                Signal::SIGTERM,
            );
            let t0 = Instant::now();
            while matches!(self.0.try_wait(), Ok(None)) && t0.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}
