"""Atomic checkpoints: everything a resume needs, verified before it is used.

A checkpoint is a folder ``RUN_DIR/checkpoints/step-000123/`` holding

    model.safetensors   the weights (exact float bits); with [model.lora] only the adapters'
                        (the base weights are frozen and reload from the model folder)
    trainer.pt          optimizer + LR schedule state, torch / numpy / python RNG states
    state.json          step, policy_version, store version, loader/selector state, config
    manifest.json       name, size and sha256 of each file above; written last

It is written to a temporary sibling folder and renamed into place, so a crash
leaves either the previous checkpoint or the new one, never half of one; a save a
kill interrupted leaves a ``.tmp-step-*`` folder, removed when the run restarts
(:func:`remove_abandoned_saves`). The last ``keep`` checkpoints are kept. The weights
and the torch RNG state are stored once: where ``trainer_state`` holds the same weights
mapping (or an equal RNG state) ``trainer.pt`` holds a reference to them instead.

Resume reads the newest checkpoint that is whole (:func:`newest_good_checkpoint`): its
files match the manifest (checkpoints from before manifests: they load) and parse.
A damaged one is skipped with one warning line naming it; if none is usable, one
:class:`CheckpointError` line names every folder tried and why.

Published weights (learner -> generators) live in :mod:`trainer.rollout.weights`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from trainer.errors import CheckpointError
from trainer.models.lora import adapter_state, has_lora, is_adapter_state
from trainer.rollout.weights import atomic_dir, state_tensors

if TYPE_CHECKING:
    from trainer.algo.learner import Learner
    from trainer.config import TrainConfig

STEP_FMT = "step-{:09d}"
MANIFEST = "manifest.json"
CHECKPOINT_FILES = ("model.safetensors", "trainer.pt", "state.json")
# What trainer.pt holds in place of a second copy of the weights / of the torch RNG state.
_WEIGHTS_REF = "<model.safetensors>"
_TORCH_RNG_REF = "<rng.torch>"


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
    """Write checkpoint ``step`` atomically and drop all but the newest ``keep``.

    ``trainer_state`` may hold ``model`` itself (a state dict) and the torch RNG state
    (e.g. a learner's ``state_dict()``): both are written once, see the module docstring."""
    root = Path(run_dir) / "checkpoints"

    def write(tmp: Path) -> None:
        save_file(state_tensors(model), str(tmp / "model.safetensors"))
        rng = rng_state()
        refs = _to_refs(trainer_state, model, rng["torch"])
        torch.save({**refs, "rng": rng}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2))
        _write_manifest(tmp)

    path = atomic_dir(root / STEP_FMT.format(step), write)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _to_refs(value: Any, weights: Any, torch_rng: torch.Tensor) -> Any:
    if value is weights:
        return _WEIGHTS_REF
    if isinstance(value, dict):
        return {k: _to_refs(v, weights, torch_rng) for k, v in value.items()}
    if (
        isinstance(value, torch.Tensor)
        and value.dtype == torch_rng.dtype
        and value.shape == torch_rng.shape
        and torch.equal(value, torch_rng)
    ):
        return _TORCH_RNG_REF
    return value


def _replace_obj(value: Any, old: Any, new: Any) -> Any:
    """``value`` with each occurrence of the object ``old`` (nested in dicts) replaced."""
    if value is old:
        return new
    if isinstance(value, dict):
        return {k: _replace_obj(v, old, new) for k, v in value.items()}
    return value


