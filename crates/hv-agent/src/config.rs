//! Agent configuration (`/etc/vmigrater/hv-agent.toml`): every key has a default; unknown
//! keys are errors naming the line. Owns parsing and validation only.

use anyhow::Result;
use control::{in_range, Invalid};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub const DEFAULT_CONFIG_PATH: &str = "/etc/vmigrater/hv-agent.toml";
pub const DEFAULT_STATE_DIR: &str = "/run/vmigrater-hv-agent";
pub const DEFAULT_MODEL_DIR: &str = "/sys/fs/bpf/vmigrater-host-model";
/// bpf/hostmodel.h `HM_MAX_SLOTS`: entities per modelled CPU, so `model_slot`s 0..8.
pub const MODEL_SLOTS: u32 = 8;

/// Where the agent serves its status: here, so that the config can check that the path
/// fits a socket address without depending on the status it describes.
pub fn status_socket(state_dir: &Path) -> PathBuf {
    state_dir.join("status.sock")
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Credit period.
    pub period_ms: u64,
    /// `kvm-qemu`, `xen`, `model` or `dry-run`.
    pub backend: BackendKind,
    /// Sustained per-guest rate limit: one report per this interval, bursts of 128 tolerated.
    pub min_report_interval_ms: u64,
    /// Nice range the agent's weights may use (0 = never change weights).
    pub max_nice_delta: i32,
    /// How shares move: `vm-funded` (the vCPUs carrying a VM's I/O get weight from the
    /// same VM's other vCPUs) or `isacs` (the paper's CPU-BOOST compensation).
    pub share: ShareRule,
    /// Weight steps (nice) a vCPU carrying I/O gets under `vm-funded` (never more than
    /// `max_nice_delta`).
    pub io_boost_nice: i32,
    /// How a vCPU thread's share is changed: `nice` (setpriority-equivalent) or `cgroup`
    /// (`cpu.shares` on v1, `cpu.weight` on v2).
    pub weight: WeightKind,
    /// ISACS Algorithm 2: move I/O-intensive vCPU threads between the host CPUs their VM
    /// may use, restoring the original affinity when they stop doing I/O or at exit.
    pub balance_io: bool,
    /// For VMs without guest reports, infer I/O from the vCPU threads' wake-ups
    /// (`/proc/<tid>/status` voluntary switches) and run/wait time (`schedstat`).
    pub observe_schedstat: bool,
    /// Among those host-side figures, prefer device kicks (the vCPU thread's write system
    /// calls above its VM's quietest vCPU) to wake-ups where they single out a vCPU.
    pub observe_kicks: bool,
    /// Where the status socket lives.
    pub state_dir: PathBuf,
    /// Backend `model`: the bpffs directory where the hard-IRQ testbed pins its host
    /// scheduler model's maps (`control`, `entities`).
    pub model_dir: PathBuf,
    pub metrics: MetricsConfig,
    pub libvirt: LibvirtConfig,
    #[serde(rename = "vm")]
    pub vms: Vec<VmConfig>,
}

/// Which hypervisor scheduler the agent drives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// QEMU vCPU threads on the host kernel (nice or cgroup weight, affinity).
    #[default]
    KvmQemu,
    /// Xen credit2 weights through `xl`.
    Xen,
    /// The hard-IRQ testbed's BPF host scheduler model: weights and boosts in its pinned
    /// `control` map, modelled vCPUs observed in its `entities` map.
    Model,
    /// Plans and logs, changes nothing.
    DryRun,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::KvmQemu => "kvm-qemu",
            BackendKind::Xen => "xen",
            BackendKind::Model => "model",
            BackendKind::DryRun => "dry-run",
        })
    }
}

/// How the `kvm-qemu` backend changes a vCPU thread's CPU share.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightKind {
    #[default]
    Nice,
    Cgroup,
}

impl std::fmt::Display for WeightKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightKind::Nice => "nice",
            WeightKind::Cgroup => "cgroup",
        })
    }
}

