//! The hard-IRQ deschedule testbed (testbeds/irq-steal) on the real kernel: it steals what
//! its plan asks, nothing runs on a CPU during a window, perf throttling comes back however
//! the controller ends, and a plan beyond the bounds never loads. Root only (BPF, perf
//! events on whole CPUs, a sysctl), except the refusal.

use irq_steal::{
    read_perf_cpu_time_max_percent, CpuPlan, IrqSteal, Plan, Schedule, StealReport, Window,
};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use vmigrater_testbed::{assert_cpus, assert_root, workspace_bin};

/// One stealing run at a time (the machine-wide lock would refuse a second anyway).
static SERIAL: Mutex<()> = Mutex::new(());

const MS: u64 = 1_000_000;

fn run(schedule: &str, cpus: &[usize], length: Duration) -> (Plan, StealReport) {
    let plan = schedule
        .parse::<Schedule>()
        .unwrap()
        .plan(cpus, length)
        .unwrap();
    let steal = IrqSteal::start(&plan).expect("start");
    os_layer::sleep_until(steal.start_ns() + plan.length_ns + MS);
    (plan, steal.stop().expect("stop"))
}

/// The sysctl's value from before any run: a value of 0 here means an earlier run leaked
/// it, and the restore checks below would prove nothing.
fn throttle_before() -> String {
    let v = read_perf_cpu_time_max_percent().unwrap();
    assert_ne!(
        v, "0",
        "kernel.perf_cpu_time_max_percent is already 0 before the test: an earlier run \
         leaked it (set it back, default 25)"
    );
    v
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn anti_phase_steals_what_it_asks() {
    assert_root();
    assert_cpus(2);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (_, report) = run("anti:20000:10000", &[0, 1], Duration::from_secs(3));
    eprint!("{report}");
    for c in &report.cpus {
        assert_eq!(c.asked_ns, 1500 * MS, "CPU {}", c.cpu);
        // Every window entered, but one in a hundred: this machine is itself a KVM guest,
        // and where its host holds the vCPU across a window's whole start no sample falls
        // inside it (seen once in CI: 149 of 150 windows, the run 15 ms late in all).
        assert!(
            c.windows - c.windows_hit <= c.windows / 100,
            "CPU {}: {} of {} 10 ms windows entered",
            c.cpu,
            c.windows_hit,
            c.windows
        );
        assert_eq!(
            c.watchdog_skips, 0,
            "CPU {}: the heartbeat went stale",
            c.cpu
        );
        // Entered at the first sample inside: late by up to a sample period each, more
        // when this machine's own host delays the timer interrupt (it is a KVM guest).
        assert!(
            c.late_ns <= c.windows * 2 * irq_steal::SAMPLE_PERIOD_NS,
            "CPU {}: late {} ns over {} windows",
            c.cpu,
            c.late_ns,
            c.windows
        );
        assert!(
            c.stolen_ns <= c.asked_ns,
            "CPU {}: stole past its windows",
            c.cpu
        );
    }
    assert!(
        report.within(0.05),
        "worst error {:.2}%",
        report.worst_error() * 100.0
    );
}

/// Gaps (relative to `start_ns`) longer than 1 ms seen by a SCHED_FIFO thread pinned to
/// `cpu` spinning on CLOCK_MONOTONIC over `[from, to)`. Nothing but interrupt context can
/// take the CPU from it, and for under a second neither the RT throttle nor the fair
/// server does.
fn spin_gaps(cpu: usize, start_ns: u64, from: u64, to: u64) -> Vec<(u64, u64)> {
    std::thread::spawn(move || {
        os_layer::set_cpus(vmigrater_testbed::gettid(), &[cpu]).expect("pin");
        let param = libc::sched_param { sched_priority: 99 };
        // SAFETY: plain syscall on this thread.
        assert_eq!(
            unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) },
            0,
            "SCHED_FIFO"
        );
        os_layer::sleep_until(start_ns + from);
        let mut gaps = Vec::new();
        let mut last = os_layer::monotonic_ns();
        while last < start_ns + to {
            let now = os_layer::monotonic_ns();
            if now - last > MS {
                gaps.push((last - start_ns, now - start_ns));
            }
            last = now;
        }
        gaps
    })
    .join()
    .unwrap()
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn nothing_runs_on_a_cpu_during_its_windows() {
    assert_root();
    assert_cpus(2);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (from, to) = (100 * MS, 700 * MS);
    for schedule in ["anti:20000:10000", "none"] {
        let plan = schedule
            .parse::<Schedule>()
            .unwrap()
            .plan(&[0, 1], Duration::from_secs(1))
            .unwrap();
        let steal = IrqSteal::start(&plan).expect("start");
        let gaps = spin_gaps(0, steal.start_ns(), from, to);
        let report = steal.stop().unwrap();
        eprintln!("{schedule}: gaps on CPU 0 {gaps:?}");
        let inside: Vec<&Window> = plan.cpus[0]
            .windows
            .iter()
            .filter(|w| w.start_ns >= from + MS && w.end_ns + MS <= to)
            .collect();
        for w in &inside {
            let covered = gaps
                .iter()
                .map(|&(a, b)| b.min(w.end_ns).saturating_sub(a.max(w.start_ns)))
                .max()
                .unwrap_or(0);
            assert!(
                covered * 10 >= w.len_ns() * 9,
                "{schedule}: window {w} on CPU 0: the spinner ran (longest gap inside it \
                 {:.3} ms); {report}",
                covered as f64 / 1e6
            );
        }
        // Gaps of 90% of a window outside every window: the program stole off its plan.
        // One is allowed: this machine's own host may take CPU 0 away for a while.
        let big = 9 * MS;
        let outside: Vec<&(u64, u64)> = gaps
            .iter()
            .filter(|(a, b)| b - a >= big && !plan.is_out(0, a + (b - a) / 2))
            .collect();
        assert!(
            outside.len() <= 1,
            "{schedule}: {} gaps of 9 ms or more on CPU 0 outside every window: {outside:?}",
            outside.len()
        );
        if schedule == "none" {
            assert!(inside.is_empty());
            assert_eq!(report.cpus[0].stolen_ns, 0);
        } else {
            assert!(inside.len() >= 25, "{} windows checked", inside.len());
        }
    }
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn perf_throttling_comes_back_after_stop() {
    assert_root();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let old = throttle_before();
    let plan = "in:20000:5000"
        .parse::<Schedule>()
        .unwrap()
        .plan(&[0], Duration::from_millis(300))
        .unwrap();
    let steal = IrqSteal::start(&plan).unwrap();
    assert_eq!(
        read_perf_cpu_time_max_percent().unwrap(),
        "0",
        "off during the run"
    );
    steal.stop().unwrap();
    assert_eq!(read_perf_cpu_time_max_percent().unwrap(), old);
    // Dropped without stop: the same.
    let steal = IrqSteal::start(&plan).unwrap();
    assert_eq!(read_perf_cpu_time_max_percent().unwrap(), "0");
    drop(steal);
    assert_eq!(read_perf_cpu_time_max_percent().unwrap(), old);
}

/// Starts the bin on a long schedule and waits until it has turned throttling off.
fn spawn_bin() -> std::process::Child {
    let child = Command::new(workspace_bin("irq-steal"))
        .args([
            "run",
            "--schedule",
            "anti:20000:10000",
            "--secs",
            "30",
            "--cpus",
            "0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn irq-steal");
    let deadline = Instant::now() + Duration::from_secs(10);
    while read_perf_cpu_time_max_percent().unwrap() != "0" {
        assert!(
            Instant::now() < deadline,
            "the bin never turned throttling off"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

fn comes_back(old: &str, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let v = read_perf_cpu_time_max_percent().unwrap();
        if v == old {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < within,
            "kernel.perf_cpu_time_max_percent still {v} {within:?} after the controller \
             ended (was {old})"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn perf_throttling_comes_back_after_sigkill_and_sigterm() {
    assert_root();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let old = throttle_before();

    let mut child = spawn_bin();
    std::thread::sleep(Duration::from_millis(200));
    child.kill().unwrap(); // SIGKILL: no destructor runs, the watchdog restores
    let status = child.wait().unwrap();
    assert_eq!(status.code(), None, "killed by a signal");
    let took = comes_back(&old, Duration::from_secs(2));
    eprintln!("restored {took:?} after SIGKILL");

    let mut child = spawn_bin();
    std::thread::sleep(Duration::from_millis(200));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let out = {
        let mut s = String::new();
        use std::io::Read;
        child.stdout.take().unwrap().read_to_string(&mut s).unwrap();
        s
    };
    let status = child.wait().unwrap();
    assert!(status.success(), "SIGTERM ends the run cleanly: {status}");
    assert!(out.contains("stolen_ms"), "the report is printed: {out}");
    assert_eq!(
        read_perf_cpu_time_max_percent().unwrap(),
        old,
        "restored by the bin itself"
    );
}

#[test]
fn a_plan_beyond_the_bounds_never_loads() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = read_perf_cpu_time_max_percent().ok();
    let w = |s: u64, e: u64| Window {
        start_ns: s * MS,
        end_ns: e * MS,
    };
    let plan = Plan {
        cpus: vec![CpuPlan {
            cpu: 0,
            windows: vec![w(0, 10), w(20, 80)],
        }],
        length_ns: 100 * MS,
    };
    let e = format!("{:#}", IrqSteal::start(&plan).err().expect("refused"));
    assert!(
        e.contains("CPU 0 window 1") && e.contains("60.000 ms long"),
        "the error names the window: {e}"
    );
    assert_eq!(
        read_perf_cpu_time_max_percent().ok(),
        before,
        "nothing touched"
    );
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_stopped_controller_gives_the_cpus_back() {
    assert_root();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let old = throttle_before();
    let mut child = spawn_bin();
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let longest = |gaps: &[(u64, u64)]| gaps.iter().map(|(a, b)| b - a).max().unwrap_or(0);
    let now = os_layer::monotonic_ns();
    let stealing = spin_gaps(0, now, 50 * MS, 150 * MS);
    assert!(
        longest(&stealing) >= 9 * MS,
        "the bin steals 10 ms windows on CPU 0: gaps {stealing:?}"
    );
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    // The heartbeat goes stale after 100 ms; a window already entered lasts at most 10.
    let now = os_layer::monotonic_ns();
    let stopped = spin_gaps(0, now, 150 * MS, 450 * MS);
    child.kill().unwrap();
    child.wait().unwrap();
    comes_back(&old, Duration::from_secs(2));
    // This machine is itself a guest: its host takes CPU 0 away now and then (gaps of 1-6 ms
    // seen under CI load), so one gap proves nothing. A program still stealing would take a
    // whole 10 ms window every 20 ms: 15 such gaps and half of the 300 ms.
    let whole = stopped.iter().filter(|(a, b)| b - a >= 9 * MS).count();
    let total: u64 = stopped.iter().map(|(a, b)| b - a).sum();
    assert!(
        whole <= 2 && total < 75 * MS,
        "CPU 0 still taken away with the controller stopped: {whole} gaps of 9 ms or more, \
         {:.1} ms in all of 300: {stopped:?}",
        total as f64 / 1e6
    );
}

/// CPU time the kernel charged a busy fair thread pinned on CPU 1 over a 2 s run of 10 ms
/// windows every 20 ms there, against the wall time, with the windows' time charged as
/// `accounting` says.
fn busy_thread_charged(accounting: irq_steal::Accounting) -> (u64, u64, StealReport) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut set = nix::sched::CpuSet::new();
            set.set(1).unwrap();
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).unwrap();
            let tid = nix::unistd::gettid().as_raw();
            // Well above anything else fair that may share CPU 1, so the windows land on it.
            // SAFETY: plain syscall on this thread.
            assert_eq!(
                unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, -10) },
                0
            );
            tx.send(tid).unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        })
    };
    let tid = rx.recv().unwrap();
    let charged = || -> u64 {
        let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).unwrap();
        s.split_whitespace().next().unwrap().parse().unwrap()
    };
    let plan = "anti:20000:10000"
        .parse::<Schedule>()
        .unwrap()
        .plan(&[1], Duration::from_secs(2))
        .unwrap();
    let steal = IrqSteal::start_with(&plan, accounting).expect("start");
    os_layer::sleep_until(steal.start_ns());
    let (t0, c0) = (os_layer::monotonic_ns(), charged());
    os_layer::sleep_until(steal.start_ns() + plan.length_ns);
    let (t1, c1) = (os_layer::monotonic_ns(), charged());
    let report = steal.stop().expect("stop");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    busy.join().unwrap();
    (c1 - c0, t1 - t0, report)
}

