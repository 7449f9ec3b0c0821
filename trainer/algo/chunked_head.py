"""The chunked LM head: target log-probs and entropies without ever building ``(T, V)`` logits.

:func:`trainer.algo.logprobs.token_logprobs` applies :class:`ChunkedHeadLogProbs`, a custom
``torch.autograd.Function`` that runs the LM head a chunk of rows at a time: forward keeps only
per-token scalars, backward recomputes each chunk's logits and folds their analytic gradient
into the gradients of the hidden states, the head weight and bias. Both run in float32 (float64
for float64 inputs) with autocast off. The sampler's processing (temperature, top-k, top-p:
:func:`keep_mask`, :func:`top_p_keep`) is applied to every chunk exactly as the samplers do;
the rules, the precision and the memory bound are described in :mod:`trainer.algo.logprobs`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ChunkedHeadLogProbs",
    "chunk_stats",
    "entropy_from_logp",
    "head_dtype",
    "keep_mask",
    "no_autocast",
    "top_p_keep",
]


def top_p_keep(scores: Tensor, top_p: float) -> Tensor:
    """Boolean mask (shaped like ``scores``) of the tokens top-p keeps, over the last dim.

    transformers' ``TopPLogitsWarper`` and vLLM's sampler, step for step: sort the (processed)
    logits ascending, softmax, cumulative sum, drop positions whose sum is <= ``1 - top_p``,
    never the last (most likely) one. ``-inf`` entries (top-k) stay dropped.
    """
    # The samplers' own (default, not stable) sort: on equal inputs it orders ties the same way,
    # so a tie at the boundary is split exactly as the sampler split it.
    sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1 - top_p)
    drop_sorted[..., -1] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return ~drop & (scores > float("-inf"))


def keep_mask(scaled: Tensor, top_k: int | None, top_p: float | None) -> Tensor | None:
    """Boolean (N, V) mask of the tokens the sampler could emit, or None when all can."""
    keep: Tensor | None = None
    vocab = scaled.shape[-1]
    if top_k is not None and top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        keep = scaled >= kth
    if top_p is not None and top_p < 1.0:
        masked = scaled if keep is None else scaled.masked_fill(~keep, float("-inf"))
        keep_p = top_p_keep(masked, top_p)
        keep = keep_p if keep is None else keep & keep_p
    return keep


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    # At least float32 (bf16/fp16 softmax is too coarse for log-probs); float64 stays float64.
    return torch.promote_types(dtype, torch.float32)


def head_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    return torch.promote_types(_softmax_dtype(hidden.dtype), _softmax_dtype(weight.dtype))


def no_autocast(t: Tensor):
    # Inside the custom function nothing may be autocast: forward and backward must compute in
    # the same (float32) precision, and the caller's autocast would make the head bf16.
    return torch.autocast(device_type=t.device.type, enabled=False)


def chunk_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """Float32 processed log-softmax of one chunk (``weight``, ``bias``: already float32).

    Returns ``(logp (C, V), safe_targets (C,), keep (C, V) or None, target_logp (C,),
    valid (C,))`` where ``valid`` marks non-negative (non-ignored) targets.
    """
    logits = hidden.to(weight.dtype) @ weight.t()
    if bias is not None:
        logits = logits + bias
    scaled = logits / temperature
    keep = keep_mask(scaled, top_k, top_p)
    if keep is not None:
        scaled = scaled.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(scaled, dim=-1)
    valid = targets >= 0
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets)).long()
    target_logp = logp.gather(-1, safe_targets[:, None]).squeeze(-1)
    target_logp = torch.where(valid, target_logp, torch.zeros_like(target_logp))
    return logp, safe_targets, keep, target_logp, valid


def entropy_from_logp(logp: Tensor) -> Tensor:
    # p * log p is 0 * -inf = nan on dropped tokens; their true contribution is 0. The -inf is
    # replaced *before* the product so autograd never multiplies a zero gradient by -inf.
    p = logp.exp()
    safe_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    return -(p * safe_logp).sum(dim=-1)


class ChunkedHeadLogProbs(torch.autograd.Function):
    """(N, H) hidden -> (N,) target log-probs and (N,) entropies, one chunk of rows at a time."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        out_dtype = head_dtype(hidden, weight)
        out_logp = torch.empty(n, dtype=out_dtype, device=hidden.device)
        out_ent = torch.zeros(n, dtype=out_dtype, device=hidden.device)
        with no_autocast(hidden):
            # One cast of the head per call (a no-op for float32 master weights).
            w = weight.to(out_dtype)
            b = None if bias is None else bias.to(out_dtype)
            for start in range(0, n, chunk_size):
                stop = min(start + chunk_size, n)
                logp, _, _, target_logp, _ = chunk_stats(
                    hidden[start:stop], w, b, targets[start:stop], temperature, top_k, top_p
                )
                out_logp[start:stop] = target_logp
                if with_entropy:
                    out_ent[start:stop] = entropy_from_logp(logp)
        # Only the inputs are saved: O(N*H + V*H), never O(N*V).
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature = temperature
        ctx.top_k = top_k
        ctx.top_p = top_p
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(out_ent)
        return out_logp, out_ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_logp: Tensor | None, grad_ent: Tensor | None) -> tuple:
        hidden, weight, bias, targets = ctx.saved_tensors
        with no_autocast(hidden):
            grads = _head_backward(ctx, hidden, weight, bias, targets, grad_logp, grad_ent)
        return (*grads, None, None, None, None, None, None)


