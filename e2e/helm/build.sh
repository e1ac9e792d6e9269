#!/usr/bin/env bash
# Build helm (the pinned `tool` of the wrapper module in this directory) into a cache outside the
# work tree, as e2e/kube/build.sh builds the control plane:
#
#   ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/helm/<version>-<hash>/bin/helm
#
# <hash> covers go.mod, go.sum, this script and the Go version. A no-op once built. Progress goes to
# stderr; the last stdout line is the bin dir:   BIN=$(e2e/helm/build.sh | tail -1)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { echo "e2e/helm/build.sh: error: $*" >&2; exit 1; }
say() { echo "[helm-build] $*" >&2; }

command -v go >/dev/null 2>&1 || die "'go' not found on PATH (need Go >= $(sed -n 's/^go //p' "$here/go.mod"))"
export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
unset GOOS GOARCH

pkg=helm.sh/helm/v3/cmd/helm
version=$(sed -n 's|^\s*helm\.sh/helm/v3 \(v[0-9][^ ]*\).*$|\1|p' "$here/go.mod" | head -1)
[[ -n $version ]] || die "no 'helm.sh/helm/v3 vX.Y.Z' requirement in $here/go.mod"
gover=$(go env GOVERSION) || die "'go env' failed"
hash=$( { cat "$here/go.mod" "$here/go.sum" "${BASH_SOURCE[0]}"; echo "$gover"; } | sha256sum | cut -c1-12)
out=${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/helm/$version-$hash
bin=$out/bin

if [[ -x $bin/helm && -f $out/stamp ]]; then echo "$bin"; exit 0; fi
mkdir -p "$out"
exec 9>"$out.lock"
flock 9
if [[ -x $bin/helm && -f $out/stamp ]]; then echo "$bin"; exit 0; fi  # another build finished it

say "building helm $version with $gover into $out (first build: a few minutes)"
t0=$SECONDS
(while sleep 30; do say "  still building: $((SECONDS - t0))s"; done) &
ticker=$!
trap 'kill $ticker 2>/dev/null || true' EXIT
cd "$here"
# helm's release stamps (its Makefile's LDFLAGS): `helm version` names the pinned version.
ldx="-X helm.sh/helm/v3/internal/version.version=$version -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
rm -rf "$out/bin.partial"; mkdir -p "$out/bin.partial"
go build -trimpath -ldflags "-s -w $ldx" -o "$out/bin.partial/helm" "$pkg" || die "go build of helm failed"
rm -rf "$bin"; mv "$out/bin.partial" "$bin"
printf 'version=%s\nhash=%s\ngo=%s\nseconds=%s\n' "$version" "$hash" "$gover" "$((SECONDS - t0))" > "$out/stamp"
say "built helm $version in $((SECONDS - t0))s"
echo "$bin"
