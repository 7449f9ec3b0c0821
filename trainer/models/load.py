"""The model folders a run starts from: the built-once tiny model or a configured path."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from trainer.config import TrainConfig


def prepare_model(cfg: TrainConfig, run_dir: Path) -> Path:
    """The initial model folder: built once for ``tiny``, else the configured path."""
    if cfg.model.path != "tiny":
        return Path(cfg.model.path)
    path = run_dir / "model-init"
    if not (path / "config.json").exists():
        from trainer.models.tiny import make_tiny_model

        tmp = run_dir / ".model-init-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_model(
            tmp,
            task=cfg.task.name if cfg.task.name in ("arith", "countdown") else "arith",
            seed=cfg.model.seed,
            hidden_size=cfg.model.hidden_size,
            num_layers=cfg.model.num_layers,
            num_heads=cfg.model.hidden_size // 64,
            vocab_size=cfg.model.vocab_size,
        )
        tmp.rename(path)
    return path


def load_model(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True
    )
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model.float(), tok
