//! Workloads for tests and benchmarks: O_DIRECT I/O threads (random 4 KiB reads,
//! sequential 128 KiB or 1 MiB reads, a 70/30 random read/write mix, and requests of one
//! random read plus a fixed amount of CPU work) and a CPU hog, each on its own thread with
//! progress counters and its tid, so a test can ask the kernel (or our daemon) about
//! exactly that thread. Writes go only to regular files, never to a device.

use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How an I/O thread walks its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadPattern {
    /// 4 KiB reads at random aligned offsets.
    Random4k,
    /// 128 KiB reads, sequential, wrapping at the end of the file.
    Seq128k,
    /// 1 MiB reads, sequential, wrapping at the end of the file.
    Seq1m,
    /// 4 KiB at random aligned offsets, 70% reads and 30% writes (regular files only).
    RandRw70,
    /// A request: one random 4 KiB read, then a fixed amount of CPU work (see
    /// [`IoSpec::request_work`]); its latency is the whole request's.
    Request,
}

impl ReadPattern {
    pub fn block_size(self) -> usize {
        match self {
            ReadPattern::Random4k | ReadPattern::RandRw70 | ReadPattern::Request => 4096,
            ReadPattern::Seq128k => 128 << 10,
            ReadPattern::Seq1m => 1 << 20,
        }
    }

    /// Whether the thread writes (and so needs a regular file opened for writing).
    pub fn writes(self) -> bool {
        self == ReadPattern::RandRw70
    }
}

impl std::str::FromStr for ReadPattern {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "random4k" => ReadPattern::Random4k,
            "seq128k" => ReadPattern::Seq128k,
            "seq1m" => ReadPattern::Seq1m,
            "randrw70" => ReadPattern::RandRw70,
            "request" => ReadPattern::Request,
            other => anyhow::bail!(
                "pattern {other:?}: expected random4k, seq128k, seq1m, randrw70 or request"
            ),
        })
    }
}

/// What an I/O thread does beyond its pattern.
#[derive(Clone, Copy, Debug)]
pub struct IoSpec {
    pub pattern: ReadPattern,
    /// Pin the thread to this CPU before its first request.
    pub pin: Option<usize>,
    /// [`ReadPattern::Request`]: CPU work after each read, as a count of arithmetic units
    /// from [`work_units_for`] (a count, not a time: a deschedule must stretch it).
    pub request_work: u64,
    /// Seed of the random offsets, so parallel threads do not read the same blocks.
    pub seed: u64,
    /// Requests a second on a fixed schedule: a thread behind it (its vCPU out) catches up
    /// at once, so its rate over a second is this whatever happens to its vCPU, as long as
    /// the disk keeps up (a client with a fixed offered load). `None`: back to back.
    pub rate: Option<u32>,
}

impl IoSpec {
    pub fn new(pattern: ReadPattern) -> IoSpec {
        IoSpec {
            pattern,
            pin: None,
            request_work: 0,
            seed: 0x9e37_79b9_7f4a_7c15,
            rate: None,
        }
    }
}

/// One unit of CPU work: a short dependent chain of multiply-adds.
#[inline(never)]
fn work_unit(acc: u64) -> u64 {
    let mut a = acc;
    for i in 0..64u64 {
        a = std::hint::black_box(a.wrapping_mul(6364136223846793005).wrapping_add(i));
    }
    a
}

/// Units of [`work_unit`] that take `target` of CPU on this machine: the fastest of many
/// short trials, so an interrupt or deschedule during calibration does not inflate it.
/// A warm-up spin comes first so a CPU still ramping its clock does not either. It stays
/// an estimate: a busy SMT sibling or another tenant's load during the trials still makes
/// a unit read slower than it later runs (CI measured a request 12% under its target).
pub fn work_units_for(target: Duration) -> u64 {
    const TRIAL: u64 = 200;
    let mut acc = 1u64;
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_millis(20) {
        acc = work_unit(acc);
    }
    let mut best = Duration::MAX;
    for _ in 0..200 {
        let t = Instant::now();
        for _ in 0..TRIAL {
            acc = work_unit(acc);
        }
        best = best.min(t.elapsed());
    }
    std::hint::black_box(acc);
    let per_unit = best.as_secs_f64() / TRIAL as f64;
    ((target.as_secs_f64() / per_unit.max(1e-12)).round() as u64).max(1)
}

