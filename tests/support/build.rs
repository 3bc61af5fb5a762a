//! Sets `cfg(vmigrater_root)` when the test suite is built as root, so that root-only
//! tests (`#[cfg_attr(not(vmigrater_root), ignore = "needs root")]`) are reported as
//! ignored by a build of any other user instead of passing without running.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(vmigrater_root)");
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
}
