//! The contention benchmark (`make bench-contention`): an O_DIRECT reader plus a CPU hog
//! on every CPU, with the steal emulator taking the two CPUs away in anti-phase (10 ms on
//! / 10 ms off: two vCPUs per CPU). Modes interleaved in one run, rotated each round:
//! `no_sharing` (no steal), `vanilla` (steal, no daemon), `vmigrater` (steal + daemon).
//! Writes target/bench/contention.json and, when matplotlib is there, contention.png.
//!
//! Caveat printed with the results: the guest kernel *sees* the emulator's RT threads, so
//! vanilla Linux may move tasks by itself; the nested-VM lab is the faithful setting.
//!
//! Env: VMIGRATER_BENCH_ROUNDS (default 5), VMIGRATER_BENCH_SECS (default 4).

use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use steal_emulator::{Emulator, Pattern};
use vmigrater_testbed::{require_root, workload, workspace_bin};

const MODES: [&str; 3] = ["no_sharing", "vanilla", "vmigrater"];
const WORKLOADS: [(&str, &str); 2] = [("random_4k", "random4k"), ("sequential_1m", "seq1m")];

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

/// (busy, total) jiffies of all CPUs from /proc/stat.
fn cpu_jiffies() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = text
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = f.iter().take(8).sum();
    let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// utime+stime of a whole process (all threads), in seconds; 0 if it is gone.
