"""Turn user input into a rollout-schema Arrow table, or refuse it naming the row and field.

``prepare(data, schema)`` accepts a ``pyarrow.Table``/``RecordBatch`` or a list of
dicts, fills the store's defaults (rollout ids, prompt ids, token counts,
created_at) and checks the row invariants (docs/architecture.md). Every check is vectorised
over the batch; only the error path walks rows to find the first bad one. The multi-turn
columns (schema v2: loss mask, turns, their derived counts) are checked and derived by
:mod:`rolloutstore.validate_turns`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rolloutstore.errors import ValidationError
from rolloutstore.schema.ids import prompt_ids_hash, uuid7_strings
from rolloutstore.schema.turns import _first, prepare_turns

DERIVED = ("num_prompt_tokens", "num_completion_tokens")
JSON_FIELDS = ("reward_info", "metadata")


def _to_array(values: list, name: str, type_: pa.DataType) -> pa.Array:
    """A Python column as ``type_``: Arrow infers the values' own type first, then a
    strict cast (:func:`_cast`) refuses truncation and kind changes, naming the row."""
    try:
        arr = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        for i, v in enumerate(values):
            try:
                pa.array([v])
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
                raise ValidationError(
                    f"expected {type_}, found {type(v).__name__} {_short(v)}", row=i, field=name
                ) from exc
        # Each value converts alone but not together: mixed kinds in one column.
        _find_bad_row(values, name, type_)
        raise ValidationError(f"expected {type_}, found mixed types: {exc}", field=name) from exc
    return _cast(arr, name, type_, values)


def _find_bad_row(values: list, name: str, type_: pa.DataType) -> None:
    for i, v in enumerate(values):
        try:
            _cast(pa.array([v]), name, type_, [v])
        except ValidationError as exc:
            raise ValidationError(exc.reason, row=i, field=name) from None
    first = next((type(v).__name__ for v in values if v is not None), "nothing")
    for i, v in enumerate(values):
        if type(v).__name__ != first and v is not None:
            raise ValidationError(
                f"expected {type_}, found {type(v).__name__} {_short(v)} in a column of {first}",
                row=i,
                field=name,
            )


def _leaf(t: pa.DataType) -> pa.DataType:
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    return t


def _compatible(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether values of ``src`` may become ``dst`` at all (a strict cast then checks values).

    Integers accept floats only when exactly integral (2.0 -> 2; 1.5 refused by the safe
    cast); booleans are never numbers; a string is never a list; timestamps accept
    ISO-8601 strings (JSON carries them so).
    """
    if pa.types.is_null(src) or src == dst:
        return True
    listy = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    if any(f(dst) for f in listy):
        return any(f(src) for f in listy) and _compatible(src.value_type, dst.value_type)
    if pa.types.is_integer(dst) or pa.types.is_floating(dst):
        return pa.types.is_integer(src) or pa.types.is_floating(src)
    if pa.types.is_string(dst) or pa.types.is_large_string(dst):
        return pa.types.is_string(src) or pa.types.is_large_string(src)
    if pa.types.is_timestamp(dst):
        return pa.types.is_timestamp(src) or pa.types.is_string(src)
    if pa.types.is_struct(dst):
        # A struct (e.g. a turn) takes a struct of some of its fields, never unknown ones.
        if not pa.types.is_struct(src):
            return False
        names = {dst.field(i).name: dst.field(i).type for i in range(dst.num_fields)}
        return all(
            f.name in names and _compatible(f.type, names[f.name])
            for f in (src.field(i) for i in range(src.num_fields))
        )
    return False


def _cast(
    col: pa.ChunkedArray | pa.Array, name: str, type_: pa.DataType, values: list | None = None
) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if col.type == type_:
        return col
    if not _compatible(col.type, type_):
        valid = np.flatnonzero(~col.is_null().to_numpy(zero_copy_only=False))
        row = int(valid[0]) if valid.size else 0
        v = values[row] if values is not None else col[row].as_py()
        shown = type(v).__name__ if values is not None else str(col.type)
        raise ValidationError(f"expected {type_}, found {shown} {_short(v)}", row=row, field=name)
    # Int -> float may lose precision but never truncates; every other cast is checked.
    safe = not pa.types.is_floating(_leaf(type_))
    try:
        return col.cast(type_, safe=safe)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        for i in range(len(col)):
            try:
                col.take([i]).cast(type_, safe=safe)  # take: a slice keeps all values
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as one:
                v = values[i] if values is not None else col[i].as_py()
                raise ValidationError(
                    f"expected {type_}, found {_short(v)} ({_reason(one)})", row=i, field=name
                ) from exc
        raise ValidationError(f"expected {type_}, found {col.type}", field=name) from exc


