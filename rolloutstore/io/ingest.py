"""Read rollout files (JSONL, JSONL.zst, Parquet) into a store, one atomic append per file.

A file is streamed in chunks; each chunk is validated and written as uncommitted
Lance fragments, and the file commits once at the end. A bad row anywhere in the
file raises :class:`IngestError` naming ``file:line`` (or the Parquet row) and the
field, and nothing of that file is committed. A file that cannot be read to its end
(truncated or corrupt zstd/Parquet, invalid UTF-8, not a file, unknown extension)
raises :class:`FileUnreadableError`: a file commits only once its last byte was read.

    rolloutstore ingest STORE a.jsonl b.jsonl.zst c.parquet [--on-duplicate skip]
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from rolloutstore.errors import FileUnreadableError, IngestError, ValidationError
from rolloutstore.store.log import AppendResult, OnDuplicate, RolloutLog

if TYPE_CHECKING:
    from rolloutstore.io.interop import TextImporter

CHUNK_ROWS = 4096
READ_BYTES = 1 << 20
FORMATS = ".jsonl, .json, .ndjson (optionally .zst) or .parquet, .pq"


@dataclass(frozen=True)
class IngestResult:
    path: str
    rows: int
    version: int
    skipped: int = 0  # rows left out as duplicates (on_duplicate="skip")


def _format(path: str) -> str:
    p = path.lower()
    if p.endswith((".jsonl.zst", ".json.zst", ".ndjson.zst")):
        return "jsonl.zst"
    if p.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if p.endswith((".parquet", ".pq")):
        return "parquet"
    raise FileUnreadableError(
        path, f"a file named {FORMATS}", "an unknown extension", "rename it or convert it"
    )


def check_file(path: str) -> str:
    """The file's format; refuses a missing path, a directory or an unknown extension."""
    if os.path.isdir(path):
        raise FileUnreadableError(path, "a file", "a directory", "pass the files inside it")
    if not os.path.isfile(path):
        raise FileUnreadableError(path, "a file", "nothing at that path", "check the path")
    fmt = _format(path)
    try:
        open(path, "rb").close()  # checked now, not after a scoring model has loaded
    except OSError as exc:
        raise FileUnreadableError(
            path, "a readable file", f"one that cannot be opened ({exc.strerror})",
            "check its permissions",
        ) from exc  # fmt: skip
    return fmt


def _zstd_bytes(path: str) -> Iterator[bytes]:
    """Decompressed bytes of every zstd frame in ``path``; refuses a stream cut short."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    obj, fed, total = dctx.decompressobj(), False, 0
    with open(path, "rb") as f:
        while raw := f.read(READ_BYTES):
            total += len(raw)
            while raw:
                try:
                    out = obj.decompress(raw)
                except zstandard.ZstdError as exc:
                    raise FileUnreadableError(
                        path,
                        "zstd-compressed JSONL",
                        f"data that is not zstd ({exc})",
                        "compress it with `zstd` or drop the .zst suffix",
                    ) from exc
                fed = True
                if out:
                    yield out
                if obj.eof:  # a frame ended; another may follow (concatenated frames)
                    raw, obj, fed = obj.unused_data, dctx.decompressobj(), False
                else:
                    raw = b""
    if total == 0 or fed:
        found = "an empty file" if total == 0 else f"a zstd stream cut short after {total} bytes"
        raise FileUnreadableError(
            path, "a complete zstd stream", found, "re-copy or re-export the file"
        )


def _plain_bytes(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while raw := f.read(READ_BYTES):
            yield raw


def _lines(path: str, fmt: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line, decoded strictly as UTF-8."""
    rest, lineno = b"", 0
    source = _zstd_bytes(path) if fmt == "jsonl.zst" else _plain_bytes(path)
    for block in source:
        parts = (rest + block).split(b"\n")
        rest = parts.pop()
        for raw in parts:
            lineno += 1
            yield lineno, _decode(path, lineno, raw)
    if rest:
        yield lineno + 1, _decode(path, lineno + 1, rest)