/// How the agent moves CPU share between vCPU threads (see `weights`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ShareRule {
    /// Within each VM: its I/O-carrying vCPUs gain what its other vCPUs give up.
    VmFunded,
    /// ISACS Eq. 4: CVCredit weights for the CPU-BOOST group, paid by I/O vCPUs.
    Isacs,
}

impl std::fmt::Display for ShareRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShareRule::VmFunded => "vm-funded",
            ShareRule::Isacs => "isacs",
        })
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    pub enabled: bool,
    pub listen: SocketAddr,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            enabled: true,
            listen: "127.0.0.1:9978".parse().expect("static address"),
        }
    }
}

/// VMs started by libvirt announce themselves: a channel socket named after our port in
/// `channel_dir/domain-<id>-<name>/`, and the QEMU pid in `pid_dir/<name>.pid`. With
/// `containers`, VMs whose libvirt runs in a container (KubeVirt's virt-launcher pods) are
/// found from their QEMU processes instead (discovery.rs).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LibvirtConfig {
    pub enabled: bool,
    pub channel_dir: PathBuf,
    pub pid_dir: PathBuf,
    pub containers: bool,
}

impl Default for LibvirtConfig {
    fn default() -> Self {
        LibvirtConfig {
            enabled: true,
            channel_dir: "/var/lib/libvirt/qemu/channel/target".into(),
            pid_dir: "/run/libvirt/qemu".into(),
            containers: false,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            period_ms: 100,
            backend: BackendKind::KvmQemu,
            min_report_interval_ms: 20,
            max_nice_delta: 3,
            share: ShareRule::VmFunded,
            io_boost_nice: 2,
            weight: WeightKind::Nice,
            balance_io: true,
            observe_schedstat: true,
            observe_kicks: true,
            state_dir: DEFAULT_STATE_DIR.into(),
            model_dir: DEFAULT_MODEL_DIR.into(),
            metrics: MetricsConfig::default(),
            libvirt: LibvirtConfig::default(),
            vms: Vec::new(),
        }
    }
}

impl Config {
    /// The configuration file the packages ship (`vmigrater-hv-agent default-config`):
    /// every key commented out under a line saying what it does, so that the defaults
    /// live in the program and a new release's reach every host whose file sets nothing.
    pub fn default_toml() -> String {
        let dump = toml::to_string_pretty(&Config::default()).expect("defaults serialise");
        let body = control::conffile::commented_defaults(
            &dump,
            KEY_DOCS,
            SECTION_DOCS,
            |_| false,
            &["vm"],
        );
        format!("{CONFFILE_HEAD}{body}{CONFFILE_VMS}")
    }
}

const CONFFILE_HEAD: &str = "\
# vmigrater-hv-agent: the host agent's configuration (/etc/vmigrater/hv-agent.toml).
# Every key is optional: each is shown with its default and commented out, and the
# default lives in the program, so a new release's defaults apply wherever this file
# sets nothing. Uncomment a key to set it; `systemctl reload vmigrater-hv-agent` takes
# up share, max_nice_delta, io_boost_nice, observe_schedstat and observe_kicks, anything
# else needs a restart. An unknown key is an error naming its line.
# `vmigrater-hv-agent default-config` prints this.

";

const CONFFILE_VMS: &str = "
# VMs the agent follows besides those libvirt announces, e.g.:
#[[vm]]
#name = \"db1\"
#hint_socket = \"/run/vmigrater/db1.hint.sock\"
#qmp_socket = \"/run/vmigrater/db1.qmp.sock\"
";

/// The comment over each section of the shipped file.
const SECTION_DOCS: &[(&str, &str)] = &[
    (
        "metrics",
        "Prometheus metrics (OpenMetrics text at /metrics).",
    ),
    (
        "libvirt",
        "VMs that libvirt starts with our channel (org.vmigrater.hint.0) are found on their own.",
    ),
];

