"""Off-policy policy-gradient losses for RL on replayed rollouts.

Every loss is a pure function of ``(B, T)`` tensors: the learner's current per-token log-probs
``logp`` (with grad), the behaviour policy's log-probs ``behavior_logp`` stored with the rollout
(mu, the generator that sampled it, possibly many steps stale), advantages and a validity mask.
Some variants also use ``prox_logp`` — the log-probs of a recent "proximal" policy pi_prox
(e.g. the learner at the start of this optimisation step, recomputed without grad).

Notation: r = pi_theta / mu, r_prox = pi_theta / pi_prox, k = pi_old / mu where pi_old is
``prox_logp`` when given and ``logp.detach()`` otherwise. ``clip_surrogate(x)`` is the PPO
objective ``-min(x * A, clip(x, 1 - eps_low, 1 + eps_high) * A)``. All weights written
``sg[...]`` are detached.

``loss_type``:

* ``ppo``: ``clip_surrogate(r)`` — clipped trust region directly against the stored behaviour
  policy (GRPO/PPO with separate eps_low / eps_high, as in the replay-buffer setup).
* ``tis``: ``sg[min(k, tis_cap)] * clip_surrogate(pi_theta / pi_old)`` — truncated IS.
* ``icepop``: ``sg[k * 1{icepop_low <= k <= icepop_high}] * clip_surrogate(pi_theta / pi_old)``
  — masked IS as in IcePop: tokens whose k leaves the band contribute nothing, the rest are
  IS-weighted by k.
* ``decoupled``: ``sg[min(pi_prox / mu, decoupled_cap)] * clip_surrogate(r_prox)`` — AReaL's
  decoupled PPO; the trust region is around pi_prox rather than the stale mu. Needs prox_logp.
* ``gspo``: sequence-level ratio ``s_i = exp(mean_t log r_it)``, clipped at the sequence level.
  Implemented in the GSPO-token form ``s_it = sg[s_i] * pi_theta_t / sg[pi_theta_t]`` (value
  s_i, gradient s_i * grad log pi_t), which equals sequence-level GSPO under
  ``seq-mean-token-mean`` with per-sequence advantages and also accepts per-token advantages.
* ``asymre``: ``-(A - asymre_delta) * logp`` — off-policy REINFORCE with the baseline shifted by
  ``asymre_delta`` (baseline V = V_mu + delta; delta < 0 emphasises positive samples, the
  regime Asymmetric REINFORCE recommends). No ratio.
* ``m2po``: M2PO second-moment masking: over the valid tokens of the batch, greedily mask the
  tokens with the largest ``(log r)^2`` until the mean over the kept tokens is <= m2po_tau, then
  the *unclipped* IS surrogate ``-r * A`` on the rest. The mask is computed over the tensors
  given, so with gradient accumulation it is per micro-batch.

Masked-out tokens (icepop, m2po) still count in the normaliser, so masking shrinks the update
instead of re-scaling the surviving tokens.

``agg`` (the denominators can be overridden for gradient accumulation, see ``policy_loss``):

* ``token-mean``: sum over all valid tokens / number of valid tokens in the batch;
* ``seq-mean-token-sum``: per-sequence sum over tokens, mean over sequences;
* ``seq-mean-token-mean``: per-sequence mean over its valid tokens, mean over sequences.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = ["LOSSES", "Agg", "LossConfig", "LossOutput", "LossType", "policy_loss"]

LossType = Literal["ppo", "tis", "icepop", "decoupled", "gspo", "asymre", "m2po"]
Agg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]

LOSS_TYPES: tuple[str, ...] = get_args(LossType)
AGGS: tuple[str, ...] = get_args(Agg)

# exp() of a larger log ratio overflows float32 and is meaningless anyway; beyond it the
# gradient of the ratio is cut (clamp), which PPO's clip would mostly do already.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossConfig:
    """Which policy loss, how to aggregate it, and its hyper-parameters."""

    loss_type: LossType = "ppo"
    agg: Agg = "token-mean"
    eps_low: float = 0.2
    eps_high: float = 0.2
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 2.0
    decoupled_cap: float | None = None
    m2po_tau: float = 0.04
    asymre_delta: float = -0.1
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    # Per-sequence weight staleness_decay ** staleness (policy versions behind); None = off.
    staleness_decay: float | None = None

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
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low!r}")
        if not self.eps_high >= 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high!r}")
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
    whose clip is binding (ratio < 1 - eps_low with A < 0 / ratio > 1 + eps_high with A > 0),
    i.e. that get no policy gradient. ``is_weight_*`` and ``ess_frac`` describe the importance
    weight the loss actually applies per token (0 for masked tokens; the raw pi/mu for asymre,
    which applies none); ``ess_frac = (sum w)^2 / (n * sum w^2)``. ``masked_frac``: tokens
    dropped by icepop / m2po. ``approx_kl``: k3 estimate of KL(mu || pi_theta).
    """

    loss: Tensor
    pg_loss: Tensor
    clip_frac_low: Tensor
    clip_frac_high: Tensor
    is_weight_mean: Tensor
    is_weight_max: Tensor
    ess_frac: Tensor
    masked_frac: Tensor
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


