# batchplane: `make run` runs the demo, `make test` runs the tests. Both create .venv and
# install what they need (pinned by constraints.txt) on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: venv run test test-unit test-integration proto clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dev]'
	touch $@

venv: $(STAMP)

# The demo: writes a four-source Parquet dataset, starts the data plane as local processes and
# trains a tiny model on two data-parallel ranks against it.
run: $(STAMP)
	$(VENV)/bin/batchplane demo

# Unit tests (pure logic) and integration tests (real processes on 127.0.0.1).
test: $(STAMP)
	$(PY) -m pytest

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest tests/integration

# Regenerates the wire contract's Python code; tests fail while it is stale.
proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) .batchplane
