//! One lab VM: QEMU TCG with multi-threaded TCG (each vCPU a host thread named
//! `CPU n/TCG`), a virtio-blk disk, the `org.vmigrater.hint.0` port the host agent reads,
//! the `org.vmigrater.cmd.0` port the guest's command agent serves, and QMP.

use crate::image::Image;
use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Boots of one VM before a wedged vCPU fails the caller (see [`Vm::boot`]).
const BOOT_ATTEMPTS: u32 = 3;

/// The QEMU device id of the hint port (for hot-unplugging it, see [`Vm::unplug_hint`]).
const HINT_PORT_ID: &str = "hintport";

pub struct VmSpec {
    pub name: String,
    pub vcpus: u32,
    pub mem_mb: u32,
    /// Raw disk image, seen as /dev/vda.
    pub disk: PathBuf,
    /// Appended to the kernel command line (e.g. `lab.root=/dev/vda`, see guest/init).
    pub kernel_args: String,
}

pub struct Vm {
    pub name: String,
    child: Child,
    pub dir: PathBuf,
    pub hint: PathBuf,
    pub qmp: PathBuf,
    pub serial: PathBuf,
    cmd: Option<BufReader<UnixStream>>,
    /// Commands that timed out: the guest still runs them and will print their output and
    /// `@@END` later, which the next command must not take for its own.
    unanswered: usize,
}

impl Vm {
    /// Boots `spec` from `image`; sockets and the serial log go to `dir`.
    pub fn start(spec: &VmSpec, image: &Image, dir: &Path) -> Result<Vm> {
        std::fs::create_dir_all(dir)?;
        let hint = dir.join("hint.sock");
        let cmd = dir.join("cmd.sock");
        let qmp = dir.join("qmp.sock");
        let serial = dir.join("serial.log");
        for s in [&hint, &cmd, &qmp] {
            let _ = std::fs::remove_file(s);
        }
        let mut c = Command::new("qemu-system-x86_64");
        c.args(["-name", &format!("{},debug-threads=on", spec.name)])
            .args(["-accel", "tcg,thread=multi"])
            .args(["-smp", &spec.vcpus.to_string()])
            .args(["-m", &spec.mem_mb.to_string()])
            .args(["-nodefaults", "-display", "none", "-no-reboot"])
            .arg("-kernel")
            .arg(&image.kernel)
            .arg("-initrd")
            .arg(&image.initrd)
            // tsc=reliable: without it the guest reads the emulated HPET on every clock read.
            .arg("-append")
            .arg(format!(
                "console=ttyS0 panic=-1 tsc=reliable quiet {}",
                spec.kernel_args
            ))
            .args(["-serial", &format!("file:{}", serial.display())])
            .args([
                "-drive",
                &format!(
                    "file={},if=virtio,format=raw,cache=none,aio=threads",
                    spec.disk.display()
                ),
            ])
            .args(["-device", "virtio-serial-pci"])
            .args([
                "-chardev",
                &format!("socket,path={},server=on,wait=off,id=hint", hint.display()),
            ])
            .args([
                "-device",
                &format!("virtserialport,chardev=hint,name=org.vmigrater.hint.0,id={HINT_PORT_ID}"),
            ])
            .args([
                "-chardev",
                &format!("socket,path={},server=on,wait=off,id=cmd", cmd.display()),
            ])
            .args([
                "-device",
                "virtserialport,chardev=cmd,name=org.vmigrater.cmd.0",
            ])
            .args([
                "-qmp",
                &format!("unix:{},server=on,wait=off", qmp.display()),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(dir.join("qemu.err"))?));
        // A session of its own: autogroup then schedules each VM as its own group, like
        // separate VMs on a host, not as children of the test.
        // SAFETY: setsid is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            c.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let child = c
            .spawn()
            .context("starting qemu-system-x86_64 (lab-setup.sh installs it)")?;
        Ok(Vm {
            name: spec.name.clone(),
            child,
            dir: dir.to_path_buf(),
            hint,
            qmp,
            serial,
            cmd: None,
            unanswered: 0,
        })
    }

