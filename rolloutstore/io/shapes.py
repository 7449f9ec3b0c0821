"""The shapes an export writes (``as_``): ``rollouts`` as stored, and SFT / DPO data in TRL's
dataset column names. Owns the column mappings, the checks of ``columns``, the output Arrow
schema, the DuckDB query that shapes the rows, and conversational (chat-turn) columns.
:mod:`rolloutstore.io.export` streams the query's result to files."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import duckdb
import pyarrow as pa

from rolloutstore.errors import ExportError, QueryError
from rolloutstore.query.limits import limits

if TYPE_CHECKING:
    from rolloutstore.store.log import RolloutLog

# "messages" (conversations in the OpenAI / TRL format) is built by export_messages.py.
ExportShape = Literal["rollouts", "sft", "dpo", "messages"]

# Output columns in TRL's dataset names (trl docs, "Dataset formats and types": prompt-completion
# {"prompt", "completion"}, preference {"prompt", "chosen", "rejected"}, conversational
# language modeling {"messages"}); the rest are extra columns TRL's trainers drop.
# SFT output column -> store column.
SFT_COLUMNS: dict[str, str] = {
    "prompt": "prompt_text",
    "completion": "completion_text",
    "prompt_ids": "prompt_ids",
    "completion_ids": "completion_ids",
    "reward": "reward",
    "prompt_id": "prompt_id",
    "rollout_id": "rollout_id",
}
# DPO output column -> (alias, store column): alias "c" is the chosen row, "j" the rejected one.
DPO_COLUMNS: dict[str, tuple[str, str]] = {
    "prompt": ("c", "prompt_text"),
    "chosen": ("c", "completion_text"),
    "rejected": ("j", "completion_text"),
    "prompt_id": ("c", "prompt_id"),
    "group_id": ("c", "group_id"),
    "prompt_ids": ("c", "prompt_ids"),
    "chosen_ids": ("c", "completion_ids"),
    "chosen_reward": ("c", "reward"),
    "rejected_ids": ("j", "completion_ids"),
    "rejected_reward": ("j", "reward"),
}
# Conversational rows (their metadata JSON holds the prompt turns under "messages", as
# `ingest --from trl|openai` writes for chat prompts): these columns become lists of
# {"role", "content"} turns, and sft adds "messages" (prompt turns + the completion).
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
CHAT_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages")
TURNS = "__turns"  # the query's extra column: metadata's "messages" as JSON text
# ... and a multi-turn trajectory's own messages (metadata's "completion_messages", as
# `ingest --from openai` keeps them), per completion column.
DONE = {"completion": "__done", "chosen": "__done_c", "rejected": "__done_j"}
_DONE_SQL = "json_extract({t}.metadata, '$.completion_messages')::VARCHAR AS {col}"
_CHAT_SQL = (
    "json_extract({t}.metadata, '$.messages')::VARCHAR AS {turns}, {t}.prompt_text AS {text}"
)
# The rollout each text column comes from (named by errors), and the chat prompt's fallback.
IDS = {"prompt": "__id", "completion": "__id", "messages": "__id", "chosen": "__id",
       "rejected": "__id_j"}  # fmt: skip
PROMPT_TEXT = "__prompt_text"
# Output text column -> the store column it holds.
TEXT_SOURCES = {"prompt": "prompt_text", "completion": "completion_text",
                "chosen": "completion_text", "rejected": "completion_text"}  # fmt: skip


# sft without min_reward keeps each prompt's best completions only when their reward is above
# this: a "best" answer that scored 0 is no demonstration.
SFT_FLOOR = 0.0


def quote(name: str) -> str:
    # Only ever called with names from the store schema or our fixed output columns.
    return '"' + name.replace('"', '""') + '"'


def check_columns(columns: Sequence[str] | None, allowed: Sequence[str], shape: str) -> list[str]:
    if columns is None:
        return list(allowed)
    cols = [c.strip() for c in columns if c.strip()]
    if not cols:
        raise ExportError("--columns is empty; expected a comma-separated list of column names")
    unknown = [c for c in cols if c not in allowed]
    if unknown:
        raise ExportError(
            f"unknown column(s) {', '.join(map(repr, unknown))} for --as {shape}; "
            f"expected some of: {', '.join(allowed)}"
        )
    if len(set(cols)) != len(cols):
        raise ExportError(f"--columns names a column twice: {', '.join(cols)}")
    return cols


def output_schema(
    store_schema: pa.Schema, shape: ExportShape, cols: list[str], chat: bool = False
) -> pa.Schema:
    if chat:
        fields = [
            pa.field(c, pa.list_(MESSAGE))
            if c in CHAT_COLUMNS
            else output_schema(store_schema, shape, [c]).field(c)
            for c in cols
        ]
    elif shape == "dpo":
        fields = [
            store_schema.field(DPO_COLUMNS[c][1]).with_name(c).with_nullable(True) for c in cols
        ]
    elif shape == "sft":
        fields = [store_schema.field(SFT_COLUMNS[c]).with_name(c) for c in cols]
    else:
        fields = [store_schema.field(c) for c in cols]
    meta = {k: v for k, v in (store_schema.metadata or {}).items()}
    meta[b"rolloutstore.export"] = shape.encode()
    return pa.schema(fields, metadata=meta)


def build_query(
    shape: ExportShape,
    cols: list[str],
    where: str | None,
    min_reward: float | None,
    chat: bool = False,
    keep_duplicates: bool = False,
) -> tuple[str, str]:
    """(query, count_query); both take the where's params first, then the shape's (sft: the
    floor of the best per prompt, ``SFT_FLOOR``, or ``min_reward``; dpo: the margin)."""
    filt = f"WHERE ({where})" if where is not None else ""
    base = f"SELECT * FROM rollouts {filt}"
    if shape == "rollouts":
        select = ", ".join(quote(c) for c in cols)
        return (
            f"SELECT {select} FROM rollouts {filt}",
            f"SELECT count(*) FROM rollouts {filt}",
        )

    def turns(t: str) -> str:  # a chat row's prompt turns and its prompt_text, of table t
        return ", " + _CHAT_SQL.format(t=t, turns=TURNS, text=PROMPT_TEXT) if chat else ""

    if shape == "sft":
        parts = [f"r.{quote(SFT_COLUMNS[c])} AS {quote(c)}" for c in cols if c != "messages"]
        if chat and "messages" in cols and "completion" not in cols:
            parts.append('r."completion_text" AS "completion"')
        parts.append(f"r.rollout_id AS {IDS['completion']}")
        select = ", ".join(parts) + turns("r")
        select += ", " + _DONE_SQL.format(t="r", col=DONE["completion"]) if chat else ""
        if min_reward is None:  # the best per prompt, if above the floor (the `?`)
            kept = (
                "best AS (SELECT prompt_id, max(reward) AS top FROM r0 "
                "WHERE reward IS NOT NULL GROUP BY prompt_id), "
                "k AS (SELECT r0.* FROM r0 JOIN best ON r0.prompt_id = best.prompt_id "
                "AND r0.reward = best.top WHERE r0.reward > ?)"
            )
        else:
            kept = "k AS (SELECT * FROM r0 WHERE reward >= ?)"
        # One row per (prompt, completion tokens): the highest reward, then the smallest id.
        dedup = (
            ""
            if keep_duplicates
            else " QUALIFY row_number() OVER (PARTITION BY prompt_id, completion_ids "
            "ORDER BY reward DESC, rollout_id) = 1"
        )
        body = f"WITH r0 AS ({base}), {kept}, r AS (SELECT * FROM k{dedup}) SELECT {select} FROM r"
        return body + " ORDER BY r.prompt_id, r.rollout_id", f"SELECT count(*) FROM ({body})"
    select = ", ".join(
        [
            *(
                f"{side}.{quote(src)} AS {quote(name)}"
                for name, (side, src) in DPO_COLUMNS.items()
                if name in cols
            ),
            f"c.rollout_id AS {IDS['chosen']}, j.rollout_id AS {IDS['rejected']}",
        ]
    ) + turns("c")
    if chat:
        select += "".join(
            ", " + _DONE_SQL.format(t=t, col=DONE[side])
            for side, t in (("chosen", "c"), ("rejected", "j"))
        )
    body = (
        f"WITH r AS ({base}), "
        "k AS (SELECT group_id, rollout_id, reward, "
        "row_number() OVER (PARTITION BY group_id ORDER BY reward DESC, rollout_id) AS hi, "
        "row_number() OVER (PARTITION BY group_id ORDER BY reward ASC, rollout_id) AS lo, "
        "count(*) OVER (PARTITION BY group_id) AS n "
        "FROM r WHERE reward IS NOT NULL), "
        "p AS (SELECT ch.group_id, ch.rollout_id AS chosen, rj.rollout_id AS rejected "
        "FROM k AS ch JOIN k AS rj ON ch.group_id = rj.group_id "
        "WHERE ch.hi = 1 AND rj.lo = 1 AND ch.n >= 2 "
        "AND ch.reward::DOUBLE - rj.reward::DOUBLE >= ?) "
        f"SELECT {select} FROM p JOIN r AS c ON c.rollout_id = p.chosen "
        "JOIN r AS j ON j.rollout_id = p.rejected"
    )
    return body + " ORDER BY p.group_id", f"SELECT count(*) FROM ({body})"


def row_kinds(store: RolloutLog, where: str | None, params, timeout) -> tuple[bool, bool]:
    """(chat, token_only) of the (filtered) rows: every row is conversational (its metadata
    holds prompt turns), or no row has a prompt_text or completion_text (e.g. proxy rows)."""
    filt = f"WHERE ({where})" if where is not None else ""
    n, chat, text = first_row(
        store,
        "SELECT count(*), "
        "count(*) FILTER (WHERE json_type(metadata, '$.messages') = 'ARRAY'), "
        "count(*) FILTER (WHERE prompt_text IS NOT NULL OR completion_text IS NOT NULL) "
        f"FROM rollouts {filt}",
        params,
        timeout,
    )
    return n > 0 and n == chat, n > 0 and text == 0


def first_row(store: RolloutLog, sql: str, params, timeout: float | None) -> tuple:
    """The first row of a check query on the sandboxed connection (QueryError on failure)."""
    con = store.connect()
    try:
        with limits(con, timeout):
            return con.sql(sql, params=list(params or []) or None).fetchall()[0]
    except duckdb.Error as exc:
        raise QueryError(f"export query failed: {type(exc).__name__}: {exc}") from exc
    finally:
        con.close()


def empty_reason(
    store: RolloutLog,
    shape: ExportShape,
    where: str | None,
    params,
    min_reward: float | None,
    min_margin: float | None,
    timeout: float | None,
) -> str:
    """Why an export of ``shape`` holds no row, in one line, with the option that would
    change it."""
    filt = f"WHERE ({where})" if where is not None else ""
    rows = "rows matching --where" if where is not None else "rows"
    n, scored, top = first_row(
        store, f"SELECT count(*), count(reward), max(reward) FROM rollouts {filt}", params, timeout
    )
    head = f"nothing to export (--as {shape}), no file written: "
    if n == 0:
        return head + (
            "no row matches --where; relax it" if where is not None else "the store has no rows"
        )
    if shape in ("rollouts", "messages"):
        return head + f"no rows among the {n} {rows}"
    if scored == 0:
        return (
            head + f"none of the {n} {rows} has a reward (score them: rolloutstore-train rescore)"
        )
    if shape == "sft":
        if min_reward is None:
            return head + (
                f"it keeps each prompt's best completions when their reward is > {SFT_FLOOR:g}, "
                f"and the best reward of the {scored} scored {rows} is {top:g}; pass "
                "--min-reward R to keep every completion with reward >= R"
            )
        return head + (
            f"no completion has reward >= --min-reward {min_reward:g} (the best of the "
            f"{scored} scored {rows} is {top:g}); lower --min-reward"
        )
    groups, margin = first_row(
        store,
        "SELECT count(*), max(m) FROM (SELECT max(reward)::DOUBLE - min(reward)::DOUBLE AS m "
        f"FROM rollouts {filt} {'AND' if filt else 'WHERE'} reward IS NOT NULL "
        "GROUP BY group_id HAVING count(*) >= 2)",
        params,
        timeout,
    )
    if not groups:
        return head + (
            f"no group has two scored rows (of {scored} scored {rows}); dpo pairs the best and "
            "worst completion of one group"
        )
    return head + (
        f"the largest reward margin of the {groups} groups with two or more scored rows is "
        f"{margin:g}, under --min-margin {min_margin:g}; lower --min-margin"
    )


def _content(v: Any) -> str:
    if v is None:
        return ""
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def chat_messages(raw: str | None, rid: str, field: str) -> list[dict[str, str]] | None:
    """A stored JSON list of chat messages (metadata's ``field`` of rollout ``rid``) as
    ``{"role", "content"}`` dicts of text, or None when the row keeps none: absent, or not a
    non-empty list of objects (``[1, 2]``, ``[null]``). A role or content that is not text
    (``5``, a dict, a nested list) is its JSON text, null is empty; JSON nested too deeply to
    read is refused, naming the rollout and the field."""
    if raw is None:
        return None
    try:
        turns = json.loads(raw)
        if not turns or not isinstance(turns, list) or not all(isinstance(m, dict) for m in turns):
            return None
        return [
            {"role": _content(m.get("role")), "content": _content(m.get("content"))} for m in turns
        ]
    except RecursionError:
        raise ExportError(
            f"rollout {rid}: metadata {field!r} is JSON nested too deeply to read as chat "
            "messages; fix or leave out that row (--where)"
        ) from None


def _null_text(shape: str, rid: str, field: str) -> ExportError:
    return ExportError(
        f"rollout {rid}: {field} is null; --as {shape} writes the text of every row it picks "
        f"(--as messages refuses such rows too): leave them out with --where '{field} IS NOT "
        "NULL', or export only token ids (--columns without the text columns, or --as rollouts)"
    )


def text_batch(b: pa.RecordBatch, schema: pa.Schema, shape: ExportShape) -> pa.RecordBatch:
    """Standard (text) rows: the output columns of ``schema``; a null prompt or completion
    text is refused, naming its rollout."""
    for name in schema.names:
        if name in TEXT_SOURCES and b.column(name).null_count:
            first = b.column(name).is_null().to_pylist().index(True)
            raise _null_text(shape, b.column(IDS[name])[first].as_py(), TEXT_SOURCES[name])
    return b.select(schema.names)


def _chat_prompt(r: dict[str, Any], shape: ExportShape) -> list[dict[str, str]]:
    rid = r[IDS["prompt"]]
    prompt = chat_messages(r[TURNS], rid, "messages")
    if prompt is not None:
        return prompt
    if r[PROMPT_TEXT] is None:
        raise ExportError(
            f"rollout {rid}: no prompt_text and no prompt messages in its metadata; "
            f"--as {shape} needs one of them (as --as messages does)"
        )
    return [{"role": "user", "content": r[PROMPT_TEXT]}]


def _chat_completion(r: dict[str, Any], side: str, shape: ExportShape) -> list[dict[str, str]]:
    own = chat_messages(r[DONE[side]], r[IDS[side]], "completion_messages")
    if own is not None:
        return own
    if r[side] is None:
        raise _null_text(shape, r[IDS[side]], "completion_text")
    return [{"role": "assistant", "content": r[side]}]


def chat_batch(b: pa.RecordBatch, schema: pa.Schema, shape: ExportShape) -> pa.RecordBatch:
    """Text columns as turns: prompt = the stored turns (else one user turn holding
    prompt_text), a completion = its trajectory's messages when the row keeps them, else one
    assistant turn holding completion_text: the rules of ``--as messages``
    (:func:`chat_messages`); a row without that text is refused, naming the rollout."""
    out: dict[str, list] = {name: [] for name in schema.names}
    for r in b.to_pylist():
        prompt = _chat_prompt(r, shape)
        for name in schema.names:
            if name == "prompt":
                out[name].append(prompt)
            elif name in DONE:
                out[name].append(_chat_completion(r, name, shape))
            elif name == "messages":
                out[name].append([*prompt, *_chat_completion(r, "completion", shape)])
            else:
                out[name].append(r[name])
    return pa.RecordBatch.from_pydict(out, schema=schema)


def refuse_trajectories(
    store: RolloutLog, shape: ExportShape, chat: bool, where: str | None, params, timeout
) -> None:
    """SFT / DPO text holds a completion as one assistant message: a multi-turn trajectory
    fits only when its own messages are kept (chat rows ingested with them); any other is
    refused, naming one, rather than exported with its tool tokens as the model's."""
    filt = f"AND ({where})" if where is not None else ""
    kept = "json_type(metadata, '$.completion_messages') = 'ARRAY'" if chat else "false"
    n, rid = first_row(
        store,
        f"SELECT count(*), min(rollout_id) FROM rollouts WHERE num_turns > 1 "
        f"AND NOT ({kept}) {filt}",
        params,
        timeout,
    )
    if n:
        raise ExportError(
            f"--as {shape}: {n} selected row(s) are multi-turn trajectories whose turns have no "
            f"messages of their own (e.g. rollout {rid}); as one {shape} completion their tool "
            "tokens would count as the model's. Use --as messages (one message per turn) or "
            "--as rollouts (keeps loss_mask), or leave them out with --where 'num_turns = 1'"
        )


@dataclass(frozen=True)
class ShapedQuery:
    """The rows of one export: the query (and its row count), its arguments (the where's
    params, then the shape's threshold), the output schema, whether rows are chat turns,
    and a transform of each query batch into output rows (None: the query's rows as is)."""

    shape: ExportShape
    query: str
    count_query: str
    args: list[Any]
    schema: pa.Schema
    chat: bool
    transform: Callable[[pa.RecordBatch], pa.RecordBatch] | None = None


def shape_query(
    store: RolloutLog,
    as_: ExportShape,
    columns: Sequence[str] | None,
    where: str | None,
    params: Sequence[Any] | None,
    min_reward: float | None,
    min_margin: float | None,
    timeout: float | None,
    keep_duplicates: bool = False,
) -> ShapedQuery:
    """The query and output schema of shape ``as_`` over the rows ``where`` keeps (checked
    already); ``columns`` are checked against the shape's (``messages`` needs chat rows)."""
    allowed = {
        "rollouts": store.schema.names,
        "sft": [*SFT_COLUMNS, "messages"],
        "dpo": list(DPO_COLUMNS),
    }
    cols = check_columns(columns, allowed[as_], as_)
    chat, token_only = (False, False)
    if as_ != "rollouts":
        chat, token_only = row_kinds(store, where, params, timeout)
    if as_ in ("sft", "dpo"):
        refuse_trajectories(store, as_, chat, where, params, timeout)
    if as_ == "sft" and columns is None:  # messages only for conversational rows
        cols.remove("messages")
        if chat:
            cols.insert(2, "messages")
    if columns is None and token_only and not chat:  # text columns only for rows with text
        cols = [c for c in cols if c not in TEXT_SOURCES]
    if "messages" in cols and not chat:
        raise ExportError(
            "--columns messages needs conversational rows (metadata with the prompt's "
            '"messages", as `ingest --from trl|openai` writes for chat prompts); found rows '
            "without them"
        )
    schema = output_schema(store.schema, as_, cols, chat)
    query, count_query = build_query(as_, cols, where, min_reward, chat, keep_duplicates)
    args = list(params or [])
    if as_ == "sft":
        args.append(SFT_FLOOR if min_reward is None else min_reward)
    elif as_ == "dpo":
        args.append(min_margin)
    shape = chat_batch if chat else text_batch
    return ShapedQuery(
        as_, query, count_query, args, schema, chat, transform=lambda b: shape(b, schema, as_)
    )
