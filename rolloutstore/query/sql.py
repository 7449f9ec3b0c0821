"""DuckDB over the store: a locked-down in-process connection and the named queries.

The connection registers the Lance datasets directly (DuckDB scans them as Arrow
datasets with projection and filter pushdown) and defines the views

    rollouts   every rollout row, in the current schema whatever version wrote the store
               (a view over the stored ``rollouts_stored``, see schema_compat)
    turns      one row per turn of every rollout: rollout_id, turn, role, start, end,
               tool_name, num_tokens, num_model_tokens (a rollout without turns: one
               assistant turn over its completion)
    usage      one row per (rollout_id, learner_step, run_id, at) use
    groups     per group: n, reward mean/std, min/max policy_version, tokens
    rewards    re-scorings: one row per (rollout_id, reward_version >= 1), see rescore.py
    rollouts_scored
               ``rollouts`` with ``reward``, ``advantage`` and ``reward_info`` taken
               from each rollout's newest re-scoring, plus ``reward_version`` (0: the
               values it was written with). ``rollouts`` itself always shows version 0:
               it is the raw log, and scanning it never pays for a join.

Every connection goes through :func:`connect`, the one lock-down (``LOCKDOWN``):
no external file access, no extension install/load, no persistent secrets, spills
to a private temp folder, no progress bar, and a locked configuration, so user SQL
cannot read or write files outside the registered datasets, load extensions, or
change a setting. Files we write (``--out``) are written by our code from the
Arrow result, never by SQL.

User filters (``sample --where``, ``ReplayConfig.where``, ``export --where``,
``rescore --where``) all pass :func:`check_where`: DuckDB's own parser must read
the text as exactly one expression over known columns, with no subquery, comment,
file- or settings-reading function, and only ``?`` placeholders for values.

Query limits (:mod:`rolloutstore.query.limits`): :func:`limits` bounds a
query by ``timeout`` seconds (a watchdog thread calls ``DuckDBPyConnection.interrupt()``),
and while :func:`sigint_interrupts` is active (the CLI), Ctrl-C interrupts the running
query at once instead of when it ends.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import duckdb
import pyarrow as pa

from rolloutstore.errors import QueryError
from rolloutstore.query.limits import limits

# The default limit of the CLI's `sql` and `export --where` (seconds; the API default is none).
DEFAULT_TIMEOUT = 300.0

# Settings every connection is opened with, before the configuration is locked.
LOCKDOWN: dict[str, Any] = {
    "enable_external_access": False,  # no files, URLs, ATTACH, COPY, read_*/glob
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "allow_unsigned_extensions": False,
    "allow_persistent_secrets": False,
    "threads": 2,
}


def _temp_directory() -> str:
    # Spills go to a private folder, never to the working directory (which may be a store).
    return os.path.join(tempfile.gettempdir(), f"rolloutstore-duckdb-{os.getuid()}")


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


# One row per turn; a rollout without turns (null: one model turn) is one assistant turn.
TURNS_VIEW = """
CREATE VIEW turns AS
WITH t AS (
    SELECT rollout_id, loss_mask,
           coalesce(turns, [{'role': 'assistant', 'start': 0, 'end': num_completion_tokens,
                             'tool_name': NULL::VARCHAR}]) AS ts
    FROM rollouts
), u AS (
    SELECT rollout_id, loss_mask, unnest(generate_series(0, len(ts) - 1)) AS turn,
           unnest(ts) AS x
    FROM t
)
SELECT rollout_id, turn::INTEGER AS turn, x.role AS role, x.start AS start, x."end" AS "end",
       x.tool_name AS tool_name, (x."end" - x.start)::INTEGER AS num_tokens,
       coalesce(list_sum(loss_mask[x.start + 1 : x."end"]), 0)::INTEGER AS num_model_tokens
FROM u
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


def connect(
    datasets: Mapping[str, Any] | None = None, *, rollouts_view: str | None = None
) -> duckdb.DuckDBPyConnection:
    """A locked connection (``LOCKDOWN``) with each of ``datasets`` registered under its name.

    ``rollouts_view``: SQL creating the ``rollouts`` view over a registered
    ``rollouts_stored`` (the store's dataset shown in the current schema, whatever version
    wrote it: :data:`rolloutstore.schema_compat.ROLLOUTS_VIEW`).
    """
    datasets = datasets or {}
    con = duckdb.connect(config={**LOCKDOWN, "temp_directory": _temp_directory()})
    con.execute("SET enable_progress_bar = false")  # also keeps interrupt() prompt
    for name, ds in datasets.items():
        con.register(name, ds)
    if rollouts_view is not None:
        con.execute(rollouts_view)
    if "rollouts" in datasets or rollouts_view is not None:
        con.execute(GROUPS_VIEW)
        if rollouts_view is not None:  # a store's rollouts, in the current schema
            con.execute(TURNS_VIEW)
        if "rewards" in datasets:
            con.execute(SCORED_VIEW)
    con.execute("SET lock_configuration = true")
    return con


