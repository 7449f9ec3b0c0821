"""Replay rows to learner-ready tensors: the padded or packed batch layout
(:mod:`rolloutstore.replay.loader` documents it), each row's sampling settings, and the
split of a batch into micro-batches under a token budget.

Multi-turn rows: the target-grid ``loss_mask`` is each row's per-token ``loss_mask`` (0 on
tool / environment tokens), so ``num_loss_tokens`` counts only the policy's tokens; token
budgets and micro-batches count every token (they bound memory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from rolloutstore.replay.selector import Selection

# The batch's keys, declared once: collate builds them, the learner's micro-batching
# (trainer/algo/batching.py) splits by them. B sequences (packed: 1 row), T tokens.
TOKEN_KEYS = ("input_ids", "attention_mask", "position_ids")  # (B, T)
TARGET_KEYS = ("loss_mask", "behavior_logprobs", "advantages")  # (B, T-1): column t scores t+1
SEQUENCE_KEYS = (
    "policy_version", "staleness", "weights", "rewards", "seq_advantages",
    "temperature", "top_k", "top_p",
)  # fmt: skip  # (B,): one value per sequence
PACKED_KEYS = ("cu_seqlens",)  # (B+1,): sequence boundaries of a packed row
# Per batch: counts, ids (lists, one per sequence) and the draw's provenance.
BATCH_INFO_KEYS = (
    "num_tokens", "num_loss_tokens", "rollout_ids", "run_ids", "logprobs_mode", "step",
    "learner_version", "store_version", "no_embedding", "batch_rows", "over_budget",
    "budget_cut",
)  # fmt: skip
# A micro-batch (``micro_batch_tokens``) also carries its whole step's loss tokens and sequences.
MICRO_BATCH_KEYS = ("step_loss_tokens", "step_sequences")

# Rewards and advantages come from the Selection (the selector overlays re-scorings on them).
TOKEN_COLUMNS = ["prompt_ids", "completion_ids", "behavior_logprobs", "loss_mask"]
# Each row's sampler settings: the learner scores a row under the distribution that sampled it.
SAMPLING_COLUMNS = ["temperature", "top_k", "top_p", "logprobs_mode"]


def _flat(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list column as numpy, without per-token Python."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    return values, offsets


# Each row's sampler settings as numpy: (dtype, the value a null means).
_SAMPLING_NULLS = {
    "temperature": (np.float32, np.nan),
    "top_k": (np.int64, 0),
    "top_p": (np.float32, 1.0),
}


@dataclass(frozen=True)
class TokenRows:
    """Rows' token lists as views into flat buffers, handed to :func:`collate` without a copy.

    ``lists[name] = (values, starts, lengths)``: row ``k``'s list is
    ``values[starts[k] : starts[k] + lengths[k]]`` (``loss_mask`` may be absent: all ones).
    ``sampling``: per-row ``temperature`` (NaN: unknown), ``top_k`` (0: none), ``top_p``
    (1: none) and ``logprobs_mode`` (object array, None: unknown), for the columns present.
    :meth:`take` selects rows by index arithmetic alone, so the token cache hands a batch
    over without gathering its tokens twice (the layout is the one copy)."""

    lists: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    sampling: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.lists["prompt_ids"][1])

    @classmethod
    def of_table(cls, rows: pa.Table) -> TokenRows:
        lists = {}
        for name in TOKEN_COLUMNS:
            if name in rows.column_names:
                values, offsets = _flat(rows[name])
                lists[name] = (values, offsets[:-1], np.diff(offsets))
        sampling = {}
        for name, (dtype, null) in _SAMPLING_NULLS.items():
            if name in rows.column_names:
                values = rows[name].fill_null(null).to_numpy(zero_copy_only=False)
                sampling[name] = np.array(values, dtype=dtype)  # writable: torch shares it
        if "logprobs_mode" in rows.column_names:
            sampling["logprobs_mode"] = np.asarray(rows["logprobs_mode"].to_pylist(), object)
        return cls(lists, sampling)

    def take(self, idx: np.ndarray) -> TokenRows:
        """Rows ``idx``, in that order (the token values are not copied)."""
        lists = {k: (v, s[idx], n[idx]) for k, (v, s, n) in self.lists.items()}
        return TokenRows(lists, {k: v[idx] for k, v in self.sampling.items()})

    def lengths(self) -> np.ndarray:
        """Each row's prompt + completion tokens."""
        return self.lists["prompt_ids"][2] + self.lists["completion_ids"][2]


def collate(
    rows: pa.Table | TokenRows, sel: Selection, idx: np.ndarray, *, pack: bool
) -> dict[str, Any]:
    """Tensors for rows ``idx`` of ``sel``; ``rows`` holds exactly those rows, in that order."""
    if isinstance(rows, pa.Table):
        rows = TokenRows.of_table(rows)
    adv = np.nan_to_num(sel.advantages[idx].astype(np.float32))
    out, lengths = _token_tensors(rows, adv, pack)
    for name, values in rows.sampling.items():
        out[name] = values.tolist() if name == "logprobs_mode" else torch.from_numpy(values)
    rewards = sel.rewards[idx].astype(np.float32)
    out.update(
        policy_version=torch.from_numpy(sel.policy_version[idx].copy()),
        staleness=torch.from_numpy(sel.staleness[idx].copy()),
        weights=torch.from_numpy(sel.weights[idx].copy()),
        rewards=torch.from_numpy(rewards),
        seq_advantages=torch.from_numpy(adv),
        num_tokens=int(lengths.sum()),
        num_loss_tokens=int(np.count_nonzero(out["loss_mask"].numpy())),
        rollout_ids=[sel.rollout_ids[i] for i in idx],
        run_ids=[sel.run_ids[i] for i in idx],
        step=sel.step,
        learner_version=sel.learner_version,
        store_version=sel.store_version,
        # The whole step's count (every rank's share), None unless diversity="embedding".
        no_embedding=sel.no_embedding,
        # The whole step's too (every rank's share): rows drawn, and under a token budget the
        # eligible rows too long for it and the rows it cut (None without one).
        batch_rows=len(sel),
        over_budget=sel.over_budget,
        budget_cut=sel.budget_cut,
    )
    return out


