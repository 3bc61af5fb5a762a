//! Compiles bpf/irqsteal.bpf.c and bpf/hostmodel.bpf.c into libbpf skeletons (see
//! crates/bpf-build).
fn main() {
    bpf_build::skeleton("irqsteal");
    bpf_build::skeleton("hostmodel");
}
