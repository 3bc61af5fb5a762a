//! The kernel-timer vCPU monitor (bpf/vcputick.bpf.c) on the real kernel. This machine is
//! itself a KVM guest whose host deschedules its vCPUs for real, and the host accounts
//! every such wait in the paravirtual steal time (`/proc/stat`'s steal column): ground
//! truth from a real hypervisor. The monitor must never report more time out than the
//! host stole, and must see most of it when there is some. Root only (BPF).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use steal_emulator::{Emulator, Pattern};
use vcpu_monitor::{
    monotonic_ns, online_cpus, Demand, KernelMonitor, MonitorConfig, TickEvent, TickHook, VcpuBoard,
};
use vmigrater_testbed::{assert_root, host_steal_ns, workload};

static SERIAL: Mutex<()> = Mutex::new(());

const MS: u64 = 1_000_000;

/// Counts what the event thread hands the hook.
#[derive(Default)]
struct Counter {
    resumed: AtomicU64,
    resumed_ns: AtomicU64,
    push_checks: AtomicU64,
    /// How long after each vCPU came back the hook heard of it.
    late_ns: Mutex<Vec<u64>>,
}

impl TickHook for Counter {
    /// Holding no task anywhere: every return of a vCPU from a gap of >= 2 ms wakes the
    /// event thread (the BPF side stays silent for vCPUs that hold the daemon's tasks).
    fn holds_tasks(&self, _cpu: usize) -> bool {
        false
    }

    fn on_tick(&self, _cpu: usize, event: TickEvent, _board: &VcpuBoard, _now: u64) {
        match event {
            TickEvent::Resumed {
                inactive_ns,
                back_ns,
            } => {
                self.resumed.fetch_add(1, Relaxed);
                self.resumed_ns.fetch_add(inactive_ns, Relaxed);
                let late = monotonic_ns().saturating_sub(back_ns);
                self.late_ns.lock().unwrap().push(late);
            }
            TickEvent::Running => {
                self.push_checks.fetch_add(1, Relaxed);
            }
        }
    }
}

/// Root, two CPUs, and the machine to this test alone (the tests share the CPUs with
/// `irq-steal` and the emulator): the first lines of every test here that takes CPUs away.
fn root_on_two_cpus() -> (std::sync::MutexGuard<'static, ()>, Vec<usize>) {
    assert_root();
    vmigrater_testbed::assert_cpus(2);
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    (serial, vec![0, 1])
}

/// `irq-steal` takes `cpus` away on `schedule` for `secs` seconds; returns what it took.
fn take_cpus(schedule: &str, cpus: &[usize], secs: u64) -> irq_steal::StealReport {
    let plan = schedule
        .parse::<irq_steal::Schedule>()
        .expect("schedule")
        .plan(cpus, Duration::from_secs(secs))
        .expect("plan");
    let steal = irq_steal::IrqSteal::start(&plan).expect("irq-steal");
    std::thread::sleep(Duration::from_secs(secs) + Duration::from_millis(100));
    steal.stop().expect("stop irq-steal")
}

/// A CPU hog pinned on each CPU: busy vCPUs take the scheduler tick, the timer whose
/// lateness is the monitor's evidence.
fn hog_per_cpu(cpus: &[usize]) -> Vec<workload::Worker> {
    cpus.iter()
        .map(|&c| workload::spawn_hog(Some(c)).expect("hog"))
        .collect()
}

fn start(cpus: &[usize], hook: Arc<Counter>) -> (Arc<VcpuBoard>, KernelMonitor) {
    let cfg = MonitorConfig {
        cpus: cpus.to_vec(),
        ..MonitorConfig::default()
    };
    let board = Arc::new(VcpuBoard::new(cpus, &cfg));
    let mon = KernelMonitor::start(cfg, board.clone(), hook, Duration::from_millis(1))
        .expect("the kernel-timer programs load on this kernel");
    (board, mon)
}

