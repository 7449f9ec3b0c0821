"""The learner's state: its checkpoint state dict and its full weights, sharded or not.

:meth:`trainer.algo.learner.Learner.state_dict`, ``load_state_dict`` and ``full_weights`` call
these. Unsharded they are the model's and the optimizer's own state dicts. Sharded
(``learner.sharded``, FSDP2 through :func:`trainer.run.distributed.shard_learner`) they are
collectives over ``learner.ddp``: every rank calls them; the full state is gathered to rank 0
(the only one that writes checkpoints) and restored from the full state on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from trainer.algo.optim import apply_optim_config
from trainer.models.lora import generator_state

if TYPE_CHECKING:
    from trainer.algo.learner import Learner

__all__ = ["full_weights", "load_learner_state", "learner_state"]


def full_weights(learner: Learner, *, all_ranks: bool = False) -> dict[str, Tensor]:
    """The model's full (unsharded) state dict, on CPU when sharded (see Learner.full_weights)."""
    if not learner.sharded:
        return generator_state(learner.model)  # LoRA adapters merged into base weights
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks)
    full = get_model_state_dict(learner.ddp, options=opts)
    # The FSDP root is the LogProbModule: its names carry the "model." of its attribute.
    return {k.removeprefix("model."): v for k, v in full.items()}


def learner_state(learner: Learner) -> dict[str, Any]:
    """Weights, AdamW, schedule, version, RNG (see Learner.state_dict)."""
    if learner.sharded:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        model = learner.full_weights()
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim = get_optimizer_state_dict(learner.ddp, learner.optimizer, options=opts)
    else:
        model, optim = learner.model.state_dict(), learner.optimizer.state_dict()
    state = {
        "model": model,
        "optimizer": optim,
        "sharded": learner.sharded,
        "scheduler": learner.scheduler.state_dict(),
        "policy_version": learner.policy_version,
        "steps_done": learner.steps_done,
        "torch_rng": torch.get_rng_state(),
    }
    if learner.device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(learner.device)
    return state


def load_learner_state(learner: Learner, state: dict[str, Any]) -> None:
    """Restore :func:`learner_state` (sharded: from the full state, on every rank), with the
    learner's ``optim_cfg`` hyperparameters applied to the restored AdamW and LR schedule."""
    saved = bool(state.get("sharded", False))
    if saved != learner.sharded:
        # The optimizer state is keyed by parameter name when sharded, by index otherwise.
        raise ValueError(
            f"this checkpoint was written with run.fsdp = {str(saved).lower()} and is being "
            f"restored with run.fsdp = {str(learner.sharded).lower()}: resume with "
            f"--set run.fsdp={str(saved).lower()}"
        )
    if learner.sharded:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        model = {f"model.{k}": v for k, v in state["model"].items()}
        set_model_state_dict(learner.ddp, model, options=opts)
        set_optimizer_state_dict(learner.ddp, learner.optimizer, state["optimizer"], options=opts)
    else:
        learner.model.load_state_dict(state["model"])
        learner.optimizer.load_state_dict(state["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])
    # The learner's own [optim] wins over the saved hyperparameters (a resume may change lr).
    apply_optim_config(learner.optimizer, learner.scheduler, learner.optim_cfg)
    learner.policy_version = int(state["policy_version"])
    learner.steps_done = int(state["steps_done"])
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and learner.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], learner.device)
