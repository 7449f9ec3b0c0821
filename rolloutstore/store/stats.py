"""``RolloutStore.stats()`` and ``rolloutstore stats``: size, tokens, compression, the
policy-version histogram, reward by version and reuse, from one connection."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rolloutstore.query.sql import run

if TYPE_CHECKING:
    from rolloutstore.store.log import RolloutLog


def store_stats(store: RolloutLog) -> dict[str, Any]:
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
