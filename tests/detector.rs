//! The task detector on the real kernel with real BPF (issue 2 acceptance (b)): a thread
//! doing O_DIRECT reads is classified I/O-bound within 50 ms, a CPU hog never; BPF counts
//! match the reads; every attach mode this kernel supports works, also on the pre-6.5
//! hooks; large split requests leave no in-flight count behind that the stale reset does
//! not repair. Root only.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use task_detector::{
    probe, AttachMode, BlockTracking, ClassifierConfig, Detector, IoTracker, ThreadIoSample,
    TrackerOptions, TrackerStorage, INFLIGHT_STALE_NS,
};
use vmigrater_testbed::{assert_root, gettid, workload};

#[path = "support/detection.rs"]
mod detection;
use detection::{found_side_by_side, RequestUnderSteal};

/// A 256 MiB file on the real disk (target/tmp is on / here: ext4 on virtio), made once
/// and reused; O_DIRECT bypasses the page cache, so no cache dropping is needed.
fn data_file() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("detector-test-data.bin");
    workload::prepare_file(&path, 256 << 20).expect("prepare data file");
    path
}

/// The tests run one at a time: each attaches its own programs and runs readers of the
/// same file with the same offsets; side by side they would count each other's requests
/// (dev+sector keys collide) and slow the disk the latency test measures.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn monotonic_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("clock");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

fn sample_of(tracker: &mut IoTracker<'_>, tid: u32) -> Option<ThreadIoSample> {
    tracker
        .sample_threads(monotonic_ns())
        .expect("sample threads")
        .into_iter()
        .find(|s| s.tid == tid)
}

/// Request events no program saw (mostly ends, sometimes starts). The kernel runs no
/// tracing program nested in another on the same CPU (classic tracepoints share one
/// per-CPU guard, so a completion softirq that interrupts our requeue program is
/// skipped; `missed_runs` counts some of those), and on this 6.18 guest about 1 in 300
/// requeued requests completes in a softirq on top of a host-side task where no program
/// runs and no miss is counted (measured with tracefs: the event is there, the
/// program's run count is short by one). So a thread may keep a request "in flight"
/// after its I/O is over. What must hold: such losses are rare (at most 2 + 2% of the
/// requests; we saw up to 1.5%, where a systematic bug, such as splits or requeues not
/// balancing, loses one per read), and the stale reset closes the leaks: once the
/// thread has been quiet for INFLIGHT_STALE_NS it is reported idle, its busy time
/// stopped at its last event.
fn allowed_leaks(ios: u64) -> u64 {
    2 + ios / 50
}

