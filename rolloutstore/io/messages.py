"""The ``messages`` export shape: each rollout as one conversation in the OpenAI / TRL
conversational format, a ``messages`` column of ``{"role", "content"}`` turns, plus its reward.

    rolloutstore export STORE out/chats.jsonl --as messages [--tokenizer DIR]

A conversation is the prompt's turns, then one message per completion turn:

- **prompt**: the prompt's chat messages when the row keeps them (``metadata.messages``, as
  ``ingest --from trl|openai`` writes), else one user turn holding ``prompt_text``;
- **completion**: the turns' messages when the row keeps them (``metadata.completion_messages``,
  as ``ingest --from openai`` writes for multi-turn chats); else a single-turn row is one
  message holding ``completion_text``; else (a multi-turn trajectory, whose text the store
  keeps only for the whole completion) each turn's token ids ``completion_ids[start:end]``
  decoded with ``tokenizer`` (``skip_special_tokens=True``). Without a tokenizer such a row
  is refused, naming it and ``--tokenizer``: token offsets do not map to character offsets
  of ``completion_text`` without one.

Stored messages count when they are a non-empty list of objects; a role or content that is
not text is written as its JSON text (null as empty), and any other value is no messages
(:func:`rolloutstore.io.shapes.chat_messages`, the rule ``--as sft|dpo`` follow too). A
``--tokenizer`` folder transformers cannot load is refused in one line naming it.

Roles are the turns' (``assistant``, ``tool``, ``user``, ``system``). The file loads with
``datasets.load_dataset("json" | "parquet", ...)`` and TRL's trainers read ``messages``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from rolloutstore.errors import ExportError, MissingDependencyError
from rolloutstore.io.shapes import MESSAGE, ShapedQuery, chat_messages, check_columns, quote

if TYPE_CHECKING:
    from rolloutstore.store.log import RolloutLog

MESSAGES_COLUMNS = ("messages", "reward", "rollout_id", "prompt_id", "num_turns")
# The query's extra columns the conversation is built from (dropped from the output).
_SOURCES = {
    "__id": "rollout_id",
    "__prompt_text": "prompt_text",
    "__completion_text": "completion_text",
    "__turns": "turns",
    "__prompt_messages": "json_extract(metadata, '$.messages')::VARCHAR",
    "__completion_messages": "json_extract(metadata, '$.completion_messages')::VARCHAR",
}

Decode = Callable[[list[int]], str]


def tokenizer_decoder(path: str | os.PathLike) -> Decode:
    """``ids -> text`` with the tokenizer in folder ``path`` (special tokens skipped)."""
    if not os.path.isdir(path):
        raise ExportError(f"--tokenizer {os.fspath(path)}: no such folder")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise MissingDependencyError(
            "--tokenizer needs the `transformers` package; pip install transformers"
        ) from exc
    try:
        tok = AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    except Exception as exc:  # transformers raises whatever its file parsers raise
        raise ExportError(
            f"--tokenizer {os.fspath(path)}: not a tokenizer folder transformers can load "
            f"({type(exc).__name__}: {_first_line(exc)}); pass the folder holding the "
            "tokenizer (tokenizer.json, tokenizer_config.json) that produced the token ids"
        ) from exc
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def conversation(r: dict[str, Any], decode: Decode | None) -> list[dict[str, str]]:
    """The messages of one query row (with the ``_SOURCES`` columns); see the module doc."""
    rid = r["__id"]
    prompt = chat_messages(r["__prompt_messages"], rid, "messages")
    if prompt is None:
        if r["__prompt_text"] is None:
            raise ExportError(
                f"rollout {rid}: no prompt_text and no prompt messages in its metadata; "
                "--as messages needs one of them"
            )
        prompt = [{"role": "user", "content": r["__prompt_text"]}]
    done = chat_messages(r["__completion_messages"], rid, "completion_messages")
    if done is not None:
        return prompt + done
    turns = r["__turns"] or [{"role": "assistant", "start": 0, "end": None}]
    if len(turns) == 1 and r["__completion_text"] is not None:
        return prompt + [{"role": turns[0]["role"], "content": r["__completion_text"]}]
    if decode is None:
        what = (
            f"a multi-turn trajectory ({len(turns)} turns) whose text the store keeps only for "
            "the whole completion (completion_text), not per turn"
            if len(turns) > 1
            else "a row without completion_text"
        )
        raise ExportError(
            f"rollout {rid}: {what}; only its token ids give each turn's text: pass "
            "--tokenizer DIR (the tokenizer that produced them) to decode them"
        )
    ids = r["__completion_ids"]
    try:
        return prompt + [
            {"role": t["role"], "content": decode(ids[t["start"] : t["end"]])} for t in turns
        ]
    except Exception as exc:  # the tokenizer's own error on ids it does not know
        raise ExportError(
            f"rollout {rid}: --tokenizer cannot decode its completion_ids "
            f"({type(exc).__name__}: {_first_line(exc)}); pass the tokenizer that produced them"
        ) from exc


def messages_batch(b: pa.RecordBatch, schema: pa.Schema, decode: Decode | None) -> pa.RecordBatch:
    """Query rows -> output rows of ``schema`` (the conversation built per row)."""
    out: dict[str, list] = {name: [] for name in schema.names}
    for r in b.to_pylist():
        for name in schema.names:
            out[name].append(conversation(r, decode) if name == "messages" else r[name])
    return pa.RecordBatch.from_pydict(out, schema=schema)


def messages_query(
    store: RolloutLog,
    columns: Sequence[str] | None,
    where: str | None,
    params: Sequence[Any] | None,
    tokenizer: str | os.PathLike | None,
) -> ShapedQuery:
    """The ``messages`` shape's query, output schema and row transform."""
    cols = check_columns(columns, list(MESSAGES_COLUMNS), "messages")
    decode = tokenizer_decoder(tokenizer) if tokenizer is not None else None
    fields = [
        pa.field("messages", pa.list_(MESSAGE))
        if c == "messages"
        else store.schema.field(c).with_nullable(True)
        for c in cols
    ]
    meta = {**(store.schema.metadata or {}), b"rolloutstore.export": b"messages"}
    schema = pa.schema(fields, metadata=meta)
    sources = dict(_SOURCES, **({"__completion_ids": "completion_ids"} if decode else {}))
    select = [quote(c) for c in cols if c != "messages"]
    select += [f"{expr} AS {quote(name)}" for name, expr in sources.items()]
    filt = f"WHERE ({where})" if where is not None else ""
    return ShapedQuery(
        "messages",
        f"SELECT {', '.join(select)} FROM rollouts {filt}",
        f"SELECT count(*) FROM rollouts {filt}",
        list(params or []),
        schema,
        False,
        transform=lambda b: messages_batch(b, schema, decode),
    )