def _concat(pieces: list[np.ndarray], size: int, dtype) -> np.ndarray:
    """``pieces`` (``size`` values in all) laid end to end in a new array of ``dtype``."""
    out = np.empty(size, dtype)
    if size:
        np.concatenate(pieces, out=out, casting="same_kind")
    return out


def _token_tensors(
    rows: TokenRows, adv: np.ndarray, pack: bool
) -> tuple[dict[str, Any], np.ndarray]:
    """The per-token tensors of ``rows`` with ``adv`` (one per row) spread over each completion,
    and each row's length. One description of each row's cells lays out every grid, padded or
    packed, so the layouts cannot drift apart; each grid is one ``np.concatenate`` of views
    (its only copy of the tokens) or one ``np.repeat``."""
    p_vals, p_start, p_len = rows.lists["prompt_ids"]
    c_vals, c_start, c_len = rows.lists["completion_ids"]
    lengths = p_len + c_len
    n, total = len(lengths), int(lengths.sum())
    # At least one column, so that an empty shard (world_size > rows) or a row without
    # tokens (stores from before append refused them) gives empty tensors, never a crash.
    width = max(total if pack else int(lengths.max(initial=0)), 1)
    rows_out = 1 if pack else n
    # Token grid: row k's prompt, its completion, then padding to the width (packed: only
    # after the last row).
    pad = np.zeros(n, np.int64) if pack else width - lengths
    # Target grid (column t scores token t+1): `lead` unscored cells (the prompt's tokens
    # after its first), then one value per scored completion token, then `tail` zeros to
    # the row's end. A completion token with no token before it (empty prompt: stores from
    # before append refused them) cannot be scored, and a packed row's cell that would
    # score the next row's first token holds 0; the packed grid ends one cell early.
    lead = np.maximum(p_len - 1, 0)
    skip = ((p_len == 0) & (c_len > 0)).astype(np.int64)
    scored = c_len - skip
    tail = (lengths if pack else width - 1) - lead - scored
    size = rows_out * (width - 1)
    runs = np.stack([lead, scored, tail], 1)
    zero_f = np.zeros(int(runs[:, [0, 2]].max(initial=0)), np.float32)
    lead_l, scored_l, tail_l = runs.T.tolist()

    def spread(name: str) -> np.ndarray:
        """The target grid of a per-token column: zeros, the row's scored values, zeros."""
        values, start, _ = rows.lists[name]
        pieces = []
        for s, a, k, t in zip((start + skip).tolist(), lead_l, scored_l, tail_l):
            pieces += (zero_f[:a], values[s : s + k], zero_f[:t])
        return _concat(pieces, total if pack else size, np.float32)[:size]

    def cells(per_row: np.ndarray) -> np.ndarray:
        """The target grid of one value per row, over its scored cells."""
        zero = np.zeros(n, np.float32)
        return np.repeat(np.stack([zero, per_row, zero], 1).ravel(), runs.ravel())[:size]

    # loss_mask: 1 on the policy's tokens, 0 on tool / environment ones; absent: all ones.
    has_mask = "loss_mask" in rows.lists
    mask = spread("loss_mask") if has_mask else cells(np.ones(n, np.float32))
    zeros = np.zeros(int(max(pad.max(initial=0), width - total)), np.int64)
    ids, positions = [], []
    counting = np.arange(int(lengths.max(initial=0)), dtype=np.int64)
    for ps, pl, cs, cl, m, z in zip(
        p_start.tolist(), p_len.tolist(), c_start.tolist(), c_len.tolist(),
        lengths.tolist(), pad.tolist(),
    ):  # fmt: skip
        ids += (p_vals[ps : ps + pl], c_vals[cs : cs + cl], zeros[:z])
        positions += (counting[:m], zeros[:z])
    if pack:
        ids.append(zeros[: width - total])
        positions.append(zeros[: width - total])
    grid = (rows_out, width)
    out: dict[str, Any] = {
        "input_ids": torch.from_numpy(_concat(ids, rows_out * width, np.int64).reshape(grid)),
        "position_ids": torch.from_numpy(
            _concat(positions, rows_out * width, np.int64).reshape(grid)
        ),
        "attention_mask": torch.from_numpy(
            np.repeat(
                np.tile(np.array([1, 0], np.int64), rows_out),
                [total, width - total] if pack else np.stack([lengths, pad], 1).ravel(),
            ).reshape(grid)
        ),
    }
    targets = (mask, spread("behavior_logprobs"), cells(adv))
    for name, values in zip(("loss_mask", "behavior_logprobs", "advantages"), targets, strict=True):
        out[name] = torch.from_numpy(values.reshape(rows_out, width - 1))
    if pack:
        cu = np.zeros(n + 1, np.int32)
        np.cumsum(lengths, out=cu[1:])
        out["cu_seqlens"] = torch.from_numpy(cu)
    return out, lengths


def micro_batches(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Split sequence indices, in order, into groups of at most ``max_tokens`` tokens each.

    A sequence longer than the budget forms a micro-batch of its own.
    """
    groups, cur, used = [], [], 0
    for i, n in enumerate(lengths.tolist()):
        if cur and used + n > max_tokens:
            groups.append(np.asarray(cur))
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(np.asarray(cur))
    return groups