/// This kernel has no IRQ time accounting: a window is charged to the fair task it
/// interrupts unless the CPU's absorber is the one running when the window starts.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn absorbed_windows_are_charged_to_no_fair_task() {
    assert_root();
    assert_cpus(2);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (charged, wall, report) = busy_thread_charged(irq_steal::Accounting::Interrupted);
    eprint!("interrupted: charged {charged} ns of {wall}\n{report}");
    let stolen = report.cpus[0].stolen_ns;
    assert!(report.within(0.05), "{report}");
    assert_eq!(
        report.cpus[0].absorbed_ns, 0,
        "no absorber, nothing absorbed"
    );
    // The negative control: the busy thread is billed (nearly) the whole wall time,
    // the stolen half included.
    assert!(
        charged > wall - stolen / 5,
        "interrupted: the busy thread was charged {charged} ns of {wall} with {stolen} stolen"
    );

    let (charged, wall, report) = busy_thread_charged(irq_steal::Accounting::Absorbed);
    eprint!("absorbed: charged {charged} ns of {wall}\n{report}");
    let c = &report.cpus[0];
    assert!(report.within(0.05), "{report}");
    assert!(
        c.absorbed_fraction() >= 0.9,
        "the absorber was the task interrupted in only {:.1}% of the stolen time",
        c.absorbed_fraction() * 100.0
    );
    assert!(
        charged < wall - c.stolen_ns * 4 / 5,
        "absorbed: the busy thread was still charged {charged} ns of {wall} with {} stolen",
        c.stolen_ns
    );
}

