"""Off-policy policy-gradient losses for RL on replayed rollouts.

Every loss is a pure function of ``(B, T)`` tensors: the learner's current per-token log-probs
``logp`` (with grad), the behaviour policy's log-probs ``behavior_logp`` stored with the rollout
(mu, the generator that sampled it, possibly many steps stale), advantages and a validity mask.
Some variants also use ``prox_logp`` — the log-probs of the proximal policy pi_old: the learner
at the start of this learner step, i.e. before the first of its optimizer steps (the config
lives in :mod:`trainer.algo.loss_config`).

Notation: r = pi_theta / mu, r_old = pi_theta / pi_old, k = pi_old / mu where pi_old is
``prox_logp`` when given and ``logp.detach()`` otherwise. ``clip_surrogate(x)`` is the PPO
objective ``-min(x * A, clip(x, 1 - eps_low, 1 + eps_high) * A)``, and with the dual clip
(``clip_ratio_c = c``, default 3, None: off) ``-max(min(...), c * A)`` for A < 0: a token with
A < 0 and x > c gets no gradient, so no negative-advantage token's gradient exceeds c times its
on-policy one. All weights written ``sg[...]`` are detached.

"1x1" below is the default learner step: one drawn batch, one optimizer step
(``[optim] ppo_epochs = mini_batches = 1``); then pi_old is the current weights, r_old == 1
exactly and only mu -> pi_old matters. With ``ppo_epochs * mini_batches > 1`` the learner scores
the batch once before its first update (pi_old, no grad) and every later mini-batch sees
r_old != 1, so the clip around pi_old binds from the second mini-batch on.

``loss_type``:

* ``ppo``: ``clip_surrogate(r)`` (dual clip on) — the trust region is around the *stored* mu
  (GRPO/PPO with separate eps_low / eps_high, as in the replay-buffer setup). 1x1 and epochs
  alike: r measures drift from mu (staleness plus this step's earlier mini-batches); pi_old is
  not used.
* ``tis``: ``sg[min(k, tis_cap)] * clip_surrogate(r_old)`` — truncated IS. 1x1: the surrogate
  is at r_old = 1, so the loss is a tis_cap-truncated IS policy gradient. Epochs: PPO's clip
  around pi_old, IS weight fixed per step.
* ``icepop``: ``sg[k * 1{icepop_low <= k <= icepop_high}] * clip_surrogate(r_old)`` — masked IS
  as in IcePop: tokens whose k leaves the band contribute nothing, the rest are IS-weighted by
  k. Masked tokens stay in the denominator unless ``icepop_renorm`` (default off): then the
  kept tokens are scaled by valid / kept tokens — per sequence under ``seq-mean-token-mean``,
  otherwise over the tensors given (per micro-batch, like m2po's mask) — so masked tokens leave
  the denominator. 1x1 / epochs: as tis.
* ``decoupled``: ``sg[k * 1{k <= decoupled_cap}] * clip_surrogate(r_old)`` — AReaL's decoupled
  PPO; the trust region is around pi_old rather than the stale mu, and tokens whose behaviour
  weight k exceeds the cap (default 5) are masked (AReaL's rule), not truncated;
  ``decoupled_cap = None`` (set explicitly) leaves k uncapped. Needs prox_logp. 1x1: a
  masked-IS policy gradient (tis with masking instead of truncation). Epochs: AReaL's setting.
* ``gspo``: sequence-level ratio ``s_i = exp(mean_t log r_it)``, clipped at the sequence level
  (no dual clip). Implemented in the GSPO-token form ``s_it = sg[s_i] * pi_theta_t /
  sg[pi_theta_t]`` (value s_i, gradient s_i * grad log pi_t), which equals sequence-level GSPO
  under ``seq-mean-token-mean`` with per-sequence advantages and also accepts per-token
  advantages. Like ppo it is relative to mu, 1x1 and epochs alike.
* ``asymre``: ``-(A - asymre_delta) * logp`` — off-policy REINFORCE with the baseline shifted by
  ``asymre_delta`` (baseline V = V_mu + delta; delta < 0 emphasises positive samples, the
  regime Asymmetric REINFORCE recommends). No ratio, so nothing bounds the later mini-batches'
  updates under epochs > 1 beyond the learning rate.
* ``m2po``: M2PO second-moment masking: over the valid tokens of the batch, greedily mask the
  tokens with the largest ``(log r)^2`` until the mean over the kept tokens is <= m2po_tau, then
  the *unclipped* IS surrogate ``-r * A`` on the rest. The mask is computed over the tensors
  given, so with gradient accumulation it is per micro-batch; under epochs > 1 r includes the
  step's own drift, which the mask then bounds.

Masked-out tokens (icepop without renorm, decoupled's cap, m2po) still count in the
normaliser, so masking shrinks the update instead of re-scaling the surviving tokens.

``agg`` (the denominators can be overridden for gradient accumulation, see ``policy_loss``):

* ``token-mean``: sum over all valid tokens / number of valid tokens in the batch;
* ``seq-mean-token-sum``: per-sequence sum over tokens, mean over sequences;
* ``seq-mean-token-mean``: per-sequence mean over its valid tokens, mean over sequences;
* ``seq-mean-token-sum-norm``: Dr. GRPO's constant normaliser, sum over all tokens /
  (sequences * ``agg_norm_len``): no length bias from a per-sequence or per-batch token count
  (the training loops set ``agg_norm_len`` to the model-token budget of a trajectory,
  ``[generation].max_tokens`` x ``max_turns`` within ``max_total_tokens``, when it is None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.algo.loss_config import (
    AGGS,
    LOSS_TYPES,
    Agg,
    LossConfig,
    LossOutput,
    LossType,
    check_loss_inputs,
)

__all__ = [
    "AGGS", "LOSSES", "LOSS_TYPES", "Agg", "LossConfig", "LossOutput", "LossType", "policy_loss",
]  # fmt: skip

# exp() of a larger log ratio overflows float32 and is meaningless anyway; beyond it the
# gradient of the ratio is cut (clamp), which PPO's clip would mostly do already.
_MAX_LOG_RATIO = 20.0


def _clip_surrogate(
    ratio: Tensor, adv: Tensor, cfg: LossConfig, *, dual: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """(per-token loss, where the gradient flows, where the dual clip binds).

    ``-min(r * A, clip(r) * A)``, and with the dual clip ``-max(that, c * A)`` for A < 0.
    """
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    objective = torch.minimum(unclipped, clipped)
    r = ratio.detach()
    flows = torch.where(adv > 0, r <= 1.0 + cfg.eps_high, r >= 1.0 - cfg.eps_low) | (adv == 0)
    binds = torch.zeros_like(flows)
    c = cfg.clip_ratio_c
    if dual and c is not None:
        # c * A is a constant floor of the objective: beyond r = c the gradient is 0.
        objective = torch.where(adv < 0, torch.maximum(objective, c * adv), objective)
        binds = (adv < 0) & (r > c)
        flows = flows & ~binds
    return -objective, flows, binds


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
    cfg: LossConfig,
    num_tokens_global: float | None,
    num_seqs_global: float | None,
) -> Tensor:
    agg = cfg.agg
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if agg == "token-mean":
        denom = num_tokens_global if num_tokens_global is not None else mask.sum().clamp(min=1)
        return per_token.sum() / denom
    n_seqs = num_seqs_global if num_seqs_global is not None else mask.shape[0]
    seq_sum = per_token.sum(dim=-1)
    if agg == "seq-mean-token-sum":
        return seq_sum.sum() / n_seqs
    if agg == "seq-mean-token-sum-norm":
        return seq_sum.sum() / (n_seqs * cfg.agg_norm_len)
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
    diagnostics need (the detached gradient weight w, d pg / d log pi = -w * A; the tokens
    kept; the ratio the clip acts on; where the dual clip binds)."""

    pg: Tensor
    weight: Tensor
    keep: Tensor
    clip_ratio: Tensor | None = None
    dual: Tensor | None = None


