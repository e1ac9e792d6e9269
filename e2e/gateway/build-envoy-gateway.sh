#!/usr/bin/env bash
# Build Envoy Gateway (`cmd/envoy-gateway`, the `tool` of the pinned module in envoy-gateway/) into
# ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/envoy-gateway/<version>-<hash>/bin/envoy-gateway
# (e2e/go-tool-build.sh; about 6 minutes cold on 2 cores). The last stdout line is the bin dir.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/envoy-gateway" && pwd)
tool=envoy-gateway title="Envoy Gateway" pkg=github.com/envoyproxy/gateway/cmd/envoy-gateway
version=$(sed -n 's|^\s*\(require \)\?github\.com/envoyproxy/gateway \(v[0-9][^ ]*\).*$|\2|p' "$here/go.mod" | head -1)
# Envoy Gateway's release stamps (its tools/make/golang.mk): `envoy-gateway version` names the pin.
ldx="-X github.com/envoyproxy/gateway/internal/cmd/version.envoyGatewayVersion=$version"
source "$here/../../go-tool-build.sh"
go_tool_build
