# One image for every part of batchplane: the planner, loaders, constructors and the operator.
# The first argument picks the part (see services/batchplane/entrypoint.py), e.g.
#   podman run IMAGE planner -c /etc/batchplane/job.yaml --port 50051
# No torch: trainers pip-install the client (batchplane[client]) into their own image.
#
#   make image                                   # docker or podman, whichever answers
#   make image BASE_IMAGE=registry.local/python:3.11-slim IMAGE=batchplane:dev
#   make image BASE_IMAGE=local                  # a base built here from Debian's packages
#
# The base is any Debian-like image with Python 3.10+ as `python3`, its venv module and
# groupadd/useradd: python:3.11-slim-bookworm (the default), or, where no registry can be
# reached, batchplane-base:bookworm that `make base-image` (deploy/base_image.sh) builds from
# Debian 12's packages with mmdebstrap (Debian's python3 3.11; `make image` falls back to it
# when the base cannot be pulled). batchplane lives in a venv at /opt/batchplane on both, which
# Debian's python3 needs (PEP 668 forbids pip installs into the system Python); the venv's bin
# comes first on PATH, so `python` (the entrypoint's too) and `batchplane` are the venv's.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- build: wheels of batchplane and its service dependencies --------------------------------
FROM ${BASE_IMAGE} AS build
WORKDIR /src
RUN python3 -m venv /opt/build
COPY constraints.txt pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY client ./client
# Behind a TLS-intercepting proxy, pass the CA bundle that trusts it as the build secret `ca`
# (deploy/build_image.sh does, from CA_BUNDLE or pip's `cert` setting); pip then uses it.
# pip's cache is a cache mount, so a change to the sources downloads nothing again.
RUN --mount=type=secret,id=ca --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && /opt/build/bin/pip wheel --disable-pip-version-check -c constraints.txt \
        --wheel-dir /wheels ".[services]"

# ---- e2e: an example trainer for `make e2e-kind` (torch CPU, the client, the demo dataset in
# /data); never the service image. Build it with --target e2e (`make image-e2e`). torch is
# pinned by constraints.txt (torch==2.13.0) and comes, in this order of preference, from a wheel
# in deploy/wheels/ (`make image-e2e` copies a local CPU build there; that folder ignores its
# contents), from TORCH_INDEX (PyTorch's CPU index; empty: none), or from PyPI (whose Linux
# wheel is the CUDA build, several GB with its nvidia packages).
FROM ${BASE_IMAGE} AS e2e
ARG UID=10001
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,source=deploy/wheels,target=/extra-wheels \
    --mount=type=bind,source=constraints.txt,target=/constraints.txt \
    --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && python3 -m venv /opt/batchplane \
 && /opt/batchplane/bin/pip install --no-cache-dir --disable-pip-version-check -c /constraints.txt \
        --find-links /wheels --find-links /extra-wheels ${TORCH_INDEX:+--extra-index-url $TORCH_INDEX} \
        "batchplane[services,client]" \
 && /opt/batchplane/bin/python -c "from batchplane.demo.dataset import write_demo_dataset; import pathlib; write_demo_dataset(pathlib.Path('/data'))" \
 && chmod -R a+rX /data
ENV PATH=/opt/batchplane/bin:$PATH \
    VIRTUAL_ENV=/opt/batchplane \
    PYTHONUNBUFFERED=1
USER ${UID}:${UID}
WORKDIR /tmp
ENTRYPOINT ["python", "-m", "batchplane.entrypoint"]

# ---- runtime: the wheels installed, nothing else (the default target) ---------------------
FROM ${BASE_IMAGE} AS runtime
ARG UID=10001
RUN groupadd --gid ${UID} batchplane \
 && useradd --uid ${UID} --gid ${UID} --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin batchplane
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python3 -m venv /opt/batchplane \
 && /opt/batchplane/bin/pip install --no-cache-dir --disable-pip-version-check --no-index --find-links /wheels "batchplane[services]" \
 && /opt/batchplane/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
# The source revision, shown by batchplane_build_info{revision} (deploy/build_image.sh passes
# `git describe --always --dirty`); last, so that a new revision rebuilds nothing above.
ARG REVISION=unknown
ENV PATH=/opt/batchplane/bin:$PATH \
    VIRTUAL_ENV=/opt/batchplane \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BATCHPLANE_LOG_LEVEL=INFO \
    BATCHPLANE_GIT_REVISION=${REVISION}
# Numeric, so that Kubernetes can check runAsNonRoot.
USER ${UID}:${UID}
WORKDIR /tmp
ENTRYPOINT ["python", "-m", "batchplane.entrypoint"]
CMD ["--help"]
