"""PPO epochs: the pure parts of ``ppo_epochs`` passes of ``mini_batches`` steps over one batch.

When ``OptimConfig.ppo_epochs * mini_batches > 1`` (single learner only)
:meth:`trainer.algo.learner.Learner.step` first scores the drawn batch once with the current
weights (pi_old: eval mode, no grad), then splits it into ``mini_batches`` mini-batches (a
permutation of its sequences drawn from (seed, learner step, epoch), so a resume repeats it) for
``ppo_epochs`` passes, each mini-batch one optimizer step (accumulate + update, without the
schedule). ``policy_version``, ``steps_done`` and the LR schedule advance once per *drawn
batch*: a policy version is a learner step, as everywhere else (rows' ``policy_version``,
staleness, ``max_staleness``, published weights), and one version then spans ``ppo_epochs *
mini_batches`` updates; tis / icepop / decoupled correct that in-step drift through pi_old.

The learner owns that loop (its forward, accumulate and update steps); this module holds what
is a function of the batch's layout alone: the plan, the pieces a mini-batch is cut into, the
empty pi_old grids and the averaging of the updates' metrics.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from trainer.algo.batching import is_packed, num_sequences, select_sequences, sequence_lengths
from trainer.algo.loss_config import MAX_METRICS

__all__ = ["mean_updates", "mini_batch_plan", "old_logprob_grids", "pieces", "sequence_offsets"]


def sequence_offsets(mbs: list[dict[str, Any]]) -> np.ndarray:
    """Each micro-batch's first global sequence index, plus the total at the end."""
    return np.concatenate([[0], np.cumsum([num_sequences(mb) for mb in mbs])])


def mini_batch_plan(seed: int, step: int, epoch: int, n_seqs: int, parts: int) -> list[np.ndarray]:
    """Epoch ``epoch``'s mini-batches of global sequence indices (sorted; none empty)."""
    rng = np.random.default_rng([seed, step, epoch])
    split = np.array_split(rng.permutation(n_seqs), parts)
    return [np.sort(p) for p in split if len(p)]


def pieces(mbs: list[dict], offsets: np.ndarray, part: np.ndarray, *, with_index: bool = False):
    """The sequences ``part`` (global, sorted) of the micro-batches, one piece per micro-batch."""
    out = []
    for i, mb in enumerate(mbs):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        local = part[(part >= lo) & (part < hi)] - lo
        if len(local):
            sub = select_sequences(mb, local)
            out.append((i, local, sub) if with_index else sub)
    return out


def old_logprob_grids(mbs: list[dict[str, Any]]) -> list[Tensor]:
    """Zeroed float32 ``(n, L-1)`` pi_old grids on CPU, one per micro-batch (packed: L per row)."""
    grids = []
    for mb in mbs:
        width = mb["input_ids"].shape[1] - 1
        if is_packed(mb):
            width = max(int(sequence_lengths(mb).max()) - 1, 1)
        grids.append(torch.zeros(num_sequences(mb), width, dtype=torch.float32))
    return grids


def mean_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from several updates: means, maxima for MAX_METRICS, skipped counts."""
    out = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
    out.update({k: max(u[k] for u in updates) for k in MAX_METRICS})
    out["skipped"] = float(sum(u["skipped"] for u in updates))
    return out
