//! The daemon under test in the benchmarks: the release `vmigrater run` with a given
//! configuration, in a private state directory (never /run/vmigrater), its info log (and
//! the classifier's reasons, at debug) kept there, no metrics endpoint. Stopped with
//! SIGTERM so it restores every mask, also when a benchmark fails half-way (drop) or is
//! killed (the parent-death signal).

use anyhow::{Context, Result};
use serde_json::Value;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::workspace_bin;

pub struct BenchDaemon {
    child: Child,
    state_dir: tempfile::TempDir,
    reaped: bool,
}

impl BenchDaemon {
    /// Starts the daemon with `config` (TOML text) and `extra` arguments after `run`, and
    /// returns once it answers on its status socket.
    pub fn start(config: &str, extra: &[&str]) -> Result<BenchDaemon> {
        ensure_fresh(&workspace_bin("vmigrater"))?;
        BenchDaemon::start_bin(&workspace_bin("vmigrater"), config, extra)
    }

    /// `start` with another build of the daemon (an A/B against this one's parent).
    pub fn start_bin(bin: &Path, config: &str, extra: &[&str]) -> Result<BenchDaemon> {
        let state_dir = tempfile::tempdir()?;
        let config_path = state_dir.path().join("vmigrater.toml");
        std::fs::write(&config_path, config)?;
        let log = std::fs::File::create(state_dir.path().join("daemon.log"))?;
        let mut cmd = Command::new(bin);
        // A benchmark killed half-way takes its daemon with it (SIGTERM: every mask restored),
        // so that the next "vanilla" run is not measured beside a daemon nobody stops. The
        // signal follows the thread that starts the daemon: the benchmarks' main thread.
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)?;
                Ok(())
            });
        }
        let child = cmd
            .arg("--config")
            .arg(&config_path)
            // The classifier says at debug why a task stopped being I/O-bound: one line
            // per such decision, kept with the others. VMIGRATER_BENCH_LOG replaces the
            // filter for a diagnostic run (`task_detector::classifier=trace`: every window).
            .args([
                "--log",
                &std::env::var("VMIGRATER_BENCH_LOG")
                    .unwrap_or_else(|_| "info,task_detector::classifier=debug".into()),
                "run",
                "--no-metrics",
                "--state-dir",
            ])
            .arg(state_dir.path())
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut d = BenchDaemon {
            child,
            state_dir,
            reaped: false,
        };
        let t0 = Instant::now();
        while d.status().is_none() {
            if let Some(st) = d.child.try_wait()? {
                d.reaped = true;
                anyhow::bail!("vmigrater exited at start with {st}: {}", d.log());
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(20),
                "vmigrater did not answer on its status socket within 20 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(d)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `vmigrater status --json`, or `None` while it does not answer.
    pub fn status(&self) -> Option<Value> {
        let out = Command::new(workspace_bin("vmigrater"))
            .args(["status", "--json", "--state-dir"])
            .arg(self.state_dir.path())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    /// `vmigrater explain --json [target]`, or `None` while it does not answer.
    pub fn explain(&self, target: Option<&str>) -> Option<Value> {
        let out = Command::new(workspace_bin("vmigrater"))
            .args(["explain", "--json", "--state-dir"])
            .arg(self.state_dir.path())
            .args(target)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    /// Its log so far (info: each decision is one line).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.state_dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// Stops it (every mask restored); returns its whole log.
    pub fn stop(mut self) -> Result<String> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        let st = self.child.wait()?;
        self.reaped = true;
        anyhow::ensure!(st.success(), "vmigrater exited with {st} after SIGTERM");
        Ok(self.log())
    }
}

impl Drop for BenchDaemon {
    fn drop(&mut self) {
        // An error path left the daemon running: stop it so it restores every mask. Never
        // signal a reaped pid (it may belong to someone else by now).
        if self.reaped {
            return;
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

/// Refuses a daemon binary older than the newest source of the workspace's crates, or
/// built from another commit: `cargo bench` builds the benchmark, not the binaries it
/// starts, so a forgotten `make build` would measure an old daemon under the new one's name.
fn ensure_fresh(bin: &std::path::Path) -> Result<()> {
    fn newest(
        dir: &std::path::Path,
        best: &mut Option<(std::time::SystemTime, std::path::PathBuf)>,
    ) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                newest(&path, best);
            } else if path
                .extension()
                .is_some_and(|x| x == "rs" || x == "c" || x == "h")
            {
                if let Ok(t) = e.metadata().and_then(|m| m.modified()) {
                    if best.as_ref().is_none_or(|(b, _)| t > *b) {
                        *best = Some((t, path));
                    }
                }
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut best = None;
    newest(&root.join("crates"), &mut best);
    newest(&root.join("bpf"), &mut best);
    let built = std::fs::metadata(bin)
        .and_then(|m| m.modified())
        .with_context(|| format!("{}", bin.display()))?;
    if let Some((t, path)) = best {
        anyhow::ensure!(
            built >= t,
            "{} is older than {}: build the workspace binaries first (`make build`, or \
             `cargo build --release --workspace --bins`)",
            bin.display(),
            path.display()
        );
    }
    // A time stamp can be refreshed by hand; the commit the binary names cannot.
    let (daemon, head) = (crate::daemon_build(bin), crate::head_commit());
    anyhow::ensure!(
        daemon == head || head == "unknown",
        "{} was built from commit {daemon}, this tree is at {head}: build the workspace \
         binaries first (`make build`)",
        bin.display()
    );
    Ok(())
}
