"""DuckDB over the store: a locked-down in-process connection and the named queries.

The connection registers the Lance datasets directly (DuckDB scans them as Arrow
datasets with projection and filter pushdown) and defines the views

    rollouts   every rollout row
    usage      one row per (rollout_id, learner_step, run_id, at) use
    groups     per group: n, reward mean/std, min/max policy_version, tokens
    rewards    re-scorings: one row per (rollout_id, reward_version >= 1), see rescore.py
    rollouts_scored
               ``rollouts`` with ``reward``, ``advantage`` and ``reward_info`` taken
               from each rollout's newest re-scoring, plus ``reward_version`` (0: the
               values it was written with). ``rollouts`` itself always shows version 0:
               it is the raw log, and scanning it never pays for a join.

It is safe by default: ``enable_external_access`` is off and the configuration is
locked, so a query cannot read or write files outside the registered datasets,
load extensions, or turn that back on. Files we write (``--out``) are written by
our code from the Arrow result, never by SQL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa

from .errors import QueryError

if TYPE_CHECKING:
    from .store import RolloutStore

GROUPS_VIEW = """
CREATE VIEW groups AS
SELECT group_id,
       any_value(run_id)          AS run_id,
       any_value(prompt_id)       AS prompt_id,
       count(*)                   AS n,
       avg(reward)                AS reward_mean,
       stddev_pop(reward)         AS reward_std,
       min(policy_version)        AS min_policy_version,
       max(policy_version)        AS max_policy_version,
       sum(num_completion_tokens)::BIGINT AS completion_tokens
FROM rollouts
GROUP BY group_id
"""


# Each rollout's newest re-scoring (``reward_version`` is unique per rollout).
REWARDS_NEWEST_SQL = (
    "SELECT rollout_id, reward_version, reward, advantage, reward_info FROM rewards "
    "{where} QUALIFY row_number() OVER (PARTITION BY rollout_id ORDER BY reward_version DESC) = 1"
)

SCORED_VIEW = f"""
CREATE VIEW rollouts_scored AS
WITH newest AS ({REWARDS_NEWEST_SQL.format(where="")})
SELECT r.* REPLACE (
         CASE WHEN n.reward_version IS NULL THEN r.reward ELSE n.reward END AS reward,
         CASE WHEN n.reward_version IS NULL THEN r.advantage ELSE n.advantage END AS advantage,
         CASE WHEN n.reward_version IS NULL THEN r.reward_info ELSE n.reward_info END
           AS reward_info),
       coalesce(n.reward_version, 0)::BIGINT AS reward_version
FROM rollouts r LEFT JOIN newest n ON r.rollout_id = n.rollout_id
"""


def connect(datasets: Mapping[str, Any]) -> duckdb.DuckDBPyConnection:
    """A locked connection with each of ``datasets`` registered under its name."""
    con = duckdb.connect(
        config={
            "enable_external_access": False,
            "autoinstall_known_extensions": False,
            "autoload_known_extensions": False,
            "threads": 2,
        }
    )
    for name, ds in datasets.items():
        con.register(name, ds)
    if "rollouts" in datasets:
        con.execute(GROUPS_VIEW)
        if "rewards" in datasets:
            con.execute(SCORED_VIEW)
    con.execute("SET lock_configuration = true")
    return con


def run(
    con: duckdb.DuckDBPyConnection, query: str, params: Sequence | Mapping | None = None
) -> pa.Table:
    """Execute ``query`` with ``params`` (``?`` or ``$name``) and return an Arrow table."""
    try:
        rel = con.sql(query, params=params)
        if rel is None:  # a statement without a result (e.g. CREATE TEMP VIEW)
            return pa.table({})
        return rel.to_arrow_table()
    except duckdb.Error as exc:
        raise QueryError(f"{type(exc).__name__}: {exc}") from exc


def store_stats(store: RolloutStore) -> dict[str, Any]:
    """Summary numbers for `rolloutstore stats`."""
    con = store.connect()
    totals = run(
        con,
        "SELECT count(*) AS rows, coalesce(sum(num_prompt_tokens), 0)::BIGINT AS p_tok, "
        "coalesce(sum(num_completion_tokens), 0)::BIGINT AS c_tok, count(DISTINCT run_id) AS "
        "runs, count(DISTINCT prompt_id) AS prompts, count(DISTINCT group_id) AS groups, "
        "min(created_at) AS first, max(created_at) AS last FROM rollouts",
    ).to_pylist()[0]
    rows, p_tok, c_tok, runs, prompts, groups, first, last = totals.values()
    by_version = run(
        con,
        "SELECT policy_version, count(*) AS rollouts, avg(reward) AS reward_mean, "
        "count(reward) AS scored FROM rollouts GROUP BY 1 ORDER BY 1",
    ).to_pylist()
    reuse = run(
        con,
        "WITH u AS (SELECT r.rollout_id, count(x.rollout_id) AS uses FROM rollouts r "
        "LEFT JOIN usage x USING (rollout_id) GROUP BY 1) "
        "SELECT uses, count(*) AS rollouts FROM u GROUP BY 1 ORDER BY 1",
    ).to_pylist()
    nbytes = store.bytes_on_disk()
    tokens = int(p_tok + c_tok)
    ds = store.dataset()
    return {
        "uri": store.uri,
        "version": ds.version,
        "fragments": len(ds.get_fragments()),
        "rows": int(rows),
        "runs": int(runs),
        "prompts": int(prompts),
        "groups": int(groups),
        "prompt_tokens": int(p_tok),
        "completion_tokens": int(c_tok),
        "tokens": tokens,
        "bytes_on_disk": nbytes,
        "bytes_per_token": (nbytes / tokens) if nbytes is not None and tokens else None,
        "first_created_at": first.isoformat() if first else None,
        "last_created_at": last.isoformat() if last else None,
        "embedding_dim": store.embedding_dim,
        "by_policy_version": by_version,
        "reuse": reuse,
    }
