"""The one `where` validator (rolloutstore.query.sql.check_where) at every entry point.

A filter is refused, or confined: spliced into the selector's window query it changes
nothing of the statement but that query's WHERE clause (checked on DuckDB's parse tree).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import make_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutstore import QueryError, ReplayConfig, RolloutStore, Selector
from rolloutstore.query.sql import _parse, check_where
from rolloutstore.replay.config import WHERE_COLUMNS
from rolloutstore.replay.queries import window_sql

HOSTILE = [
    "true) OR (true",
    "reward > 0; SELECT 1",
    "1=1) UNION SELECT * FROM rollouts WHERE (1=1",
    "reward > 0 UNION SELECT * FROM cand",
    "reward > 0 -- cut",
    "reward > 0 /* x */",
    "reward IN (SELECT reward FROM cand)",
    "EXISTS (SELECT 1)",
    "length(read_text('/etc/passwd')) > 0",
    "getenv('HOME') IS NOT NULL",
    "current_setting('threads') > 0",
    "len(glob('*')) > 0",
    "nosuch_column > 1",
    "reward > 0 ORDER BY 1",
    "reward > 0 AS x",
    "reward, policy_version",
    "reward > $1",
    "main.getenv('x') = ''",
    "",
]


@pytest.mark.parametrize("where", HOSTILE)
def test_hostile_filters_are_refused_everywhere(tmp_path, where):
    with pytest.raises(QueryError, match="where"):
        ReplayConfig(where=where, where_params=())
    store = RolloutStore.open(tmp_path / "s", embedding_dim=8)
    store.append(make_rows(8))
    with pytest.raises(QueryError):
        store.export(tmp_path / "o.parquet", where=where, progress=False)
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.parametrize(
    "where",
    ["reward > ?", "completion_text <> ')(' AND reward >= ?", "list_contains(prompt_ids, ?)",
     "len(list_filter(completion_ids, x -> x > ?)) > 0 OR reward_version = 0"],
)  # fmt: skip
def test_plain_filters_pass(where):
    assert check_where(f"  {where} ", [*WHERE_COLUMNS, "prompt_ids", "completion_ids",
                                       "completion_text"]) == where  # fmt: skip


def test_placeholder_count_must_match_params():
    with pytest.raises(QueryError, match="2 value"):
        ReplayConfig(where="reward > ?", where_params=(1, 2))
    with pytest.raises(ValueError, match="without a where"):
        ReplayConfig(where_params=(1,))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sample", "--learner-version", "1", "--batch-size", "2", "--where", "true) OR (true"],
         "single filter"),
        (["sample", "--learner-version", "1", "--batch-size", "2", "--where",
          "reward > 0; SELECT 1"], "';'"),
        (["export", "OUT", "--where", "1=1) UNION SELECT * FROM rollouts WHERE (1=1"],
         "single filter"),
    ],
)  # fmt: skip
def test_cli_where_errors_are_one_line(tmp_path, argv, message):
    store = RolloutStore.open(tmp_path / "s", embedding_dim=8)
    store.append(make_rows(8))
    argv = [a if a != "OUT" else str(tmp_path / "o.parquet") for a in argv]
    p = subprocess.run(
        [sys.executable, "-m", "rolloutstore", argv[0], store.uri, *argv[1:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], p.stderr


# -- property: refused or confined ---------------------------------------------------------------
PIECES = [
    "reward", "policy_version", ">", "=", "0", "1", "?", ")", "(", "'", "''", '"', ";", "--",
    "/*", "*/", "UNION", "ALL", "SELECT", "*", "FROM", "cand", "rollouts", "WHERE", "OR",
    "AND", "true", "$$", "ORDER BY", "LIMIT 1", "\n", "read_text('x')", "getenv('H')", ",",
    "AS x", "EXISTS", "IN", "NOT", " ", "::INT", "[1]", "$1", "x -> x", "QUALIFY",
]  # fmt: skip


def _shape(node):
    """The parse tree without source positions."""
    if isinstance(node, dict):
        return {
            k: _shape(v)
            for k, v in node.items()
            if k not in ("query_location", "query_location_length")
        }
    if isinstance(node, list):
        return [_shape(v) for v in node]
    return node


def _without_window_where(tree: dict) -> dict:
    assert not tree.get("error"), tree
    (stmt,) = tree["statements"]
    node = stmt["node"]
    (cte,) = node["cte_map"]["map"]
    assert cte["key"] == "win"
    inner = cte["value"]["query_node"]
    inner["where_clause"] = None
    stmt["named_param_map"] = None  # the filter's own ? placeholders
    return _shape(tree)


REFERENCE = _without_window_where(_parse(window_sql(ReplayConfig(where="true", window=7))))
CASES = 0


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=9).map(" ".join))
def test_hostile_where_is_refused_or_confined_to_the_window_where(where):
    global CASES
    CASES += 1
    try:
        cfg = ReplayConfig(where=where, where_params=(0,) * where.count("?"), window=7)
    except QueryError:
        return
    except ValueError as exc:  # placeholder count vs params: still a refusal
        assert "placeholder" in str(exc)
        return
    tree = _parse(window_sql(cfg))
    assert len(tree["statements"]) == 1
    assert _without_window_where(tree) == REFERENCE, where


def test_property_ran_many_cases():
    # Runs after the property test in file order; documents how many cases it ran.
    print(f"where property cases: {CASES}")


def test_accepted_filters_run_on_a_real_store(tmp_path):
    store = RolloutStore.open(tmp_path / "s", embedding_dim=8)
    store.append(make_rows(40, seed=1, policy_version=2))
    cfg = ReplayConfig(where="reward > ? AND policy_version = ?", where_params=(0.5, 2))
    cand = Selector(store, cfg, record_usage=False).candidates(3).to_pylist()
    expect = store.sql("SELECT count(*) AS n FROM rollouts WHERE reward > 0.5")["n"][0].as_py()
    assert 0 < len(cand) == expect and all(r["reward"] > 0.5 for r in cand)
