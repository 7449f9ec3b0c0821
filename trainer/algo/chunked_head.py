"""The chunked LM head: target log-probs and entropies without ever building ``(T, V)`` logits.

:func:`trainer.algo.logprobs.token_logprobs` applies :class:`ChunkedHeadLogProbs`, a custom
``torch.autograd.Function`` that runs the LM head a chunk of rows at a time: forward keeps only
per-token scalars (and, for a frozen head, two ``(N, H)`` expectations), backward either folds
those into the hidden states' gradient (frozen head: LoRA) or recomputes each chunk's logits and
folds their analytic gradient into the gradients of the hidden states, the head weight and bias
(trained head). Both run in float32 (float64 for float64 inputs) with autocast off. Every
``(C, V)`` step works in place on the chunk's one logits buffer: on CPU the head is bound by
memory traffic, and each extra pass over ``C x 49k`` floats costs a good part of the matmul
(``tools/bench_learner.py``, docs/benchmarks.md). The sampler's processing (temperature, top-k, top-p:
:func:`keep_mask`, :func:`top_p_keep`) is applied to every chunk exactly as the samplers do;
the rules, the precision and the memory bound are described in :mod:`trainer.algo.logprobs`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ChunkedHeadLogProbs",
    "chunk_logits",
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
    """Float32 processed log-softmax of one chunk (``weight``, ``bias``: already float32),
    differentiable by autograd: the straightforward reference (``naive_token_logprobs``).

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


def chunk_logits(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> tuple[Tensor, Tensor | None]:
    """One chunk's processed logits ``(C, V)`` (a fresh buffer the caller may overwrite) and the
    sampler's keep mask (None: every token kept). The same values as :func:`chunk_stats`'s
    ``scaled``, built in place: on CPU each extra ``(C, V)`` pass costs as much as a sizeable
    part of the head matmul."""
    z = hidden.to(weight.dtype) @ weight.t()
    if bias is not None:
        z += bias
    if temperature != 1.0:
        z /= temperature
    keep = keep_mask(z, top_k, top_p)
    if keep is not None:
        z.masked_fill_(~keep, float("-inf"))
    return z, keep


def _safe_targets(targets: Tensor) -> tuple[Tensor, Tensor]:
    valid = targets >= 0
    return torch.where(valid, targets, torch.zeros_like(targets)).long(), valid


class ChunkedHeadLogProbs(torch.autograd.Function):
    """(N, H) hidden -> (N,) target log-probs and (N,) entropies, one chunk of rows at a time.

    Two backward strategies, chosen in forward from what needs a gradient:

    - *frozen head* (only ``hidden`` needs one: LoRA, or a head the optimizer does not train):
      ``d log p_y / d h = (keep_y * w_y - E_p[w]) / T``, and the entropy's is
      ``-(E_p[log p * w] + H * E_p[w]) / T``. Forward has ``p`` at hand, so it stores the
      ``(N, H)`` expectations and backward is ``O(N * H)``: no second pass over the logits, the
      same two head matmuls as plain autograd over full logits.
    - *trained head* (the weight or bias needs a gradient): backward recomputes each chunk's
      logits (forward keeps only their log-sum-exp) for the weight's gradient.

    Either way nothing of size ``N * V`` is saved.
    """

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
        grad_mode: bool,
        entropy_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        dtype = head_dtype(hidden, weight)
        out_logp = torch.empty(n, dtype=dtype, device=hidden.device)
        out_ent = torch.zeros(n, dtype=dtype, device=hidden.device)
        lse_all = torch.empty(n, dtype=dtype, device=hidden.device)
        keep_y = torch.ones(n, dtype=torch.bool, device=hidden.device)
        # ctx.needs_input_grad does not know about no_grad: the caller's grad mode is passed in.
        need_h, need_w, need_b = (grad_mode and x for x in ctx.needs_input_grad[:3])
        ent_grad = with_entropy and entropy_grad
        frozen = need_h and not (need_w or need_b)
        shape = (n, hidden.shape[1])
        ew = hidden.new_zeros(shape, dtype=dtype) if frozen else None
        elw = hidden.new_zeros(shape, dtype=dtype) if frozen and ent_grad else None
        with no_autocast(hidden):
            # One cast of the head per call (a no-op for float32 master weights).
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for start in range(0, n, chunk_size):
                stop = min(start + chunk_size, n)
                safe_t, valid = _safe_targets(targets[start:stop])
                z, keep = chunk_logits(hidden[start:stop], w, b, temperature, top_k, top_p)
                lse = torch.logsumexp(z, dim=-1)
                lse_all[start:stop] = lse
                target_logp = z.gather(-1, safe_t[:, None]).squeeze(-1) - lse
                out_logp[start:stop] = torch.where(valid, target_logp, 0.0)
                if keep is not None:
                    keep_y[start:stop] = keep.gather(-1, safe_t[:, None]).squeeze(-1)
                if not (with_entropy or frozen):
                    continue
                logp = z.sub_(lse[:, None])  # the chunk's buffer becomes its log-softmax
                if not with_entropy:
                    ew[start:stop] = logp.exp_() @ w
                    continue
                p = logp.exp()
                if keep is not None:
                    logp.masked_fill_(~keep, 0.0)  # dropped tokens: p = 0, p * log p = 0
                if ew is not None:
                    ew[start:stop] = p @ w
                plogp = p.mul_(logp)
                out_ent[start:stop] = -plogp.sum(dim=-1)
                if elw is not None:
                    elw[start:stop] = plogp @ w
        if frozen:
            ctx.save_for_backward(weight, targets, keep_y, ew, elw, out_ent)
        else:
            # Only the inputs and per-row scalars: O(N*H + V*H), never O(N*V).
            ctx.save_for_backward(hidden, weight, bias, targets, lse_all, out_ent)
        ctx.frozen, ctx.ent_grad = frozen, ent_grad
        ctx.temperature, ctx.top_k, ctx.top_p = temperature, top_k, top_p
        ctx.chunk_size, ctx.hidden_dtype = chunk_size, hidden.dtype
        if not ent_grad:
            ctx.mark_non_differentiable(out_ent)
        return out_logp, out_ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_logp: Tensor | None, grad_ent: Tensor | None) -> tuple:
        saved = ctx.saved_tensors
        with no_autocast(saved[1]):
            if ctx.frozen:
                grads = (_frozen_head_backward(ctx, *saved, grad_logp, grad_ent), None, None)
            else:
                grads = _head_backward(ctx, *saved, grad_logp, grad_ent)
        return (*grads, None, None, None, None, None, None, None, None, None)


