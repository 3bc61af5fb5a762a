//! How soon the detector finds a request task (one read, then 200 µs of CPU work, a CPU
//! hog beside it on each vCPU) under Xen-like hard-IRQ deschedules of both vCPUs: two
//! fresh detectors side by side on the same task over the same time each round, the
//! default classifier (I/O-bound by time in flight or by request rate) and one by time in
//! flight alone. `tests/detector.rs` asserts that the task is found; this measures how
//! soon, per criterion, over rounds. Root, 2 CPUs.
//!
//! `cargo bench --bench detection -- [--rounds N] [--secs S] [--schedule SPEC]`; raw rounds,
//! medians and the build in target/bench/detection.json (`make bench-detection` copies it
//! to benches/results/).

use anyhow::{Context, Result};
use serde_json::json;
use std::time::Duration;
use task_detector::ClassifierConfig;
use vmigrater_testbed::{require_root, stats, workload};

#[path = "../tests/support/detection.rs"]
mod detection;
use detection::{found_side_by_side, RequestUnderSteal};

struct Args {
    rounds: usize,
    secs: u64,
    schedule: String,
}

fn args() -> Result<Args> {
    let mut a = Args {
        rounds: 8,
        secs: 2,
        schedule: "random:30000:30000:exp:3".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--rounds" => a.rounds = value()?.parse().context("--rounds")?,
            "--secs" => a.secs = value()?.parse().context("--secs")?,
            "--schedule" => a.schedule = value()?,
            // cargo bench passes --bench to every harness-less bench.
            "--bench" => {}
            other => anyhow::bail!(
                "unknown flag {other}: --rounds N, --secs S, --schedule SPEC (irq-steal's)"
            ),
        }
    }
    anyhow::ensure!(
        a.rounds > 0 && a.secs > 0,
        "--rounds and --secs must be > 0"
    );
    Ok(a)
}

fn main() -> Result<()> {
    if !require_root("detection benchmark") {
        return Ok(());
    }
    let a = args()?;
    vmigrater_testbed::assert_cpus(2);
    let out_dir = vmigrater_testbed::bench_dir();
    std::fs::create_dir_all(&out_dir)?;
    let file = out_dir.join("detection-data.bin");
    workload::prepare_file(&file, 256 << 20)?;
    let by_rate = ClassifierConfig::default();
    let by_time = ClassifierConfig {
        enter_iops: 0.0,
        exit_iops: 0.0,
        ..ClassifierConfig::default()
    };
    let per_round = Duration::from_secs(a.secs);
    // Every round's detectors need a whole round, plus the start and some margin.
    let run_secs = (a.rounds as u64) * (a.secs + 1) + 10;
    let bed = RequestUnderSteal::start(&file, &a.schedule, run_secs, None);
    let mut rounds = Vec::new();
    for r in 0..a.rounds {
        let found = found_side_by_side(
            &[by_rate.clone(), by_time.clone()],
            bed.task.tid,
            per_round,
            || bed.out_ns(),
        );
        let one = |f: &Option<(Duration, task_detector::IoTask)>| match f {
            Some((d, t)) => json!({
                "found_ms": d.as_secs_f64() * 1e3,
                "requests_per_s": t.iops,
                "in_flight": t.io_fraction,
                "by_rate": t.io_fraction < by_rate.enter_fraction && t.iops >= by_rate.enter_iops,
            }),
            None => json!({ "found_ms": null }),
        };
        let round =
            json!({ "round": r, "by_rate_or_time": one(&found[0]), "by_time": one(&found[1]) });
        eprintln!(
            "round {r}: by rate or time {}, by time alone {}",
            shown(&round["by_rate_or_time"]),
            shown(&round["by_time"])
        );
        rounds.push(round);
    }
    let (done, report) = bed.stop();
    eprintln!(
        "requests done: {done}\n{report}\n(the plan was made for {run_secs} s and stopped after \
         the rounds: `asked` counts the whole plan, `stolen` what ran)"
    );
    let summary = |key: &str| {
        let ms: Vec<f64> = rounds
            .iter()
            .filter_map(|r| r[key]["found_ms"].as_f64())
            .collect();
        json!({
            "found": ms.len(),
            "of": rounds.len(),
            "median_ms": stats::median(&ms),
            "max_ms": ms.iter().copied().fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x)))),
        })
    };
    let out = json!({
        "bench": "detection",
        "build": vmigrater_testbed::commit(),
        "schedule": a.schedule,
        "round_s": a.secs,
        "note": "a round without a find counts as not found within round_s; medians are of the rounds that found it",
        "summary": { "by_rate_or_time": summary("by_rate_or_time"), "by_time": summary("by_time") },
        "rounds": rounds,
    });
    println!(
        "\n| criterion | found | median | slowest |\n|---|---|---|---|\n{}\n{}",
        row(
            "by rate or time (default)",
            &out["summary"]["by_rate_or_time"]
        ),
        row("by time in flight alone", &out["summary"]["by_time"])
    );
    let path = out_dir.join("detection.json");
    std::fs::write(&path, serde_json::to_string_pretty(&out)?)?;
    println!("wrote {}", path.display());
    Ok(())
}

fn shown(v: &serde_json::Value) -> String {
    match v["found_ms"].as_f64() {
        Some(ms) => format!(
            "{ms:.0} ms ({:.0} requests/s, {:.2} in flight)",
            v["requests_per_s"].as_f64().unwrap_or(0.0),
            v["in_flight"].as_f64().unwrap_or(0.0)
        ),
        None => "never".into(),
    }
}

fn row(name: &str, s: &serde_json::Value) -> String {
    let ms = |k: &str| s[k].as_f64().map_or("–".into(), |v| format!("{v:.0} ms"));
    format!(
        "| {name} | {}/{} | {} | {} |",
        s["found"],
        s["of"],
        ms("median_ms"),
        ms("max_ms")
    )
}
