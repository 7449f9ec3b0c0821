"""The learner's optimisation settings (AdamW, the LR schedule, accumulation and memory), the
AdamW + LR schedule they build (:func:`build_adamw`), and how they apply to restored AdamW and
schedule state (:func:`apply_optim_config`: a resume with a changed ``[optim]``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

LRSchedule = Literal["constant", "cosine"]


LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, the LR schedule, gradient accumulation and memory options of the learner."""

    lr: float = field(default=1e-6, metadata={"help": "peak learning rate"})
    weight_decay: float = field(
        default=0.0, metadata={"help": "AdamW decoupled weight decay (matrices only)"}
    )
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata={"help": "AdamW betas"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    grad_clip: float | None = field(
        default=1.0, metadata={"help": "max global grad norm (None: no clipping)"}
    )
    warmup_steps: int = field(default=0, metadata={"help": "linear warmup steps from lr/warmup"})
    lr_schedule: LRSchedule = field(
        default="constant", metadata={"help": "after warmup: constant, or cosine to min_lr_ratio"}
    )
    total_steps: int | None = field(
        default=None,
        metadata={"help": "learner steps (drawn batches) of the run (required for cosine)"},
    )
    min_lr_ratio: float = field(default=0.0, metadata={"help": "cosine floor as a fraction of lr"})
    micro_batch_tokens: int | None = field(
        default=None,
        metadata={
            "help": "split a single batch dict into micro-batches of at most this many tokens"
        },
    )
    grad_checkpointing: bool = field(
        default=False, metadata={"help": "recompute activations in backward (HF models)"}
    )
    seed: int = field(
        default=0,
        metadata={"help": "torch seed set at construction (dropout); seeds the mini-batch order"},
    )
    ppo_epochs: int = field(
        default=1,
        metadata={"help": "passes over each drawn batch (each mini-batch one optimizer step)"},
    )
    mini_batches: int = field(
        default=1, metadata={"help": "mini-batches (optimizer steps) per pass over a drawn batch"}
    )

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
        if not _is_int(self.seed):
            raise ValueError(f"OptimConfig.seed must be an int, got {self.seed!r}")

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