/// Against the real hypervisor's steal (`/proc/stat`): every gap seen is steal (no false
/// gaps), and the resume events agree with the gaps.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn late_timers_match_the_hypervisors_steal_time() {
    assert_root();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cpus = online_cpus().expect("online CPUs");
    let hook = Arc::new(Counter::default());
    let (board, mon) = start(&cpus, hook.clone());
    board.set_demand(Demand::Active);
    let hogs = hog_per_cpu(&cpus);
    std::thread::sleep(Duration::from_millis(300));
    let before: Vec<u64> = board
        .snapshot(monotonic_ns())
        .iter()
        .map(|s| s.inactive_total_ns)
        .collect();
    let gaps_before: u64 = board
        .snapshot(monotonic_ns())
        .iter()
        .map(|s| s.deschedules)
        .sum();
    let steal0 = host_steal_ns(&cpus);
    let resumed0 = hook.resumed.load(Relaxed);
    hook.resumed_ns.store(0, Relaxed);
    std::thread::sleep(Duration::from_secs(10));
    let steal1 = host_steal_ns(&cpus);
    // Let the event thread publish what the last interval saw.
    std::thread::sleep(Duration::from_millis(150));
    let snap = board.snapshot(monotonic_ns());
    for h in hogs {
        h.stop().expect("hog");
    }
    let resumed = hook.resumed.load(Relaxed) - resumed0;
    mon.stop();

    let mut seen_total = 0;
    let mut stolen_total = 0;
    for (i, s) in snap.iter().enumerate() {
        let seen = s.inactive_total_ns - before[i];
        let stolen = steal1[i] - steal0[i];
        eprintln!(
            "cpu {}: host steal {:.1} ms, seen descheduled {:.1} ms ({} gaps, slice estimate {:.1} ms)",
            s.cpu,
            stolen as f64 / 1e6,
            seen as f64 / 1e6,
            s.deschedules,
            s.est_slice_ns as f64 / 1e6
        );
        // /proc/stat counts in 10 ms ticks; a gap's midpoint estimate may overshoot.
        assert!(
            seen <= stolen + stolen / 4 + 40 * MS,
            "cpu {}: {:.1} ms seen descheduled but the host stole only {:.1} ms: false gaps",
            s.cpu,
            seen as f64 / 1e6,
            stolen as f64 / 1e6
        );
        seen_total += seen;
        stolen_total += stolen;
    }
    let gaps: u64 = snap.iter().map(|s| s.deschedules).sum::<u64>() - gaps_before;
    eprintln!(
        "all CPUs: steal {:.1} ms, seen {:.1} ms, {gaps} gaps, {resumed} resume events",
        stolen_total as f64 / 1e6,
        seen_total as f64 / 1e6
    );
    // A wake-up of the event thread per gap of >= 2 ms while demand is active, never more
    // than the gaps (one at the window's edges may fall on either side), and never more
    // time out than was seen.
    let resumed_ns = hook.resumed_ns.load(Relaxed);
    assert!(
        resumed <= gaps + 2,
        "{resumed} resume events for {gaps} gaps"
    );
    assert!(
        resumed_ns <= seen_total + 40 * MS,
        "{:.1} ms reported in resume events, {:.1} ms seen",
        resumed_ns as f64 / 1e6,
        seen_total as f64 / 1e6
    );
    if seen_total >= 50 * MS {
        assert!(
            resumed > 0,
            "{gaps} gaps ({seen_total} ns) and no resume event"
        );
    }
    // Recall is not judged here: this host's steal is not ours to plan, and a check that
    // asserts only when the host happened to steal enough is no check. Recall is asserted on
    // every run against deschedules the test makes itself, in
    // hard_irq_deschedules_are_seen_as_gaps_of_their_length (≥ 95% of the windows as gaps,
    // the time out within the monitor's resolution per gap).
}

