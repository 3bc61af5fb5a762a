#!/usr/bin/env bash
# The nested-VM lab's host tools and guest kernel, installed when missing; safe to
# run again. QEMU (TCG: no KVM needed), static busybox for the initramfs, and Debian's
# current 6.1 kernel package unpacked under target/lab/kernel (never installed on the host;
# only the kernel image and the modules the guests load are kept).
set -euo pipefail
cd "$(dirname "$0")/.."
lab=${VMIGRATER_LAB_DIR:-target/lab}
. scripts/debs.sh
need_debs lab-setup qemu-system-x86 busybox-static

# The virtio modules every lab guest loads, then what mounting an ext4 root needs (the
# systemd guest of the install test); keep in step with testbeds/lab/src/image.rs.
modules="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk virtio_console
         crc16 mbcache jbd2 crc32c_generic ext4"
have=yes
ls "$lab"/kernel/boot/vmlinuz-* >/dev/null 2>&1 || have=no
for m in $modules; do
    [ -n "$(find "$lab/kernel/lib/modules" -name "$m.ko" 2>/dev/null | head -1)" ] || have=no
done
[ "$have" = yes ] && exit 0
# The package linux-image-amd64 points at (e.g. linux-image-6.1.0-56-amd64).
pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
if [ -z "$pkg" ]; then
    $SUDO apt-get update -qq
    pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
fi
[ -n "$pkg" ] || { echo "lab-setup: cannot find the kernel package behind linux-image-amd64" >&2; exit 1; }
echo "lab-setup: guest kernel $pkg"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"  # apt's download runs as _apt
(cd "$tmp" && apt-get download -q "$pkg" >/dev/null 2>&1 || apt-get download "$pkg")
dpkg -x "$tmp"/"$pkg"_*.deb "$tmp/root"
release=${pkg#linux-image-}
mkdir -p "$lab/kernel/boot" "$lab/kernel/lib/modules/$release"
cp "$tmp/root/boot/vmlinuz-$release" "$lab/kernel/boot/"
for m in $modules; do
    src=$(find "$tmp/root/lib/modules/$release/kernel" -name "$m.ko" | head -1)
    [ -n "$src" ] || { echo "lab-setup: module $m missing from $pkg" >&2; exit 1; }
    dst="$lab/kernel/lib/modules/$release/${src#"$tmp/root/lib/modules/$release/"}"
    mkdir -p "$(dirname "$dst")"
    cp "$src" "$dst"
done
echo "lab-setup: kernel $release in $lab/kernel"
