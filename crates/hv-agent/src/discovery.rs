//! Finding VMs and their vCPU threads without being told their thread ids.
//! - QEMU started with `-name ...,debug-threads=on` (libvirt always does this) names each
//!   vCPU thread `CPU <n>/KVM` (`/TCG` under emulation): the pid file is enough.
//! - libvirt creates a unix socket per `<channel>` under
//!   `channel_dir/domain-<id>-<name>/<port name>` and the pid file `pid_dir/<name>.pid`.
//! - A libvirt inside a container (KubeVirt's virt-launcher pod) does the same in the pod's
//!   own mount and pid namespaces, so neither path means anything on the host. From the
//!   host (`hostPID`), the QEMU process names its VM (`-name guest=...`) and holds the
//!   channel's listening socket, whose bound path `/proc/<pid>/net/unix` lists and
//!   `/proc/<pid>/root` reaches.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

use crate::config::VmConfig;

pub const PORT_NAME: &str = "org.vmigrater.hint.0";

/// `CPU 3/KVM` → 3. Only QEMU's vCPU thread names match.
pub fn vcpu_index(comm: &str) -> Option<u32> {
    let rest = comm.trim_end().strip_prefix("CPU ")?;
    let (n, accel) = rest.split_once('/')?;
    (!accel.is_empty()).then_some(())?;
    n.parse().ok()
}

/// The vCPU threads of QEMU process `pid`, in vCPU order.
pub fn threads_by_comm(pid: u32) -> Result<Vec<u32>> {
    let dir = format!("/proc/{pid}/task");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let Some(tid) = entry?
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("{dir}/{tid}/comm")).unwrap_or_default();
        if let Some(n) = vcpu_index(&comm) {
            found.push((n, tid));
        }
    }
    anyhow::ensure!(
        !found.is_empty(),
        "process {pid} has no thread named \"CPU <n>/...\" (QEMU needs -name ...,debug-threads=on)"
    );
    found.sort_unstable();
    Ok(found.into_iter().map(|(_, tid)| tid).collect())
}

pub fn read_pid_file(path: &Path) -> Result<u32> {
    // A pid file holds a number: a bound keeps a wrong path (a device, a log) from being
    // read whole.
    let text = control::read_bounded(path, "pid", 4096)?;
    text.trim()
        .parse()
        .with_context(|| format!("{}: not a pid: {:?}", path.display(), text.trim()))
}

/// `domain-12-web-1` → `web-1`.
fn domain_name(dir: &str) -> Option<&str> {
    let rest = dir.strip_prefix("domain-")?;
    let (id, name) = rest.split_once('-')?;
    (id.parse::<u32>().is_ok() && !name.is_empty()).then_some(name)
}

/// Running libvirt VMs that carry our channel, as VM configurations.
pub fn libvirt_vms(channel_dir: &Path, pid_dir: &Path) -> Vec<VmConfig> {
    let Ok(entries) = std::fs::read_dir(channel_dir) else {
        return Vec::new();
    };
    let mut vms: Vec<VmConfig> = entries
        .flatten()
        .filter_map(|e| {
            let dir = e.file_name().to_str()?.to_string();
            let name = domain_name(&dir)?.to_string();
            let socket: PathBuf = e.path().join(PORT_NAME);
            socket.exists().then(|| VmConfig {
                pid_file: Some(pid_dir.join(format!("{name}.pid"))),
                name,
                hint_socket: Some(socket),
                qmp_socket: None,
                vcpu_threads: Vec::new(),
                host_cpus: Vec::new(),
                domain: None,
                model_slot: None,
                pid: None,
            })
        })
        .collect();
    vms.sort_by(|a, b| a.name.cmp(&b.name));
    vms
}

/// Every VM libvirt runs with our channel: the host's libvirt first, then, with
/// `containers`, QEMU processes found under /proc that the host's libvirt does not know.
pub fn libvirt_all(l: &crate::config::LibvirtConfig) -> Vec<VmConfig> {
    let mut vms = libvirt_vms(&l.channel_dir, &l.pid_dir);
    if l.containers {
        for vm in contained_vms(Path::new("/proc")) {
            if !vms.iter().any(|v| v.name == vm.name) {
                vms.push(vm);
            }
        }
    }
    vms
}