/// The emulator's SCHED_FIFO spinners are threads of this very kernel: the timer interrupt
/// preempts them on time, so late timers cannot see them. This is why the contention
/// benchmark and the emulator-driven tests use the sleepers, and why `check` says so.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_steal_emulator_inside_the_kernel_is_invisible_to_kernel_timers() {
    assert_root();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cpus = vec![0usize];
    let hook = Arc::new(Counter::default());
    let (board, mon) = start(&cpus, hook.clone());
    board.set_demand(Demand::Active);
    let hog = workload::spawn_hog(Some(0)).expect("hog");
    let emu = Emulator::start(
        &["0:10000:10000:0".parse::<Pattern>().expect("pattern")],
        50,
    )
    .expect("steal emulator");
    let steal0 = host_steal_ns(&cpus)[0];
    std::thread::sleep(Duration::from_secs(2));
    let records = emu.stop();
    let steal = host_steal_ns(&cpus)[0] - steal0;
    hog.stop().expect("hog");
    std::thread::sleep(Duration::from_millis(150));
    let s = board.snapshot(monotonic_ns())[0].clone();
    mon.stop();
    let emulated: u64 = records.iter().map(|r| r.stolen_ns()).sum();
    eprintln!(
        "emulated {:.0} ms, host steal {:.0} ms, seen {:.1} ms in {} gaps",
        emulated as f64 / 1e6,
        steal as f64 / 1e6,
        s.inactive_total_ns as f64 / 1e6,
        s.deschedules
    );
    assert!(emulated >= 800 * MS, "the emulator stole {emulated} ns");
    assert!(
        s.inactive_total_ns <= steal + steal / 4 + 40 * MS,
        "kernel timers saw {:.1} ms of the emulator's {:.0} ms: they must only see the host",
        s.inactive_total_ns as f64 / 1e6,
        emulated as f64 / 1e6
    );
}