def _reason(exc: Exception) -> str:
    return str(exc).splitlines()[0][:120]


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _columns_from_rows(rows: Sequence[Mapping], schema: pa.Schema) -> dict[str, pa.Array]:
    names = set(schema.names)
    present: dict[str, None] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValidationError(f"expected a dict, found {type(row).__name__}", row=i)
        for key in row:
            if key not in names:
                raise ValidationError(_unknown(key, schema), row=i, field=key)
            present.setdefault(key)
    return {k: _to_array([r.get(k) for r in rows], k, schema.field(k).type) for k in present}


def _unknown(key: str, schema: pa.Schema) -> str:
    version = (schema.metadata or {}).get(b"rolloutstore.schema_version", b"?").decode()
    return (
        f"unknown field (not in rollout schema v{version}; known fields: {', '.join(schema.names)})"
    )


def to_table(data, schema: pa.Schema) -> pa.Table:
    """Convert supported inputs to an Arrow table of schema-typed columns (not yet validated)."""
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if isinstance(data, pa.Table):
        cols = {}
        for name in data.column_names:
            if name not in schema.names:
                raise ValidationError(_unknown(name, schema), field=name)
            cols[name] = _cast(data[name], name, schema.field(name).type)
        n = data.num_rows
    elif isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        cols = _columns_from_rows(data, schema)
        n = len(data)
    else:
        raise TypeError(
            f"append() takes a pyarrow.Table, a list of dicts or an iterable of record "
            f"batches, got {type(data).__name__}"
        )
    return pa.table(cols) if cols else pa.table({"_n": pa.nulls(n)}).drop(["_n"])


def _fill(col: pa.Array | None, n: int, make) -> pa.Array:
    """Fill a column's missing values from ``make(k) -> list`` (or create it)."""
    if col is None:
        return make(n)
    nulls = col.is_null().to_numpy(zero_copy_only=False)
    if not nulls.any():
        return col
    values = col.to_pylist()
    fresh = iter(make(int(nulls.sum())).to_pylist())
    return pa.array([next(fresh) if m else v for v, m in zip(values, nulls)], type=col.type)


def _list_lengths(col: pa.Array) -> np.ndarray:
    return pc.list_value_length(col).to_numpy(zero_copy_only=False)


def _check_required(table: pa.Table, schema: pa.Schema) -> None:
    for field in schema:
        if field.nullable:
            continue
        if field.name not in table.column_names:
            raise ValidationError("required field is missing", row=0, field=field.name)
        row = _first(table[field.name].is_null().to_numpy(zero_copy_only=False))
        if row is not None:
            raise ValidationError("required field is null", row=row, field=field.name)


def _check_values(col: pa.Array, name: str, bad_values, what: str) -> None:
    """Raise naming the row of the first list element for which ``bad_values(np) -> mask``."""
    flat = pc.list_flatten(col)
    if flat.null_count:
        mask = flat.is_null().to_numpy(zero_copy_only=False)
        what = "null element in list"
    else:
        mask = bad_values(flat.to_numpy(zero_copy_only=False))
    pos = _first(mask)
    if pos is not None:
        row = int(pc.list_parent_indices(col)[pos].as_py())
        value = flat[pos].as_py()
        raise ValidationError(f"{what}; found {value!r} at position {pos}", row=row, field=name)


def _check_lengths(cols: dict[str, pa.Array]) -> np.ndarray:
    """One log-prob per completion token, >= 1 prompt and completion token; returns the
    completion lengths."""
    comp = _list_lengths(cols["completion_ids"])
    lp = _list_lengths(cols["behavior_logprobs"])
    row = _first(comp != lp)
    if row is not None:
        raise ValidationError(
            f"expected one log-prob per completion token: {comp[row]} completion_ids but "
            f"{lp[row]} behavior_logprobs",
            row=row,
            field="behavior_logprobs",
        )
    for name in ("prompt_ids", "completion_ids"):
        # Schema rule (see rollout.v2.json): a trainable row has >= 1 prompt token (the
        # first completion token is scored from the last prompt position) and >= 1
        # completion token. A generation that produced nothing has nothing to train on.
        row = _first(_list_lengths(cols[name]) == 0)
        if row is not None:
            raise ValidationError(
                "expected at least one token, found an empty list; drop rows whose "
                "generation produced no tokens before appending",
                row=row,
                field=name,
            )
    return comp.astype(np.int64)


