//! `vmigrater-lab`: boots a lab VM by hand (`shell`) and runs the benefit benchmark
//! (`bench`, see `make bench-lab`).

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lab::bench::{self, Mode, Options, Scenario};
use lab::image::{self, Contents, Kernel};
use lab::summary;
use lab::vm::{Vm, VmSpec};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Parser)]
#[command(about = "The nested-VM lab of vmigrater (needs root, QEMU and make lab-setup)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Boots a 2-vCPU VM with the binaries of BIN_DIR and runs each COMMAND in it.
    Shell {
        bin_dir: PathBuf,
        commands: Vec<String>,
    },
    /// Installs the .deb in a Debian guest booting systemd and checks the service end to end.
    InstallTest {
        /// Where `make package` put the packages.
        #[arg(long, default_value = "target/package")]
        packages: PathBuf,
    },
    /// The benefit benchmark: every scenario and mode, JSON to --out.
    Bench {
        /// Where vmigrater, vmigrater-oracle (the lab's daemon, mode vmigrater_oracle),
        /// vmigrater-workload and vmigrater-hv-agent are (release builds).
        #[arg(long, default_value = "target/release")]
        bin_dir: PathBuf,
        /// The guest daemon of every mode but vmigrater_oracle, instead of BIN_DIR's
        /// vmigrater.
        #[arg(long)]
        daemon: Option<PathBuf>,
        /// Length of each run's workload, seconds.
        #[arg(long, default_value_t = 20)]
        secs: u64,
        /// Repetitions of every mode.
        #[arg(long, default_value_t = 3)]
        reps: u32,
        /// Seconds of VM A's workload run before the measured one, with the programs
        /// already started (0: they start with the measured workload, cold). A daemon
        /// lives for days: a warm run measures it after its first verdicts, not its start.
        #[arg(long, default_value_t = 0)]
        warmup_secs: u64,
        /// Only these scenarios (comma-separated names: steal, steal_inphase, mq_anti, main, four, quad, sweep1, sweep4, free).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Only these modes (comma-separated: no_sharing, vanilla, vmigrater, vmigrater_dry, agent, both, vmigrater_oracle, pinned_vcpu0).
        #[arg(long, value_delimiter = ',')]
        modes: Vec<String>,
        /// The guest daemon's configuration file (default: the lab's, testbeds/lab/guest/vmigrater.toml).
        #[arg(long)]
        guest_config: Option<PathBuf>,
        /// An extra daemon mode NAME run with the configuration FILE (repeatable): for
        /// ablations, interleaved with the scenario's modes.
        #[arg(long, value_name = "NAME=FILE")]
        variant: Vec<String>,
        /// An extra host-agent mode NAME whose agent configuration starts with the
        /// top-level keys of FILE (repeatable; no guest daemon): agent ablations.
        #[arg(long, value_name = "NAME=FILE")]
        agent_variant: Vec<String>,
        /// An extra mode NAME of both programs, the guest daemon with the configuration
        /// FILE (repeatable): `both` ablations.
        #[arg(long, value_name = "NAME=FILE")]
        both_variant: Vec<String>,
        /// The variant mode NAME (of --variant or --both-variant) runs the daemon binary
        /// PATH instead of BIN_DIR's (repeatable): two builds compared interleaved.
        #[arg(long, value_name = "NAME=PATH")]
        daemon_bin: Vec<String>,
        #[arg(long, default_value = "target/bench/lab.json")]
        out: PathBuf,
    },
    /// Both programs together for a long time in the main scenario, memory and file
    /// descriptors sampled, faults injected on a cycle (agent SIGKILL, agent restart,
    /// virtio port hot-unplug); exits non-zero if anything was not as it must be.
    Soak {
        #[arg(long, default_value = "target/release")]
        bin_dir: PathBuf,
        /// Length of the soak, minutes.
        #[arg(long, default_value_t = 60.0)]
        minutes: f64,
        /// Between two samples, seconds.
        #[arg(long, default_value_t = 30)]
        sample_secs: u64,
        /// Between two faults, seconds (0: none).
        #[arg(long, default_value_t = 300)]
        fault_secs: u64,
        #[arg(long, default_value = "target/bench/soak.json")]
        out: PathBuf,
    },
}