/// Hypervisor-like deschedules (irq-steal: nothing runs on the CPU during a window, not
/// even its timer interrupt) are what the kernel source exists to see: each 10 ms window
/// of an anti-phase 20 ms schedule shows as a gap, and the time out as seen matches what
/// the program stole, on both CPUs.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn hard_irq_deschedules_are_seen_as_gaps_of_their_length() {
    let (_serial, cpus) = root_on_two_cpus();
    let hook = Arc::new(Counter::default());
    let (board, mon) = start(&cpus, hook.clone());
    board.set_demand(Demand::Active);
    let hogs = hog_per_cpu(&cpus);
    std::thread::sleep(Duration::from_millis(300));
    let before: Vec<(u64, u64)> = board
        .snapshot(monotonic_ns())
        .iter()
        .map(|s| (s.inactive_total_ns, s.deschedules))
        .collect();
    let steal0 = host_steal_ns(&cpus);
    let report = take_cpus("anti:20000:10000", &cpus, 3);
    let host = host_steal_ns(&cpus);
    std::thread::sleep(Duration::from_millis(150));
    let snap = board.snapshot(monotonic_ns());
    for h in hogs {
        h.stop().expect("hog");
    }
    mon.stop();
    for (i, s) in snap.iter().enumerate() {
        let c = report.cpus.iter().find(|c| c.cpu == s.cpu).expect("cpu");
        let seen = s.inactive_total_ns - before[i].0;
        let gaps = s.deschedules - before[i].1;
        let host_stole = host[i] - steal0[i];
        eprintln!(
            "cpu {}: stolen {:.1} ms in {} windows, seen {:.1} ms in {gaps} gaps (host steal {:.0} ms)",
            s.cpu,
            c.stolen_ns as f64 / 1e6,
            c.windows_hit,
            seen as f64 / 1e6,
            host_stole as f64 / 1e6
        );
        // Every window seen as one gap (measured: 150 of 150), also those that begin
        // inside a timer pass, whose next timer is on time for the pass's clock. This
        // machine's own host adds some: each of its deschedules over the 1 ms threshold is
        // a gap too (1–6 ms each, dozens a second, seen under CI load), at most one per ms.
        let host_gaps = host_stole / MS;
        assert!(
            gaps >= c.windows_hit * 95 / 100 && gaps <= c.windows_hit + 20 + host_gaps,
            "cpu {}: {gaps} gaps for {} windows",
            s.cpu,
            c.windows_hit
        );
        // The time out as seen: the stolen time, give or take the monitor's resolution
        // per gap and what the real host stole meanwhile. A gap is measured from the last
        // sign of life before it to the first after, and the signs are timer events (a
        // 4 ms tick at HZ=250): each window may be seen up to ~2.5 ms short (measured:
        // 87–98% of the stolen time over 150 windows).
        let lo = c.stolen_ns.saturating_sub(c.windows_hit * 5 * MS / 2);
        let hi = c.stolen_ns + host_stole + c.windows_hit * MS;
        assert!(
            seen >= lo && seen <= hi,
            "cpu {}: seen {:.1} ms out, stolen {:.1} ms",
            s.cpu,
            seen as f64 / 1e6,
            c.stolen_ns as f64 / 1e6
        );
    }
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_recording_holds_the_windows_irq_steal_took_and_replays() {
    let (_serial, cpus) = root_on_two_cpus();
    let hogs = hog_per_cpu(&cpus);
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("trace");
    let mut recorder = std::process::Command::new(vmigrater_testbed::workspace_bin("vmigrater"))
        .args(["record", "--secs", "3", "--out"])
        .arg(&trace)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("vmigrater record");
    // The windows start once the recorder says it records (its programs are loaded).
    let mut said = std::io::BufReader::new(recorder.stderr.take().expect("stderr"));
    let mut line = String::new();
    while !line.contains("recording the deschedules") {
        line.clear();
        let n = std::io::BufRead::read_line(&mut said, &mut line).expect("recorder's stderr");
        assert!(n > 0, "vmigrater record ended before recording");
    }
    let report = take_cpus("anti:20000:10000", &cpus, 2);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut said, &mut rest).expect("recorder's stderr");
    let status = recorder.wait().expect("wait for the recorder");
    eprintln!("vmigrater record: {}", rest.trim());
    for h in hogs {
        h.stop().expect("hog");
    }
    assert!(status.success(), "vmigrater record: {status}");
    let text = std::fs::read_to_string(&trace).expect("the trace");
    // What the recorder writes, the testbed plays back.
    let replayed = irq_steal::Schedule::Replay(trace.clone())
        .plan(&cpus, Duration::from_secs(3))
        .unwrap_or_else(|e| panic!("the recording does not replay: {e:#}\n{text}"));
    for c in &report.cpus {
        let windows = &replayed
            .cpus
            .iter()
            .find(|p| p.cpu == c.cpu)
            .expect("cpu")
            .windows;
        // irq-steal's 10 ms windows, as the monitor measures them: up to a tick (4 ms)
        // short, a little long by the event thread's delay. This machine's own host adds
        // windows of 1-6 ms, left out by the band.
        let theirs: Vec<u64> = windows
            .iter()
            .filter(|w| (5 * MS..=13 * MS).contains(&(w.end_ns - w.start_ns)))
            .map(|w| w.start_ns)
            .collect();
        let mut spacing: Vec<u64> = theirs.windows(2).map(|p| p[1] - p[0]).collect();
        spacing.sort_unstable();
        let median = spacing.get(spacing.len() / 2).copied().unwrap_or(0);
        eprintln!(
            "cpu {}: {} windows stolen, {} recorded ({} of 5-13 ms), median spacing {:.1} ms",
            c.cpu,
            c.windows_hit,
            windows.len(),
            theirs.len(),
            median as f64 / 1e6
        );
        assert!(
            theirs.len() as u64 >= c.windows_hit * 95 / 100,
            "cpu {}: {} of {} windows recorded\n{text}",
            c.cpu,
            theirs.len(),
            c.windows_hit
        );
        // The windows come every 20 ms: a recording keeps their rhythm, not only their
        // number.
        assert!(
            (19 * MS..=21 * MS).contains(&median),
            "cpu {}: windows recorded {:.1} ms apart at the median, stolen every 20 ms",
            c.cpu,
            median as f64 / 1e6
        );
    }
}

