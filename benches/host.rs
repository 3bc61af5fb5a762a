//! The host scheduler in the loop (`make bench-host`, root): the guest workload of
//! `vmigrater-workload` (a 4 KiB random O_DIRECT reader on a file of the root disk and a CPU
//! hog pinned on every CPU) while bpf/hostmodel.bpf.c shares each CPU between our vCPU and
//! the vCPUs of k - 1 other VMs under a fair (KVM-like) or credit (Xen-like) policy decided
//! online. For every policy × k, every mode runs once per repetition, in an order rotated
//! each repetition:
//!
//! - `vanilla`: Linux alone, no agent;
//! - `vmigrater`: the release daemon, default configuration (no host channel);
//! - `agent`: `vmigrater-hv-agent` with its `model` backend driving the model's weights
//!   every period, fed by the guest daemon's reports over the real wire protocol (a pty
//!   stands in for the virtio-serial port) with the daemon in `--follow-host` (it reports,
//!   and moves I/O-bound tasks only onto the vCPUs the agent holds: every decision is the
//!   host's);
//! - `agent_report`: the same agent with the daemon in `--dry-run` (it reports and moves
//!   nothing): the host's weights alone;
//! - `dryrun`: the daemon in `--dry-run` alone, no channel, no agent: what the reporting
//!   daemon of `agent` costs the guest by itself;
//! - `both`: the daemon moving tasks and reporting, and the agent;
//! - `governor`: Linux's steal governor, emulated (tests/support/governor.rs) on the
//!   steal the model publishes for our vCPUs, over the workload's threads;
//! - `pinned`: the reader pinned to the disk's completion CPU (the open-loop testbed's
//!   oracle, kept as a reference point);
//! - `host_oracle`: the host-side oracle, the best the agent's own rules allow held from
//!   the first instant by a host that knows where the guest's I/O completes: the reader
//!   pinned to the completion vCPU, and the model's weights set once to the agent's
//!   steady exchange (`io_boost_nice` steps to that vCPU, paid by the guest's other vCPU
//!   and balanced by another VM's vCPUs on both CPUs, as `hv_agent::weights::fund` does);
//! - `liar`: the agent, fed by a hostile guest that claims maximal I/O on every vCPU every
//!   25 ms: its guest share against vanilla says whether claiming I/O buys CPU.
//!
//! Each run reports the guest's throughput beside the other VMs' work (their CPU time in
//! the model over the workload's run, all CPUs): what we gain and what the others pay.
//! Writes `host.json` (raw runs, per-cell medians, ratios with 95% bootstrap intervals,
//! paired ratios) in the output directory and prints a table.
//!
//! With `--workload APP` (an application of `bench-apps`, e.g. pg_select_c1) the guest runs
//! that application instead of the reader, started cold and measured from its first request,
//! `pinned` pins its server and client to the completion vCPU, and the file is
//! `host-APP.json`.
//!
//! Flags (after `--`): --reps N (8), --secs S (10), --warmup-secs S (3), --io-warmup-ms MS
//! (0: from the first request), --cells LIST (policy:k, default
//! fair:2,fair:3,fair:4,credit:2,credit:3,credit:4), --modes LIST, --duty PERIOD_MS:ON_MS
//! (the other VMs compute ON of every PERIOD; default CPU-bound), --fair-slice-ms MS (the
//! fair policy's slice, 3), --workload rand4k|APP (rand4k), --out DIR (default
//! `$VMIGRATER_BENCH_DIR` or target/bench).

use anyhow::{Context, Result};
use irq_steal::host::{Duty, HostConfig, HostModel, Policy};
use os_layer::time::{monotonic_ns, sleep_until};
use serde_json::{json, Map, Value};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vmigrater_testbed::apps::{self, App, Apps, Placement};
use vmigrater_testbed::completion::CompletionMap;
use vmigrater_testbed::daemon::BenchDaemon;
use vmigrater_testbed::governor::{GovernorConfig, GovernorRun};
use vmigrater_testbed::report::{est, f, fmt_est, list};
use vmigrater_testbed::stats::{self, Estimate};
use vmigrater_testbed::{ncpus, require_root, workload, workspace_bin};

const MODES: [&str; 10] = [
    "vanilla",
    "vmigrater",
    "agent",
    "agent_report",
    "dryrun",
    "both",
    "governor",
    "pinned",
    "host_oracle",
    "liar",
];
const CELLS: &str = "fair:2,fair:3,fair:4,credit:2,credit:3,credit:4";
const FILE_SIZE: u64 = 1 << 30;
/// The agent's credit period: its default.
const AGENT_PERIOD_MS: u64 = 100;