fn main() {
    if let Err(e) = run() {
        eprintln!("vmigrater-lab: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Soak {
            bin_dir,
            minutes,
            sample_secs,
            fault_secs,
            out,
        } => {
            anyhow::ensure!(
                minutes.is_finite() && minutes > 0.0,
                "--minutes {minutes}: must be positive"
            );
            let opts = lab::soak::SoakOptions {
                name: "soak",
                bin_dir,
                duration: Duration::from_secs_f64(minutes * 60.0),
                sample_every: Duration::from_secs(sample_secs.max(1)),
                fault_every: Duration::from_secs(fault_secs),
            };
            let _peers = bench::AutogroupOff::new()?;
            let doc = lab::soak::soak(&opts, LAB_GUEST_CONFIG)?;
            if let Some(d) = out.parent() {
                std::fs::create_dir_all(d)?;
            }
            std::fs::write(&out, serde_json::to_string_pretty(&doc)? + "\n")
                .with_context(|| format!("writing {}", out.display()))?;
            eprintln!("soak: verdict {}", doc["verdict"]);
            eprintln!("soak: wrote {}", out.display());
            let failures = doc["verdict"]["failures"].as_array().map_or(0, Vec::len);
            anyhow::ensure!(
                failures == 0,
                "the soak failed: {}",
                doc["verdict"]["failures"]
            );
            Ok(())
        }
        Cmd::Shell { bin_dir, commands } => shell(bin_dir, &commands),
        Cmd::InstallTest { packages } => lab::install::install_test(&packages),
        Cmd::Bench {
            bin_dir,
            daemon,
            secs,
            reps,
            warmup_secs,
            only,
            modes,
            guest_config,
            variant,
            agent_variant,
            both_variant,
            daemon_bin,
            out,
        } => {
            let variants = named_files("--variant", &variant)?;
            let agent_variants = named_files("--agent-variant", &agent_variant)?;
            let both_variants = named_files("--both-variant", &both_variant)?;
            let mut daemon_bins = Vec::new();
            for v in &daemon_bin {
                let (name, path) = v
                    .split_once('=')
                    .with_context(|| format!("--daemon-bin {v:?}: expected NAME=PATH"))?;
                let Some(&(name, _)) = variants
                    .iter()
                    .chain(both_variants.iter())
                    .find(|(n, _)| *n == name)
                else {
                    anyhow::bail!(
                        "--daemon-bin {name}: no --variant or --both-variant of that name"
                    );
                };
                anyhow::ensure!(
                    Path::new(path).is_file(),
                    "--daemon-bin {name}: {path} is not a file"
                );
                daemon_bins.push((name, PathBuf::from(path)));
            }
            let guest_config = match guest_config {
                Some(p) => std::fs::read_to_string(&p)
                    .with_context(|| format!("--guest-config {}", p.display()))?,
                None => LAB_GUEST_CONFIG.to_string(),
            };
            let opts = Options {
                bin_dir,
                daemon,
                secs,
                reps,
                warmup_secs,
                guest_config: Some(guest_config),
                modes,
                variants,
                agent_variants,
                both_variants,
                daemon_bins,
            };
            bench_all(opts, &only, &out)
        }
    }
}

use lab::GUEST_CONFIG as LAB_GUEST_CONFIG;

/// `NAME=FILE` arguments of `flag` as (name, file text).
fn named_files(flag: &str, args: &[String]) -> Result<Vec<(&'static str, String)>> {
    let mut out = Vec::new();
    for v in args {
        let (name, file) = v
            .split_once('=')
            .with_context(|| format!("{flag} {v:?}: expected NAME=FILE"))?;
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("{flag} {name}: reading {file}"))?;
        // A mode name lives as long as the benchmark: leaked once per variant.
        out.push((&*Box::leak(name.to_string().into_boxed_str()), text));
    }
    Ok(out)
}

