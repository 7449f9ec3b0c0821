#!/usr/bin/env bash
# End-to-end check of a GPU machine (a short bf16 sync run with vLLM); see tools/gpu_check.py.
#   tools/gpu_check.sh [--model PATH] [--steps N]     on a GPU
#   tools/gpu_check.sh --cpu                           tiny sizes on CPU
# PYTHON selects the interpreter (default: python).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$root/tools/gpu_check.py" "$@"
