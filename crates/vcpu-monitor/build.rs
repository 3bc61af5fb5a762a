//! Compiles bpf/vcputick.bpf.c into a libbpf skeleton (OUT_DIR/vcputick.skel.rs) against
//! the vendored vmlinux.h, so builds never depend on the build machine's BTF.

use libbpf_cargo::SkeletonBuilder;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let bpf_dir = manifest
        .join("../../bpf")
        .canonicalize()
        .expect("bpf/ directory");
    let src = bpf_dir.join("vcputick.bpf.c");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("vcputick.skel.rs");
    SkeletonBuilder::new()
        .source(&src)
        .clang_args(vec![
            format!("-I{}", bpf_dir.display()),
            "-I/usr/include/x86_64-linux-gnu".to_string(),
            "-Wall".to_string(),
            "-mcpu=v3".to_string(),
        ])
        .build_and_generate(&out)
        .expect("building bpf/vcputick.bpf.c (needs clang and libbpf-dev: run scripts/setup.sh)");
    for f in ["vcputick.bpf.c", "vcputick.h"] {
        println!("cargo:rerun-if-changed={}", bpf_dir.join(f).display());
    }
}
