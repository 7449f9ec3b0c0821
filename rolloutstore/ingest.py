"""Read rollout files (JSONL, JSONL.zst, Parquet) into a store, one atomic append per file.

A file is streamed in chunks; each chunk is validated and written as uncommitted
Lance fragments, and the file commits once at the end. A bad row anywhere in the
file raises :class:`IngestError` naming ``file:line`` (or the Parquet row) and the
field, and nothing of that file is committed.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import IngestError, ValidationError
from .store import AppendResult, RolloutStore

CHUNK_ROWS = 4096


@dataclass(frozen=True)
class IngestResult:
    path: str
    rows: int
    version: int


def _format(path: str) -> str:
    p = path.lower()
    if p.endswith((".jsonl.zst", ".json.zst", ".ndjson.zst")):
        return "jsonl.zst"
    if p.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if p.endswith((".parquet", ".pq")):
        return "parquet"
    raise ValueError(f"{path}: unknown format; expected .jsonl, .jsonl.zst or .parquet")


def _open_text(path: str, fmt: str) -> io.TextIOBase:
    if fmt == "jsonl.zst":
        import zstandard

        raw = open(path, "rb")  # noqa: SIM115 - closed by the TextIOWrapper
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115


def _jsonl_chunks(
    path: str, fmt: str, lines: list[int], rename: Mapping[str, str], on_bytes: Callable
) -> Iterator[list[dict]]:
    chunk: list[dict] = []
    with _open_text(path, fmt) as f:
        for lineno, line in enumerate(f, start=1):
            on_bytes(len(line))
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise IngestError(
                    path, str(lineno), ValidationError(f"invalid JSON: {exc}")
                ) from exc
            if not isinstance(row, dict):
                raise IngestError(path, str(lineno), ValidationError("expected a JSON object"))
            if rename:
                row = {rename.get(k, k): v for k, v in row.items()}
            chunk.append(row)
            lines.append(lineno)
            if len(chunk) >= CHUNK_ROWS:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _parquet_chunks(path: str, rename: Mapping[str, str], on_bytes: Callable) -> Iterator[pa.Table]:
    pf = pq.ParquetFile(path)
    for batch in pf.iter_batches(batch_size=CHUNK_ROWS):
        on_bytes(batch.nbytes)
        t = pa.Table.from_batches([batch])
        if rename:
            t = t.rename_columns([rename.get(n, n) for n in t.column_names])
        yield t


def ingest_file(
    store: RolloutStore,
    path: str | os.PathLike,
    *,
    rename: Mapping[str, str] | None = None,
    progress: bool = True,
) -> IngestResult:
    """Append every row of one file atomically; see the module docstring."""
    from tqdm.auto import tqdm

    path = os.fspath(path)
    fmt = _format(path)
    rename = dict(rename or {})
    size = os.path.getsize(path)
    lines: list[int] = []
    with tqdm(
        total=size if fmt == "jsonl" else None,
        unit="B",
        unit_scale=True,
        desc=os.path.basename(path),
        disable=not progress,
        leave=False,
    ) as bar:
        chunks = (
            _parquet_chunks(path, rename, bar.update)
            if fmt == "parquet"
            else _jsonl_chunks(path, fmt, lines, rename, bar.update)
        )
        try:
            result: AppendResult = store.append(chunks)
        except IngestError:
            raise
        except ValidationError as exc:
            if exc.row is None:
                where = "?"
            elif fmt == "parquet":
                where = f"row {exc.row}"
            else:
                where = str(lines[exc.row])
            raise IngestError(path, where, exc) from exc
    return IngestResult(path, result.rows, result.version)
