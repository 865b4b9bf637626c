#!/usr/bin/env bash
# `make base-image`: a local base image for the Dockerfile, built from Debian's packages, for
# machines that reach Debian's mirror but no container registry (so `python:3.11-slim-bookworm`
# cannot be pulled). mmdebstrap writes a minimal Debian 12 (bookworm) root file system with
# Debian's Python 3.11 (python3, python3-venv with its bundled pip, ca-certificates, passwd for
# useradd), and the engine imports it as one layer:
#
#   deploy/base_image.sh [TAG]        # default batchplane-base:bookworm
#
# Environment: ENGINE (podman or docker, default whichever is installed), DEBIAN_MIRROR (default
# http://deb.debian.org/debian; security updates come from its -security suite on the same host,
# or DEBIAN_SECURITY_MIRROR). Needs mmdebstrap (`apt-get install mmdebstrap`) and, unless run as
# root, a user namespace (mmdebstrap's unshare mode). The Dockerfile runs Python from a venv at
# /opt/batchplane, so it works on this base (python3, PEP 668) and on python:3.11-slim alike.
set -euo pipefail

TAG="${1:-batchplane-base:bookworm}"
ENGINE="${ENGINE:-$(command -v podman || command -v docker || true)}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY="${DEBIAN_SECURITY_MIRROR:-${MIRROR%/debian}/debian-security}"

if [ -z "$ENGINE" ]; then
  echo "base_image.sh: needs podman or docker to import the base image" >&2
  exit 1
fi
if ! command -v mmdebstrap >/dev/null 2>&1; then
  echo "base_image.sh: needs mmdebstrap: sudo apt-get install -y mmdebstrap (Debian/Ubuntu)" >&2
  exit 1
fi

tarball="$(mktemp --suffix=.tar)"
trap 'rm -f "$tarball"' EXIT

mode=root
[ "$(id -u)" = 0 ] || mode=unshare

# Docs, man pages and locales are left out (as in the python:slim images); apt stays, so that
# images built on this base can still apt-get install.
echo "base_image.sh: mmdebstrap bookworm from $MIRROR ($mode mode)" >&2
mmdebstrap --mode="$mode" --variant=apt --quiet \
  --include=python3,python3-venv,ca-certificates,passwd,tzdata \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/apt/* "$1"/var/log/dpkg.log' \
  --customize-hook='find "$1"/usr/lib/python3* -name __pycache__ -type d -prune -exec rm -rf {} +' \
  bookworm "$tarball" \
  "deb $MIRROR bookworm main" \
  "deb $MIRROR bookworm-updates main" \
  "deb $SECURITY bookworm-security main"

python_version="$(tar -xOf "$tarball" ./var/lib/dpkg/status | awk '/^Package: python3$/{p=1} p&&/^Version:/&&!v{v=$2} END{print v}')"
"$ENGINE" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/usr/bin/python3"]' \
  --message "Debian bookworm (mmdebstrap --variant=apt) with python3 ${python_version}" \
  "$tarball" "$TAG" >/dev/null
echo "base_image.sh: imported $TAG (Debian bookworm, python3 $python_version)" >&2
"$ENGINE" images "$TAG"
