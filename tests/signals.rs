//! Issue 27's stress test: every signal a user, systemd, logrotate or a shell may send
//! (HUP, USR1, USR2, PIPE, INT, TERM, QUIT), each sent at a random moment of start-up,
//! steady state or shutdown, `VMIGRATER_SIGNAL_ROUNDS` times (100 by default) for each
//! program. After every round: the program exited 0 (the documented status after a stop
//! signal; the non-stopping ones are followed by a SIGTERM), no panic in its log, and
//! nothing it manages is left changed — the guest daemon's I/O-bound reader has its
//! original CPU mask, the agent's vCPU threads their nice, slice and mask. The random
//! seed is printed, and `VMIGRATER_SIGNAL_SEED` replays a run. Root only.

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::io::Write;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use steal_emulator::{Emulator, Pattern};
use vmigrater_testbed::host::{nice_of, Agent, Hogs};
use vmigrater_testbed::signals::{
    spawn_daemon, stops, wait_signals_blocked, Guarded, OPERATOR_SIGNALS,
};
use vmigrater_testbed::{assert_cpus, assert_root, workload, workspace_bin};

fn rounds() -> usize {
    std::env::var("VMIGRATER_SIGNAL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
}

fn rng() -> fastrand::Rng {
    let seed = std::env::var("VMIGRATER_SIGNAL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    eprintln!("VMIGRATER_SIGNAL_SEED={seed}");
    fastrand::Rng::with_seed(seed)
}

#[derive(Clone, Copy, Debug)]
enum Phase {
    StartUp,
    Steady,
    Shutdown,
}

fn pick(rng: &mut fastrand::Rng) -> (Phase, Signal) {
    let phase = [Phase::StartUp, Phase::Steady, Phase::Shutdown][rng.usize(..3)];
    (phase, OPERATOR_SIGNALS[rng.usize(..OPERATOR_SIGNALS.len())])
}

fn send(pid: u32, sig: Signal) {
    kill(Pid::from_raw(pid as i32), sig).expect("kill");
}

/// Waits for `child` to exit; panics after 20 s.
fn exit_of(child: &mut Child, what: &str) -> ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st;
        }
        if t0.elapsed() > Duration::from_secs(20) {
            panic!("{what}: still running 20 s after its stop signal");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends the round's signal in its phase (`ready` says when start-up is over), then
/// SIGTERM where the signal does not stop the program, checking it is still running.
fn play(
    rng: &mut fastrand::Rng,
    child: &mut Child,
    phase: Phase,
    sig: Signal,
    ready: &dyn Fn() -> bool,
) -> ExitStatus {
    let pid = child.id();
    wait_signals_blocked(pid);
    let what = format!("{sig} in {phase:?}");
    match phase {
        Phase::StartUp => {
            std::thread::sleep(Duration::from_micros(rng.u64(0..300_000)));
            send(pid, sig);
        }
        Phase::Steady | Phase::Shutdown => {
            let t0 = Instant::now();
            while !ready() {
                assert!(child.try_wait().unwrap().is_none(), "{what}: exited early");
                assert!(
                    t0.elapsed() < Duration::from_secs(20),
                    "{what}: never ready"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            std::thread::sleep(Duration::from_micros(rng.u64(0..200_000)));
            if matches!(phase, Phase::Shutdown) {
                send(pid, Signal::SIGTERM);
                std::thread::sleep(Duration::from_micros(rng.u64(0..20_000)));
            }
            send(pid, sig);
        }
    }
    if !stops(sig) && !matches!(phase, Phase::Shutdown) {
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            child.try_wait().unwrap().is_none(),
            "{what}: the program ended"
        );
        send(pid, Signal::SIGTERM);
    }
    exit_of(child, &what)
}

fn anti_phase() -> Vec<Pattern> {
    vec![
        "0:10000:10000:0".parse().expect("pattern"),
        "1:10000:10000:10000".parse().expect("pattern"),
    ]
}

/// An O_DIRECT reader process; its reader thread's tid.
fn reader(file: &Path) -> (Guarded, u32) {
    let child = Guarded(
        Command::new(workspace_bin("vmigrater-workload"))
            .arg("--file")
            .arg(file)
            .args(["--pattern", "random4k", "--readers", "1"])
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn vmigrater-workload"),
    );
    let pid = child.id();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        if let Some(&tid) = vmigrater_testbed::workload::threads_named(pid, "reader-").first() {
            return (child, tid);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("reader thread did not start");
}

fn daemon_status(state_dir: &Path) -> Option<serde_json::Value> {
    let out = Command::new(workspace_bin("vmigrater"))
        .args(["status", "--json", "--state-dir"])
        .arg(state_dir)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

/// The guest daemon under emulated steal with an I/O-bound reader it moves: whatever
/// signal comes when, the reader has its original mask after every round.
#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn every_operator_signal_at_any_moment_leaves_the_guest_daemon_clean() {
    assert_root();
    assert_cpus(2);
    let mut rng = rng();
    let data = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("daemon-test-data.bin");
    workload::prepare_file(&data, 256 << 20).expect("prepare data file");
    let (_reader, tid) = reader(&data);
    let original = os_layer::get_cpus(tid).unwrap();
    let emu = Emulator::start(&anti_phase(), 50).expect("steal emulator");
    let config_dir = tempfile::tempdir().unwrap();
    let config = config_dir.path().join("vmigrater.toml");
    std::fs::write(
        &config,
        "[monitor]\nsource = \"sleepers\"\n\n[migration]\nguard = false\nfollow_completions = false\n",
    )
    .unwrap();
    let (mut restored_rounds, t0) = (0, Instant::now());
    for round in 0..rounds() {
        let (phase, sig) = pick(&mut rng);
        let state = tempfile::tempdir().unwrap();
        let log = state.path().join("log");
        let mut child = spawn_daemon(&config, state.path(), &log);
        // Steady state: the reader managed, if that comes within a second.
        let ready = || {
            if daemon_status(state.path()).is_none() {
                return false;
            }
            let since = Instant::now();
            while since.elapsed() < Duration::from_secs(1) {
                let managed = daemon_status(state.path()).is_some_and(|s| {
                    s["tasks"]
                        .as_array()
                        .is_some_and(|ts| ts.iter().any(|t| t["tid"] == tid))
                });
                if managed {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            true
        };
        let st = play(&mut rng, &mut child.0, phase, sig, &ready);
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let what = format!("round {round}: {sig} in {phase:?}");
        assert!(st.success(), "{what}: exited with {st}\n{text}");
        assert!(!text.contains("panicked"), "{what}:\n{text}");
        assert_eq!(
            os_layer::get_cpus(tid).unwrap(),
            original,
            "{what}: the reader was left with a changed mask\n{text}"
        );
        if text
            .lines()
            .any(|l| l.contains("restored original affinity") && !l.contains("restored=0"))
        {
            restored_rounds += 1;
        }
    }
    emu.stop();
    eprintln!(
        "{} rounds in {:?}, {restored_rounds} of them with the reader moved and restored",
        rounds(),
        t0.elapsed()
    );
    assert!(
        restored_rounds * 10 >= rounds(),
        "only {restored_rounds} rounds had a task to restore: the test did not test restores"
    );
}

/// A guest on the hint socket that reconnects whenever the agent does: hello, then a
/// report every 25 ms saying vCPU 0 carries I/O, until `stop`.
fn serve_guest(listener: UnixListener, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let Ok((mut g, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            let _ = g.set_nonblocking(false);
            let _ = g.set_write_timeout(Some(Duration::from_millis(200)));
            let hello = "{\"type\":\"hello\",\"version\":1,\"agent\":\"test\",\"vcpus\":1}\n";
            let mut seq = 0;
            let mut ok = g.write_all(hello.as_bytes()).is_ok();
            while ok && !stop.load(Ordering::Relaxed) {
                seq += 1;
                let r = format!(
                    "{{\"type\":\"report\",\"seq\":{seq},\"period_ms\":50,\"vcpus\":[{{\"cpu\":0,\"io_completions\":200,\"io_interval_ema_us\":500,\"io_bound_tasks\":1,\"inactive_ratio\":0.0,\"slice_estimate_us\":1000}}]}}\n"
                );
                ok = g.write_all(r.as_bytes()).is_ok();
                std::thread::sleep(Duration::from_millis(25));
            }
        }
    })
}

/// The host agent weighting two VMs' vCPU threads (CPU hogs) from a guest's reports and
/// placing the I/O VM's thread (Algorithm 2): whatever signal comes when, every thread
/// has its nice, slice and mask back after every round.
#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn every_operator_signal_at_any_moment_leaves_the_agents_threads_clean() {
    assert_root();
    assert_cpus(2);
    let mut rng = rng();
    let hogs = Hogs::start(&[0, 0]);
    let (a, b) = (hogs.tids[0], hogs.tids[1]);
    // Both CPUs allowed, so that the agent's placement changes the I/O vCPU's mask.
    os_layer::set_cpus(a, &[0, 1]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("io.sock");
    let stop = Arc::new(AtomicBool::new(false));
    let guest = serve_guest(UnixListener::bind(&sock).unwrap(), stop.clone());
    let body = format!(
        "share = \"isacs\"\n\n[[vm]]\nname = \"io\"\nhint_socket = {:?}\nvcpu_threads = [{a}]\nhost_cpus = [0, 1]\n\n[[vm]]\nname = \"cpu\"\nvcpu_threads = [{b}]\n",
        sock.display().to_string()
    );
    let before = |t: u32| {
        (
            nice_of(t),
            os_layer::sched::get_attr(t).unwrap().sched_runtime,
            os_layer::get_cpus(t).unwrap(),
        )
    };
    let originals = [before(a), before(b)];
    let (mut changed_rounds, t0) = (0, Instant::now());
    for round in 0..rounds() {
        let (phase, sig) = pick(&mut rng);
        let mut agent = Agent::start(dir.path(), &body);
        let mut child = Guarded(agent.child.take().unwrap());
        let seen_change = std::cell::Cell::new(false);
        // Steady state: the agent has changed a thread, if that comes within a second.
        let ready = || {
            if agent.status().is_none() {
                return false;
            }
            let since = Instant::now();
            while since.elapsed() < Duration::from_secs(1) {
                if [before(a), before(b)] != originals {
                    seen_change.set(true);
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            true
        };
        let st = play(&mut rng, &mut child.0, phase, sig, &ready);
        let text = std::fs::read_to_string(&agent.log).unwrap_or_default();
        let what = format!("round {round}: {sig} in {phase:?}");
        assert!(st.success(), "{what}: exited with {st}\n{text}");
        assert!(!text.contains("panicked"), "{what}:\n{text}");
        assert_eq!(
            [before(a), before(b)],
            originals,
            "{what}: a vCPU thread was left changed (nice, slice, mask)\n{text}"
        );
        changed_rounds += usize::from(seen_change.get());
    }
    stop.store(true, Ordering::Relaxed);
    let _ = guest.join();
    eprintln!(
        "{} rounds in {:?}, {changed_rounds} of them signalled with a thread changed",
        rounds(),
        t0.elapsed()
    );
    assert!(
        changed_rounds * 10 >= rounds(),
        "only {changed_rounds} rounds had a change to restore: the test did not test restores"
    );
}
