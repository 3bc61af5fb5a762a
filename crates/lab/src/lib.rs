//! The nested-VM lab (issue 4): VMs under QEMU TCG, where every vCPU is a host thread the
//! host scheduler deschedules like a hypervisor would, so vCPU descheduling is real and the
//! guest cannot see its cause. `image` builds the guest, `vm` boots and drives it over its
//! command port, `host` shapes the host side (pinning, slices, hogs), `bench` measures the
//! benefit and `summary` reduces its runs.

pub mod bench;
pub mod cpio;
pub mod guest;
pub mod host;
pub mod image;
pub mod install;
pub mod summary;
pub mod vm;
