#!/usr/bin/env bash
# Builds the OpenTelemetry Collector the tracing tests export to (OTLP receiver + debug exporter,
# scripts/otelcol/main.go, pinned by its go.mod/go.sum) once per machine, into
# ~/.cache/lockgate/tools (or $LOCKGATE_TOOLS), and prints the binary's path on stdout.
# Rebuilt only when main.go, go.mod or go.sum change. Needs Go and the Go module proxy.
#   scripts/otelcol.sh            # build if needed, print the path
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="$root/scripts/otelcol"
tools="${LOCKGATE_TOOLS:-$HOME/.cache/lockgate/tools}"
sum="$(cat "$src/main.go" "$src/go.mod" "$src/go.sum" | sha256sum | cut -c1-16)"
bin="$tools/otelcol-lockgate-$sum"
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
command -v go >/dev/null || { echo "otelcol.sh: go is not installed (needed to build the collector)" >&2; exit 1; }
mkdir -p "$tools"
echo "otelcol.sh: building the OpenTelemetry Collector (once; a few minutes on 2 cores)" >&2
cd "$src"
# nice: the build shares the machine's cores with whatever else runs (tests, other builds).
nice -n 19 go build -mod=readonly -trimpath -ldflags="-s -w" -o "$bin.tmp" . >&2
mv "$bin.tmp" "$bin"
echo "$bin"
