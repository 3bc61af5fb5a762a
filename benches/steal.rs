//! The hard-IRQ deschedule benchmark (`make bench-steal`, root): the guest workloads of
//! `vmigrater-workload` on a file of the root disk, a CPU hog pinned on every CPU, while
//! `irq-steal` takes CPUs away in hard-IRQ context on a planned schedule (nothing runs on
//! a CPU while it is out, not even the disk's completion interrupt: what a guest sees
//! while its host runs another vCPU). For every schedule × workload, every mode runs once
//! per repetition, in an order rotated each repetition:
//!
//! - `vanilla`: Linux alone;
//! - `vmigrater`: the release daemon with the default configuration (private state dir),
//!   started before the run and warmed up under the same schedule;
//! - `vmigrater_dry`: the same daemon with `--dry-run` (watching only: its cost);
//! - `vmigrater_no_slice`: the daemon with `advanced.migration.kept_slice_us = 0` (kept tasks keep
//!   their own scheduler slice: the short slice's ablation);
//! - `vmigrater_parent`: another build of the daemon (`--parent-bin PATH`, e.g. this
//!   commit's parent), default configuration: a code change's A/B, interleaved;
//! - `vmigrater_alt`: this build with the configuration of `--alt-config FILE` (an
//!   ablation: e.g. `[migration]` `guard = false`), kept in the results file;
//! - `pinned`: the oracle that knows where completions land: every I/O thread pinned to
//!   the CPU of the disk's request interrupt (`/proc/irq/*/effective_affinity_list`);
//! - `pinned_slice`: the same, each I/O thread with the daemon's default 100 µs slice
//!   (what the daemon does with a task it keeps there);
//! - `sched_oracle`: a thread of this harness that knows the plan in advance and moves
//!   every I/O thread, just before each window change, to the CPU that will run
//!   (the completion CPU when it runs).
//!
//! With `--disk loop` the workloads read a loop device over a file in memory whose requests
//! complete on the CPU that submitted them (`rq_affinity = 2`, tests/support/loopdisk.rs):
//! the geometry of a disk with a queue per vCPU, where a request waits for its submitter's
//! vCPU. There `pinned` keeps the I/O threads on CPU 0 (one vCPU's windows, the baseline a
//! move must beat) and `sched_oracle` moves them to a running CPU before each change.
//!
//! Every mode has the same timeline: steal starts, the daemon warm-up elapses (the daemon
//! runs in the daemon modes only), then the workload runs its own short I/O warm-up and
//! the measured seconds. A run whose steal report is more than 5% off its plan is rejected
//! and repeated (at most twice; both recorded).
//!
//! Writes `steal.json` (raw runs, per-cell medians, ratios with 95% bootstrap intervals,
//! paired ratios, spreads) and `steal.png` (benches/plot_steal.py) in the output
//! directory, and prints a table. It only measures: every figure comes from the kernel,
//! the workload, the steal program or the daemon. It never writes to a device: the
//! read/write workload writes into the data file this benchmark creates.
//!
//! Flags (after `--`): --reps N (8), --secs S (8), --warmup-secs S (3), --io-warmup-ms MS
//! (1000), --only SCHEDULES (names or specs, comma-separated), --workloads LIST,
//! --modes LIST, --out DIR (default `$VMIGRATER_BENCH_DIR` or target/bench),
//! --completion-cpu N (instead of reading /proc/irq), --seeds LIST (random schedules: repetition r draws seed r mod their number; 1,2,3),
//! --disk root|loop (where the data lives, root),
//! --parent-bin PATH (the daemon of `vmigrater_parent`), --accounting absorbed|interrupted
//! (who is charged a window's time: by default a real-time absorber per CPU, as on a guest
//! that subtracts steal time; or the task it interrupts, as this kernel does by itself;
//! see testbeds/irq-steal/src/absorber.rs).

use anyhow::{Context, Result};
use irq_steal::{Accounting, IrqSteal, Schedule, StealReport};
use os_layer::time::{monotonic_ns, sleep_until};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use vmigrater_testbed::completion::CompletionMap;
use vmigrater_testbed::daemon::BenchDaemon;
use vmigrater_testbed::loopdisk::LoopDisk;
use vmigrater_testbed::oracle::{self, OracleLog, OracleView};
use vmigrater_testbed::report::{est, f, fmt_est, list};
use vmigrater_testbed::seeds::Seeds;
use vmigrater_testbed::stats::{self, Estimate};
use vmigrater_testbed::SystemCpu;
use vmigrater_testbed::{ncpus, require_root, workload, workspace_bin};

const MODES: [&str; 9] = [
    "vanilla",
    "vmigrater",
    "vmigrater_dry",
    "vmigrater_no_slice",
    "vmigrater_parent",
    "vmigrater_alt",
    "pinned",
    "pinned_slice",
    "sched_oracle",
];