fn process_cpu_s(pid: u32) -> f64 {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let rest = &text[text.rfind(')').map_or(0, |i| i + 2)..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let t = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (t(11) + t(12)) / clk_tck()
}

/// Total on-CPU ns of every thread of a process (schedstat: finer than jiffies).
fn process_cpu_ns(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

struct Daemon {
    child: Child,
    state_dir: tempfile::TempDir,
}

impl Daemon {
    fn start() -> Result<Daemon> {
        let state_dir = tempfile::tempdir()?;
        let config = state_dir.path().join("vmigrater.toml");
        std::fs::write(&config, "")?;
        let child = Command::new(workspace_bin("vmigrater"))
            .arg("--config")
            .arg(&config)
            .args(["--log", "warn", "run", "--no-metrics", "--state-dir"])
            .arg(state_dir.path())
            .stdout(Stdio::null())
            .spawn()
            .context("starting vmigrater")?;
        let d = Daemon { child, state_dir };
        let t0 = Instant::now();
        while d.status().is_none() {
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(20),
                "vmigrater did not come up"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(d)
    }

    fn status(&self) -> Option<Value> {
        let out = Command::new(workspace_bin("vmigrater"))
            .args(["status", "--json", "--state-dir"])
            .arg(self.state_dir.path())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    fn stop(mut self) -> Result<()> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        let st = self.child.wait()?;
        anyhow::ensure!(st.success(), "vmigrater exited with {st}");
        Ok(())
    }
}

fn run_workload(file: &Path, pattern: &str, secs: u64) -> Result<Value> {
    let out = Command::new(workspace_bin("vmigrater-workload"))
        .arg("--file")
        .arg(file)
        .args([
            "--pattern",
            pattern,
            "--readers",
            "1",
            "--hogs",
            "2",
            "--pin-hogs",
            "--duration-ms",
        ])
        .arg((secs * 1000).to_string())
        .output()
        .context("running vmigrater-workload")?;
    anyhow::ensure!(
        out.status.success(),
        "workload failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn anti_phase() -> Vec<Pattern> {
    vec![
        "0:10000:10000:0".parse().expect("pattern"),
        "1:10000:10000:10000".parse().expect("pattern"),
    ]
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return 0.0;
    }
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn percentile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(((s.len().max(1) - 1) as f64 * q).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

/// One round of one mode: throughput, hog progress, daemon figures, foreign CPU.
fn round(mode: &str, file: &Path, pattern: &str, secs: u64) -> Result<Value> {
    let emu = if mode == "no_sharing" {
        None
    } else {
        Some(Emulator::start(&anti_phase(), 50)?)
    };
    let daemon = if mode == "vmigrater" {
        Some(Daemon::start()?)
    } else {
        None
    };
    let daemon_cpu0 = daemon.as_ref().map_or(0, |d| process_cpu_ns(d.child.id()));
    let (busy0, total0) = cpu_jiffies();
    let me0 = process_cpu_s(std::process::id());
    let out = run_workload(file, pattern, secs)?;
    let (busy1, total1) = cpu_jiffies();
    let me1 = process_cpu_s(std::process::id());
    let elapsed = out["elapsed_s"].as_f64().unwrap_or(secs as f64);
    let (mut daemon_fig, mut daemon_cpu_s) = (Value::Null, 0.0);
    if let Some(d) = daemon {
        daemon_cpu_s = process_cpu_ns(d.child.id()).saturating_sub(daemon_cpu0) as f64 / 1e9;
        let st = d.status().unwrap_or(Value::Null);
        daemon_fig = json!({
            "cpu_s": daemon_cpu_s,
            "cpu_pct_of_one_cpu": daemon_cpu_s / elapsed * 100.0,
            "migrations": st["migrations"],
            "migration_latency_us": st["migration_latency_us"],
            "io_tasks_at_end": st["io_tasks"],
        });
        d.stop()?;
    }
    if let Some(e) = emu {
        e.stop();
    }
    let reads = out["readers"][0]["reads"].as_f64().unwrap_or(0.0);
    let block = if pattern == "seq1m" { 1 << 20 } else { 4096 } as f64;
    let hog_units: f64 = out["hogs"]
        .as_array()
        .map_or(0.0, |h| h.iter().filter_map(|x| x["units"].as_f64()).sum());
    // Jiffies not spent by the workload, the daemon or this bench (the emulator): noise.
    let busy_s = (busy1 - busy0) as f64 / clk_tck();
    let workload_s = 2.0 * elapsed; // two pinned hogs keep both CPUs busy when allowed
    let ours = (me1 - me0) + daemon_cpu_s;
    let window_s = (total1 - total0) as f64 / clk_tck();
    let reader_cpu = out["readers"][0]["cpu_s"].as_f64().unwrap_or(0.0);
    let hog_cpu: f64 = out["hogs"]
        .as_array()
        .map_or(0.0, |h| h.iter().filter_map(|x| x["cpu_s"].as_f64()).sum());
    Ok(json!({
        "mode": mode,
        "reader_cpu_pct": reader_cpu / elapsed * 100.0,
        "hogs_cpu_pct": hog_cpu / elapsed * 100.0,
        "reader_cpu_us_per_read": reader_cpu * 1e6 / reads.max(1.0),
        "elapsed_s": elapsed,
        "iops": reads / elapsed,
        "mb_s": reads * block / elapsed / 1e6,
        "hog_units_per_s": hog_units / elapsed,
        "daemon": daemon_fig,
        "cpu_busy_s": busy_s,
        "cpu_window_s": window_s,
        "foreign_cpu_pct": ((busy_s - workload_s.min(busy_s) - ours).max(0.0) / window_s * 100.0),
    }))
}

fn idle_daemon_cpu(secs: u64) -> Result<Value> {
    let d = Daemon::start()?;
    std::thread::sleep(Duration::from_millis(500));
    let c0 = process_cpu_ns(d.child.id());
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let cpu_s = process_cpu_ns(d.child.id()).saturating_sub(c0) as f64 / 1e9;
    let el = t0.elapsed().as_secs_f64();
    d.stop()?;
    Ok(json!({"seconds": el, "cpu_s": cpu_s, "cpu_pct_of_one_cpu": cpu_s / el * 100.0}))
}

fn main() -> Result<()> {
    if !require_root("contention benchmark") {
        return Ok(());
    }
    let rounds = env_num("VMIGRATER_BENCH_ROUNDS", 5) as usize;
    let secs = env_num("VMIGRATER_BENCH_SECS", 4);
    let out_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let file = out_dir.join("contention-data.bin");
    workload::prepare_file(&file, 1 << 30)?;
    eprintln!(
        "contention benchmark: {rounds} rounds × {} modes × {} workloads × {secs} s",
        MODES.len(),
        WORKLOADS.len()
    );

    let idle = idle_daemon_cpu(secs.max(3))?;
    eprintln!(
        "daemon idle (no I/O-bound task, no steal): {:.3}% of one CPU",
        idle["cpu_pct_of_one_cpu"].as_f64().unwrap_or(0.0)
    );

    let mut results = serde_json::Map::new();
    for (name, pattern) in WORKLOADS {
        let mut runs: Vec<Value> = Vec::new();
        for r in 0..rounds {
            for k in 0..MODES.len() {
                let mode = MODES[(k + r) % MODES.len()];
                let v = round(mode, &file, pattern, secs)?;
                eprintln!(
                    "{name} round {r} {mode:<10} {:>9.1} IOPS {:>8.1} MB/s  hogs {:>8.0}/s  foreign {:>4.1}%",
                    v["iops"].as_f64().unwrap_or(0.0),
                    v["mb_s"].as_f64().unwrap_or(0.0),
                    v["hog_units_per_s"].as_f64().unwrap_or(0.0),
                    v["foreign_cpu_pct"].as_f64().unwrap_or(0.0)
                );
                runs.push(json!({"round": r, "result": v}));
            }
        }
        let metric = if pattern == "seq1m" { "mb_s" } else { "iops" };
        let of = |mode: &str, key: &str| -> Vec<f64> {
            runs.iter()
                .filter(|x| x["result"]["mode"] == mode)
                .filter_map(|x| x["result"][key].as_f64())
                .collect()
        };
        let med = |mode: &str, key: &str| median(&of(mode, key));
        let (ns, va, vm) = (
            med("no_sharing", metric),
            med("vanilla", metric),
            med("vmigrater", metric),
        );
        let (hns, hva, hvm) = (
            med("no_sharing", "hog_units_per_s"),
            med("vanilla", "hog_units_per_s"),
            med("vmigrater", "hog_units_per_s"),
        );
        let lat: Vec<f64> = runs
            .iter()
            .filter_map(|x| x["result"]["daemon"]["migration_latency_us"]["p50"].as_f64())
            .collect();
        let migrations: Vec<f64> = runs
            .iter()
            .filter_map(|x| x["result"]["daemon"]["migrations"].as_f64())
            .collect();
        let dcpu = of("vmigrater", "elapsed_s");
        let dcpu_pct: Vec<f64> = runs
            .iter()
            .filter_map(|x| x["result"]["daemon"]["cpu_pct_of_one_cpu"].as_f64())
            .collect();
        let summary = json!({
            "metric": metric,
            "throughput": {"no_sharing": ns, "vanilla": va, "vmigrater": vm},
            "speedup": vm / va,
            "vs_no_sharing": vm / ns,
            "vanilla_vs_no_sharing": va / ns,
            "hog_units_per_s": {"no_sharing": hns, "vanilla": hva, "vmigrater": hvm},
            "hog_slowdown": 1.0 - hvm / hva,
            // Where the CPU went (% of one CPU): the reader's I/O path costs CPU here, so
            // what the hogs lose under vmigrater is what the faster reader uses.
            "cpu_pct": {
                "no_sharing": {"reader": med("no_sharing", "reader_cpu_pct"), "hogs": med("no_sharing", "hogs_cpu_pct")},
                "vanilla": {"reader": med("vanilla", "reader_cpu_pct"), "hogs": med("vanilla", "hogs_cpu_pct")},
                "vmigrater": {"reader": med("vmigrater", "reader_cpu_pct"), "hogs": med("vmigrater", "hogs_cpu_pct")},
            },
            "reader_cpu_us_per_read": {
                "no_sharing": med("no_sharing", "reader_cpu_us_per_read"),
                "vanilla": med("vanilla", "reader_cpu_us_per_read"),
                "vmigrater": med("vmigrater", "reader_cpu_us_per_read"),
            },
            "daemon_cpu_pct_of_one_cpu": median(&dcpu_pct),
            "daemon_cpu_s_per_round": median(&dcpu_pct) / 100.0 * median(&dcpu),
            "migrations_per_round": median(&migrations),
            "migration_latency_us_p50_of_rounds": {"p50": median(&lat), "max": percentile(&lat, 1.0)},
            "foreign_cpu_pct_max": percentile(&runs.iter().filter_map(|x| x["result"]["foreign_cpu_pct"].as_f64()).collect::<Vec<_>>(), 1.0),
            "rounds": runs,
        });
        eprintln!(
            "{name}: {metric} no_sharing {ns:.1} vanilla {va:.1} vmigrater {vm:.1}  speedup {:.2}  vs_no_sharing {:.2}  hogs {:+.1}%  daemon {:.2}% CPU",
            vm / va,
            vm / ns,
            -(1.0 - hvm / hva) * 100.0,
            median(&dcpu_pct)
        );
        results.insert(name.to_string(), summary);
    }
    let report = json!({
        "benchmark": "contention",
        "setup": {"steal": "CPU0 10ms/10ms phase 0, CPU1 10ms/10ms phase 10ms (SCHED_FIFO 50)", "hogs": "one pinned per CPU", "rounds": rounds, "seconds_per_round": secs},
        "caveat": "the guest kernel sees the emulator's RT threads; vanilla Linux may migrate tasks by itself",
        "daemon_idle": idle,
        "workloads": results,
    });
    let path = out_dir.join("contention.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
    eprintln!("wrote {}", path.display());
    let plot = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/plot_contention.py");
    match Command::new("/usr/bin/python3")
        .arg(&plot)
        .arg(&path)
        .arg(out_dir.join("contention.png"))
        .status()
    {
        Ok(s) if s.success() => eprintln!("wrote {}", out_dir.join("contention.png").display()),
        other => eprintln!("warning: no chart ({other:?}); install python3-matplotlib"),
    }
    Ok(())
}
