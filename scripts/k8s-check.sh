#!/usr/bin/env bash
# `make lint` (so `make test` and CI): the Kubernetes manifests in packaging/kubernetes/
# against the Kubernetes schemas, and the channel hook run on a domain (k8s_check.py).
# Installs kubernetes-validate (PyPI; it carries the schemas, nothing is fetched at run
# time) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import kubernetes_validate, jsonschema, yaml' 2>/dev/null; then
    echo "k8s-check: installing kubernetes-validate from PyPI" >&2
    python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate==1.37.0
fi
python3 scripts/k8s_check.py packaging/kubernetes
