#!/usr/bin/env bash
# End-to-end check of a GPU machine (a short bf16 sync run with vLLM); see tools/gpu_check.py.
#   tools/gpu_check.sh [--model PATH] [--steps N]     on a GPU
#   tools/gpu_check.sh --cpu                           tiny sizes on CPU
#   tools/gpu_check.sh --lora 16                       LoRA adapters (merged into vLLM)
# PYTHON selects the interpreter (default: python).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$root/tools/gpu_check.py" "$@"