struct Settings {
    reps: usize,
    secs: f64,
    warmup: Duration,
    io_warmup: Duration,
    cells: Vec<(Policy, usize)>,
    modes: Vec<&'static str>,
    duty: Option<Duty>,
    /// The fair policy's slice, where not the model's default.
    fair_slice: Option<Duration>,
    work: Work,
    out: PathBuf,
}

fn parse_cells(v: &str) -> Result<Vec<(Policy, usize)>> {
    list(v)
        .iter()
        .map(|c| {
            let (p, k) = c
                .split_once(':')
                .with_context(|| format!("--cells: {c:?} is not policy:k (e.g. fair:2)"))?;
            Ok((
                p.parse()?,
                k.parse()
                    .with_context(|| format!("--cells: k of {c:?} is not a number"))?,
            ))
        })
        .collect()
}

fn parse_args() -> Result<Settings> {
    let mut s = Settings {
        reps: 8,
        secs: 10.0,
        warmup: Duration::from_secs(3),
        io_warmup: Duration::ZERO,
        cells: parse_cells(CELLS)?,
        modes: MODES.to_vec(),
        duty: None,
        fair_slice: None,
        work: Work::Reads,
        out: vmigrater_testbed::bench_dir(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--bench" => {}
            "--reps" => s.reps = val()?.parse::<usize>()?.max(1),
            "--secs" => s.secs = val()?.parse::<f64>()?.max(0.5),
            "--warmup-secs" => s.warmup = Duration::from_secs_f64(val()?.parse()?),
            "--io-warmup-ms" => s.io_warmup = Duration::from_millis(val()?.parse()?),
            "--cells" => s.cells = parse_cells(&val()?)?,
            "--modes" => {
                s.modes = list(&val()?)
                    .iter()
                    .map(|m| {
                        MODES.iter().copied().find(|x| x == m).with_context(|| {
                            format!("--modes: unknown {m:?}; known: {}", MODES.join(","))
                        })
                    })
                    .collect::<Result<_>>()?
            }
            "--duty" => {
                let v = val()?;
                let (p, on) = v
                    .split_once(':')
                    .with_context(|| format!("--duty: {v:?} is not PERIOD_MS:ON_MS"))?;
                s.duty = Some(Duty {
                    period_ns: p.parse::<u64>()? * 1_000_000,
                    on_ns: on.parse::<u64>()? * 1_000_000,
                });
            }
            "--fair-slice-ms" => {
                s.fair_slice = Some(Duration::from_secs_f64(val()?.parse::<f64>()? / 1e3))
            }
            "--workload" => s.work = Work::parse(&val()?)?,
            "--out" => s.out = val()?.into(),
            other => anyhow::bail!(
                "unknown argument {other:?} (see the top of benches/host.rs for the flags)"
            ),
        }
    }
    Ok(s)
}

/// The host end of our guest's port: the agent connects to a unix socket, the daemon
/// writes to a pty slave; two threads copy between them, each ending when its side closes.
struct Port {
    dir: tempfile::TempDir,
    listener: UnixListener,
    slave: PathBuf,
    master: Option<std::fs::File>,
}

impl Port {
    fn open() -> Result<Port> {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        use std::os::fd::AsFd;
        let dir = tempfile::tempdir()?;
        let listener = UnixListener::bind(dir.path().join("hint.sock"))?;
        let pty = nix::pty::openpty(None, None).context("openpty")?;
        let mut raw = tcgetattr(pty.slave.as_fd())?;
        cfmakeraw(&mut raw);
        tcsetattr(pty.slave.as_fd(), SetArg::TCSANOW, &raw)?;
        let slave = nix::unistd::ttyname(pty.slave.as_fd())?;
        Ok(Port {
            dir,
            listener,
            slave,
            master: Some(std::fs::File::from(pty.master)),
        })
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("hint.sock")
    }

    /// Waits for the agent's connection and starts relaying.
    fn relay(&mut self) -> Result<()> {
        let stream = self.accept()?;
        let mut a = self.master.take().context("relayed twice")?;
        let mut b = stream;
        let (mut a2, mut b2) = (a.try_clone()?, b.try_clone()?);
        std::thread::spawn(move || std::io::copy(&mut a, &mut b));
        std::thread::spawn(move || std::io::copy(&mut b2, &mut a2));
        Ok(())
    }

