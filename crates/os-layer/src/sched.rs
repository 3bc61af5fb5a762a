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
    fn a_missing_thread_is_esrch() {
        let err = get_attr(u32::MAX >> 2).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ESRCH));
    }
}
