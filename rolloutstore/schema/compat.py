"""How stored rows are read in the current schema (v2), whatever version wrote the store.

Two things differ between what is on disk and what every read (SQL, the selector's scans,
the loader's token reads, ``take``, exports) shows:

- an all-ones ``loss_mask`` is stored as null (Lance stores a constant list at ~2 bytes per
  token, a null row at almost nothing) and read as the ones;
- a schema-v1 store (written before multi-turn trajectories) has no multi-turn columns,
  and its rows read as what they are in v2 terms, one model turn over the completion:

    loss_mask         all ones (one per completion token)
    turns             null (one assistant turn [0, num_completion_tokens))
    num_turns         1
    num_model_tokens  num_completion_tokens
    num_tool_calls    0
    tools             []

so that SQL (the ``rollouts`` view over the stored dataset, registered as
``rollouts_stored``), the selector's scans, the loader's token reads and exports see one
schema whatever the version. Appends to a v1 store take rows that are single-turn in this sense (validated as
v2 first) and write them without the v2 columns; a row that needs them is refused, naming
``rolloutstore migrate STORE`` (:mod:`rolloutstore.store.migrate`), which upgrades the store in
one commit.
"""

from __future__ import annotations

from collections.abc import Sequence

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rolloutstore.errors import RolloutStoreError, SchemaError, SchemaVersionError, ValidationError
from rolloutstore.schema import spec as S

# The columns v2 adds (at the end of the schema, in this order).
V2_COLUMNS = ("loss_mask", "turns", "num_turns", "num_model_tokens", "num_tool_calls", "tools")
# What a v1 read needs in order to present each v2 column (None: nothing).
_SOURCES = {"loss_mask": "num_completion_tokens", "num_model_tokens": "num_completion_tokens"}

# The `rollouts` view over the stored dataset (registered as `rollouts_stored`), by the
# store's schema version: the same columns, in the same order, for every version.
_ONES = "list_resize([]::TINYINT[], num_completion_tokens, 1::TINYINT)"
ROLLOUTS_VIEW = {
    2: f"""
CREATE VIEW rollouts AS
SELECT * REPLACE (coalesce(loss_mask, {_ONES}) AS loss_mask)
FROM rollouts_stored
""",
    1: f"""
CREATE VIEW rollouts AS
SELECT *,
       {_ONES} AS loss_mask,
       NULL::STRUCT(role VARCHAR, start INTEGER, "end" INTEGER, tool_name VARCHAR)[] AS turns,
       1::INTEGER AS num_turns,
       num_completion_tokens AS num_model_tokens,
       0::INTEGER AS num_tool_calls,
       []::VARCHAR[] AS tools
FROM rollouts_stored
""",
}


def stored_version(schema: pa.Schema) -> int:
    """The schema version a Lance dataset's schema records (checked: one this code reads)."""
    return S.read_metadata(schema)[0]


def read_columns(columns: Sequence[str] | None, stored: pa.Schema) -> list[str] | None:
    """The stored columns to read in order to present ``columns`` (None: all)."""
    if columns is None:
        return None
    need = [c for c in columns if c in stored.names or c not in V2_COLUMNS]
    for c in columns:
        src = _SOURCES.get(c)
        if src is not None and src not in need:
            need.append(src)  # also for a v2 loss_mask: its null rows are filled from it
    return need


def _ones(t: pa.Table, type_: pa.DataType, given: pa.Array | None = None) -> pa.Array:
    """Each row's loss mask: ``given`` where not null, else one 1 per completion token."""
    lengths = t["num_completion_tokens"].to_numpy().astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.ones(int(offsets[-1]), np.int8)
    if given is not None and given.null_count < len(given):
        flat = pc.list_flatten(given).to_numpy(zero_copy_only=False)
        rows = pc.list_parent_indices(given).to_numpy(zero_copy_only=False)
        first = np.r_[0, np.flatnonzero(np.diff(rows)) + 1]  # each given row's first value
        within = np.arange(len(rows)) - np.repeat(first, np.diff(np.r_[first, len(rows)]))
        values[offsets[rows] + within] = flat
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(values, type_.value_type), type_
    )


def _filled(name: str, t: pa.Table, type_: pa.DataType) -> pa.Array:
    n = t.num_rows
    if name == "loss_mask":
        return _ones(t, type_)
    if name == "num_model_tokens":
        return t["num_completion_tokens"].combine_chunks()
    if name == "turns":
        return pa.nulls(n, type_)
    if name == "tools":
        return pa.array([[]] * n, type_)
    value = 1 if name == "num_turns" else 0
    return pa.array(np.full(n, value, np.int32))


