"""The store's append-only side tables next to the rollouts: ``usage`` (one row per draw of
a rollout), ``lineage`` (which run continues which) and ``rewards`` (re-scorings). Rollout
rows are never rewritten; these logs are how sampling, resumes and re-scoring record facts."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from datetime import UTC, datetime

import lance
import numpy as np
import pyarrow as pa

from rolloutstore.schema import spec as S
from rolloutstore.store.layout import LINEAGE, REWARDS, USAGE, exists, join

USAGE_MAX_FRAGMENTS = 64


def append_usage(
    uri: str,
    storage_options: dict | None,
    rollout_ids: Sequence[str],
    learner_step: int,
    run_id: str,
) -> int:
    """Append one usage row per id to the store at ``uri``; see
    :meth:`RolloutStore.record_usage`."""
    n = len(rollout_ids)
    if n == 0:
        return 0
    now = datetime.now(UTC)
    sch = S.table_schema("usage")
    table = pa.table(
        {
            "rollout_id": pa.array(list(rollout_ids), pa.string()),
            "learner_step": pa.array(np.full(n, learner_step, np.int64)),
            "run_id": pa.array([run_id] * n, pa.string()),
            "at": pa.array([now] * n, sch.field("at").type),
        },
        schema=sch,
    )
    ds = lance.write_dataset(
        table, join(uri, USAGE), mode="append", storage_options=storage_options
    )
    if len(ds.get_fragments()) > USAGE_MAX_FRAGMENTS:
        # One small fragment per draw would make every commit and read of the log
        # grow with the number of steps; merging keeps them constant. Rows are kept.
        # If another process compacts concurrently, its result stands.
        with contextlib.suppress(OSError):
            ds.optimize.compact_files()
    return n


def open_table(uri: str, name: str, storage_options: dict | None) -> lance.LanceDataset | pa.Table:
    """The side table ``name`` (``"rewards"`` or ``"lineage"``) of the store at ``uri`` at its
    latest version; an empty table of its schema until its first row is written."""
    target = join(uri, {"rewards": REWARDS, "lineage": LINEAGE}[name])
    if exists(target, storage_options):
        return lance.dataset(target, storage_options=storage_options)
    return _empty(name)


@functools.cache
def _empty(name: str) -> pa.Table:
    """An empty side table (immutable, so one per name serves every caller: the selector
    asks for the rewards table at every draw)."""
    return S.table_schema(name).empty_table()


def append_lineage(
    uri: str,
    storage_options: dict | None,
    run_id: str,
    policy_version: int,
    parent_run: str | None,
    parent_version: int | None,
) -> None:
    """Append one lineage row to the store at ``uri``; see :meth:`RolloutStore.record_lineage`."""
    sch = S.table_schema("lineage")
    table = pa.table(
        {
            "run_id": [run_id],
            "policy_version": pa.array([policy_version], pa.int64()),
            "parent_run": [parent_run],
            "parent_version": pa.array([parent_version], pa.int64()),
            "at": pa.array([datetime.now(UTC)], sch.field("at").type),
        },
        schema=sch,
    )
    target = join(uri, LINEAGE)
    mode = "append" if exists(target, storage_options) else "create"
    lance.write_dataset(table, target, mode=mode, storage_options=storage_options)
