#!/usr/bin/env bash
# Build helm (the pinned `tool` of the wrapper module in this directory) into
# ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/helm/<version>-<hash>/bin/helm (e2e/go-tool-build.sh).
# The last stdout line is the bin dir:   BIN=$(e2e/helm/build.sh | tail -1)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tool=helm title=helm pkg=helm.sh/helm/v3/cmd/helm
version=$(sed -n 's|^\s*helm\.sh/helm/v3 \(v[0-9][^ ]*\).*$|\1|p' "$here/go.mod" | head -1)
# helm's release stamps (its Makefile's LDFLAGS): `helm version` names the pinned version.
ldx="-X helm.sh/helm/v3/internal/version.version=$version -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
source "$here/../go-tool-build.sh"
go_tool_build
