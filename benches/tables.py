#!/usr/bin/env python3
"""The results tables of the docs, written from their JSON and checked against it.

A generated table in README.md or benches/RESULTS.md sits under a marker naming the
command that writes it, from the repository's root:

    <!-- table: benches/host_table.py benches/results/host-fadc5fc.json -->
    <!-- benches/results/host-fadc5fc.json: commit ..., kernel ..., 8 reps x 6.0 s -->
    | host, vCPUs per CPU | ... |
    |---|...|

The block under the marker is the command's output, down to the first line that is
neither a table row nor an HTML comment.

    tables.py check [FILE ...]   exit 1, naming file and line, where a block differs
    tables.py write [FILE ...]   rewrite every block from its command

FILE defaults to README.md and benches/RESULTS.md. `make lint` runs `check`. `check` also
holds the README to one build: every results file its tables cite names a clean commit
(not `-dirty`, not unknown), and the same one (`make results` regenerates them together).
RESULTS.md, the history, may cite many builds. And every file in benches/results must be
cited by README.md or benches/RESULTS.md (by name, `{a,b}` alternatives or a `*` pattern):
a result nobody cites leaves the tree (git keeps it).
"""
import fnmatch
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- table: "
DEFAULT_FILES = ["README.md", "benches/RESULTS.md"]


def block_end(lines, start):
    """Index after the generated block that starts at `start`."""
    i = start
    while i < len(lines) and (lines[i].startswith("|") or lines[i].startswith("<!-- benches/")):
        i += 1
    return i


def generate(command, where):
    """The command's output lines; a command outside benches/ or one that fails is an
    error naming the marker."""
    argv = shlex.split(command)
    if not argv or not argv[0].startswith("benches/") or not argv[0].endswith(".py"):
        raise SystemExit(f"{where}: a table's command must be a benches/*.py script: {command!r}")
    run = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if run.returncode != 0:
        raise SystemExit(f"{where}: `{command}` failed:\n{run.stderr.strip()}")
    return [line for line in run.stdout.splitlines() if line.strip()]


def blocks(lines):
    """(marker line index, command, block start, block end) for each marker."""
    for i, line in enumerate(lines):
        if line.startswith(MARKER) and line.rstrip().endswith("-->"):
            command = line[len(MARKER):].rstrip()[: -len("-->")].strip()
            yield i, command, i + 1, block_end(lines, i + 1)


def cited_builds(name, lines):
    """(line, results file, its commit) of every results file the tables of `lines` cite."""
    for marker, command, _, _ in blocks(lines):
        for arg in shlex.split(command)[1:]:
            if arg.startswith("benches/results/") and arg.endswith(".json"):
                commit = json.loads((ROOT / arg).read_text()).get("commit") or "unknown"
                yield f"{name}:{marker + 1}", arg, commit


def one_build(name, lines):
    """Why the README's tables are not from one clean build; empty when they are."""
    cited = list(cited_builds(name, lines))
    errors = [f"{where}: {path} is from build {commit}: a README table needs a clean commit"
              for where, path, commit in cited if commit.endswith("-dirty") or commit == "unknown"]
    builds = sorted({commit for _, _, commit in cited})
    if len(builds) > 1:
        errors.append(f"{name}: its tables come from {len(builds)} builds ({', '.join(builds)}): "
                      "`make results` regenerates them from one")
    return errors


def expand_braces(text):
    """`x-{a,b}.json` as `x-a.json x-b.json`, nested or repeated, as a shell would."""
    brace = re.compile(r"([A-Za-z0-9_.*/-]*)\{([^{}\s]*)\}([A-Za-z0-9_.*/-]*)")
    while True:
        text, n = brace.subn(lambda m: " ".join(m[1] + a + m[3] for a in m[2].split(",")), text)
        if not n:
            return text


def uncited(docs=("README.md", "benches/RESULTS.md")):
    """Results files that none of `docs` cites, by name or by a `*` pattern."""
    text = expand_braces("\n".join((ROOT / d).read_text() for d in docs))
    names = set(re.findall(r"[A-Za-z0-9_.*-]+\.(?:json|png)", text))
    # A pattern names a family by its prefix; `*.json` names none.
    patterns = [n for n in names if "*" in n and not n.startswith("*")]

    def cited(name):
        return name in names or any(fnmatch.fnmatch(name, p) for p in patterns)

    # A plot goes with the runs it was drawn from.
    return [f"benches/results/{f.name}: no line of {' or '.join(docs)} cites it; "
            "remove it (git keeps it) or say what it shows"
            for f in sorted((ROOT / "benches/results").iterdir())
            if not cited(f.name) and not (f.suffix == ".png" and cited(f.stem + ".json"))]


def main(argv):
    if not argv or argv[0] not in ("check", "write"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    mode, files = argv[0], argv[1:] or DEFAULT_FILES
    stale, seen = [], 0
    for name in files:
        path = ROOT / name
        lines = path.read_text().splitlines()
        out, last = [], 0
        for marker, command, start, end in blocks(lines):
            seen += 1
            fresh = generate(command, f"{name}:{marker + 1}")
            if lines[start:end] != fresh:
                stale.append(f"{name}:{start + 1}: the table differs from `{command}`")
            out += lines[last:start] + fresh
            last = end
        out += lines[last:]
        if name == "README.md":
            stale += one_build(name, lines)
        if mode == "write" and out != lines:
            path.write_text("\n".join(out) + "\n")
    if not argv[1:]:
        stale += uncited()
    if mode == "check":
        for s in stale:
            print(s, file=sys.stderr)
        if stale:
            print("run `python3 benches/tables.py write` (or `make results`) and commit the result",
                  file=sys.stderr)
            return 1
        print(f"{seen} generated tables agree with their JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
