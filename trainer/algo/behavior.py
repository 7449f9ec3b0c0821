"""Whose distribution a replayed row was sampled from, and whether the learner can reproduce it.

Every row stores its sampler settings (``temperature``, ``top_k``, ``top_p``) and how its
behaviour log-probs were recorded (``logprobs_mode``). The learner scores each row under *its*
settings — rows with equal settings share one LM-head pass (:func:`sampling_kwargs`) — so the
ratio pi / mu compares like with like even when a run replays rows sampled at another
temperature (e.g. imported ``[run] sources``). Rows it cannot reproduce are refused
(:func:`check_logprobs_modes`): log-probs recorded before the sampler's processing
(``raw_logprobs``), or greedy / invalid settings.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from trainer.algo.batching import is_packed, num_sequences
from trainer.errors import BehaviorPolicyError

__all__ = [
    "REPRODUCIBLE_LOGPROBS_MODES",
    "batch_rows",
    "behavior_gaps",
    "check_logprobs_modes",
    "gap_summary",
    "sampling_kwargs",
]

# How a row's behaviour log-probs may have been recorded for the learner to reproduce them: after
# the sampler's temperature / top-k / top-p (None: not recorded, taken to be that), or
# "recomputed": teacher-forced at import under the row's stored settings (ingest --score-with),
# the same processed distribution.
REPRODUCIBLE_LOGPROBS_MODES = (None, "processed_logprobs", "recomputed")


def _stored(value: float | int) -> float | int:
    """A float32 column value as the float it was written as (0.7, not 0.699999988...)."""
    return value if isinstance(value, int) else float(str(np.float32(value)))


def _reproducible(r: dict[str, Any]) -> bool:
    t, k, p = r.get("temperature"), r.get("top_k"), r.get("top_p")
    return (
        r.get("logprobs_mode") in REPRODUCIBLE_LOGPROBS_MODES
        and (t is None or math.isnan(t) or t > 0)  # greedy rows have no sampling distribution
        and (k is None or k >= 0)
        and (p is None or math.isnan(p) or 0 < p <= 1)
    )


def check_logprobs_modes(rows: list[dict[str, Any]], where: str) -> None:
    """Raise :class:`BehaviorPolicyError` naming the rows whose behaviour log-probs the learner
    cannot reproduce: a ``logprobs_mode`` other than processed (or unrecorded), temperature <= 0,
    top_k < 0, top_p outside (0, 1]. ``rows``: dicts with ``logprobs_mode`` (and optionally
    ``rollout_id``, ``temperature``, ``top_k``, ``top_p``)."""
    bad = [r for r in rows if not _reproducible(r)]
    if not bad:
        return
    shown = "; ".join(
        f"{r.get('rollout_id', '?')}: logprobs_mode={r['logprobs_mode']!r}, "
        f"temperature={r.get('temperature')}, top_k={r.get('top_k')}, top_p={r.get('top_p')}"
        for r in bad[:3]
    )
    raise BehaviorPolicyError(
        f"{where}: {len(bad)} row(s) carry behaviour log-probs the learner cannot reproduce "
        f"({shown}{'; ...' if len(bad) > 3 else ''}); the learner scores rows under the processed "
        f"distribution (logprobs_mode 'processed_logprobs', after temperature / top-k / top-p): "
        f'regenerate them so, or leave them out with [replay] where = "logprobs_mode = '
        f"'processed_logprobs'\""
    )


def batch_rows(batch: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows' ids, ``logprobs_mode`` and settings of a replay item (for the check)."""
    rows = []
    for mb in [batch] if isinstance(batch, dict) else batch:
        modes = mb.get("logprobs_mode")
        if modes is None:
            continue
        ids = mb.get("rollout_ids") or [None] * len(modes)
        for i, mode in enumerate(modes):
            row = {"rollout_id": ids[i], "logprobs_mode": mode}
            for k in ("temperature", "top_k", "top_p"):
                if k in mb:
                    row[k] = _stored(mb[k][i].item())
            rows.append(row)
    return rows