    /// Plays a hostile guest of `vcpus` vCPUs on the agent's connection until `stop`:
    /// maximal completions and I/O-bound tasks on every vCPU, every 25 ms; replies drained.
    fn lie(&mut self, vcpus: usize, stop: Arc<AtomicBool>) -> Result<()> {
        use std::io::Write;
        let mut g = self.accept()?;
        let mut replies = g.try_clone()?;
        std::thread::spawn(move || std::io::copy(&mut replies, &mut std::io::sink()));
        std::thread::spawn(move || {
            let (max, tasks) = (u64::MAX, u32::MAX);
            let _ = g.write_all(
                format!(
                    "{{\"type\":\"hello\",\"version\":1,\"agent\":\"liar\",\"vcpus\":{vcpus}}}\n"
                )
                .as_bytes(),
            );
            let mut seq = 0u64;
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                let v: Vec<String> = (0..vcpus)
                    .map(|c| format!("{{\"cpu\":{c},\"io_completions\":{max},\"io_interval_ema_us\":1,\"io_bound_tasks\":{tasks},\"inactive_ratio\":0.0,\"slice_estimate_us\":1000}}"))
                    .collect();
                let line = format!(
                    "{{\"type\":\"report\",\"seq\":{seq},\"period_ms\":25,\"vcpus\":[{}]}}\n",
                    v.join(",")
                );
                if g.write_all(line.as_bytes()).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(25));
            }
        });
        Ok(())
    }

    fn accept(&mut self) -> Result<std::os::unix::net::UnixStream> {
        self.listener.set_nonblocking(true)?;
        let t0 = Instant::now();
        let stream = loop {
            match self.listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    anyhow::ensure!(
                        t0.elapsed() < Duration::from_secs(10),
                        "the agent did not connect to {} within 10 s",
                        self.socket().display()
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(e.into()),
            }
        };
        stream.set_nonblocking(false)?;
        Ok(stream)
    }
}

/// `vmigrater-hv-agent` with the `model` backend on the model pinned at `pin_dir`: our
/// guest is slot 0 (its port `socket`), the other VMs slots 1..k.
struct BenchAgent {
    child: Child,
    dir: tempfile::TempDir,
}

impl BenchAgent {
    fn start(pin_dir: &Path, socket: &Path, k: usize) -> Result<BenchAgent> {
        let dir = tempfile::tempdir()?;
        let mut cfg = format!(
            "period_ms = {AGENT_PERIOD_MS}\nbackend = \"model\"\nmodel_dir = {:?}\nstate_dir = {:?}\n\n\
             [metrics]\nenabled = false\n\n[libvirt]\nenabled = false\n\n\
             [[vm]]\nname = \"guest\"\nmodel_slot = 0\nhint_socket = {:?}\n",
            pin_dir.display().to_string(),
            dir.path().display().to_string(),
            socket.display().to_string()
        );
        for slot in 1..k {
            cfg += &format!("\n[[vm]]\nname = \"vm{slot}\"\nmodel_slot = {slot}\n");
        }
        let config = dir.path().join("agent.toml");
        std::fs::write(&config, cfg)?;
        let child = Command::new(workspace_bin("vmigrater-hv-agent"))
            .arg("--config")
            .arg(&config)
            // Each change of a modelled vCPU's weight or boost is a debug line: counted
            // per run (`agent.guest_changes`).
            .args(["--log", "info,hv_agent::model=debug", "run"])
            .stderr(std::fs::File::create(dir.path().join("agent.log"))?)
            .spawn()
            .context("starting vmigrater-hv-agent")?;
        Ok(BenchAgent { child, dir })
    }

    fn status(&self) -> Value {
        Command::new(workspace_bin("vmigrater-hv-agent"))
            .arg("--config")
            .arg(self.dir.path().join("agent.toml"))
            .args(["status", "--json"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| serde_json::from_slice(&o.stdout).ok())
            .unwrap_or(Value::Null)
    }

    /// SIGTERM (it restores every weight), wait; its log.
    fn stop(mut self) -> Result<String> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        let st = self.child.wait()?;
        let log = std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default();
        anyhow::ensure!(st.success(), "the agent exited with {st}: {log}");
        Ok(log)
    }
}

impl Drop for BenchAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The agent's last weights per (VM, vCPU), from its status.
fn agent_weights(status: &Value) -> Value {
    let vms = status["vms"].as_array().cloned().unwrap_or_default();
    vms.iter()
        .map(|vm| {
            json!({
                "vm": vm["name"],
                "reports": vm["reports"],
                "rejected": vm["rejected"],
                "weights": vm["vcpus"].as_array().map(|v| v.iter().map(|c| c["weight"].clone()).collect::<Vec<_>>()),
                "carries_io": vm["vcpus"].as_array().map(|v| v.iter().map(|c| c["carries_io"].clone()).collect::<Vec<_>>()),
                "always_runnable": vm["vcpus"].as_array().map(|v| v.iter().map(|c| c["always_runnable"].clone()).collect::<Vec<_>>()),
                "runnable_ms": vm["vcpus"].as_array().map(|v| v.iter().map(|c| c["cpu_ms"].as_f64().unwrap_or(0.0) + c["wait_ms"].as_f64().unwrap_or(0.0)).collect::<Vec<_>>()),
            })
        })
        .collect()
}