def _decode(path: str, lineno: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IngestError(
            path,
            str(lineno),
            ValidationError(
                f"expected UTF-8 text, found byte {raw[exc.start]:#04x} at column {exc.start + 1}"
                " (invalid UTF-8); re-encode the file as UTF-8"
            ),
        ) from exc


def _jsonl_chunks(
    path: str, fmt: str, lines: list[int], rename: Mapping[str, str], on_bytes: Callable
) -> Iterator[list[dict]]:
    chunk: list[dict] = []
    for lineno, line in _lines(path, fmt):
        on_bytes(len(line) + 1)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise IngestError(path, str(lineno), ValidationError(f"invalid JSON: {exc}")) from exc
        except RecursionError:
            why = "JSON nested too deeply to read (at most a few hundred levels)"
            raise IngestError(path, str(lineno), ValidationError(why)) from None
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
    def refuse(exc: Exception) -> FileUnreadableError:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return FileUnreadableError(
            path,
            "a complete Parquet file",
            f"one that cannot be read ({first})",
            "re-copy or re-export the file",
        )

    try:
        pf = pq.ParquetFile(path)
        expected = pf.metadata.num_rows
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # a damaged footer name
        raise refuse(exc) from exc
    batches, got = pf.iter_batches(batch_size=CHUNK_ROWS), 0
    while True:
        try:
            batch = next(batches, None)
            if batch is not None:
                # Full validation: a damaged string page may hold invalid UTF-8, which only a
                # later to_pylist() would trip over.
                batch.validate(full=True)
        except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
            raise refuse(exc) from exc
        if batch is None:
            break
        got += batch.num_rows
        on_bytes(batch.nbytes)
        t = pa.Table.from_batches([batch])
        if rename:
            t = t.rename_columns([rename.get(n, n) for n in t.column_names])
        yield t
    if got != expected:
        raise FileUnreadableError(
            path, f"{expected} rows (its footer)", f"{got}", "re-copy or re-export the file"
        )


def _dict_chunks(path: str, fmt: str, lines: list[int], rename, on_bytes) -> Iterator[list[dict]]:
    if fmt != "parquet":
        yield from _jsonl_chunks(path, fmt, lines, rename, on_bytes)
        return
    for t in _parquet_chunks(path, rename, on_bytes):
        yield t.to_pylist()


def _imported(chunks: Iterator[list[dict]], importer: TextImporter) -> Iterator[list[dict]]:
    start = 0
    for chunk in chunks:
        yield importer(chunk, start)
        start += len(chunk)


def _scoring_bar(path: str, importer: TextImporter, progress: bool):
    """A rows bar (rows/s) for a text import, told by the transformer after each scored batch
    (``on_scored``, when it has one): scoring is the slow part, chunks take minutes each."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(importer.group_ids), unit="rows", desc=f"scoring {os.path.basename(path)}",
        disable=not progress, leave=False,
    )  # fmt: skip
    if hasattr(importer.transformer, "on_scored"):
        importer.transformer.on_scored = bar.update
    return bar


def ingest_file(
    store: RolloutLog,
    path: str | os.PathLike,
    *,
    rename: Mapping[str, str] | None = None,
    progress: bool = True,
    on_duplicate: OnDuplicate = "error",
    importer: TextImporter | None = None,
) -> IngestResult:
    """Append every row of one file atomically; see the module docstring.

    ``on_duplicate="skip"`` leaves out rows whose rollout_id is already stored, so
    ingesting the same file twice is a no-op the second time. ``importer``
    (:class:`rolloutstore.io.interop.TextImporter`) reads another framework's text rows:
    the file is read once for its groups, then converted chunk by chunk.
    """
    from tqdm.auto import tqdm

    path = os.fspath(path)
    fmt = check_file(path)
    rename = dict(rename or {})
    lines: list[int] = []
    with tqdm(
        total=os.path.getsize(path) if fmt == "jsonl" else None,
        unit="B",
        unit_scale=True,
        desc=os.path.basename(path),
        disable=not progress or importer is not None,  # a text import has a rows bar instead
        leave=False,
    ) as bar:
        if importer is None:
            chunks = (
                _parquet_chunks(path, rename, bar.update)
                if fmt == "parquet"
                else _jsonl_chunks(path, fmt, lines, rename, bar.update)
            )
        else:
            chunks = _imported(_dict_chunks(path, fmt, [], rename, bar.update), importer)
        try:
            if importer is None:
                result: AppendResult = store.append(chunks, on_duplicate=on_duplicate)
            else:  # pass 1: groups, sample indices, advantages; pass 2 scores and appends
                rows = (
                    r for c in _dict_chunks(path, fmt, lines, rename, lambda n: None) for r in c
                )
                importer.scan(rows)
                with _scoring_bar(path, importer, progress):
                    result = store.append(chunks, on_duplicate=on_duplicate)
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
    return IngestResult(path, result.rows, result.version, result.skipped)


def ingest_files(
    uri: str | os.PathLike,
    paths: Sequence[str | os.PathLike],
    *,
    rename: Mapping[str, str] | None = None,
    progress: bool = True,
    on_duplicate: OnDuplicate = "error",
    on_result: Callable[[IngestResult], None] | None = None,
    importer: TextImporter | None = None,
) -> tuple[RolloutLog, list[IngestResult]]:
    """Ingest ``paths`` in order into the store at ``uri`` (created if missing), one commit
    per file. Every path is checked (a file, a known extension) before anything is
    created; a store this call created is removed again if no file committed."""
    for p in paths:
        check_file(os.fspath(p))
    uri = os.fspath(uri)
    local = "://" not in uri or uri.startswith("file://")
    folder = uri.removeprefix("file://")
    # What this call creates (the folder, or the datasets in an existing empty folder).
    created = [
        p
        for p in (
            folder,
            os.path.join(folder, "rollouts.lance"),
            os.path.join(folder, "usage.lance"),
        )
        if local and not os.path.exists(p)
    ]
    store = RolloutLog.open(uri, create=True)
    results: list[IngestResult] = []
    try:
        for p in paths:
            r = ingest_file(
                store,
                p,
                rename=rename,
                progress=progress,
                on_duplicate=on_duplicate,
                importer=importer,
            )
            results.append(r)
            if on_result is not None:
                on_result(r)
    except BaseException:
        if created and not any(r.rows for r in results) and store.count() == 0:
            for p in created[:1] if created[0] == folder else created:
                shutil.rmtree(p, ignore_errors=True)
        raise
    return store, results
