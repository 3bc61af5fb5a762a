//! Real applications under hard-IRQ deschedules (`make bench-apps`, root): PostgreSQL with
//! pgbench, nginx with wrk, a tar backup (tests/support/apps.rs), each started cold (page
//! cache dropped, server started under the schedule) and measured from its first request,
//! with a CPU hog pinned on every CPU while `irq-steal` takes CPUs away on a planned
//! schedule. For every schedule × application, every mode runs once per repetition, in an
//! order rotated each repetition:
//!
//! - `vanilla`: Linux alone;
//! - `vmigrater`: the release daemon, default configuration, started before the
//!   application (as a service is) and warmed up under the same schedule;
//! - `vmigrater_no_slice`: the daemon with `advanced.migration.kept_slice_us = 0`: a kept
//!   task keeps its own scheduler slice, the cap a user sets to leave co-located CPU work
//!   its share;
//! - `vmigrater_no_partners`: the daemon with `migration.keep_partners = false` (the kept
//!   task's client stays where the kernel puts it: the partner rule's ablation);
//! - `vmigrater_parent`: another build of the daemon (`--parent-bin`), for an A/B;
//! - `pinned`: the server's processes pinned to the disk's completion CPU from their start;
//! - `pinned_all`: the server and its client (pgbench, wrk, md5sum) pinned there;
//! - `pinned_all_slice`: the same, every task of the application with the daemon's default
//!   100 µs scheduler slice (what the daemon gives a task it keeps there);
//! - `sched_oracle`: every task of the application moved, just before each window change,
//!   to the CPU that will run (the completion CPU while it runs), knowing the plan;
//! - `steal_backoff`: every 100 ms the application kept off the vCPUs stolen most in the
//!   last 100 ms, read from the plan (tests/support/backoff.rs). It is not Linux's steal
//!   governor (aggregate steal each second, 5% / 2% hysteresis, which gains only where the
//!   host gives an idle vCPU's time away): on a plan fixed in advance it narrowed few
//!   periods and measured vanilla. The governor is judged in the loop, `make bench-host`.
//!
//! The best oracle of a cell is the oracle mode with the highest median there (the
//! ceiling: where the daemon beats it, an oracle is missing); the daemon
//! is reported against it and against vanilla (ratio of medians and paired ratio, 95%
//! bootstrap intervals, spreads). Time to help: from the first request to the daemon's
//! first log line that keeps or manages one of the server's tasks.
//!
//! Flags (after `--`): --reps N (8), --secs S (60), --warmup-secs S (4), --only SCHEDULES,
//! --apps LIST (pg_select_c1,pg_tpcb_c1,nginx_c4,backup; see apps.rs for all), --modes
//! LIST, --out DIR, --seeds LIST (1,2,3: repetition r of a random schedule draws seed
//! r mod their number, so the repetitions spread over the seeds), --parent-bin PATH, --accounting absorbed|interrupted,
//! --tag NAME (file name apps-NAME.json). Writes apps.json (raw runs, cells, the build's
//! commit) and apps.png, and prints a table. Environment: VMIGRATER_BENCH_LOG (the
//! daemon's log filter), VMIGRATER_BENCH_KEEP_LOGS=DIR (each daemon's whole log there).

use anyhow::{Context, Result};
use irq_steal::{Accounting, IrqSteal, Plan, Schedule, StealReport};
use os_layer::time::{monotonic_ns, sleep_until};
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use vmigrater_testbed::apps::{self, App, AppRun, Apps, Placement};
use vmigrater_testbed::backoff::{self, BackoffLog};
use vmigrater_testbed::completion::CompletionMap;
use vmigrater_testbed::daemon::BenchDaemon;
use vmigrater_testbed::oracle::{self, OracleLog, OracleView};
use vmigrater_testbed::report::{est, f, fmt_est, list};
use vmigrater_testbed::seeds::Seeds;
use vmigrater_testbed::stats::{self, Estimate};
use vmigrater_testbed::{ncpus, require_root, workload};

