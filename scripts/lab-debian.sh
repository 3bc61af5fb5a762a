#!/usr/bin/env bash
# A Debian 12 guest with systemd as init for the package install test
# (`make lab-install-test`): debootstrap --variant=minbase into an ext4 image, cached as
# target/lab/debian/rootfs.img (rebuilt only when this script changes). The lab's kernel
# boots it through the lab initramfs (testbeds/lab/guest/init, `lab.root=/dev/vda`), which
# loads the virtio modules and switches to it. Inside, a unit serves the lab's command port,
# root has no password, and nothing needs the network: the runtime dependencies of our
# packages are installed here. Also installs debootstrap, e2fsprogs and promtool (Debian's
# prometheus) on the host when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
lab=${VMIGRATER_LAB_DIR:-target/lab}
out=$lab/debian
. scripts/debs.sh
need_promtool lab-debian
need_debs lab-debian debootstrap e2fsprogs

stamp=$(sha256sum "$0" testbeds/lab/guest/agent.sh | sha256sum | cut -c1-16)
if [ -f "$out/rootfs.img" ] && [ "$(cat "$out/stamp" 2>/dev/null)" = "$stamp" ]; then
    exit 0
fi

# The host's own Debian mirror (as configured for apt), so a local mirror is honoured.
mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '/^deb / { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$mirror" ] || mirror=http://deb.debian.org/debian

tmp=$(mktemp -d)
trap '$SUDO rm -rf "$tmp"' EXIT
root=$tmp/root
t0=$(date +%s)
echo "lab-debian: debootstrap bookworm from $mirror"
$SUDO debootstrap --variant=minbase \
    --include=systemd,systemd-sysv,udev,dbus,curl,procps,util-linux,libelf1,zlib1g,ca-certificates \
    bookworm "$root" "$mirror" >"$tmp/debootstrap.log" 2>&1 || {
    tail -30 "$tmp/debootstrap.log" >&2
    exit 1
}

$SUDO chroot "$root" passwd -d root >/dev/null
echo lab | $SUDO tee "$root/etc/hostname" >/dev/null
echo "/dev/vda / ext4 defaults 0 1" | $SUDO tee "$root/etc/fstab" >/dev/null
$SUDO mkdir -p "$root/lab"
$SUDO cp testbeds/lab/guest/agent.sh "$root/lab/agent.sh"
$SUDO tee "$root/etc/systemd/system/lab-cmd.service" >/dev/null <<'EOF'
[Unit]
Description=vmigrater lab command agent (the host drives the guest through this port)
BindsTo=dev-virtio\x2dports-org.vmigrater.cmd.0.device
After=dev-virtio\x2dports-org.vmigrater.cmd.0.device

[Service]
ExecStart=/bin/sh /lab/agent.sh
Restart=always

[Install]
WantedBy=dev-virtio\x2dports-org.vmigrater.cmd.0.device
EOF
$SUDO ln -sf /etc/systemd/system/lab-cmd.service \
    "$root/etc/systemd/system/multi-user.target.wants/lab-cmd.service"
$SUDO mkdir -p "$root/etc/systemd/system/dev-virtio\\x2dports-org.vmigrater.cmd.0.device.wants"
$SUDO ln -sf /etc/systemd/system/lab-cmd.service \
    "$root/etc/systemd/system/dev-virtio\\x2dports-org.vmigrater.cmd.0.device.wants/lab-cmd.service"
# No login prompts, no network waits, no time sync: a test guest.
for u in getty@tty1.service serial-getty@ttyS0.service systemd-timesyncd.service \
         apt-daily.timer apt-daily-upgrade.timer; do
    $SUDO ln -sf /dev/null "$root/etc/systemd/system/$u"
done
$SUDO rm -rf "$root/var/cache/apt/archives"/*.deb "$root/var/lib/apt/lists"/*

mkdir -p "$out"
rm -f "$out/rootfs.img"
$SUDO mkfs.ext4 -q -L lab-root -d "$root" "$out/rootfs.img" 1536M
echo "$stamp" >"$out/stamp"
echo "lab-debian: $out/rootfs.img ($(du -h "$out/rootfs.img" | cut -f1) used) in $(($(date +%s) - t0)) s"