/// The guest name of a QEMU command line (`/proc/<pid>/cmdline`, NUL-separated):
/// `-name guest=web,debug-threads=on` or `-name web`, with QEMU's `,,` for a comma.
pub fn qemu_guest_name(cmdline: &[u8]) -> Option<String> {
    let mut args = cmdline.split(|&b| b == 0);
    args.find(|a| *a == b"-name")?;
    let value = std::str::from_utf8(args.next()?).ok()?;
    let mut opts = Vec::new();
    let mut cur = String::new();
    let mut chars = value.chars().peekable();
    while let Some(c) = chars.next() {
        if c != ',' {
            cur.push(c);
        } else if chars.peek() == Some(&',') {
            chars.next();
            cur.push(',');
        } else {
            opts.push(std::mem::take(&mut cur));
        }
    }
    opts.push(cur);
    let first = opts.first().filter(|o| !o.contains('=')).cloned();
    let name = first.or_else(|| {
        opts.iter()
            .find_map(|o| o.strip_prefix("guest=").map(String::from))
    })?;
    (!name.is_empty()).then_some(name)
}

/// A procfs file read whole, up to `limit` bytes (procfs reports size 0).
fn read_proc(path: &Path, limit: u64) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut buf = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(limit)
        .read_to_end(&mut buf)
        .ok()?;
    Some(buf)
}

/// The bound path, as its process sees it, of a listening unix socket named after our
/// port that process `proc_pid` (a `/proc/<pid>` directory) holds open.
pub fn held_channel(proc_pid: &Path) -> Option<PathBuf> {
    const LISTENING: u32 = 0x10000; // __SO_ACCEPTCON
    let table = read_proc(&proc_pid.join("net/unix"), 16 << 20)?;
    let table = String::from_utf8_lossy(&table);
    let suffix = format!("/{PORT_NAME}");
    let listening: Vec<(u64, &str)> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            // Num RefCount Protocol Flags Type St Inode Path
            let f: Vec<&str> = line.split_whitespace().collect();
            let path = *f.get(7)?;
            let flags = u32::from_str_radix(f.get(3)?, 16).ok()?;
            let inode = f.get(6)?.parse().ok()?;
            (flags & LISTENING != 0 && path.starts_with('/') && path.ends_with(&suffix))
                .then_some((inode, path))
        })
        .collect();
    if listening.is_empty() {
        return None;
    }
    for fd in std::fs::read_dir(proc_pid.join("fd")).ok()?.flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        let Some(inode) = target
            .to_str()
            .and_then(|t| t.strip_prefix("socket:["))
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse::<u64>().ok())
        else {
            continue;
        };
        if let Some((_, path)) = listening.iter().find(|(i, _)| *i == inode) {
            return Some(PathBuf::from(path));
        }
    }
    None
}

