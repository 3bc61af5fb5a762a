//! `vmigrater-workload`: the guest tasks of the tests and benchmarks in a process of
//! their own, so the daemon, the test and the workload are accounted separately and the
//! reader can be frozen with SIGSTOP. Prints one JSON line with what each thread did.

use std::path::PathBuf;
use std::time::{Duration, Instant};
use vmigrater_testbed::workload::{self, ReadPattern};

const USAGE: &str = "usage: vmigrater-workload --file F [--pattern random4k|seq1m] [--readers N] [--seq-readers N] [--hogs N] [--pin-hogs] [--duration-ms MS]
  Runs N O_DIRECT readers of F (plus --seq-readers 1 MiB sequential ones) and N CPU hogs for
  MS milliseconds (default: until killed), then prints {\"elapsed_s\", \"readers\": [{\"tid\",
  \"pattern\", \"reads\", \"bytes\", \"p50_us\", \"p99_us\", \"cpu_s\", \"migrations\", \"last_cpu\",
  \"reads_per_s\": reads in each whole second}],
  \"hogs\": [{\"tid\", \"units\", \"cpu_s\", \"migrations\", \"last_cpu\"}]} (migrations: the kernel's
  se.nr_migrations of the thread, whoever moved it).";

fn main() {
    if let Err(e) = run() {
        eprintln!("vmigrater-workload: {e:#}\n{USAGE}");
        std::process::exit(2);
    }
}

fn run() -> anyhow::Result<()> {
    let mut file: Option<PathBuf> = None;
    let (mut pattern, mut readers, mut hogs, mut pin, mut duration) =
        (ReadPattern::Random4k, 1usize, 0usize, false, None);
    let mut seq_readers = 0usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |name: &str| {
            args.next()
                .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))
        };
        match a.as_str() {
            "--file" => file = Some(val("--file")?.into()),
            "--pattern" => {
                pattern = match val("--pattern")?.as_str() {
                    "random4k" => ReadPattern::Random4k,
                    "seq1m" => ReadPattern::Seq1m,
                    other => anyhow::bail!("--pattern {other:?}: expected random4k or seq1m"),
                }
            }
            "--readers" => readers = val("--readers")?.parse()?,
            "--seq-readers" => seq_readers = val("--seq-readers")?.parse()?,
            "--hogs" => hogs = val("--hogs")?.parse()?,
            "--pin-hogs" => pin = true,
            "--duration-ms" => {
                duration = Some(Duration::from_millis(val("--duration-ms")?.parse()?))
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => anyhow::bail!("unknown argument {other:?}"),
        }
    }
    let file = file.ok_or_else(|| anyhow::anyhow!("--file is required"))?;
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let t0 = Instant::now();
    let hog_workers = (0..hogs)
        .map(|i| workload::spawn_hog(pin.then_some(i % ncpu)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let reader_workers = (0..readers)
        .map(|_| pattern)
        .chain((0..seq_readers).map(|_| ReadPattern::Seq1m))
        .map(|p| Ok((p, workload::spawn_reader(&file, p)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Each reader's reads per whole second of the run: where in the run a cost falls (a
    // daemon's start, say) is not in the totals.
    let mut per_s: Vec<Vec<u64>> = vec![Vec::new(); reader_workers.len()];
    let mut last: Vec<u64> = vec![0; reader_workers.len()];
    let mut next = t0 + Duration::from_secs(1);
    let end = duration.map(|d| t0 + d);
    loop {
        let wake = end.map_or(next, |e| e.min(next));
        std::thread::sleep(wake.saturating_duration_since(Instant::now()));
        if Instant::now() >= next {
            for (i, (_, w)) in reader_workers.iter().enumerate() {
                let n = w.count();
                per_s[i].push(n - last[i]);
                last[i] = n;
            }
            next += Duration::from_secs(1);
        }
        if end.is_some_and(|e| Instant::now() >= e) {
            break;
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let readers: Vec<_> = reader_workers
        .into_iter()
        .zip(per_s)
        .map(|((p, w), per_s)| {
            let (tid, cpu_s, sched) = (w.tid, thread_cpu_s(w.tid), thread_sched(w.tid));
            let latency = w.latency_us.clone();
            w.stop().map(|n| {
                let h = latency.lock().expect("latency histogram");
                let q = |q: f64| (!h.is_empty()).then(|| h.value_at_quantile(q));
                serde_json::json!({"tid": tid, "pattern": format!("{p:?}"), "reads": n,
                    "bytes": n * p.block_size() as u64, "p50_us": q(0.5), "p99_us": q(0.99),
                    "cpu_s": cpu_s, "migrations": sched.0, "last_cpu": sched.1,
                    "reads_per_s": per_s})
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let hogs: Vec<_> = hog_workers
        .into_iter()
        .map(|w| {
            let (tid, cpu_s, sched) = (w.tid, thread_cpu_s(w.tid), thread_sched(w.tid));
            w.stop().map(|n| {
                serde_json::json!({"tid": tid, "units": n, "cpu_s": cpu_s,
                    "migrations": sched.0, "last_cpu": sched.1})
            })
        })
        .collect::<anyhow::Result<_>>()?;
    println!(
        "{}",
        serde_json::json!({"elapsed_s": elapsed, "pattern": format!("{pattern:?}"), "readers": readers, "hogs": hogs})
    );
    Ok(())
}

/// On-CPU seconds of one of our threads (schedstat field 1).
fn thread_cpu_s(tid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |ns| ns / 1e9)
}

/// (CPU migrations so far, CPU it last ran on) of one of our threads, from
/// /proc/self/task/TID/sched (`se.nr_migrations`) and stat (field 39); None if unreadable.
fn thread_sched(tid: u32) -> (Option<u64>, Option<u32>) {
    let migrations = std::fs::read_to_string(format!("/proc/self/task/{tid}/sched"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.trim_start().starts_with("se.nr_migrations"))
                .and_then(|l| l.split(':').nth(1)?.trim().parse().ok())
        });
    let last_cpu = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 2..];
            // Fields after the comm start at field 3; `processor` is field 39.
            rest.split_whitespace().nth(39 - 3)?.parse().ok()
        });
    (migrations, last_cpu)
}
