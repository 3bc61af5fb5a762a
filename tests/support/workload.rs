//! Workloads for tests and benchmarks: an O_DIRECT reader (random 4 KiB or sequential
//! 1 MiB) and a CPU hog, each on its own thread with a progress counter and its tid, so a
//! test can ask the kernel (or our daemon) about exactly that thread.

use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// How a reader walks its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadPattern {
    /// 4 KiB requests at random aligned offsets.
    Random4k,
    /// 1 MiB requests, sequential, wrapping at the end of the file.
    Seq1m,
}

impl ReadPattern {
    pub fn block_size(self) -> usize {
        match self {
            ReadPattern::Random4k => 4096,
            ReadPattern::Seq1m => 1 << 20,
        }
    }
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
    /// Reads completed (reader) or work units done (hog).
    pub progress: Arc<AtomicU64>,
    /// Readers: the latency of every read, in microseconds.
    pub latency_us: Arc<Mutex<Histogram<u64>>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Result<()>>>,
}

impl Worker {
    pub fn count(&self) -> u64 {
        self.progress.load(Ordering::Relaxed)
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

fn spawn_worker<F>(name: &str, body: F) -> Result<Worker>
where
    F: FnOnce(&AtomicU64, &AtomicBool, &Mutex<Histogram<u64>>) -> Result<()> + Send + 'static,
{
    let progress = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let tid = Arc::new(AtomicU32::new(0));
    // 1 µs to 1 h at 3 significant digits; auto-resize never needed.
    let latency_us = Arc::new(Mutex::new(Histogram::new_with_bounds(1, 3_600_000_000, 3)?));
    let (p, s, t, l) = (
        progress.clone(),
        stop.clone(),
        tid.clone(),
        latency_us.clone(),
    );
    let handle = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            t.store(crate::gettid(), Ordering::Release);
            body(&p, &s, &l)
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
        latency_us,
        stop,
        handle: Some(handle),
    })
}

/// Starts a thread issuing synchronous O_DIRECT reads of `pattern` on `path` until stopped.
pub fn spawn_reader(path: &Path, pattern: ReadPattern) -> Result<Worker> {
    let file = OpenOptions::new()
        .read(true)
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
    spawn_worker(
        &format!("reader-{pattern:?}"),
        move |progress, stop, latency| {
            let mut buf = AlignedBuf::new(bs as usize);
            // xorshift: cheap, deterministic, and no dependency for a benchmark's offsets.
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            let mut next = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let block = match pattern {
                    ReadPattern::Random4k => {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x % blocks
                    }
                    ReadPattern::Seq1m => {
                        let b = next;
                        next = (next + 1) % blocks;
                        b
                    }
                };
                let t0 = std::time::Instant::now();
                file.read_exact_at(buf.as_mut(), block * bs)
                    .context("O_DIRECT read")?;
                let us = t0.elapsed().as_micros().max(1) as u64;
                if let Ok(mut h) = latency.lock() {
                    h.saturating_record(us);
                }
                progress.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        },
    )
}

/// Starts a thread that burns CPU in small units (counted), optionally pinned to `cpu`.
pub fn spawn_hog(cpu: Option<usize>) -> Result<Worker> {
    spawn_worker("cpu-hog", move |progress, stop, _| {
        if let Some(cpu) = cpu {
            let mut set = nix::sched::CpuSet::new();
            set.set(cpu)?;
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)?;
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