/// VMs whose QEMU runs in a container of its own (KubeVirt) or on the host, found under
/// `proc` (`/proc`): processes started with `-name` that hold our channel's listening
/// socket. The socket is reached through the process's own root, and the pid is the
/// host's.
pub fn contained_vms(proc: &Path) -> Vec<VmConfig> {
    let Ok(entries) = std::fs::read_dir(proc) else {
        return Vec::new();
    };
    let mut vms: Vec<VmConfig> = entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let dir = e.path();
            let name = qemu_guest_name(&read_proc(&dir.join("cmdline"), 1 << 20)?)?;
            let bound = held_channel(&dir)?;
            let socket = dir.join("root").join(bound.strip_prefix("/").ok()?);
            Some(VmConfig {
                name,
                hint_socket: Some(socket),
                qmp_socket: None,
                pid_file: None,
                vcpu_threads: Vec::new(),
                host_cpus: Vec::new(),
                domain: None,
                model_slot: None,
                pid: Some(pid),
            })
        })
        .collect();
    vms.sort_by(|a, b| a.name.cmp(&b.name));
    // Two processes that claim one name are not told apart here: a migration's source and
    // target on one node, or a process of some pod that names itself after a VM. The
    // agent follows neither (the VM runs as without the agent) rather than the wrong one.
    let names: Vec<String> = vms.iter().map(|v| v.name.clone()).collect();
    vms.retain(|v| names.iter().filter(|n| **n == v.name).count() == 1);
    vms
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(vcpu_index("CPU 0/KVM\n"), Some(0));
        assert_eq!(vcpu_index("CPU 12/TCG"), Some(12));
        assert_eq!(vcpu_index("CPU 1"), None);
        assert_eq!(vcpu_index("CPU x/KVM"), None);
        assert_eq!(vcpu_index("qemu-system-x86"), None);
        assert_eq!(domain_name("domain-3-web-1"), Some("web-1"));
        assert_eq!(domain_name("domain-x-web"), None);
        assert_eq!(domain_name("domain-3-"), None);
    }

    #[test]
    fn qemu_names() {
        let name = |s: &str| qemu_guest_name(s.replace(' ', "\0").as_bytes());
        assert_eq!(
            name("qemu-kvm -S -name guest=ns_web,debug-threads=on -m 1024"),
            Some("ns_web".into())
        );
        assert_eq!(
            name("qemu-system-x86_64 -name web -m 1"),
            Some("web".into())
        );
        assert_eq!(
            name("qemu -name debug-threads=on,guest=a,,b"),
            Some("a,b".into())
        );
        assert_eq!(name("qemu -name"), None);
        assert_eq!(name("qemu -name guest="), None);
        assert_eq!(name("find / -type f"), None);
    }

    /// A /proc of two QEMUs holding our port's socket under one name, one under another
    /// name, one whose socket is not its own, and one that is not listening.
    #[test]
    fn qemu_processes_under_a_proc_tree() {
        use std::os::unix::fs::symlink;
        let root = tempfile::tempdir().unwrap();
        let proc = root.path();
        let header = "Num       RefCount Protocol Flags    Type St Inode Path\n";
        let line = |inode: u64, flags: &str, path: &str| {
            format!("0000000000000000: 00000002 00000000 {flags} 0001 01 {inode} {path}\n")
        };
        let mk = |pid: u32, name: &str, table: String, fds: &[u64]| {
            let dir = proc.join(pid.to_string());
            std::fs::create_dir_all(dir.join("net")).unwrap();
            std::fs::create_dir_all(dir.join("fd")).unwrap();
            let cmdline = format!("qemu-kvm\0-name\0guest={name},debug-threads=on\0");
            std::fs::write(dir.join("cmdline"), cmdline).unwrap();
            std::fs::write(dir.join("net/unix"), format!("{header}{table}")).unwrap();
            for (i, inode) in fds.iter().enumerate() {
                symlink(
                    format!("socket:[{inode}]"),
                    dir.join("fd").join(i.to_string()),
                )
                .unwrap();
            }
        };
        let port = |d: &str| format!("/var/run/{d}/{PORT_NAME}");
        mk(10, "ns_a", line(7, "00010000", &port("a")), &[3, 7]);
        mk(11, "ns_b", line(8, "00010000", &port("b1")), &[8]);
        mk(12, "ns_b", line(9, "00010000", &port("b2")), &[9]);
        mk(13, "ns_c", line(5, "00010000", &port("c")), &[6]);
        mk(14, "ns_d", line(4, "00000000", &port("d")), &[4]);
        std::fs::create_dir_all(proc.join("self")).unwrap();
        let vms = contained_vms(proc);
        assert_eq!(vms.len(), 1, "{vms:?}");
        assert_eq!(vms[0].name, "ns_a");
        assert_eq!(vms[0].pid, Some(10));
        assert_eq!(
            vms[0].hint_socket.as_deref(),
            Some(proc.join("10/root/var/run/a").join(PORT_NAME).as_path())
        );
    }

    #[test]
    fn libvirt_layout() {
        let root = tempfile::tempdir().unwrap();
        let chan = root.path().join("channel/target");
        for (dir, with_port) in [("domain-1-a", true), ("domain-2-b", false), ("junk", true)] {
            std::fs::create_dir_all(chan.join(dir)).unwrap();
            if with_port {
                std::fs::write(chan.join(dir).join(PORT_NAME), "").unwrap();
            }
        }
        let vms = libvirt_vms(&chan, Path::new("/run/libvirt/qemu"));
        assert_eq!(vms.len(), 1, "{vms:?}");
        assert_eq!(vms[0].name, "a");
        assert_eq!(
            vms[0].pid_file.as_deref(),
            Some(Path::new("/run/libvirt/qemu/a.pid"))
        );
        assert!(libvirt_vms(&root.path().join("none"), Path::new("/")).is_empty());
    }

    #[test]
    fn threads_of_a_real_process_by_name() {
        // Name two threads of this test process like QEMU's vCPU threads.
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = std::sync::Arc::new(std::sync::Barrier::new(3));
        let mut handles = Vec::new();
        for n in [1, 0] {
            let (tx, stop) = (tx.clone(), stop.clone());
            handles.push(
                std::thread::Builder::new()
                    .name(format!("CPU {n}/TCG"))
                    .spawn(move || {
                        tx.send((n, nix::unistd::gettid().as_raw() as u32)).unwrap();
                        stop.wait();
                    })
                    .unwrap(),
            );
        }
        let mut want: Vec<(u32, u32)> = (0..2).map(|_| rx.recv().unwrap()).collect();
        want.sort_unstable();
        let got = threads_by_comm(std::process::id()).unwrap();
        stop.wait();
        handles.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(got, want.iter().map(|w| w.1).collect::<Vec<_>>());
        assert!(threads_by_comm(1).is_err() || std::process::id() == 1);
    }
}
