# `make demo` and `make test` each install everything they need first (fresh Debian 12, root).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CKPTSUP := $(VENV)/bin/ckptsup
APT_PACKAGES := slurm-wlm munge tini
DEV_CLUSTER_DIR ?= /tmp/ckptsup-dev-cluster

.PHONY: setup apt venv demo test test-fast test-slurm fuzz bench clean

setup: apt venv

apt:
	@if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v tini >/dev/null; then \
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

test-fast: venv
	$(PY) -m pytest -q -m "not slurm and not integration" --timeout 300

test-slurm: setup
	$(PY) -m pytest -q -m slurm --timeout 600

test: setup
	$(PY) -m pytest -q --timeout 900

# The fuzz tier (tests/test_fuzz_*.py) at 10,000 examples per test, a fresh seed each run; `make test`
# runs it under the deterministic "ci" profile (150 examples). See SECURITY.md.
fuzz: venv
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -m fuzz --timeout 7200 -p no:cacheprovider

bench: setup
	$(PY) bench/run_all.py

clean:
	-$(CKPTSUP) dev-cluster down --dir $(DEV_CLUSTER_DIR)
	rm -rf $(VENV) .pytest_cache
