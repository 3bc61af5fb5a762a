//! `vmigrater explain` against a real daemon on the real kernel: each reason with a thread
//! placed in that situation (O_DIRECT readers, a CPU hog, a reader pinned by its owner, an
//! excluded command, a kernel thread, the daemon's own, a mask changed behind the daemon,
//! no contention, the block programs detached). Root (CI is); otherwise reported ignored,
//! and run by another user they fail (`assert_root`).

use serde_json::Value;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use steal_emulator::{Emulator, Pattern};
use vmigrater_testbed::daemon::BenchDaemon;
use vmigrater_testbed::workload::{self, IoSpec, ReadPattern};
use vmigrater_testbed::{assert_cpus, assert_root};

/// A 256 MiB file on the real disk (O_DIRECT needs a real filesystem, not tmpfs).
fn data_file() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("explain-test-data.bin");
    workload::prepare_file(&path, 256 << 20).expect("prepare data file");
    path
}

/// Polls `d`'s status until `pred` holds; panics with the last one after `limit`.
fn wait_status(d: &BenchDaemon, limit: Duration, what: &str, pred: impl Fn(&Value) -> bool) {
    let t0 = Instant::now();
    let mut last = Value::Null;
    while t0.elapsed() < limit {
        if let Some(s) = d.status() {
            if pred(&s) {
                return;
            }
            last = s;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "timed out after {limit:?} waiting for {what}; last status: {last:#}\nlog:\n{}",
        d.log()
    );
}

/// The explanation of thread `tid` (explained by its own id).
fn explained(d: &BenchDaemon, tid: u32) -> Value {
    let e = d
        .explain(Some(&tid.to_string()))
        .unwrap_or_else(|| panic!("explain {tid} gave no JSON; log:\n{}", d.log()));
    let threads = e["threads"].as_array().expect("threads");
    threads
        .iter()
        .find(|t| t["thread"]["tid"] == tid)
        .unwrap_or_else(|| panic!("{tid} not in {e:#}"))
        .clone()
}

fn reason(d: &BenchDaemon, tid: u32) -> String {
    explained(d, tid)["reason"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn in_list(s: &Value, key: &str, tid: u32) -> bool {
    s[key]
        .as_array()
        .is_some_and(|v| v.iter().any(|t| t["tid"] == tid || *t == tid))
}

/// Under deschedules in anti-phase (the steal emulator), with the planner alone (no guard,
/// no completion keeping): a reader is managed; a reader its owner pinned to one CPU is
/// managed with nowhere to go; an excluded reader is found and left; a hog is not
/// I/O-bound; a kernel thread and the daemon's own threads are never managed; a reader
/// whose mask someone else changes is left alone.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn explain_gives_each_thread_the_rule_that_decides_it() {
    assert_root();
    assert_cpus(2);
    let file = data_file();
    let reader = workload::spawn_reader(&file, ReadPattern::Random4k).expect("reader");
    let pinned = workload::spawn_io(
        &file,
        IoSpec {
            pin: Some(0),
            seed: 7,
            ..IoSpec::new(ReadPattern::Random4k)
        },
    )
    .expect("pinned reader");
    let excluded = workload::spawn_reader(&file, ReadPattern::Seq128k).expect("seq reader");
    let hog = workload::spawn_hog(None).expect("hog");
    let patterns: Vec<Pattern> = ["0:10000:10000:0", "1:10000:10000:10000"]
        .iter()
        .map(|p| p.parse().expect("pattern"))
        .collect();
    let emu = Emulator::start(&patterns, 50).expect("steal emulator");
    let d = BenchDaemon::start(
        "[monitor]\nsource = \"sleepers\"\n\n[migration]\nguard = false\nfollow_completions = false\nexclude_comm = [\"reader-Seq128k\"]\n",
        &[],
    )
    .expect("daemon");
    wait_status(
        &d,
        Duration::from_secs(20),
        "both random readers managed and the sequential one found",
        |s| {
            in_list(s, "tasks", reader.tid)
                && in_list(s, "tasks", pinned.tid)
                && in_list(s, "seen", excluded.tid)
        },
    );
    let e = explained(&d, reader.tid);
    assert_eq!(e["reason"], "managed", "{e:#}");
    assert!(
        e["detector"]["io_fraction"].as_f64().unwrap() > 0.0,
        "{e:#}"
    );
    assert_eq!(reason(&d, pinned.tid), "one_vcpu");
    let e = explained(&d, excluded.tid);
    assert_eq!(e["reason"], "excluded", "{e:#}");
    assert!(
        e["why"].as_str().unwrap().contains("reader-Seq128k"),
        "{e:#}"
    );
    assert_eq!(reason(&d, hog.tid), "not_io_bound");
    assert_eq!(reason(&d, 2), "kernel_thread", "kthreadd");
    assert_eq!(reason(&d, d.pid()), "daemon");
    // By command: the one thread of that name.
    let by_comm = d.explain(Some("reader-Seq128k")).expect("explain by comm");
    let tids: Vec<&Value> = by_comm["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| &t["thread"]["tid"])
        .collect();
    assert_eq!(tids, vec![&Value::from(excluded.tid)], "{by_comm:#}");
    // Without a target: the daemon as a whole.
    let whole = d.explain(None).expect("explain");
    let lines: Vec<&str> = whole["daemon"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(lines.contains(&"moves: allowed"), "{whole:#}");
    assert!(whole["threads"].as_array().unwrap().is_empty(), "{whole:#}");

    // Someone else sets the reader's mask while the daemon has it pinned to one CPU (a
    // mask of both CPUs is none the daemon sets then): it lets go of the reader for good.
    let t0 = Instant::now();
    while os_layer::get_cpus(reader.tid).unwrap().len() != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the reader is never pinned"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    os_layer::set_cpus(reader.tid, &[0, 1]).expect("set the reader's mask");
    wait_status(&d, Duration::from_secs(10), "the reader hands off", |s| {
        s["hands_off"]
            .as_array()
            .is_some_and(|h| h.contains(&reader.tid.into()))
    });
    assert_eq!(reason(&d, reader.tid), "hands_off");
    d.stop().expect("daemon stop");
    let _ = emu.stop();
    assert_eq!(
        os_layer::get_cpus(reader.tid).unwrap(),
        vec![0, 1],
        "the owner's mask was kept"
    );
    drop((reader, pinned, excluded, hog));
}

/// With no vCPU descheduled on this machine (nothing to gain), a reader is explained by the
/// contention gate while the programs are attached, then by their detaching.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn explain_says_when_nothing_can_gain_and_when_the_programs_are_off() {
    assert_root();
    let file = data_file();
    let reader = workload::spawn_reader(&file, ReadPattern::Random4k).expect("reader");
    let d = BenchDaemon::start("[channel]\nenabled = false\n", &[]).expect("daemon");
    wait_status(&d, Duration::from_secs(20), "the contention gate", |s| {
        s["move_gate"] == "not_contended" && s["block_attached"] == true
    });
    let e = explained(&d, reader.tid);
    assert_eq!(e["reason"], "not_contended", "{e:#}");
    d.stop().expect("daemon stop");

    let d = BenchDaemon::start(
        "[advanced.detector]\ndetach_after_ms = 1000\n[channel]\nenabled = false\n",
        &[],
    )
    .expect("daemon");
    wait_status(
        &d,
        Duration::from_secs(60),
        "the block programs to come off",
        |s| s["block_attached"] == false,
    );
    assert_eq!(reason(&d, reader.tid), "block_detached");
    d.stop().expect("daemon stop");
    drop(reader);
}
