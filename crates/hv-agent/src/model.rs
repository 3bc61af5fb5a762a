//! The `model` backend: on the hard-IRQ testbed the hypervisor's scheduler is a BPF model
//! (bpf/hostmodel.bpf.c), and the agent drives it like any other hypervisor, through the
//! two array maps the testbed pins in `model_dir` (layout: bpf/hostmodel.h).
//! - `control` (`struct hm_control`): per entity the weight and boost the agent asks for.
//! - `entities` (`struct hm_entity`): per entity what the model measured (run, wait, halted
//!   time and wake-ups: the schedstat of a vCPU that has no host thread) and the weight in
//!   effect, non-zero exactly for the entities the model runs.
//!
//! Keys are `cpu * MAX_SLOTS + slot`. Slot 0 on each modelled CPU is the testbed's own
//! guest's vCPU on that CPU, slots 1.. other VMs' vCPUs pinned there, so a VM configured as
//! slot S (`model_slot`) has vCPU n = entity (CPU n, slot S) for every CPU that runs it.

use anyhow::{bail, Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use tracing::{debug, warn};

use crate::backend::Backend;
use crate::config::VmConfig;
use crate::observe::ThreadSample;
use crate::weights::Setting;

pub use crate::config::MODEL_SLOTS as MAX_SLOTS;
/// `HM_MAX_CPUS`.
pub const MAX_CPUS: u32 = 64;
/// `HM_DEFAULT_WEIGHT`: a nice-0 thread's CFS weight, which the model also gives an entity
/// whose control weight is 0.
pub const DEFAULT_WEIGHT: u32 = 1024;

const CONTROL_SIZE: u32 = 8;
const ENTITY_SIZE: u32 = 64;
/// `hm_entity.weight`.
const ENTITY_WEIGHT_AT: usize = 60;

/// `struct hm_control`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Control {
    pub weight: u32,
    pub boost: u32,
}

impl Control {
    /// What the model is told for a setting: its weight factor on the default CFS weight,
    /// and boost.
    pub fn of(s: &Setting) -> Control {
        let weight = (f64::from(DEFAULT_WEIGHT) * s.weight)
            .round()
            .clamp(1.0, f64::from(u32::MAX)) as u32;
        Control {
            weight,
            boost: u32::from(s.boost),
        }
    }

    /// The map value's bytes (`struct hm_control`).
    pub fn to_bytes(self) -> [u8; CONTROL_SIZE as usize] {
        let mut b = [0; CONTROL_SIZE as usize];
        b[..4].copy_from_slice(&self.weight.to_ne_bytes());
        b[4..].copy_from_slice(&self.boost.to_ne_bytes());
        b
    }
}

pub fn key(cpu: u32, slot: u32) -> u32 {
    cpu * MAX_SLOTS + slot
}

/// The parts of `struct hm_entity` the agent reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entity {
    pub run_ns: u64,
    pub wait_ns: u64,
    pub halted_ns: u64,
    pub wakeups: u64,
    pub weight: u32,
}

impl Entity {
    fn parse(b: &[u8]) -> Option<Entity> {
        let u64_at = |at: usize| Some(u64::from_ne_bytes(b.get(at..at + 8)?.try_into().ok()?));
        let weight = b.get(ENTITY_WEIGHT_AT..ENTITY_WEIGHT_AT + 4)?;
        Some(Entity {
            run_ns: u64_at(0)?,
            wait_ns: u64_at(8)?,
            halted_ns: u64_at(16)?,
            wakeups: u64_at(24)?,
            weight: u32::from_ne_bytes(weight.try_into().ok()?),
        })
    }
}

pub struct Model {
    control: MapHandle,
    entities: MapHandle,
    /// VM name → slot, for `apply`, which is given the name only.
    slots: HashMap<String, u32>,
    /// What the agent last wrote per control key.
    written: BTreeMap<u32, Control>,
}

/// Opens a pinned map and checks that it has the layout of bpf/hostmodel.h.
fn open_map(dir: &Path, name: &str, value_size: u32) -> Result<MapHandle> {
    let path = dir.join(name);
    // Asked of the file system, not of bpf(2): where BPF is closed to the user, the
    // syscall says EPERM before it looks for the path.
    if let Err(e) = std::fs::symlink_metadata(&path) {
        if e.kind() == std::io::ErrorKind::NotFound {
            bail!(
                "the host model's maps are not pinned at {}: is the testbed running?",
                path.display()
            );
        }
    }
    let map = MapHandle::from_pinned_path(&path)
        .with_context(|| format!("opening the host model's map {}", path.display()))?;
    if map.key_size() != 4 || map.value_size() != value_size || map.max_entries() < MAX_SLOTS {
        bail!(
            "{} is not the host model's {name} map: key {} B, value {} B, {} entries \
             (bpf/hostmodel.h: key 4 B, value {value_size} B, at least {MAX_SLOTS} entries)",
            path.display(),
            map.key_size(),
            map.value_size(),
            map.max_entries()
        );
    }
    Ok(map)
}

impl Model {
    /// Opens the maps the testbed pinned in `dir`; `vms` says which VM is which slot.
    pub fn open(dir: &Path, vms: &[VmConfig]) -> Result<Model> {
        Ok(Model {
            control: open_map(dir, "control", CONTROL_SIZE)?,
            entities: open_map(dir, "entities", ENTITY_SIZE)?,
            slots: vms
                .iter()
                .filter_map(|v| Some((v.name.clone(), v.model_slot?)))
                .collect(),
            written: BTreeMap::new(),
        })
    }

