#!/usr/bin/env bash
# `make package-check`: builds the packages (scripts/package.sh; `--no-build` checks the ones
# already in target/package/) and checks what they contain: the exact file lists with modes
# and owners, conffiles / %config(noreplace), dependencies, maintainer scripts and RPM
# scriptlets, the shipped config against the binary's `default-config`, the shipped unit,
# udev rule and Prometheus alert rules against the repository's, lintian (no error, no warning that is not overridden
# with its reason in packaging/debian/*.lintian-overrides) and `systemd-analyze verify` of
# both units. Reports every problem it finds, then exits 1 if there was any.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
out=$target/package

if [ "${1:-}" != "--no-build" ]; then
    scripts/package.sh
fi

problems=()
checks=0
fail() {
    problems+=("$*")
    echo "package-check: FAIL: $*" >&2
}
ok() { checks=$((checks + 1)); }
not_grep() { ! grep -q -- "$1" "$2"; }
# check <description> <command...>: one assertion.
check() {
    local what=$1
    shift
    if "$@"; then ok; else fail "$what"; fi
}

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)
deb_arch=$(dpkg --print-architecture)
rpm_arch=$(uname -m)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# ---- the four packages, and nothing else
expected_pkgs=()
for p in vmigrater vmigrater-hv-agent; do
    expected_pkgs+=("${p}_${version}-1_${deb_arch}.deb" "${p}-${version}-1.${rpm_arch}.rpm")
done
printf '%s\n' "${expected_pkgs[@]}" | sort > "$work/pkgs.want"
(cd "$out" 2>/dev/null && ls -1) | sort > "$work/pkgs.have" || true
if ! diff -u "$work/pkgs.want" "$work/pkgs.have" > "$work/pkgs.diff"; then
    fail "$out/ does not hold exactly the expected packages (- missing, + unexpected):
$(tail -n +3 "$work/pkgs.diff")"
else
    ok
fi

# compare <what> <want-file> <have-file>: exact line sets, differences named.
compare() {
    local what=$1 want=$2 have=$3 missing extra
    missing=$(comm -23 <(sort "$want") <(sort "$have"))
    extra=$(comm -13 <(sort "$want") <(sort "$have"))
    if [ -n "$missing" ] || [ -n "$extra" ]; then
        fail "$what differs from what is expected:${missing:+
  missing:
$(sed 's/^/    /' <<< "$missing")}${extra:+
  unexpected:
$(sed 's/^/    /' <<< "$extra")}"
    else
        ok
    fi
}

