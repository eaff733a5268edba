#!/usr/bin/env bash
# End to end on a kind cluster, for users who have docker, kind, kubectl and
# helm: build the images, install the chart, serve digits v1 on the edge tier
# from an in-cluster artifact server, roll out v2, and wait for the promotion.
# (Not run by `make test`: these machines have no container runtime.)
#
#   scripts/kind-e2e.sh            # creates the cluster `tiered-e2e`
#   KEEP=1 scripts/kind-e2e.sh     # leave the cluster up afterwards
set -euo pipefail

CLUSTER=${CLUSTER:-tiered-e2e}
NAMESPACE=${NAMESPACE:-tiered}
TAG=${TAG:-e2e}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
cd "$ROOT"

cleanup() {
  rm -rf "$WORK"
  if [[ -z "${KEEP:-}" ]]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }

step "cluster and images"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER"
kubectl label node --all tiered.dev/tier=edge --overwrite
docker build -q -f controller/Dockerfile -t tiered-controller:$TAG .
docker build -q -f agents/Dockerfile -t tiered-agent:$TAG .
kind load docker-image --name "$CLUSTER" tiered-controller:$TAG tiered-agent:$TAG

step "sample models, served in the cluster"
make .venv/.installed >/dev/null
.venv/bin/tiered models digits --variant v1 --out "$WORK/models" >/dev/null
.venv/bin/tiered models digits --variant v2 --out "$WORK/models" >/dev/null
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$NAMESPACE" create configmap digits-artifacts --dry-run=client -o yaml \
  --from-file="$WORK/models" | kubectl apply -f -
kubectl -n "$NAMESPACE" apply -f - <<'YAML'
apiVersion: apps/v1
kind: Deployment
metadata: {name: artifacts}
spec:
  selector: {matchLabels: {app: artifacts}}
  template:
    metadata: {labels: {app: artifacts}}
    spec:
      containers:
        - name: http
          image: tiered-agent:e2e
          command: [python, -m, http.server, "8080", --directory, /artifacts]
          ports: [{containerPort: 8080}]
          volumeMounts: [{name: artifacts, mountPath: /artifacts}]
      volumes: [{name: artifacts, configMap: {name: digits-artifacts}}]
---
apiVersion: v1
kind: Service
metadata: {name: artifacts}
spec:
  selector: {app: artifacts}
  ports: [{port: 80, targetPort: 8080}]
YAML

step "helm install"
helm upgrade --install tiered helm/tiered -n "$NAMESPACE" --wait \
  --set images.controller.repository=tiered-controller,images.controller.tag=$TAG \
  --set images.agent.repository=tiered-agent,images.agent.tag=$TAG \
  --set images.controller.pullPolicy=Never,images.agent.pullPolicy=Never

model() {  # model VARIANT: a TieredModel on the edge tier for digits-VARIANT.onnx
  local sha
  sha=$(sha256sum "$WORK/models/digits-$1.onnx" | cut -d' ' -f1)
  cat <<YAML
apiVersion: tiered.dev/v1alpha1
kind: TieredModel
metadata: {name: digits}
spec:
  artifact:
    uri: http://artifacts.$NAMESPACE.svc/digits-$1.onnx
    sha256: $sha
    calibration: http://artifacts.$NAMESPACE.svc/digits-calibration.npz
    eval: http://artifacts.$NAMESPACE.svc/digits-eval.npz
  tiers:
    edge: {replicas: 1, node_selector: {tiered.dev/tier: edge}}
  rollout:
    stages:
      - {name: canary, weights: {edge: 20}, min_requests: 100, min_duration_s: 30}
      - {name: half, weights: {edge: 50}, min_requests: 100, min_duration_s: 30}
    analysis: {agreement: null, energy_per_inference: null, interval_s: 5}
YAML
}

wait_for() {  # wait_for JSONPATH VALUE
  for _ in $(seq 1 120); do
    [[ "$(kubectl -n "$NAMESPACE" get tieredmodel digits -o "jsonpath=$1" 2>/dev/null)" == "$2" ]] && return 0
    sleep 5
  done
  kubectl -n "$NAMESPACE" get tieredmodel digits -o yaml
  return 1
}

step "digits v1"
model v1 | kubectl -n "$NAMESPACE" apply -f -
wait_for '{.status.rollout.stable_version}' 1
kubectl -n "$NAMESPACE" get tieredmodels

step "traffic through the router while v2 rolls out"
kubectl -n "$NAMESPACE" port-forward svc/tiered-router 18001:8001 >/dev/null &
FORWARD=$!
trap 'kill $FORWARD 2>/dev/null; cleanup' EXIT
sleep 3
.venv/bin/python - <<'PY' &
import time, numpy as np, tritonclient.grpc as g
client = g.InferenceServerClient("127.0.0.1:18001")
image = np.zeros((1, 1, 8, 8), np.float32)
end = time.time() + 600
while time.time() < end:
    tensor = g.InferInput("input", [1, 1, 8, 8], "FP32")
    tensor.set_data_from_numpy(image)
    try:
        client.infer("digits", [tensor], headers={"tiered-tier": "edge"})
    except Exception as error:
        print("request failed:", error)
    time.sleep(0.05)
PY
LOAD=$!
model v2 | kubectl -n "$NAMESPACE" apply -f -
wait_for '{.status.rollout.stable_version}' 2
kill $LOAD 2>/dev/null || true
kubectl -n "$NAMESPACE" get tieredmodels
step "passed: v2 promoted on the cluster"
