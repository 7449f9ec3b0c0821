"""``RolloutLog``: the append-only Lance log of rollouts, with DuckDB SQL over it. The
user-facing :class:`rolloutstore.RolloutStore` (:mod:`rolloutstore.facade`) is this log plus
statistics, retention, re-scoring and export.

Layout under the store URI (a local folder or any URI Lance accepts)::

    STORE/rollouts.lance   one row per completion or trajectory (schema v2; a v1 store reads
                           as v2, see rolloutstore.schema.compat), compressed token columns
    STORE/usage.lance      append-only (rollout_id, learner_step, run_id, at)
    STORE/rewards.lance    append-only re-scorings (rollout_id, reward_version, reward, ...)

Every append is one Lance commit: all rows of a batch become visible together or
not at all, and concurrent appenders from several processes are serialised by
Lance's commit protocol. A store object pickles as (class, URI, pinned version,
storage options) and reopens its datasets after a fork.

This module owns opening, appending and reading; it delegates the dataset layout to
:mod:`rolloutstore.store.layout`, the usage/lineage/rewards tables to
:mod:`rolloutstore.store.side_tables`, compaction and torn-manifest recovery to
:mod:`rolloutstore.store.maintenance`, and garbage collection to :mod:`rolloutstore.store.gc`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lance
import numpy as np
import pyarrow as pa
from lance.fragment import write_fragments

from rolloutstore.errors import (
    DiskFullError,
    ReadOnlyError,
    SchemaError,
    StoreNotFoundError,
    ValidationError,
)
from rolloutstore.query.sql import connect, run
from rolloutstore.schema import compat as schema_compat
from rolloutstore.schema import spec as S
from rolloutstore.schema.validate import chunks, prepare
from rolloutstore.store import layout, maintenance, precision, side_tables
from rolloutstore.store.gc import (
    DEFAULT_MIN_AGE,
    GcResult,
    collect_store,
    discard_fragments,
    references_any,
)
from rolloutstore.store.layout import ROLLOUTS, USAGE, disk_full, exists, is_local, join
from rolloutstore.store.unique import IdCheck, OnDuplicate, gives_ids, keyed_insert


@dataclass(frozen=True)
class AppendResult:
    rows: int
    version: int
    skipped: int = 0  # rows left out by on_duplicate="skip"


class RolloutLog:
    """The rollout log at ``uri``. Use :meth:`open`; see the module docstring."""

    # Appends that name their ids commit through a keyed insert (no duplicate even with
    # concurrent writers of one id); False only for tools/bench_unique_ids.py's baseline.
    KEYED_INSERT = True

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
            if version is not None or not is_local(self.uri):
                raise
            # A torn newest manifest: the newest readable version, read-only, one warning.
            ds, good, bad = maintenance.open_newest_readable(self.uri, self._open_ds, exc)
            self._pinned, self._ds_cache, self._torn = good, ds, (bad, good)
        _, self.embedding_dim = S.read_metadata(ds.schema)
        # Rows are read and appended in the newest schema (an older store's: schema_compat).
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
    ) -> RolloutLog:
        """Open the store at ``uri``, creating it when ``create`` (the default).

        ``embedding_dim`` is fixed when the store is created (default 64); opening
        an existing store with a different one is an error.
        """
        uri = os.fspath(uri)
        if embedding_dim is not None:
            S.check_embedding_dim(embedding_dim)  # before anything is created
        rollouts = join(uri, ROLLOUTS)
        if not exists(rollouts, storage_options):
            if not create:
                raise StoreNotFoundError(
                    f"no rollout store at {uri!r}; create one with `rolloutstore init {uri}` "
                    "or RolloutStore.open(uri, create=True)"
                )
            layout.create(uri, embedding_dim or S.DEFAULT_EMBEDDING_DIM, storage_options)
        store = cls(uri, storage_options=storage_options)
        if embedding_dim is not None and embedding_dim != store.embedding_dim:
            raise SchemaError(
                f"store {uri!r} has embedding_dim {store.embedding_dim}, asked for "
                f"{embedding_dim}; the dimension is fixed when a store is created"
            )
        return store

    def repair(self) -> int | None:
        """Move unreadable manifests newer than the last good version aside (into
        ``rollouts.lance/_torn/``), so the store opens writable again at that version.

        Returns the version the store is now at, or None if nothing was torn.
        """
        if self._torn is None:
            return None
        maintenance.move_torn_aside(self.uri, good=self._torn[1])
        self._pinned, self._torn, self._ds_cache = None, None, None
        return self.version

    def __reduce__(self):
        return (_reopen, (type(self), self.uri, self._pinned, self.storage_options))

    def __repr__(self) -> str:
        pin = f", version={self._pinned}" if self._pinned is not None else ""
        return f"{type(self).__name__}({self.uri!r}{pin})"

    # -- datasets ------------------------------------------------------------------------
    def _open_ds(self, name: str, version: int | None = None) -> lance.LanceDataset:
        return lance.dataset(
            join(self.uri, name), version=version, storage_options=self.storage_options
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
    def schema_version(self) -> int:
        """The rollout schema version this store version was written with (1 or 2)."""
        return schema_compat.stored_version(self._rollouts().schema)

    @property
    def read_only(self) -> bool:
        return self._pinned is not None

    def checkout(self, version: int) -> RolloutLog:
        """A read-only snapshot of the store at ``version``."""
        return type(self)(self.uri, version=version, storage_options=self.storage_options)

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
        target = join(self.uri, ROLLOUTS)
        ds = self._rollouts()
        read_version, stored = ds.version, schema_compat.stored_version(ds.schema)
        schema_compat.check_columns(ds.schema, stored, self.embedding_dim, self.uri)
        stored_schema = S.rollout_schema(self.embedding_dim, stored)
        ids = IdCheck(lambda: self._open_ds(ROLLOUTS), on_duplicate, keyed=self.KEYED_INSERT)
        bound = precision.recorded(ds.schema)  # opt-in lossy log-probs (store.precision)
        tables = (
            precision.quantize_table(t, bound)
            for t in _validated(data, ids, self.schema, stored, self.embedding_dim, self.uri)
        )
        fragments: list = []
        rows = 0
        committing = False
        try:
            first = next(tables, None)
            if first is not None and ids.keyed:  # ids given: one atomic keyed insert
                rows, offered, ds = keyed_insert(
                    self._open_ds(ROLLOUTS), itertools.chain([first], tables), stored_schema, ids
                )
                self._ds_cache = ds
                return AppendResult(rows, ds.version, ids.skipped + offered - rows)
            for table in itertools.chain([first] if first is not None else [], tables):
                fragments += write_fragments(
                    table,
                    target,
                    schema=stored_schema,
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
            if not (committing and references_any(self.uri, self.storage_options, fragments)):
                discard_fragments(self.uri, fragments)
            if isinstance(exc, OSError) and disk_full(exc):
                raise DiskFullError(f"append of {ids.offset} rows", self.uri) from exc
            schema_compat.refuse_if_migrated(lambda: self._open_ds(ROLLOUTS), stored, exc)
            raise
        self._ds_cache = ds
        return AppendResult(rows, ds.version, ids.skipped)

    def record_usage(
        self, rollout_ids: Sequence[str], learner_step: int, run_id: str = "default"
    ) -> int:
        """Append one usage row per id (sampling never rewrites rollout rows).

        Allowed on a read-only snapshot too: usage is its own append-only log.
        """
        return side_tables.append_usage(
            self.uri, self.storage_options, rollout_ids, learner_step, run_id
        )

    # -- log-prob precision ---------------------------------------------------------------
    @property
    def logprob_precision(self) -> float:
        """Absolute error bound (nats) of the stored behaviour log-probs; 0.0 = lossless."""
        return precision.recorded(self._rollouts().schema)

    def set_logprob_precision(self, bound: float) -> float:
        """Store behaviour log-probs of later appends to within ``bound`` nats (0: lossless).

        The bound is recorded in the store's metadata (the learner checks it); it may be
        raised, never lowered, since rows already stored keep their error. Returns it.
        See :mod:`rolloutstore.store.precision`.
        """
        self.check_writable()
        bound = precision.check_bound(bound)
        ds = self._rollouts()
        now = precision.recorded(ds.schema)
        if bound < now:
            raise ValueError(
                f"store {self.uri!r} records log-probs to within {now:g} nats; asked for "
                f"{bound:g}: rows already stored keep their error, so the bound cannot be "
                "lowered; write to a new store for a tighter one"
            )
        if bound > now:
            precision.record(ds, bound)
            self._ds_cache = None
        return bound

    # -- maintenance ---------------------------------------------------------------------
    def compact(self, *, cleanup_older_than: timedelta | None = None) -> dict[str, Any]:
        """Merge small fragments (one per append) into larger files; optionally drop old versions.

        Old versions stay readable (``checkout``) unless ``cleanup_older_than`` is given.
        """
        self.check_writable()
        out = maintenance.compact(self.uri, self._open_ds, cleanup_older_than)
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

        Safe with concurrent readers and appenders; see :mod:`rolloutstore.store.gc`.
        """
        self.check_writable()
        return collect_store(
            self.uri, self.storage_options, min_age=min_age, exports=exports, dry_run=dry_run
        )

    # -- reading -------------------------------------------------------------------------
    def connect(self):
        """A locked-down DuckDB connection with views ``rollouts``, ``usage``, ``groups``,
        ``lineage``, ``rewards`` and ``rollouts_scored``."""
        ds = self._rollouts()
        # The dataset is `rollouts_stored`; the `rollouts` view shows it in the current schema.
        return connect(
            {
                "rollouts_stored": ds,
                "usage": self.usage_dataset(),
                "lineage": self.lineage_table(),
                "rewards": self.rewards_table(),
            },
            rollouts_view=schema_compat.ROLLOUTS_VIEW[schema_compat.stored_version(ds.schema)],
        )

    def rewards_table(self) -> lance.LanceDataset | pa.Table:
        """The re-scorings table (latest version); empty until the first ``rescore``."""
        return side_tables.open_table(self.uri, "rewards", self.storage_options)

    def lineage_table(self) -> lance.LanceDataset | pa.Table:
        """The lineage table (run continuations); empty for stores from before lineage."""
        return side_tables.open_table(self.uri, "lineage", self.storage_options)

    def record_lineage(
        self, run_id: str, policy_version: int, parent_run: str | None, parent_version: int | None
    ) -> None:
        """Record that ``run_id`` at ``policy_version`` continues from ``parent_run`` at
        ``parent_version``, which defines staleness across runs."""
        side_tables.append_lineage(
            self.uri, self.storage_options, run_id, policy_version, parent_run, parent_version
        )

    def sql(
        self, query: str, params: Sequence | dict | None = None, *, timeout: float | None = None
    ) -> pa.Table:
        """Run a parameterized DuckDB query over the store's views; returns an Arrow table.

        ``timeout``: seconds after which the query is interrupted (``QueryTimeoutError``)."""
        return run(self.connect(), query, params, timeout=timeout)

    def take(
        self, row_ids: Sequence[int] | np.ndarray, columns: list[str] | None = None
    ) -> pa.Table:
        """Rows by position (row offsets in this store version), in the order given."""
        return schema_compat.take(self._rollouts(), self.schema, row_ids, columns)

    def take_rows(
        self, row_addresses: Sequence[int] | np.ndarray, columns: list[str] | None = None
    ) -> pa.Table:
        """Rows by Lance row address (``_rowaddr`` of this store version), in the order given."""
        return schema_compat.take_rows(self._rollouts(), self.schema, row_addresses, columns)

    def bytes_on_disk(self) -> int | None:
        """Bytes of the rollouts dataset: a local folder walked in full (all versions); on an
        object store, the data files of this version as its manifest records them (listing
        a bucket prefix costs a request per 1,000 objects). None if a size is unrecorded."""
        return layout.bytes_on_disk(self.uri, self._rollouts)


def _validated(data, ids: IdCheck, schema: pa.Schema, stored: int, dim: int, uri: str):
    """``data``'s chunks validated, in the stored schema, rows with repeated ids dealt with;
    a ValidationError names the row counted across the whole input."""
    for chunk in chunks(data):
        given = gives_ids(chunk)
        seen = ids.offset
        try:
            table = prepare(chunk, schema, unique_ids=False)
            table = schema_compat.to_stored(table, stored, dim, uri)
            table = ids.filter(table, given)
        except ValidationError as exc:
            if seen and exc.row is not None:
                raise ValidationError(exc.reason, row=seen + exc.row, field=exc.field) from exc
            raise
        if table.num_rows:
            yield table


def _reopen(cls: type[RolloutLog], uri: str, version: int | None, storage_options: dict | None):
    return cls(uri, version=version, storage_options=storage_options)
