//! The host side of a scenario: pinning vCPU threads, giving threads a custom EEVDF slice
//! (the hypervisor's time slice: 11 ms in the vMigrater paper), CPU hogs that stand for
//! co-located VMs, and the guest disk.

use anyhow::{Context, Result};
use std::path::Path;

pub fn pin(tid: u32, cpu: usize) -> Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(tid as i32), &set)
        .with_context(|| format!("pinning thread {tid} to CPU {cpu}"))
}

/// Changes `tid`'s scheduling attributes with `f`, keeping the rest.
fn update_attr(tid: u32, what: &str, f: impl FnOnce(&mut libc::sched_attr)) -> Result<()> {
    let mut attr =
        os_layer::sched::get_attr(tid).with_context(|| format!("sched_getattr({tid})"))?;
    f(&mut attr);
    os_layer::sched::set_attr(tid, &attr).with_context(|| format!("setting {what} on thread {tid}"))
}

/// Sets `tid`'s custom slice (sched_attr.sched_runtime of a fair-class thread, Linux 6.12+;
/// the kernel clamps it to 0.1–100 ms), keeping its nice.
pub fn set_slice(tid: u32, slice_ns: u64) -> Result<()> {
    update_attr(tid, &format!("a {slice_ns} ns slice"), |a| {
        a.sched_runtime = slice_ns
    })
}

/// Sets `tid`'s nice, keeping its slice.
pub fn set_nice(tid: u32, nice: i32) -> Result<()> {
    update_attr(tid, &format!("nice {nice}"), |a| a.sched_nice = nice)
}

/// The on-CPU time of a thread so far (schedstat), in seconds.
pub fn cpu_seconds(pid: u32, tid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |ns| ns / 1e9)
}

/// A raw disk image of `mb` MiB filled with data (holes would read without host I/O).
pub fn make_disk(path: &Path, mb: u64) -> Result<()> {
    if std::fs::metadata(path).is_ok_and(|m| m.len() == mb << 20) {
        return Ok(());
    }
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut block = vec![0u8; 1 << 20];
    let mut x = 0x9e3779b97f4a7c15u64;
    for _ in 0..mb {
        for b in block.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.copy_from_slice(&x.to_ne_bytes());
        }
        f.write_all(&block)?;
    }
    f.flush()?;
    Ok(())
}
