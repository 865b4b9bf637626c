#!/usr/bin/env bash
# `make e2e-kind`: batchplane end to end on a kind cluster. Builds the service image and the e2e
# image (torch, the client and the demo dataset in /data), creates a cluster, loads both images,
# installs the chart with the example trainer Job over the demo's sources, waits for the Job and
# checks, from the planner's ledger and the trainer's log, that every sample of the epoch was
# delivered exactly once. Where docker (or podman) and kind are missing it says so and fails.
set -euo pipefail

cd "$(dirname "$0")/.."
HELM="${BATCHPLANE_HELM:-helm}"
CLUSTER="${E2E_CLUSTER:-batchplane-e2e}"
NAMESPACE=e2e
IMAGE=batchplane:e2e
TRAINER=batchplane-trainer:e2e

missing=()
engine=""
for candidate in docker podman; do
  if command -v "$candidate" >/dev/null && "$candidate" info >/dev/null 2>&1; then engine="$candidate"; break; fi
done
[ -n "$engine" ] || engine="$(command -v docker || command -v podman || true)"
[ -n "$engine" ] || missing+=("docker or podman")
command -v kind >/dev/null || missing+=("kind")
command -v kubectl >/dev/null || missing+=("kubectl")
[ -x "$HELM" ] || command -v "$HELM" >/dev/null || missing+=("helm (make helm)")
if [ "${#missing[@]}" -gt 0 ]; then
  echo "make e2e-kind: cannot run here: missing ${missing[*]}; it needs a container engine and kind (https://kind.sigs.k8s.io)" >&2
  exit 1
fi
if ! "$engine" info >/dev/null 2>&1; then
  echo "make e2e-kind: cannot run here: $engine is installed but its engine does not answer ($engine info failed)" >&2
  exit 1
fi

echo "== images"
# BASE_IMAGE (from make) when pullable, else the local Debian base; see deploy/build_image.sh.
ENGINE="$engine" deploy/build_image.sh runtime "$IMAGE"
ENGINE="$engine" deploy/build_image.sh e2e "$TRAINER"

echo "== cluster $CLUSTER"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
trap 'kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true' EXIT
kind load docker-image --name "$CLUSTER" "$IMAGE" "$TRAINER"
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -

echo "== chart"
# The loaders read the demo dataset baked into the e2e image; one trainer pod runs both ranks.
cat > /tmp/batchplane-e2e-values.yaml <<EOF
image: {repository: batchplane-trainer, tag: e2e, pullPolicy: Never}
sourceGroups:
  - name: text
    sources: [{name: captions, path: /data/captions}, {name: docs, path: /data/docs}, {name: code, path: /data/code}, {name: chat, path: /data/chat}]
mixture: {weights: {captions: 3, docs: 2, code: 2, chat: 2}}
mesh: {dp: 2, cp: 1, tp: 1, pp: 1}
batch: {globalBatchSize: 16, microbatches: 2}
trainer: {ranksPerPod: 2}
job: {epochs: 1}
example: {enabled: true, steps: 100000, image: {repository: batchplane-trainer, tag: e2e}}
EOF
"$HELM" upgrade --install e2e deploy/helm/batchplane -n "$NAMESPACE" -f /tmp/batchplane-e2e-values.yaml --wait --timeout 10m

echo "== training"
job="$(kubectl get jobs -n "$NAMESPACE" -o name | grep example)"
kubectl wait -n "$NAMESPACE" --for=condition=complete --timeout=30m "$job"
kubectl logs -n "$NAMESPACE" "$job" -c trainer | tail -20

echo "== exactly once"
planner="$(kubectl get deploy -n "$NAMESPACE" -o name | grep planner)"
kubectl exec -n "$NAMESPACE" "$planner" -- python - <<'EOF'
import collections, pathlib, sys
from batchplane.core.config import load_job
from batchplane.core.storage import LocalStorage
from batchplane.planner.journal import LedgerReader

job = load_job(pathlib.Path("/etc/batchplane/job.yaml"))
reader = LedgerReader(LocalStorage(job.resolve(job.run_dir) / "ledger"))
seen = collections.Counter((k, row, epoch) for r in reader.records() for bucket in r["ranks"] for mb in bucket for k, row, epoch in mb)
twice = [s for s, n in seen.items() if n > 1]
taken = collections.Counter()
for r in reader.records():
    for name, (start, count) in r["take"].items():
        taken[name] += count
import pyarrow.parquet as pq
rows = {s.name: sum(pq.ParquetFile(f).metadata.num_rows for f in sorted(pathlib.Path(s.path).glob("*.parquet"))) for s in job.sources}
print(f"{sum(seen.values())} samples delivered over {reader.last_step() + 1} steps; {len(twice)} delivered twice")
print(f"positions taken per source {dict(taken)}; rows per source {rows}")
sys.exit(1 if twice or dict(taken) != rows else 0)
EOF
echo "make e2e-kind: passed"
