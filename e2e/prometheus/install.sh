#!/usr/bin/env bash
# Prometheus from Debian's packages, for tests/e2e/test_prometheus.py: a no-op when `prometheus` is on
# PATH. Root on a new machine. The package's service is not started (policy-rc.d): the test runs its
# own Prometheus inside the cluster's network namespace.
set -euo pipefail
command -v prometheus >/dev/null 2>&1 && exit 0
die() { echo "e2e/prometheus/install.sh: error: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "prometheus not found; install it as root: apt-get install prometheus"
command -v apt-get >/dev/null 2>&1 || die "prometheus not found and no apt-get to install it"
echo "[prometheus] installing prometheus from Debian" >&2
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
policy=/usr/sbin/policy-rc.d
restore=""
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && restore=1
fi
trap '[[ -n $restore ]] && rm -f "$policy"' EXIT
apt-get install -y -q --no-install-recommends prometheus >"$log" 2>&1 ||
  { apt-get update -q >>"$log" 2>&1 && apt-get install -y -q --no-install-recommends prometheus >>"$log" 2>&1; } ||
  { tail -20 "$log" >&2; die "apt-get install prometheus failed; log: $log"; }
command -v prometheus >/dev/null 2>&1 || die "installed, but prometheus is not on PATH"
echo "[prometheus] $(prometheus --version 2>&1 | head -1)" >&2
