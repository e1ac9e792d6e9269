#!/usr/bin/env bash
# Build the local cluster's Envoy Gateway extension for InferencePool backends (eg-inferencepool/, built
# against the Envoy Gateway release it pins) into
# ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/eg-inferencepool/<version>-<hash>/bin/eg-inferencepool
# (e2e/go-tool-build.sh). The last stdout line is the bin dir.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/eg-inferencepool" && pwd)
tool=eg-inferencepool title="the InferencePool extension" pkg=. ldx=
version=$(sed -n 's|^\s*\(require \)\?github\.com/envoyproxy/gateway \(v[0-9][^ ]*\).*$|\2|p' "$here/go.mod" | head -1)
source "$here/../../go-tool-build.sh"
go_tool_build
