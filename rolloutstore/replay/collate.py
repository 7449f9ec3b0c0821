"""Replay rows to learner-ready tensors: the padded or packed batch layout
(:mod:`rolloutstore.replay.loader` documents it), each row's sampling settings, and the
split of a batch into micro-batches under a token budget.

Multi-turn rows: the target-grid ``loss_mask`` is each row's per-token ``loss_mask`` (0 on
tool / environment tokens), so ``num_loss_tokens`` counts only the policy's tokens; token
budgets and micro-batches count every token (they bound memory)."""

from __future__ import annotations

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


def _segment_index(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sequences of ``lengths``: (sequence index, position within it) of every element."""
    total = int(lengths.sum())
    seq = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    pos = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
    return seq, pos


def _sampling(rows: pa.Table) -> dict[str, Any]:
    """Per-row ``temperature`` (NaN: unknown), ``top_k`` (0: none), ``top_p`` (1: none) tensors
    and the ``logprobs_mode`` list (None: unknown); columns a table lacks are left out."""
    out: dict[str, Any] = {}
    defaults = {
        "temperature": (np.float32, np.nan),
        "top_k": (np.int64, 0),
        "top_p": (np.float32, 1.0),
    }
    for name, (dtype, null) in defaults.items():
        if name in rows.column_names:
            values = rows[name].fill_null(null).to_numpy(zero_copy_only=False)
            out[name] = torch.from_numpy(np.array(values, dtype=dtype))
    if "logprobs_mode" in rows.column_names:
        out["logprobs_mode"] = rows["logprobs_mode"].to_pylist()
    return out


def collate(rows: pa.Table, sel: Selection, idx: np.ndarray, *, pack: bool) -> dict[str, Any]:
    """Tensors for rows ``idx`` of ``sel``; ``rows`` holds exactly those rows, in that order."""
    adv = np.nan_to_num(sel.advantages[idx].astype(np.float32))
    out, lengths, num_loss_tokens = _token_tensors(rows, adv, pack)
    out.update(_sampling(rows))
    rewards = sel.rewards[idx].astype(np.float32)
    out.update(
        policy_version=torch.from_numpy(sel.policy_version[idx].copy()),
        staleness=torch.from_numpy(sel.staleness[idx].copy()),
        weights=torch.from_numpy(sel.weights[idx].copy()),
        rewards=torch.from_numpy(rewards),
        seq_advantages=torch.from_numpy(adv),
        num_tokens=int(lengths.sum()),
        num_loss_tokens=num_loss_tokens,
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


def _token_tensors(
    rows: pa.Table, adv: np.ndarray, pack: bool
) -> tuple[dict[str, Any], np.ndarray, int]:
    """The per-token tensors of ``rows`` (one pass that pads or packs them all together, so
    the layouts cannot drift apart), with ``adv`` (one per row) spread over each completion;
    also each row's length and the number of loss tokens."""
    p_vals, p_off = _flat(rows["prompt_ids"])
    c_vals, c_off = _flat(rows["completion_ids"])
    l_vals, l_off = _flat(rows["behavior_logprobs"])
    p_len, c_len = np.diff(p_off), np.diff(c_off)
    p_vals = p_vals[p_off[0] : p_off[-1]]
    c_vals = c_vals[c_off[0] : c_off[-1]]
    l_vals = l_vals[l_off[0] : l_off[-1]]
    if "loss_mask" in rows.column_names:  # 1: the policy's token, 0: tool / environment
        m_vals, m_off = _flat(rows["loss_mask"])
        m_vals = m_vals[m_off[0] : m_off[-1]].astype(np.float32)
    else:
        m_vals = np.ones(len(c_vals), np.float32)
    lengths = p_len + c_len
    # At least one column, so that an empty shard (world_size > rows) or a row without
    # tokens (stores from before append refused them) gives empty tensors, never a crash.
    width = max(int(lengths.sum()) if pack else int(lengths.max(initial=0)), 1)
    adv_vals = np.repeat(adv, c_len)
    unscored = None
    if (p_len == 0).any():  # stores from before append refused empty prompts
        # A completion token with no token before it (empty prompt) cannot be scored.
        first = np.repeat(p_len == 0, c_len) & (_segment_index(c_len)[1] == 0)
        l_vals, m_vals, adv_vals = l_vals[~first], m_vals[~first], adv_vals[~first]
        unscored = (p_len == 0) & (c_len > 0)
    out = _layout(p_vals, c_vals, (m_vals, l_vals, adv_vals), p_len, c_len, width, pack, unscored)
    return out, lengths, int(np.count_nonzero(m_vals))


def _layout(p_vals, c_vals, targets, p_len, c_len, width, pack, unscored):
    """The padded or packed grid: one small code per cell (0 prompt, 1 completion, 2 padding)
    from one ``np.repeat``, and boolean-mask writes, which keep the values' order. ``targets``
    (loss mask, log-probs, advantages) hold one value per scored completion token, in order;
    ``unscored``: rows whose first completion token has no token before it (None: none)."""
    n = len(p_len)
    rows_out = 1 if pack else n
    runs = np.stack([p_len, c_len, np.zeros(n, np.int64) if pack else width - p_len - c_len], 1)
    code = np.repeat(np.tile(np.array([0, 1, 2], np.int8), n), runs.ravel())
    if pack:
        code = np.concatenate([code, np.full(width - len(code), 2, np.int8)])
    code = code.reshape(rows_out, width)
    input_ids = np.zeros((rows_out, width), np.int64)
    input_ids[code == 0] = p_vals
    input_ids[code == 1] = c_vals
    # Column t of the targets scores token t+1: a completion token's cell, one to the left.
    # A padded row's first cell has no column; a packed row's would score the row before's
    # last token, so an empty-prompt row's first completion token is taken out there.
    scored = code[:, 1:] == 1
    if pack and unscored is not None:
        starts = np.cumsum(p_len + c_len) - (p_len + c_len)
        scored[0, starts[unscored & (starts > 0)] - 1] = False
    grids = []
    for values in targets:
        grid = np.zeros((rows_out, width - 1), np.float32)
        grid[scored] = values
        grids.append(torch.from_numpy(grid))
    out: dict[str, Any] = {"input_ids": torch.from_numpy(input_ids)}
    out.update(zip(("loss_mask", "behavior_logprobs", "advantages"), grids, strict=True))
    out.update(_positions(p_len + c_len, width, pack))
    return out


def _positions(lengths: np.ndarray, width: int, pack: bool) -> dict[str, torch.Tensor]:
    """``position_ids`` and ``attention_mask`` of sequences of ``lengths`` in rows of
    ``width`` (packed: one row, positions restarting per sequence, plus ``cu_seqlens``)."""
    out: dict[str, torch.Tensor] = {}
    if pack:
        shape = (1, width)
        pos_all = np.zeros(width, np.int64)
        pos_all[: int(lengths.sum())] = _segment_index(lengths)[1]
        out["position_ids"] = torch.from_numpy(pos_all.reshape(shape))
        out["attention_mask"] = torch.from_numpy(
            (np.arange(width) < int(lengths.sum())).astype(np.int64).reshape(shape)
        )
        cu = np.zeros(len(lengths) + 1, np.int32)
        np.cumsum(lengths, out=cu[1:])
        out["cu_seqlens"] = torch.from_numpy(cu)
    else:
        am = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        out["attention_mask"] = torch.from_numpy(am)
        out["position_ids"] = torch.from_numpy(np.arange(width)[None, :] * am)
    return out


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
