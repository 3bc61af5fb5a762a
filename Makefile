# The two commands of the README are `make run` and `make test`.
CARGO ?= cargo
TEST_THREADS ?= 1

.PHONY: setup lab-setup lab-install-test build run test lint bench bench-contention bench-micro bench-lab bench-steal bench-host bench-detection bench-mq bench-gate bench-apps apps-setup results bench-smoke soak fuzz fuzz-smoke package package-check rpm-install-test clean

setup:
	@scripts/setup.sh

# QEMU, static busybox and a Debian guest kernel for the nested-VM lab (tests/lab.rs,
# `make bench-lab`); nothing is installed on the host but the two Debian packages.
lab-setup: setup
	@scripts/lab-setup.sh

build: setup
	$(CARGO) build --release --workspace --bins

# The daemon in the foreground with the default configuration (needs root).
run: build
	./target/release/vmigrater run

# The Prometheus alert and fleet rules with their promtool unit tests and the example
# configs (scripts/alerts-check.sh installs promtool when missing), and the Kubernetes
# manifests against the Kubernetes schemas (scripts/k8s-check.sh) belong to lint as well.
lint: setup
	$(CARGO) fmt --all -- --check
	scripts/alerts-check.sh
	scripts/k8s-check.sh
	python3 benches/tables.py check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Unit tests, then the real-kernel tests (root; built by another user, cargo reports them
# ignored, and run by another user they fail saying so). The integration tests share the
# CPUs with a steal emulator, so they run one at a time. Every test binary runs even when
# one fails (--no-fail-fast): one failure never hides the rest; the run still fails.
test: lint lab-setup
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace --no-fail-fast -- --test-threads=$(TEST_THREADS)

bench-micro: setup
	$(CARGO) bench -p vmigrater-testbed --bench estimator --bench classifier --bench planner --bench credit_core --bench frame_parse

bench-contention: build
	$(CARGO) bench -p vmigrater-testbed --bench bpf_overhead
	$(CARGO) bench -p vmigrater-testbed --bench contention

# The nested-VM benefit benchmark (~40 min; root): JSON + charts in target/bench/, copied to
# benches/results/. Options: make bench-lab LAB_ARGS="--secs 10 --reps 1 --only main".
# Mode vmigrater_oracle runs the lab's daemon, vmigrater-oracle (crate lab-oracle: the
# daemon on the host's known steal schedule), which no package ships.
bench-lab: lab-setup build
	./target/release/vmigrater-lab bench --bin-dir target/release --out target/bench/lab.json $(LAB_ARGS)
	/usr/bin/python3 benches/plot_lab.py target/bench/lab.json target/bench/lab.png target/bench/lab-sweep.png
	cp target/bench/lab.json target/bench/lab.png target/bench/lab-sweep.png benches/results/

bench: bench-micro bench-contention

# The hard-IRQ deschedule benchmark (root; hours with the defaults: 6 schedules × 6
# workloads × 5 modes × 8 reps): JSON + chart in target/bench/, copied to benches/results/.
# Shorter: make bench-steal STEAL_ARGS="--reps 3 --secs 4 --only anti,none --workloads rand4k".
bench-steal: build
	$(CARGO) bench -p vmigrater-testbed --bench steal -- $(STEAL_ARGS)
	cp target/bench/steal.json target/bench/steal.png benches/results/

# The host scheduler in the loop (root; ~105 min with the defaults: 6 cells (fair and credit
# policies, 2, 3 and 4 vCPUs per CPU) x 9 modes x 8 reps x ~14.5 s): bpf/hostmodel.bpf.c
# decides online who holds each CPU, the agent drives it through its `model` backend, the
# steal governor is a baseline. JSON in target/bench/, copied to benches/results/. Shorter:
# make bench-host HOST_ARGS="--reps 2 --secs 4 --cells fair:2 --modes vanilla,agent".
# An application instead of the reader (root; its data built once by apps-setup):
# make bench-host HOST_ARGS="--workload pg_select_c1 --cells fair:2,credit:2 --secs 15".
bench-host: build
	$(CARGO) bench -p vmigrater-testbed --bench host -- $(HOST_ARGS)
	cp target/bench/host*.json benches/results/

# The same deschedules on a disk whose requests complete on the submitting vCPU (a loop
# device over memory, rq_affinity = 2: the geometry of a queue per vCPU), 4 KiB reads,
# modes vanilla, vmigrater, readers pinned to vCPU 0 and moved with the plan, 12 s runs
# as in the README's table (root; ~55 min). Shorter: make bench-mq MQ_ARGS="--reps 3
# --secs 4 --only anti". Killed, it leaves its loop device attached: `losetup -d
# /dev/loopN`, rq_affinity and /sys/module/workqueue/parameters/default_affinity_scope
# (cache) back by hand.
bench-mq: build
	VMIGRATER_BENCH_DIR=$(CURDIR)/target/bench-mq $(CARGO) bench -p vmigrater-testbed --bench steal -- \
		--disk loop --secs 12 --workloads rand4k \
		--only anti,rphase,none,anti:30000:20000,replay:benches/traces/kvm-11ms-2to1.trace \
		--modes vanilla,vmigrater,pinned,sched_oracle $(MQ_ARGS)
	cp target/bench-mq/steal.json benches/results/steal-mq.json

# The bench gate (root; ~20 min): anti-phase and no deschedules, 4 KiB reads and requests,
# 8 interleaved repetitions of 8 s, judged against the floors stated in benches/gate.py
# (0.97x vanilla by the median where nothing can gain). Run before any results claim; not
# in CI (too noisy on a shared machine to fail a build by).
# How soon the detector finds a request task under Xen-like deschedules, by rate or time
# against time in flight alone (root; 8 rounds of 2 s, ~30 s).
bench-detection:
	$(CARGO) bench -p vmigrater-testbed --bench detection -- $(DETECTION_ARGS)
	cp target/bench/detection.json benches/results/

bench-gate: build
	VMIGRATER_BENCH_DIR=$(CURDIR)/target/bench-gate $(CARGO) bench -p vmigrater-testbed --bench steal -- \
		--reps 8 --secs 8 --only anti,none --workloads rand4k,request --modes vanilla,vmigrater,pinned_slice
	/usr/bin/python3 benches/gate.py target/bench-gate/steal.json

# Real applications under the hard-IRQ deschedules (root; PostgreSQL + pgbench, nginx + wrk,
# a tar backup, started cold and measured from their first request; the defaults are a
# day: 6 schedules x 4 apps x 7 modes x 8 reps x 60 s; pick with APPS_ARGS). JSON + chart in target/bench/,
# copied to benches/results/. Shorter: make bench-apps APPS_ARGS="--reps 2 --secs 30
# --only anti,none --apps pg_select_c1". The data (a pgbench database of scale 100, a tree of
# 100,000 files) is built once under /var/tmp/vmigrater-apps (VMIGRATER_APPS_DIR).
apps-setup: setup
	@scripts/apps-setup.sh

bench-apps: apps-setup build
	$(CARGO) bench -p vmigrater-testbed --bench apps -- $(APPS_ARGS)
	cp target/bench/apps*.json target/bench/apps*.png benches/results/

# The README's results tables, measured again from one build on the plan fixed in
# scripts/results.sh, and written from their JSON (root; ~4 h; refuses a tree with
# uncommitted changes). One part: make results RESULTS_PARTS=host (apps_random,
# apps_none); RESULTS_AT=COMMIT measures that commit, built in a worktree.
results: build apps-setup
	scripts/results.sh

# Both programs for an hour in the lab (root): memory and descriptors sampled, the agent
# killed and restarted and the virtio port hot-unplugged every 5 minutes. JSON + chart in
# target/bench/, copied to benches/results/. Shorter: make soak SOAK_ARGS="--minutes 5".
soak: lab-setup build
	./target/release/vmigrater-lab soak --bin-dir target/release --out target/bench/soak.json $(SOAK_ARGS)
	/usr/bin/python3 benches/plot_soak.py target/bench/soak.json target/bench/soak.png
	cp target/bench/soak.json target/bench/soak.png benches/results/

# Every benchmark run once in seconds, not a measurement: so that none can rot unseen (a
# benchmark that no longer starts fails CI). Criterion's test mode runs each micro
# benchmark once; the contention, BPF-overhead, lab and hard-IRQ steal benchmarks run one
# tiny round (the applications' with their data built once under /var/tmp/vmigrater-apps)
# and the soak 30 s with one fault, all writing to target/bench-smoke, never
# over a real result; then `make results`' whole pipeline for seconds (target/results-smoke). Root (CI is). `cargo bench` runs release builds, which start the release
# binaries: built first.
bench-smoke: lab-setup apps-setup
	$(CARGO) build --release --workspace --bins
	$(CARGO) test -p vmigrater-testbed --bench estimator --bench classifier --bench planner --bench credit_core --bench frame_parse
	VMIGRATER_BENCH_DIR=$(CURDIR)/target/bench-smoke VMIGRATER_BENCH_ROUNDS=1 VMIGRATER_BENCH_READS=200 \
		$(CARGO) bench -p vmigrater-testbed --bench bpf_overhead
	VMIGRATER_BENCH_DIR=$(CURDIR)/target/bench-smoke VMIGRATER_BENCH_ROUNDS=1 VMIGRATER_BENCH_SECS=1 \
		VMIGRATER_BENCH_WARMUP_MS=200 VMIGRATER_BENCH_IDLE_SECS=1 \
		$(CARGO) bench -p vmigrater-testbed --bench contention
	./target/release/vmigrater-lab bench --bin-dir target/release --secs 2 --reps 1 --only sweep1 \
		--modes vanilla,vmigrater --out target/bench-smoke/lab.json
	./target/release/vmigrater-lab soak --bin-dir target/release --minutes 0.5 --sample-secs 10 \
		--fault-secs 20 --out target/bench-smoke/soak.json
	/usr/bin/python3 benches/plot_soak.py target/bench-smoke/soak.json target/bench-smoke/soak.png
	$(CARGO) bench -p vmigrater-testbed --bench steal -- --reps 1 --secs 1 --warmup-secs 1 \
		--io-warmup-ms 200 --only none,anti --workloads rand4k --modes vanilla,vmigrater,pinned \
		--out $(CURDIR)/target/bench-smoke
	VMIGRATER_BENCH_DIR=$(CURDIR)/target/bench-smoke $(CARGO) bench -p vmigrater-testbed --bench detection -- --rounds 1 --secs 1
	$(CARGO) bench -p vmigrater-testbed --bench host -- --reps 1 --secs 1 --warmup-secs 1 \
		--cells fair:2 --modes vanilla,both,governor,liar --out $(CURDIR)/target/bench-smoke
	$(CARGO) bench -p vmigrater-testbed --bench apps -- --reps 1 --secs 2 --warmup-secs 1 \
		--only none,anti --apps pg_select_c1,nginx_c4,backup --modes vanilla,vmigrater,pinned_all,pinned_all_slice,sched_oracle \
		--out $(CURDIR)/target/bench-smoke
	RESULTS_SMOKE=1 RESULTS_DIRTY=1 scripts/results.sh

# Coverage-guided fuzzing of the guest channel's framing and messages, the session rules
# and both configuration loaders (fuzz/; installs cargo-fuzz). FUZZ_SECS per target.
FUZZ_SECS ?= 600
fuzz: setup
	scripts/fuzz.sh $(FUZZ_SECS)

# CI's short pass: 60 s per target from the committed corpus.
fuzz-smoke: setup
	FUZZ_SCRATCH=1 scripts/fuzz.sh 60

# .deb and .rpm of both programs into target/package/ (installs cargo-deb, cargo-generate-rpm).
package: setup
	@scripts/package.sh

# `make package`, then checks the packages: exact file lists, conffiles and %config(noreplace),
# dependencies, scriptlets, lintian (no error or warning), systemd-analyze verify. CI runs it.
package-check: setup
	@scripts/package-check.sh

# The .deb of `make package` installed in a Debian 12 guest booting systemd (debootstrap image
# cached in target/lab/debian): systemctl start, /metrics through promtool, two upgrades to
# repacked next releases while the daemon manages a task (anti-phase steal on the host; an
# unchanged conffile follows, a changed one is kept beside .dpkg-dist), systemctl reload,
# apt remove (no task left with a changed mask) and purge. CI runs it after package-check.
lab-install-test: lab-setup
	@scripts/lab-debian.sh
	$(CARGO) run -q -p lab --bin vmigrater-lab -- install-test --packages target/package

# Both RPMs of `make package` installed, upgraded to a next release (conffile unchanged and
# changed by the operator: .rpmnew) and erased (.rpmsave) in `rpm --root` trees, the
# scriptlets run by a static busybox (root). CI runs it after package-check.
rpm-install-test: setup
	@scripts/rpm-install-test.sh

clean:
	$(CARGO) clean
