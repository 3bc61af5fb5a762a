//! The benefit benchmark (`make bench-lab`): VM A runs a 4 KiB random O_DIRECT reader, a
//! 1 MiB sequential reader and a CPU hog per vCPU; co-located hog VMs share the host CPUs
//! with it, every vCPU thread pinned (vCPU i on host CPU i mod 2) with the vMigrater paper's
//! 11 ms hypervisor slice. Modes are interleaved within each repetition (rotated, so no mode
//! always runs first), and each run records the host CPU spent outside the lab so noisy runs
//! are left out of the medians.

use crate::guest;
use crate::host;
use crate::image::{self, Contents, Kernel};
use crate::summary::{self, AgentVcpu, Run};
use crate::vm::{Vm, VmSpec};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The vMigrater paper's hypervisor time slice.
pub const HOST_SLICE_NS: u64 = 11_000_000;
pub const HOST_CPUS: usize = 2;
/// SCHED_FIFO priority of the host-side steal spinners (above every lab thread).
const STEAL_RT_PRIORITY: i32 = 50;
/// Nice of QEMU's non-vCPU threads (see `boot`).
pub const IO_PATH_NICE: i32 = -10;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    /// The co-located VMs paused: VM A alone on its host CPUs.
    NoSharing,
    Vanilla,
    /// The guest daemon only.
    Vmigrater,
    /// The guest daemon with `--dry-run`: all its monitoring and BPF cost, no migration
    /// (separates what the daemon costs from what its migrations do).
    VmigraterDry,
    /// The host agent only (it observes VM A from schedstat: no guest reports).
    Agent,
    Both,
    /// The guest daemon fed the host's known steal schedule instead of detecting it
    /// (scenarios with `host_steal` only): what migration gains with perfect knowledge.
    VmigraterOracle,
    /// VM A's readers pinned to its vCPU 0, no daemon: what a reader loses that stays on
    /// one vCPU while the host takes it away (with a queue per vCPU its completions wait
    /// for that vCPU too).
    PinnedVcpu0,
    /// The guest daemon with a configuration of its own (`--variant NAME=FILE`): for
    /// ablations measured interleaved with the other modes.
    Variant(&'static str),
    /// The host agent with keys of its own (`--agent-variant NAME=FILE`), no guest daemon.
    AgentVariant(&'static str),
    /// Both programs, the guest daemon with a configuration of its own
    /// (`--both-variant NAME=FILE`).
    BothVariant(&'static str),
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::NoSharing => "no_sharing",
            Mode::Vanilla => "vanilla",
            Mode::Vmigrater => "vmigrater",
            Mode::VmigraterDry => "vmigrater_dry",
            Mode::Agent => "agent",
            Mode::Both => "both",
            Mode::VmigraterOracle => "vmigrater_oracle",
            Mode::PinnedVcpu0 => "pinned_vcpu0",
            Mode::Variant(name) | Mode::AgentVariant(name) | Mode::BothVariant(name) => name,
        }
    }
    fn daemon(self) -> bool {
        matches!(
            self,
            Mode::Vmigrater
                | Mode::VmigraterDry
                | Mode::Both
                | Mode::VmigraterOracle
                | Mode::Variant(_)
                | Mode::BothVariant(_)
        )
    }
    fn agent(self) -> bool {
        matches!(
            self,
            Mode::Agent | Mode::Both | Mode::AgentVariant(_) | Mode::BothVariant(_)
        )
    }
}

pub struct Scenario {
    pub name: &'static str,
    pub what: &'static str,
    pub a_vcpus: u32,
    /// Co-located VMs running a CPU hog per vCPU, of `hog_vcpus` vCPUs each.
    pub hog_vms: usize,
    pub hog_vcpus: u32,
    /// Host-side steal instead of (or besides) hog VMs: a SCHED_FIFO spinner per host CPU
    /// (`CPU:BUSY_US:IDLE_US:PHASE_US`), invisible to the guest like a hypervisor's other
    /// work, on a schedule the lab knows exactly (the oracle mode's truth).
    pub host_steal: &'static [&'static str],
    /// Pin vCPU i to host CPU i mod 2 (false: every vCPU thread may run on both host CPUs,
    /// so the host's own balancer and the agent's Algorithm 2 place them).
    pub pinned: bool,
    pub modes: Vec<Mode>,
}

impl Scenario {
    /// vCPUs per host CPU.
    pub fn consolidation(&self) -> f64 {
        let stolen = if self.host_steal.is_empty() {
            0.0
        } else {
            self.a_vcpus as f64
        };
        (stolen + self.a_vcpus as f64 + (self.hog_vcpus as usize * self.hog_vms) as f64)
            / HOST_CPUS as f64
    }
}

