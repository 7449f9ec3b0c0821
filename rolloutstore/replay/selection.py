"""``Selection``: one drawn replay batch (row addresses in the store version it was drawn from,
and the per-row data the loader needs), and building one from the selector's candidates."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)

from rolloutstore.replay.draw import floats

_PICKED = [
    "_rowaddr", "rollout_id", "policy_version", "prompt_id", "run_id", "reward", "advantage",
    "reward_version",
]  # fmt: skip


@dataclass(frozen=True)
class Selection:
    """One drawn batch: row addresses in the store version it was drawn from, and per-row data."""

    row_addresses: np.ndarray  # (B,) uint64, Lance row addresses at store_version
    rollout_ids: list[str]
    weights: np.ndarray  # (B,) float32 importance weights (1 for uniform sampling)
    staleness: np.ndarray  # (B,) int64, learner_version - policy_version
    policy_version: np.ndarray  # (B,) int64
    prompt_ids: list[str] = field(repr=False)
    run_ids: list[str] = field(default=None, repr=False)
    learner_version: int = 0
    store_version: int = 0
    step: int = 0
    # The buffer this batch was drawn from: lets a loader read (and cache) it in one pass.
    buffer_addresses: np.ndarray = field(default=None, repr=False)
    buffer_tokens: int = 0
    # The reward version read (see the module docstring), per row.
    rewards: np.ndarray = field(default=None, repr=False)  # (B,) float32, NaN: unscored
    advantages: np.ndarray = field(default=None, repr=False)  # (B,) float32, NaN: none
    reward_versions: np.ndarray = field(default=None, repr=False)  # (B,) int64, 0: original
    # (B,) bool: policy_version among the buffer's fresh_versions newest (mix or not).
    fresh: np.ndarray = field(default=None, repr=False)
    # The batch_size asked for (None: a token budget only); len(self) may be smaller
    # when the buffer or per_prompt_cap cannot fill it (a ShortBatchWarning says why).
    requested: int | None = None
    # diversity="embedding": how many of the rows had no embedding (drawn with prompt
    # diversity instead, see MissingEmbeddingWarning); None under other diversity modes.
    no_embedding: int | None = None
    # A token budget (max_tokens; None without one): eligible rows longer than it, left out of
    # the draw, and rows of a batch_size draw it cut (rolloutstore/replay/budget.py).
    over_budget: int | None = None
    budget_cut: int | None = None

    def __len__(self) -> int:
        return len(self.rollout_ids)


def selection_of(
    cand: pa.Table,
    idx: np.ndarray,
    weights: np.ndarray,
    fresh: np.ndarray,
    *,
    learner_version: int,
    store_version: int,
    step: int,
    requested: int | None,
    no_embedding: int | None = None,
    over_budget: int | None = None,
    budget_cut: int | None = None,
) -> Selection:
    """The Selection of rows ``idx`` of the candidates ``cand`` (the buffer drawn from) with
    their importance ``weights``; ``fresh``: the fresh mask of every candidate."""
    # Only the columns a Selection keeps: the candidates also hold ones the draw alone reads.
    pick = cand.select(_PICKED).take(pa.array(idx, pa.int64()))
    pv = pick["policy_version"].to_numpy().astype(np.int64)
    return Selection(
        row_addresses=pick["_rowaddr"].to_numpy().astype(np.uint64),
        rollout_ids=pick["rollout_id"].to_pylist(),
        weights=weights.astype(np.float32),
        staleness=(learner_version - pv).astype(np.int64),
        policy_version=pv,
        prompt_ids=pick["prompt_id"].to_pylist(),
        run_ids=pick["run_id"].to_pylist(),
        learner_version=learner_version,
        store_version=store_version,
        step=step,
        buffer_addresses=cand["_rowaddr"].to_numpy().astype(np.uint64),
        buffer_tokens=int(pa.compute.sum(cand["num_prompt_tokens"]).as_py() or 0)
        + int(pa.compute.sum(cand["num_completion_tokens"]).as_py() or 0),
        rewards=floats(pick["reward"]),
        advantages=floats(pick["advantage"]),
        reward_versions=pick["reward_version"].to_numpy().astype(np.int64),
        fresh=fresh[idx],
        requested=requested,
        no_embedding=no_embedding,
        over_budget=over_budget,
        budget_cut=budget_cut,
    )