/// The share of each vCPU's time out during which another vCPU was seen running: what a
/// move could gain, and what the daemon's gate reads. Windows taken from both CPUs at once
/// leave nowhere to go; windows in anti-phase leave the other CPU running throughout.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn time_out_is_covered_only_where_another_vcpu_ran() {
    let (_serial, cpus) = root_on_two_cpus();
    let (board, mon) = start(&cpus, Arc::new(Counter::default()));
    let hogs = hog_per_cpu(&cpus);
    std::thread::sleep(Duration::from_millis(300));
    let mut share = Vec::new();
    for schedule in ["in:20000:10000", "anti:20000:10000"] {
        let before = board.snapshot(monotonic_ns());
        take_cpus(schedule, &cpus, 2);
        std::thread::sleep(Duration::from_millis(100));
        let after = board.snapshot(monotonic_ns());
        let (out, covered) = before.iter().zip(&after).fold((0, 0), |(o, c), (b, a)| {
            (
                o + a.inactive_total_ns - b.inactive_total_ns,
                c + a.covered_total_ns - b.covered_total_ns,
            )
        });
        let s = covered as f64 / out.max(1) as f64;
        eprintln!(
            "{schedule}: {:.0} ms out, {:.0}% of it covered by the other vCPU",
            out as f64 / 1e6,
            s * 100.0
        );
        share.push(s);
    }
    for h in hogs {
        h.stop().expect("hog");
    }
    mon.stop();
    // In phase, only the few hundred µs between the two CPUs' returns are covered (and
    // whatever this machine's own host takes apart); in anti-phase nearly all of it.
    assert!(share[0] < 0.1, "in phase: {:.0}% covered", share[0] * 100.0);
    assert!(
        share[1] > 0.8,
        "anti-phase: {:.0}% covered",
        share[1] * 100.0
    );
}

/// The heartbeat (a BPF timer pinned to each vCPU, firing every 250 µs around its expected
/// slice end) puts each deschedule's start, and so each slice, within its step: under
/// anti-phase windows the slice estimate is what irq-steal left each CPU, give or take a
/// step or two, and the time out as seen is the time taken, where ticks alone see a few
/// ms of every window less. It runs only while events are asked for.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn the_heartbeat_places_slice_ends_to_within_its_step() {
    let (_serial, cpus) = root_on_two_cpus();
    let hook = Arc::new(Counter::default());
    let (board, mon) = start(&cpus, hook.clone());
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    if kernel_before(release.trim(), (6, 7)) {
        eprintln!(
            "SKIPPED: kernel {} cannot pin a BPF timer to a CPU (6.7+), so the monitor runs \
             without the heartbeat ({:?}); nothing to check here",
            release.trim(),
            mon.attach()
        );
        mon.stop();
        return;
    }
    assert_eq!(
        mon.attach(),
        vcpu_monitor::TimerAttach::Heartbeat,
        "kernel {} is 6.7+: it pins BPF timers to a CPU, so the heartbeat must be on",
        release.trim()
    );
    let hogs = hog_per_cpu(&cpus);
    take_cpus("anti:20000:10000", &cpus, 1);
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(
        mon.heartbeats(),
        0,
        "no heartbeat while no events are asked for"
    );

    board.set_demand(Demand::Active);
    std::thread::sleep(Duration::from_millis(300));
    let before: Vec<u64> = board
        .snapshot(monotonic_ns())
        .iter()
        .map(|s| s.inactive_total_ns)
        .collect();
    let report = take_cpus("anti:20000:10000", &cpus, 3);
    std::thread::sleep(Duration::from_millis(150));
    let snap = board.snapshot(monotonic_ns());
    let beats = mon.heartbeats();
    for h in hogs {
        h.stop().expect("hog");
    }
    mon.stop();
    let windows: u64 = report.cpus.iter().map(|c| c.windows_hit).sum();
    eprintln!("{beats} heartbeats over {windows} windows");
    // About ten per slice where slices are regular (measured: 3,106 over 300 windows);
    // the first slices of each vCPU come before the history the heartbeat needs.
    assert!(
        beats >= windows * 3,
        "{beats} heartbeats, {windows} windows"
    );
    for (i, s) in snap.iter().enumerate() {
        let c = report.cpus.iter().find(|c| c.cpu == s.cpu).expect("cpu");
        let left = 20 * MS - c.stolen_ns / c.windows_hit.max(1);
        let seen = s.inactive_total_ns - before[i];
        eprintln!(
            "cpu {}: slice estimate {:.2} ms, irq-steal left {:.2} ms per period; seen out {:.1}% of {:.1} ms taken",
            s.cpu,
            s.est_slice_ns as f64 / 1e6,
            left as f64 / 1e6,
            seen as f64 * 100.0 / c.stolen_ns as f64,
            c.stolen_ns as f64 / 1e6
        );
        // Ticks alone put slice ends anywhere within a 4 ms tick of the truth, and see ~2 ms
        // of every 10 ms window less (~80% seen). On a quiet machine the heartbeat reads
        // ±0.1 ms and 97-99% seen; loaded CI machines read 12.01 ms against 10.15 and
        // 94.3-95.0% seen, and failed at ±0.5 ms and 95%. The margins here only catch a
        // heartbeat that no longer works (half a tick, 90%); how well it works is a
        // benchmark's figure, side by side with ticks alone.
        assert!(
            s.est_slice_ns.abs_diff(left) <= 2 * MS,
            "cpu {}: slice {} ns, left {left} ns",
            s.cpu,
            s.est_slice_ns
        );
        assert!(
            seen >= c.stolen_ns * 90 / 100,
            "cpu {}: seen {seen} ns out of {} ns taken",
            s.cpu,
            c.stolen_ns
        );
    }
}