pub struct Options {
    pub bin_dir: PathBuf,
    /// The guest daemon of every mode but the oracle's (None: `bin_dir`'s). The oracle mode
    /// runs `bin_dir`'s vmigrater-oracle (crate `lab-oracle`): the daemon on the host's
    /// known schedule, which the product's build has no way to take.
    pub daemon: Option<PathBuf>,
    pub secs: u64,
    pub reps: u32,
    /// VM A's workload runs this long before the measured one, with the mode's programs
    /// started: a warm run (0: cold, the programs start with the measured workload).
    pub warmup_secs: u64,
    /// The guest daemon's /etc/vmigrater/vmigrater.toml (None: its built-in defaults).
    pub guest_config: Option<String>,
    /// Only these modes (empty: the scenario's).
    pub modes: Vec<String>,
    /// Extra daemon modes, each with its own configuration: (name, config text). Every
    /// scenario runs them beside its own modes.
    pub variants: Vec<(&'static str, String)>,
    /// Extra host-agent modes: (name, top-level agent configuration keys).
    pub agent_variants: Vec<(&'static str, String)>,
    /// Extra modes of both programs, the daemon with its own configuration: (name, text).
    pub both_variants: Vec<(&'static str, String)>,
    /// Variant modes (`variants`, `both_variants`) that run another build of the daemon:
    /// (name, its `vmigrater` binary), installed in the guest as /bin/NAME/vmigrater. Two
    /// builds measured interleaved in one batch, not in batches minutes apart.
    pub daemon_bins: Vec<(&'static str, PathBuf)>,
}

impl Options {
    /// The guest daemon binary on this host.
    pub fn daemon_path(&self) -> PathBuf {
        self.daemon
            .clone()
            .unwrap_or_else(|| self.bin_dir.join("vmigrater"))
    }

    /// The lab's daemon on the host's known schedule (mode vmigrater_oracle).
    pub fn oracle_daemon_path(&self) -> PathBuf {
        self.bin_dir.join("vmigrater-oracle")
    }

    /// Fails, before any VM boots, when the oracle mode has no lab daemon to run: the
    /// guest's failure would surface only as a run without a daemon.
    fn check_oracle_daemon(&self) -> Result<()> {
        let path = self.oracle_daemon_path();
        let out = Command::new(&path)
            .arg("--version")
            .output()
            .with_context(|| format!("running {} --version", path.display()))?;
        anyhow::ensure!(
            out.status.success(),
            "mode vmigrater_oracle: {} --version failed; build it with `cargo build --release \
             -p lab-oracle` (`make build` does), or leave the mode out with --modes",
            path.display()
        );
        Ok(())
    }
}

pub struct Guest {
    pub vm: Vm,
    /// The vCPU threads, index = vCPU number.
    pub vcpus: Vec<u32>,
}

/// Whether `sc` runs the oracle mode with these options.
fn runs_oracle(sc: &Scenario, opts: &Options) -> bool {
    sc.modes.contains(&Mode::VmigraterOracle)
        && (opts.modes.is_empty() || opts.modes.iter().any(|o| o == Mode::VmigraterOracle.name()))
}

/// Boots VM A and the hog VMs of `sc`, pinned and sliced; their files live under
/// `run/<run>` and `disk-<run>-*.img` of the lab directory.
pub fn boot(
    sc: &Scenario,
    opts: &Options,
    kernel: &Kernel,
    lab: &Path,
    run: &str,
) -> Result<Vec<Guest>> {
    let tag = run;
    let run = lab.join("run").join(run);
    std::fs::create_dir_all(&run)?;
    let contents = Contents {
        binaries: [
            (opts.daemon_path(), "vmigrater".to_string()),
            (
                opts.bin_dir.join("vmigrater-workload"),
                "vmigrater-workload".to_string(),
            ),
        ]
        .into_iter()
        // Only where its mode runs: an initrd larger than the guest can unpack loses its
        // last files, the daemon among them.
        .chain(
            runs_oracle(sc, opts)
                .then(|| (opts.oracle_daemon_path(), "vmigrater-oracle".to_string())),
        )
        .chain(
            opts.daemon_bins
                .iter()
                .map(|(n, p)| (p.clone(), format!("{n}/vmigrater"))),
        )
        .collect(),
        files: opts
            .guest_config
            .iter()
            .map(|c| ("/etc/vmigrater/vmigrater.toml".to_string(), c.clone()))
            .collect(),
    };
    let img = image::build(kernel, &contents, &run.join("initrd.cpio"))?;
    // The co-located VMs run only CPU hogs: an image without the daemon builds (an initrd
    // larger than a 256 MB guest can unpack loses its last files).
    let hog_contents = Contents {
        binaries: vec![(
            opts.bin_dir.join("vmigrater-workload"),
            "vmigrater-workload".to_string(),
        )],
        files: vec![],
    };
    let hog_img = image::build(kernel, &hog_contents, &run.join("initrd-hog.cpio"))?;
    let mut guests = Vec::new();
    for i in 0..=sc.hog_vms {
        let (name, vcpus, disk_mb) = match i {
            0 => ("a".to_string(), sc.a_vcpus, 256),
            n => (format!("hog{n}"), sc.hog_vcpus, 4),
        };
        let disk = lab.join(format!("disk-{tag}-{name}.img"));
        host::make_disk(&disk, disk_mb)?;
        let spec = VmSpec {
            name: name.clone(),
            vcpus,
            mem_mb: if i == 0 { 512 } else { 256 },
            disk,
            kernel_args: String::new(),
        };
        let image = if i == 0 { &img } else { &hog_img };
        let vm = Vm::boot(&spec, image, &run.join(&name), Duration::from_secs(300))?;
        let tids = vm.vcpu_threads()?;
        for (v, &t) in tids.iter().enumerate() {
            if sc.pinned {
                host::pin(t, v % HOST_CPUS)?;
            }
            host::set_slice(t, HOST_SLICE_NS)?;
        }
        // Under TCG the guest's timer and completion interrupts are delivered by QEMU's
        // main loop and I/O threads. On a real hypervisor that path is the host kernel
        // (KVM's in-kernel LAPIC, irqfd), never time-sliced behind vCPUs; here it would be,
        // and every vCPU would then look descheduled at once. So those threads run at
        // IO_PATH_NICE (the I/O workers QEMU starts later inherit it from the main loop).
        for t in vm.threads().into_iter().filter(|t| !tids.contains(t)) {
            host::set_nice(t, IO_PATH_NICE)?;
        }
        guests.push(Guest { vm, vcpus: tids });
    }
    Ok(guests)
}

/// Busy time (user+nice+system+irq+softirq) of host CPUs 0..HOST_CPUS, seconds.
fn host_busy_s() -> f64 {
    host_stat_s(&[0, 1, 2, 5, 6])
}

/// Time this machine's own hypervisor took from host CPUs 0..HOST_CPUS (steal), seconds.
/// Not "foreign": no process here used it, and interleaved modes share it alike.
fn host_steal_s() -> f64 {
    host_stat_s(&[7])
}

/// The sum of `/proc/stat` columns `cols` (0 = user) of host CPUs 0..HOST_CPUS, seconds.
fn host_stat_s(cols: &[usize]) -> f64 {
    let hz = 100.0; // USER_HZ on every Linux ABI this runs on
    std::fs::read_to_string("/proc/stat")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            (0..HOST_CPUS).any(|c| {
                l.split_whitespace()
                    .next()
                    .is_some_and(|f| f == format!("cpu{c}"))
            })
        })
        .map(|l| {
            let f: Vec<f64> = l
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            // user nice system idle iowait irq softirq steal
            cols.iter()
                .map(|&i| f.get(i).copied().unwrap_or(0.0))
                .sum::<f64>()
                / hz
        })
        .sum()
}

/// On-CPU seconds of every thread of a process (schedstat of the whole process).
fn process_cpu_s(pid: u32) -> f64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .map(|tid| host::cpu_seconds(pid, tid))
                .sum()
        })
        .unwrap_or(0.0)
}