fn check_leaks_are_rare_and_repaired(label: &str, tracker: &mut IoTracker<'_>, s: &ThreadIoSample) {
    let leaked = u64::from(s.in_flight);
    if leaked > 0 {
        eprintln!(
            "{label}: {leaked} request end(s) not seen (kernel-reported missed runs: {}); open: {:?}",
            tracker.missed_runs(),
            tracker.open_requests().map(|o| o.len())
        );
    }
    // Runs the kernel itself skipped (a program already running on that CPU) are request
    // ends nobody could see; the kernel counts them, so they are allowed on top.
    let missed = tracker.missed_runs();
    assert!(
        leaked <= allowed_leaks(s.ios) + missed,
        "{label}: {leaked} of {} requests still in flight ({missed} runs missed by the kernel)",
        s.ios
    );
    if leaked == 0 {
        return;
    }
    let quiet_until = s.last_ts + INFLIGHT_STALE_NS + 100_000_000;
    std::thread::sleep(Duration::from_nanos(
        quiet_until.saturating_sub(monotonic_ns()),
    ));
    let later = sample_of(tracker, s.tid).expect("thread still in the map");
    assert_eq!(later.in_flight, 0, "{label}: stale reset did not close it");
    assert!(
        later.busy_ns <= s.busy_ns + 1_000_000,
        "{label}: busy time kept running while nothing was in flight: {} -> {} ns",
        s.busy_ns,
        later.busy_ns
    );
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn reader_is_io_bound_within_50ms_and_hog_never() {
    assert_root();
    let _serial = serial();
    let file = data_file();
    let mut storage = TrackerStorage::new();
    let tracker = IoTracker::open(&TrackerOptions::default(), &mut storage).expect("load BPF");
    eprintln!(
        "attach mode: {} hooks {:?}",
        tracker.mode(),
        tracker.hooks()
    );
    let cfg = ClassifierConfig::default();
    let window = Duration::from_nanos(cfg.window_ns);
    let mut det = Detector::new(tracker, cfg);
    let hog = workload::spawn_hog(None).expect("hog");
    let first = det.poll(&[]).expect("baseline poll");
    let completions0: u64 = first.cpus.iter().map(|c| c.completions).sum();
    let reader = workload::spawn_reader(&file, workload::ReadPattern::Random4k).expect("reader");
    let t0 = Instant::now();
    let mut classified_after = None;
    let mut poll_us = Vec::new();
    while t0.elapsed() < Duration::from_secs(2) {
        let p0 = Instant::now();
        let out = det.poll(&[]).expect("poll");
        poll_us.push(p0.elapsed().as_secs_f64() * 1e6);
        assert!(
            out.tasks.iter().all(|t| t.task.tid != hog.tid),
            "the hog was classified I/O-bound: {:?}",
            out.tasks
        );
        if classified_after.is_none() {
            if let Some(t) = out.tasks.iter().find(|t| t.task.tid == reader.tid) {
                classified_after = Some(t0.elapsed());
                eprintln!(
                    "reader classified after {:?} ({} reads done): {:?} comm {:?}",
                    t0.elapsed(),
                    reader.count(),
                    t.task,
                    t.comm
                );
                assert!(t.start_time > 0);
                assert_eq!(t.comm, "reader-Random4k");
            }
        }
        std::thread::sleep(window);
    }
    poll_us.sort_by(f64::total_cmp);
    eprintln!(
        "poll cost: p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs over {} polls",
        poll_us[poll_us.len() / 2],
        poll_us[poll_us.len() * 99 / 100],
        poll_us[poll_us.len() - 1],
        poll_us.len()
    );
    let after = classified_after.expect("the reader was never classified I/O-bound");
    assert!(
        after <= Duration::from_millis(50),
        "classified after {after:?}"
    );
    let out = det.poll(&[]).expect("poll");
    let total: u64 = out.cpus.iter().map(|c| c.completions).sum();
    eprintln!("per-CPU I/O: {:?}", out.cpus);
    assert!(
        total > completions0 + 100,
        "per-CPU completions did not grow: {completions0} → {total}"
    );
    assert!(
        out.cpus.iter().any(|c| c.ema_interval_ns > 0),
        "no completion-interval EMA: {:?}",
        out.cpus
    );
    reader.stop().expect("reader");
    hog.stop().expect("hog");
}

/// Opens `how`, runs a 4 KiB random reader for 300 ms, and checks the BPF counters of
/// exactly that thread against the reads it issued.
fn check_counts(label: &str, mode: AttachMode, mut tracker: IoTracker<'_>, file: &Path) {
    assert_eq!(tracker.mode(), mode);
    let reader = workload::spawn_reader(file, workload::ReadPattern::Random4k).expect("reader");
    let tid = reader.tid;
    std::thread::sleep(Duration::from_millis(300));
    let reads = reader.stop().expect("reader");
    std::thread::sleep(Duration::from_millis(20));
    let s = sample_of(&mut tracker, tid)
        .unwrap_or_else(|| panic!("{label}: reader {tid} not in the map"));
    eprintln!(
        "{label} {:?}: {reads} reads, BPF saw {} ios, {} bytes, busy {:.1} ms, in flight {}",
        tracker.hooks(),
        s.ios,
        s.bytes,
        s.busy_ns as f64 / 1e6,
        s.in_flight
    );
    // Classic tracepoints key by dev+sector: two requests on one sector collide. In
    // every mode a start can go unseen like an end (see `allowed_leaks`).
    let slack = allowed_leaks(reads);
    assert!(
        s.ios.abs_diff(reads) <= slack,
        "{label}: {reads} reads vs {} ios",
        s.ios
    );
    // Bytes are counted at completion: a request whose end was not seen adds none.
    let lost = slack + allowed_leaks(s.ios);
    assert!(
        s.bytes + lost * 4096 >= reads * 4096,
        "{label}: {} bytes for {reads} reads",
        s.bytes
    );
    // Without block_io_start a request is the issuer's: the reader's plug flush may
    // dispatch someone else's queued writeback (one big request each), so bytes have
    // no upper bound there while other I/O runs; the request count above still holds.
    if tracker.hooks().contains(&"block_io_start") {
        assert!(
            s.bytes <= (reads + slack) * 4096,
            "{label}: {} bytes for {reads} reads",
            s.bytes
        );
    }
    assert!(
        s.busy_ns > 0 && s.busy_ns < 400_000_000,
        "{label}: busy {}",
        s.busy_ns
    );
    check_leaks_are_rare_and_repaired(label, &mut tracker, &s);
}

#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn bpf_counts_match_the_reads_in_every_supported_mode() {
    assert_root();
    let _serial = serial();
    let file = data_file();
    let p = probe();
    eprintln!("probe: {p:?}");
    let mut worked = Vec::new();
    for mode in AttachMode::ALL {
        let t0 = Instant::now();
        let mut storage = TrackerStorage::new();
        let opts = TrackerOptions {
            force_mode: Some(mode),
        };
        let tracker = match IoTracker::open(&opts, &mut storage) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("{mode}: not available here: {e:#}");
                continue;
            }
        };
        eprintln!("{mode}: load + attach {:?}", t0.elapsed());
        check_counts(&mode.to_string(), mode, tracker, &file);
        worked.push(mode);
        // The pre-6.5 path (insert + issue) on this kernel, by hiding block_io_start.
        if p.tracepoints
            .iter()
            .any(|(tp, ok)| tp == "block_io_start" && *ok)
        {
            let mut storage = TrackerStorage::new();
            let tracker = IoTracker::open_without(mode, &["block_io_start"], &mut storage)
                .expect("pre-6.5 hooks");
            assert!(!tracker.hooks().contains(&"block_io_start"));
            check_counts(&format!("{mode} (pre-6.5 hooks)"), mode, tracker, &file);
        }
    }
    let best = p.best_mode.expect("this kernel has block tracepoints");
    assert!(
        worked.contains(&best),
        "the probed best mode {best} did not work; worked: {worked:?}"
    );
    let mut storage = TrackerStorage::new();
    assert_eq!(
        IoTracker::open(&TrackerOptions::default(), &mut storage)
            .expect("default")
            .mode(),
        best,
        "the first mode that loads is the probed best"
    );
}

/// Reads of 8 MiB are split into several requests (max_sectors_kb is 4096 here) and,
/// LAB-NOTES says, requeued at 2–4 MiB: the in-flight table must balance anyway.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn large_split_reads_leave_nothing_in_flight() {
    assert_root();
    let _serial = serial();
    let path = data_file();
    const BS: usize = 8 << 20;
    for mode in AttachMode::ALL {
        let mut storage = TrackerStorage::new();
        let opts = TrackerOptions {
            force_mode: Some(mode),
        };
        let Ok(mut tracker) = IoTracker::open(&opts, &mut storage) else {
            continue;
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .expect("open O_DIRECT");
        let blocks = (file.metadata().expect("stat").len() as usize / BS) as u64;
        let layout = std::alloc::Layout::from_size_align(BS, 4096).expect("layout");
        let tid = std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: non-zero size, valid alignment; freed below with the same layout.
                let ptr = unsafe { std::alloc::alloc(layout) };
                assert!(!ptr.is_null());
                // SAFETY: valid for BS bytes and only used by this thread.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr, BS) };
                for i in 0..24u64 {
                    file.read_exact_at(buf, (i % blocks) * BS as u64)
                        .expect("8 MiB O_DIRECT read");
                }
                // SAFETY: allocated above with this layout.
                unsafe { std::alloc::dealloc(ptr, layout) };
                gettid()
            })
            .join()
            .expect("reader thread")
        });
        std::thread::sleep(Duration::from_millis(20));
        let s = sample_of(&mut tracker, tid).expect("reader in the map");
        eprintln!(
            "{mode}: 24 reads of 8 MiB: {} requests, {} MiB, busy {:.1} ms, in flight {}",
            s.ios,
            s.bytes >> 20,
            s.busy_ns as f64 / 1e6,
            s.in_flight
        );
        assert!(s.ios >= 24, "{mode}: {} requests", s.ios);
        // A request whose end was not seen adds no bytes; one is at most max_sectors_kb
        // (4 MiB here). Classic tracepoints also lose partial completions.
        let total = 24 * BS as u64;
        let lost = allowed_leaks(s.ios) * (4 << 20);
        assert!(
            s.bytes <= total && s.bytes + lost >= total,
            "{mode}: {} of {total} bytes",
            s.bytes
        );
        check_leaks_are_rare_and_repaired(&mode.to_string(), &mut tracker, &s);
    }
}

