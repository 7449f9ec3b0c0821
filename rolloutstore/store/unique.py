"""rollout_id uniqueness for an append: within the input and against the stored rows.

Ids the store generates are UUIDv7 (unique by construction), so only inputs that
name rollout ids are checked. Within one append a dict of the ids seen so far
catches repeats across chunks; against the store, each chunk's ids are looked up
in the latest version through a Lance BTREE scalar index on ``rollout_id`` (plus a
scan of the fragments appended since the index was last extended). Measured with
``tools/bench_unique_ids.py`` (200k stored rows in 100 fragments, shared 2-core CPU):
looking up 64 ids costs ~3.4 ms through the index vs ~38 ms by a full-scan filter
(which grows with the store); 4096 ids ~34 ms vs ~58 ms. A whole append that names
its ids costs 25.7 ms vs 25.3 ms without (64 rows) and 524 ms vs 475 ms (4096 rows).
Building the index over 200k rows takes ~0.2 s, extending it ~0.1 s (one extra
commit, at most once per INDEX_AFTER_ROWS appended rows).

An append that names its ids is committed by :func:`keyed_insert`: a Lance
``merge_insert`` keyed on ``rollout_id``, which the rollouts dataset declares its
(unenforced) primary key. Lance checks the keys a commit inserts against those of
every commit that landed since it read the dataset, so two writers of the same ids at
once (an actor restarted beside its zombie, two actors given the same round) land each
id once; the check-then-append this replaces made 200 duplicates of 200 in that race.
Its cost against the check-then-append: docs/benchmarks.md, "Keyed insert"
(``tools/bench_unique_ids.py --keyed``). Rows without ids get UUIDv7s and a plain append.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rolloutstore.errors import ValidationError

OnDuplicate = Literal["error", "skip"]
ID_INDEX = "rollout_id_idx"
# Unindexed rows the lookup may scan before the index is extended (one extra commit).
INDEX_AFTER_ROWS = 20_000
# Field metadata that makes Lance detect concurrent inserts of one key (merge_insert).
PRIMARY_KEY = {"lance-schema:unenforced-primary-key": "true"}
_MATCHED = re.compile(r'found matching row with key values: rollout_id = "([^"]*)"')


def gives_ids(chunk) -> bool:
    """Whether the input names any rollout_id (ids the store generates are UUIDv7: unique)."""
    if isinstance(chunk, (pa.Table, pa.RecordBatch)):
        names = chunk.schema.names
        return "rollout_id" in names and chunk.column("rollout_id").null_count < chunk.num_rows
    if isinstance(chunk, Sequence):
        return any(isinstance(r, dict) and r.get("rollout_id") is not None for r in chunk)
    return True


class IdCheck:
    """rollout_id uniqueness for one append: within the input (a set of the ids seen so
    far) and against the store's latest version (a BTREE index lookup per chunk, plus a
    scan of the fragments appended since the index was last brought up to date)."""

    def __init__(
        self,
        open_latest: Callable[[], lance.LanceDataset],
        on_duplicate: str,
        *,
        keyed: bool = False,
    ):
        self.open_latest, self.skip = open_latest, on_duplicate == "skip"
        self.seen: dict[str, int] = {}  # id -> input row that gave it
        self.skipped = self.offset = self.last_rows = 0
        self._indexed = False
        # keyed: when the first chunk names its ids, the commit (keyed_insert) checks them
        # against the store atomically (no lookup here unless skipping); None until the
        # first chunk.
        self._keyed_allowed, self.keyed = keyed, None

    def filter(self, table: pa.Table, given: bool) -> pa.Table:
        n = self.last_rows = table.num_rows
        offset, self.offset = self.offset, self.offset + n
        if self.keyed is None:
            self.keyed = given and self._keyed_allowed
        if not given:
            return table
        ids = table["rollout_id"].to_pylist()
        # Skipping looks ids up first all the same: a re-run import then commits nothing.
        stored = self._index_only() if self.keyed and not self.skip else self._stored(ids)
        keep = np.ones(n, bool)
        for i, rid in enumerate(ids):
            first = self.seen.get(rid)
            if first is None and rid not in stored:
                self.seen[rid] = offset + i
                continue
            if not self.skip:
                where = (
                    f"repeats row {first} of this append"
                    if first is not None
                    else f"is already in the store (version {stored[rid]})"
                )
                raise ValidationError(
                    f"expected a unique rollout_id, found {rid!r}, which {where}; pass "
                    "on_duplicate='skip' (CLI: --on-duplicate skip) to leave such rows out",
                    row=i,
                    field="rollout_id",
                )
            keep[i] = False
        if keep.all():
            return table
        self.skipped += int((~keep).sum())
        return table.filter(pa.array(keep))

    def _index_only(self) -> dict[str, int]:
        """No lookup (the keyed insert matches ids itself, through the same index)."""
        if not self._indexed:
            self._indexed = True
            ds = self.open_latest()
            if ds.count_rows():
                _update_id_index(ds, self.open_latest)
        return {}

    def _stored(self, ids: list[str]) -> dict[str, int]:
        ds = self.open_latest()  # the latest: narrows the window for concurrent appends
        if ds.count_rows() == 0:
            return {}
        if not self._indexed:
            self._indexed = True
            ds = _update_id_index(ds, self.open_latest)
        found: dict[str, int] = {}
        for lo in range(0, len(ids), 8192):
            part = pc.field("rollout_id").isin(ids[lo : lo + 8192])
            t = ds.to_table(columns=["rollout_id"], filter=part)
            found.update(dict.fromkeys(t["rollout_id"].to_pylist(), ds.version))
        return found


def _update_id_index(
    ds: lance.LanceDataset, open_latest: Callable[[], lance.LanceDataset]
) -> lance.LanceDataset:
    """Create or extend the rollout_id BTREE index once INDEX_AFTER_ROWS rows lack it.

    Best effort: a concurrent writer may win the commit; lookups then scan a bit more.
    """
    index = next((i for i in ds.describe_indices() if i.name == ID_INDEX), None)
    if ds.count_rows() - (index.num_rows_indexed if index else 0) < INDEX_AFTER_ROWS:
        return ds
    try:
        if index is None:
            ds.create_scalar_index("rollout_id", "BTREE", name=ID_INDEX)
        else:
            ds.optimize.optimize_indices(index_names=[ID_INDEX])
    except (OSError, ValueError, RuntimeError):
        return ds
    return open_latest()


def keyed_insert(
    ds: lance.LanceDataset, tables: Iterable[pa.Table], schema: pa.Schema, ids: IdCheck
) -> tuple[int, int, lance.LanceDataset]:
    """Commit ``tables`` (validated, in the stored schema) as one ``merge_insert`` keyed on
    rollout_id: (rows inserted, rows offered, the dataset at the new version).

    ``ids.skip``: rows whose id is in the store (also when a concurrent writer landed it
    first) are left out; else any such row fails the whole insert with a ValidationError.
    """
    ds = mark_primary_key(ds)
    tables = iter(tables)
    head = [t for t in (next(tables, None), next(tables, None)) if t is not None]
    offered, failure = 0, []

    def batches():
        nonlocal offered
        try:
            for t in itertools.chain(head, tables):
                offered += t.num_rows
                yield from t.to_batches()
        except BaseException as exc:  # Lance sees a failed stream; we re-raise the cause
            failure.append(exc)
            raise

    # One table (the usual append) goes in as a table: Lance then plans the join with its
    # size and keeps it for a retry in memory (faster than a stream, tools/bench_unique_ids.py).
    if len(head) == 1:
        source, offered = head[0], head[0].num_rows
    else:
        source = pa.RecordBatchReader.from_batches(schema, batches())
    builder = ds.merge_insert("rollout_id")
    if not ids.skip:
        builder = builder.when_matched_fail()
    builder = builder.when_not_matched_insert_all()
    try:
        stats = builder.execute(source)
    except Exception as exc:
        if failure:
            raise failure[0] from None
        found = _MATCHED.search(str(exc))
        if found is None:
            raise
        rid = found.group(1)
        raise ValidationError(
            f"expected a unique rollout_id, found {rid!r}, which is already in the store "
            "(or a concurrent writer landed it first); "
            "pass on_duplicate='skip' (CLI: --on-duplicate skip) to leave such rows out",
            row=ids.seen.get(rid),
            field="rollout_id",
        ) from exc
    return int(stats["num_inserted_rows"]), offered, ds


def with_primary_key(schema: pa.Schema) -> pa.Schema:
    """``schema`` with rollout_id declared the primary key (a new store's rollouts)."""
    i = schema.get_field_index("rollout_id")
    field = schema.field(i)
    return schema.set(i, field.with_metadata({**(field.metadata or {}), **PRIMARY_KEY}))


def mark_primary_key(ds: lance.LanceDataset) -> lance.LanceDataset:
    """``ds`` with rollout_id declared its primary key (stores created before the keyed
    insert lack it; without it Lance does not detect two commits inserting one id)."""
    meta = ds.schema.field("rollout_id").metadata or {}
    if all(meta.get(k.encode()) == v.encode() for k, v in PRIMARY_KEY.items()):
        return ds
    ds.update_field_metadata({"rollout_id": dict(PRIMARY_KEY)})
    return ds
