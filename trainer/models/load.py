"""Loading a model folder for the learner (weights in float32, as the generators score)."""

from __future__ import annotations

from pathlib import Path

import torch


def load_model(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True
    )
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model.float(), tok
