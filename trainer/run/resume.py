"""What a resume may change, and the record of each resume in ``run.json``.

    rolloutstore-train resume runs/arith --set optim.lr=3e-4 --set run.steps=80

A resume continues with the config the run last ran with (:func:`effective_config`) plus the
``--set`` changes. A changed ``[optim]`` or ``[model]`` key either applies from the first
resumed step or is refused before anything in the run folder is written
(:func:`check_resume`: one :class:`ConfigError` naming each key and why):

    applies   [optim] lr, weight_decay, betas, eps: set on the restored AdamW, and lr as the
              schedule's base lr (it continues from the step it reached, scaled to the new lr);
              the schedule, clipping, accumulation and epoch keys, read at every step;
              [model] device, attn_implementation, gradient_checkpointing, trust_remote_code,
              [model.lora] dropout: the model and learner are built anew at every resume
    refused   [model] path, dtype, the tiny model's keys, [model.lora] on/off, rank, alpha,
              target_modules: the checkpoint's weights (and the store's rollouts) belong to
              the model the run started with; [optim] seed: the RNG streams continue
              from the checkpoint

Keys of the other sections apply as the loop reads them (e.g. ``run.steps``), unchecked;
async actors the learner starts read the effective config (the newest resume's, as the learner).

A resume also needs the store its checkpoints trained on: one whose store is gone, or at a
lower version than its newest checkpoint read (a new store in its place), is refused
(:func:`check_resume_store`) rather than continued over rows the interrupted run never saw.

``run.json`` keeps ``config``, the config the run started with, and gains a ``resumes`` list:
one entry per resume with its time, the checkpoint and step it continued from, the keys it
changed (``{"optim.lr": [old, new]}``) and its whole effective config (:func:`note_resume`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config import TrainConfig, move_keys
from trainer.errors import ConfigError, RunDirError

if TYPE_CHECKING:
    from trainer.run.checkpoint import Checkpoint

_TINY = "they built the run's tiny model (RUN_DIR/model-init) at its start"
_ADAPTERS = "the checkpoint's adapters have the shapes and scale the run started with"

# Changed [optim] / [model] keys a resume applies; any other changed key of those sections
# is refused (a key added later is refused until it is listed here or in REFUSED).
APPLIED = frozenset(
    {
        *(f"optim.{k}" for k in ("lr", "weight_decay", "betas", "eps", "grad_clip")),
        *(f"optim.{k}" for k in ("warmup_steps", "lr_schedule", "total_steps", "min_lr_ratio")),
        "optim.micro_batch_tokens",
        "optim.ppo_epochs",
        "optim.mini_batches",
        *(f"model.{k}" for k in ("device", "attn_implementation", "gradient_checkpointing")),
        "model.trust_remote_code",
        "model.lora.dropout",
    }
)
REFUSED = {
    "model.path": "the checkpoint's weights (with LoRA: its base weights) are that model's",
    "model.hidden_size": _TINY,
    "model.num_layers": _TINY,
    "model.vocab_size": _TINY,
    "model.seed": _TINY,
    "model.dtype": "the generators' precision followed it from the start and the store's "
    "behaviour log-probs were computed in it",
    "model.lora": "the checkpoint holds the run's kind of weights (LoRA adapters only, or all)",
    "model.lora.rank": _ADAPTERS,
    "model.lora.alpha": _ADAPTERS,
    "model.lora.target_modules": _ADAPTERS,
    "optim.seed": "it seeded the learner at the start; a resume continues the checkpoint's "
    "RNG streams",
}
CHECKED_SECTIONS = ("optim", "model")


def read_run_meta(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``RUN_DIR/run.json``; :class:`RunDirError` when it is missing or damaged (not JSON, or
    without the run id, start time and config a resume continues with)."""
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise RunDirError(
            f"{run_dir} holds no run to resume (no run.json); start one with "
            f"`rolloutstore-train train CONFIG.toml`"
        )
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RunDirError(f"{path} is not valid JSON ({exc}); the run folder is damaged") from exc
    if not isinstance(meta, dict):
        raise _damaged(path, f"expected a JSON object, found {type(meta).__name__}")
    for key, kind, what in _META_KEYS:
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            found = "nothing" if key not in meta else f"{type(value).__name__} {value!r:.60}"
            raise _damaged(path, f"expected {key!r} ({what}), found {found}")
    resumes = meta.get("resumes", [])
    if not isinstance(resumes, list) or not all(
        isinstance(r, dict) and isinstance(r.get("config"), dict) for r in resumes
    ):
        raise _damaged(path, "expected 'resumes' a list of records, each with its 'config'")
    return meta


_META_KEYS = (
    ("run_id", str, "the run's id"),
    ("start_ms", int, "the run's start time in ms"),
    ("config", dict, "the config the run started with"),
)


def _damaged(path: Path, what: str) -> RunDirError:
    return RunDirError(
        f"{path} is damaged: {what}; a resume continues with the run's recorded config: "
        "restore run.json, or start a new run in another [run].dir"
    )


