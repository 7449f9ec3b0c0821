"""Per-token log-probabilities (and entropies) of target tokens, computed in chunks.

The learner needs ``log p(y_t | y_<t)`` for every generated token. Done naively this materialises
the full ``(T, V)`` float32 logits — for T = 32k and V = 150k that is ~19 GB before autograd
keeps its own copies for backward. Here the LM head is applied to the final hidden states a
chunk of ``chunk_size`` rows at a time inside a custom ``torch.autograd.Function``: forward keeps
only per-token scalars, and backward recomputes each chunk's logits, turns them into the
gradient w.r.t. those logits analytically, and folds that into the gradients of the hidden
states, the head weight and bias before moving on. Peak extra memory is therefore
``O(chunk_size * V)`` in both forward and backward; nothing of size ``T * V`` is ever saved.

Precision: the LM head matmul and the processed softmax run in float32 (float64 for float64
inputs), whatever the model runs in: under a bf16 autocast (``[model].dtype = "bfloat16"``) the
transformer body is bf16, but bf16 logits are off by ~1e-2 nats, which would show up as a
spurious importance ratio on every token. Autocast is disabled inside both the forward and the
backward of the custom function, so the two run at the same (float32) precision; the gradient
of the hidden states is returned in their own dtype, the head's in the weight's.

Sampling processors: the generator may have sampled with temperature, top-k and top-p. The
log-probs returned are under the *processed* distribution the generator actually sampled from,
with exactly the rules of transformers' logits warpers and vLLM's sampler:

1. logits are divided by ``temperature``;
2. top-k keeps every token whose scaled logit is >= the k-th largest one (ties at the k-th
   value are all kept);
3. top-p (on the top-k-filtered logits) sorts them ascending, takes the cumulative softmax and
   drops the tokens at sorted positions where it is <= ``1 - top_p``, always keeping the most
   likely one (:func:`top_p_keep`). It works on sorted *positions*: tokens tied at the
   boundary may be split, in the order the samplers' own ``torch.sort`` call puts them (the
   same call here), so the kept set is the sampler's one, ties included. Two exceptions, both
   only for logits tied exactly at the top-p boundary: with top-k *and* top-p, vLLM's PyTorch
   sampler reuses its one sort of the raw logits where transformers (and this module) sort the
   top-k-masked logits again; and vLLM on GPU may use a Triton top-k/top-p kernel.

Rows sampled with different settings (the learner scores each replayed row under its own):
``sequence_logprobs(..., groups=, group_settings=)`` runs the body once and the head once per
settings group.

Tokens outside the kept set get log-prob ``-inf``; the entropy is that of the processed
distribution. The kept set is treated as a constant of the logits (no gradient through the
selection), as in any sampler.

Double backward through the chunked head is not supported (nothing in the trainer needs it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.algo.chunked_head import (
    ChunkedHeadLogProbs,
    chunk_stats,
    entropy_from_logp,
    head_dtype,
    no_autocast,
    top_p_keep,
)

__all__ = [
    "LogProbOutput",
    "Sampling",
    "naive_token_logprobs",
    "packed_target_mask",
    "sequence_logprobs",
    "token_logprobs",
    "top_p_keep",
]


# (temperature, top_k or None, top_p or None): one sampler's processing.
Sampling = tuple[float, int | None, float | None]


@dataclass(frozen=True)
class LogProbOutput:
    """Per-token log-probs, shaped like ``targets``; ``entropy`` only when requested."""

    logprobs: Tensor
    entropy: Tensor | None = None


def _validate(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    chunk_size: int,
    lm_head_bias: Tensor | None,
) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if isinstance(chunk_size, bool) or int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if lm_head_weight.dim() != 2:
        raise ValueError(f"lm_head_weight must be (V, H), got shape {tuple(lm_head_weight.shape)}")
    if hidden.dim() not in (2, 3) or hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden must be (B, T, H) or (N, H) with H={lm_head_weight.shape[1]}, "
            f"got shape {tuple(hidden.shape)}"
        )
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden.shape[:-1] "
            f"{tuple(hidden.shape[:-1])}"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    if lm_head_bias is not None and tuple(lm_head_bias.shape) != (lm_head_weight.shape[0],):
        raise ValueError(
            f"lm_head_bias must be (V,)=({lm_head_weight.shape[0]},), "
            f"got {tuple(lm_head_bias.shape)}"
        )


def token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    lm_head_bias: Tensor | None = None,
    entropy_grad: bool = True,
) -> LogProbOutput:
    """Log-probs of ``targets`` under ``softmax(process(hidden @ W.T + b) / temperature)``.

    Args:
        hidden: final hidden states, ``(B, T, H)`` or ``(N, H)``.
        lm_head_weight: ``(V, H)``.
        targets: token ids shaped ``hidden.shape[:-1]``; negative ids (e.g. -100 padding) give
            log-prob 0, entropy still computed, and no gradient.
        temperature, top_k, top_p: the sampler's processing (see module docstring).
        chunk_size: rows of the flattened ``(N, H)`` hidden states per LM-head call; peak extra
            memory is a handful of ``(chunk_size, V)`` float32 buffers, in forward and backward.
        return_entropy: also return the per-token entropy of the processed distribution.
        lm_head_bias: optional ``(V,)``.
        entropy_grad: False returns the entropy detached (a diagnostic only): with a frozen
            head that spares forward a third ``(N, V) x (V, H)`` matmul.

    Returns:
        ``LogProbOutput`` with ``logprobs`` (and ``entropy``) shaped like ``targets``, in float32
        (float64 if ``hidden`` or the head is float64), computed in that precision even under
        autocast.
    """
    _validate(hidden, lm_head_weight, targets, temperature, top_k, top_p, chunk_size, lm_head_bias)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    logp, ent = ChunkedHeadLogProbs.apply(
        flat_h,
        lm_head_weight,
        lm_head_bias,
        flat_t,
        float(temperature),
        None if top_k is None else int(top_k),
        None if top_p is None else float(top_p),
        int(chunk_size),
        bool(return_entropy),
        torch.is_grad_enabled(),
        bool(entropy_grad),
    )
    return LogProbOutput(
        logprobs=logp.reshape(targets.shape),
        entropy=ent.reshape(targets.shape) if return_entropy else None,
    )


def naive_token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    lm_head_bias: Tensor | None = None,
) -> LogProbOutput:
    """Reference for :func:`token_logprobs` via plain autograd over the full logits.

    ``chunk_size`` is accepted for signature parity and ignored. Materialises ``(N, V)``.
    """
    _validate(hidden, lm_head_weight, targets, temperature, top_k, top_p, chunk_size, lm_head_bias)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    f32 = head_dtype(hidden, lm_head_weight)
    bias = None if lm_head_bias is None else lm_head_bias.to(f32)
    with no_autocast(hidden):
        logp, _, _, target_logp, _ = chunk_stats(
            flat_h, lm_head_weight.to(f32), bias, targets.reshape(-1), temperature, top_k, top_p
        )
    entropy = entropy_from_logp(logp).reshape(targets.shape) if return_entropy else None
    return LogProbOutput(logprobs=target_logp.reshape(targets.shape), entropy=entropy)


def _check_plain_head(model: Any) -> None:
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(config, attr, None)
        # Heads that rescale or soft-cap logits would silently give wrong log-probs here.
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"model config has {attr}={value!r}; sequence_logprobs only supports a plain "
                "linear lm_head"
            )


def sequence_logprobs(
    model: Any,
    input_ids: Tensor,
    *,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    groups: Tensor | None = None,
    group_settings: Sequence[Sampling] | None = None,
    entropy_grad: bool = True,
) -> LogProbOutput:
    """Next-token log-probs of ``input_ids`` under a HuggingFace causal LM, chunked.

    Runs the base transformer ``model.model`` to get the final hidden states and applies
    ``model.lm_head`` through :func:`token_logprobs`, so ``model(...).logits`` is never built.

    Alignment: the output has shape ``(B, T-1)`` and ``out[:, t]`` is
    ``log p(input_ids[:, t + 1] | input_ids[:, :t + 1])``, i.e. the log-prob of the token at
    position ``t + 1``. To line it up with per-token tensors of length T (response masks, stored
    behaviour log-probs), drop their first column: ``mask[:, 1:]``.

    Packed sequences: pass ``position_ids`` that restart at 0 at the start of every packed
    sequence and ``attention_mask=None``. Position ids are forwarded to the model unchanged;
    whether attention is isolated between the packed sequences is up to the model's attention
    implementation (recent transformers derive a block-causal mask from restarting position ids
    when no mask is given; on GPU, flash-attention varlen gives true isolation without the
    ``(T, T)`` mask). The log-prob at each sequence boundary (last token of one sequence
    "predicting" the first of the next) is meaningless: mask it with :func:`packed_target_mask`.

    Rows sampled with different settings: ``groups`` ``(B, T-1)`` gives every target position an
    index into ``group_settings`` (``(temperature, top_k, top_p)`` each); the body runs once and
    the head once per group, on that group's positions (``temperature`` / ``top_k`` / ``top_p``
    are then ignored).

    ``entropy_grad=False``: the entropy is a diagnostic, returned detached (see
    :func:`token_logprobs`).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be (B, T) with T >= 2, got {tuple(input_ids.shape)}")
    _check_plain_head(model)
    out = model.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    head = model.lm_head
    if groups is not None:
        return _grouped_head(hidden[:, :-1], head, input_ids[:, 1:], groups, group_settings,
                             chunk_size=chunk_size, return_entropy=return_entropy,
                             entropy_grad=entropy_grad)  # fmt: skip
    return token_logprobs(
        hidden[:, :-1],
        head.weight,
        input_ids[:, 1:],
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        chunk_size=chunk_size,
        return_entropy=return_entropy,
        lm_head_bias=getattr(head, "bias", None),
        entropy_grad=entropy_grad,
    )