/// Sampled tracking (issue 10): paused, the programs return at once, so requests cost
/// almost nothing and count nothing; nothing is left "in flight"; resumed, counting goes on.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn paused_tracking_counts_nothing_and_leaves_nothing_open() {
    assert_root();
    let _serial = serial();
    let file = data_file();
    let mut storage = TrackerStorage::new();
    let mut tracker = IoTracker::open(&TrackerOptions::default(), &mut storage).expect("load BPF");
    let reader = workload::spawn_reader(&file, workload::ReadPattern::Random4k).expect("reader");
    let tid = reader.tid;
    std::thread::sleep(Duration::from_millis(200));
    assert!(tracker.tracking());
    tracker.pause(monotonic_ns()).expect("pause");
    assert!(!tracker.tracking());
    let paused = sample_of(&mut tracker, tid).expect("reader in the map");
    let reads0 = reader.count();
    std::thread::sleep(Duration::from_millis(300));
    let during = reader.count() - reads0;
    let still = sample_of(&mut tracker, tid).expect("reader in the map");
    eprintln!(
        "paused: {} ios before, {} after {during} more reads; open requests {:?}",
        paused.ios,
        still.ios,
        tracker.open_requests().expect("inflight")
    );
    assert!(
        during > 20,
        "the reader did not run while paused: {during} reads"
    );
    assert_eq!(still.ios, paused.ios, "a paused program counted requests");
    assert_eq!(
        still.in_flight, 0,
        "a request stayed in flight across the pause"
    );
    assert_eq!(still.busy_ns, paused.busy_ns, "busy time grew while paused");
    assert!(tracker.open_requests().expect("inflight").is_empty());
    tracker.resume().expect("resume");
    std::thread::sleep(Duration::from_millis(200));
    let resumed = sample_of(&mut tracker, tid).expect("reader in the map");
    eprintln!("resumed: {} ios", resumed.ios);
    assert!(resumed.ios > still.ios + 20, "no counting after resume");
    reader.stop().expect("reader");
    std::thread::sleep(Duration::from_millis(20));
    let done = sample_of(&mut tracker, tid).expect("reader in the map");
    // What to read if this fails (it did once in CI with 24): whether the requests are
    // still open in the table (their ends lost) or the count drifted from the table, and
    // whether the kernel skipped runs of the programs.
    let open_of_reader = tracker
        .open_requests()
        .expect("inflight")
        .iter()
        .filter(|r| r.1 == tid)
        .count();
    assert!(
        done.in_flight <= 1,
        "in flight after the reader stopped: {} ({open_of_reader} of its requests open in \
         the table; {} program runs skipped by the kernel; {} ios, {} completions)",
        done.in_flight,
        tracker.missed_runs(),
        done.ios,
        done.completions.total
    );
}

/// While paused, a thread new to block I/O rings the doorbell and a steady one does not,
/// also after the steady thread's passes are cached on its CPU (`passes` in
/// bpf/iotrack.bpf.c): a new thread on that CPU must still ring.
#[test]
fn paused_the_doorbell_rings_for_a_new_io_thread_and_not_for_a_steady_one() {
    assert_root();
    let _serial = serial();
    let file = data_file();
    let mut storage = TrackerStorage::new();
    let mut tracker = IoTracker::open(&TrackerOptions::default(), &mut storage).expect("load BPF");
    // Tracked past DOORBELL_YOUNG_IOS requests: a steady I/O thread.
    read_blocks_on(0, &file, 200, 65536);
    tracker.pause(monotonic_ns()).expect("pause");
    // Other processes' first reads ring too (an exec loading a binary): a steady thread
    // that rang would ring in every attempt.
    let quiet = (0..5).any(|_| {
        tracker.take_doorbell();
        read_blocks_on(0, &file, 100, 65536);
        !tracker.take_doorbell()
    });
    assert!(
        quiet,
        "a steady thread's paused reads rang the doorbell in every attempt"
    );
    std::thread::scope(|s| {
        s.spawn(|| read_blocks_on(0, &file, 1, 65536));
    });
    assert!(
        tracker.take_doorbell(),
        "a new thread's read on the steady thread's CPU did not ring"
    );
    tracker.resume().expect("resume");
}

/// Links the kernel holds for these programs: what says they are on their tracepoints.
fn kernel_links_of(prog_ids: &[u32]) -> usize {
    libbpf_rs::query::LinkInfoIter::default()
        .filter(|l| prog_ids.contains(&l.prog_id))
        .count()
}

/// Detached, the programs are off their tracepoints in the kernel (no link left) and count
/// nothing; `resume` puts them back and they count again.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn detached_programs_leave_the_tracepoints_and_come_back() {
    assert_root();
    let _serial = serial();
    let file = data_file();
    let mut storage = TrackerStorage::new();
    let tracker = IoTracker::open(&TrackerOptions::default(), &mut storage).expect("load BPF");
    let ids = tracker.program_ids();
    let hooks = tracker.hooks().len();
    assert_eq!(ids.len(), hooks, "one loaded program per hook");
    assert_eq!(kernel_links_of(&ids), hooks, "attached: one link per hook");
    let mut det = Detector::new(tracker, ClassifierConfig::default());
    let reader = workload::spawn_reader(&file, workload::ReadPattern::Random4k).expect("reader");
    std::thread::sleep(Duration::from_millis(200));
    let ios = |det: &mut Detector<'_>| -> u64 {
        det.poll(&[])
            .expect("poll")
            .cpus
            .iter()
            .map(|c| c.completions)
            .sum()
    };
    let before = ios(&mut det);
    det.detach().expect("detach");
    assert!(!det.attached() && !det.tracking());
    assert_eq!(kernel_links_of(&ids), 0, "detached programs still linked");
    let reads0 = reader.count();
    std::thread::sleep(Duration::from_millis(300));
    let during = reader.count() - reads0;
    assert!(
        during > 20,
        "the reader did not run while detached: {during} reads"
    );
    det.resume().expect("resume");
    assert!(det.attached() && det.tracking());
    assert_eq!(
        kernel_links_of(&ids),
        hooks,
        "not linked again after resume"
    );
    let after_resume = ios(&mut det);
    std::thread::sleep(Duration::from_millis(200));
    let later = ios(&mut det);
    eprintln!("completions: {before} before, {after_resume} right after {during} detached reads, {later} 200 ms later");
    assert!(
        after_resume < before + during / 2,
        "detached programs counted the reads: {before} -> {after_resume} over {during} reads"
    );
    assert!(
        later > after_resume + 20,
        "no counting after resume: {after_resume} -> {later}"
    );
    reader.stop().expect("reader");
}

