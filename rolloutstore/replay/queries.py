"""Named SQL for replay selection. Each function returns SQL text; values are bound as params.

The candidate table ``cand`` holds the scalar columns of the fragments that can
hold the window (see ``Selector``); ``uses`` holds per-rollout use counts.
"""

from __future__ import annotations

from rolloutstore.replay.config import ReplayConfig

ORDER = "policy_version DESC, created_at DESC, rollout_id DESC"


def window_sql(cfg: ReplayConfig) -> str:
    """The buffer: eligible rows, newest first, capped at the window, minus flat groups.

    Params: ``where_params``. Depends only on the store version and the staleness
    bound, so the selector caches its result between draws.
    """
    where = f"WHERE ({cfg.where})" if cfg.where else ""
    limit = f"LIMIT {int(cfg.window)}" if cfg.window else ""
    sql = f"WITH win AS (SELECT * FROM cand {where} ORDER BY {ORDER} {limit}) SELECT * FROM win"
    if cfg.drop_zero_variance_groups:
        sql += (
            " WHERE group_id NOT IN (SELECT group_id FROM win GROUP BY group_id "
            "HAVING count(*) > 1 AND coalesce(stddev_pop(reward), 0) = 0 "
            "AND count(reward) = count(*))"
        )
    return f"{sql} ORDER BY {ORDER}"


# The reuse cap on top of the buffer. Params: max_uses.
USES_FILTER_SQL = (
    "SELECT buf.* FROM buf LEFT JOIN uses USING (rollout_id) "
    f"WHERE coalesce(uses.n, 0) < ? ORDER BY {ORDER}"
)


def lance_filter(cfg: ReplayConfig, lower_version: int | None) -> str | None:
    """Filter pushed into the Lance scan (policy_version bound and runs)."""
    parts = []
    if lower_version is not None:
        parts.append(f"policy_version >= {int(lower_version)}")
    if cfg.runs is not None:
        quoted = ", ".join("'" + r.replace("'", "''") + "'" for r in cfg.runs)
        parts.append(f"run_id IN ({quoted})")
    return " AND ".join(parts) or None
