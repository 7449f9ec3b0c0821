"""The token budget of a draw (``Selector.sample(max_tokens=...)``, a run's
``max_tokens_per_batch``): which rows no batch can hold, and what a budget cut off a batch.

The rule (docs/limits.md): a row longer than the budget is never drawn; it stays in the store,
each draw counts the eligible rows left out (``Selection.over_budget``) and the first time a
selector meets one it warns (:class:`RowOverBudgetWarning`) with its rollout_id, length and the
fix. Training it would exceed the memory the budget stands for, and the old rule (keep the
first drawn row whatever its length, cut the rest) both exceeded it and shrank the batch
silently. Rows within the budget fill the batch in draw order up to it; the rows it cuts are
counted (``Selection.budget_cut``) and warned about once (:class:`ShrunkBatchWarning`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from rolloutstore.errors import RowOverBudgetError


def row_lengths(cand: pa.Table) -> np.ndarray:
    """(N,) int64 tokens of each candidate row: prompt + completion (what a batch holds)."""
    return cand["num_prompt_tokens"].to_numpy().astype(np.int64) + cand[
        "num_completion_tokens"
    ].to_numpy().astype(np.int64)


def over_budget(cand: pa.Table, max_tokens: int) -> np.ndarray:
    """(N,) bool: candidates longer than ``max_tokens``; every one of them: an error."""
    lengths = row_lengths(cand)
    over = lengths > max_tokens
    if len(over) and over.all():
        raise RowOverBudgetError(
            f"all {len(over)} eligible rows are longer than the token budget max_tokens="
            f"{max_tokens} (shortest: {int(lengths.min())} tokens, rollout_id "
            f"{cand['rollout_id'][int(lengths.argmin())].as_py()}): raise the budget "
            "([run].max_tokens_per_batch) to at least that"
        )
    return over


def over_budget_message(cand: pa.Table, over: np.ndarray, max_tokens: int) -> str:
    """One line for :class:`RowOverBudgetWarning`: how many, the first one, the fix."""
    first = int(np.flatnonzero(over)[0])
    length = int(row_lengths(cand)[first])
    return (
        f"{int(over.sum())} of {len(over)} eligible rows are longer than the token budget "
        f"max_tokens={max_tokens} and are not drawn (first: rollout_id "
        f"{cand['rollout_id'][first].as_py()}, {length} tokens); each train record counts them "
        "as rows_over_budget. Raise [run].max_tokens_per_batch to train them, or leave them out "
        "on purpose with [replay].where = 'num_prompt_tokens + num_completion_tokens <= "
        f"{max_tokens}'"
    )


def fit_budget(lengths: np.ndarray, max_tokens: int) -> int:
    """How many of the drawn rows (``lengths``, in draw order) fit ``max_tokens`` together."""
    return int(np.searchsorted(np.cumsum(lengths), max_tokens, side="right"))


def budget_metrics(batch: dict | list[dict]) -> dict[str, int]:
    """A train record's keys for one loader item (a batch, or its micro-batches): ``batch_rows``
    (rows of the whole step) and, under a token budget, ``batch_shrunk`` (rows it cut off the
    ``batch_size`` drawn) and ``rows_over_budget`` (eligible rows too long to draw)."""
    first = batch[0] if isinstance(batch, list) else batch
    out = {"batch_rows": int(first["batch_rows"])}
    if first.get("budget_cut") is not None:
        out["batch_shrunk"] = int(first["budget_cut"])
    if first.get("over_budget") is not None:
        out["rows_over_budget"] = int(first["over_budget"])
    return out