const MODES: [&str; 10] = [
    "vanilla",
    "vmigrater",
    "vmigrater_no_slice",
    "vmigrater_no_partners",
    "vmigrater_parent",
    "pinned",
    "pinned_all",
    "pinned_all_slice",
    "sched_oracle",
    "steal_backoff",
];
const ORACLES: [&str; 4] = ["pinned", "pinned_all", "pinned_all_slice", "sched_oracle"];
/// The daemon's default `advanced.migration.kept_slice_us`, in ns.
const KEPT_SLICE_NS: u64 = 100_000;
const DEFAULT_APPS: [&str; 4] = ["pg_select_c1", "pg_tpcb_c1", "nginx_c4", "backup"];
/// (name, spec) of the schedules, as in benches/steal.rs; `SEED` is replaced by the seed of
/// each repetition (--seeds).
const SCHEDULES: [(&str, &str); 6] = [
    ("anti", "anti:20000:10000"),
    ("rphase", "rphase:20000:10000:SEED"),
    ("xen", "random:30000:30000:exp:SEED"),
    ("kvm", "random:3000:3000:exp:SEED"),
    ("in", "in:20000:10000"),
    ("none", "none"),
];
const STEAL_TOLERANCE: f64 = 0.05;
/// Time the plan leaves for the server's start and stop around the measured seconds.
const START_STOP_BUDGET: Duration = Duration::from_secs(40);

struct Settings {
    reps: usize,
    secs: f64,
    warmup: Duration,
    /// (name, spec) with `SEED` left in: `Settings::spec` fills it per repetition.
    schedules: Vec<(String, String)>,
    seeds: Seeds,
    apps: Vec<App>,
    modes: Vec<&'static str>,
    out: PathBuf,
    tag: Option<String>,
    parent_bin: Option<PathBuf>,
    accounting: Accounting,
}

