//! Backends apply the credit core's settings to a real hypervisor and undo them on exit.
//! - `KvmQemu`: per vCPU thread, the share either as nice (`sched_setattr` with the rest of
//!   the thread's attributes as read, so a slice or policy somebody set stays) or as the
//!   thread's cgroup weight (`cgroup`), and Algorithm 2 moves as single-CPU affinity. Everything is saved at first touch and put back by
//!   `restore`. Threads that are not SCHED_OTHER (someone made them real-time) are left
//!   alone.
//! - `Xen`: one credit2 weight per domain (`xl sched-credit2 -d DOM -w W`), 256 being the
//!   default, through a command runner so tests can check the exact commands.
//! - `Model` (`model.rs`): the hard-IRQ testbed's BPF host scheduler model, whose
//!   modelled vCPUs have no host thread: the backend also says how many vCPUs such a VM
//!   has and what each did (`vcpus`, `sample`).
//! - `DryRun`: computes and logs, touches nothing.

use anyhow::{Context, Result};
use std::collections::{BTreeMap, HashMap};
use tracing::{debug, info, warn};

use crate::cgroup::CgroupWeights;
use crate::config::VmConfig;
use crate::journal::Journal;
use crate::observe::ThreadSample;
use crate::weights::Setting;

pub trait Backend: Send {
    fn name(&self) -> &'static str;
    /// Applies one vCPU's setting; `tid` is its host thread where known, `domain` the VM's
    /// Xen domain. Returns whether anything changed.
    fn apply(
        &mut self,
        vm: &str,
        domain: Option<&str>,
        tid: Option<u32>,
        s: &Setting,
    ) -> Result<bool>;
    /// Called once per period after every `apply`.
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }
    /// Pins a vCPU thread to one host CPU (Algorithm 2); false where the backend does not
    /// place threads.
    fn place(&mut self, _tid: u32, _cpu: usize) -> Result<bool> {
        Ok(false)
    }
    /// The thread is gone or no longer a vCPU: drop (and undo, if it still exists) what
    /// was changed on it.
    fn forget(&mut self, _tid: u32) {}
    /// Puts back everything this backend changed; returns how many objects it restored.
    fn restore(&mut self) -> usize;
    /// How many vCPUs a VM has where the backend, not a host thread, runs them (a
    /// modelled VM); None where the backend does not know the VM.
    fn vcpus(&self, _vm: &VmConfig) -> Option<usize> {
        None
    }
    /// What such a vCPU did so far, as the schedstat of a thread would say.
    fn sample(&self, _vm: &VmConfig, _vcpu: u32) -> Option<ThreadSample> {
        None
    }
}

/// How the share (CVCredit) reaches a vCPU thread under `kvm-qemu`.
pub enum Share {
    Nice,
    Cgroup(CgroupWeights),
}

use os_layer::sched::{get_attr, set_attr};

pub struct KvmQemu {
    share: Share,
    /// Each thread's nice when the agent first touched it.
    originals: HashMap<u32, i32>,
    /// The nice the agent last set on each thread: at exit, a thread that carries any other
    /// was reniced by somebody after us and is left as they set it.
    last_set: HashMap<u32, i32>,
    masks: HashMap<u32, nix::sched::CpuSet>,
    /// The host CPU each placed thread was pinned to, for the same check.
    placed: HashMap<u32, usize>,
    journal: Option<Journal>,
}

impl KvmQemu {
    pub fn new(share: Share, journal: Option<Journal>) -> KvmQemu {
        KvmQemu {
            share,
            originals: HashMap::new(),
            last_set: HashMap::new(),
            masks: HashMap::new(),
            placed: HashMap::new(),
            journal,
        }
    }

    fn journal(
        &mut self,
        tid: u32,
        reason: &str,
        add: impl FnOnce(&mut crate::journal::Entry),
    ) -> Result<()> {
        match &mut self.journal {
            Some(j) => j.record(tid, reason, add),
            None => Ok(()),
        }
    }
}

impl KvmQemu {
    /// Gives `tid` its original nice back unless somebody else changed it after our last
    /// change (then theirs stays). Ok(false): nothing was put back.
    fn put_back_nice(&mut self, tid: u32, original: i32) -> std::io::Result<bool> {
        let Some(ours) = self.last_set.remove(&tid) else {
            return Ok(false); // never changed
        };
        // The whole attribute set is written back as read, so only the nice changes.
        let mut now = get_attr(tid)?;
        if now.sched_nice != ours {
            info!(
                tid,
                nice = now.sched_nice,
                "changed by somebody else after us: left as is"
            );
            return Ok(false);
        }
        now.sched_nice = original;
        set_attr(tid, &now)?;
        Ok(true)
    }