/// Three vCPUs per CPU (each CPU out 20 ms of every 30, both out together 10 of every 30)
/// with a hog on each CPU: a plan the 60% bound refused, allowed now that its stretches
/// are short and the machine runs somewhere two thirds of the time. The machine keeps
/// answering: a normal thread that sleeps 1 ms at a time is never held back anywhere near
/// the liveness bound, and the run steals what it asked.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn three_vcpus_per_cpu_steal_what_they_ask_and_the_machine_answers() {
    assert_root();
    assert_cpus(2);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let hogs: Vec<_> = (0..2)
        .map(|cpu| vmigrater_testbed::workload::spawn_hog(Some(cpu)).expect("hog"))
        .collect();
    let plan = "anti:30000:20000"
        .parse::<Schedule>()
        .unwrap()
        .plan(&[0, 1], Duration::from_secs(3))
        .expect("a 3:1 plan passes the bounds");
    let steal = IrqSteal::start(&plan).expect("start");
    let mut longest = Duration::ZERO;
    while os_layer::monotonic_ns() < steal.start_ns() + plan.length_ns {
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        longest = longest.max(t.elapsed());
    }
    let report = steal
        .stop()
        .expect("the run ends without a liveness failure");
    for h in hogs {
        h.stop().expect("hog");
    }
    eprint!("longest 1 ms sleep: {longest:?}\n{report}");
    assert!(report.within(0.05), "{report}");
    assert!(
        longest < irq_steal::ANSWER_WITHIN / 2,
        "a normal thread waited {longest:?} for a CPU at 3:1"
    );
}

