"""Export a store's rollouts (or SFT / DPO datasets derived from them) to files, streaming.

    from rolloutstore import RolloutStore
    store = RolloutStore.open("runs/demo/store")
    store.export("out/rollouts.parquet")                                  # every row, zstd Parquet
    store.export("out/r.jsonl.zst", format="jsonl.zst", where="reward > ?", params=[0.5])
    store.export("out/sft.parquet", as_="sft")                            # best completions
    store.export("out/dpo_hf", format="hf", as_="dpo", min_margin=1.0)    # datasets.load_from_disk

Rows are read as Arrow record batches from the store's locked-down DuckDB
connection and written batch by batch, so memory stays bounded by one batch
(``sft``/``dpo`` also sort their output by key inside DuckDB, which spills to
disk when it must). A file is written under a temporary name and renamed when
complete: a failed export leaves no partial file.

Shapes (``as_``):

``rollouts``
    schema-v1 rows (all columns, or ``columns``), in store order. Every format
    reads back with ``rolloutstore ingest`` losslessly (JSON carries ``created_at``
    as ISO-8601 with ``+00:00``, lists as JSON arrays, float32 values as the
    shortest decimal of their exact double value).
``sft`` and ``dpo`` use TRL's dataset column names (``prompt``/``completion``,
``prompt``/``chosen``/``rejected``); when every row is conversational (metadata holds
the prompt's ``messages``, as ``ingest --from trl|openai`` writes) those columns are lists
of ``{"role", "content"}`` turns and ``sft`` adds ``messages`` (prompt turns + completion).

``sft``
    per ``prompt_id``, the completions with the highest reward (ties all kept);
    with ``min_reward`` instead every completion with ``reward >= min_reward``.
    Unscored rows (reward null) are skipped. Sorted by prompt_id, rollout_id.
``dpo``
    one pair per ``group_id``: chosen = highest reward, rejected = lowest reward
    (ties broken by the smallest rollout_id), kept when
    ``chosen_reward - rejected_reward >= min_margin`` (default 0.5). Groups with
    fewer than two scored rows give no pair. Sorted by group_id.

``where`` is a filter only, applied to ``rollouts`` before shaping: it runs as
``... FROM rollouts WHERE (<where>)`` with ``params`` bound to its ``?``
placeholders, and must be one boolean expression over the store's columns
(:func:`rolloutstore.sql.check_where`). ``timeout`` (seconds) interrupts a query
that runs longer. ``out`` may not lie inside a store folder (:func:`check_output_path`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import ExportError, MissingDependencyError, OutputPathError, QueryError
from .sql import check_where, limits

__all__ = [
    "ExportError",
    "ExportResult",
    "MissingDependencyError",
    "check_output_path",
    "check_where",
    "export",
    "infer_format",
]

if TYPE_CHECKING:
    from .store import RolloutStore

ExportFormat = Literal["parquet", "jsonl", "jsonl.zst", "hf"]
ExportShape = Literal["rollouts", "sft", "dpo"]

FORMATS: tuple[str, ...] = get_args(ExportFormat)
SHAPES: tuple[str, ...] = get_args(ExportShape)
DEFAULT_MIN_MARGIN = 0.5
BATCH_ROWS = 4096

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
_TURNS = "__turns"  # the query's extra column: metadata's "messages" as JSON text


@dataclass(frozen=True)
class ExportResult:
    rows: int
    path: str


# -- outputs -------------------------------------------------------------------------------
def check_output_path(path: str | os.PathLike, *, what: str = "output") -> str:
    """Refuse an output path inside a store or Lance dataset folder (symlinks resolved).

    Writing there (a manifest, a data file, the store folder itself) would corrupt
    the store, so ``export`` and ``sql --out`` refuse it with OutputPathError.
    """
    raw = os.fspath(path)
    if "://" in raw:
        return raw
    real = Path(os.path.realpath(raw))
    for folder in (real, *real.parents):
        if folder.name.endswith(".lance") or (folder / "rollouts.lance").is_dir():
            kind = "Lance dataset" if folder.name.endswith(".lance") else "store"
            raise OutputPathError(
                f"refusing to write the {what} {raw!r}: it lies inside the {kind} folder "
                f"{str(folder)!r} (resolved: {str(real)!r}) and would corrupt it; "
                "write it outside every store folder"
            )
    return raw


def _remove_stale_temps(parent: str, name: str) -> None:
    """Temp outputs (``.NAME.tmp-PID``) of exports whose process is gone (e.g. killed)."""
    prefix = f".{name}.tmp-"
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        if not entry.startswith(prefix) or not entry[len(prefix) :].isdigit():
            continue
        pid = int(entry[len(prefix) :])
        try:
            os.kill(pid, 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except OSError:
            continue
        stale = os.path.join(parent, entry)
        if os.path.isdir(stale):
            shutil.rmtree(stale, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(stale)


# -- queries ---------------------------------------------------------------------------------
def _quote(name: str) -> str:
    # Only ever called with names from the store schema or our fixed output columns.
    return '"' + name.replace('"', '""') + '"'


def _check_columns(columns: Sequence[str] | None, allowed: Sequence[str], shape: str) -> list[str]:
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


def _output_schema(
    store_schema: pa.Schema, shape: ExportShape, cols: list[str], chat: bool = False
) -> pa.Schema:
    if chat:
        fields = [
            pa.field(c, pa.list_(MESSAGE))
            if c in CHAT_COLUMNS
            else _output_schema(store_schema, shape, [c]).field(c)
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


def _build_query(
    shape: ExportShape,
    cols: list[str],
    where: str | None,
    min_reward: float | None,
    chat: bool = False,
) -> tuple[str, str]:
    """(query, count_query); both take the where's params first, then the shape's."""
    filt = f"WHERE ({where})" if where is not None else ""
    base = f"SELECT * FROM rollouts {filt}"
    if shape == "rollouts":
        select = ", ".join(_quote(c) for c in cols)
        return (
            f"SELECT {select} FROM rollouts {filt}",
            f"SELECT count(*) FROM rollouts {filt}",
        )
    turns = f", json_extract(r.metadata, '$.messages')::VARCHAR AS {_TURNS}" if chat else ""
    if shape == "sft":
        select = ", ".join(
            f"r.{_quote(SFT_COLUMNS[c])} AS {_quote(c)}" for c in cols if c != "messages"
        )
        if chat and "messages" in cols and "completion" not in cols:
            select += (", " if select else "") + 'r."completion_text" AS "completion"'
        select += turns
        if min_reward is None:
            body = (
                f"WITH r AS ({base}), "
                "best AS (SELECT prompt_id, max(reward) AS top FROM r "
                "WHERE reward IS NOT NULL GROUP BY prompt_id) "
                f"SELECT {select} FROM r JOIN best ON r.prompt_id = best.prompt_id "
                "AND r.reward = best.top"
            )
        else:
            body = f"WITH r AS ({base}) SELECT {select} FROM r WHERE r.reward >= ?"
        return body + " ORDER BY r.prompt_id, r.rollout_id", f"SELECT count(*) FROM ({body})"
    select = ", ".join(
        f"{side}.{_quote(src)} AS {_quote(name)}"
        for name, (side, src) in DPO_COLUMNS.items()
        if name in cols
    ) + turns.replace("r.metadata", "c.metadata")
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


def _check_number(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ExportError(f"{name} must be a finite number, found {value!r}")
    return float(value)


# -- writers ---------------------------------------------------------------------------------
def _json_default(v: Any) -> Any:
    if isinstance(v, datetime):
        return v.isoformat()  # tz-aware UTC: '...+00:00', parsed back by ingest
    if isinstance(v, date):
        return v.isoformat()
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape")
    raise TypeError(f"cannot encode {type(v).__name__} as JSON")


def _write_parquet(batches: Iterator[pa.RecordBatch], schema: pa.Schema, path: str) -> None:
    with pq.ParquetWriter(path, schema, compression="zstd") as w:
        for b in batches:
            w.write_batch(b)


def _write_jsonl(
    batches: Iterator[pa.RecordBatch], schema: pa.Schema, path: str, zst: bool
) -> None:
    with open(path, "wb") as raw:
        if zst:
            import zstandard

            sink = zstandard.ZstdCompressor(level=6).stream_writer(raw, closefd=False)
        else:
            sink = raw
        try:
            for b in batches:
                lines = [
                    json.dumps(r, default=_json_default, ensure_ascii=False, allow_nan=False)
                    for r in b.to_pylist()
                ]
                if lines:
                    sink.write(("\n".join(lines) + "\n").encode("utf-8"))
        finally:
            if zst:
                sink.close()


def _import_datasets():
    try:
        import datasets
    except ImportError as exc:
        raise MissingDependencyError(
            "--format hf needs the Hugging Face `datasets` package, which is not installed; "
            "install it with `pip install 'rolloutstore[dev]'` or `pip install datasets`"
        ) from exc
    return datasets


def _write_hf(
    batches: Iterator[pa.RecordBatch], schema: pa.Schema, path: str, progress: bool
) -> None:
    datasets = _import_datasets()
    work = tempfile.mkdtemp(prefix=".export-", dir=os.path.dirname(path) or ".")
    try:
        shard = os.path.join(work, "data.parquet")
        _write_parquet(batches, schema, shard)
        was_disabled = datasets.are_progress_bars_disabled()
        if not progress:
            datasets.disable_progress_bars()
        try:
            ds = datasets.Dataset.from_parquet(shard, cache_dir=os.path.join(work, "cache"))
            ds.save_to_disk(path)
            del ds
        finally:
            if not progress and not was_disabled:
                datasets.enable_progress_bars()
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- entry point -----------------------------------------------------------------------------
def export(
    store: RolloutStore,
    out: str | os.PathLike,
    *,
    format: ExportFormat | None = None,
    where: str | None = None,
    params: Sequence[Any] | None = None,
    columns: Sequence[str] | None = None,
    as_: ExportShape = "rollouts",
    min_reward: float | None = None,
    min_margin: float | None = None,
    progress: bool = True,
    timeout: float | None = None,
) -> ExportResult:
    """Write ``store``'s rows (shaped by ``as_``) to ``out``; see the module docstring.

    ``format``: ``parquet`` (zstd), ``jsonl``, ``jsonl.zst``, or ``hf`` (a folder
    that ``datasets.load_from_disk`` opens); by default the one ``out``'s extension
    names (.parquet, .jsonl, .jsonl.zst), else ``parquet``. A format that contradicts
    the extension is refused. ``min_reward`` applies to ``sft`` only,
    ``min_margin`` (default 0.5) to ``dpo`` only. Returns the rows written and the path.
    """
    from tqdm.auto import tqdm

    path = check_output_path(out, what="export output")
    implied = _implied_format(path)
    if format is None:
        format = implied or "parquet"
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}; expected one of {', '.join(FORMATS)}")
    if implied is not None and implied != format:
        raise ExportError(
            f"{path!r} names a {implied} file but format is {format!r}; "
            "make the extension match or drop one of them"
        )
    if as_ not in SHAPES:
        raise ExportError(f"unknown --as {as_!r}; expected one of {', '.join(SHAPES)}")
    min_reward = _check_number("min_reward", min_reward)
    min_margin = _check_number("min_margin", min_margin)
    if min_reward is not None and as_ != "sft":
        raise ExportError(f"--min-reward applies to --as sft only, found --as {as_}")
    if min_margin is not None and as_ != "dpo":
        raise ExportError(f"--min-margin applies to --as dpo only, found --as {as_}")
    if min_margin is not None and min_margin < 0:
        raise ExportError(f"--min-margin must be >= 0, found {min_margin}")
    if as_ == "dpo" and min_margin is None:
        min_margin = DEFAULT_MIN_MARGIN
    if where is not None:
        where = check_where(where, store.schema.names, n_params=len(params or []))
    elif params:
        raise QueryError(f"{len(params)} params given but no --where to bind them to")

    allowed = {
        "rollouts": store.schema.names,
        "sft": [*SFT_COLUMNS, "messages"],
        "dpo": list(DPO_COLUMNS),
    }
    cols = _check_columns(columns, allowed[as_], as_)
    chat = as_ != "rollouts" and _all_chat(store, where, params, timeout)
    if as_ == "sft" and columns is None:  # messages only for conversational rows
        cols.remove("messages")
        if chat:
            cols.insert(2, "messages")
    if "messages" in cols and not chat:
        raise ExportError(
            "--columns messages needs conversational rows (metadata with the prompt's "
            '"messages", as `ingest --from trl|openai` writes for chat prompts); found rows '
            "without them"
        )
    schema = _output_schema(store.schema, as_, cols, chat)
    query, count_query = _build_query(as_, cols, where, min_reward, chat)
    args = list(params or [])
    if as_ == "sft" and min_reward is not None:
        args.append(min_reward)
    elif as_ == "dpo":
        args.append(min_margin)

    if format == "hf" and os.path.isdir(path) and os.listdir(path):
        raise ExportError(
            f"{path} exists and is not empty; expected a new folder for --format hf "
            "(remove it or choose another OUT)"
        )
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)

    _remove_stale_temps(parent, Path(path).name)

    con = store.connect()
    tmp = os.path.join(parent, f".{Path(path).name}.tmp-{os.getpid()}")
    rows = 0
    bar = None
    try:
        # One deadline for the count and the whole stream.
        with limits(con, timeout):
            total = con.sql(count_query, params=args or None).fetchall()[0][0]
            reader = con.sql(query, params=args or None).to_arrow_reader(BATCH_ROWS)
            bar = tqdm(total=total, unit="rows", desc=f"export {as_}", disable=not progress,
                       leave=False)  # fmt: skip

            def batches() -> Iterator[pa.RecordBatch]:
                nonlocal rows
                for b in reader:
                    if b.num_rows == 0:
                        continue
                    if chat:
                        b = _chat_batch(b, schema, as_)
                    b = pa.Table.from_batches([b]).rename_columns(schema.names).cast(schema)
                    for part in b.to_batches():
                        rows += part.num_rows
                        bar.update(part.num_rows)
                        yield part

            if format == "parquet":
                _write_parquet(batches(), schema, tmp)
            elif format == "hf":
                _write_hf(batches(), schema, tmp, progress)
            else:
                _write_jsonl(batches(), schema, tmp, zst=format == "jsonl.zst")
            if format == "hf" and os.path.isdir(path):
                os.rmdir(path)  # empty (checked above)
            os.replace(tmp, path)
    except duckdb.Error as exc:
        raise QueryError(f"export query failed: {type(exc).__name__}: {exc}") from exc
    finally:  # also on KeyboardInterrupt / SystemExit: no partial or hidden temp output
        if bar is not None:
            bar.close()
        con.close()
        _remove(tmp)
    return ExportResult(rows, path)


def _all_chat(store: RolloutStore, where: str | None, params, timeout: float | None) -> bool:
    """Whether every (filtered) row is conversational: its metadata holds prompt turns."""
    filt = f"WHERE ({where})" if where is not None else ""
    con = store.connect()
    try:
        with limits(con, timeout):
            n, chat = con.sql(
                "SELECT count(*), count(*) FILTER "
                f"(WHERE json_type(metadata, '$.messages') = 'ARRAY') FROM rollouts {filt}",
                params=list(params or []) or None,
            ).fetchall()[0]
    except duckdb.Error as exc:
        raise QueryError(f"export query failed: {type(exc).__name__}: {exc}") from exc
    finally:
        con.close()
    return n > 0 and n == chat


def _chat_batch(b: pa.RecordBatch, schema: pa.Schema, shape: ExportShape) -> pa.RecordBatch:
    """Text columns as turns: prompt = the stored turns, completions = one assistant turn."""
    rows = b.to_pylist()
    out: dict[str, list] = {name: [] for name in schema.names}
    for r in rows:
        turns = [{"role": m.get("role"), "content": m.get("content")}
                 for m in json.loads(r.pop(_TURNS))]  # fmt: skip
        for name in schema.names:
            if name == "prompt":
                out[name].append(turns)
            elif name in ("completion", "chosen", "rejected"):
                out[name].append([{"role": "assistant", "content": r[name]}])
            elif name == "messages":
                out[name].append([*turns, {"role": "assistant", "content": r["completion"]}])
            else:
                out[name].append(r[name])
    return pa.RecordBatch.from_pydict(out, schema=schema)


def _remove(tmp: str) -> None:
    if os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    elif os.path.exists(tmp):
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _implied_format(path: str) -> ExportFormat | None:
    p = path.lower()
    if p.endswith((".jsonl.zst", ".ndjson.zst")):
        return "jsonl.zst"
    if p.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if p.endswith((".parquet", ".pq")):
        return "parquet"
    return None


def infer_format(path: str) -> ExportFormat:
    """The format implied by ``path``'s extension (for the CLI when --format is absent)."""
    fmt = _implied_format(path)
    if fmt is not None:
        return fmt
    raise ExportError(
        f"cannot tell the format of {path!r} from its extension; expected .parquet, .jsonl or "
        ".jsonl.zst, or pass --format parquet|jsonl|jsonl.zst|hf"
    )
