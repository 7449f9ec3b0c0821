"""Deleting rows by an explicit retention rule: keep the newest N, drop old or stale
policies, or keep N while preserving diversity (:mod:`rolloutstore.retention.policy` plans which).
Sampling never deletes; this is the only place rows leave a store."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import lance

from rolloutstore.retention.policy import RetentionConfig, RetentionReport


def evict_rows(
    ds: lance.LanceDataset,
    newest_rewards: Callable[[], Any],
    *,
    keep_last: int | None = None,
    older_than: timedelta | datetime | None = None,
    min_policy_version: int | None = None,
    preserve_diversity: bool | RetentionConfig = False,
) -> tuple[int, RetentionReport | None]:
    """Delete ``ds``'s rows by the rule of :meth:`RolloutStore.evict` (one commit); returns
    the row count before and, with ``preserve_diversity``, the retention report.
    ``newest_rewards()``: the store's newest re-scored rewards (correctness is judged by them)."""
    if keep_last is None and older_than is None and min_policy_version is None:
        raise ValueError("evict needs keep_last, older_than or min_policy_version")
    before = ds.count_rows()
    preds = []
    if min_policy_version is not None:
        preds.append(f"policy_version < {int(min_policy_version)}")
    if older_than is not None:
        cutoff = (
            older_than if isinstance(older_than, datetime) else (datetime.now(UTC) - older_than)
        )
        if cutoff.tzinfo is None:
            cutoff = cutoff.replace(tzinfo=UTC)
        stamp = cutoff.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
        preds.append(f"created_at < TIMESTAMP '{stamp}'")
    if preserve_diversity is not False:
        before_ts = cutoff if older_than is not None else None
        return _evict_diverse(
            ds, newest_rewards, keep_last, preserve_diversity, before_ts, min_policy_version
        )
    if keep_last is not None:
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        pred = _keep_last_predicate(ds, keep_last)
        if pred:
            preds.append(pred)
    if preds:
        ds.delete(" OR ".join(f"({p})" for p in preds))
    return before, None


def _evict_diverse(
    ds, newest_rewards, keep, config, before, min_policy_version
) -> tuple[int, RetentionReport]:
    from rolloutstore.retention.policy import plan_retention, read_rows, rule_mask
    from rolloutstore.retention.rescore import apply_rewards

    if keep is None:
        raise ValueError("evict(preserve_diversity=...) needs keep_last (the rows to keep)")
    if not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep_last must be an int >= 0, got {keep!r}")
    if not isinstance(config, RetentionConfig):
        if config is not True:
            raise TypeError(
                "preserve_diversity must be True, False or a RetentionConfig, "
                f"got {type(config).__name__}"
            )
        config = RetentionConfig()
    # "Correct" answers are judged by each rollout's newest re-scoring.
    table = apply_rewards(read_rows(ds), newest_rewards())
    dropped = rule_mask(table, before=before, min_policy_version=min_policy_version)
    plan = plan_retention(table, keep, config, dropped=dropped)
    if plan.delete is not None:
        ds.delete(plan.delete)  # one filter, one commit
    return table.num_rows, plan.report


def _keep_last_predicate(ds: lance.LanceDataset, keep: int) -> str | None:
    if ds.count_rows() <= keep:
        return None
    if keep == 0:
        return "true"
    from rolloutstore.query.sql import connect, run

    pv, ts, rid = (
        run(
            connect({"rollouts": ds}),
            "SELECT policy_version, epoch_us(created_at) AS ts, rollout_id FROM rollouts "
            "ORDER BY policy_version DESC, created_at DESC, rollout_id DESC "
            "LIMIT 1 OFFSET ?",
            [keep - 1],
        )
        .to_pylist()[0]
        .values()
    )
    stamp = datetime.fromtimestamp(ts / 1e6, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    t = f"TIMESTAMP '{stamp}'"
    rid = rid.replace("'", "''")
    return (
        f"policy_version < {pv} OR (policy_version = {pv} AND (created_at < {t} OR "
        f"(created_at = {t} AND rollout_id < '{rid}')))"
    )
