# Sourced by the setup scripts: `need_debs WHO PACKAGE...` installs the Debian packages that
# are not installed yet (nothing, and no apt call, when all are), saying which and for whom.
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi

need_debs() {
    local who=$1 p
    shift
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -gt 0 ] || return 0
    echo "$who: installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# `need_promtool WHO`: promtool, from Debian's prometheus package, which also brings a
# Prometheus server: only promtool is wanted, never a server listening on this machine.
need_promtool() {
    if ! dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q "install ok installed"; then
        need_debs "$1" prometheus
        $SUDO systemctl disable --now prometheus 2>/dev/null || true
    fi
}