/// The classifier lives on tracked time: a pause is neither idle time nor CPU time, so a
/// reader classified before a pause is measured right after it as the reader it is.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_pause_does_not_read_as_idleness() {
    assert_root();
    let _serial = serial();
    let file = data_file();
    let mut storage = TrackerStorage::new();
    let tracker = IoTracker::open(&TrackerOptions::default(), &mut storage).expect("load BPF");
    let cfg = ClassifierConfig::default();
    let window = Duration::from_nanos(cfg.window_ns);
    let mut det = Detector::new(tracker, cfg);
    let reader = workload::spawn_reader(&file, workload::ReadPattern::Random4k).expect("reader");
    // A pause read as idleness fails every attempt (fed real time, the window spanning a
    // 500 ms pause would be ~1% busy). This machine's own host now and then steals a 5 ms
    // window from the reader (CI once saw io_fraction 0.015 with cpu_fraction 0.47), which
    // fails one attempt, hardly three in a row.
    let mut attempts = Vec::new();
    for _ in 0..3 {
        let t0 = Instant::now();
        while !det
            .poll(&[])
            .expect("poll")
            .tasks
            .iter()
            .any(|t| t.task.tid == reader.tid)
        {
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "reader never classified"
            );
            std::thread::sleep(window);
        }
        det.pause().expect("pause");
        assert!(
            det.poll(&[]).is_err(),
            "a paused detector must refuse to poll"
        );
        std::thread::sleep(Duration::from_millis(500));
        det.resume().expect("resume");
        let mut fractions = Vec::new();
        for _ in 0..5 {
            let out = det.poll(&[]).expect("poll");
            fractions.push(
                out.tasks
                    .iter()
                    .find(|t| t.task.tid == reader.tid)
                    .map_or(0.0, |t| t.task.io_fraction),
            );
            std::thread::sleep(window);
        }
        let held = fractions.iter().all(|&f| f >= 0.25);
        attempts.push(fractions);
        if held {
            break;
        }
    }
    eprintln!("io_fraction after each pause: {attempts:?}");
    assert!(
        attempts.last().unwrap().iter().all(|&f| f >= 0.25),
        "the reader read as idle (or not I/O-bound) right after every one of 3 pauses: \
         io_fraction per window {attempts:?}"
    );
    reader.stop().expect("reader");
}

/// Pins this thread to `cpu` and reads `n` 4 KiB blocks of `file` (O_DIRECT, one at a
/// time); returns how many of the disk's interrupts each CPU took meanwhile, and how many
/// 4 KiB blocks this thread fetched from the disk by the kernel's own count (the reads, plus
/// any metadata the file system read on the way, such as an extent block).
fn reads_from(cpu: usize, file: &Path, n: u64) -> (Vec<u64>, u64) {
    let irqs0 = disk_irqs_per_cpu(file);
    let fetched0 = own_read_bytes();
    read_blocks_on(cpu, file, n, 65536);
    let fetched = own_read_bytes() - fetched0;
    let irqs1 = disk_irqs_per_cpu(file);
    let grew = irqs1.iter().zip(&irqs0).map(|(a, b)| a - b).collect();
    (grew, fetched.div_ceil(4096))
}

/// Pins this thread to `cpu`, reads `n` 4 KiB blocks spread over the first `span` of
/// `path` (O_DIRECT, one at a time), and gives the thread its mask back.
fn read_blocks_on(cpu: usize, path: &Path, n: u64, span: u64) {
    let me = nix::unistd::Pid::from_raw(0);
    let mask = nix::sched::sched_getaffinity(me).expect("own mask");
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).unwrap();
    nix::sched::sched_setaffinity(me, &set).expect("pin");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open O_DIRECT");
    // O_DIRECT wants an aligned buffer: a 4 KiB-aligned slice of a larger one.
    let mut backing = vec![0u8; 8192];
    let skip = backing.as_ptr().align_offset(4096);
    let buf = &mut backing[skip..skip + 4096];
    for i in 0..n {
        f.read_exact_at(buf, (i * 7919 % span) * 4096)
            .expect("read");
    }
    nix::sched::sched_setaffinity(me, &mask).expect("restore own mask");
}

/// Bytes this thread has caused to be read from storage (`read_bytes` of its task's io
/// accounting: counted at bio submission, direct I/O and metadata included).
fn own_read_bytes() -> u64 {
    let io = std::fs::read_to_string("/proc/thread-self/io").expect("/proc/thread-self/io");
    io.lines()
        .find_map(|l| l.strip_prefix("read_bytes: "))
        .expect("read_bytes in /proc/thread-self/io")
        .trim()
        .parse()
        .expect("read_bytes is a number")
}

/// Per CPU, how many interrupts of the disk that holds `file` were handled: the lines of
/// /proc/interrupts named after its virtio device's request queues (`virtioN-req.Q`).
fn disk_irqs_per_cpu(file: &Path) -> Vec<u64> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(file).expect("stat data file").dev();
    let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    let part = std::fs::canonicalize(format!("/sys/dev/block/{major}:{minor}")).expect("sysfs");
    // A partition's directory sits in its disk's; a whole disk has `device` itself.
    let disk = if part.join("device").exists() {
        part
    } else {
        part.parent().expect("disk dir").to_path_buf()
    };
    let virtio = std::fs::canonicalize(disk.join("device")).expect("device link");
    let name = virtio.file_name().unwrap().to_string_lossy().to_string();
    assert!(
        name.starts_with("virtio"),
        "this test reads the interrupts of a virtio disk; {} is on {name}",
        file.display()
    );
    let text = std::fs::read_to_string("/proc/interrupts").expect("/proc/interrupts");
    let ncpu = text.lines().next().unwrap().split_whitespace().count();
    let mut per_cpu = vec![0u64; ncpu];
    let mut lines = 0;
    for line in text.lines().filter(|l| l.contains(&format!("{name}-req"))) {
        lines += 1;
        for (cpu, n) in line.split_whitespace().skip(1).take(ncpu).enumerate() {
            per_cpu[cpu] += n.parse::<u64>().expect("interrupt count");
        }
    }
    assert!(lines > 0, "no {name}-req line in /proc/interrupts");
    per_cpu
}