    /// The same for the affinity set by `place`.
    fn put_back_mask(
        &mut self,
        tid: u32,
        original: &nix::sched::CpuSet,
    ) -> std::result::Result<bool, nix::errno::Errno> {
        let Some(cpu) = self.placed.remove(&tid) else {
            return Ok(false);
        };
        let now = nix::sched::sched_getaffinity(pid(tid))?;
        if os_layer::cpus_of(&now) != [cpu] {
            info!(tid, cpus = ?os_layer::cpus_of(&now), "affinity changed by somebody else after us: left as is");
            return Ok(false);
        }
        nix::sched::sched_setaffinity(pid(tid), original)?;
        Ok(true)
    }
}

fn pid(tid: u32) -> nix::unistd::Pid {
    nix::unistd::Pid::from_raw(tid as i32)
}

impl Backend for KvmQemu {
    fn name(&self) -> &'static str {
        "kvm-qemu"
    }

    fn apply(
        &mut self,
        vm: &str,
        _domain: Option<&str>,
        tid: Option<u32>,
        s: &Setting,
    ) -> Result<bool> {
        let Some(tid) = tid else { return Ok(false) };
        let current = match get_attr(tid) {
            Ok(a) => a,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                self.originals.remove(&tid);
                return Ok(false);
            }
            Err(e) => return Err(e).with_context(|| format!("sched_getattr({tid})")),
        };
        if current.sched_policy != libc::SCHED_OTHER as u32 {
            debug!(
                vm,
                tid,
                policy = current.sched_policy,
                "not a SCHED_OTHER thread: left alone"
            );
            return Ok(false);
        }
        if !self.originals.contains_key(&tid) {
            self.journal(tid, "ISACS credits weight the vCPU (nice)", |e| {
                e.nice = Some(current.sched_nice);
            })?;
            self.originals.insert(tid, current.sched_nice);
        }
        let original = self.originals[&tid];
        let nice = match &mut self.share {
            Share::Nice => (original + s.nice).clamp(-20, 19),
            Share::Cgroup(cg) => {
                let journal = &mut self.journal;
                return cg.set(tid, s.weight, |t| match journal {
                    Some(j) => j.record(tid, "ISACS credits weight the vCPU (cpu.weight)", |e| {
                        e.cgroup = Some(t.clone())
                    }),
                    None => Ok(()),
                });
            }
        };
        if current.sched_nice == nice {
            return Ok(false);
        }
        let mut want = current;
        want.sched_nice = nice;
        set_attr(tid, &want).with_context(|| format!("sched_setattr({tid})"))?;
        self.last_set.insert(tid, nice);
        debug!(
            vm,
            vcpu = s.key.1,
            tid,
            nice,
            iv = s.iv_credit,
            cv = s.cv_credit,
            boost = s.boost,
            "vCPU thread re-weighted"
        );
        Ok(true)
    }

    fn place(&mut self, tid: u32, cpu: usize) -> Result<bool> {
        let current = nix::sched::sched_getaffinity(pid(tid))
            .with_context(|| format!("sched_getaffinity({tid})"))?;
        let mut want = nix::sched::CpuSet::new();
        want.set(cpu)?;
        if current == want {
            return Ok(false);
        }
        if !self.masks.contains_key(&tid) {
            let cpus = os_layer::cpus_of(&current);
            self.journal(tid, "I/O load balancing places the vCPU", |e| {
                e.mask = Some(cpus)
            })?;
            self.masks.insert(tid, current);
        }
        nix::sched::sched_setaffinity(pid(tid), &want)
            .with_context(|| format!("sched_setaffinity({tid}, {{{cpu}}})"))?;
        self.placed.insert(tid, cpu);
        Ok(true)
    }

    fn forget(&mut self, tid: u32) {
        if let Some(nice) = self.originals.remove(&tid) {
            let _ = self.put_back_nice(tid, nice);
        }
        if let Some(mask) = self.masks.remove(&tid) {
            let _ = self.put_back_mask(tid, &mask);
        }
        if let Share::Cgroup(cg) = &mut self.share {
            cg.forget(tid);
        }
        if let Some(j) = &mut self.journal {
            j.forget(tid);
        }
    }

    fn restore(&mut self) -> usize {
        let mut n = 0;
        let originals: Vec<_> = self.originals.drain().collect();
        for (tid, nice) in originals {
            match self.put_back_nice(tid, nice) {
                Ok(restored) => n += usize::from(restored),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => warn!(tid, "could not restore the nice: {e}"),
            }
        }
        let masks: Vec<_> = self.masks.drain().collect();
        for (tid, mask) in masks {
            match self.put_back_mask(tid, &mask) {
                Ok(restored) => n += usize::from(restored),
                Err(nix::errno::Errno::ESRCH) => {}
                Err(e) => warn!(tid, "could not restore the affinity: {e}"),
            }
        }
        if let Share::Cgroup(cg) = &mut self.share {
            n += cg.restore();
        }
        if let Some(j) = &mut self.journal {
            j.clear();
        }
        n
    }
}