def _from_refs(value: Any, weights: Callable[[], dict], torch_rng: torch.Tensor) -> Any:
    if isinstance(value, str) and value == _WEIGHTS_REF:
        return weights()
    if isinstance(value, str) and value == _TORCH_RNG_REF:
        return torch_rng.clone()
    if isinstance(value, dict):
        return {k: _from_refs(v, weights, torch_rng) for k, v in value.items()}
    return value


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(folder: Path) -> None:
    """Flush every file, then record name, size and sha256 of each (a temp file, renamed)."""
    files = {}
    for name in CHECKPOINT_FILES:
        f = folder / name
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        files[name] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    tmp = folder / f".{MANIFEST}.tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps({"format": 1, "files": files}, indent=2))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MANIFEST)


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` if ``path``'s files do not match its manifest.

    A checkpoint without a manifest (written before manifests) passes: loading it decides."""
    path = Path(path)
    try:
        text = (path / MANIFEST).read_text()
    except FileNotFoundError:
        return
    try:
        files = json.loads(text)["files"]
        expected = {name: (int(f["size"]), str(f["sha256"])) for name, f in files.items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: {MANIFEST} is unreadable ({_one_line(exc)})") from exc
    for name, (size, digest) in expected.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing (the manifest lists it)")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{path}: {name} has {f.stat().st_size} bytes, the manifest says {size}"
            )
        if _sha256(f) != digest:
            raise CheckpointError(f"{path}: {name} does not match its sha256 in the manifest")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint read whole into memory (weights, trainer state with RNG, state.json)."""

    path: Path
    weights: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    state: dict[str, Any]

    def restore(self, model: torch.nn.Module | None) -> tuple[dict, dict]:
        """Load the weights into ``model`` (``None``: leave them to the caller, e.g. a sharded
        learner restoring from ``trainer_state``), set the RNG states; return
        (trainer_state, state) as :func:`load_checkpoint` does.

        An adapter-only checkpoint (``[model.lora]``) loads into a model with the same adapters
        whose base weights came from the model folder; the returned ``trainer_state`` then
        holds the model's whole state dict wherever it held the stored weights."""
        trainer_state = dict(self.trainer_state)
        if model is not None:
            full = self._load_into(model)
            if full is not None:
                trainer_state = _replace_obj(trainer_state, self.weights, full)
        set_rng_state(trainer_state.pop("rng"))
        return trainer_state, self.state

    def _load_into(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Load the weights; for adapter-only ones, return the model's whole state after."""
        adapters, lora = is_adapter_state(self.weights), has_lora(model)
        if adapters != lora:
            has, run = ("LoRA adapters only", "without") if adapters else ("full weights", "with")
            raise CheckpointError(
                f"{self.path} holds {has}, but this run's model is {run} [model.lora]: resume "
                f"with the [model] settings the run was started with (its run.json)"
            )
        if not adapters:
            model.load_state_dict(self.weights, strict=True)
            return None
        missing = sorted(set(adapter_state(model.state_dict())) - set(self.weights))
        unexpected = sorted(set(self.weights) - set(model.state_dict()))
        if missing or unexpected:
            raise CheckpointError(
                f"{self.path}: its adapters do not fit this run's [model.lora] (missing "
                f"{missing[:3]}, unexpected {unexpected[:3]}): resume with the run's own settings"
            )
        model.load_state_dict(self.weights, strict=False)
        return model.state_dict()


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Verify and read checkpoint ``path``; :class:`CheckpointError` names it and the
    damaged file. Changes nothing (see :meth:`Checkpoint.restore`)."""
    path = Path(path)
    verify_checkpoint(path)

    def read(name: str, load: Callable[[Path], Any], kind: type) -> Any:
        try:
            value = load(path / name)
        except Exception as exc:  # any damage: truncated, empty, garbage, missing
            raise CheckpointError(f"{path}: {name} is unreadable ({_one_line(exc)})") from exc
        if not isinstance(value, kind):
            raise CheckpointError(
                f"{path}: {name} holds a {type(value).__name__}, not a {kind.__name__}"
            )
        return value

    weights = read("model.safetensors", lambda f: load_file(str(f)), dict)
    trainer_state = read("trainer.pt", lambda f: torch.load(f, weights_only=False), dict)
    state = read("state.json", lambda f: json.loads(f.read_text()), dict)
    rng = trainer_state.get("rng")
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
        raise CheckpointError(f"{path}: trainer.pt holds no RNG state")
    if "step" not in state:
        raise CheckpointError(f"{path}: state.json names no step")
    trainer_state = _from_refs(trainer_state, lambda: weights, rng["torch"])
    return Checkpoint(path, weights, trainer_state, state)


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step-") and p.is_dir())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def newest_good_checkpoint(
    run_dir: str | os.PathLike, *, warn: Callable[[str], None] | None = None
) -> Checkpoint | None:
    """The newest checkpoint of ``run_dir`` that verifies and reads (None: there are none).

    Each damaged newer one is reported by one ``warn`` line (default: stderr) naming it;
    if every checkpoint is damaged, :class:`CheckpointError` names each and why."""
    if warn is None:

        def warn(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

    tried = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            ckpt = read_checkpoint(path)
        except CheckpointError as exc:
            tried.append(str(exc))
            continue
        for bad in tried:
            warn(f"warning: skipping damaged checkpoint {bad}; resuming from {path.name}")
        return ckpt
    if tried:
        raise CheckpointError(
            f"no usable checkpoint in {Path(run_dir) / 'checkpoints'}: tried "
            + "; ".join(tried)
            + " (restore one from a backup, or start a new run in another folder)"
        )
    return None


def saved_state(run_dir: str | os.PathLike) -> tuple[Path, dict[str, Any]] | None:
    """(folder, state.json) of the newest checkpoint whose state.json parses: a cheap look at
    what the run saved (no weights read or verified)."""
    for path in reversed(list_checkpoints(run_dir)):
        with contextlib.suppress(OSError, ValueError):
            state = json.loads((path / "state.json").read_text())
            if isinstance(state, dict):
                return path, state
    return None


def remove_abandoned_saves(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the ``.tmp-step-*`` folders saves that were killed left behind; return them.

    Call only while no save of this run can be in progress (at the start of train/resume)."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    gone = sorted(p for p in root.iterdir() if p.name.startswith(".tmp-step-") and p.is_dir())
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None) -> tuple[dict, dict]:
    """Load weights into ``model`` (``None``: leave them to the caller, e.g. a sharded learner
    restoring from ``trainer_state``); return (trainer_state, state). Restores RNG states.

    Raises :class:`CheckpointError` (naming ``path``) if the checkpoint is damaged."""
    return read_checkpoint(path).restore(model)


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
    metrics_records: int | None = None,
) -> Path:
    """Checkpoint everything a resume needs: learner state, loader position, store version,
    and (sync loop) the round schedule with the replay controller's state.

    ``learner_state``: ``learner.state_dict()`` gathered beforehand (FSDP: on every rank).
    ``metrics_records``: lines of metrics.jsonl so far (a resume drops the later ones).
    A LoRA learner's checkpoint holds only the adapter weights (and their optimizer state)."""
    if learner_state is None:
        learner_state = learner.state_dict()
    if has_lora(learner_state["model"]):
        learner_state = {**learner_state, "model": adapter_state(learner_state["model"])}
    return save_checkpoint(
        run_dir,
        step,
        model=learner_state["model"],
        trainer_state={"learner": learner_state},
        state={
            "policy_version": learner.policy_version,
            "loader": loader.state_dict(),
            # The version the loader reads (a resumed run catching up reads a snapshot).
            "store_version": loader.store.version,
            "totals": totals,
            "first_eval": first_eval,
            "config": cfg.to_dict(),
            **({"schedule": schedule} if schedule is not None else {}),
            **({"metrics_records": metrics_records} if metrics_records is not None else {}),
        },
        keep=cfg.run.keep_checkpoints,
    )