/// The processes the governor governs: the workload, or the application's cgroup (listed
/// anew each interval, so a client started after the server is governed too).
enum GovernedBy {
    Pid(u32),
    Procs(PathBuf),
}

type Governed = Arc<Mutex<Option<GovernedBy>>>;

fn governed_pids(g: &Governed) -> Vec<u32> {
    match &*g.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
        None => Vec::new(),
        Some(GovernedBy::Pid(p)) => vec![*p],
        Some(GovernedBy::Procs(file)) => std::fs::read_to_string(file)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect(),
    }
}

/// What a run reads: the reader's file or the applications, and the disk's completion CPU.
struct Data {
    file: PathBuf,
    apps: Option<Apps>,
    completion: usize,
}

/// The guest's workload.
#[derive(Clone, Copy)]
enum Work {
    Reads,
    App(App),
}

impl Work {
    fn parse(name: &str) -> Result<Work> {
        if name == "rand4k" {
            return Ok(Work::Reads);
        }
        App::parse(name)
            .map(Work::App)
            .with_context(|| format!("--workload {name:?}: rand4k or an application of bench-apps"))
    }

    fn name(&self) -> String {
        match self {
            Work::Reads => "rand4k".into(),
            Work::App(a) => a.name(),
        }
    }

    fn metric(&self) -> &'static str {
        match self {
            Work::Reads => "iops",
            Work::App(a) => a.metric(),
        }
    }
}

fn run_once(
    policy: Policy,
    k: usize,
    mode: &str,
    data: &Data,
    s: &Settings,
    tag: &str,
) -> Result<Value> {
    let work = s.work;
    if let Work::App(_) = work {
        apps::drop_caches()?;
    }
    let cpus: Vec<usize> = (0..ncpus()).collect();
    let mut cfg = HostConfig::new(policy, k, cpus.clone());
    cfg.duty = s.duty;
    if let Some(d) = s.fair_slice {
        cfg.timings.base_slice_ns = d.as_nanos() as u64;
    }
    cfg.pin_dir = format!("/sys/fs/bpf/vmigrater-bench-host-{tag}").into();
    let model = HostModel::start(&cfg).context("starting the host model")?;
    if mode == "host_oracle" {
        hold_the_agents_exchange(&cfg.pin_dir, data.completion, k)?;
    }
    let reader = model.reader()?;
    let start_ns = model.start_ns();
    let port = matches!(mode, "agent" | "agent_report" | "both" | "liar")
        .then(Port::open)
        .transpose()?;
    let daemon_config =
        |port: &Port| format!("[channel]\npath = {:?}\n", port.slave.display().to_string());
    let (daemon, agent) = match (mode, &port) {
        ("vmigrater", _) => (Some(BenchDaemon::start("", &[])?), None),
        ("dryrun", _) => (Some(BenchDaemon::start("", &["--dry-run"])?), None),
        ("agent" | "agent_report", Some(p)) => {
            let agent = BenchAgent::start(&cfg.pin_dir, &p.socket(), k)?;
            let guest = if mode == "agent" {
                "--follow-host"
            } else {
                "--dry-run"
            };
            (
                Some(BenchDaemon::start(&daemon_config(p), &[guest])?),
                Some(agent),
            )
        }
        ("both", Some(p)) => {
            let agent = BenchAgent::start(&cfg.pin_dir, &p.socket(), k)?;
            (
                Some(BenchDaemon::start(&daemon_config(p), &[])?),
                Some(agent),
            )
        }
        ("liar", Some(p)) => (None, Some(BenchAgent::start(&cfg.pin_dir, &p.socket(), k)?)),
        _ => (None, None),
    };
    let stop_lying = Arc::new(AtomicBool::new(false));
    if let Some(mut p) = port {
        if mode == "liar" {
            p.lie(cpus.len(), stop_lying.clone())?;
        } else {
            p.relay()?;
        }
        // The port's ends live in the relay threads from here.
        drop(p.listener);
        std::mem::forget(p.dir);
    }
    // The governor watches from the start, as the kernel's does from boot; it governs the
    // workload's threads once it exists.
    let governed: Governed = Arc::default();
    let governor = (mode == "governor")
        .then(|| {
            let steal_reader = model.reader()?;
            let governed = governed.clone();
            GovernorRun::start_with(
                GovernorConfig::default(),
                move || governed_pids(&governed),
                move || steal_reader.guest_steal_ns(),
            )
            .context("starting the steal governor")
        })
        .transpose()?;
    sleep_until(start_ns + s.warmup.as_nanos() as u64);

    let others0 = reader.others_run_ns();
    let t0 = monotonic_ns();
    let measured = match work {
        Work::Reads => reads(mode, data, s, &governed),
        Work::App(app) => app_once(app, mode, data, s, &governed),
    };
    let t1 = monotonic_ns();
    let others1 = reader.others_run_ns();
    let agent_status = agent.as_ref().map(BenchAgent::status);
    stop_lying.store(true, Ordering::Relaxed);
    let governor_record = governor.map(GovernorRun::stop);
    let daemon_json = match daemon {
        Some(d) => {
            let st = d.status();
            let log = d.stop()?;
            json!({
                "migrations": st.as_ref().map(|s| s["migrations"].clone()),
                "channel_reports_sent": st.as_ref().map(|s| s["channel_reports_sent"].clone()),
                "managed": log.lines().filter(|l| l.contains("managing it")).count(),
                "guard_holds": log.lines().filter(|l| l.contains("pays=false")).count(),
                "move_gate": st.as_ref().map(|s| s["move_gate"].clone()),
                "partners": st.as_ref().map(|s| s["partners"].clone()),
            })
        }
        None => Value::Null,
    };
    let agent_json = match agent {
        Some(a) => {
            let log = a.stop()?;
            let changes: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("re-weighted") && l.contains("guest"))
                .collect();
            json!({
                "status": agent_status.as_ref().map(agent_weights),
                "restored": log.contains("restored every scheduling change"),
                "guest_changes": changes.len(),
                "guest_boosts": changes.iter().filter(|l| l.contains("boost=true")).count(),
            })
        }
        None => Value::Null,
    };
    let report = model.stop().context("stopping the host model")?;
    let mut v = measured?;
    let window_s = (t1 - t0) as f64 / 1e9;
    v["mode"] = json!(mode);
    // The other VMs' CPU time per second of the workload's run, over all CPUs.
    v["others_cpu_per_s"] = json!((others1 - others0) as f64 / 1e9 / window_s);
    v["guest_share"] = json!(report.guest_share());
    v["daemon"] = daemon_json;
    v["agent"] = agent_json;
    v["governor"] = json!(governor_record);
    v["model"] = json!(report);
    Ok(v)
}

