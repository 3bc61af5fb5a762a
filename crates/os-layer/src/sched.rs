//! Raw `sched_{get,set}attr` (libc declares the struct, not the calls): the only way to set
//! a fair-class thread's custom slice (`sched_runtime`, Linux 6.12+) together with its nice.
//! And the calling thread's own CPU and policy, for the testbeds' helper threads.

use std::io;

/// Thread `tid`'s scheduling attributes (0: the calling thread).
pub fn get_attr(tid: u32) -> io::Result<libc::sched_attr> {
    // SAFETY: zeroed sched_attr is a valid out-parameter; size tells the kernel its length.
    let mut attr: libc::sched_attr = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::sched_attr>() as u32;
    // SAFETY: valid pointer and size for the duration of the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            tid as libc::pid_t,
            &mut attr as *mut _,
            size,
            0u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(attr)
}

/// Sets thread `tid`'s scheduling attributes; `size` is filled in here.
pub fn set_attr(tid: u32, attr: &libc::sched_attr) -> io::Result<()> {
    let mut a = *attr;
    a.size = std::mem::size_of::<libc::sched_attr>() as u32;
    // SAFETY: valid pointer to an initialised sched_attr for the duration of the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_setattr,
            tid as libc::pid_t,
            &a as *const _,
            0u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `policy` is one of the fair class's (the ones a custom slice applies to).
pub fn is_fair(policy: u32) -> bool {
    policy == libc::SCHED_OTHER as u32 || policy == libc::SCHED_BATCH as u32
}

/// The slice a fair thread without a custom one reads back (`sched_runtime` of
/// `sched_getattr`: the kernel's base slice, which scales with the CPU count). A child
/// inherits its parent's custom slice, so it is asked of a helper thread that drops its
/// own first (`sched_runtime` = 0 means "no custom slice"). `None` before Linux 6.12,
/// where fair threads read 0 and no slice can be set.
pub fn base_slice_ns() -> io::Result<Option<u64>> {
    std::thread::spawn(|| {
        let mut a = get_attr(0)?;
        a.sched_policy = libc::SCHED_OTHER as u32;
        a.sched_priority = 0;
        a.sched_runtime = 0;
        // Keeps the thread's nice: raising it back would need a privilege.
        a.sched_flags = 0;
        set_attr(0, &a)?;
        let slice = get_attr(0)?.sched_runtime;
        Ok((slice > 0).then_some(slice))
    })
    .join()
    .map_err(|_| io::Error::other("the thread asking the base slice panicked"))?
}

/// Thread `tid`'s slice when it is a fair-class thread (`None` for real-time and idle ones).
pub fn fair_slice(tid: u32) -> io::Result<Option<u64>> {
    let a = get_attr(tid)?;
    Ok(is_fair(a.sched_policy).then_some(a.sched_runtime))
}

/// Gives fair thread `tid` a custom slice of `ns` (0: none, the kernel's base slice back),
/// keeping its policy, nice and reset-on-fork flag. The kernel clamps it to 0.1–100 ms.
pub fn set_fair_slice(tid: u32, ns: u64) -> io::Result<()> {
    let mut a = get_attr(tid)?;
    if !is_fair(a.sched_policy) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    a.sched_runtime = ns;
    a.sched_flags &= libc::SCHED_FLAG_RESET_ON_FORK as u64;
    set_attr(tid, &a)
}

/// Pins the calling thread to `cpu`.
pub fn pin_self(cpu: usize) -> io::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).map_err(io::Error::from)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).map_err(io::Error::from)
}

/// Sets the calling thread's policy (`libc::SCHED_FIFO`, `SCHED_IDLE`, ...) and priority.
pub fn set_self_policy(policy: libc::c_int, priority: i32) -> io::Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: plain syscall on the calling thread with a valid param.
    if unsafe { libc::sched_setscheduler(0, policy, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_attributes_read_back_as_written() {
        let a = get_attr(0).expect("sched_getattr on self");
        set_attr(0, &a).expect("writing back what was read needs no privilege");
        let b = get_attr(0).unwrap();
        assert_eq!(
            (a.sched_policy, a.sched_nice),
            (b.sched_policy, b.sched_nice)
        );
    }

    #[test]
    fn a_thread_pins_itself_and_drops_to_sched_idle() {
        std::thread::spawn(|| {
            pin_self(0).expect("CPU 0 is always online");
            let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
            assert!(set.is_set(0).unwrap());
            assert!((1..nix::sched::CpuSet::count()).all(|c| !set.is_set(c).unwrap()));
            // Lowering a thread to SCHED_IDLE needs no privilege.
            set_self_policy(libc::SCHED_IDLE, 0).unwrap();
            assert_eq!(get_attr(0).unwrap().sched_policy, libc::SCHED_IDLE as u32);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_custom_slice_reads_back_and_zero_gives_the_base_one_back() {
        std::thread::spawn(|| {
            let base = base_slice_ns().unwrap().expect("Linux >= 6.12");
            let mut a = get_attr(0).unwrap();
            assert_eq!(
                a.sched_runtime, base,
                "an untouched thread has the base slice"
            );
            a.sched_runtime = 100_000;
            set_attr(0, &a).unwrap();
            assert_eq!(get_attr(0).unwrap().sched_runtime, 100_000);
            // A child inherits it, the base is still what a thread without one reads.
            assert_eq!(base_slice_ns().unwrap(), Some(base));
            a.sched_runtime = 0;
            set_attr(0, &a).unwrap();
            assert_eq!(get_attr(0).unwrap().sched_runtime, base);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_missing_thread_is_esrch() {
        let err = get_attr(u32::MAX >> 2).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ESRCH));
    }
}