def row_sampling(mb: dict[str, Any], default: tuple) -> list[tuple]:
    """Each sequence's ``(temperature, top_k, top_p)``: its stored settings; ``default`` (the
    learner's) where a row recorded none (NaN temperature) or the batch has no such column."""
    n = num_sequences(mb)
    temp = [_stored(t) for t in mb["temperature"].tolist()] if "temperature" in mb else None
    temp = temp or [math.nan] * n
    top_k = mb["top_k"].tolist() if "top_k" in mb else None
    top_p = [_stored(p) for p in mb["top_p"].tolist()] if "top_p" in mb else None
    out = []
    for i in range(n):
        t = default[0] if math.isnan(temp[i]) else float(temp[i])
        k = default[1] if top_k is None else (int(top_k[i]) if top_k[i] > 0 else None)
        p = default[2] if top_p is None else (float(top_p[i]) if 0 < top_p[i] < 1 else None)
        out.append((t, k, p))
    return out


def sampling_kwargs(mb: dict[str, Any], default: tuple, device: Any) -> dict[str, Any]:
    """sequence_logprobs' processing arguments: one setting, or a group per target position."""
    rows = row_sampling(mb, default)
    settings = sorted(set(rows), key=repr)
    if len(settings) == 1:
        t, k, p = settings[0]
        return {"temperature": t, "top_k": k, "top_p": p}
    index = {s: g for g, s in enumerate(settings)}
    per_seq = torch.tensor([index[r] for r in rows], dtype=torch.long)
    width = mb["input_ids"].shape[1] - 1
    if is_packed(mb):
        # Target column t scores token t+1, which belongs to the sequence holding it.
        cu = mb["cu_seqlens"].long().cpu()
        seq = torch.searchsorted(cu[1:], torch.arange(1, width + 1), right=True)
        groups = per_seq[seq.clamp(max=len(rows) - 1)][None, :]
    else:
        groups = per_seq[:, None].expand(len(rows), width)
    return {"groups": groups.to(device), "group_settings": settings}


def behavior_gaps(model: Any, rows: list[dict[str, Any]], dtype: torch.dtype) -> torch.Tensor:
    """Per-token |stored behaviour log-prob - the learner's recomputation| of generated ``rows``
    (float32, completion tokens in order; ``inf`` where one side is ``-inf``: a top-p flip).

    The recomputation is the learner's: ``model`` (float32 weights) under autocast in ``dtype``,
    its LM head and processed softmax in float32 (:func:`trainer.algo.logprobs.sequence_logprobs`),
    each row under its own temperature / top-k / top-p. With the generator at the same weights
    (staleness 0) this is the train/inference mismatch; docs/benchmarks.md has it measured."""
    from trainer.algo.logprobs import sequence_logprobs

    device = next(model.parameters()).device
    gaps = []
    for r in rows:
        n = len(r["completion_ids"])
        if n == 0:
            continue
        ids = torch.tensor([list(r["prompt_ids"]) + list(r["completion_ids"])], device=device)
        t, k, p = r.get("temperature", 1.0), r.get("top_k") or None, r.get("top_p", 1.0)
        auto = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        with torch.no_grad(), auto:
            out = sequence_logprobs(model, ids, temperature=t, top_k=k, top_p=p if p < 1 else None)
        lp = out.logprobs[0, -n:].float().cpu()
        gaps.append((lp - torch.tensor(r["behavior_logprobs"], dtype=torch.float32)).abs())
    return torch.cat(gaps) if gaps else torch.zeros(0)


def gap_summary(gaps: torch.Tensor) -> dict[str, float]:
    """``tokens``, ``mean``, ``p50``, ``p99`` and ``max`` of the finite gaps, and ``flips``
    (tokens where one side is ``-inf``)."""
    finite = gaps[torch.isfinite(gaps)].double()
    if finite.numel() == 0:
        return {"tokens": int(gaps.numel()), "mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0,
                "flips": int(gaps.numel())}  # fmt: skip
    return {
        "tokens": int(gaps.numel()),
        "mean": float(finite.mean()),
        "p50": float(finite.quantile(0.5)),
        "p99": float(finite.quantile(0.99)),
        "max": float(finite.max()),
        "flips": int((~torch.isfinite(gaps)).sum()),
    }