/// A workload of the benchmark: its name, `--pattern`, I/O threads, and its metric.
struct Workload {
    name: &'static str,
    pattern: &'static str,
    threads: usize,
    /// "iops" (requests per second, reads and writes) or "mb_s".
    metric: &'static str,
}

const WORKLOADS: [Workload; 6] = [
    Workload {
        name: "rand4k",
        pattern: "random4k",
        threads: 1,
        metric: "iops",
    },
    // Eight requests in flight by eight synchronous threads (no io_uring): QD8 as an
    // application with a thread per request keeps it.
    Workload {
        name: "rand4k_qd8_threads",
        pattern: "random4k",
        threads: 8,
        metric: "iops",
    },
    Workload {
        name: "seq128k",
        pattern: "seq128k",
        threads: 1,
        metric: "mb_s",
    },
    Workload {
        name: "randrw70",
        pattern: "randrw70",
        threads: 1,
        metric: "iops",
    },
    Workload {
        name: "rand4k_4readers",
        pattern: "random4k",
        threads: 4,
        metric: "iops",
    },
    // One random read then ~200 µs of CPU work per request; p50/p99 of whole requests.
    Workload {
        name: "request",
        pattern: "request",
        threads: 1,
        metric: "iops",
    },
];

/// (name, spec) of the default schedules; `SEED` is replaced by each repetition's seed
/// (--seeds). Windows of
/// 3 ms / 3 ms mean (KVM-like) and 30 ms / 30 ms (Xen-like) are exponential draws.
const SCHEDULES: [(&str, &str); 6] = [
    ("none", "none"),
    ("anti", "anti:20000:10000"),
    ("in", "in:20000:10000"),
    ("rphase", "rphase:20000:10000:SEED"),
    ("kvm", "random:3000:3000:exp:SEED"),
    ("xen", "random:30000:30000:exp:SEED"),
];

const FILE_SIZE: u64 = 1 << 30;
/// The loop disk's backing file: in memory (tmpfs), so that no other disk is involved.
const LOOP_BACKING: &str = "/dev/shm/vmigrater-steal-loop.bin";
/// A run whose stolen time is further than this from its plan, on any CPU, is rejected.
const STEAL_TOLERANCE: f64 = 0.05;
const MAX_RETRIES: usize = 2;
struct Settings {
    reps: usize,
    secs: f64,
    warmup: Duration,
    io_warmup: Duration,
    /// (name, spec) with `SEED` left in: `Seeds::fill` fills it per repetition.
    schedules: Vec<(String, String)>,
    seeds: Seeds,
    workloads: Vec<&'static Workload>,
    modes: Vec<&'static str>,
    out: PathBuf,
    completion_cpu: Option<usize>,
    disk: DiskKind,
    parent_bin: Option<PathBuf>,
    /// The configuration of `vmigrater_alt` (`--alt-config`), its text.
    alt_config: Option<String>,
    accounting: Accounting,
}

/// Where the workloads' data lives.
#[derive(Clone, Copy, PartialEq, Eq)]
enum DiskKind {
    /// A file on the root disk: one request queue, its interrupt on one CPU.
    Root,
    /// A loop device completing on the submitting CPU (a queue per vCPU's geometry).
    Loop,
}

/// The data under test and where its I/O threads go in the placed modes.
struct Data<'a> {
    file: &'a Path,
    /// Where completions land (the disk's interrupt CPU); `None` where they follow the
    /// submitter.
    completion: Option<usize>,
    /// Where `pinned` and `pinned_slice` keep the I/O threads.
    pin: Option<usize>,
}