/// When the liveness thread stops saying that it ran (as when no normal task can run), the
/// controller stops stealing within the liveness bound and the run fails saying so: CPU 0
/// runs without gaps of a window's length from then on.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_machine_that_stops_answering_stops_the_run() {
    assert_root();
    assert_cpus(2);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let plan = "anti:30000:20000"
        .parse::<Schedule>()
        .unwrap()
        .plan(&[0, 1], Duration::from_secs(4))
        .unwrap();
    let steal = IrqSteal::start_with(&plan, irq_steal::Accounting::Interrupted).expect("start");
    os_layer::sleep_until(steal.start_ns() + 300 * MS);
    let stealing = spin_gaps(0, steal.start_ns(), 300 * MS, 500 * MS);
    steal.silence_liveness();
    // The bound, and a window already entered, later: nothing more is taken.
    let after = spin_gaps(
        0,
        steal.start_ns(),
        900 * MS + irq_steal::ANSWER_WITHIN.as_nanos() as u64,
        1500 * MS + irq_steal::ANSWER_WITHIN.as_nanos() as u64,
    );
    let e = format!("{:#}", steal.stop().expect_err("the run must fail"));
    eprintln!("{e}\nbefore: {stealing:?}\nafter: {after:?}");
    assert!(e.contains("the machine stopped answering"), "{e}");
    let whole = |gaps: &[(u64, u64)]| gaps.iter().filter(|(a, b)| b - a >= 15 * MS).count();
    assert!(whole(&stealing) >= 4, "not stealing before: {stealing:?}");
    assert!(
        whole(&after) <= 1,
        "CPU 0 still taken away after the liveness bound: {after:?}"
    );
}
