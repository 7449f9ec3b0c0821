"""The ``[loss]`` section (:class:`LossConfig`), what a loss returns (:class:`LossOutput`) and
the checks of a loss call's inputs against them (:func:`check_loss_inputs`).

The losses themselves, and what every option does to them, are in :mod:`trainer.algo.loss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, get_args

from torch import Tensor

from rolloutstore.options import help_field as _h

__all__ = [
    "AGGS", "LOSS_TYPES", "MAX_METRICS", "Agg", "LossConfig", "LossOutput", "LossType",
    "check_loss_inputs",
]  # fmt: skip

LossType = Literal["ppo", "tis", "icepop", "decoupled", "gspo", "asymre", "m2po"]
Agg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

LOSS_TYPES: tuple[str, ...] = get_args(LossType)
AGGS: tuple[str, ...] = get_args(Agg)
# LossOutput diagnostics that combine as maxima over micro-batches, updates and ranks, not as
# token-weighted means.
MAX_METRICS = ("is_weight_max", "ratio_max_dev")


@dataclass(frozen=True)
class LossConfig:
    """Which policy loss, how to aggregate it, and its hyper-parameters."""

    loss_type: LossType = _h(
        "ppo (clip around the stored mu), tis (truncated IS), icepop (masked IS), decoupled "
        "(AReaL: clip around pi_old, needs prox_logp), gspo (sequence-level ratio), asymre "
        "(REINFORCE, shifted baseline), m2po (second-moment masking); trainer/algo/loss.py",
        "ppo",
    )
    agg: Agg = _h(
        "aggregation over tokens: token-mean, seq-mean-token-sum, seq-mean-token-mean, "
        "seq-mean-token-sum-norm (Dr. GRPO: constant normaliser agg_norm_len)",
        "token-mean",
    )
    agg_norm_len: int | None = _h(
        "seq-mean-token-sum-norm: the constant length normaliser (None: a run fills in the "
        "model-token budget of a trajectory, [generation].max_tokens x max_turns within "
        "max_total_tokens)",
        None,
    )
    eps_low: float = _h("clip range below 1: ratio < 1 - eps_low with A < 0 gets no gradient", 0.2)
    eps_high: float = _h(
        "clip range above 1: ratio > 1 + eps_high with A > 0 gets no gradient", 0.2
    )
    clip_ratio_c: float | None = _h(
        "dual clip (Ye et al. 2020): for A < 0 the objective is at least c * A, so a token "
        "whose ratio exceeds c gets no gradient (> 1; None: off)",
        3.0,
    )
    tis_cap: float = _h("tis: the cap of the truncated IS weight pi_old / mu", 2.0)
    icepop_low: float = _h("icepop: tokens with pi_old / mu below this are masked", 0.5)
    icepop_high: float = _h("icepop: tokens with pi_old / mu above this are masked", 2.0)
    icepop_renorm: bool = _h(
        "icepop: divide by the kept tokens only (masked tokens leave the denominator)", False
    )
    decoupled_cap: float | None = _h(
        "decoupled: tokens whose pi_old / mu exceeds the cap are masked (AReaL; None: uncapped)",
        5.0,
    )
    m2po_tau: float = _h(
        "m2po: mask the largest (log ratio)^2 tokens until their mean over the kept ones is <= tau",
        0.04,
    )
    asymre_delta: float = _h(
        "asymre: baseline shift, loss -(A - delta) * logp (delta < 0 favours positive samples)",
        -0.1,
    )
    kl_coef: float = _h("k3 KL penalty to a frozen reference model (0: off)", 0.0)
    entropy_coef: float = _h("entropy bonus coefficient (0: off)", 0.0)
    logprob_tolerance: float = _h(
        "largest error (nats) of stored behaviour log-probs the learner accepts (a store's "
        "[store].logprob_precision); an error b moves every ratio pi / mu by a factor within "
        "exp(+-b): 0.01 is 1%, a 20th of the default clip range. A store recording more is "
        "refused at start",
        0.01,
    )
    staleness_decay: float | None = _h(
        "per-sequence weight decay ** staleness (policy versions behind), in (0, 1] (None: off)",
        None,
    )

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; expected one of {LOSS_TYPES}")
        if self.agg not in AGGS:
            raise ValueError(f"unknown agg {self.agg!r}; expected one of {AGGS}")
        for f in fields(self):
            value = getattr(self, f.name)
            is_number = isinstance(value, float | int) and not isinstance(value, bool)
            if is_number and not math.isfinite(value):
                raise ValueError(f"{f.name} must be finite, got {value!r}")
        n = self.agg_norm_len
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"agg_norm_len must be an int >= 1 or None, got {n!r}")
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low!r}")
        if not self.eps_high >= 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high!r}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 or None, got {self.clip_ratio_c!r}")
        if not self.tis_cap > 0.0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap!r}")
        if not 0.0 <= self.icepop_low <= 1.0:
            raise ValueError(f"icepop_low must be in [0, 1], got {self.icepop_low!r}")
        if not self.icepop_high >= 1.0:
            raise ValueError(f"icepop_high must be >= 1, got {self.icepop_high!r}")
        if self.decoupled_cap is not None and not self.decoupled_cap > 0.0:
            raise ValueError(f"decoupled_cap must be > 0 or None, got {self.decoupled_cap!r}")
        if not self.m2po_tau > 0.0:
            raise ValueError(f"m2po_tau must be > 0, got {self.m2po_tau!r}")
        if not self.logprob_tolerance >= 0.0:
            raise ValueError(f"logprob_tolerance must be >= 0, got {self.logprob_tolerance!r}")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef!r}")
        if not self.entropy_coef >= 0.0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef!r}")
        if self.staleness_decay is not None and not 0.0 < self.staleness_decay <= 1.0:
            raise ValueError(
                f"staleness_decay must be in (0, 1] or None, got {self.staleness_decay!r}"
            )


@dataclass(frozen=True)
class LossOutput:
    """The scalar loss (with grad) and detached 0-dim diagnostics.

    Fractions and means are over valid tokens. ``clip_frac_low`` / ``clip_frac_high``: tokens
    whose trust-region clip is binding (ratio < 1 - eps_low with A < 0 / ratio > 1 + eps_high
    with A > 0), i.e. that get no policy gradient; ``clip_frac_dual``: tokens where the dual
    clip binds (A < 0, ratio > clip_ratio_c). ``is_weight_*`` and ``ess_frac`` describe the
    weight the gradient actually gets per token — ``w`` with ``d pg / d log pi = -w * A``:
    the (IS weight times) ratio where the gradient flows, 0 where a clip binds or a mask drops
    the token (the raw pi/mu for asymre, which applies none); ``ess_frac = (sum w)^2 / (n *
    sum w^2)``, so clipped and masked tokens count as lost samples. ``masked_frac``: tokens
    dropped by icepop / decoupled's cap / m2po. ``ratio_max_dev``: max |ratio - 1| of the
    ratio the clip acts on (pi_theta / pi_old for tis / icepop / decoupled: exactly 0 on the
    first mini-batch of a step). ``approx_kl``: k3 estimate of KL(mu || pi_theta).
    """

    loss: Tensor
    pg_loss: Tensor
    clip_frac_low: Tensor
    clip_frac_high: Tensor
    clip_frac_dual: Tensor
    is_weight_mean: Tensor
    is_weight_max: Tensor
    ess_frac: Tensor
    masked_frac: Tensor
    ratio_max_dev: Tensor
    approx_kl: Tensor
    entropy: Tensor | None = None
    mean_staleness: Tensor | None = None
    kl_ref: Tensor | None = None

    def metrics(self) -> dict[str, float]:
        """Plain floats for logging (synchronises with the device); ``None`` fields skipped."""
        return {
            f.name: float(getattr(self, f.name).detach())
            for f in fields(self)
            if getattr(self, f.name) is not None
        }


def check_loss_inputs(logp: Tensor, advantages: Tensor, cfg: LossConfig, **named) -> Tensor:
    """:func:`trainer.algo.loss.policy_loss`'s inputs: raise ValueError on a shape or option
    mismatch; return ``advantages`` as ``(B, T')`` 2-D."""
    if cfg.loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {cfg.loss_type!r}; expected one of {LOSS_TYPES}")
    if cfg.agg not in AGGS:
        raise ValueError(f"unknown agg {cfg.agg!r}; expected one of {AGGS}")
    if cfg.agg == "seq-mean-token-sum-norm" and cfg.agg_norm_len is None:
        raise ValueError(
            "agg 'seq-mean-token-sum-norm' requires agg_norm_len (the constant length "
            "normaliser, e.g. the generation's max_tokens)"
        )
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    shape = logp.shape
    for name in ("behavior_logp", "mask", "prox_logp", "ref_logp", "entropy"):
        t = named[name]
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(shape)}")
    for name in ("seq_weights", "staleness"):
        t = named[name]
        if t is not None and tuple(t.shape) != (shape[0],):
            raise ValueError(f"{name} must be (B,)=({shape[0]},), got {tuple(t.shape)}")
    needs = (
        (cfg.loss_type == "decoupled", "prox_logp", "loss_type 'decoupled' requires prox_logp"),
        (cfg.kl_coef > 0, "ref_logp", f"kl_coef={cfg.kl_coef} requires ref_logp"),
        (cfg.entropy_coef > 0, "entropy", f"entropy_coef={cfg.entropy_coef} requires entropy"),
        (
            cfg.staleness_decay is not None,
            "staleness",
            f"staleness_decay={cfg.staleness_decay} requires staleness",
        ),
    )
    for needed, name, message in needs:
        if needed and named[name] is None:
            raise ValueError(message)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    if (
        advantages.dim() != 2
        or advantages.shape[0] != shape[0]
        or advantages.shape[1] not in (1, shape[1])
    ):
        raise ValueError(
            f"advantages must be (B, T), (B,) or (B, 1) with B={shape[0]}, "
            f"got {tuple(advantages.shape)}"
        )
    return advantages