fn scenarios() -> Vec<Scenario> {
    use Mode::*;
    vec![
        Scenario {
            name: "steal",
            what: "VM A 2 vCPUs; the host takes each CPU 11 ms of every 22 (SCHED_FIFO spinner, a quarter period apart: both vCPUs out a quarter of the time)",
            a_vcpus: 2,
            hog_vms: 0,
            hog_vcpus: 2,
            host_steal: &["0:11000:11000:0", "1:11000:11000:5500"],
            pinned: true,
            modes: vec![Vanilla, Vmigrater, VmigraterDry, VmigraterOracle],
        },
        Scenario {
            name: "steal_inphase",
            what: "VM A 2 vCPUs; the host takes both CPUs at once, 11 ms of every 22 (nothing to gain)",
            a_vcpus: 2,
            hog_vms: 0,
            hog_vcpus: 2,
            host_steal: &["0:11000:11000:0", "1:11000:11000:0"],
            pinned: true,
            modes: vec![Vanilla, Vmigrater, VmigraterOracle],
        },
        Scenario {
            name: "mq_anti",
            what: "VM A 2 vCPUs, a virtio-blk queue per vCPU; the host takes each CPU 11 ms of every 22 in anti-phase (SCHED_FIFO spinner): one vCPU runs at any time, and a request completes on the vCPU that submitted it",
            a_vcpus: 2,
            hog_vms: 0,
            hog_vcpus: 2,
            host_steal: &["0:11000:11000:0", "1:11000:11000:11000"],
            pinned: true,
            modes: vec![Vanilla, PinnedVcpu0, VmigraterOracle, Vmigrater],
        },
        Scenario {
            name: "main",
            what: "VM A 2 vCPUs + hog VM B 2 vCPUs on 2 host CPUs (2 vCPUs per CPU)",
            a_vcpus: 2,
            hog_vms: 1,
            hog_vcpus: 2,
            host_steal: &[],
            pinned: true,
            modes: vec![NoSharing, Vanilla, Vmigrater, VmigraterDry, Agent, Both],
        },
        Scenario {
            name: "four",
            what: "VM A 4 vCPUs + hog VM B 4 vCPUs on 2 host CPUs (4 vCPUs per CPU, like the paper's many-vCPU VMs)",
            a_vcpus: 4,
            hog_vms: 1,
            hog_vcpus: 4,
            host_steal: &[],
            pinned: true,
            modes: vec![Vanilla, Vmigrater, VmigraterDry, Agent, Both],
        },
        Scenario {
            name: "quad",
            what: "VM A 4 vCPUs alone on 2 host CPUs (its own vCPUs share them)",
            a_vcpus: 4,
            hog_vms: 0,
            hog_vcpus: 2,
            host_steal: &[],
            pinned: true,
            modes: vec![Vanilla, Vmigrater, Agent, Both],
        },
        Scenario {
            name: "sweep1",
            what: "VM A 2 vCPUs alone on 2 host CPUs (1 vCPU per CPU)",
            a_vcpus: 2,
            hog_vms: 0,
            hog_vcpus: 2,
            host_steal: &[],
            pinned: true,
            modes: vec![Vanilla, Vmigrater, VmigraterDry, Agent, Both],
        },
        Scenario {
            name: "sweep4",
            what: "VM A 2 vCPUs + 3 hog VMs of 2 vCPUs on 2 host CPUs (4 vCPUs per CPU)",
            a_vcpus: 2,
            hog_vms: 3,
            hog_vcpus: 2,
            host_steal: &[],
            pinned: true,
            modes: vec![Vanilla, Vmigrater, Agent, Both],
        },
        Scenario {
            name: "free",
            what: "VM A 2 vCPUs + hog VM B 2 vCPUs on 2 host CPUs, no vCPU thread pinned (the host balances them; the agent's Algorithm 2 may place I/O vCPUs)",
            a_vcpus: 2,
            hog_vms: 1,
            hog_vcpus: 2,
            host_steal: &[],
            pinned: false,
            modes: vec![Vanilla, Agent, Both],
        },
    ]
}

fn bench_all(opts: Options, only: &[String], out: &PathBuf) -> Result<()> {
    let _peers = bench::AutogroupOff::new()?;
    let mut results = Vec::new();
    for sc in scenarios() {
        if !only.is_empty() && !only.iter().any(|o| o == sc.name) {
            continue;
        }
        let runs = bench::run_scenario(&sc, &opts)?;
        let summary = summary::summarize(&runs);
        for s in &summary {
            eprintln!(
                "bench-lab: {} {:<10} 4k {:7.1} IOPS (speedup {}, vs alone {})  seq {:6.2} MB/s ({})  hogB {:.3} of vanilla  B cpu {:.3}  clean {}/{}",
                sc.name,
                s.mode,
                s.iops_4k,
                fmt(s.iops_speedup),
                fmt(s.iops_vs_no_sharing),
                s.seq_mbps,
                fmt(s.seq_speedup),
                s.hog_b_vs_vanilla.unwrap_or(f64::NAN),
                s.b_cpu_share,
                s.clean_runs,
                s.runs
            );
        }
        results.push(json!({
            "name": sc.name,
            "what": sc.what,
            "vcpus_per_host_cpu": sc.consolidation(),
            // The hog VMs' fair share of the host CPUs: their vCPUs among all, as peers.
            "b_fair_share": (sc.hog_vcpus as usize * sc.hog_vms) as f64 / (sc.a_vcpus as usize + sc.hog_vcpus as usize * sc.hog_vms) as f64,
            "summary": summary,
            "runs": runs,
        }));
        // Written after every scenario: a cut-off run keeps what it measured.
        write(out, &opts, &results)?;
    }
    eprintln!("bench-lab: wrote {}", out.display());
    Ok(())
}

