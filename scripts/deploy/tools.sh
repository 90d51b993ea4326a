#!/usr/bin/env bash
# Installs the tools `make deploy-check` uses into $LOCKGATE_TOOLS (default ~/.cache/lockgate/tools),
# each only if missing, from the package registries (no root needed):
#   helm         go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION         (Go module proxy)
#   kubeconform  go install github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION
#   promtool     the Debian package `prometheus`: apt-get download + dpkg -x  (Debian archive)
#   k8s schemas  the PyPI wheel kubernetes-validate==$K8S_VALIDATE_VERSION, converted for kubeconform
# Prints the tools directory's bin paths as shell assignments for deploy-check to eval.
set -euo pipefail
tools="${LOCKGATE_TOOLS:-$HOME/.cache/lockgate/tools}"
HELM_VERSION="${HELM_VERSION:-v3.21.4}"
KUBECONFORM_VERSION="${KUBECONFORM_VERSION:-v0.8.0}"
K8S_VALIDATE_VERSION="${K8S_VALIDATE_VERSION:-1.37.0}"
KUBE_VERSION="${KUBE_VERSION:-1.33.0}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
mkdir -p "$tools/bin"
say() { echo "deploy-tools: $*" >&2; }

go_tool() {  # name module version
  local bin="$tools/bin/$1" stamp="$tools/bin/.$1-$3"
  if [ -x "$bin" ] && [ -e "$stamp" ]; then return; fi
  command -v go >/dev/null || { say "go is needed to build $1 ($2@$3)"; exit 1; }
  say "building $1 $3 (go install; a few minutes on 2 cores, once)"
  GOBIN="$tools/bin" GOFLAGS="${GOFLAGS:--trimpath}" nice -n 19 go install "$2@$3" >&2
  rm -f "$tools/bin/.$1-"*; touch "$stamp"
}
go_tool helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION"
go_tool kubeconform github.com/yannh/kubeconform/cmd/kubeconform "$KUBECONFORM_VERSION"

promtool="$tools/prometheus/usr/bin/promtool"
if [ ! -x "$promtool" ]; then
  say "fetching promtool (Debian package prometheus)"
  command -v apt-get >/dev/null || { say "apt-get is needed to fetch the Debian prometheus package"; exit 1; }
  mkdir -p "$tools/debs"
  ( cd "$tools/debs" && rm -f prometheus_*.deb && { apt-get download prometheus >&2 \
      || { apt-get update -qq >&2 && apt-get download prometheus >&2; }; } )
  rm -rf "$tools/prometheus"
  dpkg -x "$tools"/debs/prometheus_*.deb "$tools/prometheus"
  rm -f "$tools"/debs/prometheus_*.deb
fi

schemas="$tools/k8s-schemas"
if [ ! -d "$schemas/v$KUBE_VERSION-standalone-strict" ]; then
  say "fetching Kubernetes v$KUBE_VERSION JSON schemas (PyPI kubernetes-validate==$K8S_VALIDATE_VERSION)"
  tmp="$(mktemp -d)"
  "$python" -m pip download -q --no-deps "kubernetes-validate==$K8S_VALIDATE_VERSION" -d "$tmp" >&2
  "$python" "$root/scripts/deploy/k8s_schemas.py" "$tmp"/kubernetes_validate-*.whl "$KUBE_VERSION" "$schemas" >&2
  rm -rf "$tmp"
fi

echo "HELM='$tools/bin/helm'"
echo "KUBECONFORM='$tools/bin/kubeconform'"
echo "PROMTOOL='$promtool'"
echo "K8S_SCHEMAS='$schemas'"
echo "KUBE_VERSION='$KUBE_VERSION'"
