#!/usr/bin/env bash
# Build the Gateway API's echo server (conformance/echo-basic, at the revision the inference extension's
# conformance suite pins) into
# ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/echo-basic/<version>-<hash>/bin/echo-basic
# (e2e/go-tool-build.sh). The last stdout line is the bin dir.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/conformance" && pwd)
tool=echo-basic title="the Gateway API's echo server" pkg=sigs.k8s.io/gateway-api/conformance/echo-basic ldx=
version=$(sed -n 's|^\s*sigs\.k8s\.io/gateway-api \(v[0-9][^ ]*\).*$|\1|p' "$here/go.mod" | head -1)
source "$here/../../go-tool-build.sh"
go_tool_build