fn fmt(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.2}x"))
}

fn write(out: &PathBuf, opts: &Options, results: &[serde_json::Value]) -> Result<()> {
    // The consolidation sweep: vanilla vs the cures at 1, 2 and 4 vCPUs per host CPU (2
    // comes from the main scenario).
    let mut sweep = Vec::new();
    for name in ["sweep1", "main", "sweep4"] {
        if let Some(r) = results.iter().find(|r| r["name"] == name) {
            let modes = r["summary"].as_array().cloned().unwrap_or_default();
            let get = |m: &str, k: &str| {
                modes
                    .iter()
                    .find(|s| s["mode"] == m)
                    .map_or(serde_json::Value::Null, |s| s[k].clone())
            };
            sweep.push(json!({
                "vcpus_per_host_cpu": r["vcpus_per_host_cpu"],
                "vanilla_iops_4k": get("vanilla", "iops_4k"),
                "vmigrater_iops_4k": get("vmigrater", "iops_4k"),
                "both_iops_4k": get("both", "iops_4k"),
                "vmigrater_speedup": get("vmigrater", "iops_speedup"),
                "both_speedup": get("both", "iops_speedup"),
            }));
        }
    }
    let doc = json!({
        "bench": "lab",
        "host": {
            "cpus_used": bench::HOST_CPUS,
            "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
            "guest_kernel": Kernel::find(&image::lab_dir()).map(|k| k.release).unwrap_or_default(),
            "accel": "tcg,thread=multi",
        },
        "params": {
            "secs_per_run": opts.secs,
            "warmup_secs": opts.warmup_secs,
            "reps": opts.reps,
            "host_slice_ms": bench::HOST_SLICE_NS as f64 / 1e6,
            "vcpu_scheduling": "every vCPU thread a peer (autogroups off), vCPU i pinned to host CPU i mod 2",
            "noise_limit": summary::NOISE_LIMIT,
            "workload_a": "1 random 4 KiB O_DIRECT reader + 1 sequential 1 MiB reader of /dev/vda + 1 CPU hog per vCPU",
            "workload_hog_vms": "1 CPU hog per vCPU",
            "guest_config": opts.guest_config,
            "variants": opts.variants.iter().chain(opts.both_variants.iter()).chain(opts.agent_variants.iter())
                .map(|(n, c)| (n.to_string(), json!(c))).collect::<serde_json::Map<_, _>>(),
            "daemon_bins": opts.daemon_bins.iter()
                .map(|(n, p)| (n.to_string(), json!(p.display().to_string()))).collect::<serde_json::Map<_, _>>(),
        },
        "paper": {
            "vmigrater_speedup_2_vms": 1.72,
            "vmigrater_speedup_8_vms": 4.42,
            "source": "vMigrater, ch. 2 of the dissertation: I/O throughput speedup over vanilla, 2 to 8 VMs per host CPU",
        },
        "scenarios": results,
        "sweep": sweep,
    });
    if let Some(d) = out.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", out.display()))
}

fn shell(bins: PathBuf, commands: &[String]) -> Result<()> {
    let lab = image::lab_dir();
    let kernel = Kernel::find(&lab)?;
    let dir = lab.join("run/shell");
    std::fs::create_dir_all(&dir)?;
    let mut binaries: Vec<_> = ["vmigrater", "vmigrater-workload"]
        .iter()
        .map(|b| (bins.join(b), b.to_string()))
        .collect();
    // For looking inside the guest's BPF (`bpftool prog show` with kernel.bpf_stats_enabled).
    let bpftool = std::path::Path::new("/usr/sbin/bpftool");
    if bpftool.exists() {
        binaries.push((bpftool.to_path_buf(), "bpftool".into()));
    }
    let contents = Contents {
        binaries,
        files: vec![],
    };
    let img = image::build(&kernel, &contents, &dir.join("initrd.cpio"))?;
    let disk = lab.join("disk-64m.img");
    lab::host::make_disk(&disk, 64)?;
    let spec = VmSpec {
        name: "shell".into(),
        vcpus: 2,
        mem_mb: 512,
        disk,
        kernel_args: String::new(),
    };
    let t0 = std::time::Instant::now();
    let mut vm = Vm::boot(&spec, &img, &dir, Duration::from_secs(120))?;
    eprintln!(
        "ready after {:?}; vCPU threads {:?}",
        t0.elapsed(),
        vm.vcpu_threads()?
    );
    for c in commands {
        let (rc, out) = vm.sh_rc(c, Duration::from_secs(300))?;
        println!("$ {c}\n{out}[exit {rc}]");
    }
    vm.stop();
    Ok(())
}
