#!/usr/bin/env bash
# make results: the README's results tables, measured again from one build and written
# from their JSON. The plan is fixed here, in the tree, before any run: the repetitions,
# run lengths, schedules, seeds and modes of every table. A cell is never re-run alone:
# a re-run is this whole command again, and the first run's files stay in git's history.
#
#   RESULTS_PARTS=host,apps_random,apps_none
#                             which parts (default: all); every part of one README
#                             must come from one build (`tables.py check` says so)
#   RESULTS_DIRTY=1           run on a tree with changes: the files say `-dirty`, and
#                             `tables.py check` refuses them in the README
#   RESULTS_SMOKE=1           every part for seconds, into target/results-smoke, the
#                             README untouched: to see the pipeline work, not a result
#   RESULTS_AT=COMMIT         measure that commit (default: HEAD), built in a worktree
#                             of its own under target/results-at: a README of one build
#                             whose parts run on different days names it; and the tree
#                             here may move on while a part runs (a commit here would
#                             otherwise make the benchmarks refuse the daemon binary
#                             mid-run as built from another commit). The files are
#                             written here.
#
# Root (the benchmarks take CPUs away in hard-IRQ context). Time with the defaults:
# host ~75 min (6 cells x 7 modes x 8 reps x 10 s), apps_random ~112 min (6 modes x 8
# reps x 120 s and start-up), apps_none ~95 min (5 modes): ~4.7 h in all, so the parts
# may run on different days at one commit (RESULTS_AT).
# The whole script is one brace group, read in full before any of it runs: bash reads a
# script as it goes, so an edit or checkout of this file during a part's hours would
# otherwise change what the running command does next.
{
set -euo pipefail
cd "$(dirname "$0")/.."

parts=${RESULTS_PARTS:-host,apps_random,apps_none}
smoke=${RESULTS_SMOKE:-}
dirty=$(git status --porcelain --untracked-files=no)
if [ -n "$dirty" ] && [ -z "${RESULTS_AT:-}" ] && [ "${RESULTS_DIRTY:-}" != 1 ]; then
    echo "make results: the tree has uncommitted changes (git status); commit them, or" >&2
    echo "set RESULTS_DIRTY=1 to measure anyway (the files will say -dirty)" >&2
    exit 1
fi
if [ "$(id -u)" != 0 ]; then
    echo "make results: needs root (irq-steal and the host model are BPF programs)" >&2
    exit 1
fi
here=$PWD
commit=$(git rev-parse --short=12 HEAD)
if [ -z "${RESULTS_AT:-}" ] && { [ -n "$dirty" ] || [ -n "$smoke" ]; }; then
    # A dirty tree is measured where it is (its changes are in no commit to check out),
    # and so is a smoke, which checks the pipeline, not a build.
    if [ -n "$dirty" ]; then commit="$commit-dirty"; fi
else
    commit=$(git rev-parse --short=12 "${RESULTS_AT:-HEAD}^{commit}")
    tree=target/results-at/$commit
    [ -d "$tree" ] || git worktree add --detach "$tree" "$commit"
    # The crates.io dependencies built here serve the worktree too (its own crates build
    # again, under its own path): minutes instead of a cold release build.
    if [ ! -d "$tree/target/release" ] && [ -d target/release ]; then
        mkdir -p "$tree/target" && cp -a target/release "$tree/target/"
    fi
    (cd "$tree" && cargo build --release --workspace --bins)
fi
out=target/results
dest=benches/results
# A smoke never writes where a real result lives.
[ -n "$smoke" ] && out=target/results-smoke && dest=$out
mkdir -p "$out"

# A benchmark of the build measured: this tree's, or RESULTS_AT's worktree's.
bench() {
    (cd "${tree:-.}" && cargo bench -p vmigrater-testbed --bench "$@")
}

# part NAME: whether it was asked for.
part() {
    case ",$parts," in *",$1,"*) return 0 ;; *) return 1 ;; esac
}