/// Creates (or reuses, when already large enough) a file of `size` bytes filled with
/// non-zero data, flushed to disk so O_DIRECT reads hit the device and not holes.
pub fn prepare_file(path: &Path, size: u64) -> Result<()> {
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.len() >= size {
            return Ok(());
        }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let chunk: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8 + 1).collect();
    let mut written = 0u64;
    while written < size {
        f.write_all(&chunk)?;
        written += chunk.len() as u64;
    }
    f.sync_all()?;
    Ok(())
}

/// A page-aligned buffer, as O_DIRECT requires.
struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, 4096).expect("layout");
        // SAFETY: len > 0 and the layout is valid; freed in Drop with the same layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocation of {len} bytes failed");
        AlignedBuf { ptr, len }
    }
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes and uniquely owned.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, 4096).expect("layout");
        // SAFETY: allocated in new() with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) }
    }
}

/// A running workload thread: its tid, a progress counter, and a stop switch.
pub struct Worker {
    pub tid: u32,
    /// I/O requests completed (reads and writes), or work units done (hog).
    pub progress: Arc<AtomicU64>,
    /// I/O threads: how many of `progress` were writes.
    pub writes: Arc<AtomicU64>,
    /// I/O threads: the latency of every request, in microseconds.
    pub latency_us: Arc<Mutex<Histogram<u64>>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Result<()>>>,
}

impl Worker {
    pub fn count(&self) -> u64 {
        self.progress.load(Ordering::Relaxed)
    }

    pub fn write_count(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Stops the thread and returns its final count, or the error that ended it.
    pub fn stop(mut self) -> Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            h.join()
                .map_err(|_| anyhow::anyhow!("workload thread panicked"))??;
        }
        Ok(self.count())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// What a worker thread's body updates.
struct Counters<'a> {
    progress: &'a AtomicU64,
    writes: &'a AtomicU64,
    stop: &'a AtomicBool,
    latency: &'a Mutex<Histogram<u64>>,
}

fn spawn_worker<F>(name: &str, body: F) -> Result<Worker>
where
    F: FnOnce(Counters) -> Result<()> + Send + 'static,
{
    let progress = Arc::new(AtomicU64::new(0));
    let writes = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let tid = Arc::new(AtomicU32::new(0));
    // 1 µs to 1 h at 3 significant digits; auto-resize never needed.
    let latency_us = Arc::new(Mutex::new(Histogram::new_with_bounds(1, 3_600_000_000, 3)?));
    let (p, w, s, t, l) = (
        progress.clone(),
        writes.clone(),
        stop.clone(),
        tid.clone(),
        latency_us.clone(),
    );
    let handle = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            t.store(crate::gettid(), Ordering::Release);
            body(Counters {
                progress: &p,
                writes: &w,
                stop: &s,
                latency: &l,
            })
        })?;
    while tid.load(Ordering::Acquire) == 0 {
        if handle.is_finished() {
            break;
        }
        std::thread::yield_now();
    }
    Ok(Worker {
        tid: tid.load(Ordering::Acquire),
        progress,
        writes,
        latency_us,
        stop,
        handle: Some(handle),
    })
}

/// Starts a thread issuing synchronous O_DIRECT reads of `pattern` on `path` until stopped.
pub fn spawn_reader(path: &Path, pattern: ReadPattern) -> Result<Worker> {
    spawn_io(path, IoSpec::new(pattern))
}

/// Pins the calling thread to `cpu`.
fn pin_self(cpu: usize) -> Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .with_context(|| format!("pinning to CPU {cpu}"))
}

