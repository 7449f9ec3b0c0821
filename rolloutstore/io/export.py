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
complete: a failed export (a full disk too: one OutputDiskFullError) leaves no partial file.

Shapes (``as_``):

``rollouts``
    schema-v1 rows (all columns, or ``columns``), in store order. Every format
    reads back with ``rolloutstore ingest`` losslessly (JSON carries ``created_at``
    as ISO-8601 with ``+00:00``, lists as JSON arrays, float32 values as the
    shortest decimal of their exact double value).
``sft`` and ``dpo`` use TRL's dataset column names (``prompt``/``completion``,
``prompt``/``chosen``/``rejected``); when every row is conversational (metadata holds
the prompt's ``messages``, as ``ingest --from trl|openai`` writes) those columns are lists
of ``{"role", "content"}`` turns and ``sft`` adds ``messages`` (prompt turns + completion),
read by the rule of ``messages`` (:func:`rolloutstore.io.shapes.chat_messages`). A row whose
text an output column needs is null (no prompt turns and no ``prompt_text``, no completion
turns and no ``completion_text``) is refused with :class:`ExportError` naming the rollout, as
``messages`` refuses it; nothing is written (not even the folder made for ``out``). Rows with
no text at all (token ids only, e.g. proxy rollouts) export without the text columns unless
``columns`` names them.

``sft``
    per ``prompt_id``, the completions with the highest reward (ties all kept) when that
    reward is above 0 (``SFT_FLOOR``: a best answer that scored 0 teaches nothing); with
    ``min_reward`` instead every completion with ``reward >= min_reward``. Unscored rows
    (reward null) are skipped; a (prompt, completion tokens) pair is kept once (the highest
    reward, then the smallest rollout_id) unless ``keep_duplicates``. Sorted by prompt_id,
    rollout_id.
``dpo``
    one pair per ``group_id``: chosen = highest reward, rejected = lowest reward
    (ties broken by the smallest rollout_id), kept when
    ``chosen_reward - rejected_reward >= min_margin`` (default 0.5). Groups with
    fewer than two scored rows give no pair. Sorted by group_id.

``messages``
    one conversation per rollout in the OpenAI / TRL conversational format (a ``messages``
    column of ``{"role", "content"}`` turns: the prompt's, then one per completion turn)
    plus ``reward``, ``rollout_id``, ``prompt_id``, ``num_turns``; multi-turn trajectories
    without stored per-turn text need ``tokenizer`` (:mod:`rolloutstore.export_messages`).
``rollouts`` keeps every column, ``loss_mask`` and ``turns`` included.

``where`` is a filter only, applied to ``rollouts`` before shaping: it runs as
``... FROM rollouts WHERE (<where>)`` with ``params`` bound to its ``?``
placeholders, and must be one boolean expression over the store's columns
(:func:`rolloutstore.query.sql.check_where`). ``timeout`` (seconds) interrupts a query
that runs longer. ``out`` may not lie inside a store folder; a device or FIFO there (e.g.
``/dev/stdout``) is written in place, never renamed over (:mod:`rolloutstore.io.outputs`).

This module checks the options and streams rows to files; the shapes' columns, output
schema and queries live in :mod:`rolloutstore.export_shapes`.
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
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, get_args

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from rolloutstore.errors import EmptyExportError, ExportError, MissingDependencyError, QueryError
from rolloutstore.io.outputs import (
    OutputTarget,
    check_output_path,
    open_output,
    output_folder,
    output_target,
    remove_stale_temps,
)
from rolloutstore.io.shapes import (
    DPO_COLUMNS,
    SFT_COLUMNS,
    ExportShape,
    ShapedQuery,
    empty_reason,
    first_row,
    shape_query,
)
from rolloutstore.query.limits import limits
from rolloutstore.query.sql import check_where

__all__ = [
    "DPO_COLUMNS",
    "SFT_COLUMNS",
    "EmptyExportError",
    "ExportError",
    "ExportResult",
    "MissingDependencyError",
    "check_where",
    "export",
    "infer_format",
]

if TYPE_CHECKING:
    from rolloutstore.store.log import RolloutLog

ExportFormat = Literal["parquet", "jsonl", "jsonl.zst", "hf"]

FORMATS: tuple[str, ...] = get_args(ExportFormat)
SHAPES: tuple[str, ...] = get_args(ExportShape)
DEFAULT_MIN_MARGIN = 0.5
BATCH_ROWS = 4096


@dataclass(frozen=True)
class ExportResult:
    rows: int
    path: str


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


def _write_parquet(
    batches: Iterator[pa.RecordBatch], schema: pa.Schema, sink: str | BinaryIO
) -> None:
    # A file object, not a path, for outputs: pyarrow removes a path it failed to write,
    # and a device written in place (/dev/full) must never be removed.
    with pq.ParquetWriter(sink, schema, compression="zstd") as w:
        for b in batches:
            w.write_batch(b)


def _write_jsonl(
    batches: Iterator[pa.RecordBatch], schema: pa.Schema, raw: BinaryIO, zst: bool
) -> None:
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
    store: RolloutLog,
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
    tokenizer: str | os.PathLike | None = None,
    keep_duplicates: bool = False,
) -> ExportResult:
    """Write ``store``'s rows (shaped by ``as_``) to ``out``; see the module docstring.

    ``format``: ``parquet`` (zstd), ``jsonl``, ``jsonl.zst``, or ``hf`` (a folder
    that ``datasets.load_from_disk`` opens); by default the one ``out``'s extension
    names (.parquet, .jsonl, .jsonl.zst), else ``parquet``. A format that contradicts
    the extension is refused. ``min_reward`` applies to ``sft`` only,
    ``min_margin`` (default 0.5) to ``dpo`` only, ``tokenizer`` (a tokenizer folder, to
    decode the turns of multi-turn rows) to ``messages`` only. ``sft`` drops repeated
    (prompt, completion tokens) pairs unless ``keep_duplicates``. Returns the rows written and
    the path. An export that would hold no row raises ``EmptyExportError`` (saying why) and
    writes nothing.
    """
    path = check_output_path(out, what="export output")
    format = _resolve_format(path, format)
    target = output_target(path, what="export output", folder=format == "hf")
    min_reward, min_margin = _check_shape_options(as_, min_reward, min_margin)
    if where is not None:
        where = check_where(where, store.schema.names, n_params=len(params or []))
    elif params:
        raise QueryError(f"{len(params)} params given but no --where to bind them to")
    if tokenizer is not None and as_ != "messages":
        raise ExportError(f"--tokenizer applies to --as messages only, found --as {as_}")
    if keep_duplicates and as_ != "sft":
        raise ExportError(f"--keep-duplicates applies to --as sft only, found --as {as_}")
    if as_ == "messages":
        from rolloutstore.io.messages import messages_query

        shaped = messages_query(store, columns, where, params, tokenizer)
    else:
        shaped = shape_query(
            store, as_, columns, where, params, min_reward, min_margin, timeout, keep_duplicates
        )
    if first_row(store, shaped.count_query, shaped.args, timeout)[0] == 0:
        raise EmptyExportError(
            empty_reason(store, as_, where, params, min_reward, min_margin, timeout)
        )
    created = _prepare_target(target, format)
    try:
        return ExportResult(_write(store, shaped, target, format, progress, timeout), path)
    except BaseException:  # a refused row or a failed query leaves no folder it made behind
        for folder in created:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise


def _resolve_format(path: str, format: ExportFormat | None) -> ExportFormat:
    """``format``, or the one ``path``'s extension implies (else parquet); a contradiction
    between the two is refused."""
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
    return format


def _check_shape_options(
    as_: str, min_reward: float | None, min_margin: float | None
) -> tuple[float | None, float | None]:
    """The shape and its thresholds checked; ``dpo``'s ``min_margin`` defaulted."""
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
    return min_reward, min_margin


def _prepare_target(target: OutputTarget, format: ExportFormat) -> list[str]:
    """Refuse a non-empty ``hf`` folder, create the parent folder and clear killed exports'
    temps there (nothing for a device or FIFO written in place); returns the folders created
    for it, deepest first."""
    path = target.path
    if format == "hf" and os.path.isdir(path) and os.listdir(path):
        raise ExportError(
            f"{target.given} exists and is not empty; expected a new folder for --format hf "
            "(remove it or choose another OUT)"
        )
    if target.in_place:
        return []
    parent = os.path.dirname(os.path.abspath(path))
    created, folder = [], parent
    while not os.path.exists(folder) and folder != os.path.dirname(folder):
        created.append(folder)
        folder = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    remove_stale_temps(path)
    return created


def _write(
    store: RolloutLog,
    plan: ShapedQuery,
    target: OutputTarget,
    format: ExportFormat,
    progress: bool,
    timeout: float | None,
) -> int:
    """Stream ``plan``'s rows to ``target`` (through a temp output renamed when complete,
    or in place: :mod:`rolloutstore.io.outputs`); returns the rows written."""
    from tqdm.auto import tqdm

    schema, args = plan.schema, plan.args
    con = store.connect()
    rows = 0
    bar = None
    try:
        # One deadline for the count and the whole stream.
        with limits(con, timeout):
            total = con.sql(plan.count_query, params=args or None).fetchall()[0][0]
            reader = con.sql(plan.query, params=args or None).to_arrow_reader(BATCH_ROWS)
            bar = tqdm(total=total, unit="rows", desc=f"export {plan.shape}",
                       disable=not progress, leave=False)  # fmt: skip

            def batches() -> Iterator[pa.RecordBatch]:
                nonlocal rows
                for b in reader:
                    if b.num_rows == 0:
                        continue
                    if plan.transform is not None:
                        b = plan.transform(b)
                    b = pa.Table.from_batches([b]).rename_columns(schema.names).cast(schema)
                    for part in b.to_batches():
                        rows += part.num_rows
                        bar.update(part.num_rows)
                        yield part

            if format == "hf":
                with output_folder(target) as tmp:
                    _write_hf(batches(), schema, tmp, progress)
            else:
                with open_output(target) as f:
                    if format == "parquet":
                        _write_parquet(batches(), schema, f)
                    else:
                        _write_jsonl(batches(), schema, f, zst=format == "jsonl.zst")
    except duckdb.Error as exc:
        raise QueryError(f"export query failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if bar is not None:
            bar.close()
        con.close()
    return rows


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