# The plan. Smoke runs the same cells and modes for a second or two each.
if [ -n "$smoke" ]; then
    host_len=(--reps 1 --secs 1 --warmup-secs 1 --cells fair:2,credit:2)
    apps_len=(--reps 1 --secs 2 --warmup-secs 1)
else
    host_len=(--reps 8 --secs 10)
    apps_len=(--reps 8 --secs 120)
fi
written=()
if part host; then
    # Both halves with a host that reacts: the 4 KiB reader, k = 2, 3, 4 under both policies;
    # two ceilings: the reader pinned in the guest, and that with the agent's exchange held
    # by the host from the start (host_oracle).
    bench host -- "${host_len[@]}" \
        --modes vanilla,vmigrater,agent,both,governor,pinned,host_oracle --out "$here/$out"
    cp "$out/host.json" "$dest/results-host-$commit.json"
    written+=("$dest/results-host-$commit.json")
fi
# PostgreSQL under hard-IRQ deschedules, long enough for the move guard to probe inside
# every run (it trusts a kept task 30 s first); three oracles: the server and its client
# pinned to the completion vCPU with and without the daemon's kept slice, and every task
# moved ahead of each window knowing the plan.
apps_modes=vanilla,vmigrater,pinned_all,pinned_all_slice,sched_oracle
if part apps_random; then
    # Random phase over three seeds, the repetitions spread over them. Beside the plan's
    # modes, the user's cap on what the daemon takes from co-located work: no kept slice
    # (vmigrater_no_slice), the row that shows what capping costs and gives back.
    bench apps -- "${apps_len[@]}" --apps pg_select_c1 --only rphase --seeds 1,2,3 \
        --modes "$apps_modes,vmigrater_no_slice" --tag random --out "$here/$out"
    cp "$out/apps-random.json" "$dest/results-apps_random-$commit.json"
    written+=("$dest/results-apps_random-$commit.json")
fi
if part apps_none; then
    # Nothing taken away: what the daemon costs where no deschedule gives it anything to
    # gain (the oracles' pinning may still gain by itself).
    bench apps -- "${apps_len[@]}" --apps pg_select_c1 --only none \
        --modes "$apps_modes" --tag none --out "$here/$out"
    cp "$out/apps-none.json" "$dest/results-apps_none-$commit.json"
    written+=("$dest/results-apps_none-$commit.json")
fi
if [ -n "$smoke" ]; then
    # The smoke checks the tables can be drawn, not their numbers.
    for f in "${written[@]}"; do
        case "$f" in
            *results-host-*) python3 benches/host_table.py "$f" > /dev/null ;;
            *results-apps_*) python3 benches/apps_table.py --readme "$f" > /dev/null ;;
        esac
    done
    echo "make results (smoke): every part ran and its table was drawn; README untouched"
    exit 0
fi
# Point the README's table markers at the new files and write the tables from them.
for f in "${written[@]}"; do
    kind=${f#"$dest"/results-}
    kind=${kind%%-*}
    if ! grep -q "benches/results/results-$kind-" README.md; then
        case $kind in
            host) cmd="benches/host_table.py $f" ;;
            *) cmd="benches/apps_table.py --readme $f" ;;
        esac
        echo "make results: README.md has no $kind table yet; put the line" >&2
        echo "  <!-- table: $cmd -->" >&2
        echo "where it belongs in '## Results' and run: python3 benches/tables.py write README.md" >&2
        continue
    fi
    sed -i -E "s#benches/results/results-$kind-[0-9a-f]+(-dirty)?\.json#$f#g" README.md
done
python3 benches/tables.py write README.md
python3 benches/tables.py check README.md
if [ ${#written[@]} -eq 0 ]; then
    echo "make results: no part asked for ($parts): nothing measured, README.md checked"
else
    echo "make results: ${written[*]} written; README.md's tables regenerated from build $commit"
fi
exit
}