/// Starts a thread issuing synchronous O_DIRECT requests as `spec` says, until stopped.
/// The thread is named `reader-<pattern>` (tests and benchmarks find I/O threads by that
/// prefix; the kernel keeps 15 bytes of it).
pub fn spawn_io(path: &Path, spec: IoSpec) -> Result<Worker> {
    let pattern = spec.pattern;
    if pattern.writes() {
        let meta = std::fs::metadata(path).with_context(|| format!("stat {}", path.display()))?;
        anyhow::ensure!(
            meta.is_file(),
            "{}: the {pattern:?} pattern writes, and writes go only to a regular file the \
             benchmark created, never to a device",
            path.display()
        );
    }
    let file = OpenOptions::new()
        .read(true)
        .write(pattern.writes())
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("opening {} with O_DIRECT", path.display()))?;
    // Seeking to the end sizes block devices too (their metadata length is 0): the lab
    // guest reads its virtio disk directly.
    let len = std::io::Seek::seek(&mut &file, std::io::SeekFrom::End(0))?;
    let bs = pattern.block_size() as u64;
    anyhow::ensure!(
        len >= bs * 4,
        "{} is too small ({len} bytes)",
        path.display()
    );
    let blocks = len / bs;
    let name: String = format!("reader-{pattern:?}").chars().take(15).collect();
    spawn_worker(&name, move |c| {
        if let Some(cpu) = spec.pin {
            pin_self(cpu)?;
        }
        let mut buf = AlignedBuf::new(bs as usize);
        // Reads fill the buffer; writes then put back data that is never all zero.
        buf.as_mut().fill(0x5a);
        // xorshift: cheap, deterministic, and no dependency for a benchmark's offsets.
        let mut x: u64 = spec.seed | 1;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut next = 0u64;
        let mut acc = 1u64;
        let start = Instant::now();
        let mut issued = 0u64;
        while !c.stop.load(Ordering::Relaxed) {
            if let Some(rate) = spec.rate {
                let due = start + Duration::from_secs_f64(issued as f64 / rate.max(1) as f64);
                if let Some(ahead) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(ahead);
                }
                issued += 1;
            }
            let (block, write) = match pattern {
                ReadPattern::Random4k | ReadPattern::Request => (rnd() % blocks, false),
                ReadPattern::RandRw70 => {
                    let r = rnd();
                    (r % blocks, (r >> 40) % 10 < 3)
                }
                ReadPattern::Seq128k | ReadPattern::Seq1m => {
                    let b = next;
                    next = (next + 1) % blocks;
                    (b, false)
                }
            };
            let t0 = Instant::now();
            if write {
                file.write_all_at(buf.as_mut(), block * bs)
                    .context("O_DIRECT write")?;
                c.writes.fetch_add(1, Ordering::Relaxed);
            } else {
                file.read_exact_at(buf.as_mut(), block * bs)
                    .context("O_DIRECT read")?;
            }
            if pattern == ReadPattern::Request {
                for _ in 0..spec.request_work {
                    acc = work_unit(acc);
                }
            }
            let us = t0.elapsed().as_micros().max(1) as u64;
            if let Ok(mut h) = c.latency.lock() {
                h.saturating_record(us);
            }
            c.progress.fetch_add(1, Ordering::Relaxed);
        }
        std::hint::black_box(acc);
        Ok(())
    })
}

/// Starts a thread that burns CPU in small units (counted), optionally pinned to `cpu`.
pub fn spawn_hog(cpu: Option<usize>) -> Result<Worker> {
    spawn_worker("cpu-hog", move |c| {
        let (progress, stop) = (c.progress, c.stop);
        if let Some(cpu) = cpu {
            pin_self(cpu)?;
        }
        let mut acc = 1u64;
        while !stop.load(Ordering::Relaxed) {
            // ~tens of µs of arithmetic per unit; black_box keeps it from being folded.
            for i in 0..20_000u64 {
                acc = std::hint::black_box(acc.wrapping_mul(6364136223846793005).wrapping_add(i));
            }
            progress.fetch_add(1, Ordering::Relaxed);
        }
        std::hint::black_box(acc);
        Ok(())
    })
}

/// The threads of process `pid` whose command starts with `prefix` (a workload's I/O
/// threads are `reader-*`), in /proc order.
pub fn threads_named(pid: u32, prefix: &str) -> Vec<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.starts_with(prefix))
        })
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}
