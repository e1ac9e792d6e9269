# Build one Go tool from a pinned wrapper module into a cache outside the work tree; sourced by each
# tool's build script (e2e/helm/build.sh, e2e/tracing/build-collector.sh, e2e/gateway/build-*.sh),
# which sets:
#
#   tool     the binary's name, and the cache folder's:  <cache>/<tool>/<version>-<hash>/bin/<tool>
#   title    what the progress lines call it
#   here     the wrapper module's directory (go.mod, go.sum, any Go sources)
#   pkg      the package to build ("." for the wrapper's own main)
#   version  the pinned version, for the folder's name and the stamp
#   ldx      extra -ldflags (version stamps), may be empty
#   test     1: the package's test binary (`go test -c`), else its command
#
# and then calls `go_tool_build`. <cache> is ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}; <hash>
# covers go.mod, go.sum, the wrapper's Go sources (in any folder), the calling script, this file and the
# Go version. A no-op once built; one build at a time per folder (flock); with ROUTERFLEET_NO_BUILD=1,
# exit 3 instead of building. Progress goes to stderr, with a line every 30 s while Go builds; the last
# stdout line is the bin dir:  BIN=$(bash e2e/helm/build.sh | tail -1)

go_tool_build() {
  set -euo pipefail
  local script=${BASH_SOURCE[1]}
  die() { echo "$script: error: $*" >&2; exit 1; }
  say() { echo "[$tool-build] $*" >&2; }

  command -v go >/dev/null 2>&1 || die "'go' not found on PATH (need Go >= $(sed -n 's/^go //p' "$here/go.mod"))"
  [[ -n $version ]] || die "no pinned version of $pkg in $here/go.mod"
  export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
  unset GOOS GOARCH
  local gover hash out bin t0 ticker
  gover=$(go env GOVERSION) || die "'go env' failed"
  # Sorted names, so the hash does not depend on the shell's locale or the order files were made in.
  hash=$( { cat "$here/go.mod" "$here/go.sum"; LC_ALL=C find "$here" -name '*.go' | sort | xargs -r cat
            cat "$script" "${BASH_SOURCE[0]}"; echo "$gover"; } | sha256sum | cut -c1-12)
  out=${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/$tool/$version-$hash
  bin=$out/bin

  if [[ -x $bin/$tool && -f $out/stamp ]]; then echo "$bin"; return 0; fi
  if [[ ${ROUTERFLEET_NO_BUILD:-} == 1 ]]; then exit 3; fi  # asked whether it is built: it is not
  mkdir -p "$out"
  exec 9>"$out.lock"
  flock 9
  if [[ -x $bin/$tool && -f $out/stamp ]]; then echo "$bin"; return 0; fi  # another build finished it

  say "building $title $version with $gover into $out"
  t0=$SECONDS
  (while sleep 30; do say "  still building: $((SECONDS - t0))s"; done) &
  ticker=$!
  trap "kill $ticker 2>/dev/null || true" EXIT
  cd "$here"
  rm -rf "$out/bin.partial"; mkdir -p "$out/bin.partial"
  local build=(go build)
  if [[ ${test:-} == 1 ]]; then build=(go test -c); fi
  "${build[@]}" -trimpath -ldflags "-s -w $ldx" -o "$out/bin.partial/$tool" "$pkg" || die "${build[*]} of $pkg failed"
  rm -rf "$bin"; mv "$out/bin.partial" "$bin"
  printf 'version=%s\nhash=%s\ngo=%s\nseconds=%s\n' "$version" "$hash" "$gover" "$((SECONDS - t0))" > "$out/stamp"
  say "built $title $version in $((SECONDS - t0))s"
  echo "$bin"
}
