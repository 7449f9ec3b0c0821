"""The learner's state: its weights and optimizer state for checkpoints, sharded or not.

:class:`trainer.algo.learner.Learner` calls these from ``state_dict``, ``load_state_dict`` and
``full_weights`` with its parts (model, optimizer, the wrapped module ``ddp``, the ``sharded``
flag); they never see the learner itself. Unsharded they are the model's and the optimizer's
own state dicts. Sharded (FSDP2 through :func:`trainer.run.distributed.shard_learner`) they are
collectives over the wrapped module: every rank calls them; the full state is gathered to rank 0
(the only one that writes checkpoints) and restored from the full state on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trainer.models.lora import generator_state

__all__ = ["full_weights", "gather_state", "restore_rng", "restore_state", "rng_state"]


def full_weights(
    model: Any, ddp: Any | None, *, sharded: bool, all_ranks: bool = False
) -> dict[str, Tensor]:
    """The model's full (unsharded) state dict, on CPU when sharded (see Learner.full_weights)."""
    if not sharded:
        return generator_state(model)  # LoRA adapters merged into base weights
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks)
    full = get_model_state_dict(ddp, options=opts)
    # The FSDP root is the LogProbModule: its names carry the "model." of its attribute.
    return {k.removeprefix("model."): v for k, v in full.items()}


def gather_state(
    model: Any, optimizer: torch.optim.Optimizer, ddp: Any | None, *, sharded: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state dict, optimizer state dict); sharded: the full ones on rank 0, a collective."""
    if not sharded:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    weights = full_weights(model, ddp, sharded=True)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return weights, get_optimizer_state_dict(ddp, optimizer, options=opts)


def restore_state(
    model: Any,
    optimizer: torch.optim.Optimizer,
    ddp: Any | None,
    state: dict[str, Any],
    *,
    sharded: bool,
) -> None:
    """Load ``state["model"]`` and ``state["optimizer"]`` (sharded: the full ones, every rank)."""
    saved = bool(state.get("sharded", False))
    if saved != sharded:
        # The optimizer state is keyed by parameter name when sharded, by index otherwise.
        raise ValueError(
            f"this checkpoint was written with run.fsdp = {str(saved).lower()} and is being "
            f"restored with run.fsdp = {str(sharded).lower()}: resume with "
            f"--set run.fsdp={str(saved).lower()}"
        )
    if not sharded:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    weights = {f"model.{k}": v for k, v in state["model"].items()}
    set_model_state_dict(ddp, weights, options=opts)
    set_optimizer_state_dict(ddp, optimizer, state["optimizer"], options=opts)


def rng_state(device: torch.device) -> dict[str, Tensor]:
    """The torch RNG state (and ``device``'s CUDA one), under their checkpoint keys."""
    state = {"torch_rng": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Restore :func:`rng_state` (a CUDA state only onto a CUDA device)."""
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], device)