/// `host_oracle`'s weights: the exchange the agent settles on (its status reads
/// [0.58, 1.42] for our guest in every fair cell), written into the model's `control` map
/// before the workload starts. The completion vCPU is favoured and our other vCPU pays;
/// the other VM in slot 1 pays on the completion CPU and is paid back on the other, so no
/// VM's share and no CPU's balance moves. Only the guest's first two vCPUs take part, as
/// in the agent's exchange.
fn hold_the_agents_exchange(pin_dir: &Path, completion: usize, k: usize) -> Result<()> {
    use hv_agent::model::{key, Control, DEFAULT_WEIGHT};
    use libbpf_rs::{MapCore, MapFlags, MapHandle};
    anyhow::ensure!(
        k >= 2,
        "host_oracle needs another VM on each CPU to trade with (k = {k})"
    );
    let other = usize::from(completion == 0);
    let steps = hv_agent::config::Config::default().io_boost_nice;
    let (favoured, paying) = hv_agent::weights::exchange_weights(steps);
    let path = pin_dir.join("control");
    let control = MapHandle::from_pinned_path(&path)
        .with_context(|| format!("opening the host model's {}", path.display()))?;
    for (cpu, slot, factor) in [
        (completion, 0, favoured),
        (completion, 1, paying),
        (other, 1, favoured),
        (other, 0, paying),
    ] {
        let c = Control {
            weight: (f64::from(DEFAULT_WEIGHT) * factor).round() as u32,
            boost: 0,
        };
        control
            .update(
                &key(cpu as u32, slot).to_ne_bytes(),
                &c.to_bytes(),
                MapFlags::ANY,
            )
            .with_context(|| format!("host_oracle: writing control[cpu {cpu}, slot {slot}]"))?;
    }
    Ok(())
}