def _ppo(t: _Tokens, cfg: LossConfig) -> _PG:
    ratio = _exp_ratio(t.log_r)
    pg, flows, dual = _clip_surrogate(ratio, t.adv, cfg)
    return _PG(pg, torch.where(flows, ratio.detach(), t.zero), t.mask, ratio, dual)


def _renorm(keep: Tensor, mask: Tensor, agg: str) -> Tensor:
    """valid / kept tokens: per sequence for seq-mean-token-mean, else over the tensors given."""
    dims = {"dim": -1, "keepdim": True} if agg == "seq-mean-token-mean" else {}
    return mask.sum(**dims) / keep.sum(**dims).clamp(min=1)


def _proximal(t: _Tokens, cfg: LossConfig) -> _PG:
    """tis / icepop / decoupled: an IS weight k = pi_old / mu times a clip around pi_old."""
    k = _exp_ratio(t.old - t.mu)
    keep = t.mask
    if cfg.loss_type == "tis":
        is_w = torch.clamp(k, max=cfg.tis_cap)
    elif cfg.loss_type == "icepop":
        keep = t.mask & (k >= cfg.icepop_low) & (k <= cfg.icepop_high)
        is_w = torch.where(keep, k, t.zero)
        if cfg.icepop_renorm:
            is_w = is_w * _renorm(keep, t.mask, cfg.agg).to(is_w.dtype)
    elif cfg.decoupled_cap is None:
        is_w = k
    else:  # decoupled, AReaL's rule: a token beyond the cap is dropped, not truncated
        keep = t.mask & (k <= cfg.decoupled_cap)
        is_w = torch.where(keep, k, t.zero)
    ratio = _exp_ratio(t.lp - t.old)
    pg, flows, dual = _clip_surrogate(ratio, t.adv, cfg)
    weight = torch.where(flows, is_w * ratio.detach(), t.zero)
    return _PG(is_w * pg, weight, keep, ratio, dual)