# -- the one `where` validator -----------------------------------------------------------------
# Functions a filter may not call: they read files, settings, the environment or the
# catalog, sleep, or change state. (External access is off anyway; this names the fault.)
DENIED_FUNCTIONS = frozenset(
    {
        "glob", "getenv", "current_setting", "query", "query_table", "which_secret",
        "sleep_ms", "pg_sleep", "enable_profile", "disable_profile", "current_query",
        "add_grammar_extension", "remove_grammar_extension", "setseed", "nextval", "currval",
        "sniff_csv", "extension_versions", "load_extension", "install_extension",
    }
)  # fmt: skip
DENIED_PREFIXES = ("read_", "duckdb_", "pragma_", "parquet_", "iceberg_", "delta_", "json_execute")
FIX = "pass literal values as ? placeholders with --param / params"

_parse_lock = threading.Lock()
_parse_con: duckdb.DuckDBPyConnection | None = None


def _parse(sql: str) -> dict:
    """DuckDB's parse tree of ``sql`` (``json_serialize_sql``), without executing it."""
    global _parse_con
    with _parse_lock:
        if _parse_con is None:
            _parse_con = connect()
        raw = _parse_con.execute("SELECT json_serialize_sql(?::VARCHAR)", [sql]).fetchone()[0]
    return json.loads(raw)


def check_where(
    where: str,
    columns: Iterable[str] | None = None,
    *,
    what: str = "--where",
    n_params: int | None = None,
) -> str:
    """Return ``where`` stripped if it is one boolean filter expression; raise QueryError if not.

    DuckDB's parser must read ``SELECT <where>`` as exactly one plain SELECT of one
    un-aliased expression with no FROM, WHERE, ORDER BY, set operation or second
    statement; the text may hold no comment; the expression may hold no subquery,
    no ``*``, no file/settings-reading function (``DENIED_FUNCTIONS``), only ``?``
    placeholders, and only column names in ``columns`` (when given). Such a text,
    spliced as ``WHERE (<where>)``, can only filter rows. ``n_params``: the number
    of values given for its ``?`` placeholders, checked when not None.
    """
    if not isinstance(where, str):
        raise QueryError(f"{what} must be a string, got {type(where).__name__}")
    text = where.strip()
    if not text:
        raise QueryError(f"{what} is empty; expected a boolean filter such as 'reward > ?'")
    if "\x00" in text:
        raise QueryError(f"{what} contains a NUL character: {text!r}")
    try:
        tokens = duckdb.tokenize(text)
    except Exception:  # the parser below names the fault
        tokens = []
    if any(kind == duckdb.token_type.comment for _, kind in tokens):
        raise _refuse(what, text, "it contains an SQL comment ('--' or '/* */')")
    if any(kind == duckdb.token_type.operator and text[pos] == ";" for pos, kind in tokens):
        raise _refuse(what, text, "found ';', which would end the statement")
    tree = _parse("SELECT " + text)
    if tree.get("error"):
        msg = tree.get("error_message", "parse error")
        raise _refuse(what, text, f"DuckDB cannot parse it as one expression ({msg})")
    statements = tree.get("statements", [])
    if len(statements) != 1:
        raise _refuse(what, text, f"found ';' and {len(statements)} statements")
    node = statements[0]["node"]
    items = node.get("select_list") or []
    plain = (
        node.get("type") == "SELECT_NODE"
        and not node.get("modifiers")
        and not (node.get("cte_map") or {}).get("map")
        and len(items) == 1
        and not items[0].get("alias")
        and (node.get("from_table") or {}).get("type") == "EMPTY"
        and node.get("where_clause") is None
        and not node.get("group_expressions")
        and not node.get("group_sets")
        and node.get("having") is None
        and node.get("qualify") is None
        and node.get("sample") is None
        and node.get("aggregate_handling", "STANDARD_HANDLING") == "STANDARD_HANDLING"
    )
    if not plain:
        raise _refuse(
            what, text, "it changes the query around it (UNION, ORDER BY, FROM, an alias, ...)"
        )
    # The same text in the place it will be spliced must parse to the same expression
    # (e.g. ``ALL reward`` is a valid select list but no expression).
    wrapped = _parse(f"SELECT 1 FROM rollouts WHERE ({text})")
    inner = (wrapped.get("statements") or [{}])[0].get("node", {}).get("where_clause")
    if wrapped.get("error") or len(wrapped["statements"]) != 1 or _shape(inner) != _shape(items[0]):
        raise _refuse(what, text, "it does not read as the same expression inside WHERE (...)")
    params: list[str] = []
    _walk(items[0], text, what, None if columns is None else {c.lower() for c in columns}, set(),
          params)  # fmt: skip
    if n_params is not None and len(params) != n_params:
        raise QueryError(
            f"{what} {text!r} has {len(params)} ? placeholder(s) but {n_params} value(s) were "
            "given; pass one --param / params value per ?"
        )
    return text


