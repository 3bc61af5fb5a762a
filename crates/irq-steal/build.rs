//! Compiles bpf/irqsteal.bpf.c into a libbpf skeleton (see crates/bpf-build).
fn main() {
    bpf_build::skeleton("irqsteal");
}