fn parse_args() -> Result<Settings> {
    let mut s = Settings {
        reps: 8,
        secs: 8.0,
        warmup: Duration::from_secs(3),
        io_warmup: Duration::from_millis(1000),
        schedules: Vec::new(),
        seeds: Seeds::default(),
        workloads: WORKLOADS.iter().collect(),
        // The A/B mode runs only when asked for (it needs --parent-bin).
        modes: MODES
            .iter()
            .copied()
            .filter(|m| *m != "vmigrater_parent")
            .collect(),
        out: vmigrater_testbed::bench_dir(),
        completion_cpu: None,
        disk: DiskKind::Root,
        parent_bin: None,
        alt_config: None,
        accounting: Accounting::default(),
    };
    let mut only = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            // cargo bench passes this to every harness = false bench.
            "--bench" => {}
            "--reps" => s.reps = val()?.parse::<usize>()?.max(1),
            "--secs" => s.secs = val()?.parse::<f64>()?.max(0.5),
            "--warmup-secs" => s.warmup = Duration::from_secs_f64(val()?.parse()?),
            "--io-warmup-ms" => s.io_warmup = Duration::from_millis(val()?.parse()?),
            "--only" => only = Some(list(&val()?)),
            "--seed" | "--seeds" => s.seeds = Seeds::parse(&a, &val()?)?,
            "--workloads" => {
                s.workloads = list(&val()?)
                    .iter()
                    .map(|n| {
                        WORKLOADS.iter().find(|w| w.name == n).with_context(|| {
                            let names: Vec<_> = WORKLOADS.iter().map(|w| w.name).collect();
                            format!("--workloads: unknown {n:?}; known: {}", names.join(","))
                        })
                    })
                    .collect::<Result<_>>()?
            }
            "--modes" => {
                s.modes = list(&val()?)
                    .iter()
                    .map(|m| {
                        MODES.iter().copied().find(|x| x == m).with_context(|| {
                            format!("--modes: unknown {m:?}; known: {}", MODES.join(","))
                        })
                    })
                    .collect::<Result<_>>()?
            }
            "--out" => s.out = val()?.into(),
            "--completion-cpu" => s.completion_cpu = Some(val()?.parse()?),
            "--disk" => {
                s.disk = match val()?.as_str() {
                    "root" => DiskKind::Root,
                    "loop" => DiskKind::Loop,
                    other => anyhow::bail!("--disk: unknown {other:?}; known: root, loop"),
                }
            }
            "--parent-bin" => s.parent_bin = Some(val()?.into()),
            "--alt-config" => {
                let path = val()?;
                s.alt_config = Some(
                    std::fs::read_to_string(&path)
                        .with_context(|| format!("--alt-config: reading {path}"))?,
                );
            }
            "--accounting" => s.accounting = val()?.parse()?,
            other => anyhow::bail!(
                "unknown argument {other:?} (see the top of benches/steal.rs for the flags)"
            ),
        }
    }
    let defaults: Vec<(String, String)> = SCHEDULES
        .iter()
        .map(|(n, spec)| (n.to_string(), spec.to_string()))
        .collect();
    s.schedules = match only {
        None => defaults,
        Some(names) => names
            .into_iter()
            .map(|n| match defaults.iter().find(|(d, _)| *d == n) {
                Some(d) => Ok(d.clone()),
                // A spec of its own: named by itself.
                None if n.contains(':') => Ok((n.clone(), n)),
                None => anyhow::bail!(
                    "--only: unknown schedule {n:?}; known: {} (or a spec such as anti:6000:3000)",
                    SCHEDULES.map(|s| s.0).join(",")
                ),
            })
            .collect::<Result<_>>()?,
    };
    anyhow::ensure!(
        !s.modes.contains(&"vmigrater_parent") || s.parent_bin.is_some(),
        "--modes: vmigrater_parent needs --parent-bin PATH (the other build's vmigrater)"
    );
    anyhow::ensure!(
        !s.modes.contains(&"vmigrater_alt") || s.alt_config.is_some(),
        "--modes: vmigrater_alt needs --alt-config FILE (its configuration)"
    );
    Ok(s)
}

/// Busy CPU seconds of the whole machine (all CPUs) from /proc/stat: user through softirq,
/// without idle, iowait and the hypervisor's steal column.
fn busy_cpu_s() -> f64 {
    SystemCpu::read().busy
}

/// user+system seconds of this process, or of its waited-for children.
fn rusage_s(who: libc::c_int) -> f64 {
    // SAFETY: getrusage fills the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(who, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The daemon under test: the release build, default configuration (an empty file, so
/// /etc is not read, or `config`), private state directory, no metrics endpoint.
fn start_daemon(config: &str, dry_run: bool) -> Result<BenchDaemon> {
    BenchDaemon::start(config, if dry_run { &["--dry-run"] } else { &[] })
}

/// What the daemon decided, from its info log: each decision is one line.
fn decisions(log: &str) -> Value {
    let count = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| {
            [
                "managing it",
                "kept there",
                "move guard",
                "restored",
                "no longer I/O-bound",
                "waits for its turn",
                "WARN",
                "ERROR",
            ]
            .iter()
            .any(|k| l.contains(k))
        })
        .take(40)
        .collect();
    json!({
        "managed": count("managing it"),
        "kept_with_completions": count("kept there"),
        "guard_pays": count("pays=true"),
        "guard_holds": count("pays=false"),
        "lines": lines,
    })
}