for p in vmigrater vmigrater-hv-agent; do
    case $p in
        vmigrater) conf=vmigrater.toml ;;
        vmigrater-hv-agent) conf=hv-agent.toml ;;
    esac
    man_pages=("$p" "$p-run" "$p-check" "$p-status" "$p-default-config")
    if [ "$p" = vmigrater ]; then man_pages+=("$p-record" "$p-explain"); fi
    deb=$out/${p}_${version}-1_${deb_arch}.deb
    rpm=$out/${p}-${version}-1.${rpm_arch}.rpm

    # ---- .deb: files (mode owner path), conffiles, control, maintainer scripts
    if [ -f "$deb" ]; then
        {
            echo "-rwxr-xr-x 0/0 ./usr/bin/$p"
            echo "-rw-r--r-- 0/0 ./etc/vmigrater/$conf"
            echo "-rw-r--r-- 0/0 ./usr/lib/systemd/system/$p.service"
            echo "-rw-r--r-- 0/0 ./usr/share/bash-completion/completions/$p"
            echo "-rw-r--r-- 0/0 ./usr/share/zsh/vendor-completions/_$p"
            echo "-rw-r--r-- 0/0 ./usr/share/fish/vendor_completions.d/$p.fish"
            echo "-rw-r--r-- 0/0 ./usr/share/doc/$p/README.md"
            echo "-rw-r--r-- 0/0 ./usr/share/doc/$p/copyright"
            echo "-rw-r--r-- 0/0 ./usr/share/doc/$p/changelog.Debian.gz"
            echo "-rw-r--r-- 0/0 ./usr/share/lintian/overrides/$p"
            echo "-rw-r--r-- 0/0 ./usr/share/$p/prometheus/$p-alerts.yml"
            for m in "${man_pages[@]}"; do echo "-rw-r--r-- 0/0 ./usr/share/man/man8/$m.8.gz"; done
            if [ "$p" = vmigrater ]; then
                echo "-rw-r--r-- 0/0 ./usr/lib/udev/rules.d/99-vmigrater.rules"
            fi
        } > "$work/$p.deb.want"
        dpkg-deb -c "$deb" | awk '$1 !~ /^d/ { print $1, $2, $6 }' > "$work/$p.deb.have"
        compare "$deb: files (mode owner path)" "$work/$p.deb.want" "$work/$p.deb.have"

        ctl=$work/$p.ctl
        dpkg-deb -e "$deb" "$ctl"
        check "$deb: conffiles must be exactly /etc/vmigrater/$conf" \
            test "$(cat "$ctl/conffiles" 2>/dev/null)" = "/etc/vmigrater/$conf"
        depends=$(dpkg-deb -f "$deb" Depends)
        want_deps=(libc6)
        [ "$p" = vmigrater ] && want_deps+=(libelf1 zlib1g)
        for d in "${want_deps[@]}"; do
            check "$deb: Depends ($depends) lacks $d (\$auto from the binary's libraries)" \
                grep -qE "(^|, )$d( |,|$)" <<< "$depends"
        done
        check "$deb: Package field is not $p" test "$(dpkg-deb -f "$deb" Package)" = "$p"
        for s in postinst prerm postrm; do
            check "$deb: maintainer script $s missing or not executable" test -x "$ctl/$s"
        done
        check "$deb: postinst does not enable $p.service" \
            grep -q "deb-systemd-helper enable $p.service" "$ctl/postinst"
        check "$deb: prerm does not stop $p.service on removal" \
            grep -q "deb-systemd-invoke stop $p.service" "$ctl/prerm"
        check "$deb: postrm does not purge $p.service's state" \
            grep -q "deb-systemd-helper purge $p.service" "$ctl/postrm"
        if [ "$p" = vmigrater ]; then
            check "$deb: postinst does not start vmigrater.service on install" \
                grep -q "_dh_action=start" "$ctl/postinst"
        else
            check "$deb: postinst must not start $p.service (configure VMs first)" \
                not_grep "_dh_action=start" "$ctl/postinst"
        fi

        # ---- the installed tree: binary runs, config = its defaults, unit/rule = repo's
        root=$work/$p.root
        mkdir -p "$root"
        dpkg-deb -x "$deb" "$root"
        check "$deb: usr/bin/$p --version does not run" "$root/usr/bin/$p" --version > /dev/null
        if "$root/usr/bin/$p" default-config > "$work/$p.defaults" 2> "$work/$p.defaults.err"; then
            check "$deb: /etc/vmigrater/$conf is not \`$p default-config\`" \
                cmp -s "$work/$p.defaults" "$root/etc/vmigrater/$conf"
        else
            fail "$deb: \`$p default-config\` failed: $(cat "$work/$p.defaults.err")"
        fi
        check "$deb: the unit is not systemd/$p.service" \
            cmp -s "systemd/$p.service" "$root/usr/lib/systemd/system/$p.service"
        if [ "$p" = vmigrater ]; then
            check "$deb: the udev rule is not systemd/99-vmigrater.rules" \
                cmp -s systemd/99-vmigrater.rules "$root/usr/lib/udev/rules.d/99-vmigrater.rules"
        fi
        check "$deb: the alert rules are not packaging/prometheus/$p-alerts.yml" \
            cmp -s "packaging/prometheus/$p-alerts.yml" "$root/usr/share/$p/prometheus/$p-alerts.yml"
        check "$deb: copyright does not name Apache-2.0" \
            grep -q "^License: Apache-2.0" "$root/usr/share/doc/$p/copyright"

        # ---- lintian: no errors, no warnings that are not overridden with a reason
        if lintian --fail-on error,warning -EIL +pedantic --tag-display-limit 0 "$deb" \
            > "$work/$p.lintian" 2>&1; then
            ok
        else
            fail "$deb: lintian found errors or warnings (fix them, or override a tag with its reason in packaging/debian/$p.lintian-overrides):
