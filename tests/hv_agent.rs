//! `vmigrater-hv-agent` on real threads (issue 3): a hostile guest floods maximal I/O
//! reports for VM "liar"; both VMs' vCPU threads are real CPU hogs pinned to one host
//! CPU. The liar must gain no CPU share (measured from the threads' CPU time), the agent
//! must really change the threads' scheduling, and restore it on SIGTERM. Root only.

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vmigrater_testbed::{require_root, workspace_bin};

fn nice_of(tid: u32) -> i32 {
    // SAFETY: getpriority has no memory arguments; errno is cleared first.
    unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, tid)
    }
}

fn cpu_ns(tid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn hog_tids(pid: u32) -> Vec<u32> {
    let mut tids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|tid| {
            std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                .is_ok_and(|c| c.starts_with("cpu-hog"))
        })
        .collect();
    tids.sort_unstable();
    tids
}

#[test]
fn a_lying_guest_gains_no_cpu_and_everything_is_restored() {
    if !require_root("a_lying_guest_gains_no_cpu_and_everything_is_restored") {
        return;
    }
    // Two hogs pinned to CPU 0 stand in for one vCPU thread of each VM.
    let file = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hv-agent-dummy.bin");
    vmigrater_testbed::workload::prepare_file(&file, 1 << 20).unwrap();
    let mut workload = Command::new(workspace_bin("vmigrater-workload"))
        .arg("--file")
        .arg(&file)
        .args(["--readers", "0", "--hogs", "2", "--pin-hogs"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let mut tids = Vec::new();
    while tids.len() < 2 && t0.elapsed() < Duration::from_secs(5) {
        tids = hog_tids(workload.id());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(tids.len(), 2, "hog threads not found");
    // --pin-hogs pins hog i to CPU i; put both on CPU 0 so they share one run queue.
    let mut set = nix::sched::CpuSet::new();
    set.set(0).unwrap();
    for &t in &tids {
        nix::sched::sched_setaffinity(Pid::from_raw(t as i32), &set).unwrap();
    }
    let (liar, honest) = (tids[0], tids[1]);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("liar.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "period_ms = 50\nbackend = \"kvm-qemu\"\n\n[[vm]]\nname = \"liar\"\nhint_socket = {:?}\nvcpu_threads = [{liar}]\n\n[[vm]]\nname = \"honest\"\nvcpu_threads = [{honest}]\n",
            sock.display().to_string()
        ),
    )
    .unwrap();
    let mut agent = Command::new(workspace_bin("vmigrater-hv-agent"))
        .arg("--config")
        .arg(&config)
        .args(["--log", "debug", "run"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Play the hostile guest: maximal I/O figures, as fast as the rate limit allows.
    let (mut guest, _) = listener.accept().unwrap();
    guest
        .write_all(b"{\"type\":\"hello\",\"version\":1,\"agent\":\"liar\",\"vcpus\":1}\n")
        .unwrap();
    let (liar0, honest0) = (cpu_ns(liar), cpu_ns(honest));
    let mut seen_nice = (0, 0);
    let t0 = Instant::now();
    let mut seq = 0;
    while t0.elapsed() < Duration::from_secs(3) {
        seq += 1;
        let line = format!(
            "{{\"type\":\"report\",\"seq\":{seq},\"period_ms\":50,\"vcpus\":[{{\"cpu\":0,\"io_completions\":18446744073709551615,\"io_interval_ema_us\":1e12,\"io_bound_tasks\":4294967295,\"inactive_ratio\":0.0,\"slice_estimate_us\":1e12}}]}}\n"
        );
        guest.write_all(line.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(25));
        seen_nice = (
            seen_nice.0.max(nice_of(liar)),
            seen_nice.1.min(nice_of(honest)),
        );
    }
    let (dl, dh) = (cpu_ns(liar) - liar0, cpu_ns(honest) - honest0);
    let share = dl as f64 / (dl + dh) as f64;
    kill(Pid::from_raw(agent.id() as i32), Signal::SIGTERM).unwrap();
    let status = agent.wait().unwrap();
    let mut log = String::new();
    agent
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    let restored = (nice_of(liar), nice_of(honest));
    let _ = workload.kill();
    let _ = workload.wait();
    eprintln!("liar CPU share {share:.3} (liar {dl} ns, honest {dh} ns); nice seen liar {} honest {}; after exit {restored:?}", seen_nice.0, seen_nice.1);
    assert!(status.success(), "agent exited with {status}:\n{log}");
    assert!(log.contains("guest said hello"), "{log}");
    assert!(
        log.contains("vCPU thread re-weighted"),
        "the agent changed nothing:\n{log}"
    );
    // The core grants I/O latency, never share: the liar may not exceed its fair half.
    assert!(share <= 0.55, "the lying guest got {share:.3} of the CPU");
    assert!(
        seen_nice.1 < 0,
        "the CPU-bound VM was never compensated (CVCredit)"
    );
    assert_eq!(restored, (0, 0), "nice values not restored:\n{log}");
    assert!(log.contains("restored every scheduling change"), "{log}");
}
