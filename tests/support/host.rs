//! Host-side helpers of the agent and lab tests: CPU hogs in a process of their own that
//! stand in for vCPU threads or co-located VMs, and a `vmigrater-hv-agent` run from a
//! test configuration.

use crate::workspace_bin;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The nice of a thread (getpriority).
pub fn nice_of(tid: u32) -> i32 {
    // SAFETY: getpriority has no memory arguments; errno is cleared first.
    unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, tid)
    }
}

/// A workload process whose `n` CPU hogs stand in for vCPU threads, each pinned to `cpus[i]`.
pub struct Hogs {
    child: Child,
    pub tids: Vec<u32>,
}

impl Hogs {
    pub fn start(cpus: &[usize]) -> Hogs {
        // No readers: the file is never opened.
        let child = Command::new(workspace_bin("vmigrater-workload"))
            .args(["--file", "/dev/null"])
            .args(["--readers", "0", "--hogs", &cpus.len().to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        let mut tids = Vec::new();
        while tids.len() < cpus.len() && t0.elapsed() < Duration::from_secs(5) {
            tids = Self::find(child.id());
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(tids.len(), cpus.len(), "hog threads not found");
        for (&t, &c) in tids.iter().zip(cpus) {
            let mut set = nix::sched::CpuSet::new();
            set.set(c).unwrap();
            nix::sched::sched_setaffinity(Pid::from_raw(t as i32), &set).unwrap();
        }
        Hogs { child, tids }
    }

    pub fn find(pid: u32) -> Vec<u32> {
        let mut tids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .filter(|tid| {
                std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                    .is_ok_and(|c| c.starts_with("cpu-hog"))
            })
            .collect();
        tids.sort_unstable();
        tids
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Agent {
    pub child: Option<Child>,
    pub config: PathBuf,
    /// stderr goes to a file: a pipe nobody reads until exit fills up at debug level and
    /// blocks the agent in a log write, so it never gets to its SIGTERM handling.
    pub log: PathBuf,
}

impl Agent {
    /// Starts the agent with `body` (top-level keys, then `[[vm]]` tables) in a config
    /// whose state lives in `dir`, without /metrics or libvirt discovery.
    pub fn start(dir: &Path, body: &str) -> Agent {
        Self::start_in(dir, dir, body)
    }

    /// `start` with the state (journal, status socket) in `state_dir`, the config and log
    /// in `dir`.
    pub fn start_in(dir: &Path, state_dir: &Path, body: &str) -> Agent {
        let config = dir.join("agent.toml");
        std::fs::write(
            &config,
            format!(
                "period_ms = 50\nbackend = \"kvm-qemu\"\nstate_dir = {:?}\n{body}\n[metrics]\nenabled = false\n\n[libvirt]\nenabled = false\n",
                state_dir.display().to_string()
            ),
        )
        .unwrap();
        Agent::run(config, dir.join("agent.log"))
    }

    /// The agent on the configuration file `config`, at debug level, its log in `log`.
    pub fn run(config: PathBuf, log: PathBuf) -> Agent {
        let child = Command::new(workspace_bin("vmigrater-hv-agent"))
            .arg("--config")
            .arg(&config)
            .args(["--log", "debug", "run"])
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Agent {
            child: Some(child),
            config,
            log,
        }
    }

    pub fn status(&self) -> Option<serde_json::Value> {
        let out = Command::new(workspace_bin("vmigrater-hv-agent"))
            .arg("--config")
            .arg(&self.config)
            .args(["status", "--json"])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).ok())?
    }

    /// SIGTERM, wait, and return stderr; panics if the agent failed.
    pub fn terminate(mut self) -> String {
        let mut child = self.child.take().unwrap();
        kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
        let status = child.wait().unwrap();
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        assert!(status.success(), "agent exited with {status}:\n{log}");
        assert!(log.contains("restored every scheduling change"), "{log}");
        log
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
