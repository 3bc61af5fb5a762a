#!/usr/bin/env bash
# `make lint` (so `make test` and CI): the Prometheus files in packaging/prometheus/ as
# Prometheus reads them. Each alert and recording rules file passes `promtool check rules`
# and its unit test (<name>.test.yml next to it) `promtool test rules`; the example scrape
# and federation configs pass `promtool check config`. Installs promtool (Debian's prometheus) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/debs.sh
need_promtool alerts-check
dir=packaging/prometheus
rules=("$dir"/*-alerts.yml "$dir"/*-rules.yml)
[ -e "${rules[0]}" ] || { echo "alerts-check: no $dir/*-alerts.yml" >&2; exit 1; }
promtool check rules "${rules[@]}"
for r in "${rules[@]}"; do
    t=${r%.yml}.test.yml
    [ -f "$t" ] || { echo "alerts-check: $r has no unit test $t" >&2; exit 1; }
    promtool test rules "$t"
done
promtool check config --syntax-only "$dir/scrape.yml" "$dir/federate.yml"
