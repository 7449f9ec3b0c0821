"""The learner's optimisation settings (AdamW, the LR schedule, accumulation and memory), the
AdamW + LR schedule they build (:func:`build_adamw`), and how they apply to restored AdamW and
schedule state (:func:`apply_optim_config`: a resume with a changed ``[optim]``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from rolloutstore.options import help_field as _h

LRSchedule = Literal["constant", "cosine"]


LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, the LR schedule, gradient accumulation and memory options of the learner."""

    lr: float = _h("peak learning rate", 1e-6)
    weight_decay: float = _h("AdamW decoupled weight decay (matrices only)", 0.0)
    betas: tuple[float, float] = _h("AdamW betas", (0.9, 0.999))
    eps: float = _h("AdamW epsilon", 1e-8)
    grad_clip: float | None = _h("max global grad norm (None: no clipping)", 1.0)
    warmup_steps: int = _h("linear warmup steps from lr/warmup", 0)
    lr_schedule: LRSchedule = _h("after warmup: constant, or cosine to min_lr_ratio", "constant")
    total_steps: int | None = _h(
        "learner steps (drawn batches) the LR schedule spans (cosine needs it; a training run's "
        "None is [run].steps)",
        None,
    )
    min_lr_ratio: float = _h("cosine floor as a fraction of lr", 0.0)
    micro_batch_tokens: int | None = _h(
        "split a single batch dict into micro-batches of at most this many tokens", None
    )
    seed: int | None = _h(
        "torch seed set at construction (dropout); seeds the mini-batch order (None: 0; a "
        "training run's None is [run].seed)",
        None,
    )
    ppo_epochs: int = _h("passes over each drawn batch (each mini-batch one optimizer step)", 1)
    mini_batches: int = _h("mini-batches (optimizer steps) per pass over a drawn batch", 1)

    def __post_init__(self) -> None:
        for name in ("lr", "weight_decay", "eps", "min_lr_ratio"):
            value = getattr(self, name)
            if not (isinstance(value, float | int) and math.isfinite(value)):
                raise ValueError(f"OptimConfig.{name} must be a finite number, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr!r}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if not self.eps > 0:
            raise ValueError(f"OptimConfig.eps must be > 0, got {self.eps!r}")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"OptimConfig.betas must be two values in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if self.grad_clip is not None and not (
            math.isfinite(self.grad_clip) and self.grad_clip > 0
        ):
            raise ValueError(f"OptimConfig.grad_clip must be > 0 or None, got {self.grad_clip!r}")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(
                f"OptimConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"OptimConfig.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}"
            )
        if self.total_steps is not None and (not _is_int(self.total_steps) or self.total_steps < 1):
            raise ValueError(
                f"OptimConfig.total_steps must be a positive int or None, got {self.total_steps!r}"
            )
        if self.lr_schedule == "cosine" and self.total_steps is None:
            raise ValueError("OptimConfig.lr_schedule='cosine' requires total_steps, got None")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}"
            )
        mbt = self.micro_batch_tokens
        if mbt is not None and (not _is_int(mbt) or mbt < 1):
            raise ValueError(f"OptimConfig.micro_batch_tokens must be a positive int, got {mbt!r}")
        for name in ("ppo_epochs", "mini_batches"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"OptimConfig.{name} must be an int >= 1, got {value!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"OptimConfig.seed must be an int or None, got {self.seed!r}")

    def seeded(self) -> OptimConfig:
        """This config with an unset ``seed`` as 0, the seed the learner uses."""
        return self if self.seed is not None else replace(self, seed=0)

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at learner step ``step`` (0-based; all the optimizer steps of
        one drawn batch share it)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return 1.0
        assert self.total_steps is not None
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cos


def build_adamw(model: Any, cfg: OptimConfig) -> tuple[list[Any], Any, Any]:
    """(trainable parameters, AdamW, LR schedule) over ``model``'s current parameters."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    # Weight decay on matrices only: decaying norms' gains and biases towards 0 only hurts.
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": group, "weight_decay": wd}
            for group, wd in zip((decay, no_decay), _group_weight_decay(cfg))
        ],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
    )
    return params, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, cfg.lr_factor)


def apply_optim_config(optimizer: Any, scheduler: Any, cfg: OptimConfig) -> None:
    """Give restored AdamW and LR-schedule state ``cfg``'s hyperparameters (lr, weight decay,
    betas, eps), as :func:`build_adamw` would have.

    The schedule keeps the step it reached and continues from ``cfg.lr``: its base lrs become
    ``cfg.lr`` and each group's current lr ``cfg.lr * cfg.lr_factor(step)``, so the next
    optimizer step already uses the new value. AdamW's moments are kept. With the config the
    state was saved under this changes no bit (the schedule computes the same product)."""
    factor = cfg.lr_factor(scheduler.last_epoch)
    for group, wd in zip(optimizer.param_groups, _group_weight_decay(cfg), strict=True):
        group.update(
            lr=cfg.lr * factor, initial_lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=wd
        )
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _group_weight_decay(cfg: OptimConfig) -> tuple[float, float]:
    """Weight decay of build_adamw's two parameter groups: matrices, then gains and biases."""
    return cfg.weight_decay, 0.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)
