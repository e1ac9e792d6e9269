#!/usr/bin/env bash
# Build the tests' OpenTelemetry Collector (the module in collector/: the OTLP receiver and the file
# exporter) into ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/otelcol/<version>-<hash>/bin/otelcol
# (e2e/go-tool-build.sh; about 1.5 minutes cold on 2 cores). The last stdout line is the bin dir.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/collector" && pwd)
tool=otelcol title="the OpenTelemetry Collector" pkg=. ldx=
version=$(sed -n 's|^[[:space:]]*go\.opentelemetry\.io/collector/otelcol \(v[0-9][^ ]*\).*$|\1|p' "$here/go.mod" | head -1)
source "$here/../../go-tool-build.sh"
go_tool_build
