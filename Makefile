# `make demo` and `make test` each install everything they need first (fresh Debian 12, root).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CKPTSUP := $(VENV)/bin/ckptsup
# libdeflate0: the script-checkpoint check's CRC-32 (several GB/s; zlib's, its fallback, ~0.5 GB/s)
# runc: the dev cluster's OCI containers (dev-cluster up --containers; docs/containers.md)
APT_PACKAGES := slurm-wlm munge tini libdeflate0 runc
DEV_CLUSTER_DIR ?= /tmp/ckptsup-dev-cluster
# Bytecode caches on, whatever the calling shell says: the suite starts thousands of short-lived
# Python processes (CLI calls, supervisors, agents, zygotes, proxies) and each would otherwise
# compile ckptsup's modules (an editable install: no .pyc from pip) and pytest its rewritten tests anew.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup apt venv typecheck demo test test-fast test-slurm test-slurm-versions test-slurm-matrix test-scale fuzz bench gpu-check clean

setup: apt venv

apt:
	@if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v tini >/dev/null \
	    || ! /sbin/ldconfig -p | grep -q 'libdeflate\.so\.0' || ! command -v runc >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); fi

# torch first, pinned to the CPU wheel on disk: an unpinned torch would pull a 5.5 GB CUDA build.
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q torch==2.13.0 -e '.[train,s3,report,dev,lightning,hf,torchtitan]'
	touch $@

demo: setup
	$(PY) examples/demo.py --cluster-dir $(DEV_CLUSTER_DIR)

# The type checker first ([tool.mypy] in pyproject.toml; incremental, a few seconds once cached)
typecheck: venv
	$(PY) -m mypy

# The unit tier: independent tests, so both cores run them (pytest-xdist, whole files per worker)
test-fast: venv typecheck
	$(PY) -m pytest -q -m "not slurm and not integration" --timeout 300 -n 2 --dist loadfile

test-slurm: setup
	$(PY) -m pytest -q -m slurm --timeout 600

# The whole suite through pytest-xdist, whole files per worker (--dist loadfile: a module's shared
# reference run stays on one; each worker's dev-cluster tests take their own numbered cluster slot,
# tests/conftest.py), the longest files first (conftest FILE_SECONDS; --no-loadscope-reorder keeps
# that order). Four workers: most real-cluster tests wait on timers, so a fourth fills the cores the
# other three leave idle (1.68 -> 1.87 of 2 cores busy; 21.4 -> 19.7 min here, and 17.8-18.2 min in
# three clean-clone runs in a row with bytecode caches on; BENCHMARKS.md §Test suite).
# `make test TEST_WORKERS=1` runs it serially (~45 min).
# The type checker runs beside the tests (a clean clone's first mypy run takes ~30 s of one core, which
# the workers' start would otherwise wait for); either failing fails the target.
TEST_WORKERS ?= 4
test: setup
	$(PY) -m mypy > .mypy.out 2>&1 & mypy=$$!; \
	$(PY) -m pytest -q --timeout 900 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; rc=$$?; \
	wait $$mypy; typed=$$?; cat .mypy.out; rm -f .mypy.out; test $$typed -eq 0 && exit $$rc || exit 1

# The scale tier (tests/test_scale_slurm.py, issue 39 part 4): a 16-node dev cluster of its own, 28 gloo
# ranks of examples/train.py, a node death to the hot spare, then a requeue onto the reserved spare.
# It holds both cores for minutes, past `make test`'s budget, so that run skips it (BENCHMARKS.md §Scale:
# a 16-node dev-cluster run); `CKPTSUP_SCALE_NODES=N make test-scale` runs it at N nodes.
test-scale: setup
	$(PY) -m pytest -q -s -m scale --timeout 1800 tests/test_scale_slurm.py

# The Slurm version matrix (.ci/slurm-matrix.sh, docs/slurm.md §Versions): Debian trixie (24.11) and
# sid (26.05) in debootstrap chroots cached in /var/cache/ckptsup/slurm-chroots, beside the host's 22.05.
SLURM_SUITES ?= trixie sid
# the Slurm tests that need no torch: CI runs them on every version
SLURM_TORCH_FREE := tests/test_devcluster.py tests/test_gpu_health_cluster.py tests/test_health_cluster.py \
  tests/test_requeue_cluster.py tests/test_requeue_template.py tests/test_slurm_cluster.py tests/test_step_lines.py \
  tests/test_watchdog_cluster.py
# with the torch tests marked `matrix` (node death with a spare, requeue with a spare partition,
# preemption, the watchdog, every fault inside Slurm's OCI containers)
SLURM_MATRIX_TORCH := tests/test_supervisor_slurm_node_death.py tests/test_watchdog_template.py tests/test_container_slurm.py

test-slurm-versions: setup
	.ci/slurm-matrix.sh matrix "$(SLURM_SUITES)" -m slurm --timeout 600 $(SLURM_TORCH_FREE)

test-slurm-matrix: setup
	MATRIX_TAG=torch-free .ci/slurm-matrix.sh matrix "host $(SLURM_SUITES)" -m slurm --timeout 600 $(SLURM_TORCH_FREE)
	MATRIX_TAG=torch .ci/slurm-matrix.sh matrix "host $(SLURM_SUITES)" -m "slurm and matrix" --timeout 900 $(SLURM_MATRIX_TORCH)

# The fuzz tier (tests/test_fuzz_*.py) at 10,000 examples per test, a fresh seed each run; `make test`
# runs it under the deterministic "ci" profile (150 examples). See SECURITY.md.
fuzz: venv
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -m fuzz --timeout 7200 -p no:cacheprovider

bench: setup
	$(PY) bench/run_all.py

# The GPU proof (docs/gpu.md): on a machine with one GPU; `GPU_CHECK_ARGS=--dry-run` runs it on the CPU
GPU_CHECK_ARGS ?= --budget-s 300 --out bench/out/gpu_check.json
gpu-check: venv
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	-$(CKPTSUP) dev-cluster down --dir $(DEV_CLUSTER_DIR)
	rm -rf $(VENV) .pytest_cache