def _clip_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    return -torch.minimum(unclipped, clipped)


def _exp_ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(torch.clamp(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _m2po_keep(log_ratio: Tensor, mask: Tensor, tau: float) -> Tensor:
    """Greedy M2PO mask: drop the largest (log r)^2 until the kept mean is <= tau."""
    sq = torch.where(mask, log_ratio.detach().double() ** 2, torch.zeros((), dtype=torch.float64))
    flat = sq.reshape(-1)
    n = int(mask.sum())
    if n == 0:
        return mask.clone()
    # Invalid tokens get -1 so they sort last; stable sort makes tie-breaking deterministic
    # (earlier flat index is dropped first).
    key = torch.where(mask.reshape(-1), flat, torch.full_like(flat, -1.0))
    order = torch.sort(key, descending=True, stable=True).indices[:n]
    vals = flat[order]
    # kept mean after dropping the first m of the sorted values, for m = 0..n-1
    suffix = torch.flip(torch.cumsum(torch.flip(vals, [0]), 0), [0])
    kept_mean = suffix / torch.arange(n, 0, -1, dtype=torch.float64, device=vals.device)
    ok = kept_mean <= tau
    n_drop = int(torch.argmax(ok.to(torch.int8))) if bool(ok.any()) else n
    keep = mask.reshape(-1).clone()
    keep[order[:n_drop]] = False
    return keep.reshape(mask.shape)


def _aggregate(
    per_token: Tensor,
    mask: Tensor,
    agg: str,
    num_tokens_global: float | None,
    num_seqs_global: float | None,
) -> Tensor:
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if agg == "token-mean":
        denom = num_tokens_global if num_tokens_global is not None else mask.sum().clamp(min=1)
        return per_token.sum() / denom
    n_seqs = num_seqs_global if num_seqs_global is not None else mask.shape[0]
    seq_sum = per_token.sum(dim=-1)
    if agg == "seq-mean-token-sum":
        return seq_sum.sum() / n_seqs
    if agg == "seq-mean-token-mean":
        return (seq_sum / mask.sum(dim=-1).clamp(min=1)).sum() / n_seqs
    raise ValueError(f"unknown agg {agg!r}; expected one of {AGGS}")


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp(min=1)


@dataclass(frozen=True)
class _Tokens:
    """The sanitised ``(B, T)`` inputs every per-loss function reads (masked positions are 0)."""

    lp: Tensor  # current log-probs, with grad
    mu: Tensor  # behaviour log-probs
    old: Tensor  # pi_old: prox_logp when given, else lp detached
    adv: Tensor  # advantages, expanded to (B, T)
    mask: Tensor  # bool
    zero: Tensor  # a 0-dim zero of the right dtype/device

    @property
    def log_r(self) -> Tensor:  # log pi_theta / mu, with grad
        return self.lp - self.mu


@dataclass(frozen=True)
class _PG:
    """What a per-loss function returns: the per-token policy-gradient loss and what the
    diagnostics need (the detached IS weight applied, the tokens kept, the clipped ratio)."""

    pg: Tensor
    weight: Tensor
    keep: Tensor
    clip_ratio: Tensor | None = None


def _ppo(t: _Tokens, cfg: LossConfig) -> _PG:
    ratio = _exp_ratio(t.log_r)
    pg = _clip_surrogate(ratio, t.adv, cfg.eps_low, cfg.eps_high)
    return _PG(pg, ratio.detach(), t.mask, ratio)


def _proximal(t: _Tokens, cfg: LossConfig) -> _PG:
    """tis / icepop / decoupled: an IS weight k = pi_old / mu times a clip around pi_old."""
    k = _exp_ratio(t.old - t.mu)
    keep = t.mask
    if cfg.loss_type == "tis":
        weight = torch.clamp(k, max=cfg.tis_cap)
    elif cfg.loss_type == "icepop":
        keep = t.mask & (k >= cfg.icepop_low) & (k <= cfg.icepop_high)
        weight = torch.where(keep, k, t.zero)
    else:  # decoupled
        weight = k if cfg.decoupled_cap is None else torch.clamp(k, max=cfg.decoupled_cap)
    ratio = _exp_ratio(t.lp - t.old)
    return _PG(
        weight * _clip_surrogate(ratio, t.adv, cfg.eps_low, cfg.eps_high), weight, keep, ratio
    )


def _gspo(t: _Tokens, cfg: LossConfig) -> _PG:
    n_valid = t.mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_r = (t.log_r.detach().sum(dim=-1, keepdim=True) / n_valid).expand(t.lp.shape)
    ratio = _exp_ratio(seq_log_r + t.lp - t.lp.detach())
    pg = _clip_surrogate(ratio, t.adv, cfg.eps_low, cfg.eps_high)
    return _PG(pg, ratio.detach(), t.mask, ratio)


def _asymre(t: _Tokens, cfg: LossConfig) -> _PG:
    return _PG(-(t.adv - cfg.asymre_delta) * t.lp, _exp_ratio(t.log_r.detach()), t.mask)


def _m2po(t: _Tokens, cfg: LossConfig) -> _PG:
    log_r = t.log_r
    keep = _m2po_keep(log_r, t.mask, cfg.m2po_tau)
    ratio = _exp_ratio(log_r)
    pg = torch.where(keep, -ratio * t.adv, t.zero)
    return _PG(pg, torch.where(keep, ratio.detach(), t.zero), keep)


# loss_type -> per-token policy-gradient loss; the aggregation and diagnostics are shared.
LOSSES: dict[str, Callable[[_Tokens, LossConfig], _PG]] = {
    "ppo": _ppo,
    "tis": _proximal,
    "icepop": _proximal,
    "decoupled": _proximal,
    "gspo": _gspo,
    "asymre": _asymre,
    "m2po": _m2po,
}
assert set(LOSSES) == set(LOSS_TYPES)


def _check_inputs(logp: Tensor, advantages: Tensor, cfg: LossConfig, **named) -> Tensor:
    """Raise ValueError on a shape or option mismatch; return advantages as (B, T') 2-D."""
    if cfg.loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {cfg.loss_type!r}; expected one of {LOSS_TYPES}")
    if cfg.agg not in AGGS:
        raise ValueError(f"unknown agg {cfg.agg!r}; expected one of {AGGS}")
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


def _diagnostics(
    t: _Tokens, out: _PG, cfg: LossConfig, loss: Tensor, pg_loss: Tensor, **extra
) -> LossOutput:
    """Detached diagnostics of the weight and clip actually applied (see :class:`LossOutput`)."""
    mask, zero = t.mask, t.zero
    with torch.no_grad():
        n_valid = mask.sum().clamp(min=1)
        if out.clip_ratio is not None:
            r = out.clip_ratio.detach()
            low = mask & (r < 1.0 - cfg.eps_low) & (t.adv < 0) & out.keep
            high = mask & (r > 1.0 + cfg.eps_high) & (t.adv > 0) & out.keep
            clip_low, clip_high = low.sum() / n_valid, high.sum() / n_valid
        else:
            clip_low = clip_high = zero.clone()
        w = torch.where(mask, out.weight, zero)
        sum_w, sum_w2 = w.sum(), (w * w).sum()
        ess = torch.where(sum_w2 > 0, sum_w**2 / (n_valid * sum_w2), zero)
        lr = t.log_r.detach()
        # k3 of KL(mu || pi_theta) from tokens sampled by mu: (r - 1) - log r >= 0.
        approx_kl = _masked_mean(_exp_ratio(lr) - 1.0 - lr, mask)
        return LossOutput(
            loss=loss,
            pg_loss=pg_loss,
            clip_frac_low=clip_low,
            clip_frac_high=clip_high,
            is_weight_mean=sum_w / n_valid,
            is_weight_max=w.max() if w.numel() else zero.clone(),
            ess_frac=ess,
            masked_frac=(mask & ~out.keep).sum() / n_valid,
            approx_kl=approx_kl,
            **extra,
        )


def policy_loss(
    logp: Tensor,
    behavior_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    prox_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    seq_weights: Tensor | None = None,
    staleness: Tensor | None = None,
    entropy: Tensor | None = None,
    num_tokens_global: float | None = None,
    num_seqs_global: float | None = None,
) -> LossOutput:
    """The configured policy loss plus optional k3 KL-to-reference and entropy bonus.

    Args:
        logp: ``(B, T)`` current log-probs of the sampled tokens, with grad.
        behavior_logp: ``(B, T)`` log-probs under the behaviour policy mu that sampled them.
        advantages: ``(B, T)`` per token, or ``(B,)`` / ``(B, 1)`` per sequence.
        mask: ``(B, T)`` bool/0-1, true on tokens that are trained on. Values at masked
            positions of every tensor are ignored (they may be -inf or nan).
        cfg: the loss configuration.
        prox_logp: ``(B, T)`` proximal-policy log-probs (required for ``decoupled``).
        ref_logp: ``(B, T)`` reference-policy log-probs for the k3 KL penalty (``kl_coef``).
        seq_weights: ``(B,)`` per-sequence multipliers, e.g. prioritized-replay IS weights.
        staleness: ``(B,)`` policy versions between generation and now; weights sequences by
            ``cfg.staleness_decay ** staleness`` when that is set, and is logged either way.
        entropy: ``(B, T)`` per-token entropies for the bonus (``entropy_coef``) and logging.
        num_tokens_global: ``token-mean`` denominator override — the number of valid tokens in
            the whole accumulated batch, so summing micro-batch losses equals the full-batch
            loss. Ignored by the other aggregations.
        num_seqs_global: same for the ``seq-mean-*`` aggregations (number of sequences).

    The per-token loss is ``pg + kl_coef * k3(ref || pi) - entropy_coef * entropy``, multiplied
    by the per-sequence weights, then aggregated with ``cfg.agg``.
    """
    advantages = _check_inputs(
        logp, advantages, cfg, behavior_logp=behavior_logp, mask=mask, prox_logp=prox_logp,
        ref_logp=ref_logp, entropy=entropy, seq_weights=seq_weights, staleness=staleness,
    )  # fmt: skip
    shape, dtype = logp.shape, logp.dtype
    mask = mask.bool()

    def clean(t: Tensor) -> Tensor:
        # Sanitise *before* any arithmetic so padding garbage (-inf, nan) can never reach a
        # forward value or, through 0 * inf in backward, a gradient.
        return torch.where(mask, t.to(dtype), torch.zeros((), dtype=dtype, device=t.device))

    lp = clean(logp)
    t = _Tokens(
        lp=lp,
        mu=clean(behavior_logp.detach()),
        old=clean(prox_logp.detach()) if prox_logp is not None else lp.detach(),
        adv=clean(advantages.detach().expand(shape)),
        mask=mask,
        zero=torch.zeros((), dtype=dtype, device=lp.device),
    )
    out = LOSSES[cfg.loss_type](t, cfg)

    per_token = out.pg
    kl_ref = None
    if ref_logp is not None:
        ref = clean(ref_logp.detach())
        # k3 = e^{ref - logp} - (ref - logp) - 1 >= 0, unbiased for KL(pi || ref) under pi.
        d = torch.clamp(ref - lp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        k3 = torch.exp(d) - d - 1.0
        kl_ref = _masked_mean(k3.detach(), mask)
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * k3
    ent = clean(entropy) if entropy is not None else None
    if ent is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * ent

    seq_w = torch.ones(shape[0], dtype=dtype, device=lp.device)
    if seq_weights is not None:
        seq_w = seq_w * seq_weights.detach().to(dtype)
    if staleness is not None and cfg.staleness_decay is not None:
        seq_w = seq_w * cfg.staleness_decay ** staleness.detach().to(dtype)
    per_token = per_token * seq_w[:, None]

    loss = _aggregate(per_token, mask, cfg.agg, num_tokens_global, num_seqs_global)
    pg_loss = _aggregate(
        out.pg.detach() * seq_w[:, None], mask, cfg.agg, num_tokens_global, num_seqs_global
    )
    return _diagnostics(
        t,
        out,
        cfg,
        loss,
        pg_loss,
        entropy=_masked_mean(ent.detach(), mask) if ent is not None else None,
        mean_staleness=staleness.detach().to(dtype).mean() if staleness is not None else None,
        kl_ref=kl_ref,
    )