/// Where a thread's requests complete, as BPF records it, against the kernel's own
/// interrupt counts: a reader pinned to each CPU in turn; its completions counted, their
/// vCPU the one whose interrupt count grew, and "remote" exactly when that is not the
/// reader's own.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn completions_are_recorded_on_the_vcpu_that_took_the_interrupt() {
    assert_root();
    let _serial = serial();
    let file = data_file();
    let mut storage = TrackerStorage::new();
    let mut tracker = IoTracker::open(&TrackerOptions::default(), &mut storage).expect("load BPF");
    let ncpu = nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
        .ok()
        .flatten()
        .unwrap_or(1) as usize;
    let tid = gettid();
    for cpu in 0..ncpu {
        let before = sample_of(&mut tracker, tid).map(|s| s.completions);
        let reads = 400u64;
        let (grew, fetched) = reads_from(cpu, &file, reads);
        let after = sample_of(&mut tracker, tid)
            .expect("the reader in the map")
            .completions;
        let before = before.unwrap_or_default();
        let done = after.total - before.total;
        let remote = after.remote - before.remote;
        let busiest = (0..grew.len()).max_by_key(|&c| grew[c]).unwrap();
        let irq_remote = grew
            .iter()
            .enumerate()
            .filter(|&(c, _)| c != cpu)
            .map(|(_, n)| n)
            .sum::<u64>();
        let irq_total: u64 = grew.iter().sum();
        eprintln!(
            "reader on CPU {cpu}: {done} completions, {remote} remote, last on CPU {}; \
             disk interrupts per CPU {grew:?}; {fetched} blocks fetched by the kernel's count",
            after.last_cpu
        );
        // A request counted once: at most the blocks the kernel says this thread fetched (a
        // read may bring an extent block with it). Lost ends are a known anomaly: alone this
        // test records all 400; inside the whole suite it once recorded 357 (the reader on
        // CPU 1), as the paused test once found 24 requests "in flight" after its reader
        // stopped. Most must be seen, and fewer than 95% is said loudly.
        assert!(
            done >= reads * 80 / 100 && done <= fetched.max(reads),
            "{done} completions recorded for {reads} reads ({fetched} blocks fetched)"
        );
        if done < reads * 95 / 100 {
            eprintln!(
                "WARNING: {} of {reads} request ends not recorded ({} program runs skipped \
                 by the kernel)",
                reads - done,
                tracker.missed_runs()
            );
        }
        assert_eq!(
            after.last_cpu as usize, busiest,
            "the last completion's vCPU is not the one that took the disk's interrupts"
        );
        // Interrupts of other requests (the system's own) may land too: compare shares.
        let bpf_share = remote as f64 / done as f64;
        let irq_share = irq_remote as f64 / irq_total.max(1) as f64;
        assert!(
            (bpf_share - irq_share).abs() < 0.15,
            "remote share {bpf_share:.2} by BPF vs {irq_share:.2} by the interrupt counts"
        );
    }
}

/// The kernel's queue map says where each vCPU's requests complete; the disk's own
/// interrupt counts (the reader pinned to each vCPU in turn) must agree with it.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn the_queue_map_names_the_vcpu_whose_interrupts_grow() {
    assert_root();
    let _serial = serial();
    let file = data_file();
    let map = task_detector::queues::QueueMap::read(&os_layer::Root::real()).expect("queue map");
    eprintln!("queue map: {map:?}");
    let completes = map.completion_cpus();
    assert!(
        !completes.is_empty(),
        "no disk mapped on this virtio machine"
    );
    for (&cpu, expected) in &completes {
        let (grew, _) = reads_from(cpu, &file, 200);
        let busiest = (0..grew.len()).max_by_key(|&c| grew[c]).unwrap();
        assert!(
            expected.contains(&busiest),
            "submitting from vCPU {cpu}: the map says {expected:?}, the interrupts grew on {grew:?}"
        );
    }
}

/// The queue-per-vCPU geometry on this one-queue machine (`benches/steal.rs --disk loop`):
/// a loop device over memory with `rq_affinity = 2` completes every request on the vCPU
/// that submitted it. The queue map says so before any I/O, and BPF records it: a reader
/// pinned to each vCPU in turn sees its completions there, none remote.
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_loop_disk_forced_onto_the_submitter_completes_there() {
    assert_root();
    let _serial = serial();
    let backing = Path::new("/dev/shm/vmigrater-detector-loop.bin");
    let disk = vmigrater_testbed::loopdisk::LoopDisk::create(backing, 64 << 20).expect("loop disk");
    let map = task_detector::queues::QueueMap::read(&os_layer::Root::real()).expect("queue map");
    let ours = map
        .disks
        .iter()
        .find(|d| d.disk == disk.name)
        .unwrap_or_else(|| panic!("{} missing from the queue map {map:?}", disk.name));
    assert!(
        ours.queues
            .iter()
            .all(|q| q.on_submitter && q.completion_cpus.is_empty()),
        "{ours:?}"
    );
    let mut storage = TrackerStorage::new();
    let mut tracker = IoTracker::open(&TrackerOptions::default(), &mut storage).expect("load BPF");
    let tid = gettid();
    let ncpu = nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
        .ok()
        .flatten()
        .unwrap_or(1) as usize;
    for cpu in 0..ncpu {
        let before = sample_of(&mut tracker, tid).map(|s| s.completions);
        let reads = 400u64;
        read_blocks_on(cpu, &disk.device, reads, 16384);
        let after = sample_of(&mut tracker, tid)
            .expect("the reader in the map")
            .completions;
        let before = before.unwrap_or_default();
        let (done, remote) = (after.total - before.total, after.remote - before.remote);
        eprintln!(
            "reader on CPU {cpu}: {done} completions, {remote} remote, last on CPU {}",
            after.last_cpu
        );
        assert!(
            done >= reads * 80 / 100 && done <= reads,
            "{done} completions for {reads} reads"
        );
        assert_eq!(remote, 0, "completions away from the submitting vCPU {cpu}");
        assert_eq!(after.last_cpu as usize, cpu);
    }
}