    /// Boots `spec` and waits for its command agent, then checks that every vCPU runs
    /// guest code; a guest with a wedged vCPU is killed and booted again, up to
    /// `BOOT_ATTEMPTS` times. Seen in a CI run of `tests/lab.rs`: from the guest's 4th
    /// second on, before anything of ours ran in it, vCPU 1's host thread kept running
    /// while the vCPU ran no guest code for the rest of the run (the guest's own
    /// "rcu_preempt kthread starved for 5578 jiffies ... ->cpu=1", a hog there did 1% of the
    /// other's work). QEMU TCG's doing, not a guest program's; a run on such a VM measures
    /// nothing.
    pub fn boot(spec: &VmSpec, image: &Image, dir: &Path, ready_in: Duration) -> Result<Vm> {
        let mut attempt = 1;
        loop {
            let mut vm = Vm::start(spec, image, dir)?;
            vm.wait_ready(ready_in)?;
            match vm.stuck_vcpus(spec.vcpus) {
                Ok(stuck) if stuck.is_empty() => return Ok(vm),
                outcome => {
                    let why = match outcome {
                        Ok(stuck) => format!("vCPUs {stuck:?} ran nothing within 5 s"),
                        Err(e) => format!("the vCPU check got no answer: {e:#}"),
                    };
                    if attempt == BOOT_ATTEMPTS {
                        bail!("{}: wedged after {attempt} boots: {why}", spec.name);
                    }
                    eprintln!(
                        "LAB: {} booted with a wedged vCPU ({why}); serial log:\n{}\nbooting it again ({} of {BOOT_ATTEMPTS})",
                        spec.name,
                        vm.log_tail(),
                        attempt + 1
                    );
                    vm.kill();
                    attempt += 1;
                }
            }
        }
    }

