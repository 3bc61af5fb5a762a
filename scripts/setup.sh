#!/usr/bin/env bash
# Installs what building and testing vmigrater needs on a Debian 12 machine, and nothing
# when it is all there already. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/debs.sh
need_debs setup clang llvm libbpf-dev libelf-dev zlib1g-dev pkg-config bpftool make \
    python3-matplotlib coreutils

for comp in rustfmt clippy; do
    if ! cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1; then
        rustup component add "$comp"
    fi
done

# The BPF probes read tracefs; some minimal systems do not mount it.
if [ "$(id -u)" -eq 0 ] && [ ! -d /sys/kernel/tracing/events ] && [ -d /sys/kernel/tracing ]; then
    mount -t tracefs nodev /sys/kernel/tracing || echo "setup: could not mount tracefs (classic tracepoints unavailable)"
fi