/// The comment line(s) over each key of the shipped file; every key has one
/// (`the_shipped_file_sets_nothing_and_documents_every_key`).
const KEY_DOCS: &[(&str, &str)] = &[
    ("period_ms", "Credit period: how often the agent reads the guests and sets weights."),
    ("backend", "How weights reach the hypervisor: \"kvm-qemu\" (the vCPU threads' nice or cgroup\nweight), \"xen\" (credit2 weights), \"model\" (the testbed) or \"dry-run\"."),
    ("min_report_interval_ms", "Sustained per-guest report rate limit (bursts of 128 tolerated)."),
    ("max_nice_delta", "Nice range the weights may use; 0 never changes a weight."),
    ("share", "\"vm-funded\": a vCPU carrying its VM's I/O gets weight paid by the same VM's\nother vCPUs; \"isacs\": the paper's CPU-BOOST compensation."),
    ("io_boost_nice", "Weight steps (nice) a vCPU carrying I/O gets under vm-funded; 0 turns the\nexchange off."),
    ("weight", "\"nice\" or \"cgroup\" (cpu.shares on v1, cpu.weight on v2)."),
    ("balance_io", "ISACS Algorithm 2: move I/O-intensive vCPU threads between a VM's host_cpus."),
    ("observe_schedstat", "For VMs without reports, infer I/O from the vCPU threads' wake-ups and run time."),
    ("observe_kicks", "Prefer device kicks (the vCPU thread's write calls) to wake-ups where they\nsingle out a vCPU."),
    ("state_dir", "Where the journal of original settings and the status socket live."),
    ("model_dir", "Backend \"model\": the bpffs directory of the testbed's host model maps."),
    ("metrics.enabled", "Serve metrics."),
    ("metrics.listen", "Address of the metrics endpoint (localhost only by default)."),
    ("libvirt.enabled", "Find libvirt's VMs."),
    ("libvirt.channel_dir", "Where libvirt puts its VMs' channel sockets."),
    ("libvirt.pid_dir", "Where libvirt puts its QEMU pid files."),
    ("libvirt.containers", "Also find VMs whose libvirt runs in a container (KubeVirt's virt-launcher\npods) from their QEMU processes."),
];

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    pub name: String,
    /// Host end of the guest's `org.vmigrater.hint.0` port (QEMU chardev unix socket).
    pub hint_socket: Option<PathBuf>,
    /// QMP socket, to find the vCPU threads.
    pub qmp_socket: Option<PathBuf>,
    /// QEMU's pid file: vCPU threads are the ones QEMU names `CPU <n>/KVM` (or `/TCG`)
    /// when started with `-name ...,debug-threads=on` (libvirt always does).
    pub pid_file: Option<PathBuf>,
    /// vCPU thread ids, in vCPU order, when there is no QMP (tests, other VMMs).
    #[serde(default)]
    pub vcpu_threads: Vec<u32>,
    /// Host CPUs Algorithm 2 may place this VM's vCPU threads on (empty: each thread's
    /// own affinity when the agent first saw it).
    #[serde(default)]
    pub host_cpus: Vec<usize>,
    /// Xen domain name or id (xen backend).
    pub domain: Option<String>,
    /// This VM is the testbed model's slot S on every modelled CPU, its vCPU n on CPU n
    /// (only with backend `model`; slot 0 is the testbed's own guest).
    pub model_slot: Option<u32>,
    /// The host pid of a QEMU found under /proc (`libvirt.containers`), whose pid file, if
    /// any, lives in a namespace of its own.
    #[serde(skip)]
    pub pid: Option<u32>,
}

impl Config {
    pub fn parse(text: &str, origin: &str) -> Result<Config> {
        control::parse_checked(text, origin, Config::validate)
    }

    pub fn load(path: &Path, explicit: bool) -> Result<Config> {
        control::load_config(path, explicit, Config::parse)
    }