$(grep -E '^[EW]:' "$work/$p.lintian" || cat "$work/$p.lintian")"
        fi
        grep -E '^[IPX]:' "$work/$p.lintian" | sed 's/^/package-check: lintian note: /' || true

        # ---- systemd-analyze verify: the shipped unit, its ExecStart pointed at the
        # shipped binary and its Documentation= at the shipped man pages.
        units=$work/$p.units
        mkdir -p "$units"
        sed "s#^ExecStart=/usr/bin/#ExecStart=$root/usr/bin/#" \
            "$root/usr/lib/systemd/system/$p.service" > "$units/$p.service"
        if MANPATH=$root/usr/share/man systemd-analyze verify "$units/$p.service" \
            > "$work/$p.verify" 2>&1 && ! grep -q "$p.service" "$work/$p.verify"; then
            ok
        else
            fail "$p.service: systemd-analyze verify:
$(cat "$work/$p.verify")"
        fi
        if [ "$p" = vmigrater ] && udevadm verify --help > /dev/null 2>&1; then
            check "99-vmigrater.rules: udevadm verify" \
                udevadm verify "$root/usr/lib/udev/rules.d/99-vmigrater.rules"
        fi
    fi

    # ---- .rpm: files (path|mode|owner|flags), config(noreplace), scriptlets, requires
    if [ -f "$rpm" ]; then
        {
            echo "/usr/bin/$p|-rwxr-xr-x|root|"
            echo "/etc/vmigrater/$conf|-rw-r--r--|root|cn"
            echo "/usr/lib/systemd/system/$p.service|-rw-r--r--|root|"
            echo "/usr/share/bash-completion/completions/$p|-rw-r--r--|root|"
            echo "/usr/share/zsh/site-functions/_$p|-rw-r--r--|root|"
            echo "/usr/share/fish/vendor_completions.d/$p.fish|-rw-r--r--|root|"
            echo "/usr/share/doc/$p/README.md|-rw-r--r--|root|d"
            echo "/usr/share/licenses/$p/LICENSE|-rw-r--r--|root|d"
            echo "/usr/share/$p/prometheus/$p-alerts.yml|-rw-r--r--|root|"
            for m in "${man_pages[@]}"; do echo "/usr/share/man/man8/$m.8.gz|-rw-r--r--|root|d"; done
            if [ "$p" = vmigrater ]; then
                echo "/usr/lib/udev/rules.d/99-vmigrater.rules|-rw-r--r--|root|"
            fi
        } > "$work/$p.rpm.want"
        rpm -qp --qf '[%{FILENAMES}|%{FILEMODES:perms}|%{FILEUSERNAME}|%{FILEFLAGS:fflags}\n]' \
            "$rpm" > "$work/$p.rpm.have"
        compare "$rpm: files (path|mode|owner|flags: c config, n noreplace, d doc)" \
            "$work/$p.rpm.want" "$work/$p.rpm.have"
        check "$rpm: rpm -qpc must list exactly /etc/vmigrater/$conf" \
            test "$(rpm -qpc "$rpm")" = "/etc/vmigrater/$conf"
        check "$rpm: Name is not $p" test "$(rpm -qp --qf '%{NAME}' "$rpm")" = "$p"
        check "$rpm: License is not Apache-2.0" \
            test "$(rpm -qp --qf '%{LICENSE}' "$rpm")" = "Apache-2.0"
        check "$rpm: digests do not verify (rpm -K)" rpm -K --nosignature "$rpm" > /dev/null
        rpm -qp --scripts "$rpm" > "$work/$p.scripts"
        for s in postinstall preuninstall postuninstall; do
            check "$rpm: no $s scriptlet" grep -q "^$s scriptlet" "$work/$p.scripts"
        done
        check "$rpm: the scriptlets do not handle $p.service" \
            grep -q "disable --now $p.service" "$work/$p.scripts"
        if [ "$p" = vmigrater ]; then
            rpm -qpR "$rpm" > "$work/$p.requires"
            for lib in 'libelf.so.1()(64bit)' 'libz.so.1()(64bit)'; do
                check "$rpm: does not require $lib" grep -qxF "$lib" "$work/$p.requires"
            done
        fi
    fi
done

if [ ${#problems[@]} -gt 0 ]; then
    echo "package-check: FAILED: ${#problems[@]} problem(s), $checks check(s) passed:" >&2
    for p in "${problems[@]}"; do echo "  - ${p%%$'\n'*}" >&2; done
    exit 1
fi
echo "package-check: ok, $checks checks passed on ${#expected_pkgs[@]} packages ($(cd "$out" && du -ch -- "${expected_pkgs[@]}" | tail -n1 | cut -f1) in $out/)"
