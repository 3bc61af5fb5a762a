//! `vmigrater-workload`: the guest tasks of the tests and benchmarks in a process of
//! their own, so the daemon, the test and the workload are accounted separately and the
//! reader can be frozen with SIGSTOP. Prints one JSON line with what each thread did.
//! The flags are used by tests, benchmarks and the lab guests: keep old ones working.

use std::path::PathBuf;
use std::time::{Duration, Instant};
use vmigrater_testbed::workload::{self, IoSpec, ReadPattern};

const USAGE: &str = "usage: vmigrater-workload --file F [--pattern P] [--readers N] [--seq-readers N] [--hogs N] [--pin-hogs] [--pin CPU] [--slice-us US] [--request-work-us US] [--warmup-ms MS] [--duration-ms MS]
  Runs N O_DIRECT I/O threads on F (plus --seq-readers 1 MiB sequential ones) and N CPU hogs
  for MS milliseconds (default: until killed), then prints {\"elapsed_s\", \"readers\": [{\"tid\",
  \"pattern\", \"reads\", \"writes\", \"ops\", \"bytes\", \"p50_us\", \"p99_us\", \"cpu_s\", \"migrations\",
  \"last_cpu\", \"reads_per_s\": requests in each whole second}],
  \"hogs\": [{\"tid\", \"units\", \"cpu_s\", \"migrations\", \"last_cpu\"}]} (migrations: the kernel's
  se.nr_migrations of the thread, whoever moved it; \"reads\" counts reads, \"ops\" reads and writes).
  Patterns: random4k (default), seq128k, seq1m, randrw70 (70/30 random 4 KiB reads/writes;
  F must be a regular file), request (a random 4 KiB read then --request-work-us of CPU work,
  default 200; latencies are whole requests'). N I/O threads of random4k keep N requests in
  flight: QD N by threads. --pin CPU pins the I/O threads to CPU. --slice-us gives them a scheduler slice of their own
  (sched_runtime, Linux 6.12+: what the daemon gives a task it keeps with its completions). The first --warmup-ms of
  --duration-ms are a warm-up: only what follows is reported (counts, latencies, CPU, elapsed_s).";

fn main() {
    if let Err(e) = run() {
        eprintln!("vmigrater-workload: {e:#}\n{USAGE}");
        std::process::exit(2);
    }
}

fn run() -> anyhow::Result<()> {
    let mut file: Option<PathBuf> = None;
    let (mut pattern, mut readers, mut hogs, mut pin_hogs, mut duration) =
        (ReadPattern::Random4k, 1usize, 0usize, false, None);
    let (mut seq_readers, mut pin, mut work_us, mut warmup) =
        (0usize, None, 200u64, Duration::ZERO);
    let mut slice_us: Option<u64> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |name: &str| {
            args.next()
                .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))
        };
        match a.as_str() {
            "--file" => file = Some(val("--file")?.into()),
            "--pattern" => pattern = val("--pattern")?.parse()?,
            "--readers" => readers = val("--readers")?.parse()?,
            "--seq-readers" => seq_readers = val("--seq-readers")?.parse()?,
            "--hogs" => hogs = val("--hogs")?.parse()?,
            "--pin-hogs" => pin_hogs = true,
            "--pin" => pin = Some(val("--pin")?.parse::<usize>()?),
            "--slice-us" => slice_us = Some(val("--slice-us")?.parse()?),
            "--request-work-us" => work_us = val("--request-work-us")?.parse()?,
            "--warmup-ms" => warmup = Duration::from_millis(val("--warmup-ms")?.parse()?),
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
    if let Some(cpu) = pin {
        anyhow::ensure!(cpu < ncpu, "--pin {cpu}: this machine has CPUs 0..{ncpu}");
    }
    // Calibrated before any thread starts, so the hogs do not slow the trials.
    let request_work = if pattern == ReadPattern::Request && readers > 0 {
        workload::work_units_for(Duration::from_micros(work_us))
    } else {
        0
    };
    let hog_workers = (0..hogs)
        .map(|i| workload::spawn_hog(pin_hogs.then_some(i % ncpu)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let reader_workers = (0..readers)
        .map(|_| pattern)
        .chain((0..seq_readers).map(|_| ReadPattern::Seq1m))
        .enumerate()
        .map(|(i, p)| {
            let mut spec = IoSpec::new(p);
            spec.pin = pin;
            spec.request_work = request_work;
            // The first thread keeps the historical offsets; the others read elsewhere.
            spec.seed ^= (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d);
            Ok((p, workload::spawn_io(&file, spec)?))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if let Some(us) = slice_us {
        for (_, w) in &reader_workers {
            os_layer::sched::set_fair_slice(w.tid, us * 1_000)
                .map_err(|e| anyhow::anyhow!("--slice-us {us}: sched_setattr: {e}"))?;
        }
    }
    if !warmup.is_zero() {
        std::thread::sleep(warmup);
    }
    // What the warm-up did, subtracted from every total below.
    let base_ops: Vec<u64> = reader_workers.iter().map(|(_, w)| w.count()).collect();
    let base_writes: Vec<u64> = reader_workers
        .iter()
        .map(|(_, w)| w.write_count())
        .collect();
    let base_cpu: Vec<f64> = reader_workers
        .iter()
        .map(|(_, w)| thread_cpu_s(w.tid))
        .collect();
    let base_units: Vec<u64> = hog_workers.iter().map(|w| w.count()).collect();
    let base_hog_cpu: Vec<f64> = hog_workers.iter().map(|w| thread_cpu_s(w.tid)).collect();
    if !warmup.is_zero() {
        for (_, w) in &reader_workers {
            w.latency_us.lock().expect("latency histogram").reset();
        }
    }
    let t0 = Instant::now();
    // Each reader's requests per whole second of the run: where in the run a cost falls (a
    // daemon's start, say) is not in the totals.
    let mut per_s: Vec<Vec<u64>> = vec![Vec::new(); reader_workers.len()];
    let mut last = base_ops.clone();
    let mut next = t0 + Duration::from_secs(1);
    let end = duration.map(|d| t0 + d.saturating_sub(warmup));
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
        .enumerate()
        .map(|(i, ((p, w), per_s))| {
            let (tid, cpu_s, sched) = (w.tid, thread_cpu_s(w.tid), thread_sched(w.tid));
            let latency = w.latency_us.clone();
            let writes = w.write_count() - base_writes[i];
            w.stop().map(|n| {
                let ops = n - base_ops[i];
                let h = latency.lock().expect("latency histogram");
                let q = |q: f64| (!h.is_empty()).then(|| h.value_at_quantile(q));
                serde_json::json!({"tid": tid, "pattern": format!("{p:?}"),
                    "reads": ops - writes, "writes": writes, "ops": ops,
                    "bytes": ops * p.block_size() as u64, "p50_us": q(0.5), "p99_us": q(0.99),
                    "cpu_s": cpu_s - base_cpu[i], "migrations": sched.0, "last_cpu": sched.1,
                    "reads_per_s": per_s})
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let hogs: Vec<_> = hog_workers
        .into_iter()
        .enumerate()
        .map(|(i, w)| {
            let (tid, cpu_s, sched) = (w.tid, thread_cpu_s(w.tid), thread_sched(w.tid));
            w.stop().map(|n| {
                serde_json::json!({"tid": tid, "units": n - base_units[i],
                    "cpu_s": cpu_s - base_hog_cpu[i],
                    "migrations": sched.0, "last_cpu": sched.1})
            })
        })
        .collect::<anyhow::Result<_>>()?;
    println!(
        "{}",
        serde_json::json!({"elapsed_s": elapsed, "pattern": format!("{pattern:?}"),
            "warmup_s": warmup.as_secs_f64(), "pin": pin,
            "request_work_units": (request_work > 0).then_some(request_work),
            "readers": readers, "hogs": hogs})
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
