"""Atomic checkpoints and published weights.

A checkpoint is a folder ``RUN_DIR/checkpoints/step-000123/`` holding

    model.safetensors   the weights (exact float bits)
    trainer.pt          optimizer + LR schedule state, torch / numpy / python RNG states
    state.json          step, policy_version, store version, loader/selector state, config

It is written to a temporary sibling folder and renamed into place, so a crash
leaves either the previous checkpoint or the new one, never half of one. The last
``keep`` checkpoints are kept.

Weights for actors are published the same way, one folder per policy version under
``RUN_DIR/weights/v-000123/`` (``model.safetensors`` + ``config.json`` +
tokenizer files, a folder `from_pretrained` and vLLM load directly), and a
``LATEST`` file names the newest one (written to a temp file, then renamed).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STEP_FMT = "step-{:09d}"
VERSION_FMT = "v-{:09d}"


def _atomic_dir(final: Path, write) -> Path:
    """Call ``write(tmp_dir)`` then rename ``tmp_dir`` to ``final`` (replacing nothing)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        _fsync_dir(tmp)
        if final.exists():  # an identical step re-saved after a resume
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage (tied embeddings): clone to be safe.
    return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}


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
    model: torch.nn.Module,
    trainer_state: dict[str, Any],
    state: dict[str, Any],
    keep: int = 3,
) -> Path:
    """Write checkpoint ``step`` atomically and drop all but the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"

    def write(tmp: Path) -> None:
        save_file(_state_tensors(model), str(tmp / "model.safetensors"))
        torch.save({**trainer_state, "rng": rng_state()}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2))

    path = _atomic_dir(root / STEP_FMT.format(step), write)
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


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module) -> tuple[dict, dict]:
    """Load weights into ``model``; return (trainer_state, state). Restores RNG states."""
    path = Path(path)
    model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    trainer_state = torch.load(path / "trainer.pt", weights_only=False)
    set_rng_state(trainer_state.pop("rng"))
    state = json.loads((path / "state.json").read_text())
    return trainer_state, state


# -- published weights (learner -> actors) -------------------------------------------------
def publish_weights(
    weights_dir: str | os.PathLike,
    version: int,
    model: torch.nn.Module,
    *,
    template: str | os.PathLike | None = None,
    keep: int = 3,
) -> Path:
    """Publish ``model`` as policy ``version``: a loadable model folder, then ``LATEST``.

    ``template``: a model folder whose config and tokenizer files are copied beside
    the weights (so the folder loads with ``from_pretrained`` and in vLLM).
    """
    root = Path(weights_dir)

    def write(tmp: Path) -> None:
        if template is not None:
            for f in Path(template).iterdir():
                if (
                    f.is_file()
                    and not f.name.endswith((".safetensors", ".bin"))
                    and (f.name != "model.safetensors.index.json")
                ):
                    shutil.copy2(f, tmp / f.name)
        save_file(_state_tensors(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "policy_version.json").write_text(json.dumps({"policy_version": version}))

    path = _atomic_dir(root / VERSION_FMT.format(version), write)
    tmp = root / f".LATEST-{uuid.uuid4().hex[:8]}"
    tmp.write_text(f"{version}\n")
    os.replace(tmp, root / "LATEST")
    versions = sorted(p for p in root.iterdir() if p.name.startswith("v-") and p.is_dir())
    for old in versions[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def latest_weights(weights_dir: str | os.PathLike) -> tuple[int, Path] | None:
    """(version, folder) of the newest published weights, or None."""
    root = Path(weights_dir)
    try:
        version = int((root / "LATEST").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return version, root / VERSION_FMT.format(version)
