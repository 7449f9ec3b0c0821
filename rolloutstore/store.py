"""``RolloutStore``: an append-only Lance log of rollouts, with DuckDB SQL over it.

Layout under the store URI (a local folder or any URI Lance accepts)::

    STORE/rollouts.lance   one row per completion (schema v1, compressed token columns)
    STORE/usage.lance      append-only (rollout_id, learner_step, run_id, at)
    STORE/rewards.lance    append-only re-scorings (rollout_id, reward_version, reward, ...)

Every append is one Lance commit: all rows of a batch become visible together or
not at all, and concurrent appenders from several processes are serialised by
Lance's commit protocol. A store object pickles as (URI, pinned version,
storage options) and reopens its datasets after a fork.

    from rolloutstore import RolloutStore
    store = RolloutStore.open("runs/demo/store")
    store.append([{"prompt_ids": [1, 2], "completion_ids": [3], "behavior_logprobs": [-0.1],
                   "policy_version": 0}])
    store.sql("SELECT policy_version, count(*) FROM rollouts GROUP BY 1")
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import lance
import numpy as np
import pyarrow as pa
from lance.fragment import write_fragments

from . import schema as S
from .errors import (
    CorruptStoreError,
    DiskFullError,
    ReadOnlyError,
    SchemaError,
    StoreNotFoundError,
    ValidationError,
)
from .gc import DEFAULT_MIN_AGE, GcResult, collect_dataset, collect_export_temps, merge
from .retention import RetentionConfig, RetentionReport
from .unique import IdCheck, OnDuplicate, gives_ids
from .validate import prepare

ROLLOUTS = "rollouts.lance"
USAGE = "usage.lance"
USAGE_MAX_FRAGMENTS = 64
LINEAGE = "lineage.lance"
REWARDS = "rewards.lance"


@dataclass(frozen=True)
class AppendResult:
    rows: int
    version: int
    skipped: int = 0  # rows left out by on_duplicate="skip"


@dataclass(frozen=True)
class EvictResult:
    rows_deleted: int
    rows_left: int
    version: int
    # Set by evict(preserve_diversity=...): coverage before/after, and what FIFO would keep.
    coverage: RetentionReport | None = None


def _join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


def _is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def _exists(uri: str, storage_options: dict | None) -> bool:
    if _is_local(uri):
        return os.path.isdir(os.path.join(uri.removeprefix("file://"), "_versions"))
    try:
        lance.dataset(uri, storage_options=storage_options)
        return True
    except (ValueError, OSError, FileNotFoundError):
        return False


class RolloutStore:
    """A rollout store at ``uri``. Use :meth:`open`; see the module docstring."""

    def __init__(
        self,
        uri: str,
        *,
        version: int | None = None,
        storage_options: dict[str, str] | None = None,
    ):
        self.uri = str(uri)
        self.storage_options = storage_options
        self._pinned = version
        self._pid = os.getpid()
        self._ds_cache: lance.LanceDataset | None = None
        self._torn: tuple[int, int] | None = None  # (unreadable newest version, fallback)
        try:
            ds = self._rollouts()
        except (OSError, ValueError, RuntimeError) as exc:
            if version is not None or not _is_local(self.uri):
                raise
            ds = self._fall_back(exc)
        _, self.embedding_dim = S.read_metadata(ds.schema)
        self.schema = S.rollout_schema(self.embedding_dim)

    # -- opening -----------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        uri: str | os.PathLike,
        *,
        create: bool = True,
        embedding_dim: int | None = None,
        storage_options: dict[str, str] | None = None,
    ) -> RolloutStore:
        """Open the store at ``uri``, creating it when ``create`` (the default).

        ``embedding_dim`` is fixed when the store is created (default 64); opening
        an existing store with a different one is an error.
        """
        uri = os.fspath(uri)
        rollouts = _join(uri, ROLLOUTS)
        if not _exists(rollouts, storage_options):
            if not create:
                raise StoreNotFoundError(
                    f"no rollout store at {uri!r}; create one with `rolloutstore init {uri}` "
                    "or RolloutStore.open(uri, create=True)"
                )
            cls._create(uri, embedding_dim or S.DEFAULT_EMBEDDING_DIM, storage_options)
        store = cls(uri, storage_options=storage_options)
        if embedding_dim is not None and embedding_dim != store.embedding_dim:
            raise SchemaError(
                f"store {uri!r} has embedding_dim {store.embedding_dim}, asked for "
                f"{embedding_dim}; the dimension is fixed when a store is created"
            )
        return store

    @staticmethod
    def _create(uri: str, embedding_dim: int, storage_options: dict | None) -> None:
        if _is_local(uri):
            os.makedirs(uri.removeprefix("file://"), exist_ok=True)
        for name, sch in (
            (ROLLOUTS, S.rollout_schema(embedding_dim)),
            (USAGE, S.table_schema("usage")),
        ):
            target = _join(uri, name)
            if _exists(target, storage_options):
                continue
            try:
                lance.write_dataset(
                    sch.empty_table(),
                    target,
                    schema=sch,
                    mode="create",
                    storage_options=storage_options,
                )
            except (OSError, ValueError) as exc:
                # Another process created it first: fine, as long as it is there now.
                if not _exists(target, storage_options):
                    raise StoreNotFoundError(f"could not create {target!r}: {exc}") from exc

    def _fall_back(self, exc: Exception) -> lance.LanceDataset:
        """The newest version of rollouts cannot be opened (a torn manifest): open the newest
        one that can, read-only, with one warning naming both."""
        folder = os.path.join(self.uri.removeprefix("file://"), ROLLOUTS, "_versions")
        versions = sorted(_manifest_versions(folder), reverse=True)
        for v in versions[1:]:
            try:
                ds = self._open_ds(ROLLOUTS, v)
            except (OSError, ValueError, RuntimeError):
                continue
            bad = versions[0]
            self._pinned, self._ds_cache, self._torn = v, ds, (bad, v)
            warnings.warn(
                f"store {self.uri!r}: version {bad} of {ROLLOUTS} is unreadable "
                f"({str(exc).splitlines()[0]}); opened version {v} read-only instead. Writes "
                "are refused until it is repaired (RolloutStore.repair(), after checking "
                "the disk)",
                RuntimeWarning,
                stacklevel=4,
            )
            return ds
        raise CorruptStoreError(
            f"no readable version of {_join(self.uri, ROLLOUTS)!r}: expected a manifest Lance "
            f"can open, found {len(versions)} that fail ({str(exc).splitlines()[0]}); restore "
            "the store from a copy"
        ) from exc

    def repair(self) -> int | None:
        """Move unreadable manifests newer than the last good version aside (into
        ``rollouts.lance/_torn/``), so the store opens writable again at that version.

        Returns the version the store is now at, or None if nothing was torn.
        """
        if self._torn is None:
            return None
        bad_from, good = self._torn
        folder = os.path.join(self.uri.removeprefix("file://"), ROLLOUTS)
        aside = os.path.join(folder, "_torn")
        os.makedirs(aside, exist_ok=True)
        for v, name in _manifest_versions(os.path.join(folder, "_versions")).items():
            if v > good:
                os.replace(os.path.join(folder, "_versions", name), os.path.join(aside, name))
        hint = os.path.join(folder, "_versions", "latest_version_hint.json")
        with contextlib.suppress(FileNotFoundError):
            os.remove(hint)
        self._pinned, self._torn, self._ds_cache = None, None, None
        return self.version

    def __reduce__(self):
        return (_reopen, (self.uri, self._pinned, self.storage_options))

    def __repr__(self) -> str:
        pin = f", version={self._pinned}" if self._pinned is not None else ""
        return f"RolloutStore({self.uri!r}{pin})"

    # -- datasets ------------------------------------------------------------------------
    def _open_ds(self, name: str, version: int | None = None) -> lance.LanceDataset:
        return lance.dataset(
            _join(self.uri, name), version=version, storage_options=self.storage_options
        )

    def _rollouts(self) -> lance.LanceDataset:
        """The rollouts dataset at the pinned version, or the latest (re-read each call)."""
        if self._pid != os.getpid():  # forked: never share the parent's handles
            self._pid, self._ds_cache = os.getpid(), None
        if self._pinned is not None:
            if self._ds_cache is None:
                self._ds_cache = self._open_ds(ROLLOUTS, self._pinned)
            return self._ds_cache
        if self._ds_cache is None:
            self._ds_cache = self._open_ds(ROLLOUTS)
        else:
            self._ds_cache = self._ds_cache.checkout_version(self._ds_cache.latest_version)
        return self._ds_cache

    def usage_dataset(self) -> lance.LanceDataset:
        """The append-only usage table (rollout_id, learner_step, run_id, at)."""
        return self._open_ds(USAGE)

    def dataset(self) -> lance.LanceDataset:
        """The underlying Lance dataset (at this store's version) for direct reads."""
        return self._rollouts()

    @property
    def version(self) -> int:
        """Version of the rollouts dataset this store reads (latest unless pinned)."""
        return self._rollouts().version

    @property
    def read_only(self) -> bool:
        return self._pinned is not None

    def checkout(self, version: int) -> RolloutStore:
        """A read-only snapshot of the store at ``version``."""
        return RolloutStore(self.uri, version=version, storage_options=self.storage_options)

    def versions(self) -> list[dict[str, Any]]:
        return [
            {"version": v["version"], "timestamp": v["timestamp"], "metadata": v.get("metadata")}
            for v in self._rollouts().versions()
        ]

    def count(self, filter: str | None = None) -> int:
        return self._rollouts().count_rows(filter=filter)

    # -- writing -------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Raise ReadOnlyError unless this handle may write (not a snapshot, not torn)."""
        if self._torn is not None:
            bad, good = self._torn
            raise ReadOnlyError(
                f"store {self.uri!r} opened read-only at version {good}: its newest version "
                f"{bad} is unreadable (torn manifest); expected a readable newest version, "
                "found a damaged one; check the disk, then call RolloutStore.repair()"
            )
        if self._pinned is not None:
            raise ReadOnlyError(
                f"store snapshot at version {self._pinned} is read-only; write through "
                "RolloutStore.open(uri)"
            )

    def append(self, data, *, on_duplicate: OnDuplicate = "error") -> AppendResult:
        """Validate and append rollouts atomically: all of ``data`` commits, or nothing.

        ``data``: a ``pyarrow.Table``/``RecordBatch``, a list of dicts, or an
        iterable of tables/record batches (streamed to fragments, then one commit).
        Raises :class:`ValidationError` naming the row and field; rows are counted
        across the whole input. A ``rollout_id`` given twice in ``data`` or already in
        the store is refused (``on_duplicate="error"``) or that row is left out
        (``"skip"``; the result counts it in ``skipped``).
        """
        self.check_writable()
        if on_duplicate not in ("error", "skip"):
            raise ValueError(f"on_duplicate must be 'error' or 'skip', got {on_duplicate!r}")
        target = _join(self.uri, ROLLOUTS)
        read_version = self._rollouts().version
        ids = IdCheck(lambda: self._open_ds(ROLLOUTS), on_duplicate)
        fragments: list = []
        rows = seen = 0
        committing = False
        try:
            for chunk in _chunks(data):
                given = gives_ids(chunk)
                try:
                    table = prepare(chunk, self.schema, unique_ids=False)
                    table = ids.filter(table, given)
                except ValidationError as exc:
                    if seen and exc.row is not None:
                        raise ValidationError(
                            exc.reason, row=seen + exc.row, field=exc.field
                        ) from exc
                    raise
                seen += ids.last_rows
                if table.num_rows == 0:
                    continue
                fragments += write_fragments(
                    table,
                    target,
                    schema=self.schema,
                    storage_options=self.storage_options,
                    max_rows_per_file=1 << 20,
                )
                rows += table.num_rows
            if not fragments:
                return AppendResult(0, read_version, ids.skipped)
            committing = True
            ds = lance.LanceDataset.commit(
                target,
                lance.LanceOperation.Append(fragments),
                read_version=read_version,
                storage_options=self.storage_options,
            )
        except BaseException as exc:
            # Uncommitted fragments are invisible but take disk; drop them now (gc() catches
            # what a killed process leaves) -- unless a failed commit got far enough to
            # reference them.
            if not (committing and self._references_any(fragments)):
                self._discard(fragments)
            if isinstance(exc, OSError) and _disk_full(exc):
                raise DiskFullError(f"append of {seen} rows", self.uri) from exc
            raise
        self._ds_cache = ds
        return AppendResult(rows, ds.version, ids.skipped)

    def _references_any(self, fragments: list) -> bool:
        ours = {f.path for frag in fragments for f in frag.files}
        try:
            latest = self._open_ds(ROLLOUTS)
            return any(f.path in ours for fr in latest.get_fragments() for f in fr.metadata.files)
        except (OSError, ValueError, RuntimeError):
            return True  # cannot tell: keep the files (gc collects them if unreferenced)

    def _discard(self, fragments: list) -> None:
        if not _is_local(self.uri):
            return
        data = os.path.join(self.uri.removeprefix("file://"), ROLLOUTS, "data")
        for frag in fragments:
            for f in frag.files:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(data, f.path))

    def record_usage(
        self, rollout_ids: Sequence[str], learner_step: int, run_id: str = "default"
    ) -> int:
        """Append one usage row per id (sampling never rewrites rollout rows).

        Allowed on a read-only snapshot too: usage is its own append-only log.
        """
        n = len(rollout_ids)
        if n == 0:
            return 0
        now = datetime.now(UTC)
        sch = S.table_schema("usage")
        table = pa.table(
            {
                "rollout_id": pa.array(list(rollout_ids), pa.string()),
                "learner_step": pa.array(np.full(n, learner_step, np.int64)),
                "run_id": pa.array([run_id] * n, pa.string()),
                "at": pa.array([now] * n, sch.field("at").type),
            },
            schema=sch,
        )
        ds = lance.write_dataset(
            table, _join(self.uri, USAGE), mode="append", storage_options=self.storage_options
        )
        if len(ds.get_fragments()) > USAGE_MAX_FRAGMENTS:
            # One small fragment per draw would make every commit and read of the log
            # grow with the number of steps; merging keeps them constant. Rows are kept.
            # If another process compacts concurrently, its result stands.
            with contextlib.suppress(OSError):
                ds.optimize.compact_files()
        return n

    # -- maintenance ---------------------------------------------------------------------
    def compact(self, *, cleanup_older_than: timedelta | None = None) -> dict[str, Any]:
        """Merge small fragments (one per append) into larger files; optionally drop old versions.

        Old versions stay readable (``checkout``) unless ``cleanup_older_than`` is given.
        """
        self.check_writable()
        out = {}
        for name in (ROLLOUTS, USAGE):
            ds = self._open_ds(name)
            try:
                metrics = ds.optimize.compact_files()
            except OSError as exc:
                if _disk_full(exc):
                    raise DiskFullError(f"compaction of {name}", self.uri) from exc
                raise
            out[name.split(".")[0]] = {
                "fragments_removed": metrics.fragments_removed,
                "fragments_added": metrics.fragments_added,
            }
            if cleanup_older_than is not None:
                stats = self._open_ds(name).cleanup_old_versions(older_than=cleanup_older_than)
                out[name.split(".")[0]]["bytes_removed"] = stats.bytes_removed
        self._ds_cache = None
        return out

    def gc(
        self,
        *,
        min_age: timedelta = DEFAULT_MIN_AGE,
        exports: Sequence[str | os.PathLike] = (),
        dry_run: bool = False,
    ) -> GcResult:
        """Remove data files no retained version references (left by killed appends) that are
        older than ``min_age``, and killed exports' ``.OUT.tmp-PID`` files in ``exports``.

        Safe with concurrent readers and appenders; see :mod:`rolloutstore.gc`.
        """
        self.check_writable()
        if not _is_local(self.uri):
            raise ValueError(
                f"gc works on local stores; {self.uri!r} is an object store: expire "
                "unreferenced data/ files with a bucket lifecycle rule instead"
            )
        results = [
            collect_dataset(self._open_ds(name), min_age=min_age, dry_run=dry_run)
            for name in (ROLLOUTS, USAGE, REWARDS, LINEAGE)
            if _exists(_join(self.uri, name), self.storage_options)
        ]
        results.append(collect_export_temps(exports, min_age=min_age, dry_run=dry_run))
        return merge(results)

    def evict(
        self,
        *,
        keep_last: int | None = None,
        older_than: timedelta | datetime | None = None,
        min_policy_version: int | None = None,
        preserve_diversity: bool | RetentionConfig = False,
    ) -> EvictResult:
        """Delete rows by an explicit retention rule (sampling never deletes).

        ``keep_last``: keep the N most recent rollouts by (policy_version, created_at,
        rollout_id); ``older_than``: drop rows created before now - delta (or before a
        datetime); ``min_policy_version``: drop rows sampled by older policies.
        ``preserve_diversity`` (True or a :class:`~rolloutstore.retention.RetentionConfig`,
        with ``keep_last``): still keep exactly N rows, but spend a reserved share of them on
        older representatives of prompts, embedding clusters and correct answers the newest
        rows miss; ``coverage`` of the result reports the gain over FIFO.
        Deletions are one new version; earlier versions stay readable until compaction
        with cleanup.
        """
        from .evict import evict_rows
        from .rescore import newest_rewards

        self.check_writable()
        before, report = evict_rows(
            self._rollouts(), lambda: newest_rewards(self), keep_last=keep_last,
            older_than=older_than, min_policy_version=min_policy_version,
            preserve_diversity=preserve_diversity,
        )  # fmt: skip
        self._ds_cache = None
        after = self._rollouts()
        left = after.count_rows()
        return EvictResult(before - left, left, after.version, report)

    # -- reading -------------------------------------------------------------------------
    def connect(self):
        """A locked-down DuckDB connection with views ``rollouts``, ``usage``, ``groups``,
        ``lineage``, ``rewards`` and ``rollouts_scored``."""
        from .sql import connect

        return connect(
            {
                "rollouts": self._rollouts(),
                "usage": self.usage_dataset(),
                "lineage": self._lineage(),
                "rewards": self.rewards_table(),
            }
        )

    def rewards_table(self) -> lance.LanceDataset | pa.Table:
        """The re-scorings table (latest version); empty until the first ``rescore``."""
        target = _join(self.uri, REWARDS)
        if _exists(target, self.storage_options):
            return lance.dataset(target, storage_options=self.storage_options)
        return S.table_schema("rewards").empty_table()

    def rescore(self, task, **options: Any):
        """Re-score stored rollouts with ``task``'s verifier under a new ``reward_version``.

        Token columns are never rewritten; see :func:`rolloutstore.rescore.rescore` for
        ``options`` (``task_options``, ``where``, ``params``, ``from_task``, ...). Returns
        ``RescoreResult``.
        """
        from .rescore import rescore

        return rescore(self, task, **options)

    def _lineage(self) -> lance.LanceDataset | pa.Table:
        target = _join(self.uri, LINEAGE)
        if _exists(target, self.storage_options):
            return lance.dataset(target, storage_options=self.storage_options)
        return S.table_schema("lineage").empty_table()  # stores from before lineage

    def record_lineage(
        self, run_id: str, policy_version: int, parent_run: str | None, parent_version: int | None
    ) -> None:
        """Record that ``run_id`` at ``policy_version`` continues from ``parent_run`` at
        ``parent_version``, which defines staleness across runs."""
        sch = S.table_schema("lineage")
        table = pa.table(
            {
                "run_id": [run_id],
                "policy_version": pa.array([policy_version], pa.int64()),
                "parent_run": [parent_run],
                "parent_version": pa.array([parent_version], pa.int64()),
                "at": pa.array([datetime.now(UTC)], sch.field("at").type),
            },
            schema=sch,
        )
        target = _join(self.uri, LINEAGE)
        mode = "append" if _exists(target, self.storage_options) else "create"
        lance.write_dataset(table, target, mode=mode, storage_options=self.storage_options)

    def sql(
        self, query: str, params: Sequence | dict | None = None, *, timeout: float | None = None
    ) -> pa.Table:
        """Run a parameterized DuckDB query over the store's views; returns an Arrow table.

        ``timeout``: seconds after which the query is interrupted (``QueryTimeoutError``)."""
        from .sql import run

        return run(self.connect(), query, params, timeout=timeout)

    def take(
        self, row_ids: Sequence[int] | np.ndarray, columns: list[str] | None = None
    ) -> pa.Table:
        """Rows by position (row offsets in this store version), in the order given."""
        return self._rollouts().take(np.asarray(row_ids, dtype=np.int64), columns=columns)

    def take_rows(
        self, row_addresses: Sequence[int] | np.ndarray, columns: list[str] | None = None
    ) -> pa.Table:
        """Rows by Lance row address (``_rowaddr`` of this store version), in the order given."""
        addr = np.asarray(row_addresses, dtype=np.uint64)
        if addr.size == 0:
            return self.schema.empty_table().select(columns or self.schema.names)
        uniq, inverse = np.unique(addr, return_inverse=True)
        # Lance reads sorted addresses fastest; restore the caller's order (and repeats) after.
        table = self._rollouts()._take_rows(uniq.tolist(), columns=columns)
        return table.take(pa.array(inverse.astype(np.int64)))

    def stats(self) -> dict[str, Any]:
        """Size, tokens, compression, policy-version histogram, reward by version, reuse."""
        from .sql import store_stats

        return store_stats(self)

    def export(self, out: str | os.PathLike, **options: Any):
        """Stream rows (``as_="rollouts"|"sft"|"dpo"``) to Parquet, JSONL(.zst) or a HF dataset.

        Options as :func:`rolloutstore.export.export` (``format``, ``where``, ``params``,
        ``columns``, ``as_``, ``min_reward``, ``min_margin``, ``progress``); returns
        ``ExportResult(rows, path)``.
        """
        from .export import export

        return export(self, out, **options)

    def bytes_on_disk(self) -> int | None:
        """Bytes of the rollouts dataset: a local folder walked in full (all versions); on an
        object store, the data files of this version as its manifest records them (listing
        a bucket prefix costs a request per 1,000 objects). None if a size is unrecorded."""
        if not _is_local(self.uri):
            sizes = [
                f.file_size_bytes
                for frag in self._rollouts().get_fragments()
                for f in frag.metadata.files
            ]
            return None if any(s is None for s in sizes) else int(sum(sizes))
        root = self.uri.removeprefix("file://")
        total = 0
        for d, _, files in os.walk(os.path.join(root, ROLLOUTS)):
            total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
        return total


