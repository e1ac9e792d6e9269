#!/usr/bin/env bash
# A server the tests run, from Debian's packages: `install.sh PACKAGE COMMAND` is a no-op when COMMAND
# is on PATH. Root on a new machine. The package's service is not started (policy-rc.d): each test runs
# its own server (Prometheus inside the cluster's network namespace, redis-server on loopback).
#   e2e/debian/install.sh prometheus prometheus      # tests/e2e/test_prometheus.py
#   e2e/debian/install.sh redis-server redis-server  # tests/test_session_store.py
#   e2e/debian/install.sh iptables iptables          # e2e/soak.py (the kv_stream_dropped fault)
set -euo pipefail
package=${1:?usage: install.sh PACKAGE COMMAND} command=${2:?usage: install.sh PACKAGE COMMAND}
command -v "$command" >/dev/null 2>&1 && exit 0
die() { echo "e2e/debian/install.sh: error: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "$command not found; install it as root: apt-get install $package"
command -v apt-get >/dev/null 2>&1 || die "$command not found and no apt-get to install it"
echo "[debian] installing $package" >&2
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
policy=/usr/sbin/policy-rc.d
restore=""
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && restore=1
fi
trap '[[ -n $restore ]] && rm -f "$policy"' EXIT
apt-get install -y -q --no-install-recommends "$package" >"$log" 2>&1 ||
  { apt-get update -q >>"$log" 2>&1 && apt-get install -y -q --no-install-recommends "$package" >>"$log" 2>&1; } ||
  { tail -20 "$log" >&2; die "apt-get install $package failed; log: $log"; }
command -v "$command" >/dev/null 2>&1 || die "installed, but $command is not on PATH"
echo "[debian] $package: $("$command" --version 2>&1 | head -1)" >&2
