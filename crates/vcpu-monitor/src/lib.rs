//! Per-vCPU time-slice detection (filled in by the vcpu-monitor work).