/// Runs external commands (`xl`); replaced in tests.
pub trait CommandRunner: Send {
    fn run(&mut self, argv: &[String]) -> Result<()>;
}

pub struct RealRunner;

impl CommandRunner for RealRunner {
    fn run(&mut self, argv: &[String]) -> Result<()> {
        let status = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .status()
            .with_context(|| format!("running {}", argv.join(" ")))?;
        anyhow::ensure!(status.success(), "{} exited with {status}", argv.join(" "));
        Ok(())
    }
}

pub const XEN_DEFAULT_WEIGHT: u32 = 256;

pub struct Xen {
    runner: Box<dyn CommandRunner>,
    /// Σ nice and count per domain, gathered by `apply`, turned into weights by `flush`.
    pending: BTreeMap<String, (i32, u32)>,
    applied: BTreeMap<String, u32>,
}

impl Xen {
    pub fn new(runner: Box<dyn CommandRunner>) -> Self {
        Xen {
            runner,
            pending: BTreeMap::new(),
            applied: BTreeMap::new(),
        }
    }

    fn set(&mut self, domain: &str, weight: u32) -> Result<()> {
        let argv = [
            "xl",
            "sched-credit2",
            "-d",
            domain,
            "-w",
            &weight.to_string(),
        ]
        .map(String::from);
        self.runner.run(&argv)
    }
}

impl Backend for Xen {
    fn name(&self) -> &'static str {
        "xen"
    }

    fn apply(
        &mut self,
        _vm: &str,
        domain: Option<&str>,
        _tid: Option<u32>,
        s: &Setting,
    ) -> Result<bool> {
        let Some(domain) = domain else {
            return Ok(false);
        };
        let e = self.pending.entry(domain.to_string()).or_insert((0, 0));
        e.0 += s.nice;
        e.1 += 1;
        Ok(false)
    }

    fn flush(&mut self) -> Result<()> {
        for (domain, (sum, n)) in std::mem::take(&mut self.pending) {
            let mean_nice = sum as f64 / n.max(1) as f64;
            let weight = (XEN_DEFAULT_WEIGHT as f64 * 1.25f64.powf(-mean_nice))
                .round()
                .clamp(1.0, 65535.0) as u32;
            if self.applied.get(&domain) != Some(&weight) {
                self.set(&domain, weight)?;
                info!(domain, weight, "credit2 weight set");
                self.applied.insert(domain, weight);
            }
        }
        Ok(())
    }

    fn restore(&mut self) -> usize {
        let domains: Vec<String> = std::mem::take(&mut self.applied).into_keys().collect();
        domains
            .iter()
            .filter(|d| match self.set(d, XEN_DEFAULT_WEIGHT) {
                Ok(()) => true,
                Err(e) => {
                    warn!(domain = %d, "could not restore the credit2 weight: {e:#}");
                    false
                }
            })
            .count()
    }
}

pub struct DryRun;

impl Backend for DryRun {
    fn name(&self) -> &'static str {
        "dry-run"
    }

    fn apply(
        &mut self,
        vm: &str,
        _domain: Option<&str>,
        tid: Option<u32>,
        s: &Setting,
    ) -> Result<bool> {
        debug!(
            vm,
            vcpu = s.key.1,
            ?tid,
            nice = s.nice,
            iv = s.iv_credit,
            cv = s.cv_credit,
            "dry-run: would apply"
        );
        Ok(false)
    }

    fn restore(&mut self) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    struct Recorder(Arc<Mutex<Vec<String>>>);

    impl CommandRunner for Recorder {
        fn run(&mut self, argv: &[String]) -> Result<()> {
            self.0.lock().unwrap().push(argv.join(" "));
            Ok(())
        }
    }

    fn setting(cpu: u32, nice: i32) -> Setting {
        Setting {
            key: (0, cpu),
            nice,
            weight: 1.25f64.powi(-nice),
            iv_credit: 0.0,
            cv_credit: 0.0,
            boost: false,
            held: false,
        }
    }

    #[test]
    fn xen_issues_exactly_the_credit2_commands() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut x = Xen::new(Box::new(Recorder(log.clone())));
        x.apply("a", Some("vm-a"), None, &setting(0, -1)).unwrap();
        x.apply("a", Some("vm-a"), None, &setting(1, -1)).unwrap();
        x.apply("b", Some("7"), None, &setting(0, 2)).unwrap();
        x.flush().unwrap();
        // Same weights again: no new commands.
        x.apply("a", Some("vm-a"), None, &setting(0, -1)).unwrap();
        x.flush().unwrap();
        assert_eq!(x.restore(), 2);
        assert_eq!(
            *log.lock().unwrap(),
            vec![
                "xl sched-credit2 -d 7 -w 164",
                "xl sched-credit2 -d vm-a -w 320",
                "xl sched-credit2 -d 7 -w 256",
                "xl sched-credit2 -d vm-a -w 256",
            ]
        );
    }
}
