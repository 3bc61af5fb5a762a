//! `vmigrater explain` against a real daemon on the real kernel: each reason with a thread
//! placed in that situation (O_DIRECT readers, a CPU hog, a real-time reader pinned by its
//! owner, an excluded command, a kernel thread, the daemon's own, a mask changed behind the
//! daemon, no contention, the block programs detached, the move guard holding, vCPUs out
//! all at once with a reader kept where its completions land and one that cannot be).
//! Root (CI is); otherwise reported ignored, and run by another user they fail
//! (`assert_root`).

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

/// The steal emulator taking the CPUs away on these patterns (`cpu:period:out:offset`, µs).
fn steal(patterns: &[&str]) -> Emulator {
    let patterns: Vec<Pattern> = patterns
        .iter()
        .map(|p| p.parse().expect("pattern"))
        .collect();
    Emulator::start(&patterns, 50).expect("steal emulator")
}

/// The daemon's overall lines (`explain` without a target).
fn overall(d: &BenchDaemon) -> Vec<String> {
    let whole = d.explain(None).expect("explain");
    whole["daemon"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l.as_str().map(String::from))
        .collect()
}

/// A cgroup v1 cpuset holding one thread, which leaves it on drop. `None` where no v1
/// cpuset hierarchy is mounted (cgroup v2 moves whole processes, not one thread of ours).
struct Cpuset {
    dir: PathBuf,
    tid: u32,
}

impl Cpuset {
    const ROOT: &'static str = "/sys/fs/cgroup/cpuset";

