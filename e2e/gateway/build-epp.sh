#!/usr/bin/env bash
# Build the Gateway API Inference Extension's reference endpoint picker (`cmd/epp`, the `tool` of the
# pinned module in extension/) into a cache outside the work tree, as e2e/helm/build.sh builds helm:
#
#   ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/epp/<version>-<hash>/bin/epp
#
# <hash> covers go.mod, go.sum, this script and the Go version. A no-op once built (about 2 minutes
# cold on 2 cores). Progress goes to stderr; the last stdout line is the bin dir.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/extension" && pwd)
die() { echo "e2e/gateway/build-epp.sh: error: $*" >&2; exit 1; }
say() { echo "[epp-build] $*" >&2; }

command -v go >/dev/null 2>&1 || die "'go' not found on PATH (need Go >= $(sed -n 's/^go //p' "$here/go.mod"))"
export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
unset GOOS GOARCH

pkg=sigs.k8s.io/gateway-api-inference-extension/cmd/epp
version=$(sed -n 's|^require sigs\.k8s\.io/gateway-api-inference-extension \(v[0-9][^ ]*\).*$|\1|p' "$here/go.mod" | head -1)
[[ -n $version ]] || die "no 'require sigs.k8s.io/gateway-api-inference-extension vX.Y.Z' in $here/go.mod"
gover=$(go env GOVERSION) || die "'go env' failed"
hash=$( { cat "$here/go.mod" "$here/go.sum" "${BASH_SOURCE[0]}"; echo "$gover"; } | sha256sum | cut -c1-12)
out=${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/epp/$version-$hash
bin=$out/bin

if [[ -x $bin/epp && -f $out/stamp ]]; then echo "$bin"; exit 0; fi
mkdir -p "$out"
exec 9>"$out.lock"
flock 9
if [[ -x $bin/epp && -f $out/stamp ]]; then echo "$bin"; exit 0; fi  # another build finished it

say "building the reference endpoint picker $version with $gover into $out (first build: about 2 minutes)"
t0=$SECONDS
(while sleep 30; do say "  still building: $((SECONDS - t0))s"; done) &
ticker=$!
trap 'kill $ticker 2>/dev/null || true' EXIT
cd "$here"
rm -rf "$out/bin.partial"; mkdir -p "$out/bin.partial"
go build -trimpath -ldflags "-s -w" -o "$out/bin.partial/epp" "$pkg" || die "go build of $pkg failed"
rm -rf "$bin"; mv "$out/bin.partial" "$bin"
printf 'version=%s\nhash=%s\ngo=%s\nseconds=%s\n' "$version" "$hash" "$gover" "$((SECONDS - t0))" > "$out/stamp"
say "built the reference endpoint picker $version in $((SECONDS - t0))s"
echo "$bin"