fn parse_args() -> Result<Settings> {
    let mut s = Settings {
        reps: 8,
        secs: 60.0,
        // Long enough for the contention gate to open (~2.3 s): the guard's first probe
        // starts with the first I/O-bound task, as on a machine where the daemon ran
        // since boot.
        warmup: Duration::from_secs(4),
        schedules: Vec::new(),
        seeds: Seeds::default(),
        apps: DEFAULT_APPS
            .iter()
            .map(|a| App::parse(a))
            .collect::<Result<_>>()?,
        modes: MODES
            .iter()
            .copied()
            .filter(|m| {
                ![
                    "vmigrater_parent",
                    "vmigrater_no_partners",
                    "vmigrater_no_slice",
                ]
                .contains(m)
            })
            .collect(),
        out: vmigrater_testbed::bench_dir(),
        tag: None,
        parent_bin: None,
        accounting: Accounting::default(),
    };
    let mut only = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--bench" => {}
            "--reps" => s.reps = val()?.parse::<usize>()?.max(1),
            "--secs" => s.secs = val()?.parse::<f64>()?.max(1.0),
            "--warmup-secs" => s.warmup = Duration::from_secs_f64(val()?.parse()?),
            "--only" => only = Some(list(&val()?)),
            "--seed" | "--seeds" => s.seeds = Seeds::parse(&a, &val()?)?,
            "--apps" => {
                s.apps = list(&val()?)
                    .iter()
                    .map(|a| App::parse(a).context("--apps"))
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
            "--tag" => s.tag = Some(val()?),
            "--parent-bin" => s.parent_bin = Some(val()?.into()),
            "--accounting" => s.accounting = val()?.parse()?,
            other => anyhow::bail!(
                "unknown argument {other:?} (see the top of benches/apps.rs for the flags)"
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
        "--modes: vmigrater_parent needs --parent-bin PATH"
    );
    Ok(s)
}

/// Gives every task the application has a scheduler slice of `ns`, those it starts later
/// too, until `stop` (`pinned_all_slice`).
fn keep_slices(mut tasks: impl FnMut() -> Vec<u32>, ns: u64, stop: &AtomicBool) -> Result<()> {
    let mut done = std::collections::HashSet::new();
    while !stop.load(Ordering::Relaxed) {
        for tid in tasks() {
            // A task gone or not fair (none of the applications') keeps its own.
            if !done.contains(&tid) && os_layer::sched::set_fair_slice(tid, ns).is_ok() {
                done.insert(tid);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// The steal report judged against the plan up to `until_ns` (the run stops the program
/// when the application is done, not at the plan's end).
fn steal_error(report: &StealReport, plan: &Plan, until_ns: u64) -> f64 {
    report
        .cpus
        .iter()
        .map(|c| {
            let asked = plan.out_between(c.cpu, 0, until_ns);
            match asked {
                0 if c.stolen_ns == 0 => 0.0,
                0 => f64::INFINITY,
                a => c.stolen_ns.abs_diff(a) as f64 / a as f64,
            }
        })
        .fold(0.0, f64::max)
}

/// A CPU hog pinned on every CPU (threads of this process, stopped with the application).
struct Hogs {
    workers: Vec<workload::Worker>,
    t0: std::time::Instant,
}

impl Hogs {
    fn start() -> Result<Hogs> {
        Ok(Hogs {
            workers: (0..ncpus())
                .map(|c| workload::spawn_hog(Some(c)))
                .collect::<Result<_>>()?,
            t0: std::time::Instant::now(),
        })
    }

    /// Units of work per second of each hog, by CPU.
    fn finish(self) -> Result<Vec<f64>> {
        let el = self.t0.elapsed().as_secs_f64();
        self.workers
            .into_iter()
            .map(|w| Ok(w.stop()? as f64 / el))
            .collect()
    }
}

fn run_once(
    sched: &Schedule,
    app: App,
    mode: &str,
    apps: &Apps,
    completion: usize,
    s: &Settings,
) -> Result<Value> {
    let cpus: Vec<usize> = (0..ncpus()).collect();
    let length = s.warmup + Duration::from_secs_f64(s.secs) + START_STOP_BUDGET;
    let plan = sched.plan(&cpus, length).context("planning the schedule")?;
    plan.validate_on(&cpus).context("the schedule's plan")?;
    apps::drop_caches()?;
    let steal = IrqSteal::start_with(&plan, s.accounting).context("starting irq-steal")?;
    let start_ns = steal.start_ns();
    let daemon = match mode {
        "vmigrater" => Some(BenchDaemon::start("", &[])?),
        "vmigrater_no_slice" => Some(BenchDaemon::start(
            "[advanced.migration]\nkept_slice_us = 0\n",
            &[],
        )?),
        "vmigrater_no_partners" => Some(BenchDaemon::start(
            "[migration]\nkeep_partners = false\n",
            &[],
        )?),
        "vmigrater_parent" => Some(BenchDaemon::start_bin(
            s.parent_bin.as_deref().context("--parent-bin")?,
            "",
            &[],
        )?),
        _ => None,
    };
    sleep_until(start_ns + s.warmup.as_nanos() as u64);
    let dcpu0 = daemon
        .as_ref()
        .map(|d| vmigrater_testbed::process_cpu_s(d.pid()));
    let hogs = Hogs::start()?;
    let place = match mode {
        "pinned" => Placement {
            server_cpu: Some(completion),
            client_cpu: None,
        },
        "pinned_all" | "pinned_all_slice" => Placement {
            server_cpu: Some(completion),
            client_cpu: Some(completion),
        },
        _ => Placement::default(),
    };
    let stop = AtomicBool::new(false);
    let log = OracleLog::default();
    let backoff_log = BackoffLog::default();
    let t0 = monotonic_ns();
    let run: Result<AppRun> = std::thread::scope(|scope| {
        let mut placer = None;
        let mut on_start = |cg: &apps::MemCgroup| {
            let tasks_file = cg.procs_file().with_file_name("tasks");
            let tasks = move || -> Vec<u32> {
                std::fs::read_to_string(&tasks_file)
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect()
            };
            let (stop, log, backoff_log, plan, cpus) = (&stop, &log, &backoff_log, &plan, &cpus);
            placer =
                match mode {
                    "sched_oracle" => Some(scope.spawn(move || {
                        let view = OracleView {
                            plan,
                            start_ns,
                            cpus,
                            completion: Some(completion),
                        };
                        oracle::run(&view, tasks, stop, log)
                    })),
                    "steal_backoff" => Some(scope.spawn(move || {
                        backoff::run(plan, start_ns, cpus, tasks, stop, backoff_log)
                    })),
                    "pinned_all_slice" => {
                        Some(scope.spawn(move || keep_slices(tasks, KEPT_SLICE_NS, stop)))
                    }
                    _ => None,
                };
        };
        let r = apps.run(app, s.secs, &place, &mut on_start);
        stop.store(true, Ordering::Relaxed);
        if let Some(o) = placer {
            o.join()
                .map_err(|_| anyhow::anyhow!("{mode} thread panicked"))??;
        }
        r
    });
    let t1 = monotonic_ns();
    let hog_rates = hogs.finish();
    let mut daemon_json = Value::Null;
    if let (Some(d), Some(c0)) = (daemon, dcpu0) {
        let cpu_s = vmigrater_testbed::process_cpu_s(d.pid()) - c0;
        let st = d.status().unwrap_or(Value::Null);
        let pid = d.pid();
        let log = d.stop()?;
        // The JSON keeps 200 decision lines; a diagnostic run (a trace filter in
        // VMIGRATER_BENCH_LOG) keeps every line here.
        if let Some(dir) = std::env::var_os("VMIGRATER_BENCH_KEEP_LOGS") {
            let path = PathBuf::from(dir).join(format!("{}-{mode}-{pid}.log", app.name()));
            std::fs::write(&path, &log).with_context(|| format!("writing {}", path.display()))?;
        }
        let first = run.as_ref().ok().map(|r| r.first_request_unix_s);
        daemon_json = json!({
            "cpu_pct_of_one_cpu": cpu_s / ((t1 - t0) as f64 / 1e9) * 100.0,
            "migrations": st["migrations"],
            "time_to_help_s": first.and_then(|t| apps::first_kept_after(&log, app.server_comms(), t)),
            "kept_lines": log.lines().filter(|l| l.contains("kept there")).count(),
            "released_lines": log.lines().filter(|l| l.contains("no longer I/O-bound") || l.contains("restored")).count(),
            "guard_holds_logged": log.lines().filter(|l| l.contains("pays=false")).count(),
            // The move guard's verdicts in this run and the time its probes ran without
            // moves (the status at the end of the run).
            "guard_pays": st["guard_pays"],
            "guard_holds": st["guard_holds"],
            "guard_without_moves_s": st["guard_without_moves_s"],
            // Every decision the daemon logged (a line each), for the runs that need a why.
            "log": log
                .lines()
                .filter(|l| !l.contains(" DEBUG ") || l.contains("no longer I/O-bound"))
                .take(200)
                .collect::<Vec<_>>(),
        });
    }
    // The first second from which the application runs at half its rate over the second
    // half of the run, whoever helped it: the time to help of every mode, oracles included.
    let steady = stats::median(
        &run.as_ref()
            .map_or(Vec::new(), |r| r.per_s[r.per_s.len() / 2..].to_vec()),
    );
    let to_rate = run.as_ref().ok().and_then(|r| {
        let half = steady? / 2.0;
        r.per_s.iter().position(|&x| x >= half).map(|i| i as f64)
    });
    let until = monotonic_ns().saturating_sub(start_ns);
    let report = steal.stop().context("stopping irq-steal")?;
    let run = run?;
    let err = steal_error(&report, &plan, until);
    anyhow::ensure!(
        until < length.as_nanos() as u64,
        "the run outlived its plan ({} s): raise START_STOP_BUDGET",
        length.as_secs()
    );
    Ok(json!({
        "mode": mode,
        "value": run.value,
        "metric": app.metric(),
        "elapsed_s": run.elapsed_s,
        "per_s": run.per_s,
        "p50_ms": run.p50_ms,
        "p99_ms": run.p99_ms,
        "server_start_s": run.server_start_s,
        "time_to_half_rate_s": to_rate,
        "app": run.extra,
        "hog_units_per_s_by_cpu": hog_rates.ok(),
        "daemon": daemon_json,
        "oracle": (mode == "sched_oracle").then(|| log.to_json()),
        "backoff": (mode == "steal_backoff").then(|| backoff_log.to_json()),
        "steal": report,
        "steal_error": err,
        "steal_ok": err <= STEAL_TOLERANCE,
    }))
}

/// Medians, ratios and spreads of one schedule × application.
fn summarise(runs: &[Value], modes: &[&str]) -> Value {
    let good: Vec<&Value> = runs.iter().filter(|r| r["steal_ok"] == true).collect();
    let vals = |mode: &str, key: &str| -> Vec<f64> {
        good.iter()
            .filter(|r| r["mode"] == mode)
            .map(|r| f(&r[key]))
            .collect()
    };
    let paired = |a: &str, b: &str| -> Option<Estimate> {
        let by_rep = |m: &str| -> Map<String, Value> {
            good.iter()
                .filter(|r| r["mode"] == m)
                .map(|r| (r["rep"].to_string(), r["value"].clone()))
                .collect()
        };
        let (ma, mb) = (by_rep(a), by_rep(b));
        let pairs: Vec<(f64, f64)> = ma
            .iter()
            .filter_map(|(rep, x)| Some((f(x), f(mb.get(rep)?))))
            .collect();
        stats::paired_ratio(&pairs)
    };
    let best_oracle = ORACLES
        .iter()
        .copied()
        .filter(|o| modes.contains(o))
        .max_by(|a, b| {
            let m = |o| stats::median(&vals(o, "value")).unwrap_or(f64::NEG_INFINITY);
            m(a).total_cmp(&m(b))
        });
    let mut per_mode = Map::new();
    for &m in modes {
        let v = vals(m, "value");
        let mut e = json!({
            "runs": v,
            "median": stats::median(&v),
            "spread_max_over_min": stats::spread(&v),
            "p99_ms_median": stats::median(&vals(m, "p99_ms")),
            "p50_ms_median": stats::median(&vals(m, "p50_ms")),
            "time_to_half_rate_s": vals(m, "time_to_half_rate_s"),
            "time_to_half_rate_s_median": stats::median(&vals(m, "time_to_half_rate_s")),
        });
        if m != "vanilla" {
            e["vs_vanilla"] = est(stats::ratio_of_medians(&v, &vals("vanilla", "value")));
            e["paired_vs_vanilla"] = est(paired(m, "vanilla"));
        }
        if let Some(o) = best_oracle.filter(|o| *o != m) {
            let ov = vals(o, "value");
            e["vs_best_oracle"] = est(stats::ratio_of_medians(&v, &ov));
            e["paired_vs_best_oracle"] = est(paired(m, o));
            if let Some(om) = stats::median(&ov) {
                e["runs_at_least_0.9_of_best_oracle"] =
                    json!(stats::fraction_at_least(&v, 0.9 * om));
                e["runs_at_least_0.7_of_best_oracle"] =
                    json!(stats::fraction_at_least(&v, 0.7 * om));
            }
        }
        if m.starts_with("vmigrater") {
            let d = |k: &str| -> Vec<f64> {
                good.iter()
                    .filter(|r| r["mode"] == m)
                    .map(|r| f(&r["daemon"][k]))
                    .collect()
            };
            let tth = d("time_to_help_s");
            e["time_to_help_s"] = json!(tth);
            e["time_to_help_s_median"] = json!(stats::median(&tth));
            e["daemon_cpu_pct_median"] = json!(stats::median(&d("cpu_pct_of_one_cpu")));
        }
        for other in [
            "vmigrater_parent",
            "vmigrater_no_partners",
            "vmigrater_no_slice",
            "steal_backoff",
        ] {
            if m == "vmigrater" && modes.contains(&other) {
                e[format!("vs_{other}")] = est(stats::ratio_of_medians(&v, &vals(other, "value")));
                e[format!("paired_vs_{other}")] = est(paired(m, other));
            }
        }
        per_mode.insert(m.to_string(), e);
    }
    json!({ "best_oracle": best_oracle, "modes": per_mode })
}

fn print_table(cells: &Map<String, Value>, s: &Settings) {
    println!(
        "\napplications under hard-IRQ deschedules ({:?} billing): median per mode, ratio of \
         medians [95% bootstrap], {} reps × {} s from the first request",
        s.accounting, s.reps, s.secs
    );
    let head: String = s.modes.iter().map(|m| format!(" {m:>12}")).collect();
    println!(
        "{:<8} {:<13}{head} {:>19} {:>19} {:>13} {:>8} {:>9} {:>9}",
        "schedule", "app", "vm/vanilla", "vm/best oracle", "best", "vm≥.7bo", "keep s", "½rate s"
    );
    for (sname, _) in &s.schedules {
        for app in &s.apps {
            let c = &cells[sname][app.name()];
            let m = &c["modes"];
            let meds: String = s
                .modes
                .iter()
                .map(|mode| format!(" {:>12.1}", f(&m[*mode]["median"])))
                .collect();
            let vm = &m["vmigrater"];
            println!(
                "{:<8} {:<13}{meds} {:>19} {:>19} {:>13} {:>8.2} {:>9.2} {:>9.1}",
                sname,
                app.name(),
                fmt_est(&vm["vs_vanilla"]),
                fmt_est(&vm["vs_best_oracle"]),
                c["best_oracle"].as_str().unwrap_or("-"),
                f(&vm["runs_at_least_0.7_of_best_oracle"]),
                f(&vm["time_to_help_s_median"]),
                f(&vm["time_to_half_rate_s_median"]),
            );
        }
    }
}

fn main() -> Result<()> {
    if !require_root("applications benchmark") {
        return Ok(());
    }
    let s = parse_args()?;
    anyhow::ensure!(
        ncpus() >= 2,
        "the applications benchmark needs at least 2 CPUs"
    );
    // Every schedule of every repetition parses before the first run.
    let schedules = s.seeds.schedules(&s.schedules, s.reps)?;
    std::fs::create_dir_all(&s.out)?;
    let apps = Apps::new();
    for &app in &s.apps {
        apps.prepare(app)
            .with_context(|| format!("preparing {}", app.name()))?;
    }
    // The disk the applications' data lives on, and the CPU its completions land on.
    let map = CompletionMap::for_file(&apps.dir).context("the data disk's completion CPU")?;
    let completion = *map
        .cpus()
        .first()
        .context("no completion CPU for the data disk")?;
    if map.cpus().len() > 1 {
        eprintln!(
            "WARNING: {} completes on CPUs {:?} (a queue per CPU): the pinned oracles use CPU \
             {completion}, which is not an oracle for this geometry",
            map.disk,
            map.cpus()
        );
    }
    let build = vmigrater_testbed::commit();
    if build.ends_with("-dirty") || build == "unknown" {
        eprintln!("WARNING: build {build}: the results file says so, and no table may cite it");
    }
    let n = s.reps * s.modes.len() * s.apps.len() * schedules.len();
    eprintln!(
        "apps benchmark at {build}: {} schedules × {} apps × {} modes × {} reps, ~{:.0} min; completion CPU {completion}",
        schedules.len(),
        s.apps.len(),
        s.modes.len(),
        s.reps,
        n as f64 * (s.secs + s.warmup.as_secs_f64() + 12.0) / 60.0
    );
    let name = s
        .tag
        .as_ref()
        .map_or("apps".to_string(), |t| format!("apps-{t}"));
    let path = s.out.join(format!("{name}.json"));
    let partial_path = s.out.join(format!("{name}.partial.json"));
    let mut raw = Vec::new();
    let mut cells = Map::new();
    for ((sname, spec), per_rep) in s.schedules.iter().zip(&schedules) {
        let mut per_app = Map::new();
        for &app in &s.apps {
            let t0 = std::time::Instant::now();
            let bytes = apps
                .settle_storage(app)
                .with_context(|| format!("settling {}'s storage", app.name()))?;
            eprintln!(
                "{sname:<7} {:<13} storage settled: {:.1} GB read in {:.1} s",
                app.name(),
                bytes as f64 / 1e9,
                t0.elapsed().as_secs_f64()
            );
            let mut runs = Vec::new();
            for (rep, sched) in per_rep.iter().enumerate() {
                for k in 0..s.modes.len() {
                    let mode = s.modes[(k + rep) % s.modes.len()];
                    let mut v = run_once(sched, app, mode, &apps, completion, &s)
                        .with_context(|| format!("{sname} {} rep {rep} {mode}", app.name()))?;
                    v["schedule"] = json!(sname);
                    let (filled, seed) = s.seeds.fill(spec, rep);
                    v["spec"] = json!(filled);
                    v["seed"] = json!(seed);
                    v["app_name"] = json!(app.name());
                    v["rep"] = json!(rep);
                    v["order"] = json!(k);
                    eprintln!(
                        "{sname:<7} {:<13} rep {rep} {mode:<13} {:>9.1} {:<5} p99 {:>8.1} ms  start {:>5.2} s  ½rate {:>4.0} s  steal err {:>4.1}%{}",
                        app.name(),
                        f(&v["value"]),
                        app.metric(),
                        f(&v["p99_ms"]),
                        f(&v["server_start_s"]),
                        f(&v["time_to_half_rate_s"]),
                        f(&v["steal_error"]) * 100.0,
                        if v["daemon"].is_null() {
                            String::new()
                        } else {
                            format!(
                                "  help {:.2} s  daemon {:.2}%",
                                f(&v["daemon"]["time_to_help_s"]),
                                f(&v["daemon"]["cpu_pct_of_one_cpu"])
                            )
                        }
                    );
                    runs.push(v);
                }
            }
            per_app.insert(app.name(), summarise(&runs, &s.modes));
            raw.extend(runs);
            // What is done so far survives a benchmark stopped in a later cell.
            let mut so_far = cells.clone();
            so_far.insert(sname.clone(), Value::Object(per_app.clone()));
            let partial = report(&s, &map, completion, &so_far, &raw);
            std::fs::write(
                &partial_path,
                serde_json::to_string_pretty(&partial)? + "\n",
            )?;
        }
        cells.insert(sname.clone(), Value::Object(per_app));
    }
    let report = report(&s, &map, completion, &cells, &raw);
    let _ = std::fs::remove_file(&partial_path);
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
    print_table(&cells, &s);
    println!("\nwrote {}", path.display());
    let png = s.out.join(format!("{name}.png"));
    vmigrater_testbed::plot("plot_apps.py", &path, &png);
    Ok(())
}

fn report(
    s: &Settings,
    map: &CompletionMap,
    completion: usize,
    cells: &Map<String, Value>,
    raw: &[Value],
) -> Value {
    vmigrater_testbed::report::with_provenance(json!({
        "benchmark": "apps",
        "parent_build": s.parent_bin.as_deref().map(vmigrater_testbed::daemon_build),
        "setup": {
            "cpus": ncpus(),
            "steal": "irq-steal: a BPF perf_event program per CPU spinning in hard-IRQ context through each planned window",
            "accounting": s.accounting,
            "schedules": s.schedules.iter().map(|(n, spec)| json!({"name": n, "spec": spec})).collect::<Vec<_>>(),
            "seeds": s.seeds,
            "seed_of_rep": "rep r draws seeds[r mod len] where the spec has SEED",
            "apps": s.apps.iter().map(|a| json!({"name": a.name(), "metric": a.metric()})).collect::<Vec<_>>(),
            "modes": s.modes,
            "oracles": ORACLES,
            "hogs": "one CPU hog pinned on every CPU from the application's start, every mode",
            "cold": "page cache dropped before each run; server started under the schedule; memory cgroup (pg 160 MB, nginx and backup 64 MB)",
            "storage_settled": "each application's files read once before its repetitions (the host's cache, which the guest cannot drop, in one state for every run)",
            "completion_cpu": completion,
            "completion_map": map,
            "reps": s.reps,
            "seconds_per_run": s.secs,
            "daemon_warmup_s": s.warmup.as_secs_f64(),
            "steal_tolerance": STEAL_TOLERANCE,
            "bootstrap": {"resamples": stats::RESAMPLES, "seed": stats::SEED, "interval": "95% percentile"},
            "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        },
        "cells": cells,
        "runs": raw,
    }))
}