/// A request/response task (one read, then ~200 µs of CPU work) that submits on one vCPU
/// while its reads complete on another, both taken away half of the time by hard-IRQ
/// deschedules in anti-phase: each read waits for the other vCPU's window, so the task
/// waits on I/O most of the time, yet its requests come milliseconds apart, seldom two in
/// one 5 ms window, and between them it often has nothing in flight and cannot run (the
/// read completed while its own vCPU was out). Windows stretched until they hold enough
/// requests, told the time the vCPUs were out, find it in most rounds; windows that never
/// stretch, watching the same task over the same time, find it later or not at all. How
/// much later depends on how often this machine's timing lets two requests into 5 ms, so
/// that control is a comparison over rounds, not a promise that it never happens (the
/// classifier's unit tests `a_task_with_a_request_every_few_windows_is_judged_on_longer_windows`
/// and `time_its_vcpu_was_out_with_nothing_in_flight_does_not_close_a_window` pin the
/// arithmetic).
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_request_task_waiting_for_a_descheduled_completion_vcpu_is_found() {
    assert_root();
    vmigrater_testbed::assert_cpus(2);
    let _serial = serial();
    let file = data_file();
    let completing = vmigrater_testbed::completion::CompletionMap::for_file(&file)
        .expect("completion map")
        .cpus();
    let submit = (0..2)
        .find(|c| !completing.contains(c))
        .unwrap_or_else(|| {
            panic!("this test needs a disk whose completions land on one vCPU; they land on {completing:?}")
        });
    const ROUNDS: usize = 5;
    let per_round = Duration::from_secs(2);
    let began = Instant::now();
    let bed = RequestUnderSteal::start(&file, "anti:20000:10000", 40, Some(submit));
    let task = &bed.task;
    let stretched = ClassifierConfig::default();
    let fixed = ClassifierConfig {
        max_window_ns: stretched.window_ns,
        ..ClassifierConfig::default()
    };
    let mut rounds = Vec::new();
    for i in 0..ROUNDS {
        let (at, before) = (began.elapsed(), task.count());
        let found = found_side_by_side(
            &[stretched.clone(), fixed.clone()],
            task.tid,
            per_round,
            || bed.out_ns(),
        );
        eprintln!(
            "round {i} ({at:.1?} into the schedule): {} requests",
            task.count() - before
        );
        rounds.push(found);
    }
    let (done, report) = bed.stop();
    let when = |f: &Option<(Duration, task_detector::IoTask)>| {
        f.as_ref()
            .map_or("never".to_string(), |(d, _)| format!("{d:?}"))
    };
    for (i, r) in rounds.iter().enumerate() {
        eprintln!(
            "round {i}: stretched windows found it after {}, unstretched after {}",
            when(&r[0]),
            when(&r[1])
        );
    }
    eprintln!("requests done: {done}\n{report}");
    // Found in most rounds: in a round where the task fell into one of the testbed's
    // spells (a reader placed far behind the hog at every wake-up, ~25 requests a second;
    // see benches/RESULTS.md) even a 50 ms window holds fewer than two requests.
    let found: Vec<_> = rounds.iter().filter_map(|r| r[0].as_ref()).collect();
    assert!(
        found.len() > ROUNDS / 2,
        "stretched windows found the request task in only {} of {ROUNDS} rounds of {per_round:?}",
        found.len()
    );
    for (_, t) in &found {
        // Only meaningful where requests were too sparse for a 5 ms window.
        assert!(
            t.iops < 400.0,
            "{:.0} requests/s: two per 5 ms window, this test did not exercise sparse requests",
            t.iops
        );
        assert!(t.io_fraction >= 0.25, "{t:?}");
    }
    // Stretched windows found it strictly first (or alone) in most rounds; with the rule
    // broken both detectors judge the same windows and find it at the same poll.
    let first = rounds
        .iter()
        .filter(|r| match (&r[0], &r[1]) {
            (Some(_), None) => true,
            (Some((a, _)), Some((b, _))) => a < b,
            _ => false,
        })
        .count();
    assert!(
        first > ROUNDS / 2,
        "stretched windows found the task first in only {first} of {ROUNDS} rounds"
    );
}

/// A request/response task (one read, then ~200 µs of CPU work) beside a CPU hog on each
/// vCPU, both vCPUs taken away by Xen-like hard-IRQ deschedules (30 ms runs and gaps, drawn
/// independently): while its completion vCPU runs its reads complete promptly and it has
/// I/O in flight only about a tenth of the time, at 1,000–2,000 requests a second. Found
/// within 2 s in most rounds, and in some rounds by its rate (a window with under a quarter
/// of the time in flight): the criterion works on the real kernel. Side by side, the time
/// criterion alone is printed for comparison; it finds the task too, but only through
/// windows in which a completion waited for a descheduled vCPU, which a daemon's short
/// sample may not contain (how much sooner: `benches/detection.rs`, `make bench-detection`).
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn a_request_task_is_found_by_its_rate_under_xen_like_deschedules() {
    assert_root();
    vmigrater_testbed::assert_cpus(2);
    let _serial = serial();
    let file = data_file();
    const ROUNDS: usize = 8;
    let per_round = Duration::from_secs(2);
    let bed = RequestUnderSteal::start(&file, "random:30000:30000:exp:3", 30, None);
    let by_rate = ClassifierConfig::default();
    let by_time = ClassifierConfig {
        enter_iops: 0.0,
        exit_iops: 0.0,
        ..ClassifierConfig::default()
    };
    let rounds: Vec<_> = (0..ROUNDS)
        .map(|_| {
            found_side_by_side(
                &[by_rate.clone(), by_time.clone()],
                bed.task.tid,
                per_round,
                || bed.out_ns(),
            )
        })
        .collect();
    let (done, report) = bed.stop();
    let when = |f: &Option<(Duration, task_detector::IoTask)>| {
        f.as_ref().map_or("never".to_string(), |(d, t)| {
            format!(
                "{d:?} ({:.0} requests/s, {:.2} in flight)",
                t.iops, t.io_fraction
            )
        })
    };
    for (i, r) in rounds.iter().enumerate() {
        eprintln!(
            "round {i}: found after {} by rate or time; {} by time alone",
            when(&r[0]),
            when(&r[1])
        );
    }
    eprintln!("requests done: {done}\n{report}");
    let found: Vec<_> = rounds.iter().filter_map(|r| r[0].as_ref()).collect();
    assert!(
        found.len() >= ROUNDS - 1,
        "the request task was found within {per_round:?} in only {} of {ROUNDS} rounds",
        found.len()
    );
    assert!(
        found
            .iter()
            .any(|(_, t)| t.io_fraction < by_rate.enter_fraction && t.iops >= by_rate.enter_iops),
        "never found by its rate: every round found it through a window mostly in flight"
    );
}