def present(table: pa.Table, columns: Sequence[str] | None, schema: pa.Schema) -> pa.Table:
    """``table`` (read from the store) in the current ``schema``: a stored null loss mask
    as its ones, and the v2 ``columns`` a v1 store lacks filled as one model turn. Columns
    outside the schema (``_rowaddr``) are kept, helper columns read only to fill others
    are dropped."""
    wanted = list(columns) if columns is not None else list(schema.names)
    for name in wanted:
        if name in V2_COLUMNS and name not in table.column_names:
            arr = _filled(name, table, schema.field(name).type)
            table = table.append_column(schema.field(name), arr)
        elif name == "loss_mask" and table["loss_mask"].null_count:
            given = table["loss_mask"].combine_chunks()
            i = table.column_names.index("loss_mask")
            table = table.set_column(i, schema.field(name), _ones(table, given.type, given))
    extra = [c for c in table.column_names if c not in schema.names and c not in wanted]
    return table.select(wanted + extra)


def take(
    ds: lance.LanceDataset, schema: pa.Schema, row_ids, columns: Sequence[str] | None
) -> pa.Table:
    """Rows of ``ds`` by position, as every read shows them (``schema``: the current one)."""
    ids = np.asarray(row_ids, dtype=np.int64)
    return present(ds.take(ids, columns=read_columns(columns, ds.schema)), columns, schema)


def take_rows(
    ds: lance.LanceDataset, schema: pa.Schema, row_addresses, columns: Sequence[str] | None
) -> pa.Table:
    """Rows of ``ds`` by Lance row address, in the order given, as every read shows them."""
    addr = np.asarray(row_addresses, dtype=np.uint64)
    if addr.size == 0:
        return schema.empty_table().select(list(columns or schema.names))
    uniq, inverse = np.unique(addr, return_inverse=True)
    # Lance reads sorted addresses fastest; restore the caller's order (and repeats) after,
    # unless they came sorted and unique (a loader's cache fill): then no copy is needed.
    table = present(
        ds._take_rows(uniq.tolist(), columns=read_columns(columns, ds.schema)), columns, schema
    )
    if len(uniq) == len(addr) and np.array_equal(uniq, addr):
        return table
    return table.take(pa.array(inverse.astype(np.int64)))


def to_stored(table: pa.Table, version: int, embedding_dim: int, uri: str) -> pa.Table:
    """A prepared (v2) table as rows of a store of schema ``version``: unchanged for v2; for
    v1, refused when a row needs the v2 columns (a 0 in its loss mask, several turns),
    else without them."""
    if version >= S.SCHEMA_VERSION:
        return table
    several = pc.not_equal(table["num_turns"], 1).to_numpy(zero_copy_only=False)
    masked = pc.not_equal(table["num_model_tokens"], table["num_completion_tokens"])
    masked = masked.to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(several | masked)
    if bad.size:
        row = int(bad[0])
        what = (
            f"{table['num_turns'][row].as_py()} turns"
            if several[row]
            else "loss_mask 0 on some tokens (tool / environment tokens)"
        )
        raise ValidationError(
            f"this row is a multi-turn trajectory ({what}), which needs rollout schema v2, but "
            f"store {uri!r} is schema v{version}; upgrade the store with "
            f"`rolloutstore migrate {uri}` (one atomic commit; its rows read as before), "
            "then append again",
            row=row,
            field="turns" if several[row] else "loss_mask",
        )
    stored = S.rollout_schema(embedding_dim, version)
    return table.select(stored.names).cast(stored)


def check_columns(found: pa.Schema, version: int, embedding_dim: int, uri: str) -> None:
    """Refuse to append to a dataset whose columns are not those of its schema ``version``
    (a column added, dropped or retyped outside rolloutstore): Lance would refuse the
    fragments with a raw error after they were written."""
    expected = S.rollout_schema(embedding_dim, version)
    if [(f.name, f.type) for f in found] == [(f.name, f.type) for f in expected]:
        return
    extra = [n for n in found.names if n not in expected.names]
    missing = [n for n in expected.names if n not in found.names]
    retyped = [
        n
        for n in found.names
        if n in expected.names and found.field(n).type != expected.field(n).type
    ]
    diff = (
        "; ".join(
            f"{what} {names}"
            for what, names in (("extra", extra), ("missing", missing), ("retyped", retyped))
            if names
        )
        or "the columns in another order"
    )
    raise SchemaError(
        f"store {uri!r}: expected the columns of rollout schema v{version}, found {diff}; it "
        "was changed outside rolloutstore, so appends are refused (nothing was written); "
        "drop what was added with Lance (`LanceDataset.drop_columns`) or restore the store from a copy"
    )


def refuse_if_migrated(open_latest, version: int, exc: BaseException) -> None:
    """After a failed append: raise a clear error if the store was migrated to another schema
    version since the append read it (Lance refuses its fragments, or their commit)."""
    if not isinstance(exc, Exception) or isinstance(exc, RolloutStoreError):
        return  # interrupted, or refused for its own reason
    try:
        ds = open_latest()
        now = stored_version(ds.schema)
    except Exception:  # cannot tell: the original error stands
        return
    if now != version:
        raise SchemaVersionError(
            f"store {ds.uri!r} was migrated from rollout schema v{version} to v{now} while "
            "this append was in flight; nothing of it was written: append it again"
        ) from exc