def _gspo(t: _Tokens, cfg: LossConfig) -> _PG:
    n_valid = t.mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_r = (t.log_r.detach().sum(dim=-1, keepdim=True) / n_valid).expand(t.lp.shape)
    ratio = _exp_ratio(seq_log_r + t.lp - t.lp.detach())
    pg, flows, _ = _clip_surrogate(ratio, t.adv, cfg, dual=False)
    return _PG(pg, torch.where(flows, ratio.detach(), t.zero), t.mask, ratio)


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


def _diagnostics(
    t: _Tokens, out: _PG, cfg: LossConfig, loss: Tensor, pg_loss: Tensor, **extra
) -> LossOutput:
    """Detached diagnostics of the weight and clip actually applied (see :class:`LossOutput`)."""
    mask, zero = t.mask, t.zero
    with torch.no_grad():
        n_valid = mask.sum().clamp(min=1)
        clip_low = clip_high = clip_dual = dev = zero.clone()
        if out.clip_ratio is not None:
            r = out.clip_ratio.detach()
            low = mask & (r < 1.0 - cfg.eps_low) & (t.adv < 0) & out.keep
            high = mask & (r > 1.0 + cfg.eps_high) & (t.adv > 0) & out.keep
            clip_low, clip_high = low.sum() / n_valid, high.sum() / n_valid
            if mask.any():
                dev = (r - 1.0).abs()[mask].max()
        if out.dual is not None:
            clip_dual = (mask & out.dual & out.keep).sum() / n_valid
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
            clip_frac_dual=clip_dual,
            is_weight_mean=sum_w / n_valid,
            is_weight_max=w.max() if w.numel() else zero.clone(),
            ess_frac=ess,
            masked_frac=(mask & ~out.keep).sum() / n_valid,
            ratio_max_dev=dev,
            approx_kl=approx_kl,
            **extra,
        )


def _regularised(
    pg: Tensor, lp: Tensor, ref: Tensor | None, ent: Tensor | None, mask: Tensor, cfg: LossConfig
) -> tuple[Tensor, Tensor | None]:
    """(per-token ``pg + kl_coef * k3(ref || pi) - entropy_coef * entropy``, mean k3 or None)."""
    per_token = pg
    kl_ref = None
    if ref is not None:
        # k3 = e^{ref - logp} - (ref - logp) - 1 >= 0, unbiased for KL(pi || ref) under pi.
        d = torch.clamp(ref - lp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        k3 = torch.exp(d) - d - 1.0
        kl_ref = _masked_mean(k3.detach(), mask)
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * k3
    if ent is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * ent
    return per_token, kl_ref


def _sequence_weights(
    n: int, lp: Tensor, seq_weights: Tensor | None, staleness: Tensor | None, cfg: LossConfig
) -> Tensor:
    """``(n,)`` per-sequence multipliers: ``seq_weights`` times ``staleness_decay ** staleness``."""
    dtype = lp.dtype
    seq_w = torch.ones(n, dtype=dtype, device=lp.device)
    if seq_weights is not None:
        seq_w = seq_w * seq_weights.detach().to(dtype)
    if staleness is not None and cfg.staleness_decay is not None:
        seq_w = seq_w * cfg.staleness_decay ** staleness.detach().to(dtype)
    return seq_w


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
    advantages = check_loss_inputs(
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

    ref = clean(ref_logp.detach()) if ref_logp is not None else None
    ent = clean(entropy) if entropy is not None else None
    per_token, kl_ref = _regularised(out.pg, lp, ref, ent, mask, cfg)
    seq_w = _sequence_weights(shape[0], lp, seq_weights, staleness, cfg)[:, None]
    loss = _aggregate(per_token * seq_w, mask, cfg, num_tokens_global, num_seqs_global)
    pg_loss = _aggregate(out.pg.detach() * seq_w, mask, cfg, num_tokens_global, num_seqs_global)
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