/// The 4 KiB reader and a hog per vCPU (`vmigrater-workload`): IOPS from its first request.
fn reads(mode: &str, data: &Data, s: &Settings, governed: &Governed) -> Result<Value> {
    let workload_ms = (s.io_warmup + Duration::from_secs_f64(s.secs)).as_millis() as u64;
    let mut cmd = Command::new(workspace_bin("vmigrater-workload"));
    cmd.arg("--file")
        .arg(&data.file)
        .args(["--pattern", "random4k", "--readers", "1", "--hogs"])
        .arg(ncpus().to_string())
        .args(["--pin-hogs", "--warmup-ms"])
        .arg(s.io_warmup.as_millis().to_string())
        .arg("--duration-ms")
        .arg(workload_ms.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if matches!(mode, "pinned" | "host_oracle") {
        cmd.arg("--pin").arg(data.completion.to_string());
    }
    let child = cmd.spawn().context("starting vmigrater-workload")?;
    *governed.lock().unwrap() = Some(GovernedBy::Pid(child.id()));
    let out = child
        .wait_with_output()
        .context("waiting for vmigrater-workload")?;
    anyhow::ensure!(
        out.status.success(),
        "vmigrater-workload failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let w: Value = serde_json::from_slice(&out.stdout).context("parsing the workload's JSON")?;
    let elapsed = f(&w["elapsed_s"]);
    let readers = w["readers"].as_array().cloned().unwrap_or_default();
    let ops: f64 = readers.iter().map(|r| f(&r["ops"])).sum();
    // Hog i is pinned to vCPU i (`--pin-hogs`, one per vCPU): the guest's co-located work
    // per vCPU, beside the reader's gain.
    let hog_rates: Vec<f64> = w["hogs"].as_array().map_or(Vec::new(), |h| {
        h.iter().map(|h| f(&h["units"]) / elapsed).collect()
    });
    Ok(json!({
        "value": ops / elapsed,
        "iops": ops / elapsed,
        "elapsed_s": elapsed,
        "p99_us": readers.iter().map(|r| f(&r["p99_us"])).filter(|x| x.is_finite()).reduce(f64::max),
        "hog_units_per_s": hog_rates.iter().sum::<f64>(),
        "hog_units_per_s_by_cpu": hog_rates,
        "reader_last_cpu": readers.iter().map(|r| r["last_cpu"].clone()).collect::<Vec<_>>(),
    }))
}

/// An application of `bench-apps` (started cold, its memory bounded, measured from its first
/// request) and a hog per vCPU: its figure of merit. `pinned` pins server and client to the
/// completion vCPU (the best oracle of `bench-apps`' tables).
fn app_once(app: App, mode: &str, data: &Data, s: &Settings, governed: &Governed) -> Result<Value> {
    let apps = data
        .apps
        .as_ref()
        .context("the applications are not prepared")?;
    let hogs: Vec<workload::Worker> = (0..ncpus())
        .map(|c| workload::spawn_hog(Some(c)))
        .collect::<Result<_>>()?;
    let place = if matches!(mode, "pinned" | "host_oracle") {
        Placement {
            server_cpu: Some(data.completion),
            client_cpu: Some(data.completion),
        }
    } else {
        Placement::default()
    };
    let mut on_start = |cg: &apps::MemCgroup| {
        *governed.lock().unwrap() = Some(GovernedBy::Procs(cg.procs_file()));
    };
    let t0 = Instant::now();
    let apart = Apart::start(governed.clone());
    let run = apps.run(app, s.secs, &place, &mut on_start);
    let samples = apart.stop();
    let secs = t0.elapsed().as_secs_f64();
    let hog_rates: Vec<f64> = hogs
        .into_iter()
        .map(|h| h.stop().unwrap_or(0) as f64 / secs)
        .collect();
    let run = run?;
    let apart_per_s = per_second(&samples, run.first_request_unix_s, run.per_s.len());
    Ok(json!({
        "apart_per_s": apart_per_s,
        "value": run.value,
        "metric": app.metric(),
        "elapsed_s": run.elapsed_s,
        "per_s": run.per_s,
        "p99_ms": run.p99_ms,
        "server_start_s": run.server_start_s,
        "hog_units_per_s": hog_rates.iter().sum::<f64>(),
        "hog_units_per_s_by_cpu": hog_rates,
        "app": run.extra,
    }))
}

/// Where a client and its server run, sampled every 20 ms while the application runs: the
/// client (`pgbench`, `wrk`: the busiest thread not named like the server) and the server
/// thread that has used the most CPU. Apart, each request waits for two vCPUs' turns on
/// the host; the per-second share of samples apart shows whether a slow second is one.
struct Apart {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(f64, bool)>>,
}

impl Apart {
    fn start(governed: Governed) -> Apart {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                if let Some(apart) = client_and_server_apart(&governed_pids(&governed)) {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64());
                    samples.push((now, apart));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            samples
        });
        Apart { stop, thread }
    }

    fn stop(self) -> Vec<(f64, bool)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// `Some(true)` when the busiest client thread and the busiest server thread last ran on
/// different CPUs; `None` until both exist.
fn client_and_server_apart(pids: &[u32]) -> Option<bool> {
    let mut busiest: [Option<(u64, u32)>; 2] = [None, None]; // (ns on a CPU, last CPU)
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let stat = os_layer::TaskStat::read(&t.path().join("stat"));
            let run = os_layer::SchedStat::read(&t.path().join("schedstat"));
            let (Some(stat), Some(run)) = (stat, run) else {
                continue;
            };
            let Some(cpu) = stat.last_cpu else {
                continue;
            };
            let side = usize::from(!matches!(stat.comm.as_str(), "postgres" | "nginx" | "tar"));
            if busiest[side].is_none_or(|(ns, _)| run.run_ns > ns) {
                busiest[side] = Some((run.run_ns, cpu));
            }
        }
    }
    match busiest {
        [Some((_, a)), Some((_, b))] => Some(a != b),
        _ => None,
    }
}