def check_resume_store(run_dir: str | os.PathLike, uri: str, storage_options=None) -> None:
    """Refuse a resume whose store is gone, or older than the version its newest checkpoint
    read (a new store in its place): the steps a checkpoint continues draw from the rows that
    store held, so the exact resume would be silently lost. :class:`RunDirError`; reads only."""
    from rolloutstore import RolloutStore
    from rolloutstore.errors import StoreNotFoundError
    from trainer.run.checkpoint import saved_state

    found = saved_state(run_dir)
    if found is None:  # no checkpoint: the resumed run starts at step 0 and makes its rows
        return
    ckpt, state = found
    saved = state.get("store_version")
    try:
        version = RolloutStore.open(uri, create=False, storage_options=storage_options).version
    except StoreNotFoundError:
        why = "there is no store there any more"
    else:
        if not isinstance(saved, int) or version >= saved:
            return
        why = f"it is at version {version}: an older store, or a new one in its place"
    raise RunDirError(
        f"cannot resume {run_dir}: checkpoint {ckpt} trained on the rows of the store {uri} at "
        f"version {saved}, and {why}; restore that store (or point [run] store at it), or "
        "start a new run in another [run].dir"
    )


def effective_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The config the run last ran with: its newest resume's, else the one it started with."""
    resumes = meta.get("resumes") or []
    config = resumes[-1]["config"] if resumes else meta["config"]
    # Keys that moved since the run started are read at their new place, without a warning:
    # run.json is the run's record, not a file the user edits.
    return move_keys(config, warn=False)


def config_changes(before: dict[str, Any], cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """``{"section.key": (old, new)}`` for each value ``cfg`` changes against the config dict
    ``before`` (both normalised: defaults filled in, as in run.json). ``run.dir`` is left
    out: a moved or relatively named folder is the same run."""
    old = _as_json(TrainConfig.from_dict(move_keys(before, warn=False)).to_dict())
    changes = _diff(old, _as_json(cfg.to_dict()))
    changes.pop("run.dir", None)
    return changes


def refused_changes(changes: dict[str, tuple[Any, Any]]) -> dict[str, str]:
    """``{key: why}`` for each changed ``[optim]`` / ``[model]`` key a resume cannot apply."""
    return {
        key: REFUSED.get(key, "a resume is not known to apply it")
        for key in changes
        if key.split(".", 1)[0] in CHECKED_SECTIONS and key not in APPLIED
    }


def check_resume(cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """The changes ``cfg`` makes to the run in ``[run].dir`` (see :func:`config_changes`);
    :class:`ConfigError` naming every key a resume cannot apply, and why. Writes nothing.

    No run.json: no changes (the loop then refuses the resume, naming the folder)."""
    if not (Path(cfg.run.dir) / "run.json").is_file():
        return {}
    changes = config_changes(effective_config(read_run_meta(cfg.run.dir)), cfg)
    refused = refused_changes(changes)
    if refused:
        named = "; ".join(
            f"{_toml_name(key)} ({_show(changes[key][0])} -> {_show(changes[key][1])}: {why})"
            for key, why in refused.items()
        )
        raise ConfigError(
            f"resume cannot change {named}: resume without these --set, or start a new run "
            "with them in another [run].dir"
        )
    return changes


def note_resume(run_dir: Path, cfg: TrainConfig, ckpt: Checkpoint | None) -> str:
    """Append this resume to ``run.json`` (atomically) and print one line naming the
    checkpoint it continues from, its step and the changed keys; return that line."""
    meta = read_run_meta(run_dir)
    changes = config_changes(effective_config(meta), cfg)
    step = int(ckpt.state["step"]) if ckpt is not None else 0
    meta.setdefault("resumes", []).append(
        {
            "time": time.time(),
            "step": step,
            "checkpoint": str(ckpt.path) if ckpt is not None else None,
            "changed": {k: list(v) for k, v in changes.items()},
            "config": cfg.to_dict(),
        }
    )
    tmp = run_dir / ".run.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, run_dir / "run.json")
    if ckpt is not None:
        line = f"resumed from checkpoint {ckpt.path} (step {step})"
    else:
        line = f"resumed with no checkpoint in {run_dir / 'checkpoints'} yet: from step 0"
    if changes:
        line += "; changed " + ", ".join(
            f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in changes.items()
        )
    print(line, flush=True)
    return line


def _diff(old: Any, new: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    out: dict[str, tuple[Any, Any]] = {}
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(_diff(a, b, f"{prefix}{key}."))
        elif a != b:
            out[f"{prefix}{key}"] = (a, b)
    return out


def _as_json(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d))  # tuples -> lists, as run.json holds them


def _toml_name(key: str) -> str:
    table, _, name = key.rpartition(".")
    return f"[{table}].{name}"


def _show(value: Any) -> str:
    return json.dumps(value)
