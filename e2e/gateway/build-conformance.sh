#!/usr/bin/env bash
# Build the Gateway API Inference Extension's conformance suite (conformance/, a test binary) into
# ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/gie-conformance/<version>-<hash>/bin/gie-conformance
# (e2e/go-tool-build.sh). The last stdout line is the bin dir.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/conformance" && pwd)
tool=gie-conformance title="the inference extension's conformance suite" pkg=. ldx= test=1
version=$(sed -n 's|^require sigs\.k8s\.io/gateway-api-inference-extension \(v[0-9][^ ]*\).*$|\1|p' "$here/go.mod" | head -1)
source "$here/../../go-tool-build.sh"
go_tool_build