/// The share of samples apart in each whole second from the first request.
fn per_second(samples: &[(f64, bool)], first_request_unix_s: f64, secs: usize) -> Vec<f64> {
    let mut counts = vec![(0u32, 0u32); secs];
    for &(t, apart) in samples {
        let i = t - first_request_unix_s;
        if i >= 0.0 && (i as usize) < secs {
            counts[i as usize].0 += u32::from(apart);
            counts[i as usize].1 += 1;
        }
    }
    counts
        .iter()
        .map(|&(a, n)| {
            if n == 0 {
                f64::NAN
            } else {
                f64::from(a) / f64::from(n)
            }
        })
        .collect()
}

fn summarise(runs: &[Value], modes: &[&str]) -> Value {
    let vals = |mode: &str, key: &str| -> Vec<f64> {
        runs.iter()
            .filter(|r| r["mode"] == mode)
            .map(|r| f(&r[key]))
            .collect()
    };
    let paired = |a: &str, b: &str, key: &str| -> Option<Estimate> {
        let by_rep = |m: &str| -> Map<String, Value> {
            runs.iter()
                .filter(|r| r["mode"] == m)
                .map(|r| (r["rep"].to_string(), r[key].clone()))
                .collect()
        };
        let (ma, mb) = (by_rep(a), by_rep(b));
        let pairs: Vec<(f64, f64)> = ma
            .iter()
            .filter_map(|(rep, x)| Some((f(x), f(mb.get(rep)?))))
            .collect();
        stats::paired_ratio(&pairs)
    };
    let mut per_mode = Map::new();
    for &m in modes {
        let v = vals(m, "value");
        let o = vals(m, "others_cpu_per_s");
        let mut e = json!({
            "value_runs": v,
            "value_median": stats::median(&v),
            "value_worst": v.iter().copied().reduce(f64::min),
            "others_cpu_per_s_median": stats::median(&o),
            "guest_share_median": stats::median(&vals(m, "guest_share")),
            "hog_units_per_s_median": stats::median(&vals(m, "hog_units_per_s")),
        });
        for base in ["vanilla", "pinned", "host_oracle", "governor"] {
            if m == base || !modes.contains(&base) {
                continue;
            }
            e[format!("vs_{base}")] = est(stats::ratio_of_medians(&v, &vals(base, "value")));
            e[format!("paired_vs_{base}")] = est(paired(m, base, "value"));
            e[format!("others_vs_{base}")] =
                est(stats::ratio_of_medians(&o, &vals(base, "others_cpu_per_s")));
        }
        per_mode.insert(m.to_string(), e);
    }
    json!({ "modes": per_mode })
}

fn print_table(cells: &Map<String, Value>, modes: &[&str], work: Work) {
    println!(
        "\nhost scheduler in the loop: guest {} ({}, median), ratio of medians to vanilla [95% \
         bootstrap], paired ratio, the other VMs' CPU time against vanilla",
        work.name(),
        work.metric()
    );
    println!(
        "{:<9} {:<10} {:>9} {:>20} {:>20} {:>20}",
        "cell",
        "mode",
        work.metric(),
        "vs vanilla",
        "paired",
        "others vs vanilla"
    );
    for (cell, c) in cells {
        for &m in modes {
            let e = &c["modes"][m];
            println!(
                "{:<9} {:<10} {:>9.0} {:>20} {:>20} {:>20}",
                cell,
                m,
                f(&e["value_median"]),
                fmt_est(&e["vs_vanilla"]),
                fmt_est(&e["paired_vs_vanilla"]),
                fmt_est(&e["others_vs_vanilla"]),
            );
        }
    }
}