    /// Every key's range, documented in the README's configuration table.
    fn validate(&self) -> std::result::Result<(), Invalid> {
        in_range("period_ms", self.period_ms, 10, 60_000)?;
        in_range(
            "min_report_interval_ms",
            self.min_report_interval_ms,
            0,
            60_000,
        )?;
        in_range("max_nice_delta", self.max_nice_delta, 0, 19)?;
        in_range("io_boost_nice", self.io_boost_nice, 0, 19)?;
        control::socket_path_fits("state_dir", &status_socket(&self.state_dir))?;
        let mut names = std::collections::HashSet::new();
        let mut slots = std::collections::HashMap::new();
        for vm in &self.vms {
            if !names.insert(&vm.name) {
                return Err(Invalid::new(
                    "vm",
                    format!("vm {:?} is configured twice", vm.name),
                ));
            }
            self.validate_model_slot(vm, &mut slots)?;
            if vm.qmp_socket.is_none()
                && vm.pid_file.is_none()
                && vm.vcpu_threads.is_empty()
                && vm.domain.is_none()
                && vm.model_slot.is_none()
            {
                return Err(Invalid::new(
                    "vm",
                    format!(
                        "vm {:?}: give qmp_socket, pid_file, vcpu_threads, domain or model_slot",
                        vm.name
                    ),
                ));
            }
            for (key, path) in [
                ("vm.hint_socket", &vm.hint_socket),
                ("vm.qmp_socket", &vm.qmp_socket),
            ] {
                if let Some(p) = path {
                    control::socket_path_fits(key, p).map_err(|e| {
                        Invalid::new(key, format!("vm {:?}: {}", vm.name, e.message))
                    })?;
                }
            }
            // SAFETY: sysconf has no memory arguments.
            let max = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) }.max(1) as usize;
            if let Some(c) = vm.host_cpus.iter().find(|&&c| c >= max) {
                return Err(Invalid::new(
                    "vm.host_cpus",
                    format!(
                        "vm {:?}: host_cpus has CPU {c}, but this host has CPUs 0..{}",
                        vm.name,
                        max - 1
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A modelled VM's vCPUs are the model's entities, found by slot: nothing else may
    /// name them, and no two VMs may claim the same ones.
    fn validate_model_slot<'a>(
        &self,
        vm: &'a VmConfig,
        slots: &mut std::collections::HashMap<u32, &'a str>,
    ) -> std::result::Result<(), Invalid> {
        const KEY: &str = "vm.model_slot";
        let Some(slot) = vm.model_slot else {
            return Ok(());
        };
        let name = &vm.name;
        if self.backend != BackendKind::Model {
            return Err(Invalid::new(
                KEY,
                format!(
                    "vm {name:?}: model_slot needs backend = \"model\" (backend is {:?})",
                    self.backend.to_string()
                ),
            ));
        }
        if slot >= MODEL_SLOTS {
            return Err(Invalid::new(
                KEY,
                format!(
                    "vm {name:?}: model_slot = {slot} is outside 0..={}",
                    MODEL_SLOTS - 1
                ),
            ));
        }
        if let Some(other) = slots.insert(slot, name) {
            return Err(Invalid::new(
                KEY,
                format!("vm {name:?}: model_slot = {slot} is vm {other:?}'s already"),
            ));
        }
        let others = [
            ("vcpu_threads", !vm.vcpu_threads.is_empty()),
            ("qmp_socket", vm.qmp_socket.is_some()),
            ("pid_file", vm.pid_file.is_some()),
            ("host_cpus", !vm.host_cpus.is_empty()),
            ("domain", vm.domain.is_some()),
        ];
        if let Some((key, _)) = others.iter().find(|(_, given)| *given) {
            return Err(Invalid::new(
                KEY,
                format!(
                    "vm {name:?}: model_slot and {key} both given: a modelled VM's vCPUs are \
                     the model's entities (vCPU n on model CPU n), it has no threads"
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_file_sets_nothing_and_documents_every_key() {
        let text = Config::default_toml();
        let parsed: Config = toml::from_str(&text).unwrap();
        let dump = |c: &Config| toml::to_string_pretty(c).unwrap();
        assert_eq!(dump(&parsed), dump(&Config::default()));
        for line in text.lines() {
            let active = !line.is_empty() && !line.starts_with('#');
            assert!(
                !active || line.starts_with('['),
                "the shipped file sets {line:?}"
            );
        }
        let defaults = dump(&Config::default());
        assert!(
            control::conffile::undocumented(&defaults, KEY_DOCS, &["vm"]).is_empty(),
            "{:?}",
            control::conffile::undocumented(&defaults, KEY_DOCS, &["vm"])
        );
        // Uncommenting the example gives a VM that parses.
        let vm: String = CONFFILE_VMS
            .lines()
            .filter_map(|l| l.strip_prefix('#'))
            .filter(|l| !l.starts_with(' '))
            .map(|l| format!("{l}\n"))
            .collect();
        let with_vm: Config = toml::from_str(&vm).unwrap();
        assert_eq!(with_vm.vms[0].name, "db1");
    }

    #[test]
    fn defaults_and_a_vm() {
        let c = Config::parse(
            "[[vm]]\nname = \"a\"\nhint_socket = \"/run/a.sock\"\nvcpu_threads = [1, 2]\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.period_ms, 100);
        assert_eq!(c.vms[0].vcpu_threads, vec![1, 2]);
    }

    /// Every numeric key at both ends of its range and beyond: accepted inside, refused
    /// outside with the file, the line and the key.
    #[test]
    fn every_key_is_bounded_at_both_ends() {
        let cases: &[(&str, &str, &str, &[&str])] = &[
            (
                "period_ms",
                "10",
                "60000",
                &["9", "60001", "9223372036854775807"],
            ),
            (
                "min_report_interval_ms",
                "0",
                "60000",
                &["60001", "9223372036854775807"],
            ),
            ("max_nice_delta", "0", "19", &["-1", "20"]),
            ("io_boost_nice", "0", "19", &["-1", "20"]),
        ];
        for (key, lo, hi, refused) in cases {
            let text = |v: &str| format!("# c\n{key} = {v}\n");
            for v in [lo, hi] {
                if let Err(e) = Config::parse(&text(v), "a.toml") {
                    panic!("{key} = {v} refused: {e:#}");
                }
            }
            for v in *refused {
                let e = match Config::parse(&text(v), "a.toml") {
                    Ok(_) => panic!("{key} = {v} accepted"),
                    Err(e) => format!("{e:#}"),
                };
                assert!(e.starts_with("a.toml:2: "), "{e}");
                assert!(e.contains(key), "{e}");
            }
        }
    }

    /// The agent sets no EEVDF slices: a configuration that asks for one (`io_slice_us`) is
    /// refused like any unknown key, naming the line, rather than run without it unnoticed.
    #[test]
    fn the_removed_slice_key_is_refused_naming_the_line() {
        for value in ["0", "500"] {
            let e = format!(
                "{:#}",
                Config::parse(
                    &format!("period_ms = 100\nio_slice_us = {value}\n"),
                    "a.toml"
                )
                .unwrap_err()
            );
            assert!(
                e.starts_with("a.toml:2: unknown field `io_slice_us`"),
                "{e}"
            );
        }
    }

    #[test]
    fn modelled_vms_are_checked_naming_the_key() {
        let vm = |name: &str, extra: &str| format!("\n[[vm]]\nname = {name:?}\n{extra}");
        let ok = format!(
            "backend = \"model\"\nmodel_dir = \"/sys/fs/bpf/hm\"\n{}{}",
            vm("guest", "hint_socket = \"/run/g.sock\"\nmodel_slot = 0\n"),
            vm("other", "model_slot = 7\n")
        );
        let c = Config::parse(&ok, "t").unwrap();
        assert_eq!(c.backend, BackendKind::Model);
        assert_eq!(c.backend.to_string(), "model");
        assert_eq!(c.model_dir, PathBuf::from("/sys/fs/bpf/hm"));
        assert_eq!(
            c.vms.iter().map(|v| v.model_slot).collect::<Vec<_>>(),
            [Some(0), Some(7)]
        );
        assert_eq!(
            Config::default().model_dir,
            PathBuf::from("/sys/fs/bpf/vmigrater-host-model")
        );
        let refused = |text: String, want: &str| {
            let e = match Config::parse(&text, "a.toml") {
                Ok(_) => panic!("accepted:\n{text}"),
                Err(e) => format!("{e:#}"),
            };
            assert!(e.starts_with("a.toml:"), "{e}");
            assert!(e.contains("model_slot") && e.contains(want), "{e}");
        };
        refused(
            vm("a", "model_slot = 0\n"),
            "model_slot needs backend = \"model\" (backend is \"kvm-qemu\")",
        );
        refused(
            format!("backend = \"model\"\n{}", vm("a", "model_slot = 8\n")),
            "model_slot = 8 is outside 0..=7",
        );
        refused(
            format!(
                "backend = \"model\"\n{}{}",
                vm("a", "model_slot = 1\n"),
                vm("b", "model_slot = 1\n")
            ),
            "vm \"b\": model_slot = 1 is vm \"a\"'s already",
        );
        for (key, value) in [
            ("vcpu_threads", "[1]"),
            ("qmp_socket", "\"/run/q\""),
            ("pid_file", "\"/run/q.pid\""),
            ("host_cpus", "[0]"),
            ("domain", "\"d\""),
        ] {
            refused(
                format!(
                    "backend = \"model\"\n{}",
                    vm("a", &format!("model_slot = 0\n{key} = {value}\n"))
                ),
                &format!("model_slot and {key} both given"),
            );
        }
        // Negative or non-integer slots fail as TOML types, naming the line.
        let e = Config::parse(
            &format!("backend = \"model\"\n{}", vm("a", "model_slot = -1\n")),
            "a.toml",
        )
        .unwrap_err();
        assert!(format!("{e:#}").starts_with("a.toml:5:"), "{e:#}");
    }

    #[test]
    fn errors_name_the_line() {
        // Typed modes: a bad value fails at parse time with its line and the valid ones.
        let e = format!(
            "{:#}",
            Config::parse("period_ms = 100\nbackend = \"kvm\"\n", "t").unwrap_err()
        );
        assert!(
            e.starts_with("t:2:") && e.contains("`kvm-qemu`, `xen`, `model`, `dry-run`"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            Config::parse("weight = \"shares\"\n", "t").unwrap_err()
        );
        assert!(
            e.starts_with("t:1:") && e.contains("`nice` or `cgroup`"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            Config::parse("share = \"fair\"\n", "t").unwrap_err()
        );
        assert!(
            e.starts_with("t:1:") && e.contains("`vm-funded` or `isacs`"),
            "{e}"
        );
        let cfg = Config::parse("backend = \"xen\"\nweight = \"cgroup\"\n", "t").unwrap();
        assert_eq!(
            (cfg.backend, cfg.weight),
            (BackendKind::Xen, WeightKind::Cgroup)
        );
        assert_eq!(cfg.backend.to_string(), "xen");
        let e = Config::parse("\n\nperiod = 5\n", "t")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("t:3:"), "{e}");
        assert!(Config::parse("[[vm]]\nname = \"a\"\n", "t").is_err());
        let e = Config::parse(
            "[[vm]]\nname = \"a\"\nvcpu_threads = [1]\nhost_cpus = [100000]\n",
            "t",
        )
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("host_cpus has CPU 100000"),
            "{e:#}"
        );
        let e = Config::parse("[metrics]\nlisten = \"nowhere\"\n", "t").unwrap_err();
        assert!(e.to_string().starts_with("t:2:"), "{e}");
    }
}
