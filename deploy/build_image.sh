#!/usr/bin/env bash
# `make image` / `make image-e2e`: builds one target of the Dockerfile with docker or podman.
#
#   deploy/build_image.sh [TARGET [TAG]]     # default: runtime batchplane:dev
#
# Environment:
#   ENGINE        docker or podman (default: the first of them whose engine answers `info`)
#   BASE_IMAGE    the base (default python:3.11-slim-bookworm). Used when present locally or
#                 pullable within PULL_TIMEOUT seconds (default 60); otherwise, and always when
#                 BASE_IMAGE=local, the local Debian base LOCAL_BASE (default
#                 batchplane-base:bookworm), built first by deploy/base_image.sh when missing.
#   TORCH_INDEX   (e2e only) an extra index for torch (default PyTorch's CPU index when it
#                 answers, else none); TORCH_WHEELS: folders whose torch-*+cpu-*.whl are copied
#                 into deploy/wheels/ for the e2e target (default: pip's find-links).
#   CA_BUNDLE     a CA bundle for pip inside the build, for a TLS-intercepting proxy (default:
#                 PIP_CERT or pip's `cert` setting here, if any; empty: none).
set -euo pipefail

cd "$(dirname "$0")/.."
TARGET="${1:-runtime}"
TAG="${2:-batchplane:dev}"
BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim-bookworm}"
LOCAL_BASE="${LOCAL_BASE:-batchplane-base:bookworm}"
PULL_TIMEOUT="${PULL_TIMEOUT:-60}"

engine=""
for candidate in ${ENGINE:-docker podman}; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" info >/dev/null 2>&1; then
    engine="$candidate"
    break
  fi
done
if [ -z "$engine" ]; then
  echo "build_image.sh: needs docker or podman with an engine that answers ('${ENGINE:-docker podman} info' failed or none is installed)" >&2
  exit 1
fi

have() { "$engine" image inspect "$1" >/dev/null 2>&1; }

# A short name (python:3.11-slim) is Docker Hub's; podman wants it spelled out.
qualify() {
  local first="${1%%/*}"
  if [ "$first" = "$1" ]; then echo "docker.io/library/$1"
  elif [[ "$first" == *.* || "$first" == *:* || "$first" == localhost ]]; then echo "$1"
  else echo "docker.io/$1"
  fi
}

base=""
if [ "$BASE_IMAGE" != local ]; then
  if have "$BASE_IMAGE"; then
    base="$BASE_IMAGE"
  elif have "$(qualify "$BASE_IMAGE")"; then
    base="$(qualify "$BASE_IMAGE")"
  else
    echo "build_image.sh: pulling $(qualify "$BASE_IMAGE") (at most ${PULL_TIMEOUT}s)" >&2
    if timeout "$PULL_TIMEOUT" "$engine" pull -q "$(qualify "$BASE_IMAGE")" >/dev/null; then
      base="$(qualify "$BASE_IMAGE")"
    else
      echo "build_image.sh: cannot pull $BASE_IMAGE; using the local Debian base $LOCAL_BASE instead (as BASE_IMAGE=local)" >&2
    fi
  fi
fi
if [ -z "$base" ]; then
  have "$LOCAL_BASE" || ENGINE="$engine" deploy/base_image.sh "$LOCAL_BASE"
  base="$LOCAL_BASE"
fi

revision=$(git describe --always --dirty 2>/dev/null || echo unknown)
args=(--build-arg "BASE_IMAGE=$base" --build-arg "REVISION=$revision" --target "$TARGET" -t "$TAG")
# pip in the build trusts what pip here trusts (a TLS-intercepting proxy's CA), as the secret `ca`.
ca="${CA_BUNDLE-${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}}"
if [ -n "$ca" ] && [ -s "$ca" ]; then
  args+=(--secret "id=ca,src=$ca")
fi
if [ "$TARGET" = e2e ]; then
  # A CPU build of torch from a local folder (e.g. pip's find-links) avoids PyPI's CUDA build.
  folders="${TORCH_WHEELS-${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}}"
  for folder in $folders; do
    folder="${folder#file://}"
    for wheel in "$folder"/torch-*+cpu-*.whl; do
      [ -f "$wheel" ] || continue
      [ -f "deploy/wheels/$(basename "$wheel")" ] && continue
      ln -f "$wheel" deploy/wheels/ 2>/dev/null || cp "$wheel" deploy/wheels/
      echo "build_image.sh: torch for the e2e image from $wheel" >&2
    done
  done
  if [ -z "${TORCH_INDEX+set}" ]; then
    TORCH_INDEX=https://download.pytorch.org/whl/cpu
    if ! python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$TORCH_INDEX/" >/dev/null 2>&1; then
      echo "build_image.sh: $TORCH_INDEX does not answer; torch comes from deploy/wheels/ or PyPI" >&2
      TORCH_INDEX=""
    fi
  fi
  args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
fi

echo "build_image.sh: $engine build --target $TARGET -t $TAG on $base" >&2
start=$(date +%s)
"$engine" build "${args[@]}" .
echo "build_image.sh: built $TAG ($TARGET, base $base) in $(( $(date +%s) - start ))s" >&2
"$engine" images "$TAG"
