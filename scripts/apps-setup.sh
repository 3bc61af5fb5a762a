#!/usr/bin/env bash
# Installs the real applications of `make bench-apps` from Debian's packages: PostgreSQL
# (server and pgbench), nginx, wrk. Their packaged services are stopped and disabled: the
# benchmark starts its own servers with their own data under /var/tmp/vmigrater-apps.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/debs.sh
need_debs apps-setup postgresql postgresql-contrib nginx-light wrk util-linux tar coreutils
for svc in postgresql nginx; do
    systemctl disable --now "$svc" >/dev/null 2>&1 || service "$svc" stop >/dev/null 2>&1 || true
done
