#!/usr/bin/env bash
# `make podman`: podman for `make image` and the podman end-to-end test on a Debian/Ubuntu
# machine without a container engine. Installs Debian's podman with runc (and mmdebstrap, for
# `make base-image`) when podman is missing and this machine allows (root or passwordless sudo,
# with apt-get), then writes /etc/containers/containers.conf.d/batchplane.conf:
#
# - runtime = "runc": Debian 12's podman 4.3 defaults to crun, which some sandboxes refuse;
# - default_ulimits no higher than this machine's hard limits: podman asks for nofile=1048576
#   and nproc=4194304 as root, and where the process lacks CAP_SYS_RESOURCE (a sandbox) every
#   container then fails with "error setting rlimit type 7 (or 6): operation not permitted".
#   podman itself lowers its nproc to 32768, so nproc is at most that.
#
# Storage stays podman's default (overlay, which works on ext4 here); vfs is not needed.
set -euo pipefail

SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -n"

if ! command -v podman >/dev/null 2>&1 || ! command -v mmdebstrap >/dev/null 2>&1 || ! command -v catatonit >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && { [ -z "$SUDO" ] || sudo -n true 2>/dev/null; }; then
    echo "podman_setup.sh: installing Debian's podman, runc and mmdebstrap" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      podman runc catatonit mmdebstrap uidmap netavark aardvark-dns iptables ca-certificates >/dev/null
  else
    echo "podman_setup.sh: podman is missing and cannot be installed here: run 'sudo apt-get install -y podman runc mmdebstrap'" >&2
    exit 1
  fi
fi

nofile="$(ulimit -Hn)"
nproc="$(ulimit -Hu)"
[ "$nofile" = unlimited ] || [ "$nofile" -gt 1048576 ] && nofile=1048576
[ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ] && nproc=32768

conf=/etc/containers/containers.conf.d/batchplane.conf
want="# Written by batchplane's deploy/podman_setup.sh (make podman).
[containers]
default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]

[engine]
runtime = \"runc\""
if [ "$(cat "$conf" 2>/dev/null)" != "$want" ]; then
  $SUDO mkdir -p "$(dirname "$conf")"
  printf '%s\n' "$want" | $SUDO tee "$conf" >/dev/null
  echo "podman_setup.sh: wrote $conf (runc, nofile=$nofile, nproc=$nproc)" >&2
fi

if ! podman info >/dev/null 2>&1; then
  echo "podman_setup.sh: podman does not answer (podman info failed)" >&2
  exit 1
fi
podman --version
