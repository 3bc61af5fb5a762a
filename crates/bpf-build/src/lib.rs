//! Used by the build scripts of the crates that load BPF (task-detector, vcpu-monitor):
//! compiles `bpf/NAME.bpf.c` against the vendored `bpf/vmlinux.h` into
//! `OUT_DIR/NAME.skel.rs`, so builds never depend on the build machine's BTF.

use libbpf_cargo::SkeletonBuilder;
use std::path::PathBuf;

/// Builds the skeleton of `bpf/{name}.bpf.c` (which may include `bpf/{name}.h`).
pub fn skeleton(name: &str) {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let bpf_dir = manifest
        .join("../../bpf")
        .canonicalize()
        .expect("bpf/ directory");
    let src = bpf_dir.join(format!("{name}.bpf.c"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"))
        .join(format!("{name}.skel.rs"));
    // asm/types.h lives under the target's multiarch directory.
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_else(|_| "x86_64".into());
    SkeletonBuilder::new()
        .source(&src)
        .clang_args(vec![
            format!("-I{}", bpf_dir.display()),
            format!("-I/usr/include/{arch}-linux-gnu"),
            "-Wall".to_string(),
            // Atomic fetch-and-add with a result needs BPF ISA v3 (5.12+).
            "-mcpu=v3".to_string(),
        ])
        .build_and_generate(&out)
        .unwrap_or_else(|e| {
            panic!(
                "building bpf/{name}.bpf.c (needs clang and libbpf-dev: run scripts/setup.sh): {e}"
            )
        });
    for f in [format!("{name}.bpf.c"), format!("{name}.h")] {
        println!("cargo:rerun-if-changed={}", bpf_dir.join(f).display());
    }
}
