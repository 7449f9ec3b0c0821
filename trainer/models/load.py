"""Loading a model folder for the learner (weights in float32, as the generators score)."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.errors import ModelError


def load_model(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True
    )
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model.float(), tok


def check_model_dir(path: str | Path) -> Path:
    """``path`` as a model folder, or ModelError saying what is missing (before any run state
    is written, so a typo in ``[model].path`` leaves nothing behind)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(
            f"[model].path {str(path)!r}: no such folder; give a local model folder (a "
            f'transformers save_pretrained folder with config.json) or "tiny"'
        )
    if not (path / "config.json").is_file():
        raise ModelError(
            f"[model].path {str(path)!r} has no config.json: give the folder that "
            f"save_pretrained wrote (weights, config.json, tokenizer files)"
        )
    return path
