#!/usr/bin/env bash
# Build the Gateway API Inference Extension's reference endpoint picker (`cmd/epp`, the `tool` of the
# pinned module in extension/) into ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/epp/<version>-<hash>/bin/epp
# (e2e/go-tool-build.sh; about 2 minutes cold on 2 cores). The last stdout line is the bin dir.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/extension" && pwd)
tool=epp title="the reference endpoint picker" pkg=sigs.k8s.io/gateway-api-inference-extension/cmd/epp ldx=
version=$(sed -n 's|^require sigs\.k8s\.io/gateway-api-inference-extension \(v[0-9][^ ]*\).*$|\1|p' "$here/go.mod" | head -1)
source "$here/../../go-tool-build.sh"
go_tool_build