def _shape(node: Any) -> Any:
    """A parse tree without source positions (which differ with the text around it)."""
    if isinstance(node, dict):
        skip = ("query_location", "query_location_length")
        return {k: _shape(v) for k, v in node.items() if k not in skip}
    if isinstance(node, list):
        return [_shape(v) for v in node]
    return node


def _refuse(what: str, text: str, reason: str) -> QueryError:
    return QueryError(
        f"{what} must be a single filter expression over the rows' columns; {reason}: "
        f"{text!r}. {FIX}"
    )


def _walk(node: Any, text: str, what: str, columns, bound: set[str], params: list) -> None:
    if isinstance(node, list):
        for x in node:
            _walk(x, text, what, columns, bound, params)
        return
    if not isinstance(node, dict):
        return
    cls = node.get("class")
    if cls == "SUBQUERY" or "subquery" in node or node.get("type") == "SELECT_NODE":
        raise _refuse(what, text, "it contains a subquery")
    if cls == "STAR":
        raise _refuse(what, text, "it uses *")
    if cls == "PARAMETER":
        # `?` only: `$1`/`$name` would clash with the placeholders of the query around it.
        loc, n = node.get("query_location", 0) - 7, node.get("query_location_length", 1)
        if text[loc : loc + n] != "?":
            raise _refuse(what, text, f"it uses the placeholder {text[loc : loc + n]!r}, not ?")
        params.append("?")
        return
    if cls == "FUNCTION":
        name = str(node.get("function_name", "")).lower()
        path = [str(p).lower() for p in (node.get("qualified_name") or {}).get("path", [])]
        if node.get("schema") or node.get("catalog") or len(path) > 1:
            raise _refuse(what, text, "it calls a schema-qualified function")
        if name in DENIED_FUNCTIONS or name.startswith(DENIED_PREFIXES):
            raise _refuse(what, text, f"it calls {name}(), which reads files/settings/state")
    if cls == "WINDOW":
        raise _refuse(what, text, "it uses a window function")
    if cls == "LAMBDA":
        lhs = node.get("lhs")
        names = _lambda_names(lhs)
        _walk(node.get("expr"), text, what, columns, bound | names, params)
        return
    if cls == "COLUMN_REF" and columns is not None:
        names = [str(n) for n in node.get("column_names", [])]
        if len(names) != 1 or (names[0].lower() not in columns and names[0] not in bound):
            shown = ".".join(names)
            raise _refuse(
                what, text, f"unknown column {shown!r} (known: {', '.join(sorted(columns))})"
            )
    for value in node.values():
        if isinstance(value, (dict, list)):
            _walk(value, text, what, columns, bound, params)


def _lambda_names(lhs: Any) -> set[str]:
    if isinstance(lhs, dict):
        if lhs.get("class") == "COLUMN_REF":
            return {str(n) for n in lhs.get("column_names", [])}
        return set().union(*(_lambda_names(c) for c in lhs.get("children", [])))
    return set()


def run(
    con: duckdb.DuckDBPyConnection,
    query: str,
    params: Sequence | Mapping | None = None,
    *,
    timeout: float | None = None,
) -> pa.Table:
    """Execute ``query`` with ``params`` (``?`` or ``$name``) and return an Arrow table.

    ``timeout``: seconds before the query is interrupted (:class:`QueryTimeoutError`).
    """
    try:
        with limits(con, timeout):
            rel = con.sql(query, params=params)
            if rel is None:  # a statement without a result (e.g. CREATE TEMP VIEW)
                return pa.table({})
            return rel.to_arrow_table()
    except duckdb.Error as exc:
        raise QueryError(f"{type(exc).__name__}: {exc}") from exc