/// Whether a kernel release (`6.1.0-28-amd64`, `6.18.44-fc`) is older than `major.minor`.
fn kernel_before(release: &str, (major, minor): (u32, u32)) -> bool {
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let version = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    version < (major, minor)
}

#[test]
fn kernel_releases_compare_by_major_and_minor() {
    assert!(kernel_before("6.1.0-28-amd64", (6, 7)));
    assert!(kernel_before("5.15.0", (6, 7)));
    assert!(!kernel_before("6.7.0", (6, 7)));
    assert!(!kernel_before("6.18.44-fc-v1252", (6, 7)));
    assert!(!kernel_before("7.0", (6, 7)));
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_return_is_heard_at_once_wherever_the_event_thread_slept() {
    // Windows at a random phase on each vCPU: the event thread sleeps on the vCPU it
    // expects back first, and the other often comes back before it. Frozen with the
    // vCPU it slept on, it would hear that return only when its own vCPU runs again
    // (measured without the rescuers: a tenth of the returns 4-10 ms late).
    let (_serial, cpus) = root_on_two_cpus();
    let hook = Arc::new(Counter::default());
    let (board, mon) = start(&cpus, hook.clone());
    let hogs = hog_per_cpu(&cpus);
    board.set_demand(Demand::Active);
    std::thread::sleep(Duration::from_millis(300));
    hook.late_ns.lock().unwrap().clear();
    take_cpus("rphase:20000:10000:3", &cpus, 3);
    for h in hogs {
        h.stop().expect("hog");
    }
    mon.stop();
    let mut late = hook.late_ns.lock().unwrap().clone();
    late.sort_unstable();
    let at = |q: f64| late[((late.len() - 1) as f64 * q) as usize];
    eprintln!(
        "{} returns heard: median {} us, p95 {} us, max {} us late",
        late.len(),
        at(0.5) / 1000,
        at(0.95) / 1000,
        late.last().unwrap() / 1000
    );
    assert!(
        late.len() >= 200,
        "{} returns heard in 300 windows",
        late.len()
    );
    // A 10 ms window is what a return heard through the other vCPU's waits.
    assert!(
        at(0.95) < 2 * MS,
        "p95 {} us late: the event thread waited for the vCPU it slept on",
        at(0.95) / 1000
    );
}