    /// The entity at (cpu, slot), if the map has that key.
    pub fn entity(&self, cpu: u32, slot: u32) -> Option<Entity> {
        if cpu >= MAX_CPUS {
            return None;
        }
        let value = self
            .entities
            .lookup(&key(cpu, slot).to_ne_bytes(), MapFlags::ANY)
            .ok()??;
        Entity::parse(&value)
    }

    fn write(&self, key: u32, c: Control) -> Result<()> {
        self.control
            .update(&key.to_ne_bytes(), &c.to_bytes(), MapFlags::ANY)
            .with_context(|| format!("writing the host model's control[{key}]"))
    }
}

impl Backend for Model {
    fn name(&self) -> &'static str {
        "model"
    }

    fn apply(
        &mut self,
        vm: &str,
        _domain: Option<&str>,
        _tid: Option<u32>,
        s: &Setting,
    ) -> Result<bool> {
        let Some(&slot) = self.slots.get(vm) else {
            return Ok(false);
        };
        let vcpu = s.key.1;
        if vcpu >= MAX_CPUS {
            bail!(
                "vm {vm:?} vCPU {vcpu}: the model has CPUs 0..{}",
                MAX_CPUS - 1
            );
        }
        let (k, want) = (key(vcpu, slot), Control::of(s));
        if self.written.get(&k) == Some(&want) {
            return Ok(false);
        }
        self.write(k, want)?;
        self.written.insert(k, want);
        debug!(
            vm,
            vcpu,
            slot,
            weight = want.weight,
            boost = s.boost,
            nice = s.nice,
            "modelled vCPU re-weighted"
        );
        Ok(true)
    }

    /// vCPU n of the VM is the entity (CPU n, its slot) for as long as the model runs one
    /// there.
    fn vcpus(&self, vm: &VmConfig) -> Option<usize> {
        let slot = vm.model_slot?;
        Some(
            (0..MAX_CPUS)
                .take_while(|&cpu| self.entity(cpu, slot).is_some_and(|e| e.weight != 0))
                .count(),
        )
    }

    fn sample(&self, vm: &VmConfig, vcpu: u32) -> Option<ThreadSample> {
        let e = self
            .entity(vcpu, vm.model_slot?)
            .filter(|e| e.weight != 0)?;
        Some(ThreadSample {
            run_ns: e.run_ns,
            wait_ns: e.wait_ns,
            wakeups: e.wakeups,
            kicks: None,
            last_cpu: Some(vcpu as usize),
        })
    }

    /// Every entity the agent touched goes back to the default weight, no boost, which is
    /// how the testbed starts them. Nothing is journaled for a killed agent: the maps live
    /// only as long as the testbed run that created them, so what an agent leaves behind
    /// goes with that run, and the next agent's first period overwrites every entry it
    /// drives anyway.
    fn restore(&mut self) -> usize {
        let keys: Vec<u32> = std::mem::take(&mut self.written).into_keys().collect();
        keys.into_iter()
            .filter(|&k| match self.write(k, Control::default()) {
                Ok(()) => true,
                Err(e) => {
                    warn!("could not restore the host model's control[{k}]: {e:#}");
                    false
                }
            })
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setting(nice: i32, boost: bool) -> Setting {
        Setting {
            key: (0, 0),
            nice,
            weight: 1.25f64.powi(-nice),
            iv_credit: 0.0,
            cv_credit: 0.0,
            boost,
            held: false,
        }
    }

    #[test]
    fn weight_factors_become_model_weights_around_the_default() {
        let w = |nice| Control::of(&setting(nice, false)).weight;
        assert_eq!(w(0), DEFAULT_WEIGHT);
        // 1024 × 1.25^±2, rounded.
        assert_eq!((w(-2), w(2)), (1600, 655));
        assert_eq!((w(-1), w(1)), (1280, 819));
        // The whole nice range stays a positive u32.
        assert_eq!(w(19), 15);
        assert_eq!(w(-19), 71054);
        assert_eq!(Control::of(&setting(0, true)).boost, 1);
        assert_eq!(Control::of(&setting(0, false)).boost, 0);
    }

    #[test]
    fn the_layout_is_bpf_hostmodels() {
        assert_eq!(key(0, 0), 0);
        assert_eq!(key(1, 2), 10);
        let c = Control {
            weight: 0x0102_0304,
            boost: 1,
        }
        .to_bytes();
        assert_eq!(c[..4], 0x0102_0304u32.to_ne_bytes());
        assert_eq!(c[4..], 1u32.to_ne_bytes());
        let mut e = [0u8; ENTITY_SIZE as usize];
        for (i, v) in [11u64, 22, 33, 44].iter().enumerate() {
            e[i * 8..i * 8 + 8].copy_from_slice(&v.to_ne_bytes());
        }
        e[ENTITY_WEIGHT_AT..].copy_from_slice(&1024u32.to_ne_bytes());
        assert_eq!(
            Entity::parse(&e),
            Some(Entity {
                run_ns: 11,
                wait_ns: 22,
                halted_ns: 33,
                wakeups: 44,
                weight: 1024
            })
        );
        assert_eq!(Entity::parse(&e[..40]), None);
    }

    #[test]
    fn missing_maps_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let e = match Model::open(dir.path(), &[]) {
            Ok(_) => panic!("opened maps that are not there"),
            Err(e) => format!("{e:#}"),
        };
        let want = format!(
            "the host model's maps are not pinned at {}: is the testbed running?",
            dir.path().join("control").display()
        );
        assert!(e.contains(&want), "{e}");
    }
}