def _scaled_grads(ctx, targets, grad_logp, grad_ent, dtype) -> tuple[Tensor, Tensor | None]:
    """(g, g_ent): the incoming gradients / temperature, g zero on ignored targets."""
    if grad_logp is None:
        g = torch.zeros(targets.shape, dtype=dtype, device=targets.device)
    else:
        g = torch.where(targets >= 0, grad_logp.to(dtype), 0.0) / ctx.temperature
    g_ent = None
    if ctx.ent_grad and grad_ent is not None:
        g_ent = grad_ent.to(dtype) / ctx.temperature
    return g, g_ent


def _frozen_head_backward(ctx, weight, targets, keep_y, ew, elw, ent, grad_logp, grad_ent):
    """grad_hidden of :class:`ChunkedHeadLogProbs` from the expectations saved in forward."""
    w = weight.to(ew.dtype)
    g, g_ent = _scaled_grads(ctx, targets, grad_logp, grad_ent, ew.dtype)
    safe_t, _ = _safe_targets(targets)
    # d log p_y / dz = (onehot(y) * keep_y - p) / T  ->  (keep_y * w_y - E_p[w]) / T.
    grad = (g * keep_y)[:, None] * w[safe_t] - g[:, None] * ew
    if g_ent is not None:
        # dH/dz_j = -p_j (log p_j + H) / T  ->  -(E_p[log p * w] + H * E_p[w]) / T.
        grad -= g_ent[:, None] * (elw + ent[:, None] * ew)
    return grad.to(ctx.hidden_dtype)


def _head_backward(ctx, hidden, weight, bias, targets, lse, ent, grad_logp, grad_ent):
    """(grad_hidden, grad_weight, grad_bias) of :class:`ChunkedHeadLogProbs`, in float32."""
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    f32 = lse.dtype
    w = weight.to(f32)
    b = None if bias is None else bias.to(f32)
    g, g_ent = _scaled_grads(ctx, targets, grad_logp, grad_ent, f32)
    grad_hidden = torch.empty_like(hidden) if need_h else None
    # Accumulate the head gradients in float32 across chunks; cast once at the end.
    grad_weight = torch.zeros(weight.shape, dtype=f32, device=weight.device) if need_w else None
    grad_bias = torch.zeros(weight.shape[0], dtype=f32, device=weight.device) if need_b else None
    for start in range(0, hidden.shape[0], ctx.chunk_size):
        stop = min(start + ctx.chunk_size, hidden.shape[0])
        h = hidden[start:stop]
        safe_t, _ = _safe_targets(targets[start:stop])
        z, keep = chunk_logits(h, w, b, ctx.temperature, ctx.top_k, ctx.top_p)
        logp = z.sub_(lse[start:stop, None])
        p = logp.exp()
        gc = g[start:stop, None]
        if g_ent is not None:
            if keep is not None:
                logp.masked_fill_(~keep, 0.0)
            # g_ent * dH/dz = -g_ent * p * (log p + H), built in the logits' buffer.
            term = logp.add_(ent[start:stop, None]).mul_(p).mul_(g_ent[start:stop, None])
            grad_z = p.mul_(-gc).sub_(term)
        else:
            grad_z = p.mul_(-gc)
        # + g * onehot(y), except where the sampler dropped y (its logit was a constant -inf).
        onehot = gc if keep is None else gc * keep.gather(-1, safe_t[:, None])
        grad_z.scatter_add_(-1, safe_t[:, None], onehot)
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