/// Starts the agent for `guests`; `keys` are top-level configuration keys of a variant.
/// With `place`, every VM may use both host CPUs (`host_cpus`): the agent pins its vCPU
/// threads and moves them by I/O load (ISACS Algorithm 2, on unless a variant sets
/// `balance_io = false`).
pub fn start_agent(
    guests: &[&Guest],
    dir: &Path,
    bin_dir: &Path,
    keys: &str,
    place: bool,
) -> Result<AgentProc> {
    std::fs::create_dir_all(dir)?;
    let mut cfg = format!(
        "{keys}\nstate_dir = {:?}\n\n[metrics]\nenabled = false\n\n[libvirt]\nenabled = false\n",
        dir.display().to_string()
    );
    for g in guests {
        cfg.push_str(&format!(
            "\n[[vm]]\nname = {:?}\nhint_socket = {:?}\nqmp_socket = {:?}\n",
            g.vm.name,
            g.vm.hint.display().to_string(),
            g.vm.qmp.display().to_string()
        ));
        if place {
            let cpus: Vec<usize> = (0..HOST_CPUS).collect();
            cfg.push_str(&format!("host_cpus = {cpus:?}\n"));
        }
    }
    let path = dir.join("agent.toml");
    std::fs::write(&path, cfg)?;
    let agent = AgentProc(Some({
        let mut c = Command::new(bin_dir.join("vmigrater-hv-agent"));
        c.arg("--config")
            .arg(&path)
            .arg("run")
            .stderr(std::fs::File::create(dir.join("agent.log"))?);
        // An agent that outlived a killed benchmark kept weighting the next
        // benchmark's VMs (same socket paths) and spoiled every mode's runs: it gets
        // SIGTERM (and restores its changes) when the benchmark goes.
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            c.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        c.spawn().context("starting vmigrater-hv-agent")?
    }));
    // Running once its status socket answers with every VM's vCPUs mapped.
    let t0 = Instant::now();
    loop {
        let mapped = agent_status(dir, bin_dir)
            .and_then(|v| {
                let vms = v["vms"].as_array()?.clone();
                Some(
                    vms.len() == guests.len()
                        && vms
                            .iter()
                            .all(|vm| vm["vcpus"].as_array().is_some_and(|c| !c.is_empty())),
                )
            })
            .unwrap_or(false);
        if mapped {
            return Ok(agent);
        }
        if t0.elapsed() > Duration::from_secs(30) {
            bail!(
                "agent not ready after 30 s: {}",
                std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn agent_status(dir: &Path, bin_dir: &Path) -> Option<Value> {
    let out = Command::new(bin_dir.join("vmigrater-hv-agent"))
        .arg("--config")
        .arg(dir.join("agent.toml"))
        .args(["status", "--json"])
        .output()
        .ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

/// What the agent did to each vCPU over a run, from its status sampled every second.
fn agent_view(samples: &[Value]) -> Vec<AgentVcpu> {
    let mut out: Vec<AgentVcpu> = Vec::new();
    for s in samples {
        for vm in s["vms"].as_array().into_iter().flatten() {
            for v in vm["vcpus"].as_array().into_iter().flatten() {
                let name = vm["name"].as_str().unwrap_or("?").to_string();
                let vcpu = v["vcpu"].as_u64().unwrap_or(0) as u32;
                let i = match out.iter().position(|a| a.vm == name && a.vcpu == vcpu) {
                    Some(i) => i,
                    None => {
                        out.push(AgentVcpu {
                            vm: name,
                            vcpu,
                            ..Default::default()
                        });
                        out.len() - 1
                    }
                };
                let a = &mut out[i];
                a.samples += 1;
                a.boosted += v["boost"].as_bool().unwrap_or(false) as u32;
                a.iv_credited += (v["iv_credit"].as_f64().unwrap_or(0.0) > 0.0) as u32;
                a.nice_sum += v["nice"].as_i64().unwrap_or(0);
                a.events_sum += v["events"].as_u64().unwrap_or(0);
                a.cpu_ms_sum += v["cpu_ms"].as_f64().unwrap_or(0.0);
                a.wait_ms_sum += v["wait_ms"].as_f64().unwrap_or(0.0);
                a.source = v["source"].as_str().unwrap_or("").to_string();
                a.moves = a.moves.max(v["moves"].as_u64().unwrap_or(0));
                if let Some(c) = v["host_cpu"].as_u64().map(|c| c as usize) {
                    if !a.host_cpus.contains(&c) {
                        a.host_cpus.push(c);
                    }
                }
            }
        }
    }
    out
}

/// The running agent; a run that fails half-way still stops it (SIGTERM: it restores every
/// thread it changed) instead of leaving it to steer the next run's threads.
pub struct AgentProc(Option<Child>);

impl AgentProc {
    pub fn id(&self) -> u32 {
        self.0.as_ref().map_or(0, Child::id)
    }

    /// SIGKILL: no restore; what the agent changed stays for the next one's journal.
    pub fn kill9(mut self) -> Result<()> {
        let mut child = self.0.take().context("agent already stopped")?;
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    pub fn stop(mut self) -> Result<()> {
        let status = self.terminate()?;
        anyhow::ensure!(status.success(), "agent exited with {status}");
        Ok(())
    }

    fn terminate(&mut self) -> Result<std::process::ExitStatus> {
        let mut child = self.0.take().context("agent already stopped")?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        Ok(child.wait()?)
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        if self.0.is_some() {
            let _ = self.terminate();
        }
    }
}

/// CPU seconds of the guest daemon's threads by name (utime+stime, USER_HZ ticks).
fn daemon_threads_cpu(vm: &mut Vm) -> Vec<(String, f64)> {
    let out = vm
        .sh(
            "p=$(pidof vmigrater); for t in /proc/$p/task/*; do echo \"$(cat $t/comm | tr ' ' _) $(cut -d' ' -f14,15 $t/stat)\"; done",
            Duration::from_secs(60),
        )
        .unwrap_or_default();
    let mut by: Vec<(String, f64)> = Vec::new();
    for l in out.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() == 3 {
            let s =
                (f[1].parse::<f64>().unwrap_or(0.0) + f[2].parse::<f64>().unwrap_or(0.0)) / 100.0;
            match by.iter_mut().find(|(n, _)| n == f[0]) {
                Some((_, v)) => *v += s,
                None => by.push((f[0].to_string(), s)),
            }
        }
    }
    by
}

fn guest_migrations(vm: &mut Vm) -> u64 {
    guest::daemon_status(vm)
        .and_then(|v| v["migrations"].as_u64())
        .unwrap_or(0)
}

fn units_per_s(w: &Value) -> f64 {
    let secs = w["elapsed_s"].as_f64().unwrap_or(0.0);
    let units: u64 = w["hogs"]
        .as_array()
        .map(|h| h.iter().filter_map(|x| x["units"].as_u64()).sum())
        .unwrap_or(0);
    if secs > 0.0 {
        units as f64 / secs
    } else {
        0.0
    }
}

/// The shell line that starts VM A's workload for `secs` in the background, its JSON
/// to `out`; its readers pinned to vCPU 0 in `Mode::PinnedVcpu0`.
fn a_workload(a: &Guest, mode: Mode, out: &str, secs: u64) -> String {
    let pin = if mode == Mode::PinnedVcpu0 {
        " --pin 0"
    } else {
        ""
    };
    format!(
        "rm -f {out}; setsid vmigrater-workload --file /dev/vda --readers 1 --seq-readers 1 --hogs {}{pin} --duration-ms {} </dev/null >{out} 2>{out}.err &",
        a.vcpus.len(),
        secs * 1000
    )
}

/// One run of `mode`; VM A's workload lasts `opts.secs`.
fn run_once(
    sc: &Scenario,
    mode: Mode,
    rep: u32,
    guests: &mut [Guest],
    opts: &Options,
    run_dir: &Path,
) -> Result<Run> {
    let (a, hogs) = guests.split_first_mut().expect("VM A");
    for h in hogs.iter() {
        if mode == Mode::NoSharing {
            h.vm.pause()?;
        } else {
            h.vm.resume()?;
        }
    }
    // The oracle's schedule is only as good as the guest clock's offset to the host's: it
    // is measured before the steal starts (a stolen command agent answers tens of ms
    // late), and again after it ends to show the drift.
    let offset_before = if mode == Mode::VmigraterOracle {
        Some(guest::clock_offset(&mut a.vm)?)
    } else {
        None
    };
    // The host's own steal runs for the whole run, daemon start included.
    let steal = if sc.host_steal.is_empty() || mode == Mode::NoSharing {
        None
    } else {
        let patterns = sc
            .host_steal
            .iter()
            .map(|p| p.parse())
            .collect::<Result<Vec<steal_emulator::Pattern>>>()?;
        Some(steal_emulator::Emulator::start(
            &patterns,
            STEAL_RT_PRIORITY,
        )?)
    };
    let mut clock_drift_us = None;
    let mut oracle_offset = None;
    match mode {
        Mode::VmigraterOracle => {
            let emu = steal
                .as_ref()
                .context("the oracle needs a host_steal scenario")?;
            let (offset, err) = offset_before.context("offset measured above")?;
            let epoch = (emu.epoch_ns() as i64 + offset) as u64;
            let schedule: Vec<String> = sc
                .host_steal
                .iter()
                .map(|p| format!("--schedule {p}"))
                .collect();
            let base = opts.guest_config.clone().unwrap_or_default();
            // The oracle measures what moves gain, so nothing may switch them off.
            let cfg = base.replace("[migration]\n", "[migration]\nguard = false\n");
            anyhow::ensure!(
                cfg.contains("guard = false"),
                "the lab guest config has no [migration] table to turn the guard off in"
            );
            guest::write_file(&mut a.vm, "/tmp/oracle.toml", &cfg)?;
            guest::start_oracle_daemon(
                &mut a.vm,
                &format!(
                    "--config /tmp/oracle.toml --epoch-ns {epoch} {}",
                    schedule.join(" ")
                ),
            )?;
            oracle_offset = Some((offset, err));
        }
        Mode::Variant(name) | Mode::BothVariant(name) => {
            let cfg = opts
                .variants
                .iter()
                .chain(opts.both_variants.iter())
                .find(|(n, _)| *n == name)
                .map(|(_, c)| c)
                .context("a variant without its configuration")?;
            let path = format!("/tmp/variant-{name}.toml");
            guest::write_file(&mut a.vm, &path, cfg)?;
            let bin = if opts.daemon_bins.iter().any(|(n, _)| *n == name) {
                format!("/bin/{name}/vmigrater")
            } else {
                "vmigrater".to_string()
            };
            guest::start_daemon_bin(&mut a.vm, &bin, &format!("--config {path}"))?;
        }
        m if m.daemon() => guest::start_daemon(&mut a.vm, mode == Mode::VmigraterDry)?,
        _ => {}
    }
    let agent = if mode.agent() {
        let mut all: Vec<&Guest> = vec![&*a];
        all.extend(hogs.iter());
        let keys = match mode {
            Mode::AgentVariant(name) => opts
                .agent_variants
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, k)| k.as_str())
                .context("an agent variant without its keys")?,
            _ => "",
        };
        Some(start_agent(
            &all,
            &run_dir.join("agent"),
            &opts.bin_dir,
            keys,
            !sc.pinned,
        )?)
    } else {
        None
    };
    let secs = opts.secs;
    // The hog VMs' hogs outlast VM A's workload, so they compete for all of it (paused VMs
    // run nothing).
    for h in hogs.iter_mut().filter(|_| mode != Mode::NoSharing) {
        h.vm.sh(
            &format!(
                "rm -f /tmp/w.json; setsid vmigrater-workload --file /dev/null --readers 0 --hogs {} --duration-ms {} </dev/null >/tmp/w.json 2>/tmp/w.json.err &",
                h.vcpus.len(),
                (opts.warmup_secs + secs + 4) * 1000
            ),
            Duration::from_secs(60),
        )?;
    }
    // The steal spinners are threads of this process: lab work, not foreign noise.
    let pids: Vec<u32> = std::iter::once(a.vm.pid())
        .chain(hogs.iter().map(|h| h.vm.pid()))
        .chain(steal.is_some().then(std::process::id))
        .collect();
    let agent_pid = agent.as_ref().map(AgentProc::id);
    let lab_cpu = || -> f64 {
        pids.iter()
            .chain(agent_pid.iter())
            .map(|&p| process_cpu_s(p))
            .sum()
    };
    let vcpu_cpu = |g: &Guest| -> f64 {
        g.vcpus
            .iter()
            .map(|&t| host::cpu_seconds(g.vm.pid(), t))
            .sum()
    };
    if opts.warmup_secs > 0 {
        let w = a_workload(a, mode, "/tmp/warm.json", opts.warmup_secs);
        a.vm.sh(&w, Duration::from_secs(60))?;
        // Polled only once it should be done: the polls are guest work too.
        std::thread::sleep(Duration::from_secs(opts.warmup_secs));
        guest::read_json(
            &mut a.vm,
            "/tmp/warm.json",
            Duration::from_secs(opts.warmup_secs + 120),
        )?;
    }
    let (migrations0, daemon0) = if mode.daemon() {
        (guest_migrations(&mut a.vm), daemon_threads_cpu(&mut a.vm))
    } else {
        (0, vec![])
    };
    let (busy0, lab0, a0, steal0) = (host_busy_s(), lab_cpu(), vcpu_cpu(a), host_steal_s());
    let b0: f64 = hogs.iter().map(vcpu_cpu).sum();
    let t0 = Instant::now();
    a.vm.sh(
        &a_workload(a, mode, "/tmp/w.json", secs),
        Duration::from_secs(60),
    )?;
    let mut agent_samples = Vec::new();
    let end = t0 + Duration::from_secs(secs);
    while Instant::now() < end {
        std::thread::sleep(
            Duration::from_secs(1).min(end.saturating_duration_since(Instant::now())),
        );
        if agent.is_some() {
            agent_samples.extend(agent_status(&run_dir.join("agent"), &opts.bin_dir));
        }
    }
    let wa = guest::read_json(&mut a.vm, "/tmp/w.json", Duration::from_secs(120))?;
    let wall = t0.elapsed().as_secs_f64();
    let (busy1, lab1, a1, steal1) = (host_busy_s(), lab_cpu(), vcpu_cpu(a), host_steal_s());
    let b1: f64 = hogs.iter().map(vcpu_cpu).sum();
    let migrations = if mode.daemon() {
        guest_migrations(&mut a.vm).saturating_sub(migrations0)
    } else {
        0
    };
    let status = if mode.daemon() {
        guest::daemon_status(&mut a.vm)
    } else {
        None
    };
    let guest_vcpus = status.as_ref().map_or(Value::Null, |v| v["vcpus"].clone());
    let guest_guard = status.as_ref().map_or(Value::Null, |v| {
        serde_json::json!({
            "moves_allowed": v["moves_allowed"],
            "pays": v["guard_pays"],
            "holds": v["guard_holds"],
            "monitor_source": v["monitor_source"],
            "block_attached": v["block_attached"],
        })
    });
    let mut daemon_cpu = Vec::new();
    if mode.daemon() {
        for (n, v) in daemon_threads_cpu(&mut a.vm) {
            let before = daemon0.iter().find(|(m, _)| *m == n).map_or(0.0, |x| x.1);
            daemon_cpu.push((n, v - before));
        }
    }
    let mut hog_b = 0.0;
    for h in hogs.iter_mut() {
        if mode != Mode::NoSharing {
            hog_b += units_per_s(&guest::read_json(
                &mut h.vm,
                "/tmp/w.json",
                Duration::from_secs(120),
            )?);
        }
    }
    let stolen_s = steal
        .map(|e| e.stop().iter().map(|r| r.stolen_ns()).sum::<u64>() as f64 / 1e9)
        .unwrap_or(0.0);
    if let Some((before, err)) = oracle_offset {
        // The guest clock must not drift off the host's during the run, or the oracle's
        // schedule would slide out of phase with the real steal.
        let (after, err2) = guest::clock_offset(&mut a.vm)?;
        clock_drift_us = Some((
            (after - before) as f64 / 1e3,
            err as f64 / 1e3,
            err2 as f64 / 1e3,
        ));
    }
    if let Some(c) = agent {
        c.stop()?;
    }
    if mode.daemon() {
        guest::stop_daemon(&mut a.vm)?;
        // Its decisions beside its numbers: which tasks it kept or moved, and why.
        let log = a.vm.sh("cat /tmp/vmigrater.log", Duration::from_secs(60))?;
        std::fs::create_dir_all(run_dir)?;
        std::fs::write(
            run_dir.join(format!("{}-{}-rep{rep}.log", sc.name, mode.name())),
            log,
        )?;
    }
    let reader = |pattern: &str| -> Value {
        wa["readers"]
            .as_array()
            .and_then(|r| r.iter().find(|x| x["pattern"] == pattern).cloned())
            .unwrap_or(Value::Null)
    };
    let (r4k, seq) = (reader("Random4k"), reader("Seq1m"));
    let elapsed = wa["elapsed_s"].as_f64().unwrap_or(secs as f64);
    let foreign = ((busy1 - busy0) - (lab1 - lab0)).max(0.0);
    let capacity = wall * HOST_CPUS as f64;
    // The hog VMs' vCPUs are on every host CPU; their share is of the CPUs they use.
    let b_cpus = hogs
        .iter()
        .map(|h| h.vcpus.len().min(HOST_CPUS))
        .max()
        .unwrap_or(0) as f64;
    Ok(Run {
        mode: mode.name().into(),
        rep,
        secs: elapsed,
        iops_4k: r4k["reads"].as_f64().unwrap_or(0.0) / elapsed,
        p50_4k_us: r4k["p50_us"].as_f64().unwrap_or(f64::NAN),
        p99_4k_us: r4k["p99_us"].as_f64().unwrap_or(f64::NAN),
        reads_4k_per_s: r4k["reads_per_s"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default(),
        seq_mbps: seq["bytes"].as_f64().unwrap_or(0.0) / elapsed / 1e6,
        hog_a_units_s: units_per_s(&wa),
        hog_b_units_s: hog_b,
        b_cpu_share: if b_cpus > 0.0 {
            (b1 - b0) / (wall * b_cpus)
        } else {
            0.0
        },
        a_cpu_share: (a1 - a0) / capacity,
        foreign_cpu_s: foreign,
        machine_steal_s: steal1 - steal0,
        noisy: summary::is_noisy(foreign, wall, HOST_CPUS),
        migrations,
        daemon_cpu_s: daemon_cpu.iter().map(|x| x.1).sum(),
        daemon_threads_cpu_s: daemon_cpu,
        guest_vcpus,
        guest_guard,
        host_stolen_s: stolen_s,
        oracle_clock_drift_us: clock_drift_us,
        agent: agent_view(&agent_samples),
        readers: [&r4k, &seq]
            .iter()
            .map(|r| summary::ReaderPlace {
                pattern: r["pattern"].as_str().unwrap_or("").into(),
                last_cpu: r["last_cpu"].as_u64(),
                migrations: r["migrations"].as_u64(),
            })
            .collect(),
    })
}

/// Turns the scheduler's autogroups off while it lives and puts the setting back on drop.
/// Each VM runs in a session of its own, so with autogroups the host would first share a
/// CPU between VMs and only then between their vCPU threads; a hypervisor schedules vCPUs
/// as peers (Xen's credit schedulers, KVM without per-VM cgroups), and so does this lab.
pub struct AutogroupOff(Option<String>);

const AUTOGROUP: &str = "/proc/sys/kernel/sched_autogroup_enabled";

impl AutogroupOff {
    pub fn new() -> Result<AutogroupOff> {
        let Ok(old) = std::fs::read_to_string(AUTOGROUP) else {
            return Ok(AutogroupOff(None)); // kernel without autogroups: nothing to do
        };
        std::fs::write(AUTOGROUP, "0").with_context(|| format!("writing 0 to {AUTOGROUP}"))?;
        eprintln!("bench-lab: {AUTOGROUP} 0 for the run (was {})", old.trim());
        Ok(AutogroupOff(Some(old)))
    }
}

impl Drop for AutogroupOff {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            if let Err(e) = std::fs::write(AUTOGROUP, old.trim()) {
                eprintln!(
                    "bench-lab: could not restore {AUTOGROUP} to {}: {e}",
                    old.trim()
                );
            }
        }
    }
}

/// Every mode of `sc`, `opts.reps` times, the order rotated each repetition. Runs are
/// printed as they finish (a long benchmark shows its progress).
pub fn run_scenario(sc: &Scenario, opts: &Options) -> Result<Vec<Run>> {
    if runs_oracle(sc, opts) {
        opts.check_oracle_daemon()?;
    }
    let lab = image::lab_dir();
    let kernel = Kernel::find(&lab)?;
    let t0 = Instant::now();
    let mut guests = boot(sc, opts, &kernel, &lab, "bench")?;
    eprintln!(
        "bench-lab: {} ({}): {} VMs booted in {:.1?}",
        sc.name,
        sc.what,
        guests.len(),
        t0.elapsed()
    );
    // Which vCPU completes which request: one queue per vCPU (QEMU's default for
    // virtio-blk-pci), each with its own interrupt, completes on the submitter's vCPU.
    let queues = guests[0].vm.sh(
        "for q in /sys/block/vda/mq/*; do echo \"${q##*/}: $(cat $q/cpu_list)\"; done",
        Duration::from_secs(60),
    )?;
    eprintln!(
        "bench-lab: {}: VM A's disk queues (queue: vCPUs) {}",
        sc.name,
        queues.trim().replace('\n', ", ")
    );
    let run_dir = lab.join("run/bench");
    let mut runs = Vec::new();
    let modes: Vec<Mode> = sc
        .modes
        .iter()
        .copied()
        .chain(opts.variants.iter().map(|(n, _)| Mode::Variant(n)))
        .chain(
            opts.agent_variants
                .iter()
                .map(|(n, _)| Mode::AgentVariant(n)),
        )
        .chain(opts.both_variants.iter().map(|(n, _)| Mode::BothVariant(n)))
        .filter(|m| opts.modes.is_empty() || opts.modes.iter().any(|o| o == m.name()))
        .collect();
    for rep in 0..opts.reps {
        let n = modes.len();
        for k in 0..n {
            let mode = modes[(k + rep as usize) % n];
            let r = run_once(sc, mode, rep, &mut guests, opts, &run_dir)
                .with_context(|| format!("{} {} rep {rep}", sc.name, mode.name()))?;
            eprintln!(
                "bench-lab: {} rep {rep} {:<10} 4k {:7.1} IOPS p99 {:8.0} us  seq {:6.2} MB/s  hogA {:7.1}/s hogB {:7.1}/s  cpu A {:.3} B {:.3}  foreign {:.2} s{}  migrations {}  daemon cpu {:.2} s {:?} guard {}",
                sc.name,
                r.mode,
                r.iops_4k,
                r.p99_4k_us,
                r.seq_mbps,
                r.hog_a_units_s,
                r.hog_b_units_s,
                r.a_cpu_share,
                r.b_cpu_share,
                r.foreign_cpu_s,
                if r.noisy { " NOISY" } else { "" },
                r.migrations,
                r.daemon_cpu_s,
                r.daemon_threads_cpu_s,
                r.guest_guard
            );
            runs.push(r);
        }
    }
    for g in guests {
        g.vm.stop();
    }
    Ok(runs)
}
