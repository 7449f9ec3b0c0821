"""Splitting a replay batch (padded or packed) into micro-batches, and unpacking packed rows.

A padded batch splits along sequences; a packed one along ``cu_seqlens``. Per-sequence keys
(``SEQUENCE_KEYS``) follow their sequences; per-token keys their tokens; ``(n, L-1)`` per-sequence
grids (``_GRID_KEYS``, e.g. the learner's pi_old log-probs) their rows. ``select_sequences``
takes any subset of a batch's sequences (the learner's PPO mini-batches).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from rolloutstore.replay.collate import SEQUENCE_KEYS, TARGET_KEYS, TOKEN_KEYS, micro_batches

# Per-sequence (n, L-1) grids in the unpacked layout (row i: sequence i's target columns),
# added by the learner (its pi_old log-probs); the rest are the loader's keys.
_GRID_KEYS = ("old_logprobs",)


def is_packed(batch: dict[str, Any]) -> bool:
    return "cu_seqlens" in batch


def num_sequences(batch: dict[str, Any]) -> int:
    return len(batch["weights"])


def sequence_lengths(batch: dict[str, Any]) -> np.ndarray:
    """Tokens (prompt + completion) of each sequence of a padded or packed batch."""
    if is_packed(batch):
        return np.diff(batch["cu_seqlens"].long().cpu().numpy())
    return batch["attention_mask"].sum(dim=1).cpu().numpy()


def check_lengths(
    items: list[dict[str, Any]], budget: int | None, positions: int | None
) -> tuple[int, int]:
    """(sequences of ``items`` longer than the micro-batch ``budget``, the longest's length).

    Such a sequence is trained alone, in a micro-batch of its own (it fits the model, and the
    loader's ``max_tokens_per_batch`` already let it through), so the learner counts it and
    warns. A sequence longer than the model's ``positions`` is refused, naming its rollout_id:
    its later tokens would be scored at positions the model never learned.
    """
    over, longest = 0, 0
    for mb in items:
        lengths = sequence_lengths(mb)
        if not len(lengths):
            continue
        i = int(np.argmax(lengths))
        longest = max(longest, int(lengths[i]))
        if positions is not None and lengths[i] > positions:
            ids = mb.get("rollout_ids")
            who = f"rollout_id {ids[i]}" if ids is not None else f"sequence {i}"
            raise ValueError(
                f"{who} is {int(lengths[i])} tokens, beyond the model's {positions} positions "
                "(max_position_embeddings): leave such rows out with [run].max_tokens_per_batch "
                f"<= {positions} or [replay].where = 'num_prompt_tokens + num_completion_tokens "
                f"<= {positions}'"
            )
        if budget is not None:
            over += int((lengths > budget).sum())
    return over, longest


def _select_padded(batch: dict[str, Any], idx: np.ndarray, lengths: np.ndarray) -> dict:
    width = int(lengths[idx].max())
    ix = torch.from_numpy(np.asarray(idx, dtype=np.int64))
    mb = {k: batch[k][ix, :width] for k in TOKEN_KEYS}
    mb.update({k: batch[k][ix, : width - 1] for k in TARGET_KEYS})
    mb.update({k: batch[k][ix] for k in SEQUENCE_KEYS if k in batch})
    mb.update({k: batch[k][ix, : width - 1] for k in _GRID_KEYS if k in batch})
    return mb


def split_padded(batch: dict[str, Any], max_tokens: int) -> list[dict[str, Any]]:
    """Micro-batches of whole sequences, each trimmed to its own longest sequence."""
    lengths = sequence_lengths(batch)
    return [_select_padded(batch, idx, lengths) for idx in micro_batches(lengths, max_tokens)]


def select_sequences(batch: dict[str, Any], idx: np.ndarray) -> dict[str, Any]:
    """Sequences ``idx`` (in that order) of a padded or packed batch, as a batch of its kind."""
    lengths = sequence_lengths(batch)
    if not is_packed(batch):
        return _select_padded(batch, idx, lengths)
    cu = batch["cu_seqlens"].long().cpu().numpy()
    tok = torch.from_numpy(np.concatenate([np.arange(cu[i], cu[i + 1]) for i in idx]))
    mb = {k: batch[k][:, tok] for k in TOKEN_KEYS}
    # New target column j scores new token j+1: the old column tok[j+1] - 1. Where j+1 starts
    # a sequence that column belongs to another one, but packed_target_mask drops it anyway.
    col = torch.clamp(tok[1:] - 1, min=0)
    mb.update({k: batch[k][:, col] for k in TARGET_KEYS})
    ix = torch.from_numpy(np.asarray(idx, dtype=np.int64))
    mb.update({k: batch[k][ix] for k in SEQUENCE_KEYS if k in batch})
    width = int(lengths[idx].max()) - 1
    mb.update({k: batch[k][ix, :width] for k in _GRID_KEYS if k in batch})
    cu_new = np.zeros(len(idx) + 1, np.int32)
    np.cumsum(lengths[idx], out=cu_new[1:])
    mb["cu_seqlens"] = torch.from_numpy(cu_new)
    return mb


def split_packed(batch: dict[str, Any], max_tokens: int) -> list[dict[str, Any]]:
    """Micro-batches of consecutive packed sequences, cut at ``cu_seqlens`` boundaries."""
    cu = batch["cu_seqlens"].long().cpu().numpy()
    out = []
    for idx in micro_batches(np.diff(cu), max_tokens):
        i, j = int(idx[0]), int(idx[-1]) + 1  # sequences i..j-1, tokens cu[i]..cu[j]-1
        a, b = int(cu[i]), int(cu[j])
        mb = {k: batch[k][:, a:b] for k in TOKEN_KEYS}
        # Target column t scores token t+1: tokens a..b-1 are scored by columns a-1..b-2, and
        # column a-1 (scoring sequence i's first token from the previous one) is masked anyway.
        mb.update({k: batch[k][:, a : b - 1] for k in TARGET_KEYS})
        mb.update({k: batch[k][i:j] for k in SEQUENCE_KEYS if k in batch})
        mb["cu_seqlens"] = torch.from_numpy((cu[i : j + 1] - a).astype(np.int32))
        out.append(mb)
    return out


def unpack_index(cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """``(n, L-1)`` indices into the packed target columns, and their validity.

    Row ``i`` column ``j`` is packed column ``cu[i] + j``, the log-prob of sequence ``i``'s token
    ``j + 1`` — the same layout as row ``i`` of the padded batch.
    """
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    width = max(int(lengths.max()) - 1, 1)
    j = torch.arange(width, device=cu.device)
    valid = j[None, :] < (lengths[:, None] - 1)
    last = int(cu[-1]) - 2  # the last packed target column
    index = torch.clamp(cu[:-1, None] + j[None, :], max=max(last, 0))
    return index, valid