    fn put(tid: u32, cpus: &str) -> Option<Cpuset> {
        let root = PathBuf::from(Self::ROOT);
        let mems = std::fs::read_to_string(root.join("cpuset.mems")).ok()?;
        let dir = root.join(format!("vmigrater-explain-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("cpuset cgroup");
        let write = |file: &str, v: &str| {
            std::fs::write(dir.join(file), v).unwrap_or_else(|e| panic!("{file} = {v}: {e}"))
        };
        write("cpuset.mems", mems.trim());
        write("cpuset.cpus", cpus);
        write("tasks", &tid.to_string());
        Some(Cpuset { dir, tid })
    }
}

impl Drop for Cpuset {
    fn drop(&mut self) {
        let _ = std::fs::write(
            PathBuf::from(Self::ROOT).join("tasks"),
            self.tid.to_string(),
        );
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Puts thread `tid` in the round-robin real-time class at priority 1.
fn make_real_time(tid: u32) {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: a plain syscall on a thread id with a valid parameter block.
    let rc = unsafe { libc::sched_setscheduler(tid as libc::pid_t, libc::SCHED_RR, &param) };
    assert_eq!(
        rc,
        0,
        "SCHED_RR for {tid}: {}",
        std::io::Error::last_os_error()
    );
}

/// Under deschedules in anti-phase (the steal emulator), with the planner alone (no guard,
/// no completion keeping): a reader is managed; a real-time reader its owner pinned to one
/// CPU, and a reader whose cpuset allows one, are managed with nowhere to go (the class is
/// shown, it is no reason to leave a task); an excluded reader is found and left; a hog is not
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
    make_real_time(pinned.tid);
    let fenced = workload::spawn_io(
        &file,
        IoSpec {
            seed: 13,
            ..IoSpec::new(ReadPattern::Random4k)
        },
    )
    .expect("reader in a cpuset");
    let cpuset = Cpuset::put(fenced.tid, "1");
    if cpuset.is_none() {
        eprintln!(
            "NOT CHECKED: a reader whose cpuset allows one vCPU (no cgroup v1 cpuset at {})",
            Cpuset::ROOT
        );
    }
    let excluded = workload::spawn_reader(&file, ReadPattern::Seq128k).expect("seq reader");
    let hog = workload::spawn_hog(None).expect("hog");
    let emu = steal(&["0:10000:10000:0", "1:10000:10000:10000"]);
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
                && (cpuset.is_none() || in_list(s, "tasks", fenced.tid))
                && in_list(s, "seen", excluded.tid)
        },
    );
    assert_eq!(reason(&d, reader.tid), "managed");
    // What the detector saw: between block-tracking samples a window can find nothing, so
    // the next window that finds the reader.
    let t0 = Instant::now();
    let e = loop {
        let e = explained(&d, reader.tid);
        if !e["detector"].is_null() || t0.elapsed() > Duration::from_secs(10) {
            break e;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(e["reason"], "managed", "{e:#}");
    assert!(
        e["detector"]["io_fraction"]
            .as_f64()
            .is_some_and(|f| f > 0.0),
        "{e:#}"
    );
    let e = explained(&d, pinned.tid);
    assert_eq!(e["reason"], "one_vcpu", "{e:#}");
    assert_eq!(e["thread"]["class"], "rr", "{e:#}");
    if cpuset.is_some() {
        let e = explained(&d, fenced.tid);
        assert_eq!(e["reason"], "one_vcpu", "{e:#}");
        assert_eq!(e["thread"]["allowed"], serde_json::json!([1]), "{e:#}");
    }
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
    assert!(
        overall(&d).iter().any(|l| l == "moves: allowed"),
        "{whole:#}"
    );
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
    // sched_setaffinity has no compare-and-set: a move of the daemon's that read the mask
    // just before our write overwrites it, and then there is no change left to see. That
    // window is microseconds wide; where it was hit, write once more.
    std::thread::sleep(Duration::from_millis(500));
    if os_layer::get_cpus(reader.tid).unwrap().len() == 1 {
        eprintln!("our mask was overwritten by a move in flight: setting it again");
        os_layer::set_cpus(reader.tid, &[0, 1]).expect("set the reader's mask");
    }
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
    drop(cpuset);
    drop((reader, pinned, fenced, excluded, hog));
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

/// vCPU 0 out half the time, vCPU 1 always running, and a reader at a fixed offered load
/// that the disk keeps up with from either vCPU (it catches up after each deschedule): the
/// reader is I/O-bound by its rate and moves cannot raise the guest's block I/O. The guard
/// (planner moves, which must win every pair of epochs) measures that and holds moves, and
/// `explain` says so, for the reader and for the daemon; the reader has its own mask.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn explain_says_when_the_move_guard_holds() {
    assert_root();
    assert_cpus(2);
    let file = data_file();
    let reader = workload::spawn_io(
        &file,
        IoSpec {
            rate: Some(1500),
            ..IoSpec::new(ReadPattern::Random4k)
        },
    )
    .expect("paced reader");
    let emu = steal(&["0:10000:10000:0"]);
    let d = BenchDaemon::start(
        "[monitor]\nsource = \"sleepers\"\n\n[migration]\nfollow_completions = false\n\n[advanced.migration]\nguard_epoch_ms = 500\n[channel]\nenabled = false\n",
        &[],
    )
    .expect("daemon");
    wait_status(&d, Duration::from_secs(60), "the guard to hold", |s| {
        s["move_gate"] == "guard_holding"
    });
    let e = explained(&d, reader.tid);
    assert_eq!(e["reason"], "guard_holding", "{e:#}");
    assert!(
        overall(&d)
            .iter()
            .any(|l| l.starts_with("moves: held by the move guard")),
        "{:#?}",
        overall(&d)
    );
    let s = d.status().expect("status");
    assert!(s["guard_holds"].as_u64().unwrap_or(0) >= 1, "{s:#}");
    assert_eq!(os_layer::get_cpus(reader.tid).unwrap(), vec![0, 1]);
    d.stop().expect("daemon stop");
    let _ = emu.stop();
    drop(reader);
}

/// Both vCPUs out at once (in phase, hard-IRQ deschedules): no move to a running vCPU can pay, only keeping a
/// reader on the vCPU its completions land on (the disk's interrupt vCPU). A reader free to
/// run anywhere is kept there; a reader its owner pinned to the other vCPU cannot be, and
/// `explain` says that vCPUs go out all at once.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn explain_says_when_vcpus_go_out_together() {
    assert_root();
    assert_cpus(2);
    let file = data_file();
    let free = workload::spawn_reader(&file, ReadPattern::Random4k).expect("reader");
    // Hard-IRQ deschedules, invisible to the guest's scheduler as a hypervisor's are (with
    // the steal emulator's RT spinners in phase, the monitor found no vCPU out).
    let plan = "in:20000:10000"
        .parse::<irq_steal::Schedule>()
        .expect("schedule")
        .plan(&[0, 1], Duration::from_secs(60))
        .expect("plan");
    let steal = irq_steal::IrqSteal::start(&plan).expect("irq-steal");
    let d = BenchDaemon::start("[channel]\nenabled = false\n", &[]).expect("daemon");
    wait_status(
        &d,
        Duration::from_secs(30),
        "the free reader kept with its completions",
        |s| s["out_together"] == true && in_list(s, "kept_with_completions", free.tid),
    );
    let e = explained(&d, free.tid);
    assert_eq!(e["reason"], "kept_with_completions", "{e:#}");
    let home = e["placed_on"].as_u64().expect("placed_on") as usize;
    assert_eq!(os_layer::get_cpus(free.tid).unwrap(), vec![home]);

    let other = 1 - home;
    let pinned = workload::spawn_io(
        &file,
        IoSpec {
            pin: Some(other),
            seed: 11,
            ..IoSpec::new(ReadPattern::Random4k)
        },
    )
    .expect("pinned reader");
    wait_status(
        &d,
        Duration::from_secs(30),
        "the pinned reader found and left",
        |s| {
            s["out_together"] == true
                && in_list(s, "seen", pinned.tid)
                && !in_list(s, "tasks", pinned.tid)
                && !in_list(s, "kept_with_completions", pinned.tid)
        },
    );
    let e = explained(&d, pinned.tid);
    assert_eq!(e["reason"], "out_together", "{e:#}");
    assert!(
        overall(&d)
            .iter()
            .any(|l| l.starts_with("moves: vCPUs go out all at once")),
        "{:#?}",
        overall(&d)
    );
    d.stop().expect("daemon stop");
    drop(steal);
    assert_eq!(os_layer::get_cpus(free.tid).unwrap(), vec![0, 1]);
    assert_eq!(os_layer::get_cpus(pinned.tid).unwrap(), vec![other]);
    drop((free, pinned));
}