/// A reader that hands every read to a client thread over a pipe and waits for its answer
/// (a database backend and its client); the client runs SCHED_FIFO when `rt_client`.
struct Pair {
    reader: u32,
    client: u32,
    handles: Vec<std::thread::JoinHandle<u64>>,
}

fn spawn_pair(
    file: &Path,
    rt_client: bool,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Pair {
    use std::sync::atomic::Ordering;
    use std::sync::mpsc;
    let (to_client_r, to_client_w) = nix::unistd::pipe().expect("pipe");
    let (to_reader_r, to_reader_w) = nix::unistd::pipe().expect("pipe");
    let (tids_tx, tids_rx) = mpsc::channel();
    let client_tx = tids_tx.clone();
    let client = std::thread::spawn(move || {
        if rt_client {
            os_layer::sched::set_self_policy(libc::SCHED_FIFO, 1).expect("SCHED_FIFO");
        }
        client_tx.send(("client", gettid())).unwrap();
        let mut b = [0u8; 1];
        // Answers each request until the reader closes its end.
        while nix::unistd::read(&to_client_r, &mut b).unwrap_or(0) == 1 {
            nix::unistd::write(&to_reader_w, &b).expect("answer");
        }
        0
    });
    let reader_stop = stop.clone();
    let reader_file = file.to_path_buf();
    let reader = std::thread::spawn(move || {
        tids_tx.send(("reader", gettid())).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&reader_file)
            .expect("open O_DIRECT");
        let mut backing = vec![0u8; 8192];
        let skip = backing.as_ptr().align_offset(4096);
        let buf = &mut backing[skip..skip + 4096];
        let mut b = [0u8; 1];
        let mut i = 0u64;
        while !reader_stop.load(Ordering::Relaxed) {
            f.read_exact_at(buf, (i * 7919 % 65536) * 4096)
                .expect("read");
            nix::unistd::write(&to_client_w, &[1]).expect("request");
            nix::unistd::read(&to_reader_r, &mut b).expect("answer");
            i += 1;
        }
        drop(to_client_w);
        i
    });
    let mut tids = std::collections::HashMap::new();
    for _ in 0..2 {
        let (who, tid) = tids_rx.recv().unwrap();
        tids.insert(who, tid);
    }
    Pair {
        reader: tids["reader"],
        client: tids["client"],
        handles: vec![reader, client],
    }
}

/// Issue 33: the user threads an I/O thread wakes and is woken by are its partners. Two
/// readers each hand every read to a client thread and wait for its answer, beside a CPU
/// hog that the disk's completion interrupts land on: the detector names the fair client as
/// its reader's partner, never the hog (an interrupt's wake-up is charged to the task it
/// interrupted, which the reader never wakes back), and never the real-time client (a
/// real-time thread is not the daemon's to place, and a timer that wakes one charges
/// whoever it interrupted).
#[test]
#[cfg_attr(not(vmigrater_root), ignore = "needs root")]
fn the_thread_an_io_thread_answers_is_its_partner_and_a_hog_or_real_time_thread_never() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    assert_root();
    let _serial = serial();
    let file = data_file();
    let mut storage = TrackerStorage::new();
    let tracker = IoTracker::open(&TrackerOptions::default(), &mut storage).expect("load BPF");
    assert!(
        tracker.mode() == AttachMode::Tracepoint || tracker.hooks().contains(&"sched_wakeup"),
        "{} mode without sched_wakeup: {:?}",
        tracker.mode(),
        tracker.hooks()
    );
    let mut det = Detector::new(tracker, ClassifierConfig::default());
    let hogs: Vec<_> = (0..2)
        .map(|c| workload::spawn_hog(Some(c)).expect("hog"))
        .collect();
    let hog_tids: Vec<u32> = hogs.iter().map(|h| h.tid).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let fair = spawn_pair(&file, false, &stop);
    let rt = spawn_pair(&file, true, &stop);
    // Both readers and their clients for 2 s: the real-time pair wakes each other as
    // often as the fair one, which is named within a few hundred ms.
    let mut seen = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(5));
        let out = det.poll(&[]).expect("poll");
        seen.extend(out.partners);
    }
    stop.store(true, Ordering::Relaxed);
    let requests: Vec<u64> = [fair.handles, rt.handles]
        .into_iter()
        .flatten()
        .map(|h| h.join().expect("thread"))
        .collect();
    for h in hogs {
        h.stop().expect("hog");
    }
    if det.mode() == AttachMode::Tracepoint {
        assert!(seen.is_empty(), "classic mode finds no partners: {seen:?}");
        return;
    }
    eprintln!(
        "requests (fair reader, rt reader): {}, {}; partners seen: {seen:?}",
        requests[0], requests[2]
    );
    let p = seen
        .iter()
        .find(|p| p.of == fair.reader && p.tid == fair.client)
        .unwrap_or_else(|| {
            panic!(
                "the client {} of reader {} not found: {seen:?}",
                fair.client, fair.reader
            )
        });
    assert_eq!(p.tgid, std::process::id(), "{p:?}");
    assert!(
        !seen.iter().any(|p| hog_tids.contains(&p.tid)),
        "a hog named a partner: {seen:?} (hogs {hog_tids:?})"
    );
    assert!(
        requests[2] > 0 && !seen.iter().any(|p| p.tid == rt.client || p.of == rt.client),
        "the real-time client {} named a partner: {seen:?}",
        rt.client
    );
}