def _head_backward(ctx, hidden, weight, bias, targets, grad_logp, grad_ent):
    """(grad_hidden, grad_weight, grad_bias) of :class:`ChunkedHeadLogProbs`, in float32."""
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    f32 = head_dtype(hidden, weight)
    w = weight.to(f32)
    b = None if bias is None else bias.to(f32)
    grad_hidden = torch.zeros_like(hidden) if need_h else None
    # Accumulate the head gradients in float32 across chunks; cast once at the end.
    grad_weight = torch.zeros(weight.shape, dtype=f32, device=weight.device) if need_w else None
    grad_bias = torch.zeros(weight.shape[0], dtype=f32, device=weight.device) if need_b else None
    n = hidden.shape[0]
    for start in range(0, n, ctx.chunk_size):
        stop = min(start + ctx.chunk_size, n)
        h = hidden[start:stop]
        logp, safe_t, keep, _, valid = chunk_stats(
            h, w, b, targets[start:stop], ctx.temperature, ctx.top_k, ctx.top_p
        )
        p = logp.exp()
        # d log p_y / d s = onehot(y) - p, with s the processed (scaled, masked) logits.
        grad_s = torch.zeros_like(p)
        if grad_logp is not None:
            g = torch.where(valid, grad_logp[start:stop].to(p.dtype), torch.zeros_like(p[:, 0]))
            grad_s = grad_s - g[:, None] * p
            grad_s.scatter_add_(-1, safe_t[:, None], g[:, None])
        if ctx.with_entropy and grad_ent is not None:
            # dH/ds_j = -p_j (log p_j + H); dropped tokens have p_j = 0.
            safe_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
            ent = -(p * safe_logp).sum(dim=-1, keepdim=True)
            g_ent = grad_ent[start:stop].to(p.dtype)
            grad_s = grad_s - g_ent[:, None] * p * (safe_logp + ent)
        if keep is not None:
            # Dropped logits were replaced by a constant -inf: no gradient reaches them.
            grad_s = grad_s * keep
        grad_z = grad_s / ctx.temperature  # (C, V), float32
        if grad_hidden is not None:
            grad_hidden[start:stop] = (grad_z @ w).to(hidden.dtype)
        if grad_weight is not None:
            grad_weight.addmm_(grad_z.t(), h.to(f32))
        if grad_bias is not None:
            grad_bias += grad_z.sum(dim=0)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias
