//! The package install test (`make lab-install-test`): the `.deb` built by
//! `make package` installed with apt in a Debian 12 guest that boots systemd
//! (scripts/lab-debian.sh), started with `systemctl`, its metrics checked by `promtool` on
//! the host, upgraded to a next release with a task in I/O (the restart hands the masks
//! over; an unchanged conffile follows the new default), reloaded with `systemctl reload`
//! (a live key, then a broken file), upgraded again over the conffile the operator changed
//! (kept, the new default beside it as `.dpkg-dist`), removed (every CPU mask back to
//! normal) and purged (nothing of ours left under /etc, /usr or /var/lib).

use crate::host;
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

/// The next release of `deb` for the upgrade steps: the same files as release `n` of its
/// version, the default conffile with one more line. Built on the host with dpkg-deb, as a
/// distribution's next upload would differ.
fn next_release(deb: &Path, dir: &Path, n: u32) -> Result<PathBuf> {
    let tree = dir.join(format!("release-{n}"));
    let _ = std::fs::remove_dir_all(&tree);
    run(Command::new("dpkg-deb").arg("-R").arg(deb).arg(&tree))?;
    let control = tree.join("DEBIAN/control");
    let text = std::fs::read_to_string(&control)?;
    let version = text
        .lines()
        .find_map(|l| l.strip_prefix("Version: "))
        .with_context(|| format!("no Version in {}", control.display()))?;
    let base = version.rsplit_once('-').map_or(version, |(b, _)| b);
    std::fs::write(
        &control,
        text.replace(
            &format!("Version: {version}"),
            &format!("Version: {base}-{n}"),
        ),
    )?;
    let conf = tree.join("etc/vmigrater/vmigrater.toml");
    let mut default = std::fs::read_to_string(&conf)?;
    default.push_str(&format!("\n{}\n", release_line(n)));
    std::fs::write(&conf, default)?;
    let out = dir.join(format!("vmigrater-{n}.deb"));
    run(Command::new("dpkg-deb")
        .args(["--root-owner-group", "-Zxz", "-b"])
        .arg(&tree)
        .arg(&out))?;
    Ok(out)
}

/// The line release `n`'s default conffile gains.
fn release_line(n: u32) -> String {
    format!("# A default that release {n} brings (lab-install-test).")
}

/// The daemon's main PID and the tids it manages, from `vmigrater status --json`.
fn daemon(vm: &mut Vm) -> Result<(u32, Vec<u32>)> {
    let json = vm.sh("vmigrater status --json", MIN)?;
    let v: serde_json::Value =
        serde_json::from_str(&json).with_context(|| format!("vmigrater status --json: {json}"))?;
    let pid = v["pid"].as_u64().context("status without pid")? as u32;
    let tids = v["tasks"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|t| t["tid"].as_u64())
                .map(|t| t as u32)
                .collect()
        })
        .unwrap_or_default();
    Ok((pid, tids))
}

/// User threads whose CPU mask is not every online CPU: `(tid, comm, mask)` lines (kernel
/// threads, with no command line, are per-CPU by design).
fn changed_masks(vm: &mut Vm) -> Result<Vec<(u32, String)>> {
    let out = vm.sh(
        "all=$(cat /sys/devices/system/cpu/online); for t in /proc/[0-9]*/task/[0-9]*; do \
         [ -s ${t%/task/*}/cmdline ] || continue; m=$(awk '/Cpus_allowed_list/ {print $2}' $t/status 2>/dev/null); \
         [ -z \"$m\" ] || [ \"$m\" = \"$all\" ] || echo \"${t##*/} $(cat $t/comm) $m\"; done; true",
        MIN,
    )?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let (tid, rest) = l.trim().split_once(' ')?;
            Some((tid.parse().ok()?, rest.to_owned()))
        })
        .collect())
}

/// Host CPUs taken from under the guest's vCPU threads in anti-phase (each vCPU out 20 ms
/// of every 40, one running while the other is out), so that the daemon has a task to
/// manage across the upgrades. Returns the steal emulator (dropped: the steal stops).
fn contend(vm: &mut Vm) -> Result<steal_emulator::Emulator> {
    for (i, t) in vm.vcpu_threads()?.into_iter().enumerate() {
        host::pin(t, i % 2)?;
    }
    let patterns = ["0:20000:20000:0", "1:20000:20000:20000"]
        .iter()
        .map(|p| p.parse())
        .collect::<Result<Vec<steal_emulator::Pattern>>>()?;
    steal_emulator::Emulator::start(&patterns, 50)
}

/// The tids the daemon manages, once it manages one (the reader's `dd` restarts now and
/// then, and a new one is found anew).
fn managed(vm: &mut Vm, what: &str) -> Result<Vec<u32>> {
    let t1 = Instant::now();
    loop {
        let (_, managed) = daemon(vm)?;
        if !managed.is_empty() {
            return Ok(managed);
        }
        if t1.elapsed() > 3 * MIN {
            let why = vm.sh("vmigrater status; vmigrater explain dd; true", MIN)?;
            bail!("{what}: under anti-phase steal the daemon managed no task in 3 min:\n{why}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Waits for the daemon to serve its status socket after a start or an upgrade's restart.
fn wait_active(vm: &mut Vm, after: &str) -> Result<()> {
    let t1 = Instant::now();
    loop {
        let (_, state) = vm.sh_rc("systemctl is-active vmigrater", MIN)?;
        // The daemon serves its status socket once BPF is attached.
        if state.trim() == "active" && vm.sh_rc("vmigrater status >/dev/null", MIN)?.0 == 0 {
            return Ok(());
        }
        if state.trim() == "failed" || t1.elapsed() > 3 * MIN {
            let why = vm.sh(
                "systemctl status vmigrater --no-pager; journalctl -u vmigrater --no-pager | tail -40",
                MIN,
            )?;
            bail!("vmigrater is {} after {after}:\n{why}", state.trim());
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// `apt-get install` of release `n` over the running daemon: the package's restart runs the
/// new daemon, and every thread whose mask is changed afterwards is one the new daemon
/// manages (the old one handed its tasks back before it stopped). A conffile the operator
/// changed is kept (`--force-confold`, what a non-interactive upgrade should do) with
/// dpkg's message, and the new default lands beside it as `.dpkg-dist`.
fn upgrade(vm: &mut Vm, n: u32, conffile_changed: bool) -> Result<String> {
    const CONF: &str = "/etc/vmigrater/vmigrater.toml";
    let before = managed(vm, &format!("before the upgrade to release {n}"))?;
    let (old_pid, _) = daemon(vm)?;
    let out = vm
        .sh(
            &format!(
                "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
             -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
             /root/vmigrater-{n}.deb 2>&1"
            ),
            10 * MIN,
        )
        .with_context(|| format!("apt upgrade to release {n}"))?;
    let version = vm.sh("dpkg-query -W -f='${Version}' vmigrater", MIN)?;
    ensure!(
        version.trim().ends_with(&format!("-{n}")),
        "after the upgrade to release {n}, dpkg has {}",
        version.trim()
    );
    wait_active(vm, &format!("the upgrade to release {n}"))?;
    let (new_pid, mut now_managed) = daemon(vm)?;
    ensure!(
        new_pid != old_pid,
        "the upgrade to release {n} did not restart the daemon (pid {old_pid})"
    );
    let masks = changed_masks(vm)?;
    // The daemon may take a task up between the two reads: managed before or after counts.
    now_managed.extend(daemon(vm)?.1);
    now_managed.sort_unstable();
    now_managed.dedup();
    let after = managed(vm, &format!("after the upgrade to release {n}"))?;
    let stray: Vec<String> = masks
        .into_iter()
        .filter(|(tid, _)| !now_managed.contains(tid))
        .map(|(tid, what)| format!("{tid} {what}"))
        .collect();
    ensure!(
        stray.is_empty(),
        "after the upgrade to release {n}, threads with a changed mask the new daemon does not manage:\n{}",
        stray.join("\n")
    );
    let conf = vm.sh(&format!("cat {CONF}"), MIN)?;
    let (_, dist) = vm.sh_rc(&format!("cat {CONF}.dpkg-dist 2>/dev/null"), MIN)?;
    if conffile_changed {
        ensure!(
            !conf.contains(&release_line(n)) && conf.contains("exclude_comm = [\"backup\"]"),
            "the conffile the operator changed was not kept:\n{conf}"
        );
        ensure!(
            dist.contains(&release_line(n)),
            "no new default beside the kept conffile as {CONF}.dpkg-dist:\n{out}"
        );
        ensure!(
            out.contains("Keeping old config file"),
            "dpkg said nothing of the kept conffile:\n{out}"
        );
    } else {
        ensure!(
            conf.contains(&release_line(n)),
            "the unchanged conffile did not follow release {n}'s default:\n{conf}"
        );
        ensure!(
            dist.trim().is_empty(),
            "a .dpkg-dist beside an unchanged conffile"
        );
    }
    Ok(format!(
        "upgraded to {}: daemon restarted (pid {old_pid} -> {new_pid}), managing {before:?} before and {after:?} after, every changed mask the new daemon's, conffile {}",
        version.trim(),
        if conffile_changed {
            "kept as changed, the new default as .dpkg-dist"
        } else {
            "follows the new default"
        }
    ))
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
             sed -i 's/^#exclude_comm = .*/exclude_comm = [\"backup\"]/' {CONF} && \
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
            "cp {CONF} /root/operator.toml && printf '[migration]\\nno_such_key = 1\\n' >> {CONF} && systemctl reload vmigrater"
        ),
        MIN,
    )?;
    let log = settle(vm, "a reload of a broken file")?;
    ensure!(
        log.lines()
            .any(|l| l.contains("SIGHUP: the new configuration is invalid") && l.contains(CONF)),
        "no refused reload naming {CONF} in the journal:\n{log}"
    );
    // The operator fixes the file: the changed, valid one stays for the next upgrade.
    vm.sh(&format!("cp /root/operator.toml {CONF}"), MIN)?;
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
    let mut debs = vec![(deb.clone(), "/root/vmigrater.deb".to_owned())];
    for n in [2, 3] {
        debs.push((
            next_release(&deb, &dir, n)?,
            format!("/root/vmigrater-{n}.deb"),
        ));
    }
    for (from, to) in &debs {
        run(Command::new("debugfs")
            .args(["-w", "-R"])
            .arg(format!("write {} {to}", from.display()))
            .arg(&disk))?;
    }
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
    wait_active(&mut vm, "systemctl start")?;
    step(t0, "systemctl is-active vmigrater: active");

    // An I/O-bound task for the daemon to manage while it runs, through the upgrades.
    vm.sh(
        "setsid sh -c 'while :; do dd if=/dev/vda of=/dev/null iflag=direct bs=4k count=100000; done' </dev/null >/dev/null 2>&1 &",
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

    let steal = contend(&mut vm)?;
    let done = upgrade(&mut vm, 2, false)?;
    step(t0, &done);

    reload(&mut vm)?;
    step(
        t0,
        "systemctl reload: a live key applied, a bad file refused naming its line, still active",
    );
    let done = upgrade(&mut vm, 3, true)?;
    step(t0, &done);
    drop(steal);

    // `[:]` keeps the pattern from matching this command's own shell.
    vm.sh("pkill -f 'while [:]; do dd'; pkill -x dd; true", MIN)?;
    vm.sh(
        "DEBIAN_FRONTEND=noninteractive apt-get remove -y vmigrater",
        5 * MIN,
    )
    .context("apt remove")?;
    let (_, state) = vm.sh_rc("systemctl is-active vmigrater", MIN)?;
    ensure!(
        state.trim() == "inactive",
        "after apt remove: {}",
        state.trim()
    );
    let masks = changed_masks(&mut vm)?;
    ensure!(
        masks.is_empty(),
        "tasks left with a changed CPU mask after apt remove:\n{masks:?}"
    );
    let kept = vm.sh("dpkg-query -W -f='${Status}' vmigrater", MIN)?;
    ensure!(
        kept.contains("config-files")
            && vm.sh_rc("test -f /etc/vmigrater/vmigrater.toml", MIN)?.0 == 0,
        "after apt remove the conffile should stay until a purge: {kept}"
    );
    step(
        t0,
        "apt remove: stopped, no task left with a changed mask, the conffile kept",
    );
    vm.sh(
        "DEBIAN_FRONTEND=noninteractive apt-get purge -y vmigrater",
        5 * MIN,
    )
    .context("apt purge")?;
    let left = vm.sh(
        "ls -d /etc/vmigrater* /usr/bin/vmigrater* /lib/systemd/system/vmigrater* /usr/lib/systemd/system/vmigrater* /var/lib/vmigrater* 2>/dev/null; true",
        MIN,
    )?;
    ensure!(left.trim().is_empty(), "left after apt purge:\n{left}");
    let (_, run_dir) = vm.sh_rc("ls -A /run/vmigrater 2>/dev/null", MIN)?;
    step(
        t0,
        &format!(
            "apt purge: nothing of ours under /etc, /usr or /var/lib; /run/vmigrater (tmpfs, gone at reboot) holds [{}]",
            run_dir.split_whitespace().collect::<Vec<_>>().join(" ")
        ),
    );
    vm.stop();
    Ok(())
}
