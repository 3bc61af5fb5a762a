#!/usr/bin/env python3
"""`make lint`: the Kubernetes manifests in packaging/kubernetes/.

- Every object of a built-in kind passes `kubernetes-validate --strict` (the Kubernetes
  OpenAPI schemas, unknown fields rejected).
- The ServiceMonitor, a Prometheus Operator kind those schemas lack, passes the schema
  below: the part of monitoring.coreos.com/v1 that it uses, with no other field allowed.
- No object of another kind goes unchecked.
- The channel hook's script, run by sh on a domain shaped as KubeVirt defines it, adds
  exactly one org.vmigrater.hint.0 channel inside <devices>, leaves a domain that has one
  unchanged, and fails on a domain without <devices>.
"""
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import yaml

PORT = "org.vmigrater.hint.0"

LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICE_MONITOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": LABELS},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": LABELS},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {"type": "array", "items": {"type": "string"}},
                                        "targetLabel": {"type": "string"},
                                        "action": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}

# A domain as KubeVirt hands it to the hook (abridged): Go's encoder, double quotes.
DOMAIN = """<domain type="kvm" xmlns:qemu="http://libvirt.org/schemas/domain/qemu/1.0"><name>ns1_vmi</name><memory unit="b">1073741824</memory><os><type arch="x86_64" machine="q35">hvm</type></os><devices><interface type="ethernet"><target dev="tap0" managed="no"></target><model type="virtio-non-transitional"></model></interface><channel type="unix"><target name="org.qemu.guest_agent.0" type="virtio"></target></channel><controller type="virtio-serial" index="0" model="virtio-non-transitional"></controller></devices><metadata><kubevirt xmlns="http://kubevirt.io"><uid>1</uid></kubevirt></metadata></domain>"""


def fail(msg):
    print(f"k8s-check: {msg}", file=sys.stderr)
    sys.exit(1)


def hook(script, domain):
    with tempfile.NamedTemporaryFile("w", suffix=".sh") as f:
        f.write(script)
        f.flush()
        return subprocess.run(["sh", f.name, "--vmi", "{}", "--domain", domain], capture_output=True, text=True)


def ours(xml_text):
    devices = ET.fromstring(xml_text).find("devices")
    if devices is None:
        fail("the hook's output has no <devices>")
    return [c for c in devices.findall("channel") if (c.find("target") is not None and c.find("target").get("name") == PORT)]


def main(folder):
    folder = Path(folder)
    core, monitors, script = [], 0, None
    for path in sorted(folder.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if not docs:
            fail(f"{path}: no object")
        for d in docs:
            kind = d.get("kind")
            where = f"{path}: {kind} {d.get('metadata', {}).get('name')}"
            if kind == "ServiceMonitor":
                try:
                    jsonschema.validate(d, SERVICE_MONITOR)
                except jsonschema.ValidationError as e:
                    fail(f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}")
                monitors += 1
            elif d.get("apiVersion") in ("v1", "apps/v1"):
                if path not in core:
                    core.append(path)
            else:
                fail(f"{where}: kind {kind} of {d.get('apiVersion')} has no schema here")
            if kind == "ConfigMap" and "onDefineDomain" in d.get("data", {}):
                script = d["data"]["onDefineDomain"]
    if monitors == 0 or not core or script is None:
        fail(f"{folder}: expected the agent's objects, a ServiceMonitor and the channel hook")
    r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", *map(str, core)])
    if r.returncode != 0:
        fail("kubernetes-validate rejected the manifests above")

    r = hook(script, DOMAIN)
    if r.returncode != 0:
        fail(f"the channel hook failed: {r.stderr}")
    if len(ours(r.stdout)) != 1:
        fail(f"the channel hook did not add exactly one {PORT} channel: {r.stdout}")
    if len(ET.fromstring(r.stdout).find("devices").findall("channel")) != 2:
        fail(f"the channel hook lost the guest agent's channel: {r.stdout}")
    again = hook(script, r.stdout.strip())
    if again.returncode != 0 or len(ours(again.stdout)) != 1:
        fail(f"the channel hook is not idempotent: {again.stdout}{again.stderr}")
    if hook(script, "<domain><name>x</name></domain>").returncode == 0:
        fail("the channel hook accepted a domain without <devices>")
    print(f"k8s-check: {len(core)} manifest file(s) against the Kubernetes schemas, {monitors} ServiceMonitor, the channel hook: ok")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "packaging/kubernetes")
