# One image for every part of batchplane: the planner, loaders, constructors and the operator.
# The first argument picks the part (see services/batchplane/entrypoint.py), e.g.
#   podman run IMAGE planner -c /etc/batchplane/job.yaml --port 50051
# No torch: trainers pip-install the client (batchplane[client]) into their own image.
#
#   make image                                   # docker or podman, whichever is installed
#   make image BASE_IMAGE=registry.local/python:3.11-slim IMAGE=batchplane:dev
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- build: wheels of batchplane and its service dependencies --------------------------------
FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY client ./client
RUN python -m pip wheel --no-cache-dir --disable-pip-version-check -c constraints.txt \
        --wheel-dir /wheels ".[services]"

# ---- e2e: an example trainer for `make e2e-kind` (torch CPU, the client, the demo dataset in
# /data); never the service image. Build it with --target e2e.
FROM ${BASE_IMAGE} AS e2e
ARG UID=10001
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir --disable-pip-version-check --find-links /wheels \
        --extra-index-url https://download.pytorch.org/whl/cpu "batchplane[services,client]" \
 && python -c "from batchplane.demo.dataset import write_demo_dataset; import pathlib; write_demo_dataset(pathlib.Path('/data'))" \
 && rm -rf /wheels && chmod -R a+rX /data
USER ${UID}:${UID}
WORKDIR /tmp
ENTRYPOINT ["python", "-m", "batchplane.entrypoint"]

# ---- runtime: the wheels installed, nothing else (the default target) ---------------------
FROM ${BASE_IMAGE} AS runtime
ARG UID=10001
RUN groupadd --gid ${UID} batchplane \
 && useradd --uid ${UID} --gid ${UID} --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin batchplane
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir --disable-pip-version-check --no-index --find-links /wheels "batchplane[services]" \
 && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BATCHPLANE_LOG_LEVEL=INFO
# Numeric, so that Kubernetes can check runAsNonRoot.
USER ${UID}:${UID}
WORKDIR /tmp
ENTRYPOINT ["python", "-m", "batchplane.entrypoint"]
CMD ["--help"]
