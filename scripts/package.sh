#!/usr/bin/env bash
# `make package`: the .deb and .rpm of both programs into target/package/. Installs the
# packaging tools when missing (cargo-deb, cargo-generate-rpm; Debian's rpm and lintian for
# the checks). Generated files (man pages, completions, default configs) come from the
# binaries themselves, under target/dist/dist/<program>/ (the `dist`
# profile's directory: asset paths say target/release/, which both tools map to the profile), so they never drift.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
out=$target/package
. scripts/debs.sh
need_debs package rpm lintian systemd
# Pinned: the lintian overrides and `make package-check`'s expectations were made with these.
command -v cargo-deb >/dev/null || cargo install --locked cargo-deb --version 3.8.0
command -v cargo-generate-rpm >/dev/null || cargo install --locked cargo-generate-rpm --version 0.21.1

# The C code linked into vmigrater (libbpf, built by libbpf-sys) gets Debian's hardening
# flags; the Rust code needs none of them.
export LIBBPF_SYS_EXTRA_CFLAGS="${LIBBPF_SYS_EXTRA_CFLAGS:-} -D_FORTIFY_SOURCE=2 -fstack-protector-strong"
cargo build --profile dist -p vmigrater -p hv-agent --bins
bin_dir=$target/dist
rm -rf "$bin_dir/dist" "$out"
mkdir -p "$out"
for bin in vmigrater vmigrater-hv-agent; do
    dist=$bin_dir/dist/$bin
    "$bin_dir/$bin" gen-dist "$dist"
    gzip -9nf "$dist"/man/*.8
    case $bin in
        vmigrater) conf=vmigrater.toml ;;
        vmigrater-hv-agent) conf=hv-agent.toml ;;
    esac
    "$bin_dir/$bin" default-config > "$dist/$conf"
done

for crate in vmigrater hv-agent; do
    cargo deb --no-build --profile dist -p "$crate" -o "$out/"
    cargo generate-rpm --profile dist -p "crates/$crate" --target-dir "$target" -o "$out/"
done
ls -l "$out"
