"""PPO epochs: ``ppo_epochs`` passes of ``mini_batches`` optimizer steps over one drawn batch.

The half of :meth:`trainer.algo.learner.Learner.step` that runs when ``OptimConfig.ppo_epochs
* mini_batches > 1`` (single learner only): the drawn batch is first scored once with the
current weights (pi_old: eval mode, no grad), then split into ``mini_batches`` mini-batches (a
permutation of its sequences drawn from (seed, learner step, epoch), so a resume repeats it)
for ``ppo_epochs`` passes, each mini-batch one optimizer step (the learner's accumulate +
update, without the schedule). ``policy_version``, ``steps_done`` and the LR schedule advance
once per *drawn batch*: a policy version is a learner step, as everywhere else (rows'
``policy_version``, staleness, ``max_staleness``, published weights), and one version then
spans ``ppo_epochs * mini_batches`` updates; tis / icepop / decoupled correct that in-step
drift through pi_old.

These functions work on a :class:`~trainer.algo.learner.Learner` (its forward, accumulate
and update steps); the learner calls them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainer.algo.batching import is_packed, num_sequences, select_sequences, sequence_lengths
from trainer.algo.loss_config import MAX_METRICS

if TYPE_CHECKING:
    from trainer.algo.learner import Learner

__all__ = ["mean_updates", "mini_batch_plan", "pieces", "ppo_updates", "with_old_logprobs"]


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


def mean_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from several updates: means, maxima for MAX_METRICS, skipped counts."""
    out = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
    out.update({k: max(u[k] for u in updates) for k in MAX_METRICS})
    out["skipped"] = float(sum(u["skipped"] for u in updates))
    return out


def ppo_updates(learner: Learner, mbs: list[dict[str, Any]]) -> tuple[list[dict], float, float]:
    """``ppo_epochs`` passes of ``mini_batches`` optimizer steps over one drawn batch.

    pi_old: before the first update every sequence is scored once with the current weights
    (eval mode, no grad), on exactly the tensors of the first epoch's mini-batches, so the
    first mini-batch's ratio pi_theta / pi_old is exactly 1; tis / icepop / decoupled use
    these log-probs as ``prox_logp``. The sequences of a pass are split by a permutation
    drawn from ``(seed, steps_done, epoch)``, so a resumed learner repeats the order.

    Returns (per-update metrics, staleness sum, the last update's lr).
    """
    if learner.ddp is not None:
        raise ValueError(
            "[optim] ppo_epochs / mini_batches > 1 are single-learner for now (ranks would "
            "need equal mini-batches); under torchrun keep them at 1"
        )
    oc = learner.optim_cfg
    counts = [num_sequences(mb) for mb in mbs]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    plans = [learner._mini_batch_plan(int(offsets[-1]), e) for e in range(oc.ppo_epochs)]
    mbs = with_old_logprobs(learner, mbs, offsets, plans[0])
    updates, staleness_sum, lr = [], 0.0, 0.0
    for plan in plans:
        for part in plan:
            subs = pieces(mbs, offsets, part)
            tokens = sum(int(learner._target_mask(mb).sum()) for mb in subs)
            sums, stal = learner._accumulate(subs, tokens, len(part))
            grad_norm, lr, skipped = learner._update()
            updates.append({**sums, "grad_norm": grad_norm, "skipped": float(skipped)})
            staleness_sum += stal / oc.ppo_epochs  # every sequence once per epoch
    return updates, staleness_sum, lr


def mini_batch_plan(seed: int, step: int, epoch: int, n_seqs: int, parts: int) -> list[np.ndarray]:
    """Epoch ``epoch``'s mini-batches of global sequence indices (sorted; none empty)."""
    rng = np.random.default_rng([seed, step, epoch])
    split = np.array_split(rng.permutation(n_seqs), parts)
    return [np.sort(p) for p in split if len(p)]


@torch.no_grad()
def with_old_logprobs(
    learner: Learner, mbs: list[dict], offsets: np.ndarray, plan: list
) -> list[dict]:
    """The micro-batches with an ``old_logprobs`` ``(n, L-1)`` grid of the current weights."""
    grids = []
    for mb in mbs:
        width = mb["input_ids"].shape[1] - 1
        if is_packed(mb):
            width = max(int(sequence_lengths(mb).max()) - 1, 1)
        grids.append(torch.zeros(num_sequences(mb), width, dtype=torch.float32))
    model = learner.model
    was_training = model.training
    model.eval()
    try:
        for part in plan:
            for i, local, sub in pieces(mbs, offsets, part, with_index=True):
                with learner._autocast():
                    logp = learner._logprobs(model, learner._to_device(sub), entropy=False)[0]
                grids[i][torch.from_numpy(local), : logp.shape[1]] = logp.float().cpu()
    finally:
        model.train(was_training)
    return [{**mb, "old_logprobs": g} for mb, g in zip(mbs, grids)]