def _grouped_head(
    hidden: Tensor,
    head: Any,
    targets: Tensor,
    groups: Tensor,
    settings: Sequence[Sampling] | None,
    *,
    chunk_size: int,
    return_entropy: bool,
    entropy_grad: bool,
) -> LogProbOutput:
    """:func:`token_logprobs` per settings group, scattered back (differentiably) in place."""
    if settings is None or tuple(groups.shape) != tuple(targets.shape):
        raise ValueError(
            f"groups must be shaped like the targets {tuple(targets.shape)} and come with "
            f"group_settings, got {tuple(groups.shape)} and {settings!r}"
        )
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t, flat_g = targets.reshape(-1), groups.reshape(-1)
    dtype = head_dtype(hidden, head.weight)
    logp = flat_h.new_zeros(flat_t.shape, dtype=dtype)
    ent = flat_h.new_zeros(flat_t.shape, dtype=dtype) if return_entropy else None
    for g, (temperature, top_k, top_p) in enumerate(settings):
        idx = (flat_g == g).nonzero().squeeze(1)
        if not len(idx):
            continue
        out = token_logprobs(
            flat_h[idx], head.weight, flat_t[idx], temperature=temperature, top_k=top_k,
            top_p=top_p, chunk_size=chunk_size, return_entropy=return_entropy,
            lm_head_bias=getattr(head, "bias", None), entropy_grad=entropy_grad,
        )  # fmt: skip
        logp = logp.index_put((idx,), out.logprobs)
        if ent is not None:
            ent = ent.index_put((idx,), out.entropy)
    return LogProbOutput(
        logprobs=logp.reshape(targets.shape),
        entropy=ent.reshape(targets.shape) if ent is not None else None,
    )


def packed_target_mask(position_ids: Tensor) -> Tensor:
    """``(B, T)`` packed position ids -> ``(B, T-1)`` bool mask aligned like sequence_logprobs.

    False where the target token starts a new packed sequence (its position id is 0), because
    the preceding token belongs to another sequence.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (B, T), got {tuple(position_ids.shape)}")
    return position_ids[:, 1:] != 0
