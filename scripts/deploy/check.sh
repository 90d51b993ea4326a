#!/usr/bin/env bash
# `make deploy-check`: the Helm chart and the Prometheus rules, checked offline.
#   1. installs the tools if missing (scripts/deploy/tools.sh; cached in ~/.cache/lockgate/tools)
#   2. helm lint + helm template of deploy/helm/lockgate with the default and the example values
#   3. kubeconform -strict of every rendered manifest: built-in kinds against the Kubernetes
#      schemas, KEDA/Strimzi kinds against deploy/schemas (no kind is skipped; a missing schema fails)
#   4. self-tests: known-bad manifests and values must be refused
#   5. promtool check rules + promtool test rules (deploy/prometheus/alerts_test.yml), and
#      promtool check config of docker-compose's docs/prometheus.yml
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
eval "$(scripts/deploy/tools.sh)"
chart=deploy/helm/lockgate
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
kc() {
  "$KUBECONFORM" -strict -summary -kubernetes-version "$KUBE_VERSION" \
    -schema-location "$K8S_SCHEMAS/{{ .NormalizedKubernetesVersion }}-standalone{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
    -schema-location "deploy/schemas/{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json" "$@"
}

declare -A sets=([default]="" [example]="-f $chart/ci/example-values.yaml")
for name in default example; do
  # shellcheck disable=SC2086  # the value flags are meant to split
  "$HELM" lint --strict --quiet --kube-version "$KUBE_VERSION" "$chart" ${sets[$name]} >/dev/null
  # shellcheck disable=SC2086
  "$HELM" template lockgate "$chart" --kube-version "$KUBE_VERSION" ${sets[$name]} > "$out/$name.yaml"
  echo "deploy-check: $name values: $(grep -c '^kind:' "$out/$name.yaml") manifests"
  kc "$out/$name.yaml"
done

for bad in deploy/schemas/testdata/*.yaml; do
  if kc "$bad" >/dev/null 2>&1; then echo "deploy-check: $bad validated, but must not: schemas not in effect" >&2; exit 1; fi
done
refuse() {  # description, helm args...: the chart must refuse to render
  local what="$1"; shift
  if "$HELM" template lockgate "$chart" --kube-version "$KUBE_VERSION" "$@" >/dev/null 2>"$out/err"; then
    echo "deploy-check: the chart rendered $what, but must refuse it" >&2; exit 1
  fi
}
refuse "worker.kind=Pod" --set worker.kind=Pod
refuse "SASL without a password Secret" --set kafka.securityProtocol=SASL_SSL --set kafka.sasl.username=u
refuse "an unknown SASL mechanism" --set kafka.securityProtocol=SASL_SSL --set kafka.sasl.username=u \
  --set kafka.sasl.existingSecret=s --set kafka.sasl.mechanism=GSSAPI
grep -q 'GSSAPI' "$out/err" || { echo "deploy-check: the GSSAPI refusal does not name it" >&2; exit 1; }
echo "deploy-check: known-bad manifests and values refused"

"$PROMTOOL" check rules deploy/prometheus/alerts.yml
# docker-compose.yml's Prometheus config, laid out as compose mounts it (the rules beside it)
mkdir -p "$out/prom" && cp docs/prometheus.yml deploy/prometheus/alerts.yml "$out/prom/"
"$PROMTOOL" check config "$out/prom/prometheus.yml"
"$PROMTOOL" test rules deploy/prometheus/alerts_test.yml
echo "deploy-check: OK"