    /// The vCPUs on which a task placed there does not get to run within 5 s.
    fn stuck_vcpus(&mut self, vcpus: u32) -> Result<Vec<u32>> {
        let line = (0..vcpus)
            .map(|c| format!("timeout 5 taskset -c {c} true 2>/dev/null || echo stuck:{c};"))
            .collect::<String>();
        let out = self.sh(&line, Duration::from_secs(10 + 6 * u64::from(vcpus)))?;
        Ok(out
            .lines()
            .filter_map(|l| l.strip_prefix("stuck:")?.trim().parse().ok())
            .collect())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until the guest's command agent answers.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        let sock = self.dir.join("cmd.sock");
        let stream = loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("{}: qemu exited ({status}): {}", self.name, self.log_tail());
            }
            match UnixStream::connect(&sock) {
                Ok(s) => break s,
                Err(_) if t0.elapsed() < timeout => std::thread::sleep(Duration::from_millis(100)),
                Err(e) => bail!("{}: no command socket after {timeout:?}: {e}", self.name),
            }
        };
        self.cmd = Some(BufReader::new(stream));
        let left = timeout.saturating_sub(t0.elapsed());
        let out = self
            .sh("echo ready", left.max(Duration::from_secs(1)))
            .with_context(|| format!("{}: guest never answered: {}", self.name, self.log_tail()))?;
        if out.trim() != "ready" {
            bail!("{}: unexpected answer {out:?}", self.name);
        }
        Ok(())
    }

    /// Runs one shell command line in the guest; its output, or an error naming the exit
    /// code and the output when it failed.
    pub fn sh(&mut self, line: &str, timeout: Duration) -> Result<String> {
        let (rc, out) = self.sh_rc(line, timeout)?;
        if rc != 0 {
            bail!("{}: `{line}` exited {rc}: {out}", self.name);
        }
        Ok(out)
    }

    pub fn sh_rc(&mut self, line: &str, timeout: Duration) -> Result<(i32, String)> {
        if line.contains('\n') {
            bail!("one line per command");
        }
        let name = self.name.clone();
        let port = self.cmd.as_mut().context("wait_ready first")?;
        port.get_mut().set_read_timeout(Some(timeout))?;
        // The late answers of commands that timed out come first (the guest runs its
        // commands in order): skipped, so that this command reads its own.
        while self.unanswered > 0 {
            let mut l = String::new();
            let n = port.read_line(&mut l).with_context(|| {
                format!(
                    "{name}: still no answer to {} earlier command(s) within {timeout:?}",
                    self.unanswered
                )
            })?;
            if n == 0 {
                bail!("{name}: command port closed");
            }
            if l.starts_with("@@END ") {
                self.unanswered -= 1;
            }
        }
        port.get_mut().write_all(format!("{line}\n").as_bytes())?;
        let mut out = String::new();
        let t0 = Instant::now();
        loop {
            let mut l = String::new();
            let n = match port.read_line(&mut l) {
                Ok(n) => n,
                Err(e) => {
                    self.unanswered += 1;
                    return Err(anyhow::Error::new(e)
                        .context(format!("{name}: no answer to `{line}` within {timeout:?}")));
                }
            };
            if n == 0 {
                bail!("{name}: command port closed during `{line}`");
            }
            if let Some(rc) = l.strip_prefix("@@END ") {
                return Ok((rc.trim().parse().unwrap_or(-1), out));
            }
            out.push_str(&l);
            if t0.elapsed() > timeout {
                self.unanswered += 1;
                bail!("{name}: `{line}` still running after {timeout:?}");
            }
        }
    }

    /// The vCPU threads, index = vCPU number (QMP query-cpus-fast).
    pub fn vcpu_threads(&self) -> Result<Vec<u32>> {
        qmp::vcpu_threads(&self.qmp)
    }

    /// Freezes the VM's vCPUs (QMP `stop`): the VM stays booted but takes no CPU.
    pub fn pause(&self) -> Result<()> {
        qmp::execute(&self.qmp, &["stop"]).map(drop)
    }

    /// Undoes [`Vm::pause`].
    pub fn resume(&self) -> Result<()> {
        qmp::execute(&self.qmp, &["cont"]).map(drop)
    }

    /// Hot-unplugs the `org.vmigrater.hint.0` port under the running guest (QMP
    /// `device_del`), as an operator or a management tool might. The chardev stays, and
    /// with it the host agent's connection to the socket.
    pub fn unplug_hint(&self) -> Result<()> {
        let del = serde_json::json!({"execute": "device_del", "arguments": {"id": HINT_PORT_ID}});
        qmp::execute_json(&self.qmp, &[del]).map(drop)
    }

    /// Plugs the port back (QMP `device_add` on the same chardev), then names it in the
    /// guest's /dev/virtio-ports as udev would (the lab guest has no udev).
    pub fn replug_hint(&mut self) -> Result<()> {
        let add = serde_json::json!({"execute": "device_add", "arguments": {
            "driver": "virtserialport", "chardev": "hint",
            "name": "org.vmigrater.hint.0", "id": HINT_PORT_ID}});
        let t0 = Instant::now();
        // The unplug completes asynchronously: the id is taken until it has.
        while let Err(e) = qmp::execute_json(&self.qmp, std::slice::from_ref(&add)) {
            if t0.elapsed() > Duration::from_secs(10) {
                return Err(e.context(format!("{}: re-adding the hint port", self.name)));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.sh(
            "for i in $(seq 1 100); do for p in /sys/class/virtio-ports/vport*; do \
             [ \"$(cat $p/name 2>/dev/null)\" = org.vmigrater.hint.0 ] && [ -e /dev/${p##*/} ] && \
             ln -sf /dev/${p##*/} /dev/virtio-ports/org.vmigrater.hint.0 && exit 0; done; sleep 0.1; done; exit 1",
            Duration::from_secs(30),
        )
        .map(drop)
        .with_context(|| format!("{}: the re-added hint port never appeared", self.name))
    }

    /// Every thread of the QEMU process.
    pub fn threads(&self) -> Vec<u32> {
        std::fs::read_dir(format!("/proc/{}/task", self.pid()))
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.serial).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Powers the guest off hard (it keeps no state worth a clean shutdown).
    pub fn stop(mut self) {
        self.kill();
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.kill();
    }
}
