#!/usr/bin/env bash
# Build the tests' OpenTelemetry Collector (the module in collector/: the OTLP receiver and the file
# exporter) into a cache outside the work tree, as e2e/gateway/build-epp.sh builds the reference picker:
#
#   ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/otelcol/<version>-<hash>/bin/otelcol
#
# <version> is the pinned otelcol's; <hash> covers go.mod, go.sum, the Go sources, this script and the
# Go version. A no-op once built (about 1.5 minutes cold on 2 cores). Progress goes to stderr; the last
# stdout line is the bin dir.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/collector" && pwd)
die() { echo "e2e/tracing/build-collector.sh: error: $*" >&2; exit 1; }
say() { echo "[otelcol-build] $*" >&2; }

command -v go >/dev/null 2>&1 || die "'go' not found on PATH (need Go >= $(sed -n 's/^go //p' "$here/go.mod"))"
export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
unset GOOS GOARCH

version=$(sed -n 's|^[[:space:]]*go\.opentelemetry\.io/collector/otelcol \(v[0-9][^ ]*\).*$|\1|p' "$here/go.mod" | head -1)
[[ -n $version ]] || die "no 'go.opentelemetry.io/collector/otelcol vX.Y.Z' requirement in $here/go.mod"
gover=$(go env GOVERSION) || die "'go env' failed"
# Sorted names, so the hash does not depend on the shell's locale or the order files were made in.
hash=$( { cat "$here/go.mod" "$here/go.sum"; LC_ALL=C ls "$here"/*.go | xargs cat; cat "${BASH_SOURCE[0]}"; echo "$gover"; } \
  | sha256sum | cut -c1-12)
out=${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/otelcol/$version-$hash
bin=$out/bin

if [[ -x $bin/otelcol && -f $out/stamp ]]; then echo "$bin"; exit 0; fi
mkdir -p "$out"
exec 9>"$out.lock"
flock 9
if [[ -x $bin/otelcol && -f $out/stamp ]]; then echo "$bin"; exit 0; fi  # another build finished it

say "building the OpenTelemetry Collector $version with $gover into $out (first build: about 1.5 minutes)"
t0=$SECONDS
(while sleep 30; do say "  still building: $((SECONDS - t0))s"; done) &
ticker=$!
trap 'kill $ticker 2>/dev/null || true' EXIT
cd "$here"
rm -rf "$out/bin.partial"; mkdir -p "$out/bin.partial"
go build -trimpath -ldflags "-s -w" -o "$out/bin.partial/otelcol" . || die "go build of $here failed"
rm -rf "$bin"; mv "$out/bin.partial" "$bin"
printf 'version=%s\nhash=%s\ngo=%s\nseconds=%s\n' "$version" "$hash" "$gover" "$((SECONDS - t0))" > "$out/stamp"
say "built the OpenTelemetry Collector $version in $((SECONDS - t0))s"
echo "$bin"
