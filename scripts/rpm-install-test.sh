#!/usr/bin/env bash
# `make rpm-install-test` (root; CI runs it after package-check): both RPMs of
# `make package` installed, upgraded and erased in `rpm --root` trees, their scriptlets run
# by a static busybox as the tree's /bin/sh (no systemd in a tree: the scriptlets take their
# no-systemd paths, as in a container or a chroot).
# - install: every file in place, the scriptlets without error, the conffile as shipped;
# - upgrade to the next release (release 2, built here, whose default conffile gained a
#   line): an unmodified conffile follows the new one; one the user changed is kept and the
#   new one lands beside it as <conffile>.rpmnew (%config(noreplace));
# - erase: nothing of the package left, but a changed conffile saved as <conffile>.rpmsave.
# Reports every problem it finds, then exits 1 if there was any.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "rpm-install-test: needs root (rpm runs scriptlets chrooted into the tree)" >&2; exit 1; }
. scripts/debs.sh
need_debs rpm-install-test rpm cpio busybox-static
target=${CARGO_TARGET_DIR:-target}
out=$target/package
dist=$target/dist/dist
# The rpm database inside each tree (Debian's rpm keeps it in root's home).
dbpath=$(rpm --eval '%{_dbpath}')
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)
arch=$(uname -m)
work=$(mktemp -d)
restore=()
cleanup() {
    local r
    for r in "${restore[@]}"; do cp "$work/$r.orig" "$dist/$r"; done
    rm -rf "$work"
}
trap cleanup EXIT

problems=()
checks=0
check() {
    local what=$1
    shift
    if "$@"; then checks=$((checks + 1)); else problems+=("$what"); echo "rpm-install-test: FAIL: $what" >&2; fi
}

# rpm_in <tree> <args...>: rpm on the tree; its output kept, a failed scriptlet a problem.
rpm_in() {
    local root=$1
    shift
    local log=$work/rpm.log
    if ! rpm --root "$root" --nodeps --noplugins "$@" > "$log" 2>&1; then
        problems+=("rpm $* failed: $(cat "$log")")
        echo "rpm-install-test: FAIL: rpm $*: $(cat "$log")" >&2
        return 0
    fi
    check "rpm $*: a scriptlet failed: $(cat "$log")" no_failure "$log"
    grep -i "warning" "$log" >&2 || true
}
no_failure() { ! grep -qi -e 'scriptlet failed' -e 'execv' "$1"; }
not_cmp() { ! cmp -s "$1" "$2"; }

new_tree() {
    local root=$work/tree-$1
    mkdir -p "$root/bin" "$root/tmp" "$root/dev"
    # The scriptlets send output to /dev/null.
    mknod -m 666 "$root/dev/null" c 1 3
    cp /bin/busybox "$root/bin/busybox"
    ln -s busybox "$root/bin/sh"
    rpm --root "$root" --initdb >&2
    echo "$root"
}

for p in vmigrater vmigrater-hv-agent; do
    case $p in
        vmigrater) crate=vmigrater conf=vmigrater.toml ;;
        vmigrater-hv-agent) crate=hv-agent conf=hv-agent.toml ;;
    esac
    first=$out/$p-$version-1.$arch.rpm
    [ -f "$first" ] || { echo "rpm-install-test: $first missing: run make package first" >&2; exit 1; }

    # The next release: this one with release 2 and a default conffile that gained a line.
    mkdir -p "$work/next" "$work/$p"
    cp "$dist/$p/$conf" "$work/$p/$conf.orig"
    restore+=("$p/$conf")
    printf '\n# A default the next release brings (rpm-install-test).\n' >> "$dist/$p/$conf"
    cargo generate-rpm --profile dist -p "crates/$crate" --target-dir "$target" \
        -o "$work/next/" -s 'release = "2"' > /dev/null
    cp "$work/$p/$conf.orig" "$dist/$p/$conf"
    next=$work/next/$p-$version-2.$arch.rpm
    [ -f "$next" ] || { echo "rpm-install-test: building $next failed" >&2; exit 1; }
    new_conf=$work/$p-$conf.next
    # rpm2cpio of rpm 4.18.0 exits 1 after a whole archive; cpio judges what it wrote.
    rpm2cpio "$next" > "$work/next.cpio" || true
    cpio -i --quiet --to-stdout "./etc/vmigrater/$conf" < "$work/next.cpio" > "$new_conf"
    [ -s "$new_conf" ] || { echo "rpm-install-test: no /etc/vmigrater/$conf in $next" >&2; exit 1; }
    check "$p: the next release's conffile does not differ from this one's" \
        not_cmp "$new_conf" "$work/$p/$conf.orig"
    etc=etc/vmigrater/$conf

    for user in unchanged changed; do
        root=$(new_tree "$p-$user")
        rpm_in "$root" -i "$first"
        check "$p ($user): not installed after rpm -i" rpm --root "$root" -q "$p" > /dev/null
        while read -r f; do
            check "$p ($user): $f listed but not installed" test -e "$root$f"
        done < <(rpm --root "$root" -ql "$p")
        check "$p ($user): /$etc differs from the shipped default" cmp -s "$root/$etc" "$work/$p/$conf.orig"
        check "$p ($user): the installed binary does not run" \
            sh -c "'$root/usr/bin/$p' --version | grep -qF '$version'"
        if [ $user = changed ]; then
            printf '# changed by the operator\n' >> "$root/$etc"
            cp "$root/$etc" "$work/user-$p.toml"
        fi

        rpm_in "$root" -U "$next"
        check "$p ($user): release 2 not installed after rpm -U" \
            test "$(rpm --root "$root" -q --qf '%{RELEASE}' "$p")" = 2
        if [ $user = unchanged ]; then
            check "$p (unchanged): the conffile did not follow the new default" cmp -s "$root/$etc" "$new_conf"
            check "$p (unchanged): an .rpmnew beside an unmodified conffile" test ! -e "$root/$etc.rpmnew"
        else
            check "$p (changed): the operator's conffile was not kept" cmp -s "$root/$etc" "$work/user-$p.toml"
            check "$p (changed): no $etc.rpmnew with the new default" cmp -s "$root/$etc.rpmnew" "$new_conf"
        fi

        rm -f "$root/$etc.rpmnew"
        rpm_in "$root" -e "$p"
        check "$p ($user): still installed after rpm -e" sh -c "! rpm --root '$root' -q '$p' > /dev/null"
        left=$(cd "$root" && find . -path ".$dbpath" -prune -o -path ./bin -prune -o -path ./tmp -prune -o -path ./dev -prune -o \( -type f -o -type l \) -print | sort)
        if [ $user = unchanged ]; then
            check "$p (unchanged): files left after rpm -e: $left" test -z "$left"
        else
            check "$p (changed): rpm -e left $left, not just ./$etc.rpmsave" test "$left" = "./$etc.rpmsave"
            check "$p (changed): the .rpmsave is not the operator's file" cmp -s "$root/$etc.rpmsave" "$work/user-$p.toml"
        fi
    done
done

if [ ${#problems[@]} -gt 0 ]; then
    echo "rpm-install-test: ${#problems[@]} problem(s), $checks check(s) passed" >&2
    exit 1
fi
echo "rpm-install-test: both RPMs installed, upgraded (conffile unchanged and changed) and erased: $checks checks passed"