def _check_invariants(t: pa.Table, unique_ids: bool) -> None:
    for name in ("prompt_ids", "completion_ids"):
        _check_values(t[name], name, lambda v: v < 0, "token ids must be non-negative")
    # behavior_logprobs values (against the loss mask) were checked by prepare_turns.
    for name in ("reward", "advantage", "temperature", "top_p"):
        if name in t.column_names:
            v = t[name].to_numpy(zero_copy_only=False).astype(np.float64)
            valid = ~t[name].is_null().to_numpy(zero_copy_only=False)
            row = _first(valid & ~np.isfinite(np.where(valid, v, 0.0)))
            if row is not None:
                raise ValidationError(
                    f"must be finite or null, found {v[row]}", row=row, field=name
                )
    if "embedding" in t.column_names:
        emb = t["embedding"]
        _check_values(emb, "embedding", lambda v: ~np.isfinite(v), "embedding must be finite")
    if "sample_index" in t.column_names:
        row = _first(t["sample_index"].to_numpy(zero_copy_only=False) < 0)
        if row is not None:
            raise ValidationError("must be >= 0", row=row, field="sample_index")
    ids = t["rollout_id"]
    if unique_ids and pc.count_distinct(ids).as_py() != len(ids):
        counts = pc.value_counts(ids)
        dup = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"].as_py()
        row = ids.to_pylist().index(dup)
        raise ValidationError(f"duplicate rollout_id {dup!r} in batch", row=row, field="rollout_id")
    for name in JSON_FIELDS:
        if name in t.column_names and t[name].null_count < len(t):
            for i, s in enumerate(t[name].to_pylist()):
                if s is None:
                    continue
                try:
                    json.loads(s)
                except ValueError as exc:
                    raise ValidationError(
                        f"expected a JSON string: {exc}", row=i, field=name
                    ) from exc
                except RecursionError:
                    raise ValidationError(
                        "expected a JSON string nested at most a few hundred levels deep, "
                        "found one too deep to read",
                        row=i,
                        field=name,
                    ) from None


def prepare(
    data, schema: pa.Schema, *, now: datetime | None = None, unique_ids: bool = True
) -> pa.Table:
    """Validate ``data`` and return it as a table of exactly ``schema`` with defaults filled.

    ``unique_ids=False`` leaves repeated rollout ids to the caller (the store checks them
    across chunks and against stored rows).
    """
    t = to_table(data, schema)
    n = t.num_rows
    cols = {name: t[name].combine_chunks() for name in t.column_names}
    for name in ("prompt_ids", "completion_ids", "behavior_logprobs", "policy_version"):
        if name not in cols:
            raise ValidationError("required field is missing", row=0, field=name)
        row = _first(cols[name].is_null().to_numpy(zero_copy_only=False))
        if row is not None:
            raise ValidationError("required field is null", row=row, field=name)
    stamp = now or datetime.now(UTC)
    ts = schema.field("created_at").type
    cols["rollout_id"] = _fill(cols.get("rollout_id"), n, lambda k: pa.array(uuid7_strings(k)))
    cols["group_id"] = _fill(cols.get("group_id"), n, lambda k: pa.array(uuid7_strings(k)))
    cols["run_id"] = _fill(cols.get("run_id"), n, lambda k: pa.array(["default"] * k))
    cols["sample_index"] = _fill(
        cols.get("sample_index"), n, lambda k: pa.array(np.zeros(k, np.int32))
    )
    cols["created_at"] = _fill(cols.get("created_at"), n, lambda k: pa.array([stamp] * k, ts))
    given_pid = cols.get("prompt_id")
    if given_pid is None or given_pid.null_count:
        hashes = pa.array(prompt_ids_hash(cols["prompt_ids"]))
        cols["prompt_id"] = hashes if given_pid is None else pc.coalesce(given_pid, hashes)
    for name, src in zip(DERIVED, ("prompt_ids", "completion_ids")):
        derived = pa.array(_list_lengths(cols[src]).astype(np.int32))
        given = cols.get(name)
        if given is not None:
            g = given.to_numpy(zero_copy_only=False)
            row = _first(~given.is_null().to_numpy(zero_copy_only=False) & (g != derived))
            if row is not None:
                raise ValidationError(
                    f"expected len({src}) = {derived[row]}, found {g[row]}", row=row, field=name
                )
        cols[name] = derived
    prepare_turns(cols, _check_lengths(cols))  # columns a v1 schema lacks are left out below
    arrays = [cols[f.name] if f.name in cols else pa.nulls(n, type=f.type) for f in schema]
    table = pa.Table.from_arrays(arrays, schema=schema.remove_metadata())
    _check_required(table, schema)
    _check_invariants(table, unique_ids)
    return table.replace_schema_metadata(schema.metadata)


def chunks(data) -> Iterable:
    """``append``'s input as an iterable of tables, record batches or lists of row dicts."""
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
