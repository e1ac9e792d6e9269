#!/usr/bin/env bash
# Build the test control plane (kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, etcd) from the pinned wrapper module in this directory, with upstream's release
# flags, into a cache outside the work tree:
#
#   ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/kube/<pin>-<hash>/bin/
#
# <hash> covers go.mod, go.sum, this script and the Go version, so any change rebuilds.
# When the stamp matches it is a no-op. Progress goes to stderr; the last stdout line is the
# bin dir:   BIN=$(e2e/kube/build.sh | tail -1)
# A cold build takes tens of minutes on 2 cores (run it under `nice`); GOMODCACHE and
# GOCACHE are Go's usual ones, so later builds on the same machine are fast.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { echo "e2e/kube/build.sh: error: $*" >&2; exit 1; }
say() { echo "[kube-build] $*" >&2; }

command -v go >/dev/null 2>&1 || die "'go' not found on PATH (need Go >= $(sed -n 's/^go //p' "$here/go.mod"))"
for f in go.mod go.sum; do [[ -f $here/$f ]] || die "missing $here/$f"; done

export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
unset GOOS GOARCH

pin=$(sed -n 's|^\s*k8s\.io/kubernetes \(v[0-9][^ ]*\)\( //.*\)\?$|\1|p' "$here/go.mod" | head -1)
[[ -n $pin ]] || die "no 'k8s.io/kubernetes vX.Y.Z' requirement in $here/go.mod"
gover=$(go env GOVERSION) || die "'go env' failed"
hash=$( { cat "$here/go.mod" "$here/go.sum" "${BASH_SOURCE[0]}"; echo "$gover"; } | sha256sum | cut -c1-12)
out=${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/kube/$pin-$hash
bin=$out/bin
stamp=$out/stamp

names=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)
declare -A pkgs=(
  [etcd]=go.etcd.io/etcd/server/v3
  [kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver
  [kube-controller-manager]=k8s.io/kubernetes/cmd/kube-controller-manager
  [kube-scheduler]=k8s.io/kubernetes/cmd/kube-scheduler
  [kubectl]=k8s.io/kubernetes/cmd/kubectl
)

complete() {
  [[ -f $stamp ]] || return 1
  local n; for n in "${names[@]}"; do [[ -x $bin/$n ]] || return 1; done
}

if complete; then echo "$bin"; exit 0; fi

mkdir -p "$out"
exec 9>"$out.lock"
if ! flock -n 9; then
  say "another build of $pin-$hash is running; waiting for it"
  flock 9
fi
if complete; then echo "$bin"; exit 0; fi   # the other build finished it

# Version stamps as hack/lib/version.sh sets them (buildDate: the tag's commit time from the
# proxy, so builds are reproducible). The source carries no git commit, so gitCommit is empty.
info=$(go mod download -json "k8s.io/kubernetes@$pin" 2>/dev/null | sed -n 's/^\s*"Info": "\(.*\)",$/\1/p') ||
  die "cannot download k8s.io/kubernetes@$pin (Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
date=$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$info")
minor=${pin#v1.}; minor=${minor%%.*}
ldx=""
for kv in "gitVersion=$pin" gitMajor=1 "gitMinor=$minor" gitCommit= gitTreeState= "buildDate=${date:-1970-01-01T00:00:00Z}"; do
  for p in k8s.io/client-go/pkg/version k8s.io/component-base/version; do ldx+=" -X $p.$kv"; done
done
flags=(-trimpath -tags selinux,notest,grpcnotrace -ldflags "-s -w$ldx")

say "building Kubernetes $pin + etcd with $gover into $out (first build: tens of minutes)"
tmp=$out/bin.partial
rm -rf "$tmp"; mkdir -p "$tmp" "$out/logs"
t0=$SECONDS
summary=()
cd "$here"
for n in "${names[@]}"; do
  pkg=${pkgs[$n]}
  log=$out/logs/$n.log
  total=$(go list -deps "$pkg" 2>"$log" | wc -l) || true
  [[ $total -gt 0 ]] || { tail -20 "$log" >&2; die "'go list -deps $pkg' failed (module download incomplete?)"; }
  say "building $n ($pkg, $total packages in its graph)"
  t1=$SECONDS
  (
    while sleep 30; do
      c=$(grep -cE '^[A-Za-z0-9._~/-]+$' "$log" 2>/dev/null || true)
      say "  $n: $((SECONDS - t1))s, ${c:-0} packages compiled so far (cached ones are skipped); total $((SECONDS - t0))s"
    done
  ) &
  ticker=$!
  if ! go build -v "${flags[@]}" -o "$tmp/$n" "$pkg" 2>"$log"; then
    kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null || true
    grep -vE '^[A-Za-z0-9._~/-]+$' "$log" | tail -30 >&2
    die "go build of $n failed; full log: $log"
  fi
  kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null || true
  size=$(du -m "$tmp/$n" | cut -f1)
  say "built $n in $((SECONDS - t1))s (${size} MB)"
  summary+=("$n ${size}MB $((SECONDS - t1))s")
done

rm -rf "$bin"; mv "$tmp" "$bin"
{
  echo "pin=$pin"
  echo "hash=$hash"
  echo "go=$gover"
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "seconds=$((SECONDS - t0))"
  printf 'binary=%s\n' "${summary[@]}"
} > "$stamp"
say "done in $((SECONDS - t0))s"
echo "$bin"
