//! The package install test (`make lab-install-test`): the `.deb` built by
//! `make package` installed with apt in a Debian 12 guest that boots systemd
//! (scripts/lab-debian.sh), started with `systemctl`, its metrics checked by `promtool` on
//! the host, reloaded with `systemctl reload` (a live key, then a broken file), and every
//! CPU mask checked back to normal after `systemctl stop`.

use crate::image::{self, Contents, Kernel};
use crate::vm::{Vm, VmSpec};
use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const MIN: Duration = Duration::from_secs(60);

fn newest_deb(dir: &Path, prefix: &str) -> Result<PathBuf> {
    std::fs::read_dir(dir)
        .with_context(|| format!("{}: run `make package` first", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.starts_with(prefix) && n.ends_with(".deb")
            })
        })
        .max_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
        .with_context(|| format!("no {prefix}*.deb in {}", dir.display()))
}

fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} exited {}: {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn step(t0: Instant, what: &str) {
    eprintln!("install-test: {:6.1} s  {what}", t0.elapsed().as_secs_f64());
}

/// The unit's `ExecReload` (SIGHUP): a live key changed in the installed configuration is
/// applied, a broken file is refused with its line and the running configuration kept; the
/// daemon stays active through both.
fn reload(vm: &mut Vm) -> Result<()> {
    const CONF: &str = "/etc/vmigrater/vmigrater.toml";
    let journal = |vm: &mut Vm| vm.sh("journalctl -u vmigrater --no-pager -o cat", MIN);
    let settle = |vm: &mut Vm, what: &str| -> Result<String> {
        std::thread::sleep(Duration::from_secs(2));
        let (_, state) = vm.sh_rc("systemctl is-active vmigrater", MIN)?;
        ensure!(state.trim() == "active", "after {what}: {}", state.trim());
        journal(vm)
    };
    // The shipped file shows every key commented out: an operator uncomments one.
    vm.sh(
        &format!(
            "grep -q '^#exclude_comm = \\[\\]$' {CONF} && \
             sed -i 's/^#exclude_comm = .*/exclude_comm = [\"dd\"]/' {CONF} && \
             systemctl reload vmigrater"
        ),
        MIN,
    )
    .context("changing migration.exclude_comm and systemctl reload")?;
    let log = settle(vm, "a reload with a live key changed")?;
    ensure!(
        log.lines()
            .any(|l| l.contains("SIGHUP: configuration reloaded, applied")
                && l.contains("migration.exclude_comm")),
        "no applied reload in the journal:\n{log}"
    );
    vm.sh(
        &format!(
            "printf '[migration]\\nno_such_key = 1\\n' >> {CONF} && systemctl reload vmigrater"
        ),
        MIN,
    )?;
    let log = settle(vm, "a reload of a broken file")?;
    ensure!(
        log.lines()
            .any(|l| l.contains("SIGHUP: the new configuration is invalid") && l.contains(CONF)),
        "no refused reload naming {CONF} in the journal:\n{log}"
    );
    Ok(())
}

/// Runs the whole test; `packages` is target/package.
pub fn install_test(packages: &Path) -> Result<()> {
    let t0 = Instant::now();
    let lab = image::lab_dir();
    let kernel = Kernel::find(&lab)?;
    let base = lab.join("debian/rootfs.img");
    ensure!(
        base.exists(),
        "{} missing: run scripts/lab-debian.sh (make lab-install-test does)",
        base.display()
    );
    let deb = newest_deb(packages, "vmigrater_")?;
    let dir = lab.join("run/install");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // A fresh copy per run, with the package written into it (no mount, no network).
    let disk = dir.join("rootfs.img");
    run(Command::new("cp")
        .arg("--sparse=always")
        .arg(&base)
        .arg(&disk))?;
    run(Command::new("debugfs")
        .args(["-w", "-R"])
        .arg(format!("write {} /root/vmigrater.deb", deb.display()))
        .arg(&disk))?;
    let img = image::build(&kernel, &Contents::default(), &dir.join("initrd.cpio"))?;
    let spec = VmSpec {
        name: "install".into(),
        vcpus: 2,
        mem_mb: 1024,
        disk,
        kernel_args: "lab.root=/dev/vda".into(),
    };
    let mut vm = Vm::start(&spec, &img, &dir)?;
    vm.wait_ready(Duration::from_secs(900))
        .context("the systemd guest never served its command port")?;
    step(t0, "systemd guest up");
    let virt = vm.sh("systemd-detect-virt; true", MIN)?;
    eprintln!("install-test: systemd-detect-virt: {}", virt.trim());

    vm.sh(
        "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends /root/vmigrater.deb",
        10 * MIN,
    )
    .context("apt install of the .deb")?;
    step(t0, &format!("installed {}", deb.display()));
    let files = vm.sh("dpkg -L vmigrater", MIN)?;
    for want in [
        "/usr/bin/vmigrater",
        "/lib/systemd/system/vmigrater.service",
        "/etc/vmigrater/vmigrater.toml",
    ] {
        ensure!(
            files
                .lines()
                .any(|l| l.trim() == want || l.trim() == format!("/usr{want}")),
            "dpkg -L vmigrater lacks {want}:\n{files}"
        );
    }

    vm.sh("systemctl start vmigrater", 2 * MIN)?;
    let t1 = Instant::now();
    loop {
        let (_, state) = vm.sh_rc("systemctl is-active vmigrater", MIN)?;
        // The daemon serves its status socket once BPF is attached.
        if state.trim() == "active" && vm.sh_rc("vmigrater status >/dev/null", MIN)?.0 == 0 {
            break;
        }
        if state.trim() == "failed" || t1.elapsed() > 3 * MIN {
            let why = vm.sh(
                "systemctl status vmigrater --no-pager; journalctl -u vmigrater --no-pager | tail -40",
                MIN,
            )?;
            bail!(
                "vmigrater is {} after systemctl start:\n{why}",
                state.trim()
            );
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    step(t0, "systemctl is-active vmigrater: active");

    // An I/O-bound task for the daemon to manage while it runs.
    vm.sh(
        "setsid dd if=/dev/vda of=/dev/null iflag=direct bs=4k count=200000 </dev/null >/dev/null 2>&1 &",
        MIN,
    )?;
    std::thread::sleep(Duration::from_secs(5));
    let status = vm.sh("vmigrater status", MIN).context("vmigrater status")?;
    eprintln!("install-test: vmigrater status:\n{status}");

    let metrics = vm.sh("curl -sf http://127.0.0.1:9977/metrics", MIN)?;
    ensure!(
        metrics.contains("vmigrater_build_info"),
        "no vmigrater metrics:\n{metrics}"
    );
    let file = dir.join("metrics.txt");
    std::fs::write(&file, &metrics)?;
    let out = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file)?)
        .output()
        .context("promtool (scripts/lab-debian.sh installs Debian's prometheus)")?;
    let lint =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success(),
        "promtool check metrics failed:\n{lint}"
    );
    step(
        t0,
        &format!(
            "promtool check metrics: ok, {} lines{}",
            metrics.lines().count(),
            if lint.trim().is_empty() {
                String::new()
            } else {
                format!(" ({})", lint.trim())
            }
        ),
    );

    reload(&mut vm)?;
    step(
        t0,
        "systemctl reload: a live key applied, a bad file refused naming its line, still active",
    );

    vm.sh("systemctl stop vmigrater", 3 * MIN)?;
    let (_, state) = vm.sh_rc("systemctl is-active vmigrater", MIN)?;
    ensure!(state.trim() == "inactive", "after stop: {}", state.trim());
    // Every user task's mask is back to all CPUs (kernel threads, with no command line,
    // are per-CPU by design).
    let masks = vm.sh(
        "all=$(cat /sys/devices/system/cpu/online); for t in /proc/[0-9]*/task/[0-9]*; do \
         [ -s ${t%/task/*}/cmdline ] || continue; m=$(awk '/Cpus_allowed_list/ {print $2}' $t/status 2>/dev/null); \
         [ -z \"$m\" ] || [ \"$m\" = \"$all\" ] || echo \"${t#/proc/} $(cat $t/comm) $m\"; done; true",
        MIN,
    )?;
    ensure!(
        masks.trim().is_empty(),
        "tasks left with a changed CPU mask after systemctl stop:\n{masks}"
    );
    step(
        t0,
        "systemctl stop: inactive, no task left with a changed mask",
    );
    vm.stop();
    Ok(())
}
