#!/usr/bin/env bash
# `make image-smoke`: the service image runs under podman. In one pod (one network namespace, so
# every part on 127.0.0.1): a planner, a loader over two small Parquet sources and a constructor
# serving on a Unix socket in a shared volume, all from IMAGE, read-only root, as the image's
# non-root user, talking mutual TLS with certificates from a throwaway CA (one folder per part,
# each naming its identity, as `batchplane up` issues them). It waits until the loader and the constructor have registered with the planner;
# then, when the e2e image (TRAINER, `make image-e2e`) is present, trains a tiny model on one
# rank for a few steps through the constructor's socket. Leaves nothing behind.
#
#   deploy/podman_smoke.sh [IMAGE [TRAINER]]    # default batchplane:dev batchplane-trainer:e2e
set -euo pipefail

IMAGE="${1:-batchplane:dev}"
TRAINER="${2:-batchplane-trainer:e2e}"
POD=batchplane-smoke
DATA="$POD-data"
SOCK="$POD-sock"
TLS="$POD-tls"
WORK=""

cleanup() {
  podman pod rm -f -t 0 "$POD" >/dev/null 2>&1 || true
  podman volume rm -f "$DATA" "$SOCK" "$TLS" >/dev/null 2>&1 || true
  [ -z "$WORK" ] || rm -rf "$WORK"
}
cleanup
trap cleanup EXIT
WORK="$(mktemp -d)"

fail() {
  echo "podman_smoke.sh: $*" >&2
  for c in planner loader constructor; do
    echo "--- $c" >&2
    podman logs "$POD-$c" 2>&1 | tail -20 >&2 || true
  done
  exit 1
}

cat > "$WORK/job.yaml" <<'EOF'
job: smoke
seed: 7
epochs: 1
sources:
  - {name: docs, path: /data/docs}
  - {name: code, path: /data/code}
mixture:
  weights: {docs: 1, code: 1}
batch: {global_batch_size: 8, microbatches: 1}
mesh: {dp: 1}
loaders: {count: 1}
constructors: {ranks_per_constructor: 1}
network: {host: 127.0.0.1}
run_dir: /var/lib/batchplane/run
EOF
chmod a+r "$WORK/job.yaml"

echo "== demo data (docs, code) into volume $DATA"
podman volume create "$DATA" >/dev/null
podman run --rm --user 0 -v "$DATA:/data" --entrypoint python "$IMAGE" -c "
import pathlib
from batchplane.demo.dataset import DEMO_SOURCES, write_demo_dataset
write_demo_dataset(pathlib.Path('/data'), sources=[s for s in DEMO_SOURCES if s.name in ('docs', 'code')])"

echo "== certificates of a throwaway CA into volume $TLS"
podman volume create "$TLS" >/dev/null
podman run --rm --user 0 -v "$TLS:/tls" --entrypoint python "$IMAGE" -c "
import os, pathlib
from batchplane.core.identity import Identity
from batchplane.core.localca import LocalCA
ca = LocalCA(pathlib.Path('/tls/ca'), name='smoke')
for name, identity in {'planner': Identity('planner'), 'loader': Identity('loader', 0, '0'), 'constructor': Identity('constructor', 0)}.items():
    ca.issue(identity, pathlib.Path('/tls') / name)
for root, dirs, files in os.walk('/tls'):
    for d in dirs: os.chown(os.path.join(root, d), 10001, 10001)
    for f in files: os.lchown(os.path.join(root, f), 10001, 10001)
os.chown('/tls', 10001, 10001)"

echo "== pod $POD: planner, loader, constructor ($IMAGE)"
podman pod create --name "$POD" >/dev/null
podman volume create "$SOCK" >/dev/null
podman run --rm --user 0 -v "$SOCK:/run/batchplane" --entrypoint sh "$IMAGE" -c 'chmod 1777 /run/batchplane'
common=(--pod "$POD" --read-only --tmpfs /tmp --tmpfs /var/lib/batchplane:mode=1777
        -v "$WORK/job.yaml:/etc/batchplane/job.yaml:ro" -v "$DATA:/data:ro" -v "$TLS:/tls:ro")
podman run -d --name "$POD-planner" "${common[@]}" "$IMAGE" \
  planner -c /etc/batchplane/job.yaml --port 50051 --metrics-port 9100 --tls-dir /tls/planner >/dev/null
podman run -d --name "$POD-loader" "${common[@]}" "$IMAGE" \
  loader -c /etc/batchplane/job.yaml --index 0 --planner 127.0.0.1:50051 --port 50052 --metrics-port 9101 --tls-dir /tls/loader >/dev/null
podman run -d --name "$POD-constructor" "${common[@]}" -v "$SOCK:/run/batchplane" "$IMAGE" \
  constructor -c /etc/batchplane/job.yaml --index 0 --planner 127.0.0.1:50051 \
  --listen unix:///run/batchplane/socket/constructor.sock --metrics-port 9102 --tls-dir /tls/constructor >/dev/null

for part in loader constructor; do
  for _ in $(seq 60); do
    podman logs "$POD-$part" 2>&1 | grep "registered with planner" >/dev/null && break
    podman ps --format '{{.Names}}' | grep -x "$POD-$part" >/dev/null || fail "the $part stopped"
    sleep 1
  done
  podman logs "$POD-$part" 2>&1 | grep "registered with planner" || fail "the $part did not register within 60s"
done

if podman image inspect "$TRAINER" >/dev/null 2>&1; then
  echo "== trainer ($TRAINER): tiny_lm, one rank, 4 steps"
  podman run --rm --name "$POD-trainer" --pod "$POD" --read-only --tmpfs /tmp -e HOME=/tmp \
    -v "$SOCK:/run/batchplane" -e BATCHPLANE_CONSTRUCTOR=unix:///run/batchplane/socket/constructor.sock \
    --entrypoint python "$TRAINER" \
    -m batchplane.examples.tiny_lm --rank 0 --world-size 1 --master-port 29512 --steps 4 --log-every 1 \
    || fail "the trainer failed"
  podman exec "$POD-planner" batchplane ledger stats -c /etc/batchplane/job.yaml --from 0 --to 3
else
  echo "== no $TRAINER (make image-e2e): the trainer step is skipped"
fi
echo "podman_smoke.sh: passed"
