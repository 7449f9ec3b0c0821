"""``rolloutstore migrate STORE``: upgrade a schema-v1 store to v2 in one atomic commit.

v2 adds the multi-turn columns at the end of the schema (``loss_mask``, ``turns``,
``num_turns``, ``num_model_tokens``, ``num_tool_calls``, ``tools``). Migrating writes them
for every fragment as new data files beside the existing ones (a v1 row is one model turn:
the mask stored null, read as all ones; no turns; 1 turn; every completion token a model
token; no tool calls) and commits them, with the schema version 2 in the schema metadata,
as ONE Lance ``Merge`` commit. Token columns are not rewritten, fragment ids and row
addresses stay, and the ``rollout_id`` index stays valid.

Until that commit nothing a reader sees changes: a failure or a kill before it leaves the
v1 store readable and writable as it was (the data files written so far are removed on a
failure; after a kill, ``rolloutstore gc`` collects them). On a v2 store it does nothing.

Appends racing the migration: one that commits first (after the migration read the store)
makes the migration's commit conflict; the migration then drops what it wrote and runs again
over the store with that append's rows (``COMMIT_ATTEMPTS`` times at most, then one
WriteConflictError, the store still v1). One that read the v1 store and commits after the
migration is the one refused, by Lance's commit check, with a SchemaVersionError naming the
migration: append it again.

    rolloutstore migrate runs/old/store
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lance
import numpy as np
import pyarrow as pa

from rolloutstore.errors import SchemaError
from rolloutstore.schema import spec as S
from rolloutstore.schema.compat import V2_COLUMNS, stored_version
from rolloutstore.store.layout import ROLLOUTS, is_local, join, retry_conflicts
from rolloutstore.store.precision import META_PRECISION

if TYPE_CHECKING:
    from rolloutstore.store.log import RolloutLog


@dataclass(frozen=True)
class MigrateResult:
    uri: str
    from_version: int  # schema version before
    to_version: int  # schema version after
    rows: int
    store_version_before: int
    store_version_after: int  # equal to before when nothing was done
    columns_added: tuple[str, ...] = ()

    def describe(self) -> str:
        if not self.columns_added:
            return (
                f"store {self.uri} is already rollout schema v{self.to_version}; nothing to do "
                f"(store version {self.store_version_after})"
            )
        return (
            f"migrated store {self.uri} from rollout schema v{self.from_version} to "
            f"v{self.to_version} in one commit: {self.rows} rollouts, columns added: "
            f"{', '.join(self.columns_added)} (each row one model turn); store version "
            f"{self.store_version_before} -> {self.store_version_after}"
        )


def _v2_columns(schema: pa.Schema):
    """The UDF that writes the v2 columns of a batch of v1 rows (it reads
    ``num_completion_tokens``)."""
    out = pa.schema([schema.field(name) for name in V2_COLUMNS])

    def udf(batch: pa.RecordBatch) -> pa.RecordBatch:
        n = batch.num_rows
        values = {
            "loss_mask": pa.nulls(n, out.field("loss_mask").type),  # null: all ones
            "turns": pa.nulls(n, out.field("turns").type),
            "num_turns": pa.array(np.ones(n, np.int32)),
            "num_model_tokens": batch["num_completion_tokens"].cast(pa.int32()),
            "num_tool_calls": pa.array(np.zeros(n, np.int32)),
            "tools": pa.array([[]] * n, out.field("tools").type),
        }
        return pa.RecordBatch.from_arrays([values[name] for name in V2_COLUMNS], schema=out)

    return udf


def _commit(uri: str, fragments: list, schema: pa.Schema, read_version: int, storage_options):
    with warnings.catch_warnings():  # a pyarrow schema keeps our schema metadata in one commit
        warnings.simplefilter("ignore", DeprecationWarning)
        op = lance.LanceOperation.Merge(fragments, schema)
    return lance.LanceDataset.commit(
        uri, op, read_version=read_version, storage_options=storage_options
    )


def _discard_new_files(uri: str, before: dict[int, set[str]], fragments: list) -> None:
    """Remove the data files the merge wrote (never the fragments' existing ones)."""
    if not is_local(uri):
        return
    data = os.path.join(uri.removeprefix("file://"), "data")
    for frag in fragments:
        for f in frag.files:
            if f.path not in before.get(frag.id, set()):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(data, f.path))


def migrate(store: RolloutLog) -> MigrateResult:
    """Upgrade ``store`` (opened writable) to the current schema; see the module docstring."""
    store.check_writable()
    return retry_conflicts("migration", store.uri, lambda: _migrate_once(store, store.dataset()))


def _migrate_once(store: RolloutLog, ds: lance.LanceDataset) -> MigrateResult:
    """One try at migrating ``ds`` (the store's latest version); raises Lance's commit conflict
    when an append committed since it was read (its new files removed)."""
    version = stored_version(ds.schema)
    rows = ds.count_rows()
    if version == S.SCHEMA_VERSION:
        return MigrateResult(store.uri, version, version, rows, ds.version, ds.version)
    if version != 1:  # read_metadata refuses newer versions already
        raise SchemaError(f"cannot migrate rollout schema v{version} to v{S.SCHEMA_VERSION}")
    target = S.rollout_schema(store.embedding_dim)
    if META_PRECISION in (ds.schema.metadata or {}):  # keep an opt-in log-prob bound
        target = target.with_metadata(
            {**target.metadata, META_PRECISION: ds.schema.metadata[META_PRECISION]}
        )
    if ds.schema.names != [n for n in target.names if n not in V2_COLUMNS]:
        raise SchemaError(
            f"store {store.uri!r} has columns {ds.schema.names}, expected those of rollout "
            "schema v1; it cannot be migrated automatically"
        )
    uri = join(store.uri, ROLLOUTS)
    udf = _v2_columns(target)
    before = {f.fragment_id: {d.path for d in f.metadata.files} for f in ds.get_fragments()}
    fragments: list = []
    try:
        for frag in ds.get_fragments():
            meta, _ = frag.merge_columns(udf, columns=["num_completion_tokens"])
            fragments.append(meta)
        new = _commit(uri, fragments, target, ds.version, store.storage_options)
    except BaseException:
        _discard_new_files(uri, before, fragments)
        raise
    store._ds_cache = None
    return MigrateResult(
        store.uri, version, S.SCHEMA_VERSION, rows, ds.version, new.version, V2_COLUMNS
    )