/// The I/O threads of a workload process (named `reader-*`), once `n` of them exist.
fn io_tids(pid: u32, n: usize, deadline: Instant) -> Result<Vec<u32>> {
    loop {
        let tids = vmigrater_testbed::workload::threads_named(pid, "reader-");
        if tids.len() >= n {
            return Ok(tids);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "workload {pid} started {} of its {n} I/O threads in time",
            tids.len()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// One run of one mode, and the steal report that judges it.
fn run_once(
    sched: &Schedule,
    wl: &Workload,
    mode: &str,
    data: &Data,
    s: &Settings,
) -> Result<(Value, StealReport)> {
    let completion = data.completion;
    let cpus: Vec<usize> = (0..ncpus()).collect();
    let workload_ms = (s.io_warmup + Duration::from_secs_f64(s.secs)).as_millis() as u64;
    // The plan covers the warm-up, the workload, its start and exit.
    let length = s.warmup + Duration::from_millis(workload_ms) + Duration::from_millis(700);
    let plan = sched.plan(&cpus, length).context("planning the schedule")?;
    plan.validate_on(&cpus).context("the schedule's plan")?;
    let steal = IrqSteal::start_with(&plan, s.accounting).context("starting irq-steal")?;
    let start_ns = steal.start_ns();
    let daemon = match mode {
        "vmigrater" => Some(start_daemon("", false)?),
        "vmigrater_dry" => Some(start_daemon("", true)?),
        "vmigrater_no_slice" => Some(start_daemon(
            "[advanced.migration]\nkept_slice_us = 0\n",
            false,
        )?),
        "vmigrater_parent" => {
            let bin = s
                .parent_bin
                .as_deref()
                .context("vmigrater_parent needs --parent-bin")?;
            Some(BenchDaemon::start_bin(bin, "", &[])?)
        }
        "vmigrater_alt" => Some(start_daemon(
            s.alt_config
                .as_deref()
                .context("vmigrater_alt needs --alt-config")?,
            false,
        )?),
        _ => None,
    };
    sleep_until(start_ns + s.warmup.as_nanos() as u64);
    let status0 = daemon.as_ref().and_then(BenchDaemon::status);
    let dcpu0 = daemon
        .as_ref()
        .map(|d| vmigrater_testbed::process_cpu_s(d.pid()));

    let mut cmd = Command::new(workspace_bin("vmigrater-workload"));
    cmd.arg("--file")
        .arg(data.file)
        .args(["--pattern", wl.pattern, "--readers"])
        .arg(wl.threads.to_string())
        .arg("--hogs")
        .arg(cpus.len().to_string())
        .args(["--pin-hogs", "--warmup-ms"])
        .arg(s.io_warmup.as_millis().to_string())
        .arg("--duration-ms")
        .arg(workload_ms.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if mode == "pinned" || mode == "pinned_slice" {
        let cpu = data
            .pin
            .context("the pinned modes need the completion CPU")?;
        cmd.arg("--pin").arg(cpu.to_string());
    }
    if mode == "pinned_slice" {
        // The daemon's default advanced.migration.kept_slice_us.
        cmd.args(["--slice-us", "100"]);
    }
    let (busy0, me0, kids0) = (
        busy_cpu_s(),
        rusage_s(libc::RUSAGE_SELF),
        rusage_s(libc::RUSAGE_CHILDREN),
    );
    let t0 = monotonic_ns();
    let child = cmd.spawn().context("starting vmigrater-workload")?;
    let pid = child.id();
    let stop = AtomicBool::new(false);
    let log = OracleLog::default();
    let out = std::thread::scope(|scope| {
        let oracle = (mode == "sched_oracle").then(|| {
            let view = OracleView {
                plan: &plan,
                start_ns,
                cpus: &cpus,
                completion,
            };
            let (stop, log) = (&stop, &log);
            scope.spawn(move || {
                let tids = io_tids(pid, wl.threads, Instant::now() + Duration::from_secs(10))?;
                oracle::run(&view, || tids.clone(), stop, log)
            })
        });
        let out = child.wait_with_output();
        stop.store(true, Ordering::Relaxed);
        if let Some(o) = oracle {
            o.join()
                .map_err(|_| anyhow::anyhow!("sched_oracle thread panicked"))?
                .context("sched_oracle")?;
        }
        anyhow::Ok(out.context("waiting for vmigrater-workload")?)
    })?;
    let t1 = monotonic_ns();
    let (busy1, me1, kids1) = (
        busy_cpu_s(),
        rusage_s(libc::RUSAGE_SELF),
        rusage_s(libc::RUSAGE_CHILDREN),
    );
    anyhow::ensure!(
        out.status.success(),
        "vmigrater-workload failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let w: Value =
        serde_json::from_slice(&out.stdout).context("parsing vmigrater-workload's JSON")?;

    let mut daemon_json = Value::Null;
    let mut daemon_cpu_s = 0.0;
    if let (Some(d), Some(c0)) = (daemon, dcpu0) {
        let cpu_s = vmigrater_testbed::process_cpu_s(d.pid()) - c0;
        daemon_cpu_s = cpu_s;
        let st = d.status().context("vmigrater status after the run")?;
        let m0 = status0
            .as_ref()
            .and_then(|v| v["migrations"].as_u64())
            .unwrap_or(0);
        daemon_json = json!({
            "cpu_s": cpu_s,
            "cpu_pct_of_one_cpu": cpu_s / ((t1 - t0) as f64 / 1e9) * 100.0,
            "migrations": st["migrations"].as_u64().unwrap_or(0).saturating_sub(m0),
            "migrations_during_warmup": m0,
            "io_tasks_at_end": st["io_tasks"],
            "attach_mode": st["attach_mode"],
        });
        daemon_json["decisions"] = decisions(&d.stop()?);
    }
    // The plan ends on its own; stopping at its end compares whole plans.
    sleep_until(start_ns + length.as_nanos() as u64);
    let report = steal.stop().context("stopping irq-steal")?;

    // Busy CPU that neither the workload, the daemon nor this harness accounts for (the
    // steal's spins are charged to whatever they interrupted, ours or not): someone else
    // ran, and the run shared the machine. Recorded, not used to drop runs.
    let window_s = (t1 - t0) as f64 / 1e9;
    let foreign_s = ((busy1 - busy0) - (kids1 - kids0) - (me1 - me0) - daemon_cpu_s).max(0.0);
    let elapsed = f(&w["elapsed_s"]);
    let readers = w["readers"].as_array().cloned().unwrap_or_default();
    let sum = |k: &str| readers.iter().map(|r| f(&r[k])).sum::<f64>();
    let (ops, bytes) = (sum("ops"), sum("bytes"));
    let q = |k: &str| readers.iter().map(|r| f(&r[k])).collect::<Vec<_>>();
    let hogs = w["hogs"].as_array().cloned().unwrap_or_default();
    let hog_units: f64 = hogs.iter().map(|h| f(&h["units"])).sum();
    let v = json!({
        "mode": mode,
        "elapsed_s": elapsed,
        "ops": ops,
        "iops": ops / elapsed,
        "mb_s": bytes / elapsed / 1e6,
        // Over the I/O threads: the median thread's p50, the worst thread's p99.
        "p50_us": stats::median(&q("p50_us")),
        "p99_us": q("p99_us").into_iter().filter(|x| x.is_finite()).reduce(f64::max),
        "hog_units_per_s": hog_units / elapsed,
        "reader_migrations": q("migrations"),
        "reader_last_cpu": readers.iter().map(|r| r["last_cpu"].clone()).collect::<Vec<_>>(),
        "pinned_cpu": mode.starts_with("pinned").then_some(data.pin).flatten(),
        "daemon": daemon_json,
        "foreign_cpu_pct_of_all_cpus": foreign_s / (window_s * cpus.len() as f64) * 100.0,
        "oracle": (mode == "sched_oracle").then(|| log.to_json()),
        "steal": &report,
        "steal_worst_error": report.worst_error(),
        "workload": w,
    });
    Ok((v, report))
}

/// A run, repeated (at most `MAX_RETRIES` times) while its steal report is off its plan.
fn run(sched: &Schedule, wl: &Workload, mode: &str, data: &Data, s: &Settings) -> Result<Value> {
    let mut rejected = Vec::new();
    loop {
        let (mut v, report) = run_once(sched, wl, mode, data, s)?;
        let ok = report.within(STEAL_TOLERANCE);
        if ok || rejected.len() >= MAX_RETRIES {
            v["retries"] = json!(rejected.len());
            v["steal_ok"] = json!(ok);
            v["rejected_steal"] = json!(rejected);
            return Ok(v);
        }
        eprintln!(
            "  rejected: steal {:.1}% off its plan; repeating",
            report.worst_error() * 100.0
        );
        rejected.push(json!(report));
    }
}

/// Medians, ratios and spreads of one schedule × workload.
fn summarise(metric: &str, runs: &[Value], modes: &[&str]) -> Value {
    // Runs whose steal stayed off its plan after every retry are kept in the raw list but
    // left out of the statistics.
    let good: Vec<&Value> = runs.iter().filter(|r| r["steal_ok"] == true).collect();
    let vals = |mode: &str, key: &str| -> Vec<f64> {
        good.iter()
            .filter(|r| r["mode"] == mode)
            .map(|r| f(&r[key]))
            .collect()
    };
    let by_rep = |mode: &str, key: &str| -> Map<String, Value> {
        good.iter()
            .filter(|r| r["mode"] == mode)
            .map(|r| (r["rep"].to_string(), r[key].clone()))
            .collect()
    };
    let paired = |a: &str, b: &str, key: &str| -> Option<Estimate> {
        let (ma, mb) = (by_rep(a, key), by_rep(b, key));
        let pairs: Vec<(f64, f64)> = ma
            .iter()
            .filter_map(|(rep, x)| Some((f(x), f(mb.get(rep)?))))
            .collect();
        stats::paired_ratio(&pairs)
    };
    let mut per_mode = Map::new();
    for &m in modes {
        let v = vals(m, metric);
        let mut e = json!({
            "runs": v,
            "median": stats::median(&v),
            "spread_max_over_min": stats::spread(&v),
            "p50_us_median": stats::median(&vals(m, "p50_us")),
            "p99_us_median": stats::median(&vals(m, "p99_us")),
            "p99_us_runs": vals(m, "p99_us"),
            "hog_units_per_s_median": stats::median(&vals(m, "hog_units_per_s")),
            "retries": runs.iter().filter(|r| r["mode"] == m).map(|r| r["retries"].as_u64().unwrap_or(0)).sum::<u64>(),
            "runs_off_plan": runs.iter().filter(|r| r["mode"] == m && r["steal_ok"] != true).count(),
        });
        if m != "vanilla" {
            e["vs_vanilla"] = est(stats::ratio_of_medians(&v, &vals("vanilla", metric)));
            e["paired_vs_vanilla"] = est(paired(m, "vanilla", metric));
            e["hog_vs_vanilla"] = est(stats::ratio_of_medians(
                &vals(m, "hog_units_per_s"),
                &vals("vanilla", "hog_units_per_s"),
            ));
            e["p99_vs_vanilla"] = est(stats::ratio_of_medians(
                &vals(m, "p99_us"),
                &vals("vanilla", "p99_us"),
            ));
        }
        for oracle in ["pinned", "pinned_slice", "sched_oracle"] {
            if m == oracle || !modes.contains(&oracle) {
                continue;
            }
            let o = vals(oracle, metric);
            e[format!("vs_{oracle}")] = est(stats::ratio_of_medians(&v, &o));
            e[format!("paired_vs_{oracle}")] = est(paired(m, oracle, metric));
            if let Some(om) = stats::median(&o) {
                e[format!("runs_at_least_0.8_of_{oracle}")] =
                    json!(stats::fraction_at_least(&v, 0.8 * om));
                e[format!("runs_at_least_0.6_of_{oracle}")] =
                    json!(stats::fraction_at_least(&v, 0.6 * om));
            }
        }
        // The short slice's ablation: the default daemon against one that leaves kept
        // tasks' slices alone.
        let other = "vmigrater_no_slice";
        if m == "vmigrater" && modes.contains(&other) {
            e[format!("vs_{other}")] = est(stats::ratio_of_medians(&v, &vals(other, metric)));
            e[format!("paired_vs_{other}")] = est(paired(m, other, metric));
        }
        // A code change's A/B: this build against the other one.
        if m == "vmigrater" && modes.contains(&"vmigrater_parent") {
            e["vs_vmigrater_parent"] = est(stats::ratio_of_medians(
                &v,
                &vals("vmigrater_parent", metric),
            ));
            e["paired_vs_vmigrater_parent"] = est(paired(m, "vmigrater_parent", metric));
        }
        if m.starts_with("vmigrater") {
            let d: Vec<f64> = good
                .iter()
                .filter(|r| r["mode"] == m)
                .map(|r| f(&r["daemon"]["cpu_pct_of_one_cpu"]))
                .collect();
            e["daemon_cpu_pct_of_one_cpu_median"] = json!(stats::median(&d));
        }
        per_mode.insert(m.to_string(), e);
    }
    json!({ "metric": metric, "modes": per_mode })
}

fn print_table(report: &Value, s: &Settings) {
    println!(
        "\nhard-IRQ steal benchmark: median per mode (IOPS or MB/s), ratio of medians with \
         95% bootstrap interval, paired ratio, spread max/min"
    );
    println!(
        "completion CPU {}; {} reps × {} s; a CPU hog pinned on each CPU",
        report["setup"]["completion_cpu"], s.reps, s.secs
    );
    let head: String = s.modes.iter().map(|m| format!(" {m:>13}")).collect();
    println!(
        "{:<9} {:<19}{head} {:>20} {:>20} {:>20} {:>11} {:>7} {:>7}",
        "schedule",
        "workload",
        "vm/vanilla",
        "vm paired/vanilla",
        "vm/pinned",
        "spread va/vm",
        "vm≥.8o",
        "vm≥.6o"
    );
    for (sname, _) in &s.schedules {
        for wl in &s.workloads {
            let c = &report["cells"][sname][wl.name];
            let m = &c["modes"];
            let meds: String = s
                .modes
                .iter()
                .map(|mode| format!(" {:>13.1}", f(&m[*mode]["median"])))
                .collect();
            let vm = &m["vmigrater"];
            println!(
                "{:<9} {:<19}{meds} {:>20} {:>20} {:>20} {:>5.1}/{:<5.1} {:>7.2} {:>7.2}",
                sname,
                wl.name,
                fmt_est(&vm["vs_vanilla"]),
                fmt_est(&vm["paired_vs_vanilla"]),
                fmt_est(&vm["vs_pinned"]),
                f(&m["vanilla"]["spread_max_over_min"]),
                f(&vm["spread_max_over_min"]),
                f(&vm["runs_at_least_0.8_of_pinned"]),
                f(&vm["runs_at_least_0.6_of_pinned"]),
            );
            if wl.name == "request" {
                let p99: String = s
                    .modes
                    .iter()
                    .map(|mode| format!(" {:>13.0}", f(&m[*mode]["p99_us_median"])))
                    .collect();
                println!(
                    "{:<9} {:<19}{p99}   (p99 µs; vm/vanilla {})",
                    "",
                    "  p99",
                    fmt_est(&vm["p99_vs_vanilla"])
                );
            }
        }
    }
}

/// Names every mode whose runs stayed off their steal plan after the retries: those runs
/// are in the JSON but not in the statistics above.
fn print_off_plan(report: &Value) {
    let off: Vec<String> = report["runs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["steal_ok"] != true)
        .map(|r| {
            format!(
                "{} {} rep {} {} ({:.0}% off)",
                r["schedule"].as_str().unwrap_or(""),
                r["workload_name"].as_str().unwrap_or(""),
                r["rep"],
                r["mode"].as_str().unwrap_or(""),
                f(&r["steal_worst_error"]) * 100.0
            )
        })
        .collect();
    if !off.is_empty() {
        println!(
            "\n{} run(s) stayed more than {:.0}% off their steal plan after {MAX_RETRIES} \
             retries and are left out of the statistics: {}",
            off.len(),
            STEAL_TOLERANCE * 100.0,
            off.join("; ")
        );
    }
}

fn main() -> Result<()> {
    if !require_root("hard-IRQ steal benchmark") {
        return Ok(());
    }
    let s = parse_args()?;
    anyhow::ensure!(ncpus() >= 2, "the steal benchmark needs at least 2 CPUs");
    // Every schedule of every repetition parses before the first run.
    let schedules = s.seeds.schedules(&s.schedules, s.reps)?;
    std::fs::create_dir_all(&s.out).with_context(|| format!("creating {}", s.out.display()))?;
    // A file the benchmark owns on the root disk: the read/write workload writes into it;
    // or a loop device over memory that completes on the submitting CPU.
    let root_file = s.out.join("steal-data.bin");
    let t = Instant::now();
    let loop_disk = match s.disk {
        DiskKind::Root => {
            workload::prepare_file(&root_file, FILE_SIZE)?;
            None
        }
        DiskKind::Loop => Some(
            LoopDisk::create(Path::new(LOOP_BACKING), FILE_SIZE)
                .context("--disk loop: a loop device over a tmpfs file")?,
        ),
    };
    let file = loop_disk.as_ref().map_or(root_file, |d| d.device.clone());
    if t.elapsed() > Duration::from_secs(1) {
        eprintln!("prepared {} in {:.1?}", file.display(), t.elapsed());
    }
    // The loop device has no interrupt: its requests complete where they were submitted.
    let map = loop_disk.is_none().then(|| CompletionMap::for_file(&file));
    let completion = match (s.completion_cpu, &map) {
        (Some(c), _) => Some(c),
        (None, None) => None,
        (None, Some(Ok(m))) => {
            let cpus = m.cpus();
            if cpus.len() > 1 {
                eprintln!(
                    "WARNING: {} completes on CPUs {cpus:?} (a queue per CPU): `pinned` uses \
                     CPU {}, which is not an oracle for this geometry",
                    m.disk, cpus[0]
                );
            }
            cpus.first().copied()
        }
        (None, Some(Err(e))) => {
            eprintln!("WARNING: no completion CPU ({e:#}); the pinned mode is skipped");
            None
        }
    };
    // Where completions follow the submitter, `pinned` is the reader kept on one vCPU.
    let pin = if loop_disk.is_some() {
        Some(0)
    } else {
        completion
    };
    let data = Data {
        file: &file,
        completion,
        pin,
    };
    let modes: Vec<&str> = s
        .modes
        .iter()
        .copied()
        .filter(|m| !m.starts_with("pinned") || pin.is_some())
        .collect();
    let per_run = s.warmup.as_secs_f64() + s.io_warmup.as_secs_f64() + s.secs + 1.0;
    let n_runs = s.reps * modes.len() * s.workloads.len() * schedules.len();
    eprintln!(
        "steal benchmark: {} schedules × {} workloads × {} modes × {} reps, ~{:.0} min; completion CPU {completion:?}",
        schedules.len(),
        s.workloads.len(),
        modes.len(),
        s.reps,
        n_runs as f64 * per_run / 60.0
    );

    let mut raw: Vec<Value> = Vec::new();
    let mut cells = Map::new();
    for ((sname, spec), per_rep) in s.schedules.iter().zip(&schedules) {
        let mut per_wl = Map::new();
        for wl in &s.workloads {
            let mut runs = Vec::new();
            for (rep, sched) in per_rep.iter().enumerate() {
                for k in 0..modes.len() {
                    let mode = modes[(k + rep) % modes.len()];
                    let mut v = run(sched, wl, mode, &data, &s)
                        .with_context(|| format!("{sname} {} rep {rep} {mode}", wl.name))?;
                    v["schedule"] = json!(sname);
                    let (filled, seed) = s.seeds.fill(spec, rep);
                    v["spec"] = json!(filled);
                    v["seed"] = json!(seed);
                    v["workload_name"] = json!(wl.name);
                    v["rep"] = json!(rep);
                    v["order"] = json!(k);
                    eprintln!(
                        "{sname:<7} {:<19} rep {rep} {mode:<13} {:>9.1} {:<4} p99 {:>7.0} µs  hogs {:>7.0}/s  steal err {:>4.1}%  foreign {:>4.1}%{}{}",
                        wl.name,
                        f(&v[wl.metric]),
                        if wl.metric == "iops" { "IOPS" } else { "MB/s" },
                        f(&v["p99_us"]),
                        f(&v["hog_units_per_s"]),
                        f(&v["steal_worst_error"]) * 100.0,
                        f(&v["foreign_cpu_pct_of_all_cpus"]),
                        match v["retries"].as_u64() { Some(0) | None => String::new(), Some(n) => format!("  retries {n}") },
                        match v["daemon"]["migrations"].as_u64() {
                            Some(m) => format!("  migrations {m}  daemon {:.2}%", f(&v["daemon"]["cpu_pct_of_one_cpu"])),
                            None => String::new(),
                        }
                    );
                    runs.push(v);
                }
            }
            per_wl.insert(wl.name.to_string(), summarise(wl.metric, &runs, &modes));
            raw.extend(runs);
        }
        cells.insert(sname.clone(), Value::Object(per_wl));
    }

    let report = vmigrater_testbed::report::with_provenance(json!({
        "benchmark": "steal",
        "parent_build": s.parent_bin.as_deref().map(vmigrater_testbed::daemon_build),
        "alt_config": s.alt_config,
        "setup": {
            "cpus": ncpus(),
            "steal": "irq-steal: a BPF perf_event program per CPU spinning in hard-IRQ context through each planned window",
            "accounting": s.accounting,
            "schedules": s.schedules.iter().map(|(n, spec)| json!({"name": n, "spec": spec})).collect::<Vec<_>>(),
            "seeds": s.seeds,
            "workloads": s.workloads.iter().map(|w| json!({"name": w.name, "pattern": w.pattern, "io_threads": w.threads, "metric": w.metric})).collect::<Vec<_>>(),
            "modes": modes,
            "hogs": "one CPU hog pinned on every CPU, every mode",
            "file": file.display().to_string(),
            "file_bytes": FILE_SIZE,
            "completion_cpu": completion,
            "completion_map": map.as_ref().and_then(|m| m.as_ref().ok()),
            "pinned_cpu": pin,
            "loop_disk": loop_disk.as_ref().map(LoopDisk::describe),
            "reps": s.reps,
            "seconds_per_run": s.secs,
            "daemon_warmup_s": s.warmup.as_secs_f64(),
            "io_warmup_ms": s.io_warmup.as_millis() as u64,
            "steal_tolerance": STEAL_TOLERANCE,
            "max_retries": MAX_RETRIES,
            "bootstrap": {"resamples": stats::RESAMPLES, "seed": stats::SEED, "interval": "95% percentile"},
            "daemon_config": "defaults (empty config file; vmigrater_no_slice: advanced.migration.kept_slice_us = 0), --no-metrics, private --state-dir",
            "oracle_lead_us": oracle::LEAD.as_micros() as u64,
        },
        "cells": cells,
        "runs": raw,
    }));
    let path = s.out.join("steal.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
    print_table(&report, &s);
    print_off_plan(&report);
    println!("\nwrote {}", path.display());
    let png = s.out.join("steal.png");
    vmigrater_testbed::plot("plot_steal.py", &path, &png);
    Ok(())
}
