//! The nested-VM lab: VMs under QEMU TCG, where every vCPU is a host thread the
//! host scheduler deschedules like a hypervisor would, so vCPU descheduling is real and the
//! guest cannot see its cause. `image` builds the guest, `vm` boots and drives it over its
//! command port, `host` shapes the host side (pinning, slices, hogs), `bench` measures the
//! benefit and `summary` reduces its runs; `soak` runs both programs for an hour with
//! faults injected.

pub mod bench;
pub mod cpio;
pub mod guest;
pub mod host;
pub mod image;
pub mod install;
pub mod soak;
pub mod summary;
pub mod vm;

/// The guest daemon's configuration in the lab (see the file for why it differs from the
/// built-in defaults).
pub const GUEST_CONFIG: &str = include_str!("../guest/vmigrater.toml");