fn main() -> Result<()> {
    if !require_root("host-scheduler-in-the-loop benchmark") {
        return Ok(());
    }
    let s = parse_args()?;
    anyhow::ensure!(ncpus() >= 2, "the host benchmark needs at least 2 CPUs");
    std::fs::create_dir_all(&s.out).with_context(|| format!("creating {}", s.out.display()))?;
    let file = s.out.join("host-data.bin");
    // The reader's file, or the applications' data, and the CPU the disk completes on.
    let data = match s.work {
        Work::Reads => {
            workload::prepare_file(&file, FILE_SIZE)?;
            let map = CompletionMap::for_file(&file)?;
            Data {
                file,
                apps: None,
                completion: *map
                    .cpus()
                    .first()
                    .context("no completion CPU for the file")?,
            }
        }
        Work::App(app) => {
            let apps = Apps::new();
            apps.prepare(app)
                .with_context(|| format!("preparing {}", app.name()))?;
            let map = CompletionMap::for_file(&apps.dir)?;
            Data {
                file,
                completion: *map
                    .cpus()
                    .first()
                    .context("no completion CPU for the data")?,
                apps: Some(apps),
            }
        }
    };
    let completion = data.completion;
    let modes = s.modes.clone();
    let per_run = s.warmup.as_secs_f64() + s.io_warmup.as_secs_f64() + s.secs + 1.5;
    eprintln!(
        "host benchmark, {}: {} cells × {} modes × {} reps, ~{:.0} min (more for applications); \
         completion CPU {completion}",
        s.work.name(),
        s.cells.len(),
        modes.len(),
        s.reps,
        (s.cells.len() * modes.len() * s.reps) as f64 * per_run / 60.0
    );
    let tag = std::process::id().to_string();
    let mut raw = Vec::new();
    let mut cells = Map::new();
    for &(policy, k) in &s.cells {
        let name = format!("{policy}:{k}");
        let mut runs = Vec::new();
        if let (Work::App(app), Some(apps)) = (s.work, &data.apps) {
            apps.settle_storage(app)
                .with_context(|| format!("settling {}'s storage", app.name()))?;
        }
        for rep in 0..s.reps {
            for i in 0..modes.len() {
                let mode = modes[(i + rep) % modes.len()];
                let mut v = run_once(policy, k, mode, &data, &s, &tag)
                    .with_context(|| format!("{name} rep {rep} {mode}"))?;
                v["cell"] = json!(name);
                v["rep"] = json!(rep);
                v["order"] = json!(i);
                eprintln!(
                    "{name:<9} rep {rep} {mode:<9} {:>8.0} {}  others {:.3} CPU/s  guest share {:.3}{}",
                    f(&v["value"]),
                    s.work.metric(),
                    f(&v["others_cpu_per_s"]),
                    f(&v["guest_share"]),
                    match &v["governor"]["decisions"] {
                        Value::Array(d) => format!(
                            "  preferred {:?}",
                            d.last().map(|x| x["preferred"].clone()).unwrap_or_default()
                        ),
                        _ => String::new(),
                    }
                );
                runs.push(v);
            }
        }
        cells.insert(name, summarise(&runs, &modes));
        raw.extend(runs);
    }
    let report = vmigrater_testbed::report::with_provenance(json!({
        "benchmark": "host",
        "setup": {
            "cpus": ncpus(),
            "host": "bpf/hostmodel.bpf.c: per CPU our vCPU and k - 1 other VMs' vCPUs, decided online by the policy; a halted vCPU gives its CPU away, its interrupt wakes it",
            "accounting": "the out time is charged to the guest task interrupted (no steal accounting in this kernel)",
            "steal_for_governor": "the model's per-vCPU out time (entities[cpu][0].wait_ns), not /proc/stat, which does not see the model",
            "governor_scope": "the workload's threads (the reader and the pinned hogs), not every task of the machine",
            "duty": s.duty,
            "fair_slice_ns": s.fair_slice.map(|d| d.as_nanos() as u64),
            "workload": s.work.name(),
            "metric": s.work.metric(),
            "workload_desc": match s.work {
                Work::Reads => "one 4 KiB random O_DIRECT reader (QD1) and a CPU hog pinned on every CPU".to_string(),
                Work::App(app) => format!("{} started cold (page cache dropped, memory bounded by a cgroup), measured from its first request, and a CPU hog pinned on every CPU", app.name()),
            },
            "file": match &data.apps { Some(a) => a.dir.display().to_string(), None => data.file.display().to_string() },
            "completion_cpu": completion,
            "reps": s.reps,
            "seconds_per_run": s.secs,
            "daemon_warmup_s": s.warmup.as_secs_f64(),
            "io_warmup_ms": s.io_warmup.as_millis() as u64,
            "agent_period_ms": AGENT_PERIOD_MS,
            "modes": modes,
            "bootstrap": {"resamples": stats::RESAMPLES, "seed": stats::SEED, "interval": "95% percentile"},
        },
        "cells": cells,
        "runs": raw,
    }));
    let path = s.out.join(match s.work {
        Work::Reads => "host.json".to_string(),
        Work::App(app) => format!("host-{}.json", app.name()),
    });
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
    print_table(&cells, &modes, s.work);
    println!("\nwrote {}", path.display());
    Ok(())
}