/// A shell the test pins: at each line on its stdin it starts `sh -c 'echo $$; sleep 30 &
/// echo $!; wait'` in the background, which prints its own pid and its child's.
struct Starter {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Starter {
    fn spawn() -> Starter {
        use std::os::unix::process::CommandExt;
        use std::process::{Command, Stdio};
        let mut child = Command::new("sh")
            .args([
                "-c",
                "while read l; do sh -c 'echo $$; sleep 30 & echo $!; wait' & done; wait",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("sh");
        let stdin = child.stdin.take().unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        Starter {
            child,
            stdin,
            stdout,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// (the shell it started, that shell's sleep)
    fn start(&mut self) -> (u32, u32) {
        use std::io::{BufRead, Write};
        writeln!(self.stdin, "go").expect("write");
        let mut pid = || {
            let mut l = String::new();
            self.stdout.read_line(&mut l).expect("read");
            l.trim().parse::<u32>().expect("a pid")
        };
        (pid(), pid())
    }
}

impl Drop for Starter {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
    }
}

/// Linux gives a child its parent's mask: a task the daemon pinned passes the pin on to
/// every process it starts. The fork program reports the children born narrowed, and the
/// executor sets back those of a task it pinned (grandchildren too, and after the parent's
/// release), never those of a task someone else pinned.
#[test]
#[cfg_attr(
    not(all(vmigrater_root, vmigrater_2cpus)),
    ignore = "needs root and 2 CPUs"
)]
fn the_processes_a_pinned_task_starts_get_its_own_mask_back() {
    use migrater::affinity::TaskId;
    use migrater::affinity::{get_cpus, set_cpus, AffinityExecutor, Outcome};
    use migrater::journal::AffinityJournal;
    assert_root();
    let _serial = serial();
    let mut storage = TrackerStorage::new();
    let mut tracker = IoTracker::open(&TrackerOptions::default(), &mut storage).expect("load BPF");
    // Classic tracepoints carry no task pointer, so forks are not watched there: a failed
    // precondition, said as a failure, never a pass.
    assert_ne!(
        tracker.mode(),
        AttachMode::Tracepoint,
        "PRECONDITION FAILED: this kernel attaches the block programs as classic \
         tracepoints, which watch no forks; the inherited-pin rule cannot be tested here"
    );
    assert!(tracker.hooks().contains(&"sched_process_fork"));
    let own = get_cpus(gettid()).unwrap();
    assert!(own.len() >= 2, "needs 2 CPUs in the test's mask");
    let pin = own[1];
    let dir = tempfile::tempdir().unwrap();
    let mut ex = AffinityExecutor::new(AffinityJournal::open(dir.path().join("j.json")).unwrap());

    let mut ours = Starter::spawn();
    let theirs = Starter::spawn();
    std::thread::sleep(Duration::from_millis(50));
    let start = os_layer::TaskStat::of_tid(ours.pid()).unwrap().start_time;
    ex.manage(
        TaskId {
            tid: ours.pid(),
            start_time: start,
        },
        ours.pid(),
    )
    .expect("manage");
    assert!(matches!(ex.move_to(ours.pid(), pin), Outcome::Moved { .. }));
    // Someone else's pin: never ours to undo.
    set_cpus(theirs.pid(), &[pin]).expect("pin");
    let mut theirs = theirs;
    let _ = tracker.take_forks().expect("forks");

    let (shell, sleep) = ours.start();
    let (their_shell, their_sleep) = theirs.start();
    for tid in [shell, sleep, their_shell, their_sleep] {
        assert_eq!(get_cpus(tid).unwrap(), [pin], "tid {tid} born with the pin");
    }
    let forks = tracker.take_forks().expect("forks");
    let seen = |child: u32, parent: u32| {
        forks
            .iter()
            .any(|f| f.child == child && f.parent == parent && f.mask == 1 << pin)
    };
    assert!(seen(shell, ours.pid()), "{forks:?}");
    assert!(
        seen(sleep, shell),
        "the grandchild, by its own parent: {forks:?}"
    );
    assert!(seen(their_shell, theirs.pid()), "{forks:?}");

    // Reported after the parent was handed back: its own mask is still known.
    assert!(matches!(ex.release(ours.pid()), Outcome::Restored { .. }));
    assert_eq!(ex.undo_inherited(&forks), 2, "{forks:?}");
    assert_eq!(get_cpus(shell).unwrap(), own);
    assert_eq!(get_cpus(sleep).unwrap(), own);
    assert_eq!(get_cpus(their_shell).unwrap(), [pin], "not ours");
    assert_eq!(get_cpus(their_sleep).unwrap(), [pin]);

    // A child that changed its own mask since its birth keeps it.
    let start = os_layer::TaskStat::of_tid(ours.pid()).unwrap().start_time;
    ex.manage(
        TaskId {
            tid: ours.pid(),
            start_time: start,
        },
        ours.pid(),
    )
    .expect("manage again");
    assert!(matches!(ex.move_to(ours.pid(), pin), Outcome::Moved { .. }));
    let (shell, sleep) = ours.start();
    set_cpus(sleep, &[own[0]]).expect("its own choice");
    let forks = tracker.take_forks().expect("forks");
    assert_eq!(ex.undo_inherited(&forks), 1, "{forks:?}");
    assert_eq!(get_cpus(shell).unwrap(), own);
    assert_eq!(get_cpus(sleep).unwrap(), [own[0]]);

    // A child taken over before its fork is reported: what is restored is its parent's
    // mask, not the pin it inherited.
    let (shell, sleep) = ours.start();
    let start = os_layer::TaskStat::of_tid(sleep).unwrap().start_time;
    assert_eq!(
        ex.manage(
            TaskId {
                tid: sleep,
                start_time: start
            },
            sleep
        )
        .expect("manage"),
        [pin]
    );
    let forks = tracker.take_forks().expect("forks");
    assert_eq!(ex.undo_inherited(&forks), 2, "{forks:?}");
    assert_eq!(get_cpus(shell).unwrap(), own);
    assert_eq!(
        get_cpus(sleep).unwrap(),
        own,
        "never moved by us: set back now"
    );
    assert!(ex.is_managed(sleep));
    assert!(matches!(ex.move_to(sleep, pin), Outcome::Moved { .. }));
    assert!(matches!(ex.release(sleep), Outcome::Restored { .. }));
    assert_eq!(get_cpus(sleep).unwrap(), own, "its parent's mask restored");
    ex.release_all();
}