def _manifest_versions(folder: str) -> dict[int, str]:
    """Version -> manifest file name in a local ``_versions`` folder (either naming scheme:
    V2 names a version ``2**64 - 1 - v``, V1 names it ``v``)."""
    out = {}
    for name in os.listdir(folder):
        stem, dot, ext = name.partition(".")
        if ext != "manifest" or not stem.isdigit():
            continue
        n = int(stem)
        out[(2**64 - 1 - n) if n > 2**63 else n] = name
    return out


def _disk_full(exc: OSError) -> bool:
    # Lance reports I/O errors from Rust as OSError without errno: match its text too.
    return exc.errno == errno.ENOSPC or "os error 28" in str(exc) or "No space left" in str(exc)


def _chunks(data) -> Iterable:
    if isinstance(data, (pa.Table, pa.RecordBatch)):
        return [data]
    if isinstance(data, pa.RecordBatchReader):
        return data
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        if data and isinstance(data[0], (pa.Table, pa.RecordBatch)):
            return data
        return [list(data)]
    if isinstance(data, Iterable):
        return data
    raise TypeError(
        f"append() takes a pyarrow.Table, a list of dicts or an iterable of record batches, "
        f"got {type(data).__name__}"
    )


def _reopen(uri: str, version: int | None, storage_options: dict | None) -> RolloutStore:
    return RolloutStore(uri, version=version, storage_options=storage_options)
