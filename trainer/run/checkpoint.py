"""Atomic checkpoints and published weights.

A checkpoint is a folder ``RUN_DIR/checkpoints/step-000123/`` holding

    model.safetensors   the weights (exact float bits)
    trainer.pt          optimizer + LR schedule state, torch / numpy / python RNG states
    state.json          step, policy_version, store version, loader/selector state, config

It is written to a temporary sibling folder and renamed into place, so a crash
leaves either the previous checkpoint or the new one, never half of one. The last
``keep`` checkpoints are kept.

Published weights (learner -> generators) live in :mod:`trainer.rollout.weights`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from trainer.rollout.weights import atomic_dir, state_tensors

if TYPE_CHECKING:
    from trainer.algo.learner import Learner
    from trainer.config import TrainConfig

STEP_FMT = "step-{:09d}"


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    trainer_state: dict[str, Any],
    state: dict[str, Any],
    keep: int = 3,
) -> Path:
    """Write checkpoint ``step`` atomically and drop all but the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"

    def write(tmp: Path) -> None:
        save_file(state_tensors(model), str(tmp / "model.safetensors"))
        torch.save({**trainer_state, "rng": rng_state()}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2))

    path = atomic_dir(root / STEP_FMT.format(step), write)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step-") and p.is_dir())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None) -> tuple[dict, dict]:
    """Load weights into ``model`` (``None``: leave them to the caller, e.g. a sharded learner
    restoring from ``trainer_state``); return (trainer_state, state). Restores RNG states."""
    path = Path(path)
    if model is not None:
        model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    trainer_state = torch.load(path / "trainer.pt", weights_only=False)
    set_rng_state(trainer_state.pop("rng"))
    state = json.loads((path / "state.json").read_text())
    return trainer_state, state


def save_run_checkpoint(
    run_dir: Path,
    step: int,
    cfg: TrainConfig,
    learner: Learner,
    loader,
    store,
    totals,
    first_eval,
    schedule: dict[str, Any] | None = None,
    learner_state: dict[str, Any] | None = None,
) -> Path:
    """Checkpoint everything a resume needs: learner state, loader position, store version,
    and (sync loop) the round schedule with the replay controller's state.

    ``learner_state``: ``learner.state_dict()`` gathered beforehand (FSDP: on every rank)."""
    if learner_state is None:
        learner_state = learner.state_dict()
    return save_checkpoint(
        run_dir,
        step,
        model=learner_state["model"],
        trainer_state={"learner": learner_state},
        state={
            "policy_version": learner.policy_version,
            "loader": loader.state_dict(),
            "store_version": store.version,
            "totals": totals,
            "first_eval": first_eval,
            "config": cfg.to_dict(),
            **({"schedule": schedule} if schedule is not None else {}),
        },
        keep=cfg.run.keep_checkpoints,
    )
