//! Sets `cfg(vmigrater_root)` when the test suite is built as root, so that root-only
//! tests (`#[cfg_attr(not(vmigrater_root), ignore = "needs root")]`) are reported as
//! ignored by a build of any other user instead of passing without running. Likewise for
//! what the machine offers: `vmigrater_2cpus` (two CPUs or more), `vmigrater_cgroup_v1_cpu`
//! and `vmigrater_cgroup_v1_cpuset` (those cgroup v1 controllers mounted). A test that
//! needs one is ignored, with its reason, where the build machine lacks it, and fails
//! loudly when run on a narrower machine than it was built on: never a passing skip.

fn main() {
    for cfg in [
        "vmigrater_root",
        "vmigrater_2cpus",
        "vmigrater_cgroup_v1_cpu",
        "vmigrater_cgroup_v1_cpuset",
    ] {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
    }
    // `sudo` and `su` change these: a later build as another user runs this again.
    for var in ["USER", "SUDO_UID", "HOME"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    println!("cargo::rerun-if-changed=tests/support/build.rs");
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    // `Uid:` real, effective, saved, filesystem: the effective one decides.
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1)?.parse::<u32>().ok());
    match euid {
        Some(0) => println!("cargo::rustc-cfg=vmigrater_root"),
        _ => println!(
            "cargo::warning=not building as root: root-only tests are reported as ignored; \
             run the suite as root to run them (CI does)"
        ),
    }
    if std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2) {
        println!("cargo::rustc-cfg=vmigrater_2cpus");
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for controller in ["cpu", "cpuset"] {
        if cgroup_v1_mounted(&mountinfo, controller) {
            println!("cargo::rustc-cfg=vmigrater_cgroup_v1_{controller}");
        }
    }
}

/// Whether a cgroup v1 hierarchy with `controller` is mounted (`/proc/self/mountinfo`).
fn cgroup_v1_mounted(mountinfo: &str, controller: &str) -> bool {
    mountinfo.lines().any(|line| {
        let Some((_, right)) = line.split_once(" - ") else {
            return false;
        };
        let mut r = right.split_whitespace();
        r.next() == Some("cgroup")
            && r.nth(1)
                .is_some_and(|opts| opts.split(',').any(|o| o == controller))
    })
}
