//! BPF overhead per I/O: 4 KiB random O_DIRECT reads with the block I/O programs attached
//! vs not, interleaved A/B/B/A with repetitions in one run (the machine is shared and
//! noisy). Writes target/bench/bpf_overhead.json.
//!
//! Env: VMIGRATER_BENCH_ROUNDS (default 6), VMIGRATER_BENCH_READS (default 20000).

use anyhow::Result;
use lab::summary::{bootstrap_ratio, median};
use serde_json::json;
use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::time::Instant;
use task_detector::{IoTracker, TrackerOptions, TrackerStorage};
use vmigrater_testbed::{require_root, workload};

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// µs per read for `n` synchronous 4 KiB O_DIRECT reads at random offsets.
fn reads(file: &std::fs::File, blocks: u64, n: u64, seed: u64) -> Result<f64> {
    let layout = std::alloc::Layout::from_size_align(4096, 4096)?;
    // SAFETY: non-zero size, valid alignment; freed below with the same layout.
    let ptr = unsafe { std::alloc::alloc(layout) };
    anyhow::ensure!(!ptr.is_null(), "allocation failed");
    // SAFETY: ptr is valid for 4096 bytes and exclusively ours until dealloc.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, 4096) };
    let mut x = seed | 1;
    let t0 = Instant::now();
    let mut res = Ok(());
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if let Err(e) = file.read_exact_at(buf, (x % blocks) * 4096) {
            res = Err(e);
            break;
        }
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(ptr, layout) };
    res?;
    Ok(us)
}

fn main() -> Result<()> {
    if !require_root("bpf overhead benchmark") {
        return Ok(());
    }
    let rounds = env_num("VMIGRATER_BENCH_ROUNDS", 6);
    let n = env_num("VMIGRATER_BENCH_READS", 20_000);
    let dir = vmigrater_testbed::bench_dir();
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("contention-data.bin");
    workload::prepare_file(&path, 1 << 30)?;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)?;
    let blocks = file.metadata()?.len() / 4096;
    reads(&file, blocks, n / 4, 7)?; // warm-up
    let (mut off, mut on) = (Vec::new(), Vec::new());
    let mut mode = String::new();
    for r in 0..rounds {
        // A B B A: each mode goes first equally often.
        for attached in if r % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        } {
            let mut storage = TrackerStorage::new();
            let tracker = if attached {
                Some(IoTracker::open(&TrackerOptions::default(), &mut storage)?)
            } else {
                None
            };
            if let Some(t) = &tracker {
                mode = t.mode().to_string();
            }
            let us = reads(&file, blocks, n, r * 31 + 1)?;
            drop(tracker);
            eprintln!(
                "round {r} {:<9} {us:.2} µs/read",
                if attached { "attached" } else { "detached" }
            );
            if attached {
                on.push(us)
            } else {
                off.push(us)
            }
        }
    }
    // Rounds stay in run order: round r's two values were measured side by side, and
    // their ratio is the least noisy figure this shared machine gives.
    let (m_off, m_on) = (median(off.clone()), median(on.clone()));
    let paired: Vec<f64> = on.iter().zip(&off).map(|(a, b)| a / b).collect();
    let paired_median = median(paired.clone());
    let interval = bootstrap_ratio(&on, &off);
    let report = json!({
        "benchmark": "bpf_overhead",
        "commit": vmigrater_testbed::commit(),
        "attach_mode": mode,
        "reads_per_round": n,
        "rounds": rounds,
        "us_per_read": {"detached": m_off, "attached": m_on},
        "ratio": m_on / m_off,
        "ratio_ci95": interval,
        "paired_ratio_median": paired_median,
        "overhead_us_per_read": m_on - m_off,
        "rounds_us": {"detached": off, "attached": on},
        "paired_ratios": paired,
    });
    let ci = interval.map_or("-".into(), |[lo, hi]| format!("[{lo:.3}, {hi:.3}]"));
    eprintln!(
        "4 KiB O_DIRECT read: detached {m_off:.2} µs, attached ({mode}) {m_on:.2} µs, ratio {:.3} \
         (95% CI {ci}), median of per-round ratios {paired_median:.3}",
        m_on / m_off
    );
    let out = dir.join("bpf_overhead.json");
    std::fs::write(&out, serde_json::to_string_pretty(&report)?)?;
    eprintln!("wrote {}", out.display());
    Ok(())
}
